"""A small transformer-like stack for planner tests: frozen base layers with trainable LoRA-style
adapters, the shape of what vramkit plans for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._toys import Stack

DIM = 256
TOKENS = 64


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 4 * DIM, rank: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        adapted = h @ self.lora_a.t() @ self.lora_b.t()
        return x + self.down(F.gelu(self.up(h))) + adapted


def stack(seed: int = 0, n: int = 6, device: str = "cpu") -> Stack:
    """A stack with its base frozen and its adapters trainable (fp32)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Stack(Block, n, inp=(DIM, DIM), out=(DIM, DIM))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def inputs(batch: int = 2, device: str = "cpu") -> tuple[torch.Tensor]:
    return (torch.randn(batch, TOKENS, DIM, generator=torch.Generator().manual_seed(1)).to(
        device),)


def stack_cost():  # type: ignore[no-untyped-def]
    """The test stack's step analyzed on meta (bf16, fp8 and nf4 storage)."""
    from vramkit.planning.analysis import analyze

    return analyze(stack(device="meta"), inputs(device="meta"), mode="train", autocast=None,
                   formats=("bf16", "fp8", "nf4"))


def plan_stack(cost, budget: int, **kw):  # type: ignore[no-untyped-def]
    """A plan of the test stack from ``cost`` (rtx4090, no headroom unless given)."""
    from vramkit.planning.api import plan

    kw.setdefault("hardware", "rtx4090")
    kw.setdefault("headroom", 0)
    return plan(stack(device="meta"), inputs(device="meta"), budget, cost=cost, **kw)
