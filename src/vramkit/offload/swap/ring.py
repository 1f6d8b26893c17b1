"""The GPU side of a block swapper: a ring of R slots, the copies that fill them, and the
predicted order that decides what to load next.

A :class:`SlotRing` owns the slots (preallocated from a device
:class:`~vramkit.memory.pool.MemoryPool`, sized to the largest swapped block), learns the order
in which blocks are called, and moves bytes on the device's shared copy streams:

* :meth:`SlotRing.acquire` makes a block usable on the compute stream: a slot that already holds
  it is a hit; otherwise a slot is filled (the least recently used one whose block is not needed
  soon), the copy stream waiting on the slot's *free* event and the compute stream on its
  *loaded* event. The block's tensors are then pointed at the slot (a handful of ``.data``
  repoints: the per-slot views are precomputed).
* :meth:`SlotRing.release` records the slot's *free* event on the compute stream and loads the
  next blocks of the predicted order into slots whose blocks are not among them.
* The order is learnt from the last forward pass and committed when backward starts; backward
  runs it in reverse, inference wraps around to the first blocks.
* :meth:`SlotRing.weight_hooks` turns slot-resident tensors autograd saves into
  :class:`~vramkit.offload.swap.records.WeightRef` handles, and hands every other saved tensor
  to the hooks that were active outside the block (activation offload composes).
* :meth:`SlotRing.end_block_backward` sends a block's trainable gradients device->host into its
  pinned gradient buffer (``trainable="cpu"``).

It implements :class:`~vramkit.offload.swap.records.BlockRuntime`, the interface the autograd
helpers use. No host synchronization happens in steady state.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vramkit.errors import OffloadError
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams
from vramkit.offload.swap.records import (
    ALIGN,
    Slot,
    SwappedBlock,
    WeightRef,
    complete_gradients,
    typed_view,
)

if TYPE_CHECKING:
    from vramkit.offload.swap.disk import DiskTier
    from vramkit.offload.swap.packed import PackedMasters
    from vramkit.offload.swap.staged import StagedCopies
    from vramkit.offload.swap.stepper import SwapStepper

__all__ = ["BlockLoader", "SlotRing"]

COUNTERS = ("loads", "prefetched", "on_demand", "hits", "h2d_bytes", "d2h_bytes", "acquisitions",
            "gathered_bytes", "state_prefetched")
_UNGUARDED = contextlib.nullcontext()  # a load of a block no background encode may switch


class BlockLoader(Protocol):
    """Fills a slot from a block's host master another way than one host->device copy.

    ``vramkit.distributed.ShardedUploads`` implements it: each GPU of a node copies its share of
    the block and the GPUs all-gather the rest over their links. Loads then become collectives:
    every process must load the same blocks in the same order, which the ring guarantees when
    every process makes the same swapped calls (:meth:`SlotRing.local_calls` for the others).
    """

    def prepare(self, names: list[str], sizes: list[int]) -> None:
        """Collective, once at attach: the swapped blocks' names and bytes (the processes must
        agree on them)."""

    def padded_bytes(self, nbytes: int) -> int:
        """Bytes of slot a block of ``nbytes`` needs (>= ``nbytes``)."""

    def load(self, dest: torch.Tensor, source: torch.Tensor, streams: Streams,
             what: str) -> int:
        """Fill ``dest`` (``padded_bytes(source.numel())`` uint8 bytes of a slot) so that its
        first ``source.numel()`` bytes equal ``source``, ordered on ``streams.h2d``. Returns
        the bytes copied from the host."""


class SlotRing:
    """R GPU slots shared by a swapper's blocks (see the module docstring).

    Args:
        blocks: the swapped blocks, masters allocated, in registration order.
        device: the compute device.
        streams: the device's copy streams.
        num_slots: R.
        lookahead: blocks to have in slots when one is released (``SwapConfig.lookahead``).
        preserve_rng_state: replay the RNG when a checkpointed block recomputes.
        on_backward_turn: called when backward starts (the first backward acquisition after
            forward calls).
    """

    def __init__(self, blocks: list[SwappedBlock], device: torch.device, streams: Streams, *,
                 num_slots: int, lookahead: int, preserve_rng_state: bool,
                 on_backward_turn: Callable[[], None] | None = None,
                 loader: BlockLoader | None = None) -> None:
        self.blocks = blocks
        self.device = device
        self.streams = streams
        self.lookahead = lookahead
        self.preserve_rng_state = preserve_rng_state
        self.on_backward_turn = on_backward_turn
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.enqueue_seconds = 0.0
        self.slots: list[Slot] = []
        self.order: list[SwappedBlock] = list(blocks)
        self._position = {id(b): i for i, b in enumerate(self.order)}
        self._upcoming_cache: dict[tuple[int, bool, bool], tuple[list[SwappedBlock],
                                                                 set[int]]] = {}
        self._observed: list[SwappedBlock] = []
        self._observed_ids: set[int] = set()
        self._direction = "forward"
        self.training_pass = False
        self._clock = 0
        self._pool: MemoryPool | None = None
        self.slot_bytes = max((b.nbytes for b in blocks), default=0)
        # Loads through ``loader`` (a collective) unless ``_local`` (local_calls()).
        self.loader = loader
        self._local = False
        self._no_grad_saved: tuple[Any, ...] | None = None  # begin_no_grad's snapshot
        if loader is not None and self.slot_bytes:
            padded = max(loader.padded_bytes(b.nbytes) for b in blocks)
            self.slot_bytes = -(-padded // ALIGN) * ALIGN
        # trainable="swap": steps the blocks' optimizers (vramkit.offload.swap.stepper).
        self.stepper: SwapStepper | None = None
        self.gradient_hook: Any = None  # BlockSwapper.set_gradient_hook
        # host_budget: blocks without a master, read from disk into staging ahead of use.
        self.disk: DiskTier | None = None
        # SwapConfig.compress: blocks whose masters are compressed, decoded after the copy.
        self.packed: PackedMasters | None = None
        # host_memory="pageable": masters copied through a pinned pool on a worker thread
        self.staged: StagedCopies | None = None
        self._disk_cache: dict[tuple[int, bool, bool], list[SwappedBlock]] = {}
        if self.slot_bytes:
            self._allocate(num_slots)

    def _allocate(self, num_slots: int) -> None:
        size = self.slot_bytes
        self._pool = MemoryPool(self.device, PoolConfig(
            initial_size=num_slots * size, max_size=num_slots * size, growth_factor=1.0,
            alignment=ALIGN, max_cached_buffers=0))
        for i in range(num_slots):
            pool_block = self._pool.allocate(size)
            slot = Slot(i, pool_block, pool_block.view((size,), torch.uint8), self.streams)
            self.slots.append(slot)
            for block in self.blocks:
                block.slot_views[i] = [typed_view(slot.buffer, e.offset, e)
                                       for e in block.entries]
                block.slot_flat[i] = slot.buffer[:block.nbytes]

    # -- the predicted order ------------------------------------------------------------------

    def observe(self, block: SwappedBlock) -> bool:
        """Learn the forward order from a forward call of ``block``. Returns whether the call
        starts a new pass (after backward, a block seen twice, or the first call)."""
        new_pass = False
        if self._direction == "backward":
            self._observed, self._observed_ids = [], set()
            new_pass = True
        elif id(block) in self._observed_ids:
            self._commit_order()
            new_pass = True
        elif not self._observed:
            new_pass = True
        self._direction = "forward"
        self._observed.append(block)
        self._observed_ids.add(id(block))
        return new_pass

    def _commit_order(self) -> None:
        if (self._observed and len(self._observed) == len(self.blocks)
                and self._observed != self.order):
            self.order = list(self._observed)
            self._position = {id(b): i for i, b in enumerate(self.order)}
            self._upcoming_cache.clear()
            self._disk_cache.clear()
        self._observed = []
        self._observed_ids = set()

    def _upcoming(self, block: SwappedBlock, backward: bool
                  ) -> tuple[list[SwappedBlock], set[int]]:
        """The next ``lookahead`` distinct blocks needed after ``block`` in the predicted order
        (``block`` itself when it is needed again next: the forward->backward turn), and their
        ids. Cached per order: this runs after every block call, and building the sequence is
        O(blocks)."""
        pos = self._position.get(id(block))
        if pos is None:
            return [], set()
        key = (pos, backward, self.training_pass)
        cached = self._upcoming_cache.get(key)
        if cached is None:
            blocks = self._compute_upcoming(pos, backward)
            cached = self._upcoming_cache[key] = (blocks, {id(b) for b in blocks})
        return cached

    def _upcoming_disk(self, block: SwappedBlock, backward: bool) -> list[SwappedBlock]:
        """The disk blocks needed after ``block``, in order, as many as the disk tier reads
        ahead (``block`` first when it is on disk and not in a slot)."""
        assert self.disk is not None
        pos = self._position.get(id(block))
        if pos is None:
            return []
        key = (pos, backward, self.training_pass)
        cached = self._disk_cache.get(key)
        if cached is None:
            cached = [b for b in self._compute_upcoming(pos, backward, len(self.order))
                      if b.on_disk][:self.disk.depth]
            self._disk_cache[key] = cached
        if block.on_disk and block.slot is None:
            return [block, *(b for b in cached if b is not block)]
        return cached

    def _compute_upcoming(self, pos: int, backward: bool, k: int | None = None
                          ) -> list[SwappedBlock]:
        k = self.lookahead if k is None else k
        order = self.order
        n = len(order)
        if not k or not n:
            return []
        out: list[SwappedBlock] = []
        if backward:
            seq = [order[i] for i in range(pos - 1, -1, -1)]
            seq += order  # then the next step's forward, from the first block
        elif self.training_pass:
            seq = order[pos + 1:] + [order[i] for i in range(n - 1, -1, -1)]
        else:  # inference: wrap around to the first blocks of the next call
            seq = order[pos + 1:] + order
        for b in seq:
            if b in out:
                continue
            out.append(b)
            if len(out) == k:
                break
        return out

    # -- acquire / release --------------------------------------------------------------------

    def acquire(self, block: SwappedBlock, *, backward: bool, stream: Any = None) -> Any:
        """Make ``block`` usable on ``stream`` (default: the current stream, returned): load it
        unless its slot holds it, order the stream after the load, point its tensors at the
        slot."""
        start = time.perf_counter()
        if backward and self._no_grad_saved is not None:
            self.end_no_grad()  # a no-grad call between forward and backward
        if backward and self._direction != "backward":
            self._commit_order()  # the forward just seen predicts this backward
            self._direction = "backward"
            if self.on_backward_turn is not None:
                self.on_backward_turn()
        self.counters["acquisitions"] += 1
        if self.disk is not None:
            self.disk.want(self._upcoming_disk(block, backward))
        slot = block.slot
        if slot is not None and slot.loaded_version == _version(block):
            self.counters["hits"] += 1
        else:
            slot = self._load(block, on_demand=True)
            if slot is None:
                raise OffloadError(
                    f"no free slot for swapped block {block.name}: all "
                    f"{len(self.slots)} slots are in use",
                    hint="A swapped block called inside another swapped block needs more "
                         "slots: raise SwapConfig.num_slots.")
        if stream is None:
            stream = self.streams.current()
        if self.staged is not None:  # the worker must have recorded the loaded event
            self.staged.settle(slot.loaded_event)
        self.streams.wait(stream, slot.loaded_event)
        slot.locked = True
        self._clock += 1
        slot.last_used = self._clock
        if block.bound is not slot:  # still bound when the block kept its slot since last time
            for e, view in zip(block.entries, block.slot_views[slot.index], strict=False):
                e.tensor.data = view
            block.bound = slot
        self.enqueue_seconds += time.perf_counter() - start
        return stream

    def release(self, block: SwappedBlock, *, backward: bool, stream: Any = None) -> None:
        """The block is done with its slot once ``stream`` (default: the current stream) gets
        past this point; prefetch what comes next."""
        start = time.perf_counter()
        slot = block.slot
        if slot is not None:
            self.streams.record(slot.free_event,
                                stream if stream is not None else self.streams.current())
            slot.locked = False
        upcoming, keep = self._upcoming(block, backward)
        stepper = self.stepper if backward else None
        here = self._position.get(id(block), -1)
        for b in upcoming:
            held = b.slot
            if held is None or held.loaded_version != _version(b):
                if self._load(b, on_demand=False, keep=keep) is None:
                    break
            # trainable="swap": the state of a block whose backward comes next follows its
            # weights (not of the next step's first forward blocks, also upcoming here)
            if stepper is not None and self._position.get(id(b), here) < here:
                stepper.prefetch_state(b)
        self.enqueue_seconds += time.perf_counter() - start

    def _load(self, block: SwappedBlock, *, on_demand: bool,
              keep: set[int] | None = None) -> Slot | None:
        """Fill a slot with ``block``: the least recently used unlocked slot whose block is not
        wanted soon. Returns ``None`` when every slot is locked or wanted, or (a prefetch) when
        a block on disk is not read yet."""
        source: torch.Tensor | None = None
        if block.on_disk:
            assert self.disk is not None
            source = self.disk.request(block, wait=on_demand)
            if source is None:
                return None
        slot: Slot | None = None
        for s in self.slots:  # R is small: a plain loop beats building candidate lists
            if s.locked:
                continue
            held = s.block
            if held is block:
                slot = s  # its own slot, reloaded in place
                break
            if held is not None and keep is not None and id(held) in keep:
                continue
            if slot is None or s.last_used < slot.last_used:
                slot = s
        if slot is None:
            if source is not None:
                self.disk.copied(block)  # type: ignore[union-attr]  # nothing copied: unreserve
            return None
        old = slot.block
        if old is not None and old is not block:
            old.slot = None
            old.bound = None
            for e in old.entries:  # eviction: a pointer repoint, nothing copied back
                e.tensor.data = e.placeholder
        fill = block.fill
        if source is None and fill is not None:  # loading in the background: its bytes first
            fill.wait(block)
        # Compressed in the background (SwapConfig.compress): the block cannot switch from its
        # raw master to its compressed one between the choice below and the copy's enqueueing
        with self.packed.guard(block) if self.packed is not None else _UNGUARDED:
            self._copy_in(block, slot, source, on_demand=on_demand)
        return slot

    def _copy_in(self, block: SwappedBlock, slot: Slot, source: torch.Tensor | None, *,
                 on_demand: bool) -> None:
        """Enqueue ``block``'s copy into ``slot`` (its disk staging ``source``, its compressed
        master, or its raw master) and take the slot."""
        streams = self.streams
        # pageable masters: the staging worker enqueues the waits right before its copies
        packed = self.packed is not None and self.packed.holds(block)
        # (compressed masters: PackedMasters.load copies them, through the staging pool's
        # worker where the payloads are pageable, and says where the loaded event goes)
        staged = self.staged if source is None and not packed else None
        if staged is None:
            if self.staged is not None:  # a disk block: a staged fill of this slot goes first
                self.staged.settle(slot.loaded_event)
            streams.wait(streams.h2d, slot.free_event)
        if slot.writeback_event is not None:  # trainable="swap": updated weights leaving it
            streams.wait(streams.h2d, slot.writeback_event)
        if block.writeback_event is not None:  # ... and arriving in this block's master
            streams.wait(streams.h2d, block.writeback_event)
        if source is None and not packed:
            source = block.master
            if source is None:
                raise OffloadError(f"swapped block {block.name} has no host master",
                                   hint="This is a vramkit bug; please report it with the "
                                        "model.")
        loaded_on = streams.h2d
        if packed:  # SwapConfig.compress: the copy, then the decode on the stream returned
            # sharded uploads gather the compressed payload (the processes' loads match)
            loader = self.loader if source is None and not self._local else None
            copied, loaded_on = self.packed.load(  # type: ignore[union-attr]
                block, block.slot_flat[slot.index], source, slot.loaded_event, loader=loader)
            if loader is not None:
                self.counters["gathered_bytes"] += (
                    self.packed.packed[id(block)].compressed_nbytes - copied)  # type: ignore[union-attr]
        elif staged is not None:  # through the pinned staging pool, on its worker thread
            staged.copy_in(block.slot_flat[slot.index], source, slot.loaded_event,
                           waits=(slot.free_event,), what=block.name)
            copied = block.nbytes
        elif self.loader is not None and not block.on_disk and not self._local:
            copied = self.loader.load(slot.buffer[:self.loader.padded_bytes(block.nbytes)],
                                      source, streams, block.name)
            self.counters["gathered_bytes"] += block.nbytes - copied
        else:
            streams.copy(block.slot_flat[slot.index], source, streams.h2d, block.name)
            copied = block.nbytes
        if staged is None and loaded_on is not None:  # None: the staging worker records it
            streams.record(slot.loaded_event, loaded_on)
        if block.on_disk:
            self.disk.copied(block)  # type: ignore[union-attr]
        slot.block = block
        slot.loaded_version = _version(block)
        self._clock += 1
        slot.last_used = self._clock
        block.slot = slot
        self.counters["loads"] += 1
        self.counters["on_demand" if on_demand else "prefetched"] += 1
        self.counters["h2d_bytes"] += copied

    # -- saved tensors ------------------------------------------------------------------------

    @contextlib.contextmanager
    def weight_hooks(self, block: SwappedBlock, *, forbid: bool = False) -> Iterator[None]:
        """Saved-tensor hooks for a block call: tensors in the slot become :class:`WeightRef`
        handles (or, with ``forbid``, an error); every other tensor goes to the hooks that were
        active outside the block (activation offload, a parent-level checkpoint), so those keep
        working inside swapped blocks."""
        slot = block.slot
        if slot is None:
            raise OffloadError(f"swapped block {block.name} runs without a slot",
                               hint="A swapped block ran outside the swapper's forward (e.g. a "
                                    "backward that outlived swapper.detach()); finish backward "
                                    "before detaching, and report a bug if it did.")
        base = slot.buffer.data_ptr()
        end = base + block.nbytes
        device = self.device
        outer = _outer_saved_tensor_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor) -> Any:
            if t.device == device and base <= t.data_ptr() < end:
                if forbid:
                    raise OffloadError(
                        f"autograd saved a weight of swapped block {block.name} although the "
                        "call looked like it needed no gradient",
                        hint="Pass tensors that require grad as plain arguments (or in "
                             "lists/tuples/dicts) of the block's forward.")
                return WeightRef(block, t.data_ptr() - base, t.shape, tuple(t.stride()), t.dtype)
            if outer_pack is not None:
                return _OuterSaved(outer_pack(t))
            # Detached: a saved *output* (relu, sigmoid...) returned as is would hold its own
            # grad_fn, a reference cycle through C++ that keeps a graph dropped without
            # backward (a validation loss under grad mode) alive forever.
            return t.detach()

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, WeightRef):
                return self._weight_from_slot(saved)
            if isinstance(saved, _OuterSaved) and outer_unpack is not None:
                return outer_unpack(saved.value)
            return saved  # type: ignore[no-any-return]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _weight_from_slot(self, ref: WeightRef) -> torch.Tensor:
        slot = ref.block.slot
        if slot is None or not slot.locked or slot.block is not ref.block:
            raise OffloadError(f"a saved weight of {ref.block.name} was used outside its "
                               "block's backward",
                               hint="This is a vramkit bug; please report it with the model.")
        itemsize = ref.dtype.itemsize
        flat = slot.buffer.view(ref.dtype)
        return torch.as_strided(flat, ref.shape, ref.stride,
                                flat.storage_offset() + ref.offset // itemsize)

    # -- gradients of swapped trainable weights (trainable="cpu") -----------------------------

    def begin_block_backward(self, block: SwappedBlock) -> None:
        """Gradients accumulate as PyTorch's do: while a host gradient holds a value (not set to
        None by ``zero_grad``), start the GPU gradient from it, so backward adds to it. With
        ``trainable="swap"`` the stepper decides (accumulated gradients, the state's load)."""
        if self.stepper is not None:
            self.stepper.begin(block)
            return
        pending = [(e, e.host_param.grad) for e in block.trainable_entries
                   if e.host_param is not None and e.host_param.grad is not None]
        if not pending:
            return
        if self.staged is not None:  # pageable gradient buffers: the worker's copy lands first
            self.staged.settle(block)
        if block.grad_event is not None:  # the previous device->host copy must land first
            self.streams.wait(self.streams.current(), block.grad_event)
        for e, grad in pending:
            e.tensor.grad = grad.to(self.device, non_blocking=True)

    def end_block_backward(self, block: SwappedBlock) -> None:
        """Copy the block's new gradients device->host into its pinned gradient buffer (the
        GPU gradients are dropped once the copy is enqueued). With ``trainable="swap"`` the
        block's optimizer steps on the GPU instead (or its gradients are parked)."""
        if self.stepper is not None:
            self.stepper.end(block)
            return
        if not block.trainable_entries:
            return
        finish = complete_gradients(self.gradient_hook, block,
                                    [e.tensor.grad for e in block.trainable_entries
                                     if e.tensor.grad is not None and e.host_param is not None])
        streams = self.streams
        ready = streams.event()
        streams.record(ready, streams.current())
        streams.wait(streams.d2h, ready)
        if finish is not None:  # a reduction in flight: the copy stream waits, compute goes on
            with streams.on(streams.d2h):
                finish()
        if block.grad_buffer is None:
            raise OffloadError(f"swapped block {block.name} has no gradient buffer",
                               hint="Run backward() before swapper.detach(): detaching frees the "
                                    "host gradient buffers.")
        copied = False
        for e in block.trainable_entries:
            grad = e.tensor.grad
            hp = e.host_param
            if grad is None or hp is None:
                continue  # no gradient this step: the host gradient keeps its state
            target = typed_view(block.grad_buffer, e.offset, e)
            if self.staged is not None:  # pageable buffers: through the staging chunks
                self.staged.copy_out(_flat_bytes(target), _flat_bytes(grad.detach()), block,
                                     waits=(ready,), what=block.name)
            else:
                streams.copy(target, grad, streams.d2h, block.name)
            hp.grad = target
            if grad.device.type == "cuda" and self.staged is None:
                grad.record_stream(streams.d2h)
            e.tensor.grad = None
            self.counters["d2h_bytes"] += e.nbytes
            copied = True
        if copied and self.staged is None:  # staged: settle(block) / drain() wait instead
            block.grad_event = streams.event()
            streams.record(block.grad_event, streams.d2h)

    def sync_gradients(self) -> None:
        """Wait (on the host) until every offloaded gradient has arrived and no copy still reads
        the masters; slots of trainable blocks are marked stale (the host step rewrites their
        masters, and fused optimizers and writes through ``.data`` bump no version counter).
        With ``trainable="swap"`` nothing steps the masters on the host: wait for the
        write-backs only."""
        if self.stepper is not None:
            self.stepper.synchronize()
            return
        if self.staged is not None:  # the worker may still read a master the host will step
            self.staged.drain()
        for block in self.blocks:
            if block.grad_event is not None:
                self.streams.synchronize(block.grad_event)
                block.grad_event = None
            # A gradient set to None by zero_grad() is re-attached at the next backward.
        for slot in self.slots:
            self.streams.synchronize(slot.loaded_event)
            if slot.block is not None and slot.block.trainable_entries:
                slot.loaded_version = -1

    def forget_loaded(self) -> None:
        """The masters were written where no version counter sees it (a collective, a C++
        write): wait until no copy reads them, and reload every slot at its next use."""
        if self.staged is not None:
            self.staged.drain()
        for slot in self.slots:
            self.streams.synchronize(slot.loaded_event)
            slot.loaded_version = -1
        for block in self.blocks:
            block.bound = None  # the next acquire points the tensors at their slot again

    @contextlib.contextmanager
    def local_calls(self) -> Iterator[None]:
        """Swapped calls that this process makes alone (see :class:`BlockLoader`): loads are
        plain copies inside, and on the way out the ring is put back as it was -- the same
        blocks in the same slots, the same learnt order and clock -- so that the processes'
        next loads match again. Between block calls only."""
        if self.loader is None or self._local:
            yield
            return
        if any(s.locked for s in self.slots):
            raise OffloadError("local_calls() inside a swapped block's call",
                               hint="Enter it between calls of the model, not inside one.")
        saved = self._snapshot()
        self._local = True
        try:
            yield
        finally:
            self._local = False
            self._restore(saved)

    def begin_no_grad(self) -> None:
        """A call under ``torch.no_grad()`` with a collective loader: such calls are often made
        by one rank alone (a preview, a validation pass), so they load with plain copies, as
        inside :meth:`local_calls`, until :meth:`end_no_grad` (the next call with gradients,
        or backward) puts the ring back."""
        if (self.loader is None or self._local or self._no_grad_saved is not None
                or any(s.locked for s in self.slots)):
            return
        self._no_grad_saved = self._snapshot()
        self._local = True

    def end_no_grad(self) -> None:
        """End a section opened by :meth:`begin_no_grad` (nothing when none is open)."""
        saved = self._no_grad_saved
        if saved is None:
            return
        self._no_grad_saved = None
        self._local = False
        self._restore(saved)

    def _snapshot(self) -> tuple[Any, ...]:
        saved = ([(s.block, s.loaded_version, s.last_used) for s in self.slots], self._clock,
                 self.order, self._position, self._observed, set(self._observed_ids),
                 self._direction, self.training_pass)
        self._observed = list(self._observed)
        return saved

    def _restore(self, saved: tuple[Any, ...]) -> None:
        """Put the ring's decision state back exactly (every slot's block, version and last
        use, the clock, the learnt order), so that the next loads are decided as on the ranks
        that made no local calls; slots whose content changed are copied back."""
        slots_were, self._clock, self.order, self._position = saved[:4]
        self._observed, self._observed_ids, self._direction, self.training_pass = saved[4:]
        self._upcoming_cache.clear()
        changed = [(s, *was) for s, was in zip(self.slots, slots_were, strict=True)
                   if (s.block, s.loaded_version) != was[:2]]
        for slot, (_, _, last_used) in zip(self.slots, slots_were, strict=True):
            slot.last_used = last_used  # hits inside the section moved it
        for slot, *_ in changed:  # evict what the local calls left, then put the old back
            old = slot.block
            if old is not None:
                old.slot = old.bound = None
                for e in old.entries:
                    e.tensor.data = e.placeholder
            slot.block = None
        streams = self.streams
        for slot, block, version, _ in changed:
            slot.loaded_version = version
            if block is None:
                continue
            slot.block = block
            block.slot = slot
            # (a background encode cannot give the raw master back before its copy is queued)
            with self.packed.guard(block) if self.packed is not None else _UNGUARDED:
                if version < 0 or block.master is None:
                    continue  # stale on every rank alike: its next use reloads it
                streams.wait(streams.h2d, slot.free_event)
                streams.copy(block.slot_flat[slot.index], block.master, streams.h2d,
                             block.name)
                streams.record(slot.loaded_event, streams.h2d)
                self.counters["h2d_bytes"] += block.nbytes

    # -- bookkeeping --------------------------------------------------------------------------

    def reset_counters(self) -> None:
        """Zero the transfer counters."""
        for key in self.counters:
            self.counters[key] = 0
        self.enqueue_seconds = 0.0
        if self.disk is not None:
            self.disk.reset_counters()

    def close(self) -> None:
        """Free the slots (the caller has synchronized the device); stop the disk reader and
        the staging worker (which writes into the slots)."""
        if self.staged is not None:
            self.staged.close()
            self.staged = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        for slot in self.slots:
            if not slot.pool_block.freed:
                slot.pool_block.free()
        self.slots = []
        if self._pool is not None:
            self._pool.clear(force=True)
            self._pool = None


class _OuterSaved:
    """A tensor saved through the hooks that were active outside the swapped block."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _outer_saved_tensor_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # older PyTorch: outer hooks do not reach inside swapped blocks
        return None
    return top(False)  # type: ignore[no-any-return]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as one flat uint8 view (a copy first when it is not contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _version(block: SwappedBlock) -> int:
    """The version of the bytes a slot copy of ``block`` was made from: its master's counter
    (bumped by host optimizer steps); blocks on disk or compressed are frozen and never change."""
    master = block.master
    return master._version if master is not None else block.frozen_version
