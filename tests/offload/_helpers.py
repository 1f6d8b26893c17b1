"""Models and training loops shared by the CPU and GPU offload tests."""

from __future__ import annotations

import torch
from torch import nn

from vramkit.offload.cpu import CPUOffloadManager


def train_offloaded(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor],
                    mgr: CPUOffloadManager | None, names: list[str]) -> list[torch.Tensor]:
    """One optimizer step per input; with ``mgr``, ``names`` are loaded before each step and
    released (then cleared) after it. Returns the losses."""
    losses = []
    for x in xs:
        if mgr is not None:
            mgr.load_to_gpu(names)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        # Before clearing: the write-back must not rely on a gradient still being there.
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if mgr is not None:
            mgr.release()
            mgr.clear_inactive()
    return losses


class FrozenBlocks(nn.Module):
    """Frozen (swappable) residual MLP blocks between trainable input and output layers."""

    def __init__(self, in_dim: int, width: int, hidden: int, blocks: int, out_dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(blocks))
        self.out = nn.Linear(width, out_dim)
        for p in self.blocks.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)
