"""`vramkit.recipes.demo`: configuration checks, the memory plan, and short CPU runs of the demo."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.recipes.demo import (
    DemoConfig,
    DemoProgress,
    add_lora_adapters,
    estimate_activations,
    plan_demo,
    run_demo,
)
from vramkit.recipes.dit import DiT, DiTConfig

TINY = dict(model_size="tiny", device="cpu", report=None)


def _tiny(**overrides: object) -> DemoConfig:
    return DemoConfig(**{**TINY, **overrides})  # type: ignore[arg-type]


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("budget", "lots"), ("budget", 0), ("budget", -5), ("model_size", "huge"),
    ("model_size", "0MiB"), ("steps", 0), ("steps", 1.5), ("steps", True), ("batch_size", 0),
    ("device", "tpu"), ("device", "banana"), ("baseline", "yes"), ("report", "out.txt"),
    ("report", 3), ("lora_rank", 0), ("learning_rate", 0.0), ("learning_rate", math.nan),
    ("num_slots", 0), ("seed", -1),
])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ConfigError):
        DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_config_normalizes_sizes_and_report() -> None:
    config = DemoConfig(budget="2MiB", model_size="3MiB", report="")
    assert config.budget == 2 * 2**20
    assert config.model_size == 3 * 2**20
    assert config.report is None
    assert DemoConfig(model_size="small").model_size == "small"



def test_config_stores_canonical_values() -> None:
    config = DemoConfig(device="cpu", learning_rate=1, budget=1024)
    assert config.device == torch.device("cpu")
    assert config.learning_rate == 1.0 and isinstance(config.learning_rate, float)
    assert config.budget == 1024

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        plan_demo(DemoConfig(device="cuda", report=None))


# -- the plan ----------------------------------------------------------------------------------


def test_activation_estimate_counts_checkpointing_batch_and_fused_attention() -> None:
    config = DiTConfig.preset("tiny", image_size=64)  # 1032 tokens: L x L matrices would dominate
    model = DiT(config, device="meta")
    names = [f"double_blocks.{i}" for i in range(2)] + [f"single_blocks.{i}" for i in range(2)]
    add_lora_adapters(model, names, rank=4)
    full1, ckpt1 = estimate_activations(model, config, 1, names)
    full2, ckpt2 = estimate_activations(model, config, 2, names)
    assert 0 < ckpt1 < full1
    assert full2 == pytest.approx(2 * full1, rel=0.01)
    assert ckpt2 == pytest.approx(2 * ckpt1, rel=0.05)  # the rope table does not scale
    assert estimate_activations(model, config, 1, names) == (full1, ckpt1)  # deterministic
    # The math path would save >= one float32 [B, heads, L, L] matrix per block.
    attention_matrices = len(names) * config.num_heads * config.num_tokens ** 2 * 4
    assert full1 < attention_matrices
    # Above the hidden states the blocks see (one [B, L, hidden] float32 per block at least).
    assert full1 > len(names) * config.num_tokens * config.hidden_size * 4


def test_default_cpu_plan_swaps_blocks_and_checkpoints() -> None:
    plan = plan_demo(DemoConfig(device="cpu", report=None))
    assert plan.model_name == "small" and plan.simulated
    assert plan.model_config["dtype"] == "float32"
    assert plan.model_bytes > plan.budget_bytes  # the model does not fit the budget
    # how many is the planner's choice: the small DiT's blocks are launch-bound, so swapping
    # all of them costs no time and leaves room to recompute fewer
    assert 0 < plan.planned_swapped_blocks <= plan.num_blocks
    assert plan.checkpointing
    assert plan.steps == 10 and plan.batch_size == 2


def test_budget_sets_the_swapped_blocks_and_checkpointing() -> None:
    tight = plan_demo(_tiny(batch_size=16))
    roomy = plan_demo(_tiny(batch_size=16, budget=tight.budget_bytes * 2))
    huge = plan_demo(_tiny(batch_size=16, budget="1GiB"))
    assert tight.checkpointing and not huge.checkpointing
    assert tight.planned_swapped_blocks > roomy.planned_swapped_blocks
    assert huge.planned_swapped_blocks == 0
    assert huge.max_gpu_bytes >= roomy.max_gpu_bytes > tight.max_gpu_bytes  # all resident: equal


def test_the_plan_is_the_planners() -> None:
    """No second copy of the rules: the demo's layout is what vramkit.plan chooses."""
    import vramkit
    from vramkit.recipes.demo import CPU_PLAN_HARDWARE
    from vramkit.recipes.dit import flow_matching_loss, synthetic_batch

    plan = plan_demo(_tiny(batch_size=16))
    meta = DiT(plan.dit_config, device="meta")
    names = [f"double_blocks.{i}" for i in range(2)] + [f"single_blocks.{i}" for i in range(2)]
    add_lora_adapters(meta, names, plan.lora_rank)
    batch = synthetic_batch(plan.dit_config, plan.batch_size, device="meta")
    expected = vramkit.plan(meta, batch, plan.budget_bytes, step=flow_matching_loss,
                            blocks=names, hardware=CPU_PLAN_HARDWARE, headroom=0.05,
                            num_slots=(plan.num_slots,), activation_offload=False,
                            autocast=None)
    assert plan.swapped_block_names == list(expected.swapped)
    assert plan.checkpointed_block_names == list(expected.checkpointed)
    assert plan.predicted_peak_bytes == expected.predicted_peak_bytes <= plan.budget_bytes
    assert plan.margin_bytes == expected.headroom_bytes
    assert plan.predicted_step_seconds is None  # simulated on the CPU: no time is claimed
    assert "Swap" in plan.plan_explanation
    with pytest.raises(vramkit.PlanError) as info:
        vramkit.plan(meta, batch, 1, step=flow_matching_loss, blocks=names,
                     hardware=CPU_PLAN_HARDWARE, headroom=0.05, num_slots=(plan.num_slots,),
                     activation_offload=False, autocast=None)
    assert info.value.minimum_budget == plan.minimum_budget_bytes


