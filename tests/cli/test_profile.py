"""`vramkit profile`: in-process runs of Python scripts, child-process runs, reports written."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vramkit.cli import profile as profile_cli
from vramkit.cli.profile import PythonTarget, parse_target
from vramkit.errors import ConfigError
from vramkit.observe import profiler as profiler_mod

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn

    class Wide(nn.Module):
        def forward(self, x):
            # 64 MiB: above glibc's largest mmap threshold (32 MiB), so always fresh pages
            # that the RSS sees (a 32 MiB one could reuse a heap chunk freed by an earlier
            # test in the process, and the module's growth read 0)
            return torch.ones(16 * 2**20) + x.sum()

    model = nn.Sequential(nn.Linear(4, 4), Wide())
    out = model(torch.randn(2, 4))
    print("script args:", sys.argv[1:], "out", tuple(out.shape))
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    """
)


@pytest.fixture(autouse=True)
def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler_mod, "nvml_process_memory", lambda pid=None: None)


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vramkit")
    profile_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", *argv])
    return int(args.func(args))


@pytest.mark.parametrize(("command", "expected"), [
    (["python", "train.py", "--lr", "1"], PythonTarget("script", "train.py", ("--lr", "1"))),
    (["python3", "-u", "train.py"], PythonTarget("script", "train.py", ())),
    (["train.py", "a"], PythonTarget("script", "train.py", ("a",))),
    (["python", "-m", "pkg.mod", "x"], PythonTarget("module", "pkg.mod", ("x",))),
    (["python3.12", "-c", "print(1)"], PythonTarget("code", "print(1)", ())),
    ([sys.executable, "t.py"], PythonTarget("script", "t.py", ())),
    (["torchrun", "--nproc-per-node=2", "train.py"], None),
    (["python", "-X", "dev", "train.py"], None),
    (["python"], None),
    ([], None),
])
def test_parse_target(command: list[str], expected: PythonTarget | None) -> None:
    assert parse_target(command) == expected


def test_in_process_run_writes_reports_and_returns_exit_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "out"
    # --device cpu: the script's activations live on the CPU, also on a GPU machine
    code = _run(["--out", str(out), "--interval", "0.005", "--device", "cpu", "--",
                 "python", str(script), "3"])
    assert code == 3
    for name in ("report.json", "report.html", "report.png"):
        assert (out / name).stat().st_size > 0
    printed = capsys.readouterr().out
    assert "script args: ['3']" in printed
    assert "vramkit memory profile" in printed and "top modules" in printed
    data = json.loads((out / "report.json").read_text())
    modules = {m["name"]: m for m in data["top_modules"]}
    assert modules["1"]["type"] == "Wide" and modules["1"]["activation_bytes"] >= 24 * 2**20
    assert data["num_samples"] >= 1
    assert data["sample_interval"] == 0.005 and data["device"] == "cpu"
    html = (out / "report.html").read_text()
    assert "<svg" in html and "http://" not in html and "https://" not in html
    assert sys.argv[0] != str(script)  # argv restored


def test_json_summary_and_no_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    code = _run(["--out", str(tmp_path / "o"), "--json", "--no-modules", "--", str(script)])
    assert code == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.index("{"):])
    assert "history" not in summary and summary["top_modules"] == []
    assert summary["metric"] in ("host_rss", "allocated")
    assert len(summary["files"]) == 3


