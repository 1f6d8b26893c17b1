"""The autograd side of block swapping for blocks with swapped *trainable* weights.

(Blocks whose swapped weights are all frozen -- LoRA, frozen bases -- join the outer graph
instead, without a reentrant backward: see :mod:`vramkit.offload.swap.graph`. This Function keeps
a clean boundary where the host-gradient copies of ``trainable="cpu"`` need one.)

One Function per swapped-block call.

A swapped block's weights live in a GPU slot only while the block runs. Autograd normally keeps
the weights it needs for backward by reference -- but a slot is reused by the next block, so a
kept reference would read another block's bytes in backward (silently wrong gradients; the bug
that the classic trainers' in-place buffer reuse invites). :class:`SwapBlockFunction` therefore
saves a *handle* to the block, never a GPU weight:

* the block's graph is built *inside* the Function (its inputs detached) under a
  ``saved_tensors_hooks`` pair that replaces every saved tensor lying in the block's slot by a
  :class:`WeightRef` (offset, shape, strides, dtype). Backward re-acquires the slot and the
  unpack hook rebuilds the tensor from the slot's *current* memory, which holds the same bytes;
* a **checkpointed** block runs under PyTorch's non-reentrant checkpoint inside that graph: it
  keeps only the inputs, and its recomputation happens in backward while the block holds its
  slot (RNG state replayed, recomputation stopped early once the saved tensors are rebuilt).

Backward calls ``torch.autograd.backward`` on the inner graph (a reentrant backward), so every
kernel that reads the slot has been enqueued when the Function returns and the slot's "free"
event can be recorded right after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from vramkit.errors import OffloadError
from vramkit.offload import _tree
from vramkit.offload.swap.records import WeightRef

if TYPE_CHECKING:
    from vramkit.offload.swap.records import BlockRuntime, SwappedBlock

__all__ = ["BlockCall", "SwapBlockFunction", "WeightRef"]


class BlockCall:
    """One call of a swapped block: its inputs' structure, mode and (non-checkpointed) graph."""

    __slots__ = (
        "__weakref__",
        "block",
        "checkpointed",
        "fn",
        "in_spec",
        "inner_inputs",
        "inner_outputs",
        "is_tensor",
        "leaves",
        "out_is_tensor",
        "out_leaves",
        "out_spec",
        "runtime",
    )

    def __init__(self, runtime: BlockRuntime, block: SwappedBlock, fn: Callable[..., Any],
                 leaves: list[Any], in_spec: Any, checkpointed: bool) -> None:
        """``leaves`` and ``in_spec``: ``_tree.flatten((args, kwargs))`` of the call."""
        self.runtime = runtime
        self.block = block
        self.fn = fn
        self.checkpointed = checkpointed
        self.in_spec = in_spec
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        # Non-tensor leaves are kept here; tensor leaves travel through Function.apply.
        self.leaves = [None if t else x for x, t in zip(leaves, self.is_tensor, strict=False)]
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_is_tensor: list[bool] = []
        self.inner_inputs: list[torch.Tensor] | None = None
        self.inner_outputs: list[torch.Tensor] | None = None

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else x for x, t in zip(self.leaves, self.is_tensor, strict=False)]
        args, kwargs = _tree.unflatten(leaves, self.in_spec)
        return self.fn(*args, **kwargs)

    def detached_runner(self) -> Callable[..., Any]:
        """``run`` as a function that does not reference this object: the checkpoint's unpack
        hook (held by C++) keeps it alive, and a reference back to the call would form a cycle
        the garbage collector cannot see when backward never runs."""
        fn, leaves, is_tensor, spec = self.fn, self.leaves, self.is_tensor, self.in_spec

        def run(*tensors: torch.Tensor) -> Any:
            it = iter(tensors)
            merged = [next(it) if t else x for x, t in zip(leaves, is_tensor, strict=False)]
            args, kwargs = _tree.unflatten(merged, spec)
            return fn(*args, **kwargs)

        return run

    def split_outputs(self, out: Any) -> list[torch.Tensor]:
        """The output's tensors; its structure and other leaves are kept for rebuild_outputs."""
        leaves, self.out_spec = _tree.flatten(out)
        self.out_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.out_leaves = [None if t else x for x, t in zip(leaves, self.out_is_tensor, strict=False)]
        return [x for x, t in zip(leaves, self.out_is_tensor, strict=True) if t]

    def rebuild_outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        merged = [next(it) if t else x for x, t in zip(self.out_leaves, self.out_is_tensor, strict=False)]
        return _tree.unflatten(merged, self.out_spec)


def _detach_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        d = t.detach()
        if t.requires_grad:
            d.requires_grad_(True)
        out.append(d)
    return out


class SwapBlockFunction(torch.autograd.Function):
    """Runs one swapped block; saves a block handle, never the slot's GPU weights."""

    @staticmethod
    def forward(ctx: Any, call: BlockCall, _anchor: torch.Tensor | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        runtime, block = call.runtime, call.block
        ctx.call = call
        ctx.set_materialize_grads(False)
        runtime.acquire(block, backward=False)
        try:
            inputs = _detach_like(tensors)
            with torch.enable_grad(), runtime.weight_hooks(block):
                if call.checkpointed:
                    # PyTorch's non-reentrant checkpoint keeps only the inputs, recomputes in
                    # backward (which runs while the block holds its slot) and stops the
                    # recomputation as soon as the saved tensors are rebuilt.
                    out = torch_checkpoint(call.detached_runner(), *inputs, use_reentrant=False,
                                           preserve_rng_state=runtime.preserve_rng_state)
                else:
                    out = call.run(inputs)
            outs = call.split_outputs(out)
            call.inner_inputs = inputs
            call.inner_outputs = outs
        finally:
            runtime.release(block, backward=False)
        outs = [o.detach() for o in outs]
        non_diff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: BlockCall = ctx.call
        runtime, block = call.runtime, call.block
        if call.inner_inputs is None or call.inner_outputs is None:
            raise OffloadError(
                f"backward through swapped block {block.name} ran twice",
                hint="Swapped blocks free their graph after backward; retain_graph=True "
                     "is not supported through a BlockSwapper.")
        inputs, outs = call.inner_inputs, call.inner_outputs
        runtime.acquire(block, backward=True)
        try:
            pairs = [(o, g) for o, g in zip(outs, grads, strict=False)
                     if g is not None and o.requires_grad]
            # begin/end run even when no gradient reaches the block: its step (or its
            # accumulation window) counts every backward of a call.
            runtime.begin_block_backward(block)
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            runtime.end_block_backward(block)
            input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        finally:
            call.inner_inputs = call.inner_outputs = None
            runtime.release(block, backward=True)
        return (None, None, *input_grads)
