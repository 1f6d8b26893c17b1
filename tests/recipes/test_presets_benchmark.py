"""benchmarks/presets.py on the CPU with tiny models: every code path the GPU run takes (meta
build, peft LoRA, block-by-block random weights with quantization, each tier's preset through
its verb, training steps, one subprocess per row, failures recorded as rows), so the GPU run
does not fail on a typo. The numbers it prints on the CPU mean nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from tests._benchmarks import load_benchmark

pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("presets")


@pytest.mark.parametrize(("model", "tier"), [("sdxl", 8), ("sdxl", 12), ("sdxl", 24),
                                             ("flux", 8), ("flux", 24)])
def test_row_trains_with_the_tiers_preset(bench: ModuleType, model: str, tier: int) -> None:
    row = bench.run_row(model, tier, bench.Settings(device="cpu", tiny=True, steps=2))
    assert len(row["loss"]) == 2 and all(math.isfinite(v) for v in row["loss"])
    assert row["estimate_gib"] > 1  # the full model's estimate, printed beside the peak
    assert row["planned_gib"] > 1  # and the tier plan's predicted peak
    applied = row["applied"]
    if model == "flux":
        assert "int8" in applied["quantize_base_model"]
        assert "quantized before kept" in applied["quantize_base_model"]  # built quantized
        assert ("blocks_to_swap" in applied) == (tier == 8)
        assert row["preset"].startswith("int8, ckpt")
    else:  # the planner's SDXL tiers: 12 GB swaps, 8 GB recomputes every block instead
        assert ("cpu_offload" in applied) == (tier == 12)
        assert ("gradient_checkpointing" in applied) == (tier == 8)
    if "swapped_blocks" in row:
        swapped, blocks = map(int, row["swapped_blocks"].split("/"))
        assert 0 < swapped <= blocks


def test_failures_are_rows(bench: ModuleType, tmp_path: Path) -> None:
    result = tmp_path / "row.json"
    assert bench.row_main("flux:7", result, bench.Settings(device="cpu", tiny=True)) == 0
    row = json.loads(result.read_text())
    assert row["status"] == "error" and "preset_7gb" in row["error"]
    timed_out = bench.run_child("sdxl:8", bench.Settings(device="cpu", tiny=True), 0.01)
    assert timed_out["status"] == "timeout"


@pytest.mark.slow
def test_main_runs_rows_in_subprocesses_and_writes_the_table(bench: ModuleType,
                                                             tmp_path: Path) -> None:
    code = bench.main(["--device", "cpu", "--tiny", "--models", "flux", "--tiers", "12",
                       "--quick", "--out", str(tmp_path)])
    assert code == 0
    document = json.loads((tmp_path / "presets.json").read_text())
    (row,) = document["rows"]
    assert row["status"] == "ok" and row["tier_gb"] == 12 and len(row["step_s"]) == 1
    table = (tmp_path / "presets.md").read_text()
    assert "| FLUX.1-dev (11.9 B) | 12 GB |" in table and "int8, ckpt, 23/57 swapped" in table