def test_budget_below_the_minimum_is_a_clear_error() -> None:
    minimum = plan_demo(_tiny()).minimum_budget_bytes
    assert plan_demo(_tiny(budget=minimum)).planned_swapped_blocks == 4
    with pytest.raises(ConfigError, match="needs at least") as info:
        plan_demo(_tiny(budget=minimum - 1024))
    assert "--budget" in info.value.hint


def test_knobs_change_the_plan() -> None:
    base = plan_demo(_tiny())
    assert plan_demo(_tiny(lora_rank=32)).trainable_params == 2 * base.trainable_params
    assert plan_demo(_tiny(steps=3)).steps == 3
    bigger = plan_demo(_tiny(batch_size=4))
    assert bigger.activation_bytes_full > base.activation_bytes_full
    three = plan_demo(_tiny(num_slots=3, budget="64MiB"))
    assert three.num_slots == 3
    assert three.minimum_budget_bytes > plan_demo(_tiny(budget="64MiB")).minimum_budget_bytes
    sized = plan_demo(_tiny(model_size="8MiB"))
    assert sized.model_name.startswith("for_bytes")
    assert sized.model_bytes == pytest.approx(8 * 2**20, rel=0.1)


# -- runs --------------------------------------------------------------------------------------


def test_run_demo_trains_under_swapping_like_the_resident_model(tmp_path: Path) -> None:
    events: list[DemoProgress] = []
    report = tmp_path / "demo.html"
    config = _tiny(steps=3, batch_size=16, report=str(report))
    plan = plan_demo(config)
    assert plan.checkpointing
    result = run_demo(config, plan=plan, progress=events.append)

    assert result.swapped_blocks > 0 and result.swapped_blocks == plan.planned_swapped_blocks
    assert result.total_blocks == 4
    assert len(result.swapped_names) == result.swapped_blocks
    assert result.checkpointed_blocks == ["double_blocks.0", "double_blocks.1",
                                          "single_blocks.0", "single_blocks.1"]
    assert result.slot_bytes == plan.num_slots * plan.largest_block_bytes
    assert result.transfers["h2d_bytes"] > 0
    assert result.peak_source.startswith("planned")
    assert result.peak_bytes == sum(result.peak_breakdown.values())
    assert result.under_budget and result.peak_bytes <= plan.budget_bytes
    assert len(result.losses) == 3 and all(math.isfinite(v) for v in result.losses)
    assert result.loss_last < result.loss_first
    # Swapping computes exactly what the resident model computes.
    assert result.baseline_losses == result.losses
    assert result.baseline_max_loss_diff == 0.0
    assert result.slowdown is not None and result.slowdown > 0
    assert len(result.step_seconds) == 3 and result.median_step_seconds > 0
    assert result.report_path == str(report) and report.read_text().lstrip().startswith("<")
    # On the CPU the two runs alternate step by step (swapped first in even rounds): each
    # stage's events stay in order, each stage starts right before its first step.
    assert [(e.stage, e.step) for e in events] == [
        ("build", 0), ("train", 0), ("train", 1), ("baseline", 0), ("baseline", 1),
        ("baseline", 2), ("train", 2), ("train", 3), ("baseline", 3)]
    assert events[2].loss == result.losses[0]
    assert events[2].step_seconds == result.step_seconds[0]
    data = json.loads(json.dumps(result.to_dict()))
    assert data["plan"]["budget_bytes"] == plan.budget_bytes
    assert data["loss_first"] == result.losses[0]


def test_run_demo_without_baseline_and_training_knobs() -> None:
    result = run_demo(_tiny(steps=2, baseline=False))
    assert result.baseline_median_step_seconds is None and result.slowdown is None
    assert "no-baseline" in (result.baseline_skipped or "")
    assert result.baseline_losses == [] and result.report_path is None
    faster = run_demo(_tiny(steps=2, baseline=False, learning_rate=3e-2))
    assert faster.losses[0] == result.losses[0]  # same weights and data
    assert faster.losses[1] < result.losses[1]  # a larger step on the same batch
    other_seed = run_demo(_tiny(steps=1, baseline=False, seed=1))
    assert other_seed.losses[0] != result.losses[0]


