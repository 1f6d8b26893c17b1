"""On a GPU: ``vramkit.fit`` lets PyTorch's caching allocator grow expandable segments where
nobody chose its segment policy, says so in the plan's notes, and leaves a chosen policy alone.
Each case runs in its own interpreter (the setting is the process's)."""

from __future__ import annotations

import pytest
import torch

from tests._child import run_child

pytestmark = pytest.mark.gpu

CHILD = """
import json, torch, vramkit
from vramkit.devices.env import allocator_settings
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
from vramkit.recipes.lora import add_lora_adapters

config = DiTConfig.preset("base")
model = DiT(config, seed=0, device="cpu")
names = [f"double_blocks.{i}" for i in range(config.num_double_blocks)]
names += [f"single_blocks.{i}" for i in range(config.num_single_blocks)]
add_lora_adapters(model, names, 4)
batch = synthetic_batch(config, 2, device="cuda", generator=torch.Generator().manual_seed(0))
step = lambda m, b: flow_matching_loss(m, b)
try:  # the smallest budget a plan fits: everything that can swap does
    vramkit.plan(model, batch, 1, step=step, hardware="h100-pcie")
except vramkit.PlanError as exc:
    budget = exc.minimum_budget
fitted = vramkit.fit(model, batch, budget, step=step, hardware="h100-pcie", observe_steps=1)
for _ in range(2):
    loss = step(model, batch)
    loss.backward()
torch.cuda.synchronize()
fitted.detach()
print(json.dumps({"expandable": allocator_settings()["in_effect"]["expandable_segments"],
                  "noted": any("expandable segments" in n for n in fitted.plan.notes),
                  "swapped": len(fitted.plan.swapped), "finite": bool(torch.isfinite(loss))}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fit_turns_expandable_segments_on_and_trains() -> None:
    out = run_child(CHILD, drop=("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))
    assert out["expandable"] is True and out["noted"], out
    assert out["swapped"] > 0 and out["finite"], out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_chosen_segment_policy_is_left_alone() -> None:
    out = run_child(CHILD, env={"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
                    drop=("PYTORCH_CUDA_ALLOC_CONF",))
    assert out["expandable"] is False and not out["noted"], out
    assert out["swapped"] > 0 and out["finite"], out
