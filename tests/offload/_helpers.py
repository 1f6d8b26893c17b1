"""The training loop shared by the CPU and GPU offload tests."""

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
