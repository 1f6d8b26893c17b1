"""benchmarks/w8a8_quality.py's control arm: one step of the frozen weights' own dtype, up or
down at random, and nothing else moved."""

from __future__ import annotations

import torch
from torch import nn

from tests._benchmarks import load_benchmark


def test_the_control_moves_each_frozen_weight_one_step_and_leaves_the_adapters() -> None:
    bench = load_benchmark("w8a8_quality")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)).to(torch.bfloat16)
    model[1].weight.requires_grad_(True)
    model[0].requires_grad_(False)
    model[1].bias.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bench.nudge_frozen(model, seed=0)
    for name, p in model.named_parameters():
        old = before[name]
        if p.requires_grad:
            assert torch.equal(p, old), name  # the trainable weight is not touched
            continue
        up = torch.nextafter(old, torch.full_like(old, float("inf")))
        down = torch.nextafter(old, torch.full_like(old, float("-inf")))
        assert bool(((p == up) | (p == down)).all()), name
        moved_up = (p == up).float().mean().item()
        assert 0.3 < moved_up < 0.7, (name, moved_up)  # both directions, at random
