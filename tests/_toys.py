"""Toy models and gradient comparisons that many tests share.

The models are small block stacks in the shape vramkit works on: a ``blocks`` ModuleList of
identical blocks, optionally between an input and an output layer. Each one creates its layers in
a fixed order, so under the same seed two of them hold the same values: tests build a reference
and a model under test from the same call and compare them bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """``x + drop(down(act(up(norm(x))))) [+ adapter(x)]``: a pre-norm residual MLP block.

    ``act`` defaults to GELU; ``drop`` exists only with a ``dropout``; ``adapter`` adds a
    bias-free linear beside the MLP (created after it: a trainable low-rank stand-in).
    """

    def __init__(self, dim: int, hidden: int | None = None, *, act: nn.Module | None = None,
                 dropout: float = 0.0, adapter: bool = False) -> None:
        super().__init__()
        hidden = hidden or 4 * dim
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.act = act if act is not None else nn.GELU()
        self.down = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout) if dropout else None
        self.adapter = nn.Linear(dim, dim, bias=False) if adapter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.act(self.up(self.norm(x))))
        y = x + (self.drop(y) if self.drop is not None else y)
        return y + self.adapter(x) if self.adapter is not None else y


class ResidualLinear(nn.Module):
    """``x + fc(x)``: the smallest block with weights."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class ResidualSequential(nn.Sequential):
    """``x + layers(x)``; its parameters keep nn.Sequential's names (``0.weight``, ...)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def mlp(width: int, hidden: int) -> ResidualSequential:
    """The residual ``Linear -> GELU -> Linear`` block of the frozen-base stacks."""
    return ResidualSequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class Stack(nn.Module):
    """``inp`` -> ``n`` blocks from ``block()`` -> ``out``, each end layer optional.

    Layers are created in that order (after ``torch.manual_seed(seed)`` when ``seed`` is given),
    so equal calls give equal values. ``inp``/``out`` are a Linear's (in, out) features and
    ``names`` their attribute names. ``frozen`` freezes the blocks (a frozen base under trainable
    end layers). ``skip`` adds block 0's output again after the last block (a long skip: one
    block output read twice).
    """

    def __init__(self, block: Callable[[], nn.Module], n: int, *,
                 inp: tuple[int, int] | None = None, out: tuple[int, int] | None = None,
                 names: tuple[str, str] = ("inp", "out"), seed: int | None = None,
                 frozen: bool = False, skip: bool = False) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self._ends = names
        self._skip = skip
        if inp is not None:
            setattr(self, names[0], nn.Linear(*inp))
        self.blocks = nn.ModuleList(block() for _ in range(n))
        if out is not None:
            setattr(self, names[1], nn.Linear(*out))
        if frozen:
            self.blocks.requires_grad_(False)

    def _end(self, which: int) -> nn.Module | None:
        return getattr(self, self._ends[which], None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (inp := self._end(0)) is not None:
            x = inp(x)
        first = None
        for block in self.blocks:
            x = block(x)
            first = x if first is None else first
        if self._skip:
            x = x + first
        if (out := self._end(1)) is not None:
            x = out(x)
        return x


def frozen_mlp_stack(in_dim: int, width: int, hidden: int, blocks: int,
                     out_dim: int) -> Stack:
    """Frozen (swappable) residual MLP blocks between trainable input and output layers,
    seeded 0."""
    return Stack(lambda: mlp(width, hidden), blocks, inp=(in_dim, width), out=(width, out_dim),
                 seed=0, frozen=True)


# -- gradients ---------------------------------------------------------------------------------

def host_params(swapper: Any) -> dict[int, nn.Parameter]:
    """Module Parameter id -> the host parameter a BlockSwapper trains it in (trainable="cpu")."""
    return {id(e.tensor): e.host_param for b in swapper.blocks for e in b.trainable_entries
            if e.host_param is not None}


def grads_of(model: nn.Module, swapper: Any = None) -> dict[str, torch.Tensor]:
    """Name -> a copy of the gradient of every trainable parameter (from its host parameter
    where ``swapper`` trains it there); each must have one."""
    host = host_params(swapper) if swapper is not None else {}
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = host[id(p)].grad if id(p) in host else p.grad
            assert g is not None, f"{name} got no gradient"
            out[name] = g.detach().clone()
    return out


def present_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> a copy of each gradient there is (parameters without one left out)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def assert_same_grads(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """The same names with bit-identical tensors."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def assert_all_equal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    """As many tensors, each bit-identical to its partner."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def grad_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the parameter gradients there are of one ``out.square().mean()`` backward,
    from no gradients and leaving none."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


