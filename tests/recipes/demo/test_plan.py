"""`vramkit.recipes.demo.plan`: the demo resolved for the machine and planned by vramkit.plan."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.demo._helpers import tiny_config as _tiny
from vramkit.errors import ConfigError
from vramkit.planning import estimate_activations as planner_estimate
from vramkit.recipes.demo import DemoConfig, add_lora_adapters, plan_demo
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        plan_demo(DemoConfig(device="cuda", report=None))


# -- the plan ----------------------------------------------------------------------------------


def estimate_activations(model: torch.nn.Module, config: DiTConfig, batch_size: int,
                         block_names: list[str]) -> tuple[int, int]:
    """The planner's activation bytes of the demo's step, without and with checkpointing."""
    batch = synthetic_batch(config, batch_size, device="meta")
    found = planner_estimate(model, lambda: flow_matching_loss(model, batch), block_names)
    return found.full, found.checkpointed


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
    from vramkit.recipes.demo.config import CPU_PLAN_HARDWARE

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