def test_plan_from_config_is_used_by_run_demo() -> None:
    plan = plan_demo(_tiny(steps=1))
    result = run_demo(_tiny(), plan=replace(plan, steps=2), progress=None)
    assert len(result.losses) == 2


# -- the report's leak verdict, events, and paired timing --------------------------------------


def test_cpu_demo_report_judges_each_run_and_shows_no_leak(tmp_path: Path) -> None:
    """The resident run follows (here: alternates with) the swapped one in one profile; the
    switch between them must not read as a leak: each run is judged on its own steps."""
    from vramkit.observe.report import load_report
    from vramkit.observe.report_html import render_html

    report = tmp_path / "demo.json"
    result = run_demo(_tiny(steps=8, report=str(report)))
    loaded = load_report(report)
    assert loaded.leak is not None and not loaded.leak.leak
    assert set(loaded.leak_by_workload) == {"swapped", "resident"}
    for verdict in loaded.leak_by_workload.values():
        assert verdict.steps == 8 and verdict.conclusive and not verdict.leak
    leak_row = dict(loaded.summary_rows())["leak"]
    assert "LEAK" not in leak_row and "swapped" in leak_row and "resident" in leak_row
    assert "LEAK" not in render_html(loaded)
    # the swapper's block loads are in the profile, as many as the swapper counted
    loads = [e for e in loaded.events if e.kind == "block loads"]
    assert loads and all(e.workload == "swapped" for e in loads)
    assert sum(e.count for e in loads) == result.transfers["loads"]


def test_cpu_demo_times_the_runs_in_paired_alternating_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that slows down steadily: every step takes longer than the one before. Timed
    one run after the other, the resident run would look 3x slower than the swapped one; in
    paired, alternating rounds both see the same drift and the ratio stays 1."""
    from vramkit.recipes import demo as demo_mod

    calls: list[float] = []

    def drifting_clock() -> float:  # step j (in global order) lasts 4j + 1 "seconds"
        calls.append(float(len(calls) ** 2))
        return calls[-1]

    monkeypatch.setattr(demo_mod, "_clock", drifting_clock)
    events: list[DemoProgress] = []
    result = run_demo(_tiny(steps=5), progress=events.append)
    assert result.timing == "paired"
    assert [r["first"] for r in result.timing_rounds] == [
        "swapped", "resident", "swapped", "resident", "swapped"]
    durations = [4 * j + 1 for j in range(10)]  # global order: A B | B A | A B | B A | A B
    assert result.step_seconds == [durations[i] for i in (0, 3, 4, 7, 8)]
    assert result.baseline_step_seconds == [durations[i] for i in (1, 2, 5, 6, 9)]
    for r in result.timing_rounds:
        assert r["swapped_seconds"] == result.step_seconds[r["round"]]
        assert r["resident_seconds"] == result.baseline_step_seconds[r["round"]]
    assert result.median_step_seconds == 23.0 and result.baseline_median_step_seconds == 23.0
    assert result.slowdown == 1.0
    # the losses of the two runs are still compared, step by step
    assert result.baseline_losses == result.losses and result.baseline_max_loss_diff == 0.0
    # progress reports carry the same statistic the result reports
    last = {e.stage: e for e in events if e.step_seconds is not None}
    assert last["train"].median_step_seconds == result.median_step_seconds
    assert last["baseline"].median_step_seconds == result.baseline_median_step_seconds


def test_demo_without_baseline_runs_the_swapped_model_only() -> None:
    result = run_demo(_tiny(steps=2, baseline=False))
    assert result.timing == "swapped only" and result.timing_rounds == []
    assert result.baseline_step_seconds == []


def test_the_memory_cap_collects_garbage_before_it_reads_what_the_process_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Device memory held by unreachable cycles of earlier work must not count as "held
    before" the run: freed during the run, it would take the run's peak below it."""
    import gc

    from vramkit.recipes import demo

    state = {"allocated": 100}

    class Cycle:  # stands for tensors of an earlier run kept alive by a reference cycle
        def __init__(self) -> None:
            self.me = self
            state["allocated"] += 50

        def __del__(self) -> None:
            state["allocated"] -= 50

    fake = {"empty_cache": lambda: None, "set_per_process_memory_fraction": lambda *a: None,
            "reset_peak_memory_stats": lambda *a: None,
            "get_per_process_memory_fraction": lambda *a: 1.0,
            "memory_reserved": lambda *a: state["allocated"],
            "memory_allocated": lambda *a: state["allocated"],
            "get_device_properties": lambda *a: type("P", (), {"total_memory": 10**9})}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        Cycle()
        assert state["allocated"] == 150
        with demo._memory_cap(torch.device("cuda", 0), 10) as (allocated, reserved):
            assert (allocated, reserved) == (100, 100)
    finally:
        if was_enabled:
            gc.enable()
