"""`vramkit.recipes.demo.run`: short CPU runs of the demo, its result and its report."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from tests.recipes.demo._helpers import tiny_config as _tiny
from vramkit.recipes.demo import DemoProgress, plan_demo, run_demo

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


def test_demo_without_baseline_runs_the_swapped_model_only() -> None:
    result = run_demo(_tiny(steps=2, baseline=False))
    assert result.timing == "swapped only" and result.timing_rounds == []
    assert result.baseline_step_seconds == []




def test_run_demo_compiles_the_swapped_blocks_and_trains_like_the_resident_model() -> None:
    # compile=True: fit compiles each block beneath the checkpointing it applies (checkpointing
    # the blocks first would make dynamo trace the checkpoint); the resident twin stays eager.
    from torch._dynamo.utils import counters

    frames = counters["frames"]["ok"]
    result = run_demo(_tiny(steps=2, compile=True))
    assert result.plan.compile and "compiled" in result.plan.planned.explain()
    assert counters["frames"]["ok"] > frames  # the blocks ran compiled
    assert result.checkpointed_blocks == result.plan.checkpointed_block_names
    assert math.isclose(result.losses[0], result.baseline_losses[0], rel_tol=1e-5)
    assert result.plan.to_dict()["compile"] is True
