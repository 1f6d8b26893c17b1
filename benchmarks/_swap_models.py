"""Models and the "exchange" baseline used by ``benchmarks/swap.py``.

* :class:`TransformerStack`: a stack of pre-norm transformer blocks (bf16,
  ``F.scaled_dot_product_attention``, GELU MLP) with frozen base weights and a small trainable
  LoRA adapter on the attention projections of every block -- the frozen-base fine-tuning case,
  where backward runs through every block.
* :class:`Exchanger`: classic trainer block swapping, implemented here as the baseline. Swapped
  blocks live in pageable host memory; before a swapped block runs, the previously used swapped
  block is copied back device->host (``.to("cpu")`` of each tensor, as kohya-style code does) and
  the needed block host->device (``.to("cuda")``, synchronous). Backward brings blocks back the
  same way. With checkpointing a swapped block runs forward under ``no_grad`` and is recomputed in
  backward; without it the block keeps its graph and the saved references to its weights are
  resolved, in backward, to wherever the weights are then (so the baseline does not recompute
  more than the model it is compared with).
* :class:`CopyTraffic`: the swapper's host->device copies without the swapper. Hooks on the
  resident model enqueue the same copies (one per swapped block and phase, ``S - R`` per phase,
  issued where the swapper prefetches them) from one pinned buffer into one GPU buffer on the
  shared copy stream. A step with it measures what the copies alone cost: on a launch-bound
  step a host->device DMA slows the host's kernel launches (``benchmarks/swap_step_host.py``), which no
  swapper code can avoid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["CopyTraffic", "Exchanger", "LoRALinear", "StackBlock", "TransformerStack"]


class LoRALinear(nn.Module):
    """A frozen ``Linear`` plus a trainable low-rank update ``x A^T B^T``.

    Args:
        in_features: input width.
        out_features: output width.
        rank: adapter rank.
        generator: CPU generator for the initial values (deterministic models).
    """

    def __init__(self, in_features: int, out_features: int, rank: int,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.base.requires_grad_(False)
        # B is not zero (unlike LoRA training's start) so every adapter gets a real gradient.
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, generator=generator)
                                   * in_features ** -0.5)
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, generator=generator) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class StackBlock(nn.Module):
    """Pre-norm transformer block: LoRA'd attention (SDPA) and a frozen 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = LoRALinear(hidden, 3 * hidden, rank, generator)
        self.proj = LoRALinear(hidden, hidden, rank, generator)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        for module in (self.norm1, self.norm2, self.fc1, self.fc2):
            module.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, -1).permute(
            2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, tokens, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class TransformerStack(nn.Module):
    """``blocks`` :class:`StackBlock` in an ``nn.ModuleList`` and a resident output norm.

    Args:
        blocks: number of blocks.
        hidden: token width.
        heads: attention heads (``hidden`` must divide evenly).
        rank: LoRA rank of the adapters.
        dtype: parameter dtype.
        device: where the model is built.
        seed: initial values come from a CPU generator with this seed.
    """

    def __init__(self, blocks: int, hidden: int, heads: int, rank: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            self.blocks = nn.ModuleList(StackBlock(hidden, heads, rank, generator)
                                        for _ in range(blocks))
            self.norm_out = nn.LayerNorm(hidden)
        self.to_empty(device=device)
        self.to(dtype)
        with torch.no_grad():  # N(0, 1/fan_in) weights keep activations O(1) through depth
            for name, p in self.named_parameters():
                if name.endswith("lora_b"):
                    values = torch.randn(p.shape, generator=generator) * 0.01
                elif p.dim() == 2:
                    values = torch.randn(p.shape, generator=generator) * p.shape[1] ** -0.5
                elif "norm" in name and name.endswith("weight"):
                    values = torch.ones(p.shape)
                else:
                    values = torch.zeros(p.shape)
                p.copy_(values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm_out(x)


def block_bytes(module: nn.Module) -> int:
    """Bytes of a block's frozen tensors (what a classic trainer moves)."""
    return sum(t.numel() * t.element_size() for t in _frozen_tensors(module))


def _frozen_tensors(module: nn.Module) -> list[torch.Tensor]:
    params = [p for p in module.parameters() if not p.requires_grad]
    return params + list(module.buffers())


class _ExchangeCall:
    """One call of an exchanged block: flattened inputs and (without checkpointing) its graph."""

    def __init__(self, owner: Exchanger, module: nn.Module, fn: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.owner, self.module, self.fn = owner, module, fn
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.others = [None if t else x for x, t in zip(leaves, self.is_tensor, strict=True)]
        self.tensors = [x for x, t in zip(leaves, self.is_tensor, strict=True) if t]
        self.out_spec: Any = None
        self.inner: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        it = iter(tensors)
        leaves = [next(it) if t else x for x, t in zip(self.others, self.is_tensor, strict=True)]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out_leaves, self.out_spec = pytree.tree_flatten(self.fn(*args, **kwargs))
        return out_leaves


def _detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


class _ExchangeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _ExchangeCall, _anchor: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        owner = call.owner
        owner.bring(call.module)
        if owner.checkpointing:
            ctx.save_for_backward(*tensors)
            with torch.no_grad():
                return tuple(call.run(tensors))
        inputs = _detached(tensors)
        with torch.enable_grad(), owner.weight_refs(call.module):
            outs = call.run(inputs)
        call.inner = (inputs, outs)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _ExchangeCall = ctx.call
        owner = call.owner
        owner.bring(call.module)
        if owner.checkpointing:
            inputs = _detached(ctx.saved_tensors)
            with torch.enable_grad():
                outs = call.run(inputs)
        else:
            assert call.inner is not None
            inputs, outs = call.inner
            call.inner = None
        pairs = [(o, g) for o, g in zip(outs, grads, strict=False)
                 if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


_MISSING = object()


class Exchanger:
    """Classic device<->host block exchange (the benchmark's baseline; see the module docstring).

    Args:
        blocks: ``(name, module)`` of every block, in execution order.
        swapped: names of the blocks to keep on the host.
        device: where compute runs.
        checkpointing: recompute swapped blocks in backward (their forward runs under
            ``no_grad``) instead of keeping their graph.

    ``detach()`` puts the swapped blocks back on ``device`` and restores their forwards.
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], swapped: Sequence[str],
                 device: torch.device, checkpointing: bool) -> None:
        from vramkit.offload.checkpointing import unwrapped_forward

        self.device = device
        self.host = torch.device("cpu")
        self.checkpointing = checkpointing
        self.current: nn.Module | None = None
        self.exchanges = 0
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        wanted = set(swapped)
        self.modules = [m for name, m in blocks if name in wanted]
        self._saved_forward: list[tuple[nn.Module, Any]] = []
        for module in self.modules:
            self._move(module, self.host)
            self._saved_forward.append((module, module.__dict__.get("forward", _MISSING)))
            fn = unwrapped_forward(module)  # vramkit checkpointing: this class recomputes itself
            module.forward = self._wrapped(module, fn)

    def _wrapped(self, module: nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                self.bring(module)
                return fn(*args, **kwargs)
            call = _ExchangeCall(self, module, fn, args, kwargs)
            outs = _ExchangeFunction.apply(call, self.anchor, *call.tensors)
            return pytree.tree_unflatten(list(outs), call.out_spec)
        return forward

    def _move(self, module: nn.Module, device: torch.device) -> None:
        # copy=True: a real copy even when host and device are both the CPU (the CPU test path),
        # so stale references to the old storage would show up as wrong gradients there too.
        for t in _frozen_tensors(module):
            t.data = t.data.to(device, copy=True)

    def bring(self, module: nn.Module) -> None:
        """Make ``module`` the swapped block on the device: the previous one goes back first."""
        if self.current is module:
            return
        if self.current is not None:
            self._move(self.current, self.host)  # device->host; waits for the compute stream
        self._move(module, self.device)  # pageable host->device: synchronous
        self.current = module
        self.exchanges += 1

    def weight_refs(self, module: nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that keep a *reference* to ``module``'s device weights (the
        parameter and the view), not their storage, which is freed when the block leaves."""
        by_storage = {t.untyped_storage().data_ptr(): t for t in _frozen_tensors(module)}

        def pack(t: torch.Tensor) -> Any:
            owner = (by_storage.get(t.untyped_storage().data_ptr()) if t.device == self.device
                     else None)
            if owner is None:
                return t
            return (owner, t.shape, t.stride(), t.storage_offset())

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, torch.Tensor):
                return saved
            owner, shape, stride, offset = saved
            return torch.as_strided(owner.data, shape, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def detach(self) -> None:
        """Put every swapped block back on the device and restore its forward."""
        for module, previous in self._saved_forward:
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
            self._move(module, self.device)
        self._saved_forward = []
        self.current = None


class CopyTraffic:
    """Enqueue the copies a swapped step makes, on the resident model (the copy floor).

    The swapped blocks are ``swapped`` (names from ``blocks``, in execution order, as the
    swapper's schedule chose them) with ``slots`` GPU slots. The swapper loads swapped block
    ``i + R`` when block ``i`` is done in forward and block ``i - R`` when block ``i`` is done
    in backward (the last R stay across the turn, the first R are in place for the next step):
    a forward hook and a hook on the block's first output gradient enqueue one copy of that
    block's swapped bytes (tensors of at least ``min_bytes``) there. Copies of one phase queue
    on the device's shared host->device stream into one scratch buffer, as slot loads do. With
    ``enqueue=False`` the hooks run and copy nothing (their own cost).
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], swapped: Sequence[str],
                 slots: int, device: torch.device, min_bytes: int, enqueue: bool = True) -> None:
        from vramkit.memory.transfer import transfer_streams

        chosen = set(swapped)
        modules = [m for name, m in blocks if name in chosen]
        sizes = [sum(t.numel() * t.element_size() for t in _frozen_tensors(m)
                     if t.numel() * t.element_size() >= min_bytes) for m in modules]
        self.streams = transfer_streams(device)
        largest = max(sizes, default=0)
        self.host = torch.empty(largest, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.scratch = torch.empty(largest, dtype=torch.uint8, device=device)
        self.copies = 0
        self.enqueue = enqueue
        self._handles = []
        n = len(modules)
        for i, module in enumerate(modules):
            forward = sizes[i + slots] if i + slots < n else 0
            backward = sizes[i - slots] if i - slots >= 0 else 0
            self._handles.append(module.register_forward_hook(self._hook(forward, backward)))

    def _copy(self, nbytes: int) -> None:
        if not self.enqueue:
            return
        self.streams.copy(self.scratch[:nbytes], self.host[:nbytes], self.streams.h2d)
        self.copies += 1

    def _hook(self, forward: int, backward: int) -> Callable[..., None]:
        def on_grad(grad: torch.Tensor) -> None:
            self._copy(backward)

        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if forward:
                self._copy(forward)
            first = next((t for t in pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if backward and first is not None and torch.is_grad_enabled():
                first.register_hook(on_grad)
        return hook

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def tokens_to_image_size(tokens: int, text_tokens: int, patch: int) -> int:
    """Latent side giving about ``tokens`` joint tokens in the DiT (image grid + text)."""
    grid = max(1, round(math.sqrt(max(1, tokens - text_tokens))))
    return grid * patch
