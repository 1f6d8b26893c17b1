"""`vramkit demo` on a CUDA GPU: a model larger than an enforced budget trains under swapping."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.recipes.demo import DemoConfig, plan_demo, run_demo

pytestmark = pytest.mark.gpu


def _fraction() -> float:
    return torch.cuda.get_per_process_memory_fraction(torch.cuda.current_device())


def test_model_larger_than_a_1gib_budget_trains_within_it() -> None:
    fraction_before = _fraction()
    config = DemoConfig(budget="1GiB", model_size="1.5GiB", steps=3, batch_size=1,
                        device="cuda", report=None)
    plan = plan_demo(config)
    assert plan.model_bytes > plan.budget_bytes == 2**30
    assert not plan.simulated and plan.gpu_found
    result = run_demo(config, plan=plan)

    assert result.swapped_blocks > 0
    assert result.peak_source == "measured"
    assert 0 < result.peak_bytes <= plan.budget_bytes and result.under_budget
    assert result.slot_bytes == plan.num_slots * plan.largest_block_bytes
    assert result.transfers["h2d_bytes"] > 0 and result.pinned_bytes >= result.swapped_bytes
    assert all(math.isfinite(v) for v in result.losses) and len(result.losses) == 3
    # The fully resident run sees the same weights, adapters and batch: the first forward is
    # the same computation; later steps may differ by atomics in attention backward.
    assert result.baseline_losses[0] == result.losses[0]
    assert result.baseline_max_loss_diff is not None
    assert result.baseline_max_loss_diff <= 1e-2 * abs(result.losses[0])
    assert result.slowdown is not None and result.slowdown > 0
    assert _fraction() == fraction_before  # the cap is lifted afterwards


def test_default_gpu_demo_trains_a_model_larger_than_the_budget() -> None:
    """The README quickstart on a GPU (fewer steps): bf16 DiT of 1.5x a 4 GiB budget."""
    config = DemoConfig(steps=5, report=None)
    plan = plan_demo(config)
    assert plan.device.startswith("cuda") and plan.model_config["dtype"] == "bfloat16"
    assert plan.model_bytes > plan.budget_bytes
    result = run_demo(config, plan=plan)
    assert 0 < result.swapped_blocks <= result.total_blocks
    assert result.peak_bytes <= plan.budget_bytes
    assert all(math.isfinite(v) for v in result.losses)
    assert result.loss_last < result.loss_first
    print(f"\ndefault GPU demo: {result.swapped_blocks}/{result.total_blocks} swapped, "
          f"checkpointing {plan.checkpointing}, peak {result.peak_bytes / 2**30:.2f} GiB of "
          f"{plan.budget_bytes / 2**30:.2f} GiB, step {result.median_step_seconds * 1000:.1f} ms"
          f" vs resident {(result.baseline_median_step_seconds or math.nan) * 1000:.1f} ms, "
          f"build {result.build_seconds:.1f} s, wall {result.wall_seconds:.1f} s")


def test_budget_above_free_memory_is_refused() -> None:
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(ConfigError, match="free memory"):
        plan_demo(DemoConfig(budget=free + 2**30, device="cuda", report=None))


def test_cuda_demo_report_has_budget_loads_and_a_verdict_per_run(tmp_path: Path) -> None:
    from vramkit.observe.report import load_report

    report = tmp_path / "demo.json"
    config = DemoConfig(budget="1GiB", model_size="1.5GiB", steps=6, batch_size=1,
                        device="cuda", report=str(report))
    result = run_demo(config)
    assert result.timing == "sequential" and result.timing_rounds == []
    assert len(result.baseline_step_seconds) == 6
    loaded = load_report(report)
    assert loaded.budget is not None and loaded.budget >= 2**30
    assert loaded.memory_limit is not None  # the enforced cap was seen while sampling
    assert set(loaded.leak_by_workload) == {"swapped", "resident"}
    assert loaded.leak is not None and not loaded.leak.leak
    assert "LEAK" not in dict(loaded.summary_rows())["leak"]
    loads = [e for e in loaded.events if e.kind == "block loads"]
    assert sum(e.count for e in loads) == result.transfers["loads"]
