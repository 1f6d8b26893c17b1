"""`vramkit demo`: JSON and table output, argument errors, and a real `python -m vramkit` run."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vramkit.cli.main import main

SRC = Path(__file__).resolve().parents[2] / "src"
FAST = ["--model-size", "tiny", "--steps", "2", "--device", "cpu"]


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", *FAST, "--report", ""]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("plan", "swapped_blocks", "total_blocks", "swapped_bytes", "slot_bytes",
                "checkpointed_blocks", "peak_bytes", "peak_source", "under_budget",
                "median_step_seconds", "baseline_median_step_seconds", "slowdown",
                "loss_first", "loss_last", "report_path", "transfers"):
        assert key in data, key
    plan = data["plan"]
    assert plan["model_name"] == "tiny" and plan["steps"] == 2
    assert data["swapped_blocks"] > 0
    assert data["peak_bytes"] <= plan["budget_bytes"] and data["under_budget"]
    assert math.isfinite(data["loss_first"]) and math.isfinite(data["loss_last"])
    assert len(data["losses"]) == 2
    assert data["slowdown"] > 0 and data["report_path"] is None


def test_table_output_and_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "demo.html"
    assert main(["demo", *FAST, "--budget", "8MiB", "--no-baseline", "--report",
                 str(report)]) == 0
    out = capsys.readouterr().out
    if torch.cuda.is_available():
        assert "Running on the CPU" in out
    else:
        assert "No GPU found: running the small CPU configuration" in out
    for row in ("swapped", "checkpointed", "peak memory", "step time", "loss", "report"):
        assert row in out
    assert "8.0 MiB budget: under budget" in out
    assert "no baseline: not asked for" in out
    assert report.is_file() and str(report) in out


@pytest.mark.parametrize("argv, message", [
    (["--budget", "lots"], "invalid budget"),
    (["--budget", "0"], "budget must be > 0"),
    (["--model-size", "enormous"], "invalid model size"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "ten"], "--steps must be a whole number"),
    (["--batch-size", "-2"], "--batch-size must be >= 1"),
    (["--report", "demo.txt"], "cannot write a profile report"),
    (["--budget", "1MiB"], "needs at least"),
])
def test_argument_errors(argv: list[str], message: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *FAST, *argv]) == 2  # a flag's value: a usage error
    err = capsys.readouterr().err
    assert "vramkit demo: error:" in err and message in err


def test_python_m_vramkit_demo_runs_without_a_gpu(tmp_path: Path) -> None:
    """The README quickstart command, end to end in a fresh interpreter with CUDA hidden."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.run([sys.executable, "-m", "vramkit", "demo", "--steps", "2", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    plan = data["plan"]
    assert plan["device"] == "cpu" and not plan["gpu_found"] and plan["model_name"] == "small"
    assert plan["model_bytes"] > plan["budget_bytes"]
    assert 0 < data["swapped_blocks"] <= data["total_blocks"]  # the planner's choice
    assert data["checkpointed_blocks"] and data["under_budget"]
    assert data["baseline_max_loss_diff"] == 0.0
    assert (tmp_path / "vramkit-demo-report.html").is_file()
    assert data["report_path"] == "vramkit-demo-report.html"


# -- errors before any work, flags in messages, one step-time statistic -----------------------


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record (and stop) any start of the demo's work: planning or training."""
    from vramkit.errors import DeviceError
    from vramkit.recipes import demo as recipe

    started: list[str] = []

    def refuse(name: str) -> Any:
        def stop(*args: object, **kwargs: object) -> None:
            started.append(name)
            raise DeviceError("work started", hint="(the test stops it here)")

        return stop

    monkeypatch.setattr(recipe, "plan_demo", refuse("plan_demo"))
    monkeypatch.setattr(recipe, "run_demo", refuse("run_demo"))
    yield started


def _unwritable_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple]:
    (tmp_path / "a-dir.html").mkdir()
    (tmp_path / "a-file").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    return {
        "a directory": (tmp_path / "a-dir.html", "is a directory"),
        "a file as parent": (tmp_path / "a-file" / "sub" / "r.html", "is not a directory"),
        "unwritable directory": (locked / "r.html", "cannot write in"),
        "png without matplotlib": (tmp_path / "r.png", "pip install matplotlib"),
    }


