"""LoRA adapters for the demo: a frozen ``nn.Linear`` plus a trainable low-rank update.

:func:`add_lora_adapters` freezes a model and wraps the :data:`LORA_TARGETS` layers of the named
blocks in :class:`LoRALinear` -- the attention layers LoRA trainers for Flux adapt. The demo
(:mod:`vramkit.recipes.demo`) trains these adapters; it re-exports the three names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LORA_TARGETS", "LoRALinear", "add_lora_adapters"]

# Layers that get LoRA adapters: the fused qkv and output projections of both streams of a
# double block, and the fused (qkv + MLP in) / (attention + MLP out) layers of a single block --
# the attention layers LoRA trainers for Flux adapt.
LORA_TARGETS = ("qkv", "proj", "linear1", "linear2")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``up @ down`` (float32).

    ``up`` starts at zero, so the adapted layer starts equal to the base layer (as in LoRA).

    Args:
        base: the layer to adapt; its parameters are frozen.
        rank: rank of the update.
        generator: random source of ``down`` (N(0, 1/in_features)). Default: the global RNG.
    """

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator | None = None
                 ) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        device = base.weight.device
        self.down = nn.Parameter(torch.empty(rank, base.in_features, device=device))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        if device.type != "meta":
            values = torch.randn(self.down.shape, generator=generator)
            with torch.no_grad():
                self.down.copy_(values.mul_(base.in_features ** -0.5))
        self.scaling = 1.0  # alpha = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        delta = F.linear(F.linear(x.to(self.down.dtype), self.down), self.up)
        return out + (delta * self.scaling).to(out.dtype)


def add_lora_adapters(model: nn.Module, block_names: list[str], rank: int, *,
                      seed: int = 0) -> list[nn.Parameter]:
    """Freeze ``model`` and wrap the ``LORA_TARGETS`` layers of the named blocks in LoRA.

    Args:
        model: the model (any device, ``meta`` included).
        block_names: qualified names of the blocks to adapt.
        rank: adapter rank.
        seed: seed of the adapters' initial values. Default 0.

    Returns:
        The trainable parameters (the adapters), in block order.
    """
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    for block_name in block_names:
        block = model.get_submodule(block_name)
        targets = [(name, mod) for name, mod in block.named_modules()
                   if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS]
        for name, linear in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            adapter = LoRALinear(linear, rank, generator)
            setattr(parent, attr, adapter)
            params += [adapter.down, adapter.up]
    return params
