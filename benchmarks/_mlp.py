"""The residual MLP stack the optimizer benchmarks train (optimizer_offload.py, adamw8bit.py)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MlpBlock", "build_mlp"]


class MlpBlock(nn.Module):
    """Pre-norm residual MLP, the bulk of a transformer block's parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_mlp(layers: int, dim: int, device: torch.device,
              dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``layers`` blocks of width ``dim``, seeded (seed 0), built on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(*(MlpBlock(dim) for _ in range(layers)))
    return model.to(dtype)