# -- adapters kept outside the model ----------------------------------------------------------

class ProjectionBlock(nn.Module):
    """``x + o(tanh(q(x)))``: a block whose two Linears (``q``, ``o``) adapters target, as an
    attention block's projections are."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(torch.tanh(self.q(x)))


class KohyaLoRAModule(nn.Module):
    """A kohya/musubi-tuner style LoRA module: ``apply_to`` replaces the target layer's
    ``forward`` by this module's (an instance attribute) and keeps the original one to call.

    ``lora_down`` Kaiming-uniform and ``lora_up`` zero, as those trainers start; ``alpha``
    scales the update by ``alpha / rank`` and is a buffer (saved with the weights).
    """

    def __init__(self, lora_name: str, org_module: nn.Linear, rank: int = 4,
                 alpha: float = 1.0, multiplier: float = 1.0) -> None:
        super().__init__()
        self.lora_name = lora_name
        self.lora_dim = rank
        self.lora_down = nn.Linear(org_module.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, org_module.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=5 ** 0.5)
        nn.init.zeros_(self.lora_up.weight)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = alpha / rank
        self.multiplier = multiplier
        self.org_module = org_module  # dropped by apply_to, as those trainers do

    def apply_to(self) -> None:
        self.org_forward = self.org_module.forward
        self.org_module.forward = self.forward
        del self.org_module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as those trainers write it: under autocast the update comes out in the compute dtype
        org_forwarded = self.org_forward(x)
        lx = self.lora_up(self.lora_down(x))
        return org_forwarded + lx * self.multiplier * self.scale


class KohyaLoRANetwork(nn.Module):
    """A kohya/musubi-tuner style LoRA network: one :class:`KohyaLoRAModule` per target
    ``nn.Linear`` of ``model`` (names containing one of ``targets``), held in ``self.loras``,
    a ModuleList outside the model. ``lora_name`` is ``prefix`` + the module path with ``_``
    for ``.`` (the kohya key). Call ``apply_to()`` to hook them in; register the network on the
    model (``model.network = net``) or not, as a trainer does."""

    def __init__(self, model: nn.Module, targets: Sequence[str], rank: int = 4,
                 alpha: float = 1.0, prefix: str = "lora_unet", seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        modules = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and any(t in name.split(".") for t in targets):
                lora_name = f"{prefix}_{name}".replace(".", "_")
                modules.append(KohyaLoRAModule(lora_name, module, rank, alpha))
        self.loras = nn.ModuleList(modules)

    def apply_to(self) -> KohyaLoRANetwork:
        for lora in self.loras:
            lora.apply_to()
        return self

    def kohya_state_dict(self) -> dict[str, torch.Tensor]:
        """``{lora_name}.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``, as the
        trainers save it."""
        return {f"{m.lora_name}.{k}": v for m in self.loras for k, v in m.state_dict().items()}


class HookLoRA(nn.Module):
    """A low-rank adapter added by a forward hook on ``layer``: ``out + up(down(x))``.

    ``bound=True`` registers a bound method (the hook's owner is this module); else a closure
    over it. ``up`` starts random so the adapter changes the output from the first step.
    """

    def __init__(self, layer: nn.Linear, rank: int = 4, bound: bool = True) -> None:
        super().__init__()
        self.down = nn.Linear(layer.in_features, rank, bias=False)
        self.up = nn.Linear(rank, layer.out_features, bias=False)
        if bound:
            self.handle = layer.register_forward_hook(self.hook)
        else:
            adapter = self
            self.handle = layer.register_forward_hook(
                lambda module, args, out: adapter.hook(module, args, out))

    def hook(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor
             ) -> torch.Tensor:
        return out + self.up(self.down(args[0]))


def hook_adapters(model: nn.Module, targets: Sequence[str], rank: int = 4, *,
                  bound: bool = True, seed: int = 0) -> nn.ModuleList:
    """A :class:`HookLoRA` on each ``nn.Linear`` of ``model`` whose name has a part in
    ``targets``; returned in a ModuleList the model does not hold."""
    torch.manual_seed(seed)
    return nn.ModuleList(HookLoRA(m, rank, bound) for name, m in model.named_modules()
                         if isinstance(m, nn.Linear) and any(t in name.split(".")
                                                             for t in targets))
