"""Full fine-tuning of swapped blocks with the optimizer on the GPU (``trainable="swap"``).

With ``SwapConfig(trainable="swap")`` and ``BlockSwapper(..., optimizer=factory)`` every swapped
block with trainable weights gets its own optimizer, ``factory(block_params)``, and its optimizer
state lives next to its weights in pinned host memory: one flat *state master* per block (512-byte
aligned offsets, raw bytes of any dtype, as the weight masters). A step of block ``b``:

1. ``b`` is acquired for backward (its weights are in a GPU slot, loaded or prefetched as
   usual); its state master is copied host->device into one of the GPU *state slots*
   (``num_slots`` of them, at least two) on the copy stream: right after its weights when they
   are prefetched in backward and a slot is free, else right before its backward runs; either
   way overlapping backward compute.
2. Once the block's gradients are complete (its last call's backward in this pass), its
   optimizer steps on the compute stream, on the slot: weights in the weight slot, states in the
   state slot, gradients where autograd left them.
3. The updated trainable weights and the state go device->host into the masters on the second
   copy stream (overlapping the next blocks' compute and loads); the gradients are dropped. The
   slot keeps the updated weights, so the next forward may hit it.

Gradients never leave the GPU in the plain case. The first step of a block creates its state
the optimizer's own way (on the GPU, fresh tensors); the swapper then *adopts* it: every state
tensor with at least one dimension on the device gets a place in a new pinned state master, and
from then on only travels. Scalars (step counters) stay where the optimizer keeps them.

Gradient accumulation (``SwapConfig(accumulation_steps=N)``): the first ``N - 1`` backward
passes of a block copy its gradients device->host into a pinned gradient buffer; the ``N``-th
starts from that buffer (host->device) and steps. Cost: the gradient bytes once each way per
non-final micro-batch.

Gradient clipping by global norm (``SwapConfig(max_grad_norm=...)``) needs every gradient before
any step, so the step is *deferred*: at the end of the accumulation window each block's
per-tensor gradient norms are taken on the GPU and its gradients go to the pinned buffer;
:meth:`SwapStepper.clip_grad_norm_` adds the resident gradients' norms, clips those in place and
fixes the coefficient; :func:`vramkit.offload.swap.optimizer.run_pending_steps`
(``swapper.optimizer.step()``) then walks
the blocks in backward order, loading weights, state and gradients, scaling, stepping and writing
back. Cost: the gradients once each way, plus one extra transfer-bound pass that moves the
weights and states (the in-backward step hides those copies behind backward compute).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vramkit._validate import check_number
from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.layout import align_up
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.offload.swap.records import ALIGN, SwappedBlock, complete_gradients, typed_view

if TYPE_CHECKING:
    from vramkit.memory.transfer import Streams

__all__ = ["BlockOptimizer", "OptimizerFactory", "SwapStepper"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StateEntry:
    """One state tensor of a block optimizer: where it lives in the block's state slot layout
    (``offset``) and in its dtype's host master (``group``)."""

    param: nn.Parameter
    key: Any
    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    group: int = 0


@dataclass
class StateGroup:
    """The state tensors of one dtype of a block: one pinned allocation of their own (so that
    ``torch.save`` of a state dict never meets two dtypes viewing one storage), copied to and
    from ``[start, start + nbytes)`` of a state slot."""

    dtype: torch.dtype
    start: int
    nbytes: int
    master_block: Any = None
    master: torch.Tensor | None = None  # uint8 view


class BlockOptimizer:
    """One swapped block's optimizer and where its state and step stand."""

    def __init__(self, block: SwappedBlock, optimizer: torch.optim.Optimizer) -> None:
        self.block = block
        self.optimizer = optimizer
        self.params = [e.tensor for e in block.trainable_entries]
        self.entries: list[StateEntry] | None = None  # None until the state is adopted
        self.nbytes = 0
        self.groups: list[StateGroup] = []  # the state masters, one per dtype
        self.slot_views: dict[int, list[torch.Tensor]] = {}
        self.placeholders: list[torch.Tensor] = []
        # Training calls whose graph is alive and not back-propagated yet (a graph dropped
        # without backward takes its call with it).
        self.calls: weakref.WeakSet[Any] = weakref.WeakSet()
        self.micro_steps = 0  # complete backward passes since the last step
        self.host_grads: list[bool] = [False] * len(self.params)  # accumulated in the buffer
        self.grads_loaded = False  # this pass already started from the host gradients
        self.norms: dict[int, torch.Tensor] = {}  # id(param) -> its gradient norm (clipping)
        self.step_pending = False  # clipping: gradients complete, step deferred
        self.state_slot: _StateSlot | None = None  # the state slot loaded for the next step


