"""benchmarks/swap_full_ft.py's planned row on the CPU with a tiny FLUX: vramkit.fit plans full
fine-tuning (trainable="swap") under the cap, trains like the hand-set sweep, and the row says
its plan, prediction and its step against the sweep's best. The times mean nothing here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._benchmarks import BENCHMARKS

pytest.importorskip("diffusers")


def test_the_planned_full_fine_tune_runs_beside_the_sweep(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "swap_full_ft.py"), "--model", "flux", "--device",
         "cpu", "--flux-variants", "planned,swap8", "--cap-gib", "0.03", "--steps", "1",
         "--warmup", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["variant"]: r for r in
               json.loads((tmp_path / "swap_full_ft_flux.json").read_text())["results"]}
    planned, swept = results["planned"], results["swap8"]
    assert "error" not in planned and "error" not in swept, results
    assert planned["plan_swapped"] > 0 and planned["predicted_step_ms"] > 0
    assert "Full fine-tuning with swapped optimizer state" in planned["explain"]
    # the same training, planned or set by hand (both all swapped; the plan checkpoints none,
    # which recomputes the same ops): the loss after the optimizer steps matches bit for bit
    assert planned["optimizer_steps"] == swept["optimizer_steps"] > 0
    assert planned["last_loss"] == swept["last_loss"] != planned["first_loss"]
