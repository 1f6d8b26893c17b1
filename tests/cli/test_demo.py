"""`vramkit demo`: JSON and table output, argument errors, and a real `python -m vramkit` run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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
    report = tmp_path / "out" / "demo.html"
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
    assert main(["demo", *FAST, *argv]) == 1
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
    assert 0 < data["swapped_blocks"] < data["total_blocks"]
    assert data["checkpointed_blocks"] and data["under_budget"]
    assert data["baseline_max_loss_diff"] == 0.0
    assert (tmp_path / "vramkit-demo-report.html").is_file()
    assert data["report_path"] == "vramkit-demo-report.html"