def test_script_exception_gives_exit_code_1(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('boom')\n")
    assert _run(["--out", str(tmp_path / "o"), "--", "python", str(script)]) == 1
    assert (tmp_path / "o" / "report.json").exists()


def test_an_interrupted_script_keeps_its_report(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text("import torch\nx = torch.ones(1000)\nraise KeyboardInterrupt\n")
    assert _run(["--out", str(tmp_path / "o"), "--", "python", str(script)]) == 130
    assert json.loads((tmp_path / "o" / "report.json").read_text())["num_samples"] >= 1
    assert "interrupted" in capsys.readouterr().err


def test_python_c_form(tmp_path: Path) -> None:
    assert _run(["--out", str(tmp_path / "o"), "--", "python", "-c",
                 "import sys; sys.exit(5)"]) == 5


def test_subprocess_mode_samples_the_child(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import time\nblob = bytearray(64 * 2**20)\ntime.sleep(0.3)\n"
                      "raise SystemExit(4)\n")
    out = tmp_path / "o"
    code = _run(["--out", str(out), "--interval", "0.02", "--subprocess", "--",
                 sys.executable, str(script)])
    assert code == 4
    data = json.loads((out / "report.json").read_text())
    assert data["metric"] == "host_rss" and data["num_samples"] >= 3
    assert data["sample_interval"] == 0.02
    assert data["peak_host_rss"]["value"] >= 64 * 2**20  # the child's memory, not ours + 0


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        _run(["--out", str(tmp_path), "--"])
    with pytest.raises(ConfigError):
        _run(["--out", str(tmp_path), "--", "python", str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError):
        _run(["--out", str(tmp_path), "--interval", "0", "--", "python", "x.py"])


def test_subprocess_device_labels_the_report(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # pretend cuda:3 exists: from outside the child only the label can follow --device
    monkeypatch.setattr(profiler_mod, "resolve_cuda_index",
                        lambda device=None: 3 if device == "cuda:3" else None)
    out = tmp_path / "o"
    assert _run(["--out", str(out), "--device", "cuda:3", "--subprocess", "--",
                 sys.executable, "-c", "pass"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["device"] == "cuda:3" and data["metric"] == "host_rss"


def test_bad_device_starts_no_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[object] = []
    monkeypatch.setattr(profile_cli.subprocess, "Popen",
                        lambda *a, **k: started.append(a))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        _run(["--out", str(tmp_path), "--device", "mps", "--subprocess", "--",
              sys.executable, "-c", "pass"])
    assert started == []


def test_child_is_killed_when_profiling_fails(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    children: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        children.append(real_popen(*args, **kwargs))
        return children[-1]

    def refuse(self: Any) -> None:
        raise RuntimeError("sampler failed to start")

    monkeypatch.setattr(profile_cli.subprocess, "Popen", popen)
    monkeypatch.setattr(profiler_mod.MemoryProfiler, "start", refuse)
    with pytest.raises(RuntimeError):
        _run(["--out", str(tmp_path), "--subprocess", "--",
              sys.executable, "-c", "import time; time.sleep(60)"])
    assert len(children) == 1 and children[0].returncode is not None  # killed and waited


# -- through the `vramkit` entry point: errors, --json, child processes, steps, traces ---------

_MARKER_SCRIPT = textwrap.dedent(
    """
    import pathlib, sys
    pathlib.Path(sys.argv[1]).write_text("ran")
    """
)

_TRAINING_SCRIPT = textwrap.dedent(
    """
    import torch
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(6):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    """
)


def _main(argv: list[str]) -> int:
    from vramkit.cli.main import main

    return main(["profile", *argv])


def _marker_script(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "marker.py"
    script.write_text(_MARKER_SCRIPT)
    return script, tmp_path / "ran.txt"


def test_json_prints_only_json_on_stdout(tmp_path: Path,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "noisy.py"
    script.write_text("import os, sys\nprint('from print')\nsys.stdout.flush()\n"
                      "os.write(1, b'from fd 1\\n')\n")
    assert _main(["--json", "--out", str(tmp_path / "o"), "--", "python", str(script)]) == 0
    out, err = capfd.readouterr()
    data = json.loads(out)  # exactly one JSON document, nothing else
    assert data["mode"] == "in-process" and len(data["files"]) == 3
    assert "from print" in err and "from fd 1" in err


def test_json_child_output_goes_to_stderr(tmp_path: Path) -> None:
    from tests.cli._helpers import run_vramkit

    proc = run_vramkit("profile", "--json", "--out", str(tmp_path / "o"), "--subprocess", "--",
                       sys.executable, "-c", "print('child says hi')", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["mode"] == "child process"
    assert "child says hi" in proc.stderr


def test_child_process_figures_are_not_applicable(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    argv = ["--out", str(out), "--subprocess", "--", sys.executable, "-c",
            "import time; time.sleep(0.1)"]
    assert _main(["--json", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated", "peak_reserved", "mean_allocated", "num_allocations"):
        assert data[key] is None, key
    assert data["top_modules"] is None and data["leak"] is None
    assert data["peak_pinned"] is None and data["steps"] is None
    assert data["peak_host_rss"]["value"] > 0  # what can be measured is

    assert _main(argv) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in capsys.readouterr().out.splitlines() if line.count("│") >= 3}
    for label in ("peak allocated", "peak reserved", "mean allocated", "allocations", "leak",
                  "peak pinned pools", "per-module attribution"):
        assert rows[label].startswith("n/a"), (label, rows[label])
    assert not any(value.startswith("0 B") for value in rows.values()), rows


def test_cpu_allocator_figures_are_not_applicable(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    script, _ = _marker_script(tmp_path)
    assert _main(["--json", "--device", "cpu", "--out", str(tmp_path / "o"), "--", "python",
                  str(script), str(tmp_path / "m")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metric"] == "host_rss"
    assert data["peak_allocated"] is None and data["mean_allocated"] is None
    assert data["top_modules"] == []  # in-process: attribution ran (nothing to attribute)


def test_interpreter_path_is_used_as_given(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`-- /path/to/python3 train.py` runs that interpreter, not vramkit's own."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    used = tmp_path / "interpreter-used.txt"
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$0" > "{used}"\nexec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    script, ran = _marker_script(tmp_path)
    out = tmp_path / "o"
    assert _main(["--json", "--out", str(out), "--", str(fake), str(script), str(ran)]) == 0
    captured = capsys.readouterr()
    assert used.read_text().strip() == str(fake) and ran.read_text() == "ran"
    assert json.loads(captured.out)["mode"] == "child process"
    assert "not the interpreter vramkit runs in" in captured.err


@pytest.mark.parametrize("word", [sys.executable, "python", "python3"])
def test_this_interpreter_runs_in_process(word: str) -> None:
    assert profile_cli.runs_this_interpreter(word)


def test_other_interpreter_paths_are_not_this_one(tmp_path: Path) -> None:
    assert not profile_cli.runs_this_interpreter(str(tmp_path / "bin" / "python3"))
    link = tmp_path / "python3"  # a venv-style link to this interpreter, in another directory
    link.symlink_to(sys.executable)
    assert not profile_cli.runs_this_interpreter(str(link))


def test_optimizer_steps_are_counted_without_prof_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAINING_SCRIPT)
    out = tmp_path / "o"
    assert _run(["--out", str(out), "--device", "cpu", "--", "python", str(script)]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["steps"] == 6
    assert data["leak"] is not None and data["leak"]["steps"] >= 5  # the leak check ran


@pytest.mark.parametrize("device", [["--device", "cpu"], []])
def test_trace_without_cuda_exits_2_before_the_script(device: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from tests.cli._helpers import check_error

    if not device and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the trace is possible")
    script, ran = _marker_script(tmp_path)
    code = _main(["--trace", str(tmp_path / "t.pickle"), *device, "--out", str(tmp_path / "o"),
                  "--", "python", str(script), str(ran)])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="profile", exit_code=2, says=("--trace needs CUDA",))
    assert not ran.exists() and not (tmp_path / "o").exists()


def test_trace_of_a_child_process_exits_2(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    script, ran = _marker_script(tmp_path)
    code = _main(["--json", "--trace", str(tmp_path / "t.pickle"), "--subprocess",
                  "--out", str(tmp_path / "o"), "--", sys.executable, str(script), str(ran)])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="profile", exit_code=2, as_json=True,
                says=("--trace", "child process"))
    assert not ran.exists()


@pytest.mark.gpu
def test_trace_writes_a_memory_viz_snapshot(tmp_path: Path) -> None:
    import pickle

    script = tmp_path / "cuda_work.py"
    script.write_text("import torch\nx = torch.randn(1024, 1024, device='cuda')\n"
                      "y = (x @ x).sum()\nprint(float(y))\n")
    trace = tmp_path / "trace.pickle"
    out = tmp_path / "o"
    assert _main(["--trace", str(trace), "--out", str(out), "--", "python", str(script)]) == 0
    with open(trace, "rb") as fh:
        snapshot = pickle.load(fh)
    # what pytorch.org/memory_viz reads: segments and per-device allocation traces
    assert "segments" in snapshot and "device_traces" in snapshot
    assert any(event.get("action") == "alloc" for device in snapshot["device_traces"]
               for event in device)


@pytest.mark.parametrize("case", ["out is a file", "report.json is a directory",
                                  "parent is a file", "unwritable"])
def test_unusable_out_dir_exits_2_before_the_script(case: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error
    from vramkit.cli import _output

    out = tmp_path / "o"
    if case == "out is a file":
        out.write_text("")
    elif case == "report.json is a directory":
        (out / "report.json").mkdir(parents=True)
    elif case == "parent is a file":
        (tmp_path / "f").write_text("")
        out = tmp_path / "f" / "o"
    else:
        def refuse(directory: Path) -> None:
            raise PermissionError(13, "Permission denied", str(directory))

        monkeypatch.setattr(_output, "_probe_directory", refuse)
    script, ran = _marker_script(tmp_path)
    code = _main(["--out", str(out), "--", "python", str(script), str(ran)])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="profile", exit_code=2, says=("--out",))
    assert not ran.exists()


def test_missing_program_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    code = _main(["--json", "--out", str(tmp_path / "o"), "--", "no-such-program-vramkit"])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="profile", exit_code=2, as_json=True,
                says=("command not found: no-such-program-vramkit",))


def test_png_is_skipped_before_the_run_without_matplotlib(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint('script ran', file=sys.stderr)\n")
    out = tmp_path / "o"
    assert _main(["--json", "--out", str(out), "--", "python", str(script)]) == 0
    captured = capsys.readouterr()
    assert [Path(f).name for f in json.loads(captured.out)["files"]] == ["report.json",
                                                                         "report.html"]
    note = captured.err.index("pip install matplotlib")
    assert note < captured.err.index("script ran")  # told before the run, not after
    assert not (out / "report.png").exists()


def test_bad_interval_names_the_flag_and_exits_2(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    code = _main(["--interval", "0", "--", "python", "x.py"])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="profile", exit_code=2, says=("--interval",),
                not_says=("sample_interval",))


def test_missing_module_exits_2_without_a_traceback(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    code = _main(["--out", str(tmp_path / "o"), "--", "python", "-m", "no_such_module_vramkit"])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="profile", exit_code=2,
                says=("module not found: no_such_module_vramkit",))
    assert not (tmp_path / "o").exists()


def test_module_in_the_current_directory_is_found(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "local_mod_vramkit.py").write_text("import sys\nsys.exit(7)\n")
    monkeypatch.chdir(tmp_path)
    assert _main(["--out", str(tmp_path / "o"), "--", "python", "-m", "local_mod_vramkit"]) == 7
