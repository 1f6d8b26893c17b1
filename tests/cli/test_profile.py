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
from vramkit.memory import profiler as profiler_mod

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn

    class Wide(nn.Module):
        def forward(self, x):
            return torch.ones(8 * 2**20) + x.sum()   # a 32 MiB activation

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
