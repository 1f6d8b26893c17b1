"""Swapped blocks whose graph joins the outer autograd graph (no reentrant backward).

:class:`~vramkit.offload.swap.function.SwapBlockFunction` builds each call's graph on detached
inputs and runs a *reentrant* ``torch.autograd.backward`` over it in backward: a clean boundary,
but every call pays for a nested engine run (cProfile on the H200 host, a probe not kept:
~0.3 ms per swapped block per step, which shows where the model is host-bound). For blocks
without swapped trainable weights the boundary is drawn with node pre-hooks on the outputs and an
identity Function on the inputs instead, and the block's own nodes are ordinary nodes of the
outer graph:

* A pre-hook on each node that produced one of the block's outputs
  (:func:`hook_outputs`) runs before any node of the block (every block node is an ancestor
  of the outputs), so it re-acquires the slot there -- before the checkpoint's recomputation,
  which needs the weights, and before any saved
  :class:`~vramkit.offload.swap.function.WeightRef` is unpacked. A hook costs less host time
  than an identity Function (no view, no Python ``backward`` call through the Function
  machinery), which matters where the model is host-bound. :class:`BlockExit`, an identity
  Function on the outputs, does the same where a hook cannot: an output that is an input passed
  through (its node is not the block's), a leaf, or functorch transforms.
* :class:`BlockEntry` wraps the block's inputs. Its backward runs once every gradient the block
  sends to them is computed -- the block's backward is over -- so it releases the slot there.
  A block whose differentiable inputs all come from one output node of the swapped block called
  just before it (a chain of swapped blocks, ``x = block(x)``) needs no entry: the previous
  block's hook on that node (:class:`OutputHook`) runs once every gradient into it is
  computed, which is the same point, and releases this block before re-acquiring its own.
  When no input requires grad (the first block of LoRA training) there is no entry node; the slot
  is released by a callback at the end of the backward pass, by which point that block (the first
  in forward order) is the last one backward reaches anyway.

Saved weights still go through the swapper's saved-tensor hooks (handles, not slot memory), so
the correctness argument is the same as the Function path's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from vramkit.errors import OffloadError

if TYPE_CHECKING:
    from vramkit.offload.swap.records import BlockRuntime, SwappedBlock

__all__ = ["BlockBackward", "BlockEntry", "BlockExit", "OutputHook", "enter_block",
           "exit_block", "hook_outputs"]


class BlockBackward:
    """One call of a swapped block, seen from backward: whether its slot is held for it."""

    __slots__ = ("block", "held", "runtime")

    def __init__(self, runtime: BlockRuntime, block: SwappedBlock) -> None:
        self.runtime = runtime
        self.block = block
        self.held = False

    def start(self) -> None:
        """Backward reached the block's outputs: hold its slot (loaded) until :meth:`finish`."""
        if self.held:
            return
        self.runtime.acquire(self.block, backward=True)
        self.held = True
        # Whatever the graph's shape, the slot is released by the end of this backward.
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def on_outputs(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Pre-hook of a node that produced a block output: backward reached the block."""
        if torch.is_grad_enabled():
            # The engine runs hooks in the graph task's grad mode: create_graph=True. A
            # second-order graph built in the block's backward would save slot weights with no
            # slot held for them when it runs.
            raise OffloadError(
                f"backward with create_graph=True reached swapped block {self.block.name}: "
                "double backward through swapped blocks is not supported",
                hint="Compute higher-order gradients without the swapper (swapper.detach()), "
                     "or leave this block resident.")
        self.start()

    def finish(self) -> None:
        """The block's backward is over: release the slot (prefetching the next blocks)."""
        if not self.held:
            return
        self.held = False
        self.runtime.release(self.block, backward=True)


class OutputHook:
    """Pre-hook of a node that produced an output of a swapped block call.

    Before re-acquiring the call's slot it releases the ``consumers``: the swapped block calls
    made right after it whose every differentiable input is an output of this node. A node's
    pre-hook runs once all gradients into it are computed, so their backward is over by then.
    Releasing first keeps a single slot enough (``num_slots=1``).

    The hook holds no reference to its node: the node holds the hook, and a cycle through
    autograd's C++ graph would never be collected.
    """

    __slots__ = ("call", "consumers")

    def __init__(self, call: BlockBackward) -> None:
        self.call = call
        self.consumers: list[BlockBackward] = []

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        for consumer in self.consumers:
            consumer.finish()
        self.call.on_outputs(grads)


class _BlockBoundary(torch.autograd.Function):
    """Identity on a swapped block's differentiable tensors; ``_on_backward`` runs in backward."""

    @staticmethod
    def _on_backward(call: BlockBackward) -> None:
        raise NotImplementedError

    @staticmethod
    def forward(ctx: Any, call: BlockBackward, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @classmethod
    def backward(cls, ctx: Any, *grads: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # create_graph=True: a second-order graph built here would save slot weights with
            # no slot held for them. Refuse its backward the way PyTorch does for
            # once_differentiable Functions.
            return cls._backward_once(ctx, *grads)
        # Plain backward (the hot path): once_differentiable's no_grad block and checks cost
        # ~6 us per call and change nothing here.
        cls._on_backward(ctx.call)
        return (None, *grads)

    @classmethod
    def _backward_once(cls, ctx: Any, *grads: torch.Tensor | None
                       ) -> tuple[torch.Tensor | None, ...]:
        @once_differentiable
        def run(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            cls._on_backward(ctx.call)
            return (None, *grads)

        return run(ctx, *grads)  # type: ignore[no-any-return]


class BlockEntry(_BlockBoundary):
    """Wraps a swapped block's differentiable inputs; backward releases the block's slot."""

    _on_backward = staticmethod(BlockBackward.finish)


class BlockExit(_BlockBoundary):
    """Wraps a swapped block's differentiable outputs; backward re-acquires its slot."""

    _on_backward = staticmethod(BlockBackward.start)


def _direct_apply(cls: type[torch.autograd.Function]) -> Any:
    """``cls.apply`` without ``Function.apply``'s Python wrapper (signature binding for
    ``setup_context`` and functorch unwrapping, neither of which these Functions use): ~2.5 us
    less per call, four calls per swapped block and step. ``None`` if PyTorch moved it."""
    apply = getattr(super(torch.autograd.Function, cls), "apply", None)
    return apply if callable(apply) else None


_ENTRY_APPLY = _direct_apply(BlockEntry)
_EXIT_APPLY = _direct_apply(BlockExit)


def _apply(cls: type[_BlockBoundary], direct: Any, call: BlockBackward,
           tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if direct is None or torch._C._are_functorch_transforms_active():
        return cls.apply(call, *tensors)  # type: ignore[no-any-return]
    return direct(call, *tensors)  # type: ignore[no-any-return]


def enter_block(call: BlockBackward, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Wrap a swapped block's differentiable inputs in :class:`BlockEntry`."""
    return _apply(BlockEntry, _ENTRY_APPLY, call, tensors)


def exit_block(call: BlockBackward, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Wrap a swapped block's differentiable outputs in :class:`BlockExit`."""
    return _apply(BlockExit, _EXIT_APPLY, call, tensors)


def hook_outputs(call: BlockBackward, outputs: list[torch.Tensor], entry: Any
                 ) -> list[tuple[int, OutputHook]] | None:
    """Make backward hold ``call``'s slot before any node of the block runs, if a hook can.

    Registers an :class:`OutputHook` of ``call`` as a pre-hook on each distinct node that
    produced one of ``outputs`` (tensors that require grad) and returns the hooks with their
    node's sequence number (which identifies the node without keeping its graph alive).
    Returns ``None`` and registers nothing when one of them was not produced by the block (a
    leaf, or an input passed through: its node is ``entry``, the node the block's inputs come
    from) or functorch transforms are active: the caller wraps the outputs in
    :class:`BlockExit` then.
    """
    if torch._C._are_functorch_transforms_active():
        return None
    nodes: list[Any] = []
    for t in outputs:
        node = t.grad_fn
        if node is None or node is entry:
            return None
        if not any(node is n for n in nodes):
            nodes.append(node)
    hooked = []
    for node in nodes:
        hook = OutputHook(call)
        node.register_prehook(hook)
        hooked.append((node._sequence_nr(), hook))
    return hooked