@pytest.mark.parametrize("case", ["a directory", "a file as parent", "unwritable directory",
                                  "png without matplotlib"])
@pytest.mark.parametrize("as_json", [False, True])
def test_unusable_report_path_fails_before_any_work(
        case: str, as_json: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], no_work: list[str]) -> None:
    from tests.cli._helpers import check_error
    from vramkit.cli import _output

    path, says = _unwritable_reports(tmp_path, monkeypatch)[case]
    if case == "unwritable directory":  # root writes through chmod: refuse at the probe instead
        def refuse(directory: Path) -> None:
            raise PermissionError(13, "Permission denied", str(directory))

        monkeypatch.setattr(_output, "_probe_directory", refuse)
    if case == "png without matplotlib":
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["demo", *FAST, *(["--json"] if as_json else []), "--report", str(path)])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="demo", exit_code=2, as_json=as_json,
                says=("--report", says))
    assert no_work == []
    assert not path.exists() or path.is_dir()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes through directory permissions")
def test_read_only_directory_fails_before_any_work(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   no_work: list[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["demo", *FAST, "--report", str(locked / "r.html")]) == 2
    finally:
        locked.chmod(0o700)
    assert "cannot write in" in capsys.readouterr().err
    assert no_work == []


def test_missing_report_directories_are_refused(tmp_path: Path, no_work: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # a missing directory is a usage error naming the path, before any work; nothing is made
    path = tmp_path / "new" / "deeper" / "r.html"
    assert main(["demo", *FAST, "--report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--report" in err and str(path) in err and "does not exist" in err
    assert no_work == []
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv", [["--budget", "lots"], ["--steps", "0"],
                                  ["--report", "demo.txt"], ["--model-size", "enormous"]])
def test_flag_errors_exit_2_before_any_work(argv: list[str], no_work: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    code = main(["demo", *FAST, *argv])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="demo", exit_code=2, says=(argv[0],))
    assert no_work == []


def test_demo_config_errors_name_the_flags(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever DemoConfig refuses is told in flags: `--budget`, not `DemoConfig.budget`."""
    from tests.cli._helpers import check_error
    from vramkit.cli import demo as demo_cli

    # let the raw text reach DemoConfig, whose own check then refuses it
    monkeypatch.setattr(demo_cli, "_size", lambda option, what, text, hint="": text)
    monkeypatch.setattr(demo_cli, "_whole_number", lambda option, text: text)
    for argv, flag in ((["--budget", "lots"], "--budget"), (["--steps", "x"], "--steps"),
                       (["--batch-size", "y"], "--batch-size"),
                       (["--model-size", "huge"], "--model-size")):
        code = main(["demo", "--device", "cpu", *argv])
        out, err = capsys.readouterr()
        check_error(code, out, err, sub="demo", exit_code=2, says=(flag,),
                    not_says=("DemoConfig.",))
    code = main(["demo", "--device", "cpu", "--json", "--budget", "lots"])
    out, err = capsys.readouterr()
    text = check_error(code, out, err, sub="demo", exit_code=2, as_json=True,
                       not_says=("DemoConfig.",))
    assert text.startswith("--budget")


def test_progress_bar_shows_the_median_step_time() -> None:
    """The bar shows the median step time with the first step left out, as the summary does,
    not the last step's time."""
    import io

    from rich.console import Console

    from vramkit.cli.demo import STEP_TIME_LABEL, _ProgressBar
    from vramkit.recipes.demo import DemoProgress

    bar = _ProgressBar(Console(file=io.StringIO(), width=200))
    bar.update(DemoProgress("build", 0, 0))
    bar.update(DemoProgress("train", 0, 4))
    seconds = [0.5, 0.010, 0.030, 0.040]
    for step in range(1, 5):
        timed = seconds[1:step] if step >= 2 else seconds[:1]
        bar.update(DemoProgress("train", step, 4, loss=1.0, step_seconds=seconds[step - 1],
                                median_step_seconds=statistics.median(timed)))
    task = bar.progress.tasks[bar.tasks["train"]]
    assert task.fields["step_time"] == "30.0 ms"  # median of 10, 30, 40 ms; not the last 40
    columns = [getattr(c, "text_format", "") for c in bar.progress.columns]
    assert any(STEP_TIME_LABEL in str(c) for c in columns)


def test_progress_bar_and_summary_show_the_same_figure(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from vramkit.cli import demo as demo_cli

    shown: dict[str, str] = {}
    update = demo_cli._ProgressBar.update

    def record(self: Any, event: Any) -> None:
        update(self, event)
        if event.stage in self.tasks:
            shown[event.stage] = self.progress.tasks[self.tasks[event.stage]].fields["step_time"]

    monkeypatch.setattr(demo_cli._ProgressBar, "update", record)
    assert main(["demo", "--model-size", "tiny", "--steps", "4", "--device", "cpu",
                 "--report", ""]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if demo_cli.STEP_TIME_LABEL in line)
    assert shown["train"] != "-" and shown["train"] in row
    assert f"fully resident {shown['baseline']}" in row


@pytest.mark.parametrize("host_bound, measured, said", [
    (("backward",), 0.360, True),  # +20 %: the host-bound phase is named
    ((), 0.360, False),  # bound by the device: nothing to add
    (("backward",), 0.310, False),  # within the planner's 10 %
])
def test_the_summary_names_a_host_bound_phase_when_the_step_is_off(
        host_bound: tuple[str, ...], measured: float, said: bool) -> None:
    import dataclasses

    from rich.console import Console

    from vramkit.cli import demo as demo_cli
    from vramkit.planning import FitReport
    from vramkit.recipes.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(model_size="tiny", steps=2, device="cpu", report=None,
                                 baseline=False))
    assert result.plan.host_bound_phases == ()  # simulated on the CPU: nothing measured
    # as a GPU run reads it: a measured peak, a prediction from measured block times
    prediction = FitReport(steps=2, budget_bytes=result.plan.budget_bytes,
                           predicted_peak_bytes=result.plan.predicted_peak_bytes,
                           measured_peak_bytes=result.peak_bytes, predicted_step_seconds=0.300,
                           measured_step_seconds=measured, host_bound=host_bound)
    shown = dataclasses.replace(result, prediction=prediction, peak_source="measured",
                                median_step_seconds=measured)
    console = Console(record=True, width=400)
    demo_cli._print_result(console, shown)
    row = next(line for line in console.export_text().splitlines()
               if "planner's prediction" in line)
    assert "step 300.0 ms (measured" in row
    assert ("the backward is host-bound" in row) is said


def test_a_model_larger_than_the_host_is_refused_before_it_is_built(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from vramkit.devices import host
    from vramkit.recipes.dit import DiT

    real = host.read_host_memory()
    small = dataclasses.replace(real, available=2 << 30, cgroup_limit=None, cgroup_usage=None)
    monkeypatch.setattr(host, "read_host_memory", lambda: small)
    built: list[object] = []
    monkeypatch.setattr(DiT, "__init__", lambda self, *a, **k: built.append(k) or None)
    code = main(["demo", "--model-size", "1TiB", "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and not built, out
    assert "host memory" in out["error"] and "2.0 GiB" in out["error"]


def test_the_ratio_is_printed_with_the_spread_of_its_rounds(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", *FAST[:-4], "--steps", "3", "--device", "cpu",
                 "--report", ""]) == 0
    data = json.loads(capsys.readouterr().out)
    spread = data["slowdown_spread"]
    assert set(spread) == {"rounds", "low", "q1", "median", "q3", "high", "wide", "rule"}
    assert spread["rounds"] == 2 and spread["wide"] is True  # too few rounds to tell
    assert main(["demo", *FAST[:-4], "--steps", "3", "--device", "cpu", "--report", ""]) == 0
    out = capsys.readouterr().out  # a table: words may wrap onto the cell's next line
    assert all(word in out for word in ("rounds", "middle", "spread"))


def test_compile_flag_reaches_the_demo_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.recipes import demo as recipe

    seen: list[Any] = []

    def record(config: Any = None, **kwargs: object) -> None:
        seen.append(config)
        raise KeyboardInterrupt  # stop before any work; the CLI answers 130

    monkeypatch.setattr(recipe, "plan_demo", record)
    assert main(["demo", *FAST, "--compile", "--report", ""]) == 130
    assert main(["demo", *FAST, "--report", ""]) == 130
    assert [config.compile for config in seen] == [True, False]
