"""The per-call path of swapped blocks: every call of a swapped block's forward runs here.

:class:`BlockCalls` acquires the block's slot and picks how the call joins autograd:

* no gradients (inference, or nothing to differentiate): acquire, run, release;
* frozen swapped weights: the call's nodes join the outer graph
  (:mod:`vramkit.offload.swap.graph`, output hooks and an identity Function on the inputs);
* swapped trainable weights: the call runs inside
  :class:`~vramkit.offload.swap.function.SwapBlockFunction`, which recomputes and
  back-propagates in its own backward.

This path runs once per block and step where the swapper is host-bound: it avoids tree walks
for calls made of plain tensors, and caches whether a block has trainable parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from vramkit.errors import OffloadError
from vramkit.offload import _tree
from vramkit.offload._reach import reach_key, reached_modules
from vramkit.offload._structure import structure_epoch
from vramkit.offload.checkpointing import run_checkpointed
from vramkit.offload.swap.function import BlockCall, SwapBlockFunction
from vramkit.offload.swap.graph import (
    BlockBackward,
    OutputHook,
    enter_block,
    exit_block,
    hook_outputs,
)
from vramkit.offload.swap.records import SwappedBlock, WeightRef
from vramkit.offload.swap.ring import SlotRing
from vramkit.offload.swap.stepper import SwapStepper

__all__ = ["BlockCalls"]

# Argument/output types that are leaves for certain (the fast path skips the tree walk for calls
# made only of these); a tensor subclass or a container takes the general path.
_PLAIN_LEAVES = frozenset({torch.Tensor, nn.Parameter, type(None), bool, int, float, str})


class BlockCalls:
    """Runs calls of swapped blocks through ``ring`` (one per attached swapper).

    Args:
        ring: the swapper's slot ring.
        device: where compute runs (the anchor of swapped trainable weights lives there).
        stepper: the block optimizers' stepper (``trainable="swap"``), told of each call.
        preserve_rng_state: replay the RNG state when a checkpointed block is recomputed.
    """

    def __init__(self, ring: SlotRing, device: torch.device, *, stepper: SwapStepper | None,
                 preserve_rng_state: bool) -> None:
        self.ring = ring
        self.device = device
        self.stepper = stepper
        self.preserve_rng_state = preserve_rng_state
        self.trainable_cache: dict[int, bool] = {}
        # Blocks whose call made a gradient no parameter showed (_untold_gradient).
        self.untold: set[int] = set()
        # Output hooks of the swapped call just made (node sequence number, hook): the next
        # call chains to them when its inputs come from one of those nodes (_in_graph).
        self.last_hooks: list[tuple[int, OutputHook]] = []
        self._anchor: torch.Tensor | None = None

    def forget_chain(self) -> None:
        """Backward began: no later call chains to the hooks of the last forward call."""
        self.last_hooks = []

    def _anchor_tensor(self) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        return self._anchor

    def run(self, block: SwappedBlock, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        """Call ``fn(*args, **kwargs)``, the forward of swapped ``block``, with its weights in
        a slot."""
        ring = self.ring
        if ring.observe(block):
            self.trainable_cache.clear()
        chain = self.last_hooks
        if chain:
            self.last_hooks = []  # only the immediately preceding call chains
        if not torch.is_grad_enabled():
            ring.begin_no_grad()  # a collective loader copies plainly (maybe one rank alone)
            ring.training_pass = False
            stream = ring.acquire(block, backward=False)
            try:
                return fn(*args, **kwargs)
            finally:
                ring.release(block, backward=False, stream=stream)
        ring.end_no_grad()
        # Most blocks take plain tensors positionally: one pass over them, no tree walk (this
        # path runs once per block and step, where the swapper is host-bound).
        spec = None
        positions: list[int] | None = [] if not kwargs else None
        if positions is not None:
            for i, a in enumerate(args):
                kind = type(a)
                if kind is torch.Tensor or kind is nn.Parameter:
                    if a.requires_grad:
                        positions.append(i)
                elif kind not in _PLAIN_LEAVES:
                    positions = None
                    break
        if positions is None:
            leaves, spec = _tree.flatten((args, kwargs))
            positions = [i for i, x in enumerate(leaves)
                         if isinstance(x, torch.Tensor) and x.requires_grad]
        else:
            leaves = list(args)
        # Whether the block has trainable parameters only matters when no input requires
        # grad (LoRA on a frozen model's first block) or for the anchor of swapped trainable
        # weights: otherwise the per-pass requires_grad check is skipped.
        if not positions and not self.has_trainable(block):
            ring.training_pass = False
            stream = ring.acquire(block, backward=False)
            try:
                # Grad mode with nothing to differentiate as far as the block's parameters and
                # the adapters hooked into it tell. A trainable tensor they do not show (one a
                # closure holds) still makes the output require grad: _untold_gradient then
                # joins the call to the graph; a slot weight saved for an output the tree does
                # not open fails loudly.
                saved: list[bool] = []
                with ring.weight_hooks(block), _noting_slot_saves(saved):
                    out = fn(*args, **kwargs)
                if saved or _requires_grad(out):
                    ring.training_pass = True
                    return self._untold_gradient(block, out, bool(saved))
                return out
            finally:
                ring.release(block, backward=False, stream=stream)
        ring.training_pass = True
        if not block.trainable_entries:
            return self._in_graph(ring, block, fn, leaves, spec, positions, chain)
        if spec is None:
            spec = _tree.flatten((args, kwargs))[1]
        call = BlockCall(ring, block, fn, leaves, spec, block.checkpointed)
        if self.stepper is not None:
            self.stepper.forward_call(block, call)  # steps after the last call's backward
        tensors = [x for x, t in zip(leaves, call.is_tensor, strict=True) if t]
        anchor = self._anchor_tensor() if self.has_trainable(block) else None
        outs = SwapBlockFunction.apply(call, anchor, *tensors)
        return call.rebuild_outputs(list(outs))

    def _in_graph(self, ring: SlotRing, block: SwappedBlock, fn: Callable[..., Any],
                  leaves: list[Any], spec: Any, positions: list[int],
                  chain: list[tuple[int, OutputHook]]) -> Any:
        """A training call whose nodes join the outer graph (:mod:`~vramkit.offload.swap.graph`):
        pre-hooks on the output nodes and an identity Function on the inputs hold the slot across
        the block's backward. ``spec`` is ``None`` when ``leaves`` are the positional arguments
        themselves; ``positions`` index the leaves that require grad; ``chain`` holds the output
        hooks of the swapped call made just before."""
        call = BlockBackward(ring, block)
        entry = None
        if positions:
            # A chain of swapped blocks: when every differentiable input comes from one output
            # node of the previous call, that node's hook releases this call (no entry Function).
            entry = leaves[positions[0]].grad_fn
            link = None
            if chain and entry is not None:
                number = entry._sequence_nr()
                for n, hook in chain:
                    if n == number:
                        link = hook
                        break
                if link is not None:
                    for i in positions:
                        if leaves[i].grad_fn is not entry:
                            link = None
                            break
            if link is not None:
                link.consumers.append(call)
            else:
                entered = enter_block(call, [leaves[i] for i in positions])
                for i, t in zip(positions, entered, strict=True):
                    leaves[i] = t
                entry = entered[0].grad_fn
        if spec is None:
            args: Any = leaves
            kwargs: dict[str, Any] = {}
        else:
            args, kwargs = _tree.unflatten(leaves, spec)
        stream = ring.acquire(block, backward=False)
        try:
            if block.checkpointed:
                # Keeps the inputs and recomputes in backward after the output hooks
                # re-acquired the slot. Lean: the forward saves nothing but the inputs (no slot
                # weight), and the recomputation's graph lives inside its backward, while the
                # slot is held. PyTorch's: every tensor saved inside goes through the
                # checkpoint's own (innermost) hooks. Either way the swapper's hooks are not
                # needed here.
                out = run_checkpointed(fn, args, kwargs, self.preserve_rng_state,
                                       module=block.module, lean=block.lean)
            else:
                with ring.weight_hooks(block):
                    out = fn(*args, **kwargs)
        finally:
            ring.release(block, backward=False, stream=stream)
        return self._join_outputs(call, out, entry)

    def _join_outputs(self, call: BlockBackward, out: Any, entry: Any) -> Any:
        """``out`` with the block's backward boundary on its differentiable tensors: pre-hooks
        on their nodes (kept for the next call to chain to) or :class:`BlockExit`."""
        if type(out) is torch.Tensor:
            if not out.requires_grad:
                return out
            hooked = hook_outputs(call, [out], entry)
            if hooked is not None:
                self.last_hooks = hooked
                return out
            return exit_block(call, [out])[0]
        if type(out) is tuple and all(type(o) in _PLAIN_LEAVES for o in out):
            out_leaves, out_spec = list(out), None
        else:
            out_leaves, out_spec = _tree.flatten(out)
        outputs = [i for i, x in enumerate(out_leaves)
                   if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outputs:
            return out
        differentiable = [out_leaves[i] for i in outputs]
        hooked = hook_outputs(call, differentiable, entry)
        if hooked is not None:
            self.last_hooks = hooked
            return out
        exited = exit_block(call, differentiable)
        for i, t in zip(outputs, exited, strict=True):
            out_leaves[i] = t
        return tuple(out_leaves) if out_spec is None else _tree.unflatten(out_leaves, out_spec)

    def _untold_gradient(self, block: SwappedBlock, out: Any, saved: bool) -> Any:
        """A call that looked like it needed no gradient made one: a trainable tensor neither
        its inputs, its parameters nor the adapters hooked into it show. Its output joins the
        graph as a training call's would (the slot weights autograd saved are handles already),
        and the block is taken as trainable from now on (until its structure changes), so its
        next calls take the training path (checkpointed, where planned)."""
        self.untold.add(id(block))
        self.trainable_cache[id(block)] = True
        joined = self._join_outputs(BlockBackward(self.ring, block), out, None)
        if joined is out and not _requires_grad(out) and saved:
            raise OffloadError(
                f"autograd saved a weight of swapped block {block.name} although the call "
                "looked like it needed no gradient, and no output of the call requires grad",
                hint="Pass tensors that require grad as plain arguments (or in "
                     "lists/tuples/dicts) of the block's forward, and return them so.")
        return joined

    def has_trainable(self, block: SwappedBlock) -> bool:
        """Whether the block has a parameter that requires grad. Re-read at the start of every
        pass (adapters may be added or weights unfrozen between steps) and cached within it:
        walking the module's parameters costs tens of microseconds per block, so the list is
        kept and listed again only after a module or parameter was registered anywhere
        (PyTorch's global registration hooks count those, ``vramkit.offload._structure``) or a child
        or parameter count of the block's modules changed (writes that bypass those hooks,
        such as ``ModuleList.insert``; replacing an entry of ``_modules`` in place is not
        seen)."""
        cached = self.trainable_cache.get(id(block))
        if cached is None:
            epoch = structure_epoch()
            # Registrations anywhere bump the epoch; writes that skip PyTorch's registration
            # hooks (ModuleList.insert, del) still change a child or parameter count.
            if block.params_epoch != epoch or block.shape_key != reach_key(block.submodules):
                # the block's modules and the adapters hooked into them (vramkit.offload._reach)
                block.submodules = reached_modules(block.module)
                block.params = list(dict.fromkeys(
                    p for m in block.submodules for p in m._parameters.values()
                    if p is not None))
                block.params_epoch = epoch
                block.shape_key = reach_key(block.submodules)
                self.untold.discard(id(block))
            cached = (id(block) in self.untold
                      or any(p.requires_grad for p in block.params))
            self.trainable_cache[id(block)] = cached
        return cached


def _requires_grad(out: Any) -> bool:
    if type(out) is torch.Tensor:
        return out.requires_grad
    leaves, _ = _tree.flatten(out)
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)


@contextlib.contextmanager
def _noting_slot_saves(saved: list[bool]) -> Iterator[None]:
    """Inside the ring's weight hooks: note (in ``saved``) each slot weight autograd saves, the
    ring's hooks doing the saving. Nothing is saved -- the hook never runs -- in a call that
    needs no gradient, the case this path exists for."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is None:  # older PyTorch: the output's requires_grad alone tells
        yield
        return
    pack, unpack = hooks

    def noting(t: torch.Tensor) -> Any:
        packed = pack(t)
        if isinstance(packed, WeightRef):
            saved.append(True)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(noting, unpack):
        yield