class _StateSlot:
    __slots__ = ("buffer", "free_event", "index", "loaded_event", "owner", "pool_block")

    def __init__(self, index: int, pool_block: Any, buffer: torch.Tensor, streams: Streams
                 ) -> None:
        self.index = index
        self.pool_block = pool_block
        self.buffer = buffer
        self.loaded_event = streams.event()
        self.free_event: Any = None  # the last device->host copy out of it
        self.owner: BlockOptimizer | None = None


class SwapStepper:
    """Steps the block optimizers of a swapper with ``trainable="swap"`` (module docstring).

    Args:
        blocks: the swapped blocks with trainable entries.
        factory: builds one block's optimizer from its parameters.
        device: the compute device.
        streams: the device's copy streams.
        host_pool: creates a host pool (pinned on CUDA) for state masters.
        accumulation_steps: backward passes per step.
        max_grad_norm: clip by global L2 norm (deferred step), or ``None``.
        counters: the swapper's transfer counters (``h2d_bytes``/``d2h_bytes`` are added to).
        state_slots: GPU state slots (at least 2; the swapper passes its ring's ``num_slots``):
            beyond the block stepping now and the one whose state goes back to the host, the
            others hold states prefetched for the next blocks of backward.
    """

    def __init__(self, blocks: list[SwappedBlock], factory: OptimizerFactory,
                 device: torch.device, streams: Streams,
                 host_pool: Callable[[], MemoryPool], *, accumulation_steps: int,
                 max_grad_norm: float | None, counters: dict[str, int],
                 state_slots: int = 2) -> None:
        self.device = device
        self.state_slots = max(2, int(state_slots))
        self.streams = streams
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.counters = counters
        self.steps = 0  # block optimizer steps taken
        self.gradient_hook: Any = None  # BlockSwapper.set_gradient_hook
        self._host_pool_factory = host_pool
        self._state_pool: MemoryPool | None = None
        self._slot_pool: MemoryPool | None = None
        self._slots: list[_StateSlot] = []
        self._slot_bytes = 0
        self._next_slot = 0
        self._clip_coef: torch.Tensor | None = None
        self._placeholder: dict[torch.dtype, torch.Tensor] = {}
        self.by_block: dict[int, BlockOptimizer] = {}
        for block in blocks:
            params = [e.tensor for e in block.trainable_entries]
            optimizer = factory(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigError(
                    f"the optimizer factory returned a {type(optimizer).__name__}, not a "
                    "torch.optim.Optimizer",
                    hint="Pass a callable such as lambda params: torch.optim.AdamW(params, "
                         "lr=1e-5).")
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            if {id(p) for p in owned} != {id(p) for p in params} or len(owned) != len(params):
                raise ConfigError(
                    f"the optimizer built for swapped block {block.name} does not hold exactly "
                    f"the {len(params)} parameters it was given",
                    hint="The factory must build its optimizer over the list it receives "
                         "(lambda params: AdamW(params, ...)), not over model.parameters().")
            self.by_block[id(block)] = BlockOptimizer(block, optimizer)

    # -- the forward/backward protocol ------------------------------------------------------

    def forward_call(self, block: SwappedBlock, call: Any) -> None:
        """A training call of ``block``; ``call`` (its ``BlockCall``) holds ``inner_inputs``
        until its backward has run."""
        bo = self.by_block[id(block)]
        if bo.step_pending:
            raise OffloadError(
                f"swapped block {block.name} has a deferred optimizer step waiting: "
                "SwapConfig.max_grad_norm defers the steps of swapped blocks until the "
                "gradients are clipped",
                hint="After backward call swapper.clip_grad_norm_() and then "
                     "swapper.optimizer.step() before the next forward.")
        bo.calls.add(call)

    @staticmethod
    def _other_calls(bo: BlockOptimizer) -> int:
        """Calls of the block still waiting for their backward, besides the one running now
        (a call's ``inner_inputs`` are cleared once its backward is done)."""
        return max(0, sum(1 for c in bo.calls if c.inner_inputs is not None) - 1)

    def _finishing(self, bo: BlockOptimizer) -> bool:
        """Whether the backward about to run completes the block's accumulation window."""
        return (not self._other_calls(bo)
                and bo.micro_steps + 1 >= self.accumulation_steps)

    def begin(self, block: SwappedBlock) -> None:
        """Before the block's backward: accumulated gradients come back from the host, and the
        state is loaded when this backward will step."""
        bo = self.by_block[id(block)]
        if any(bo.host_grads) and not bo.grads_loaded:
            self._load_host_grads(bo)
        if self._finishing(bo) and self.max_grad_norm is None:
            self._load_state(bo)

    def end(self, block: SwappedBlock) -> None:
        """After the block's backward: step, or park the gradients on the host."""
        bo = self.by_block[id(block)]
        if self._other_calls(bo):
            return  # another call of this block still back-propagates into the same gradients
        bo.grads_loaded = False
        bo.micro_steps += 1
        if bo.micro_steps < self.accumulation_steps:
            self._park_grads(bo)
            return
        bo.micro_steps = 0
        finish = complete_gradients(self.gradient_hook, block,
                                    [p.grad for p in bo.params if p.grad is not None])
        if finish is not None:  # the step (or the norms) read them next, on this stream
            finish()
        if self.max_grad_norm is None:
            self._step(bo)
            return
        with_grad = [p for p in bo.params if p.grad is not None]
        norms = torch._foreach_norm([p.grad for p in with_grad]) if with_grad else []
        bo.norms = {id(p): n for p, n in zip(with_grad, norms, strict=True)}
        self._park_grads(bo)
        bo.step_pending = True

    # -- gradients ----------------------------------------------------------------------------

    def _load_host_grads(self, bo: BlockOptimizer) -> None:
        block = bo.block
        if block.grad_event is not None:
            self.streams.wait(self.streams.current(), block.grad_event)
        assert block.grad_buffer is not None
        for i, e in enumerate(block.trainable_entries):
            if bo.host_grads[i]:
                host = typed_view(block.grad_buffer, e.offset, e)
                grad = torch.empty(e.shape, dtype=e.dtype, device=self.device)
                grad.copy_(host, non_blocking=True)
                e.tensor.grad = grad
                self.counters["h2d_bytes"] += e.nbytes
        bo.grads_loaded = True

    def _park_grads(self, bo: BlockOptimizer) -> None:
        """Gradients device->host into the pinned buffer (the GPU copies are dropped)."""
        block = bo.block
        if block.grad_buffer is None:
            raise OffloadError(f"swapped block {block.name} has no gradient buffer",
                               hint="This is a vramkit bug; please report it with the config.")
        streams = self.streams
        ready = streams.event()
        streams.record(ready, streams.current())
        streams.wait(streams.d2h, ready)
        copied = False
        for i, e in enumerate(block.trainable_entries):
            grad = e.tensor.grad
            if grad is None:
                continue
            streams.copy(typed_view(block.grad_buffer, e.offset, e), grad, streams.d2h,
                         block.name)
            if grad.device.type == "cuda":
                grad.record_stream(streams.d2h)
            e.tensor.grad = None
            bo.host_grads[i] = True
            self.counters["d2h_bytes"] += e.nbytes
            copied = True
        if copied:
            block.grad_event = streams.event()
            streams.record(block.grad_event, streams.d2h)

    # -- state --------------------------------------------------------------------------------

    def _load_state(self, bo: BlockOptimizer, slot: _StateSlot | None = None) -> None:
        """Host->device copy of the block's state master into a state slot (copy stream)."""
        if not bo.groups or bo.state_slot is not None:
            return  # not adopted yet (the first step creates the state), or already loaded
        if slot is None:
            slot = self._take_slot(bo)
        streams = self.streams
        if slot.free_event is not None:
            streams.wait(streams.h2d, slot.free_event)
        if bo.block.writeback_event is not None:  # the last write into this master
            streams.wait(streams.h2d, bo.block.writeback_event)
        for g in bo.groups:
            streams.copy(slot.buffer[g.start:g.start + g.nbytes], g.master, streams.h2d,
                         bo.block.name + " state")
        streams.record(slot.loaded_event, streams.h2d)
        self.counters["h2d_bytes"] += bo.nbytes
        slot.owner = bo
        bo.state_slot = slot

    def prefetch_state(self, block: SwappedBlock) -> None:
        """Load the state of a block whose backward comes soon (its weights were just queued on
        the copy stream, so the state follows them), where that backward will step and a state
        slot is free without waiting: its device->host copy done, and another slot left free
        for a block that needs one at once. Without it the state is loaded when the block's
        backward begins, queued behind the next blocks' weights."""
        bo = self.by_block.get(id(block))
        if (bo is None or not bo.groups or bo.state_slot is not None or bo.step_pending
                or self.max_grad_norm is not None
                or bo.micro_steps + 1 < self.accumulation_steps
                or bo.nbytes > self._slot_bytes):
            return
        free = [s for s in self._slots if s.owner is None or s.owner.state_slot is not s]
        if len(free) < 2:
            return
        ready = [s for s in free
                 if s.free_event is None or self.streams.done(s.free_event)]
        if not ready:
            return
        self._load_state(bo, ready[0])
        self.counters["state_prefetched"] += 1

    def _take_slot(self, bo: BlockOptimizer) -> _StateSlot:
        if bo.nbytes > self._slot_bytes:
            self._allocate_slots(max(bo.nbytes, self._largest_state()))
        for _ in range(len(self._slots)):
            slot = self._slots[self._next_slot]
            self._next_slot = (self._next_slot + 1) % len(self._slots)
            if slot.owner is None or slot.owner.state_slot is not slot:
                return slot
        raise OffloadError("no free optimizer state slot",
                           hint="This is a vramkit bug; please report it with the model.")

    def _largest_state(self) -> int:
        return max((bo.nbytes for bo in self.by_block.values()), default=0)

    def _allocate_slots(self, nbytes: int) -> None:
        """``state_slots`` state slots of ``nbytes``; a larger block adopted later re-allocates
        them (rare: blocks normally adopt their state in the same first step)."""
        if self._slots:
            if any(s.owner is not None and s.owner.state_slot is s for s in self._slots):
                raise OffloadError("optimizer state slots are resized while in use",
                                   hint="This is a vramkit bug; please report it.")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._free_slots()
        size = align_up(nbytes, ALIGN)
        count = self.state_slots
        self._slot_pool = MemoryPool(self.device, PoolConfig(
            initial_size=count * size, max_size=count * size, growth_factor=1.0,
            alignment=ALIGN, max_cached_buffers=0))
        for i in range(count):
            pool_block = self._slot_pool.allocate(size)
            self._slots.append(_StateSlot(i, pool_block, pool_block.view((size,), torch.uint8),
                                          self.streams))
        self._slot_bytes = size

    def _free_slots(self) -> None:
        for slot in self._slots:
            if not slot.pool_block.freed:
                slot.pool_block.free()
        self._slots = []
        self._slot_bytes = 0
        if self._slot_pool is not None:
            self._slot_pool.clear(force=True)
            self._slot_pool = None

    def _adopt(self, bo: BlockOptimizer) -> None:
        """Give the state the optimizer just created a place in new pinned state masters."""
        self._lay_out(bo, [(p, key, value) for p in bo.params
                           for key, value in bo.optimizer.state.get(p, {}).items()
                           if isinstance(value, torch.Tensor) and value.dim() >= 1
                           and value.device == self.device])

    def _lay_out(self, bo: BlockOptimizer, items: list[tuple[nn.Parameter, Any, torch.Tensor]]
                 ) -> None:
        """Entries grouped by dtype at aligned offsets, one host master per dtype."""
        entries: list[StateEntry] = []
        groups: list[StateGroup] = []
        offset = 0
        for dtype in dict.fromkeys(t.dtype for _, _, t in items):
            start = offset = align_up(offset, ALIGN)
            for p, key, t in items:
                if t.dtype == dtype:
                    offset = align_up(offset, ALIGN)
                    nbytes = t.numel() * t.element_size()
                    entries.append(StateEntry(p, key, offset, nbytes, t.shape, dtype,
                                              len(groups)))
                    offset += nbytes
            groups.append(StateGroup(dtype, start, align_up(offset - start, ALIGN)))
        bo.entries = entries
        bo.nbytes = align_up(offset, ALIGN)
        if not entries:
            return
        if self._state_pool is None:
            self._state_pool = self._host_pool_factory()
        for g in groups:
            g.master_block = self._state_pool.allocate(g.nbytes)
            g.master = g.master_block.view((g.nbytes,), torch.uint8)
        bo.groups = groups
        bo.placeholders = [self._placeholder_for(e) for e in entries]
        self._check_fits_slots(bo)

    @staticmethod
    def _host(bo: BlockOptimizer, e: StateEntry) -> torch.Tensor:
        """The host master view of a state entry."""
        g = bo.groups[e.group]
        assert g.master is not None
        return _typed_at(g.master, e.offset - g.start, e)

    def _check_fits_slots(self, bo: BlockOptimizer) -> None:
        if bo.nbytes > self._slot_bytes and self._slots:
            # Adopted after the slots were sized: re-size now, outside any step.
            if not any(s.owner is not None and s.owner.state_slot is s for s in self._slots):
                self._allocate_slots(self._largest_state())

    def _placeholder_for(self, e: StateEntry) -> torch.Tensor:
        base = self._placeholder.get(e.dtype)
        if base is None:
            base = self._placeholder[e.dtype] = torch.zeros((), dtype=e.dtype,
                                                            device=self.device)
        return base.expand(e.shape)

    def _views(self, bo: BlockOptimizer, slot: _StateSlot) -> list[torch.Tensor]:
        views = bo.slot_views.get(slot.index)
        if views is None or (views and views[0].untyped_storage().data_ptr()
                             != slot.buffer.untyped_storage().data_ptr()):
            views = [_typed_at(slot.buffer, e.offset, e) for e in bo.entries or []]
            bo.slot_views[slot.index] = views
        return views

    # -- the step -----------------------------------------------------------------------------

    def _step(self, bo: BlockOptimizer, scale: torch.Tensor | None = None) -> None:
        """Step ``bo`` on the compute stream and write weights and state back to the host."""
        streams = self.streams
        slot = bo.state_slot
        if slot is not None:
            streams.wait(streams.current(), slot.loaded_event)
            state = bo.optimizer.state
            for e, view in zip(bo.entries or [], self._views(bo, slot), strict=True):
                state[e.param][e.key] = view
        grads = [p.grad for p in bo.params if p.grad is not None]
        if scale is not None and grads:
            torch._foreach_mul_(grads, scale)
        bo.optimizer.step()
        self.steps += 1
        if bo.entries is None:
            self._adopt(bo)
        self._write_back(bo)
        for p in bo.params:
            p.grad = None
        bo.host_grads = [False] * len(bo.params)
        bo.norms = {}
        bo.step_pending = False

    def _write_back(self, bo: BlockOptimizer) -> None:
        """Device->host: the block's trainable weights (from its weight slot) and its state
        (from the state slot, or wherever the optimizer keeps it on its first step)."""
        block = bo.block
        streams = self.streams
        ready = streams.event()
        streams.record(ready, streams.current())
        streams.wait(streams.d2h, ready)
        master = block.master
        weight_slot = block.slot
        if master is None or weight_slot is None:
            raise OffloadError(f"swapped block {block.name} stepped without its slot",
                               hint="This is a vramkit bug; please report it with the model.")
        # The write-back makes master and slot equal: keep the masters' version (shared by
        # every block's master) so that no slot is taken for stale.
        with _preserve_version(master):
            if len(block.trainable_entries) == len(block.entries):
                streams.copy(master, block.slot_flat[weight_slot.index], streams.d2h,
                             block.name)
                self.counters["d2h_bytes"] += block.nbytes
            else:
                views = block.slot_views[weight_slot.index]
                for e, view in zip(block.entries, views, strict=True):
                    if e.trainable:
                        streams.copy(typed_view(master, e.offset, e), view, streams.d2h,
                                     block.name)
                        self.counters["d2h_bytes"] += e.nbytes
        slot = bo.state_slot
        if bo.entries and bo.groups:
            state = bo.optimizer.state
            in_slot = slot is not None and all(
                state[e.param][e.key] is v for e, v in zip(bo.entries, self._views(bo, slot),
                                                           strict=True))
            if in_slot:
                assert slot is not None
                for g in bo.groups:
                    streams.copy(g.master, slot.buffer[g.start:g.start + g.nbytes],
                                 streams.d2h, block.name + " state")
            else:
                for e in bo.entries:
                    value = state[e.param][e.key]
                    if (not isinstance(value, torch.Tensor) or value.shape != e.shape
                            or value.dtype != e.dtype):
                        raise OffloadError(
                            f"the optimizer of swapped block {block.name} replaced its state "
                            f"{e.key!r} by a {_describe(value)} (was {tuple(e.shape)} "
                            f"{e.dtype})",
                            hint="trainable='swap' needs optimizers whose state tensors keep "
                                 "their shape and dtype between steps (torch.optim, AdamW8bit "
                                 "do).")
                    streams.copy(self._host(bo, e), value, streams.d2h,
                                 block.name + " state")
                    if value.device.type == "cuda":
                        value.record_stream(streams.d2h)
            self.counters["d2h_bytes"] += bo.nbytes
            for e, placeholder in zip(bo.entries, bo.placeholders, strict=True):
                state[e.param][e.key] = placeholder
        done = streams.event()
        streams.record(done, streams.d2h)
        block.writeback_event = done
        weight_slot.writeback_event = done
        if slot is not None:
            slot.free_event = done
            bo.state_slot = None

    # -- clipping and deferred steps --------------------------------------------------------

    def clip_grad_norm_(self, resident: Iterable[torch.Tensor], max_norm: float | None,
                        order: Iterable[torch.Tensor] = ()) -> torch.Tensor:
        """The global L2 norm of the resident gradients and the swapped blocks' parked ones;
        resident gradients are scaled in place, swapped ones when their step runs. ``order``:
        the model's parameters, so per-tensor norms are summed in the order
        ``torch.nn.utils.clip_grad_norm_`` would use (grouped by device and dtype)."""
        if self.max_grad_norm is None:
            raise ConfigError(
                "swapper.clip_grad_norm_() needs SwapConfig(max_grad_norm=...): without it the "
                "swapped blocks step inside backward, before a global norm exists",
                hint="Set SwapConfig(max_grad_norm=1.0) (the steps of swapped blocks are then "
                     "deferred to swapper.optimizer.step()).")
        limit = self.max_grad_norm if max_norm is None else check_number(
            "max_norm", max_norm, minimum=0.0, low_open=True,
            hint="Pass e.g. swapper.clip_grad_norm_(1.0).")
        midway = [bo for bo in self.by_block.values()
                  if not bo.step_pending and bo.micro_steps]
        if midway:
            raise OffloadError(
                f"clip_grad_norm_ in the middle of an accumulation window "
                f"({midway[0].block.name} has {midway[0].micro_steps} of "
                f"{self.accumulation_steps} micro-batches)",
                hint="Clip after the last micro-batch of each window "
                     "(SwapConfig.accumulation_steps).")
        with_grad = [p for p in resident if p.grad is not None]
        grads = [p.grad for p in with_grad]
        by_param = dict(zip((id(p) for p in with_grad),
                            torch._foreach_norm(grads) if grads else [], strict=True))
        for bo in self.by_block.values():
            by_param.update(bo.norms)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in order:
            norm = by_param.pop(id(p), None)
            if norm is not None:
                groups.setdefault((p.device, p.dtype), []).append(norm)
        norms = [n for group in groups.values() for n in group] + list(by_param.values())
        if not norms:
            total = torch.zeros((), device=self.device)
        else:
            total = torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]))
        coef = torch.clamp(limit / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self._clip_coef = coef
        return total

    def pending(self) -> list[BlockOptimizer]:
        """Blocks whose (deferred) step is waiting."""
        return [bo for bo in self.by_block.values() if bo.step_pending]

    def step_pending_block(self, bo: BlockOptimizer) -> None:
        """Run a deferred step: the block holds its weight slot (acquired by the caller)."""
        if self._clip_coef is None:
            raise OffloadError(
                "the swapped blocks' gradients have not been clipped yet",
                hint="Call swapper.clip_grad_norm_() after backward, before "
                     "swapper.optimizer.step().")
        self._load_state(bo)
        self._load_host_grads(bo)
        self._step(bo, scale=self._clip_coef)

    def finish_pending(self) -> None:
        """After every deferred step ran."""
        self._clip_coef = None

    # -- synchronization, state dicts, teardown ---------------------------------------------

    def synchronize(self) -> None:
        """Wait (host) until every write-back into the masters has landed. Landed events are
        forgotten (nothing needs to wait on them any more), so a ``state_dict()``, which asks
        once per tensor, syncs each block once."""
        for bo in self.by_block.values():
            event = bo.block.writeback_event
            if event is not None:
                self.streams.synchronize(event)
                bo.block.writeback_event = None

    @contextlib.contextmanager
    def host_state(self) -> Iterator[None]:
        """Within: every adopted state entry is its host master view (for state_dict and
        load_state_dict), afterwards the placeholders again."""
        self.synchronize()
        for bo in self.by_block.values():
            if bo.entries and bo.groups:
                for e in bo.entries:
                    bo.optimizer.state[e.param][e.key] = self._host(bo, e)
        try:
            yield
        finally:
            for bo in self.by_block.values():
                if bo.entries and bo.groups:
                    for e, placeholder in zip(bo.entries, bo.placeholders, strict=True):
                        bo.optimizer.state[e.param][e.key] = placeholder

    def load_block_state(self, bo: BlockOptimizer, state_dict: dict[str, Any]) -> None:
        """Load one block optimizer's state dict into its host master (adopting it when the
        block has not stepped yet); the device never holds the whole state."""
        self.synchronize()
        block = bo.block
        # Point the parameters at their host masters so the optimizer casts the loaded state to
        # host tensors, not to device tensors of the whole model's size.
        saved = [(e.tensor, e.tensor.data) for e in block.trainable_entries]
        for e, view in zip(block.entries, block.master_views, strict=True):
            if e.trainable:
                e.tensor.data = view
        try:
            bo.optimizer.load_state_dict(state_dict)
        finally:
            for tensor, data in saved:
                tensor.data = data
        state = bo.optimizer.state
        if bo.entries is None:
            self._lay_out(bo, [(p, key, value) for p in bo.params
                               for key, value in state.get(p, {}).items()
                               if isinstance(value, torch.Tensor) and value.dim() >= 1])
        for e in bo.entries or []:
            value = state.get(e.param, {}).get(e.key)
            if (not isinstance(value, torch.Tensor) or value.shape != e.shape
                    or value.dtype != e.dtype):
                raise ConfigError(
                    f"the loaded optimizer state of swapped block {block.name} has "
                    f"{e.key!r} as {_describe(value)}, expected {tuple(e.shape)} {e.dtype}",
                    hint="Load a state dict saved from the same model, optimizer and settings.")
            self._host(bo, e).copy_(value)
        for e, placeholder in zip(bo.entries or [], bo.placeholders, strict=True):
            state[e.param][e.key] = placeholder
        # Scalars (step counters) of fused/capturable optimizers live on the device.
        for group in bo.optimizer.param_groups:
            if group.get("fused") or group.get("capturable"):
                for p in group["params"]:
                    for key, value in state.get(p, {}).items():
                        if isinstance(value, torch.Tensor) and value.dim() == 0:
                            state[p][key] = value.to(self.device)
        bo.state_slot = None

    def close(self) -> None:
        """Move every adopted state to the parameters' own devices (the block optimizers stay
        usable on the detached model) and free the state masters and slots (the caller
        synchronized the device)."""
        for bo in self.by_block.values():
            if bo.entries and bo.groups:
                for e in bo.entries:
                    bo.optimizer.state[e.param][e.key] = self._host(bo, e).to(
                        _original_device(bo, e.param), copy=True)
            for g in bo.groups:
                if g.master_block is not None and not g.master_block.freed:
                    g.master_block.free()
            bo.groups = []
            bo.entries = None
            bo.slot_views.clear()
            bo.state_slot = None
        self._free_slots()
        if self._state_pool is not None:
            self._state_pool.clear(force=True)
            self._state_pool = None

    def state_bytes(self) -> int:
        """Host bytes of the adopted state masters."""
        return sum(g.nbytes for bo in self.by_block.values() for g in bo.groups)

    def state_slot_bytes(self) -> int:
        """Device bytes of the state slots."""
        return len(self._slots) * self._slot_bytes


def _typed_at(buffer: torch.Tensor, offset: int, e: StateEntry) -> torch.Tensor:
    count = math.prod(e.shape)
    raw = buffer[offset:offset + count * e.dtype.itemsize]
    return raw.view(e.dtype).view(e.shape)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} tensor"
    return type(value).__name__


def _original_device(bo: BlockOptimizer, param: torch.Tensor) -> torch.device:
    for e in bo.block.trainable_entries:
        if e.tensor is param:
            return e.original_device
    return torch.device("cpu")


@contextlib.contextmanager
def _preserve_version(tensor: torch.Tensor) -> Iterator[None]:
    version = tensor._version
    try:
        yield
    finally:
        setter = torch._C._autograd._unsafe_set_version_counter
        try:
            setter((tensor,), (version,))
        except TypeError:  # PyTorch < 2.6 takes one tensor
            setter(tensor, version)
