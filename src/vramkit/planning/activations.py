"""How many bytes of activations a training step keeps, estimated on the meta device.

:func:`estimate_activations` runs a model's forward (and loss) on meta tensors -- no memory, no
compute -- under a saved-tensor hook that sums the distinct storages autograd keeps for backward,
attributed to the block running, and records what each block takes as input (what a
checkpointed block keeps instead). Attention is counted as the fused kernels training uses save
it (q, k, v, the output and a float32 log-sum-exp per query): on meta tensors
``scaled_dot_product_attention`` takes the math path, whose L x L matrices would inflate the
estimate many times over at long sequences. RMS norm likewise: where torch has the fused kernel
(``torch._fused_rms_norm``, what ``F.rms_norm`` runs on CUDA) it keeps its input as given and a
float32 reciprocal RMS per row, while on meta tensors ``F.rms_norm`` decomposes into float32
ops that keep a float32 copy (FLUX's q/k norms: 57 MB more per block than a GPU keeps,
measured on an H100 with ``benchmarks/investigations/activations_real.py``).

Where the step returns its loss, its backward runs on meta too, followed op by op
(:class:`~vramkit.planning._following.BackwardFollower`): what each block saved and has not
used up, and what its backward makes, at the most of both at once (``backward_peak``).

The :class:`ActivationEstimate` then answers for any choice of checkpointed blocks, which is
what a planner searches over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from vramkit.errors import ConfigError
from vramkit.offload.blocks import block_named
from vramkit.planning._following import (
    BackwardFollower,
    LiveStorages,
    flat_tensors,
    storage_key,
)

__all__ = ["ActivationEstimate", "activation_accounting", "estimate_activations"]


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one training step, by block.

    Attributes:
        per_block: bytes autograd saves inside each block (block name -> bytes), without
            checkpointing.
        inputs: bytes of each block's tensor inputs not already counted (what a checkpointed
            block keeps for its recomputation).
        outside: bytes saved outside every block (embedders, the final layer, the loss).
        tail: the most bytes alive at once of the tensors the step makes after its last block
            that autograd does not save (a language model's logits and their float32 copy for
            the loss: both alive while the copy is made, and their gradients at the start of
            the backward). Temporaries freed before the peak do not count (the final norm's
            float32 intermediates, 192 MiB for Llama-3.1-8B at 4096 tokens).
        transient: the most bytes alive at once of the tensors each block makes while it runs
            (its output included; block name -> bytes): what a forward without autograd holds
            beside the block's inputs (:attr:`inference_peak`).
        enclosing_peak: for blocks split into their children, the inference peak of the whole
            blocks (:attr:`inference_peak` of their estimate): the parent's own code keeps
            tensors between its children's calls (a FLUX single block its MLP branch while the
            attention runs, then their concatenation), which no child's count sees. 0 otherwise.
        backward_peak: the most bytes alive at once while each block's backward runs, of the
            tensors it saved (freed as its backward uses them up) and those the backward makes
            (the incoming gradient, the activation gradients, the kernels' temporaries; not
            the parameters' gradients, which the trainable state counts), followed through a
            backward on meta tensors (block name -> bytes). Empty when no backward ran: then
            :meth:`bytes_with` takes one block's saved bytes for the temporaries.
    """

    per_block: dict[str, int]
    inputs: dict[str, int]
    outside: int
    tail: int = 0
    transient: dict[str, int] = dataclasses.field(default_factory=dict)
    enclosing_peak: int = 0
    backward_peak: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def inference_peak(self) -> int:
        """The most a forward without autograd holds at once inside one block: its inputs and
        what it makes while it runs (0 when nothing was followed), or inside the whole block a
        split one came from (:attr:`enclosing_peak`), whichever is more."""
        return max(self.enclosing_peak,
                   max((self.inputs.get(n, 0) + b for n, b in self.transient.items()),
                       default=0))

    @property
    def largest_block(self) -> int:
        """The most one block saves (its backward temporaries are of that order)."""
        return max(self.per_block.values(), default=0)

    @property
    def full(self) -> int:
        """No checkpointing: every saved tensor, plus one block's worth for backward
        temporaries (activation gradients)."""
        return self.bytes_with(())

    @property
    def checkpointed(self) -> int:
        """Every block checkpointed (see :meth:`bytes_with`)."""
        return self.bytes_with(self.per_block)

    def bytes_with(self, checkpointed: Collection[str]) -> int:
        """The step's peak activation bytes when the blocks named in ``checkpointed`` recompute.

        Blocks are taken in execution order (the order of ``per_block``). A block keeps its
        saved tensors, or only its inputs when checkpointed. The peak is reached at some block
        ``i``, over what the blocks before it keep: in its forward (its inputs and what it
        holds while it runs, :attr:`transient`), in its backward (:attr:`backward_peak`; a
        checkpointed block's recomputation first holds what its forward did), or at the
        step's turn from forward to backward, where every block keeps what it keeps and the
        :attr:`tail` (logits, a loss's float32 copies) is alive, whichever is largest.
        Where the backward was not followed (:attr:`backward_peak` empty, or without the
        block), block ``i``'s backward is taken as its saved tensors plus the largest block's
        (:attr:`largest_block`) for the temporaries. Checkpointing a block lowers the estimate
        unless its inputs weigh more than what it saves (a UNet's late resnets, fed the skip
        connections, can): then it raises it.

        Raises:
            ConfigError: for a name that is not a block of the estimate.
        """
        unknown = [n for n in checkpointed if n not in self.per_block]
        if unknown:
            raise ConfigError(f"not blocks of this estimate: {unknown[:4]}",
                              hint=f"Blocks: {list(self.per_block)[:6]}...")
        chosen = set(checkpointed)
        kept_before = 0
        peak = 0
        for name, saved in self.per_block.items():
            forward = self.inputs[name] + self.transient.get(name, 0)
            # a block the followed backward did not see (its outputs in a structure the hooks
            # do not open) keeps the rule: saved + one block's worth of temporaries
            backward = (self.backward_peak[name] if name in self.backward_peak
                        else saved + self.largest_block if saved else 0)
            peak = max(peak, kept_before + max(forward, backward))
            kept_before += self.inputs[name] if name in chosen else saved
        return self.outside + max(peak, kept_before + self.tail)


