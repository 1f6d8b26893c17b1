"""The host side of a block swapper: pinned masters, gradient buffers and the disk tier.

:class:`HostStore` places each swapped block's bytes when a
:class:`~vramkit.offload.swap.BlockSwapper` attaches:

* **Pinned masters**, one per block, from a pinned :class:`~vramkit.memory.pool.MemoryPool`
  that grows by exactly each master (one segment each), so the next block's memory is
  page-locked on a helper thread while this one is filled -- from the model's tensors, or
  straight from a checkpoint (:mod:`vramkit.offload.swap.source`).
* **Gradient buffers** where gradients wait on the host (``trainable="cpu"``, accumulation and
  deferred clipped steps with ``trainable="swap"``).
* **The disk tier** (``SwapConfig.host_budget``): the fewest frozen blocks, spread evenly, stay
  on disk so that masters plus staging buffers fit the budget; what is left of the budget buys
  more staging buffers (a deeper read-ahead, a larger cache). See
  :mod:`vramkit.offload.swap.disk`.
* **Compressed masters** (``SwapConfig.compress``): frozen blocks' masters encoded once
  filled, each raw master given back as its compressed copy exists -- after the fill in the
  foreground, or block by block beside a background fill
  (:mod:`vramkit.offload.swap.packed`).
* **Masters in memory the swapper does not own** (:class:`MasterMemory`): frozen blocks' masters
  can live in memory shared by the processes of one node (``vramkit.distributed``), one copy
  per node instead of one per rank; one process writes them, the others only map them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams
from vramkit.offload.blocks import spread_evenly
from vramkit.offload.swap.disk import DISK_ALIGN, CacheFile, DiskRead, DiskTier, open_read
from vramkit.offload.swap.fill import FillSpec, MasterFill
from vramkit.offload.swap.packed import PackedMasters
from vramkit.offload.swap.records import ALIGN, SwapEntry, SwappedBlock, typed_view
from vramkit.offload.swap.staged import StagedCopies, staging_layout
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.offload.swap.source import CheckpointSource

__all__ = ["DiskSplit", "HostStore", "MasterMemory", "parks_grads", "split_for_host_budget"]

logger = logging.getLogger(__name__)

_STAGING_MIN = 3  # disk tier: one buffer copying to the GPU, one ready, one being read
# Fill reads in flight while the attach loads the resident tensors from the same checkpoint:
# enough to keep the disk busy beside the loader, few enough that the resident tensors (which
# the first forward needs before any swapped block) are not starved by the fill's 8 threads.
RESIDENT_LOAD_FILL_JOBS = 2


class MasterMemory(Protocol):
    """Memory for frozen blocks' masters that the swapper does not allocate itself.

    ``vramkit.distributed.NodeSharedMasters`` implements it with one shared mapping per node.
    Every method that says *collective* is called by every process of the job at the same
    point (each attaches a swapper to the same model with the same config).
    """

    @property
    def writer(self) -> bool:
        """Whether this process writes the masters' values (the others only read them)."""

    def reserve(self, names: list[str], sizes: list[int], device: torch.device
                ) -> list[torch.Tensor] | None:
        """Collective: one uint8 tensor of ``sizes[i]`` bytes per block (page-locked for a CUDA
        ``device`` where possible), or ``None`` when the memory cannot be had this way (the
        swapper then pins its own masters; the implementation says why)."""

    def published(self, ok: bool) -> None:
        """Collective: the writer filled the masters (``ok``) or failed; returns when every
        process may read them, raises in every process when the writer failed."""

    def close(self) -> None:
        """The masters are no longer used (detach): unpin and unmap this process's view."""


@dataclass(frozen=True)
class DiskSplit:
    """Which swapped blocks a host budget leaves on disk (:func:`split_for_host_budget`).

    Attributes:
        on_disk: indices (into the sizes given) of the blocks kept on disk, in order.
        staging: pinned staging buffers the disk blocks are read into.
        slot: bytes of each staging buffer (the largest disk block, disk aligned).
        pinned: pinned bytes in all: masters in RAM, gradient buffers, staging.
    """

    on_disk: tuple[int, ...]
    staging: int
    slot: int
    pinned: int


