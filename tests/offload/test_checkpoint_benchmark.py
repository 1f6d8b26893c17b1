"""benchmarks/checkpoint_method.py on the CPU with a tiny FLUX: every arm's code path (lean,
PyTorch's non-reentrant and reentrant checkpoints, none) and the gradient comparison, so the GPU
run does not fail on a typo. The times it prints on the CPU mean nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests._benchmarks import load_benchmark

pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("checkpoint_method")


def test_every_arm_runs_and_the_gradients_are_compared(bench: ModuleType,
                                                       tmp_path: Path) -> None:
    code = bench.main(["--device", "cpu", "--tiny", "--rounds", "1", "--steps-per-arm", "2",
                       "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "checkpoint_method.json").read_text())
    assert set(result["medians_s"]) == {"lean", "pytorch", "reentrant", "none"}
    assert all(m["step"] > 0 for m in result["medians_s"].values())
    # a chain of blocks on the CPU: lean and PyTorch's checkpoint agree bit for bit
    assert result["gradients_identical"] and result["gradient_max_abs_diff"] == 0.0
    assert "| lean |" in (tmp_path / "checkpoint_method.md").read_text()


def test_bad_arguments_are_usage_errors(bench: ModuleType) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--device", "cpu", "--tiny", "--arms", "lean,fast"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--steps-per-arm", "1"])