class _SavedBytes:
    """Bytes of the distinct storages autograd saves, attributed to the block running."""

    def __init__(self, model: nn.Module, block_names: Iterable[str]) -> None:
        self.param_keys = {storage_key(p) for p in model.parameters()}
        self.param_keys |= {storage_key(b) for b in model.buffers()}
        self.seen: set[int] = set()
        self.input_seen: set[int] = set()
        self.per_block = dict.fromkeys(block_names, 0)
        self.inputs = dict.fromkeys(self.per_block, 0)
        self.current: str | None = None
        self.order: list[str] = []  # blocks in the order they first ran
        self.called: set[str] = set()
        self.outside = 0
        # Forward FLOPs of attention by block (None: outside), counted here because the fused
        # stand-in below replaces the matmuls a FLOP counter would see.
        self.attention_flops: dict[str | None, int] = {}
        # Forward FLOPs of attention recomputed in the backward (a part checkpointed inside a
        # block, :mod:`vramkit.offload.subblock`), by the block whose backward runs.
        self.recomputed_attention: dict[str | None, int] = {}
        # Held until the forward is done: a freed storage's address could be reused by a new
        # one, which would then be taken for a tensor already counted. (Meta: costs nothing.)
        # The blocks' inputs, and the saved tensors with the block that saved them (None:
        # outside every block).
        self.alive: list[torch.Tensor] = []
        self.saved_by: list[tuple[torch.Tensor, str | None]] = []
        # The backward (following_backward): the block whose backward runs (from the moment
        # the gradient of its output arrives), the follower while it runs, and its result.
        self.backward_block: str | None = None
        self.backward_peak: dict[str, int] = {}
        self._follower: BackwardFollower | None = None
        # The tail: storages made outside every block since the last block returned, and the
        # order in which each became alive (+bytes) and dead (-bytes), by id; ids of those
        # autograd saved (counted as outside).
        self._tail_events: list[tuple[int, int]] = []
        self._tail_saved: set[int] = set()
        self._tail = LiveStorages(lambda ident, change: self._tail_events.append(
            (ident, change)))
        # Inside the running block, the storages it makes: the bytes alive now and the most
        # alive at once, by block.
        self.transient = dict.fromkeys(self.per_block, 0)
        self._block_alive = 0
        self._block = LiveStorages(self._block_changed)
        # Whose tensors each block's are, and the blocks whose tensors an op used while another
        # block (or none) ran: a parent's code reading a child's weight, which a swapper of the
        # child would hand an unloaded placeholder.
        self.owner: dict[int, str] = {}  # filled by activation_accounting
        self.foreign: set[str] = set()
        self.repeated: set[str] = set()  # blocks called more than once in the step

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        ident = self._tail.ident(key)
        if ident is not None:  # a tail tensor saved by a later op: counted as outside
            self._tail_saved.add(ident)
        if key not in self.param_keys and key not in self.seen:
            self.seen.add(key)
            self.saved_by.append((t, self.current))
            nbytes = t.untyped_storage().nbytes()
            if self.current is None:
                self.outside += nbytes
            else:
                self.per_block[self.current] += nbytes
        return t

    def estimate(self) -> ActivationEstimate:
        """The estimate, blocks in the order the step first ran them (their execution order;
        blocks that never ran come last)."""
        order = self.order + [n for n in self.per_block if n not in self.called]
        tail = alive = 0
        for ident, change in self._tail_events:
            if ident not in self._tail_saved:
                alive += change
                tail = max(tail, alive)
        return ActivationEstimate(per_block={n: self.per_block[n] for n in order},
                                  inputs={n: self.inputs[n] for n in order},
                                  outside=self.outside, tail=tail,
                                  transient={n: self.transient[n] for n in order},
                                  backward_peak={n: self.backward_peak[n] for n in order
                                                 if n in self.backward_peak})

    def left(self, name: str, out: Any) -> None:
        """Block ``name`` returned ``out``: its backward begins when the gradient of an output
        arrives (a hook on the output's node, in grad mode)."""
        self.current = None
        if not torch.is_grad_enabled():
            return
        for t in flat_tensors((out,), {}):
            node = t.grad_fn
            if node is not None:
                node.register_prehook(functools.partial(self._backward_begins, name))

    def _backward_begins(self, name: str, _grads: Any) -> None:
        self.backward_block = name
        if self._follower is not None:
            self._follower.begins(name)

    @contextlib.contextmanager
    def following_backward(self, model: nn.Module) -> Iterator[None]:
        """Follow the backward the ``with`` body runs (``loss.backward()`` on meta tensors,
        after the forward this record counted): :attr:`backward_peak` by block. The forward's
        tensors are no longer held by this record, so the saved ones die as the backward uses
        them up, as they would on a device."""
        follower = BackwardFollower(self)
        self.alive.clear()
        follower.follow_saved(self.saved_by)
        self.saved_by.clear()
        follower.recording = True
        self._follower = follower
        try:
            with follower:
                yield
        finally:
            follower.recording = False
            self._follower = None
        grads = {storage_key(p.grad) for p in model.parameters() if p.grad is not None}
        self.backward_peak = follower.peaks(
            {i for i in map(follower.made.ident, grads) if i is not None})

    def read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note the blocks whose tensors an op takes while it runs outside them."""
        for t in flat_tensors(args, kwargs):
            owner = self.owner.get(storage_key(t))
            if owner is not None and owner != self.current:
                self.foreign.add(owner)

    def made(self, value: Any) -> None:
        """Note the tensors an op returned: inside a block, what the block holds at once;
        outside every block, after the first, the tail so far."""
        if self.current is not None:
            self._made_in_block(value)
            return
        if not self.called:
            return
        for t in flat_tensors((value,), {}):
            key = storage_key(t)
            if key not in self.param_keys and key not in self.seen:  # saved: outside
                self._tail.follow(t, key)

    def _made_in_block(self, value: Any) -> None:
        for t in flat_tensors((value,), {}):
            key = storage_key(t)
            # not the weights, nor the inputs the block was called with
            if key not in self.param_keys and key not in self.input_seen:
                self._block.follow(t, key)

    def _block_changed(self, _ident: int, change: int) -> None:
        self._block_alive += change
        name = self.current
        if name is not None and self._block_alive > self.transient[name]:
            self.transient[name] = self._block_alive

    def enter(self, name: str, tensors: Iterable[torch.Tensor]) -> None:
        self.current = name
        # a block ran again: what came before is not the tail (their deaths are no longer
        # news), nor what the block before made (its output is this block's input)
        self._tail.clear()
        self._tail_events.clear()
        self._block.clear()
        self._block_alive = 0
        if name not in self.called:
            self.called.add(name)
            self.order.append(name)
        else:
            self.repeated.add(name)
        for t in tensors:
            key = storage_key(t)
            if key in self.param_keys or key in self.input_seen:
                continue
            self.input_seen.add(key)
            self.alive.append(t)
            self.inputs[name] += t.untyped_storage().nbytes()


# Where torch has the fused RMS norm, CUDA's F.rms_norm runs it (saving the input as given and
# a float32 reciprocal RMS per row) instead of the float32 decomposition meta tensors take.
_FUSED_RMS_NORM = hasattr(torch, "_fused_rms_norm")
_RMS_NORMS = frozenset(f for f in (getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None))
                       if f is not None)


class _AttentionOnMeta(torch.autograd.Function):
    """Fused attention's memory on meta tensors: it saves q, k, v, the output and a float32
    log-sum-exp per query; its backward makes the inputs' gradients beside a float32
    accumulator of the query's (flash attention's). Computes nothing."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _out, _lse = ctx.saved_tensors
        accumulator = q.new_empty(q.shape, dtype=torch.float32)
        grads = tuple(t.new_empty(t.shape) if needed else None
                      for t, needed in zip((q, k, v), ctx.needs_input_grad, strict=True))
        del accumulator
        return grads