def split_for_host_budget(sizes: Sequence[int], frozen: Sequence[bool], budget: int | None, *,
                          grads: int = 0) -> DiskSplit | None:
    """The swapper's rule for a host budget, on sizes alone (the swapper and the planner both
    ask it): the fewest frozen blocks, spread evenly, stay on disk so that the masters of the
    rest, ``grads`` bytes of gradient buffers and the staging buffers fit ``budget``; what is left
    of the budget buys more staging buffers (a deeper read-ahead), up to one per disk block.

    Args:
        sizes: each swapped block's master bytes.
        frozen: whether each block may go to disk (frozen weights only).
        budget: pinned bytes allowed (``None``: no limit).
        grads: pinned gradient buffer bytes that stay whatever goes to disk.

    Returns:
        The :class:`DiskSplit`, or ``None`` when everything fits in RAM.

    Raises:
        ConfigError: even every frozen block on disk does not fit (the message names the
            smallest budget that works).
    """
    if budget is None or not sizes:
        return None
    pinned = sum(sizes) + grads
    if pinned <= budget:
        return None
    candidates = [i for i, f in enumerate(frozen) if f]
    kept = pinned - sum(sizes[i] for i in candidates)  # trainable masters (+ grads) stay
    if not candidates:
        raise ConfigError(
            f"SwapConfig.host_budget={format_size(budget)} cannot hold the swapped blocks "
            f"({format_size(pinned)} pinned), and a disk tier holds frozen weights only "
            "(trainable weights change every step)",
            hint="Raise host_budget, or freeze the base weights (LoRA) so they can stay on "
                 "disk.")
    for count in range(1, len(candidates) + 1):
        chosen = [candidates[i] for i in spread_evenly([sizes[i] for i in candidates], count)]
        slot = _disk_aligned(max(sizes[i] for i in chosen))
        in_ram = pinned - sum(sizes[i] for i in chosen)
        if in_ram + _min_staging(count) * slot <= budget:
            staging = max(_min_staging(count), min(count, (budget - in_ram) // slot))
            return DiskSplit(tuple(sorted(chosen)), staging, slot, in_ram + staging * slot)
    slot = _disk_aligned(max(sizes[i] for i in candidates))
    smallest = kept + _min_staging(len(candidates)) * slot
    raise ConfigError(
        f"SwapConfig.host_budget={format_size(budget)} is too small: even with every "
        f"frozen swapped block on disk the swapper needs {format_size(smallest)} of pinned "
        f"memory ({_min_staging(len(candidates))} staging buffers of {format_size(slot)}"
        + (f" and {format_size(kept)} of trainable masters" if kept else "") + ")",
        hint=f"Raise host_budget to at least {format_size(smallest)}, or swap smaller "
             "blocks (find_blocks with finer names).")


def parks_grads(trainable: str, accumulation_steps: int, max_grad_norm: float | None) -> bool:
    """Whether trainable blocks need pinned gradient buffers: trainable="cpu" always; "swap"
    only where gradients wait on the host (accumulation, deferred clipped steps)."""
    return trainable == "cpu" or (trainable == "swap" and (
        accumulation_steps > 1 or max_grad_norm is not None))


def _min_staging(disk_blocks: int) -> int:
    """Staging buffers a disk tier of ``disk_blocks`` needs: three, or two for one or two blocks
    (the reader's rule: a buffer never holding an upcoming block is always free to refill)."""
    return max(2, min(disk_blocks, _STAGING_MIN))


class HostStore:
    """Where a swapper's blocks live on the host (see the module docstring).

    Args:
        host_params: give trainable entries a host ``Parameter`` over their master
            (``trainable="cpu"``: a CPU optimizer steps them).
        park_grads: trainable blocks get pinned gradient buffers (:func:`parks_grads`).
        host_budget: pinned host bytes allowed (``SwapConfig.host_budget``, normalized);
            ``None``: every master is pinned, no disk tier.
        disk_cache_dir: where the disk tier writes its cache file (``None``:
            ``$VRAMKIT_CACHE_DIR`` or ``~/.cache/vramkit``).
        compress: ``SwapConfig.compress``: ``"off"``, or compress frozen masters once filled
            (``"on"``, ``"auto"``).
        device: the compute device (pinned pools for CUDA, plain host pools for the CPU).
        streams: the device's copy streams.
        source: the checkpoint swapped tensors are read from, when the swapper was given one
            (used during :meth:`place` only).
        shared: where frozen blocks' masters live instead of the swapper's own pinned pool
            (:class:`MasterMemory`); ``None``: the swapper pins its own.
    """

    def __init__(self, device: torch.device, streams: Streams,
                 source: CheckpointSource | None, shared: MasterMemory | None = None, *,
                 host_params: bool = False, park_grads: bool = False,
                 host_budget: int | None = None, disk_cache_dir: str | None = None,
                 compress: str = "off", compressed_blocks: tuple[str, ...] | None = None
                 ) -> None:
        self.host_params = host_params
        self.park_grads = park_grads
        self.host_budget = host_budget
        self.disk_cache_dir = disk_cache_dir
        self.device = device
        self.streams = streams
        self.source = source
        self.shared = shared
        self.shared_masters: dict[int, torch.Tensor] = {}  # id(block) -> its shared master
        self._reserved = False  # reserve() was called: published() must be called too
        self._published = False
        # the slots are filled by a collective loader (sharded uploads): every process must
        # hold each block compressed or raw alike at every load, so no background encode
        self.collective = False
        self.blocks: list[SwappedBlock] = []
        self.master_pool: MemoryPool | None = None
        self.grad_pool: MemoryPool | None = None
        self.staging_pool: MemoryPool | None = None
        self.staging_blocks: list[Any] = []
        self.cache: CacheFile | None = None
        self.disk: DiskTier | None = None
        self.disk_blocks: list[SwappedBlock] = []
        self.split: DiskSplit | None = None
        self.filler: MasterFill | None = None
        self.packed = (PackedMasters(compress, device, streams, self.pool,
                                     only=compressed_blocks)
                       if compress != "off" else None)
        # host_memory="pageable": masters in ordinary memory, copied to the GPU through a small
        # pinned pool (staged.py); set by the swapper before place(): (pool bytes, blocks the
        # ring may have in flight).
        self.staging: tuple[int, int] | None = None
        self.staged: StagedCopies | None = None
        self._free_stream: Any = None  # where raw masters are freed (_free_master)

    def place(self, blocks: list[SwappedBlock]) -> None:
        """Decide where every block lives (a master, or disk), build the disk tier, and point
        the blocks' tensors at placeholders. The masters are filled by :meth:`start_fill` and
        :meth:`finish_fill`."""
        self.blocks = blocks
        self.disk_blocks = self._choose_disk_blocks(blocks)
        on_disk = {id(b) for b in self.disk_blocks}
        in_ram = [b for b in blocks if id(b) not in on_disk]
        self._reserve_shared([b for b in in_ram if not b.trainable_entries])
        # Blocks whose shared master another process writes need no value from this one (their
        # tensors may even be on meta).
        readonly = set() if self.shared is None or self.shared.writer else set(
            self.shared_masters)
        # Where each value comes from, taken before the tensors are replaced by placeholders.
        specs = {id(b): [self._spec(e) for e in b.entries] for b in blocks
                 if id(b) not in readonly}
        if self.disk_blocks:
            self._build_disk_tier(self.disk_blocks, specs)
        if in_ram:
            if self.packed is not None:  # pageable masters: pageable payloads, staged too
                self.packed.pageable = self.staging is not None
            self._prepare_masters(in_ram, specs, readonly)
            if self.staging is not None:
                chunk, count = staging_layout(self.staging[0], max(b.nbytes for b in in_ram),
                                              self.staging[1])
                self.staged = StagedCopies(self.device, self.streams, chunk_bytes=chunk,
                                           chunks=count)
                if self.packed is not None:
                    self.packed.staged = self.staged
        # Only now (every value has a way back: a master's fill, or the disk tier).
        placeholders: dict[torch.dtype, torch.Tensor] = {}
        for block in blocks:
            for e in block.entries:
                self.evict(e, placeholders)

    def _spec(self, e: SwapEntry) -> FillSpec:
        source = self.source
        file = source.entry(e.tensor) if source is not None else None
        if file is None and e.tensor.is_meta:
            raise ConfigError(
                f"{e.attr} of {type(e.owner).__name__} is on the meta device and "
                + ("the checkpoint does not hold it" if source is not None
                   else "no checkpoint was given"),
                hint="Pass BlockSwapper(..., checkpoint=path) for a model built on meta, or "
                     "materialize the model first.")
        # The model's own tensor is kept until the block is filled: from it when the file
        # lacks the tensor, and back into the model should the attach fail.
        return FillSpec(e, file, None if e.tensor.is_meta else e.tensor.detach())

    def _reserve_shared(self, frozen: list[SwappedBlock]) -> None:
        """Ask the shared memory for the frozen in-RAM blocks' masters (collective)."""
        if self.shared is None or not frozen:
            return
        self._reserved = True
        masters = self.shared.reserve([b.name for b in frozen], [b.nbytes for b in frozen],
                                      self.device)
        if masters is not None:
            self.shared_masters = {id(b): m for b, m in zip(frozen, masters, strict=True)}

    def _prepare_masters(self, blocks: list[SwappedBlock], specs: dict[int, list[FillSpec]],
                         readonly: set[int]) -> None:
        own = sum(b.nbytes for b in blocks if id(b) not in self.shared_masters)
        grads = sum(b.nbytes for b in blocks if b.trainable_entries) if self.park_grads else 0
        # One segment per master (the pool grows by exactly each request, up to the total), so
        # the next block's memory is page-locked while this one is filled.
        if own:
            self.master_pool = self.pool(own, initial=0, pinned=self.staging is None)
        if grads:  # pageable masters: their gradients come back through the staging chunks
            self.grad_pool = self.pool(grads, pinned=self.staging is None)
        for block in blocks:
            if id(block) in readonly:  # another process writes it: only the views here
                self._give_master(block)
        filled = [b for b in blocks if id(b) not in readonly]
        if filled:
            self.filler = MasterFill(filled, specs, self._give_master, self.source,
                                     threads=_fill_threads())

    def _give_master(self, block: SwappedBlock) -> torch.Tensor:
        """Pin ``block``'s master (and gradient buffer) and create its views (fill driver)."""
        shared = self.shared_masters.get(id(block))
        if shared is not None:
            block.master = shared
        else:
            assert self.master_pool is not None
            block.master_block = self.master_pool.allocate(block.nbytes)
            block.master = block.master_block.view((block.nbytes,), torch.uint8)
        if block.trainable_entries and self.grad_pool is not None:
            block.grad_block = self.grad_pool.allocate(block.nbytes)
            block.grad_buffer = block.grad_block.view((block.nbytes,), torch.uint8)
        for e in block.entries:
            view = typed_view(block.master, e.offset, e)
            block.master_views.append(view)
            if e.trainable and self.host_params:
                e.host_param = nn.Parameter(view, requires_grad=True)  # .grad set by the first
                # backward that produces one, as for any parameter
        return block.master

    def start_fill(self, *, background: bool,
                   on_done: Callable[[], None] | None = None) -> None:
        """Start filling the masters on the fill's threads: in the background (each block's
        first use waits for it) or for :meth:`finish_fill` to wait for; ``on_done`` runs once
        every master is filled (or the fill stopped). Background filling is for frozen weights
        only: trainable masters are read by optimizers the swapper does not see."""
        filler = self.filler
        if filler is None:
            if on_done is not None:
                on_done()
            return
        if background and (self._reserved or (self.packed is not None and self.collective)
                           or any(b.trainable_entries for b in filler.blocks)):
            # other processes wait for published(), after the whole fill; a collective loader
            # needs every block compressed (or raw) alike in every process from the first load
            background = False
        if self.source is not None and background:
            # the attach returns (and the first forward starts) once the resident tensors are
            # in place: they go first; a foreground attach waits for everything anyway
            filler.limit(RESIDENT_LOAD_FILL_JOBS)  # until resident_loaded()
        filler.start(background=background, on_done=on_done)
        if background and self.packed is not None:
            # Compressed masters beside the background fill: each block encoded as soon as it
            # is filled (a foreground fill encodes after it: _pack). Node-shared masters and
            # trainable blocks never get here: the fill is in the foreground for them (and
            # neither is compressed anyway).
            packed = self.packed
            eligible = [b for b in filler.blocks
                        if packed.eligible(b) and id(b) not in self.shared_masters]
            if eligible:
                packed.encode_in_background(eligible, filler, self._unlink_master,
                                            self._raw_reads_done, self._encoded)

    def resident_loaded(self) -> None:
        """The attach's own load of the resident tensors is over: the fill gets every thread."""
        if self.filler is not None:
            self.filler.limit(None)

    def finish_fill(self) -> None:
        """Wait for a foreground fill (with a progress bar over a checkpoint's bytes) and tell
        the processes sharing the masters; returns at once for a background fill."""
        filler = self.filler
        if filler is None:
            self._publish(True)
            self._pack()  # every block on disk: the scratch for their compressed reads
            return
        if filler.background:
            return
        source = self.source
        try:
            with (source.progress_bar(filler.nbytes) if source is not None
                  else contextlib.nullcontext(None)) as advance:
                filler.wait_all(advance)
        except BaseException:
            filler.cancel()
            self._publish(False)
            raise
        self._publish(True)
        self._pack()

    def _pack(self) -> None:
        """Compress the filled masters of frozen blocks (``SwapConfig.compress``) one at a
        time, giving each raw master back as soon as its compressed copy exists (pinned memory
        peaks at the raw masters, never at raw plus compressed)."""
        packed = self.packed
        if packed is None:
            return
        for block in self.blocks:
            if (not packed.eligible(block) or id(block) in self.shared_masters
                    or block.master is None or block.master_block is None):
                continue
            if packed.pack(block, block.master):
                self._unlink_master(block)()  # nothing has copied from it yet
        packed.finish()

    def _unlink_master(self, block: SwappedBlock) -> Callable[[], None]:
        """``block`` is compressed now: drop its raw master from it; returns what gives the
        master's memory back (a background encode calls it once the copies from it are
        done)."""
        pool, handle = self.master_pool, block.master_block
        assert pool is not None and handle is not None and block.master is not None
        block.frozen_version = block.master._version  # slots loaded from it stay current
        block.master_views = []
        block.master = None
        block.master_block = None
        return lambda: self._free_master(pool, handle)

    def _free_master(self, pool: MemoryPool, handle: Any) -> None:
        """Give a compressed block's raw master back to the system now (each master is a
        segment of its own), so pinned memory holds raw and compressed bytes of this block only,
        not of every block until the encode ends."""
        if self.device.type == "cuda":
            # A pinned pool keeps a freed block until an event on the current stream has
            # passed (a copy from it may still run there). None does: a background encode has
            # fenced the copies, a foreground one runs before any. On the default stream, behind
            # the first steps' kernels, that event would keep the segment past the trim below:
            # the free goes on a stream of its own, which is idle.
            if self._free_stream is None:
                self._free_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._free_stream):
                pool.free(handle)
            self._free_stream.synchronize()
        else:
            pool.free(handle)
        pool.trim()

    def _raw_reads_done(self) -> None:
        """Return once every copy from a raw master enqueued before this call has read it (a
        background encode, before it gives a raw master back): the staging worker's memcpys
        (pageable masters), then the copy stream's DMAs (a GPU; on a CPU copies are done when
        enqueued)."""
        if self.staged is not None:
            self.staged.barrier()
        if self.device.type == "cuda":
            streams = self.streams
            event = streams.event()
            streams.record(event, streams.h2d)
            streams.synchronize(event)

    def _encoded(self) -> None:
        """The background encode is over: anything the pool still holds goes back."""
        pool = self.master_pool
        if pool is not None:
            try:
                pool.trim()
            except Exception:  # only memory kept longer; never an error of the encode
                logger.warning("BlockSwapper: trimming the master pool after the encode failed",
                               exc_info=True)

    def _publish(self, ok: bool) -> None:
        """Shared masters: tell the other processes they are written (collective, once; also
        where this node could not share, since the other nodes' ranks wait for everyone)."""
        if self.shared is not None and self._reserved and not self._published:
            self._published = True
            self.shared.published(ok)

    def wait(self, block: SwappedBlock | None = None) -> None:
        """Wait until ``block``'s master (every master: ``None``) is filled, and encoded where
        it is compressed in the background."""
        filler = self.filler
        if filler is not None:
            if block is None:
                filler.wait_all()
            elif block.fill is not None:
                filler.wait(block)
        if self.packed is not None:
            self.packed.wait_encoded(block)

    @property
    def encoding(self) -> bool:
        """Whether masters are still being compressed in the background."""
        return self.packed is not None and self.packed.encoding

    def stop_fill(self) -> None:
        """Stop a fill still running (a failed attach) and a background encode: nothing writes
        into the masters, and no block switches to its compressed master, once this returns."""
        self.stop_encode()
        if self.filler is not None:
            self.filler.cancel()

    def stop_encode(self) -> None:
        """Stop a background encode (detach): the blocks not encoded keep their raw masters."""
        if self.packed is not None:
            self.packed.cancel_encode()

    def fill(self, spec: FillSpec, view: torch.Tensor) -> None:
        """Write a swapped tensor's value into ``view`` (its place in staging), now."""
        if spec.file is not None:
            assert self.source is not None
            self.source.read(spec.file, view)
        else:
            assert spec.data is not None
            view.copy_(spec.data)

    def evict(self, e: SwapEntry, cache: dict[torch.dtype, torch.Tensor]) -> None:
        if e.dtype not in cache:
            cache[e.dtype] = torch.zeros((), dtype=e.dtype, device=self.device)
        e.placeholder = cache[e.dtype].expand(e.shape)
        if e.tensor.is_meta:  # a meta tensor cannot take real data: a new object takes its place
            old = e.tensor
            e.tensor = (nn.Parameter(e.placeholder, requires_grad=old.requires_grad)
                        if e.is_param else e.placeholder.clone())
            (e.owner._parameters if e.is_param else e.owner._buffers)[e.attr] = e.tensor
            if not e.is_param:
                e.tensor.data = e.placeholder
        else:
            e.tensor.data = e.placeholder

    def _choose_disk_blocks(self, blocks: list[SwappedBlock]) -> list[SwappedBlock]:
        """The swapped blocks left on disk so pinned memory stays within ``host_budget``."""
        budget = self.host_budget
        grads = (sum(b.nbytes for b in blocks if b.trainable_entries)
                 if self.park_grads else 0)
        split = split_for_host_budget([b.nbytes for b in blocks],
                                      [not b.trainable_entries for b in blocks], budget,
                                      grads=grads)
        if split is None:
            return []
        self.split = split
        return [blocks[i] for i in split.on_disk]

    def _build_disk_tier(self, blocks: list[SwappedBlock], specs: dict[int, list[FillSpec]]
                         ) -> None:
        split = self.split
        assert split is not None  # set by _choose_disk_blocks
        slot, count = split.slot, split.staging  # the rest of the budget bought more buffers
        self.staging_pool = self.pool(count * slot, initial=0, alignment=DISK_ALIGN)
        self.staging_blocks = [self.staging_pool.allocate(slot) for _ in range(count)]
        staging = [b.view((slot,), torch.uint8) for b in self.staging_blocks]
        reads: dict[SwappedBlock, list[DiskRead]] = {}
        files: dict[Path, Any] = {}
        for block in blocks:
            block_specs = specs[id(block)]
            if self.packed is not None and self._write_packed(block, block_specs, staging[0],
                                                              reads):
                continue
            # Read from the checkpoint itself where it holds the bytes as the module keeps them.
            if all(s.file is not None and s.file.dtype == s.entry.dtype for s in block_specs):
                block_reads = []
                for spec in block_specs:
                    e, entry = spec.entry, spec.file
                    assert entry is not None
                    file = files.get(entry.path)
                    if file is None:
                        file = files[entry.path] = open_read(entry.path)
                    block_reads.append(DiskRead(file, entry.file_offset, e.nbytes, e.offset))
                reads[block] = block_reads
            else:  # written once in the swapped layout, through the first staging buffer
                if self.cache is None:
                    self.cache = CacheFile(self._cache_dir())
                buf = staging[0][:block.nbytes]
                buf.zero_()
                for spec in block_specs:
                    self.fill(spec, typed_view(buf, spec.entry.offset, spec.entry))
                offset = self.cache.append(buf)
                reads[block] = [DiskRead(self.cache.reader, offset, _disk_aligned(block.nbytes),
                                         0)]
        self.disk = DiskTier(reads, staging, self.streams, _fill_threads())
        if self.packed is not None:
            self.packed.disk_reader = self.disk.read_tensor
        for block in blocks:
            block.on_disk = True
        logger.info("BlockSwapper: %d swapped blocks (%s) stay on disk, read through %d pinned "
                    "staging buffers of %s", len(blocks),
                    format_size(sum(b.nbytes for b in blocks)), count, format_size(slot))

    def _write_packed(self, block: SwappedBlock, specs: list[FillSpec], buf: torch.Tensor,
                      reads: dict[SwappedBlock, list[DiskRead]]) -> bool:
        """SwapConfig.compress: write a disk block compressed into the cache file (fewer bytes
        read and copied); ``False`` where it would not shrink (then it is stored raw)."""
        assert self.packed is not None
        raw = buf[:block.nbytes]
        raw.zero_()
        for spec in specs:
            self.fill(spec, typed_view(raw, spec.entry.offset, spec.entry))
        packed = self.packed.pack_for_disk(block, raw)
        if packed is None:
            return False
        if self.cache is None:
            self.cache = CacheFile(self._cache_dir())
        offset = self.cache.append(packed.payload)
        reads[block] = [DiskRead(self.cache.reader, offset,
                                 _disk_aligned(packed.compressed_nbytes), 0)]
        return True

    def _cache_dir(self) -> Path:
        configured = self.disk_cache_dir or os.environ.get("VRAMKIT_CACHE_DIR")
        directory = Path(configured) if configured else Path.home() / ".cache" / "vramkit"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier's cache directory {directory}: {exc}",
                              hint="Set SwapConfig.disk_cache_dir to a writable directory."
                              ) from exc
        return directory

    def pool(self, nbytes: int | None = None, *, initial: int | None = None,
             alignment: int = ALIGN, pinned: bool = True) -> MemoryPool:
        # nbytes None: grows by exactly what each allocation needs (optimizer state masters,
        # adopted block by block on the first step).
        config = PoolConfig(initial_size=(nbytes or 0) if initial is None else initial,
                            max_size=nbytes, growth_factor=1.0, alignment=alignment,
                            max_cached_buffers=0)
        if self.device.type == "cuda" and pinned:
            return MemoryPool.pinned(config)
        return MemoryPool("cpu", config)

    def restored_views(self, block: SwappedBlock
                       ) -> tuple[list[torch.Tensor | None], OffloadError | None]:
        """The current value of each of ``block``'s tensors, on the host (detach); for a block
        whose master was never filled, the model's own tensors where it had them (``None``
        where it did not) and the error that stopped the fill (a block whose background encode
        failed has its raw master: :meth:`encode_error`)."""
        self.stop_encode()  # no block switches while the weights go back
        if self.packed is not None and self.packed.holds(block):  # in RAM or on disk
            raw = self.packed.read(block, 0, block.nbytes)
            return [typed_view(raw, e.offset, e) for e in block.entries], None
        if block.on_disk and self.disk is not None:
            disk = self.disk
            return [typed_view(disk.read_tensor(block, e.offset, e.nbytes), 0, e)
                    for e in block.entries], None
        filler = self.filler
        if filler is not None and filler.covers(block):
            try:
                filler.wait(block)
            except OffloadError as exc:
                return filler.originals(block), exc
        return list(block.master_views), None

    def encode_error(self) -> OffloadError | None:
        """The first block whose background encode failed (it kept its raw master), if any."""
        if self.packed is None:
            return None
        for block in self.blocks:
            error = self.packed.encode_error(block)
            if error is not None:
                return error
        return None

    def stats(self) -> dict[str, Any]:
        """Pinned, pageable and staging bytes, and the disk tier's counters."""
        stats = {id(p): p.stats() for p in (self.master_pool, self.grad_pool, self.staging_pool)
                 if p is not None}
        pinned_pools = [p for p in (self.master_pool, self.grad_pool, self.staging_pool)
                        if p is not None and p.kind == "pinned"]
        disk = self.disk.counters if self.disk is not None else {}
        shared = sum(m.numel() for m in self.shared_masters.values())
        staged = self.staged
        staged_figures = staged.counters() if staged is not None else {}
        # pageable masters are not pinned (on a CPU device nothing is: there every pool counts
        # as the stand-in for pinned memory, as before)
        pinned = sum(stats[id(p)].reserved for p in (
            (self.staging_pool,) if staged is not None
            else (self.master_pool, self.grad_pool, self.staging_pool)) if p is not None)
        packed: dict[str, Any] = {"pinned": 0}
        if self.packed is not None:
            self.packed.check()  # a failed decode (corrupted payload) is reported here
            packed = self.packed.stats()
        return {
            "pinned": (pinned + shared + (staged.pinned_bytes if staged is not None else 0)
                       + packed.pop("pinned")),
            **packed,
            "host_memory": "pageable" if self.staging is not None else "pinned",
            "staging_pool_bytes": staged.pinned_bytes if staged is not None else 0,
            "staged_copies": int(staged_figures.get("staged_copies", 0)),
            "staged_copy_bytes": int(staged_figures.get("staged_copy_bytes", 0)),
            "staged_chunk_waits": int(staged_figures.get("staged_chunk_waits", 0)),
            "shared_bytes": shared,
            "pageable_bytes": sum(stats[id(p)].pageable_bytes for p in pinned_pools),
            "disk_blocks": len(self.disk_blocks),
            "disk_bytes": sum(b.nbytes for b in self.disk_blocks),
            "staging_bytes": (stats[id(self.staging_pool)].reserved
                              if self.staging_pool is not None else 0),
            "disk_reads": int(disk.get("reads", 0)),
            "disk_read_bytes": int(disk.get("read_bytes", 0)),
            "disk_read_seconds": float(disk.get("read_seconds", 0.0)),
            "disk_hits": int(disk.get("hits", 0)),
            "disk_waits": int(disk.get("waits", 0)),
            "disk_wait_seconds": float(disk.get("wait_seconds", 0.0)),
        }

    def close(self) -> None:
        """Stop the fill and the disk reader and free every host buffer (the device is
        synchronized)."""
        self.stop_encode()  # it frees raw masters and waits for the staging worker
        if self.staged is not None:  # its worker reads the masters: it stops first
            self.staged.close()
            self.staged = None
        if self.filler is not None:
            self.filler.cancel()
            self.filler = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.packed is not None:
            self.packed.close()
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        for handle in self.staging_blocks:
            if not handle.freed:
                handle.free()
        self.staging_blocks = []
        for pool in (self.master_pool, self.grad_pool, self.staging_pool):
            if pool is not None:
                pool.clear(force=True)
        self.master_pool = self.grad_pool = self.staging_pool = None
        if self.shared is not None:
            self._publish(False)  # an attach that failed before the fill: nobody waits forever
            if self.shared_masters:
                self.shared_masters = {}
                self.shared.close()


def _fill_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _disk_aligned(nbytes: int) -> int:
    return -(-nbytes // DISK_ALIGN) * DISK_ALIGN
