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


# -- a tiny Wan-shaped video transformer ------------------------------------------------------


class VideoFeedForward(nn.Module):
    """Wan's FFN shape: up to a wide hidden width, tanh GELU, down (frozen)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class VideoBlock(nn.Module):
    """A Wan-shaped block at tiny widths: self-attention over every video token (SDPA), a
    cross-attention to text tokens, a wide FFN (``ffn``); LoRA-style adapters on the
    self-attention's query and output."""

    def __init__(self, dim: int = 32, heads: int = 2, hidden: int = 256, rank: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(dim) for _ in range(3))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.cross_q = nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(dim, 2 * dim)
        self.ffn = VideoFeedForward(dim, hidden)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.05)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.05)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = x + self._self_attention(self.norm1(x))
        h = self.norm2(x)
        k, v = self.cross_kv(text).chunk(2, dim=-1)
        a = F.scaled_dot_product_attention(_heads(self.cross_q(h), self.heads),
                                           _heads(k, self.heads), _heads(v, self.heads))
        x = x + a.transpose(1, 2).flatten(2)
        return x + self.ffn(self.norm3(x))

    def _self_attention(self, h: torch.Tensor) -> torch.Tensor:
        return _self_attention(h, self.qkv, self.out, self.lora_a, self.lora_b, self.heads)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _self_attention(h: torch.Tensor, qkv: nn.Linear, out: nn.Linear, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, heads: int) -> torch.Tensor:
    """Self-attention with a LoRA-style adapter on the query (a :class:`VideoBlock`'s)."""
    q, k, v = qkv(h).chunk(3, dim=-1)
    q = q + h @ lora_a.t() @ lora_b.t()
    a = F.scaled_dot_product_attention(_heads(q, heads), _heads(k, heads), _heads(v, heads))
    return out(a.transpose(1, 2).flatten(2))


class VideoModel(nn.Module):
    """Patch embedding of a (batch, channels, frames, height, width) latent into tokens,
    ``n`` :class:`VideoBlock`s, and the projection back; the base frozen, adapters trainable."""

    def __init__(self, n: int = 4, dim: int = 32, channels: int = 4, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Conv3d(channels, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(VideoBlock(dim, hidden=hidden) for _ in range(n))
        self.proj = nn.Linear(dim, channels * 4)

    def forward(self, latents: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = self.embed(latents).flatten(2).transpose(1, 2)
        t = self.text(text)
        for block in self.blocks:
            x = block(x, t)
        return self.proj(x)


def video_model(seed: int = 0, n: int = 4, device: str = "cpu", hidden: int = 256
                ) -> VideoModel:
    torch.manual_seed(seed)
    with torch.device(device):
        model = VideoModel(n, hidden=hidden)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def video_inputs(frames: int = 5, height: int = 16, width: int = 24,
                 device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A latent of ``frames`` x ``height`` x ``width`` (tokens: frames * height/2 * width/2)
    and 8 text tokens."""
    g = torch.Generator().manual_seed(2)
    return (torch.randn(1, 4, frames, height, width, generator=g).to(device),
            torch.randn(1, 8, 16, generator=g).to(device))


class VideoSelfAttention(nn.Module):
    """:class:`VideoBlock`'s self-attention as a child module (``attn1``, as Wan names it),
    its LoRA-style adapter on the query included."""

    def __init__(self, dim: int, heads: int = 2, rank: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.05)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.05)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _self_attention(h, self.qkv, self.out, self.lora_a, self.lora_b, self.heads)


class VideoPartsBlock(VideoBlock):
    """:class:`VideoBlock` with its self-attention a child (``attn1``) beside ``ffn``: the
    parts sub-block checkpointing finds by name."""

    def __init__(self, dim: int = 32, heads: int = 2, hidden: int = 256, rank: int = 4) -> None:
        super().__init__(dim, heads, hidden, rank)
        del self.qkv, self.out, self.lora_a, self.lora_b
        self.attn1 = VideoSelfAttention(dim, heads, rank)

    def _self_attention(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn1(h)


def video_parts_model(seed: int = 0, n: int = 4, device: str = "meta", hidden: int = 256
                      ) -> VideoModel:
    """:func:`video_model` with :class:`VideoPartsBlock` blocks (FFN width ``hidden``)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = VideoModel(n, hidden=hidden)
        model.blocks = nn.ModuleList(VideoPartsBlock(hidden=hidden) for _ in range(n))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model