class _RmsNormOnMeta(torch.autograd.Function):
    """The fused RMS norm's memory on meta tensors: it saves its input as given and a float32
    reciprocal RMS per row; its backward makes the input's (and the weight's) gradient.
    Computes nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                dims: int) -> torch.Tensor:
        dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        rows = x.shape[:x.dim() - dims]
        ctx.save_for_backward(x, x.new_empty(rows, dtype=torch.float32))
        ctx.weight_shape = None if weight is None else (weight.shape, weight.dtype)
        return x.new_empty(x.shape, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, _rstd = ctx.saved_tensors
        dx = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1] and ctx.weight_shape is not None:
            dw = x.new_empty(ctx.weight_shape[0], dtype=ctx.weight_shape[1])
        return dx, dw, None


class _FusedKernelsOnMeta(TorchFunctionMode):
    """Account attention as the fused kernels (flash / memory-efficient on CUDA, flash on the
    CPU) save it: q, k, v, the output and a float32 log-sum-exp per query; RMS norm on meta
    tensors as the fused kernel saves it (where torch has one); and note what each op outside
    the blocks returns (the step's tail)."""

    #: entered again around a checkpointed part's recomputation in the backward
    #: (:data:`vramkit.offload.subblock.REPLAY_ATTRIBUTE`: torch's checkpoint runs it without
    #: the function modes of its forward): fused attention there, not the math path's
    #: L x L matrices
    replay_in_recompute = True

    def __init__(self, saved: _SavedBytes) -> None:
        super().__init__()
        self.saved = saved

    def _rms_norm(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        names = ("input", "normalized_shape", "weight", "eps")
        given = dict(zip(names, args, strict=False)) | kwargs
        x, weight = given["input"], given.get("weight")
        dims = given["normalized_shape"]
        dims = 1 if isinstance(dims, int) else len(dims)
        out: torch.Tensor = _RmsNormOnMeta.apply(x, weight, dims)
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        # a recomputation in the backward: the stand-ins only (the follower follows what is
        # made there), attention's FLOPs counted as recomputed by the block whose backward runs
        backward = self.saved._follower is not None
        if not backward:
            self.saved.read(args, kwargs)
        if func in _RMS_NORMS and _FUSED_RMS_NORM and _needs_grad_on_meta(args, kwargs):
            out = self._rms_norm(args, kwargs)
            if not backward:
                self.saved.made(out)
            return out
        if func is not F.scaled_dot_product_attention:
            out = func(*args, **kwargs)
            if not backward:
                self.saved.made(out)
            return out
        names = ("query", "key", "value")
        q, k, v = (args[i] if i < len(args) else kwargs[names[i]] for i in range(3))
        out = _AttentionOnMeta.apply(q, k, v)
        if not backward:
            self.saved.made(out)
        # q @ k^T and p @ v: 2 FLOPs per multiply-add, over every query-key pair (half of
        # them with a causal mask: fused kernels skip the masked tiles).
        pairs = math.prod(q.shape[:-1]) * k.shape[-2]
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        flops = (2 * pairs * q.shape[-1] + 2 * pairs * v.shape[-1]) // (2 if causal else 1)
        counts = self.saved.recomputed_attention if backward else self.saved.attention_flops
        key = self.saved.backward_block if backward else self.saved.current
        counts[key] = counts.get(key, 0) + flops
        return out


def _needs_grad_on_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an op on these (meta) tensors is recorded by autograd."""
    tensors = flat_tensors(args, kwargs)
    return (torch.is_grad_enabled() and bool(tensors) and tensors[0].device.type == "meta"
            and any(t.requires_grad for t in tensors))


@contextlib.contextmanager
def activation_accounting(model: nn.Module, block_names: Iterable[str]) -> Iterator[_SavedBytes]:
    """Count what autograd saves while the ``with`` body runs a forward on meta tensors.

    The yielded record has ``per_block``, ``inputs``, ``outside`` (bytes, as in
    :class:`ActivationEstimate`) and ``attention_flops`` (forward FLOPs of attention by block,
    ``None`` for attention outside the blocks). :func:`estimate_activations` is this around
    one step; a planner can run a FLOP counter in the same pass.

    Raises:
        ConfigError: when ``block_names`` names a module the model does not have.
    """
    names = list(block_names)
    saved = _SavedBytes(model, names)
    handles = []
    try:
        for name in names:
            block = block_named(model, name)
            for t in (*block.parameters(), *block.buffers()):
                saved.owner[storage_key(t)] = name

            def enter(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      name: str = name) -> None:
                saved.enter(name, flat_tensors(args, kwargs))

            def leave(_m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
                saved.left(name, out)

            handles += [block.register_forward_pre_hook(enter, with_kwargs=True),
                        block.register_forward_hook(leave)]
        with (torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
              _FusedKernelsOnMeta(saved)):
            yield saved
    finally:
        for handle in handles:
            handle.remove()


def estimate_activations(model: nn.Module, step: Callable[[], Any],
                         block_names: Iterable[str]) -> ActivationEstimate:
    """Measure what ``step()`` saves for backward, by block, without running anything real.

    Args:
        model: the model, on the meta device (adapters included); its parameters and buffers
            are not activations.
        step: runs the forward and loss on meta inputs (``lambda: loss_fn(model, batch)``);
            when it returns the scalar loss (requiring grad), its backward is followed too
            (:attr:`ActivationEstimate.backward_peak`).
        block_names: the blocks, as the swapper finds them (qualified module names).

    Returns:
        An :class:`ActivationEstimate`.

    Raises:
        ConfigError: when ``block_names`` names a module the model does not have.
    """
    with activation_accounting(model, block_names) as saved:
        loss = step()
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        had = {id(p) for p in model.parameters() if p.grad is not None}
        with saved.following_backward(model):
            loss.backward()
        for p in model.parameters():  # the meta model as it was given
            if id(p) not in had:
                p.grad = None
    return saved.estimate()
