"""Compressed masters (``SwapConfig.compress``): fewer bytes over the host link, the same bits.

A frozen swapped block's master is encoded once at attach (:mod:`vramkit.compress`: bf16
exponents and 8-bit storage entropy-coded, everything else raw) into pinned host memory
(ordinary memory with ``host_memory="pageable"``: the staging pool's worker copies the payload,
then launches its decode), and its raw master is given back, so the host holds the compressed bytes only. A load then copies
the compressed payload into a device scratch buffer on the copy stream and decodes it into the
block's slot on a decode stream that waits for the copy (the Triton kernel on a GPU, the torch
reference on the CPU); the slot's *loaded* event is recorded after the decode, so the ring's
ordering is unchanged. Two scratch buffers take turns: the copy of the next block runs while
this one decodes (the copy engine never waits for a kernel), and a copy into a buffer waits
for the decode that last read it.

Only frozen blocks are compressed: a trainable master changes every step (an optimizer writes
it), and encoding it again each step would cost more than the copy it saves. Blocks in
node-shared memory (``vramkit.distributed``) or loaded by a ``block_loader`` keep raw masters.
Blocks of the disk tier are written compressed into its cache file (:meth:`pack_for_disk`:
only the header stays in memory), read compressed into staging and decoded from there.

``"on"`` compresses every eligible block; ``"auto"`` keeps a block compressed only where the
encode shrank it to at most :data:`AUTO_MAX_RATIO` of its bytes (less would not repay the
decode). A GPU decode whose checks fail (a corrupted payload) sets a device flag that
:meth:`PackedMasters.check` turns into :class:`~vramkit.errors.CompressionError`: the swapper
checks it whenever it reports its stats and before it gives the weights back at detach. On the
hot path a host sync per load would stall the pipeline, so each load *polls* instead
(:meth:`PackedMasters.poll`): the flag is copied to pinned host memory behind the decodes,
and a later load reads that copy once its event has completed -- the error stops the run
within a few loads of the failed decode (a pass or two), without ever waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vramkit.compress import (
    Compressed,
    Region,
    byte_kind,
    check_flag,
    decode_into,
    encode,
    triton_decoder_available,
)
from vramkit.memory.pool import MemoryPool
from vramkit.memory.transfer import Streams
from vramkit.offload.swap.records import SwappedBlock
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.offload.swap.staged import StagedCopies

__all__ = ["AUTO_MAX_RATIO", "COMPRESS_MODES", "PackedMasters"]

logger = logging.getLogger(__name__)

COMPRESS_MODES = ("off", "on", "auto")
#: Device scratch buffers (each the largest payload) on a GPU: two let copy and decode overlap.
SCRATCH_BUFFERS = 2
#: "auto" keeps a block compressed at this ratio or below: the copy saved must repay the decode
#: (a decode at the GPU's rate costs a few percent of a copy at the host link's rate).
AUTO_MAX_RATIO = 0.9


class PackedMasters:
    """The compressed masters of a swapper (see the module docstring).

    Args:
        mode: ``"on"`` or ``"auto"``.
        device: the compute device (the encode runs there when it is a GPU).
        streams: its copy streams.
        pool: makes the pinned pool the payloads are allocated from (``HostStore.pool``).
    """

    def __init__(self, mode: str, device: torch.device, streams: Streams,
                 pool: Callable[..., MemoryPool]) -> None:
        self.mode = mode
        self.device = device
        self.streams = streams
        self._make_pool = pool
        self.pool: MemoryPool | None = None
        self.packed: dict[int, Compressed] = {}  # id(block) -> its compressed master
        self._handles: list[Any] = []
        self.raw_bytes = 0  # decoded bytes of the packed blocks
        self.scratch: list[torch.Tensor] = []
        self._scratch_free: list[Any] = []  # the event after the decode that read each buffer
        self._turn = 0
        self.decode_stream: Any = None  # a GPU's decode stream (None: decode on the copy stream)
        self.flag: torch.Tensor | None = None
        self.decoded_bytes = 0
        self.on_disk: set[int] = set()  # blocks whose compressed bytes live in the disk tier
        self.disk_reader: Callable[[SwappedBlock, int, int], torch.Tensor] | None = None
        # host_memory="pageable": the payloads in ordinary memory, copied through the staging
        # pool's worker, which then launches the decode (set by the host store).
        self.pageable = False
        self.staged: StagedCopies | None = None
        self._copied: list[Any] = []  # per scratch buffer: its payload's copies are done
        self._flag_host: torch.Tensor | None = None  # the flag as last copied (poll)
        self._flag_event: Any = None
        if device.type == "cuda" and not triton_decoder_available(device):
            logger.warning("BlockSwapper: SwapConfig.compress=%r without Triton: the torch "
                           "reference decodes on the GPU (many small kernels and a host sync "
                           "per load); install triton for the GPU decoder", mode)

    @staticmethod
    def eligible(block: SwappedBlock) -> bool:
        """Frozen, with a master of its own in RAM."""
        return not block.trainable_entries and not block.on_disk and block.nbytes > 0

    def holds(self, block: SwappedBlock) -> bool:
        return id(block) in self.packed

    def pack(self, block: SwappedBlock, master: torch.Tensor) -> bool:
        """Encode ``block``'s filled ``master``; returns whether the block is now compressed
        (the caller then gives the raw master back)."""
        if self.pool is None:
            self.pool = self._make_pool(None, initial=0, pinned=not self.pageable)
        handles: list[Any] = []

        def alloc(n: int) -> torch.Tensor:
            handle = self.pool.allocate(max(n, 1))  # type: ignore[union-attr]
            handles.append(handle)
            return handle.view((max(n, 1),), torch.uint8)[:n]

        regions = [Region(e.offset, e.nbytes, byte_kind(e.dtype)) for e in block.entries]
        work = self.device if self.device.type == "cuda" else torch.device("cpu")
        # no crc32 here: in RAM every decode checks each group's checksum and stream ends,
        # and a crc of the payload would cost a pass over it per block at attach
        try:
            c = encode(master[:block.nbytes], regions, device=work, alloc=alloc, crc=False)
        except torch.OutOfMemoryError:  # a card already full of resident weights: on the CPU
            for h in handles:
                self.pool.free(h)  # type: ignore[union-attr]
            handles.clear()
            logger.warning("BlockSwapper: no device memory to encode %s; encoding it on the "
                           "CPU (slower attach)", block.name)
            c = encode(master[:block.nbytes], regions, device="cpu", alloc=alloc, crc=False)
        if self.mode == "auto" and c.ratio > AUTO_MAX_RATIO:
            for h in handles:
                self.pool.free(h)  # type: ignore[union-attr]
            logger.info("BlockSwapper: %s stays raw (compressed to %.2f of its bytes)",
                        block.name, c.ratio)
            return False
        self.packed[id(block)] = c
        self._handles += handles
        self.raw_bytes += block.nbytes
        return True

    def pack_for_disk(self, block: SwappedBlock, raw: torch.Tensor) -> Compressed | None:
        """Encode a disk-tier block's bytes (``raw``, host memory) for the disk tier's cache
        file; ``None`` where it would not shrink (``"auto"`` above :data:`AUTO_MAX_RATIO`, or
        larger than the raw bytes: its staging buffer holds the raw size)."""
        regions = [Region(e.offset, e.nbytes, byte_kind(e.dtype)) for e in block.entries]
        work = self.device if self.device.type == "cuda" else torch.device("cpu")
        try:
            c = encode(raw[:block.nbytes], regions, device=work, crc=False)
        except torch.OutOfMemoryError:
            c = encode(raw[:block.nbytes], regions, device="cpu", crc=False)
        if c.compressed_nbytes > block.nbytes or (self.mode == "auto"
                                                  and c.ratio > AUTO_MAX_RATIO):
            return None
        # only the header stays in memory: the payload is read from disk into staging
        self.packed[id(block)] = Compressed(c.header, torch.empty(0, dtype=torch.uint8))
        self.on_disk.add(id(block))
        self.raw_bytes += block.nbytes
        return c

    def finish(self) -> None:
        """After the last :meth:`pack`: the device scratch (the largest payload) and the flag."""
        if not self.packed:
            return
        largest = max(c.compressed_nbytes for c in self.packed.values())
        count = SCRATCH_BUFFERS if self.device.type == "cuda" else 1
        self.scratch = [torch.empty(largest, dtype=torch.uint8, device=self.device)
                        for _ in range(count)]
        self._scratch_free = [None] * count
        if self.device.type == "cuda":
            self.decode_stream = torch.cuda.Stream(self.device)
            # created up front: a staged load's waits name them before the worker records them
            self._scratch_free = [self.streams.event() for _ in range(count)]
            self._copied = [self.streams.event() for _ in range(count)]
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        logger.info("BlockSwapper: %d frozen masters compressed, %s -> %s (%.3f), scratch %s",
                    len(self.packed), format_size(self.raw_bytes),
                    format_size(self.compressed_bytes), self.ratio,
                    f"{count} x {format_size(largest)}")

    @property
    def compressed_bytes(self) -> int:
        return sum(c.compressed_nbytes for c in self.packed.values())

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / self.raw_bytes if self.raw_bytes else 1.0

    def load(self, block: SwappedBlock, dest: torch.Tensor, source: torch.Tensor | None = None,
             loaded_event: Any = None) -> tuple[int, Any]:
        """Fill ``dest`` (the block's bytes of a slot) from its compressed master (or, for a
        disk-tier block, the staging bytes ``source`` it was read into): the copy into a
        scratch buffer on the copy stream (ordered as the ring ordered it), then the decode.
        Returns the bytes copied from the host and the stream the decode runs on (the slot's
        *loaded* event goes there) -- or ``None`` with pageable payloads: the staging worker
        copies them, launches the decode and records ``loaded_event`` itself (the ring's
        ``settle(loaded_event)`` waits for that)."""
        self.poll()
        c = self.packed[id(block)]
        if source is not None:
            c = c.to(source[:c.compressed_nbytes])
        assert self.scratch and self.flag is not None
        streams = self.streams
        turn = self._turn
        self._turn = (turn + 1) % len(self.scratch)
        n = c.compressed_nbytes
        scratch = self.scratch[turn][:n]
        # (on a CPU nothing is pinned: the payload is read where it is)
        staged = self.staged if self.decode_stream is not None else None
        if staged is not None and source is None:
            self._load_staged(c, scratch, dest, turn, loaded_event, block.name)
            return n, None
        if staged is not None:  # a disk block beside staged ones: their scratch events first
            staged.drain()
        if self._scratch_free[turn] is not None:  # the decode that last read it is done
            streams.wait(streams.h2d, self._scratch_free[turn])
        streams.copy(scratch, c.payload, streams.h2d, block.name)
        stream = streams.h2d
        if self.decode_stream is not None:
            copied = streams.event()
            streams.record(copied, streams.h2d)
            streams.wait(self.decode_stream, copied)
            stream = self.decode_stream
        with streams.on(stream):
            decode_into(c.to(scratch), dest, self.flag)
        if self.decode_stream is not None:
            free = self._scratch_free[turn] or streams.event()
            streams.record(free, stream)
            self._scratch_free[turn] = free
        self.decoded_bytes += c.nbytes
        return n, stream

    def _load_staged(self, c: Compressed, scratch: torch.Tensor, dest: torch.Tensor, turn: int,
                     loaded_event: Any, what: str) -> None:
        """A pageable payload: the worker copies it through the pinned chunks into ``scratch``
        and then, in FIFO order with every other staged copy, enqueues the decode (so each
        scratch buffer's *free* event is recorded before the next job that waits for it runs)."""
        assert self.staged is not None and self.decode_stream is not None
        streams, stream, flag = self.streams, self.decode_stream, self.flag
        copied, free = self._copied[turn], self._scratch_free[turn]

        def decode() -> None:  # on the worker, right after the payload's copies
            streams.wait(stream, copied)
            with streams.on(stream):
                decode_into(c.to(scratch), dest, flag)
            streams.record(free, stream)
            streams.record(loaded_event, stream)

        self.staged.copy_in(scratch, c.payload, copied, waits=(free,), what=what, then=decode,
                            key=loaded_event)
        self.decoded_bytes += c.nbytes

    def read(self, block: SwappedBlock, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of a compressed block, decoded into a new CPU
        tensor (``state_dict``, detach)."""
        c = self.packed[id(block)]
        out = torch.empty(c.nbytes, dtype=torch.uint8, device=self.device)
        if id(block) in self.on_disk:
            assert self.disk_reader is not None
            c = c.to(self.disk_reader(block, 0, c.compressed_nbytes))
        payload = c.payload.to(self.device)
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        decode_into(c.to(payload), out, flag)
        check_flag(flag, f"compressed master of swapped block {block.name}")
        return out[offset:offset + nbytes].cpu()

    def poll(self) -> None:
        """Without waiting: raise :class:`~vramkit.errors.CompressionError` once the flag's
        last copy to the host shows a failed decode, and queue the next copy when that one has
        landed (a GPU only: the CPU's reference decoder raises at once)."""
        flag, stream = self.flag, self.decode_stream
        if flag is None or stream is None:
            return
        streams = self.streams
        if self._flag_event is None:
            self._flag_host = torch.zeros(1, dtype=flag.dtype).pin_memory()
            self._flag_event = streams.event()
        elif not streams.done(self._flag_event):
            return
        elif int(self._flag_host[0]):  # type: ignore[index]
            check_flag(flag, "compressed swapped block")
        with streams.on(stream):
            self._flag_host.copy_(flag, non_blocking=True)  # type: ignore[union-attr]
        streams.record(self._flag_event, stream)

    def check(self) -> None:
        """Raise :class:`~vramkit.errors.CompressionError` when a load's decode failed its
        checks (a host sync on a GPU)."""
        if self.flag is not None:
            check_flag(self.flag, "compressed swapped block")

    def stats(self) -> dict[str, Any]:
        pinned = (self.pool.stats().reserved if self.pool is not None and not self.pageable
                  else 0)
        return {"compressed_blocks": len(self.packed),
                "compressed_bytes": self.compressed_bytes,
                "compressed_raw_bytes": self.raw_bytes,
                "compress_scratch_bytes": sum(s.numel() for s in self.scratch),
                "pinned": pinned}

    def close(self) -> None:
        self.packed = {}
        if self.pool is not None:
            self.pool.clear(force=True)  # before the handles go: nothing left to return
            self.pool = None
        self._handles = []
        self.scratch = []
        self._scratch_free = []
        self._copied = []
        self._flag_host = self._flag_event = None
        self.staged = None
        self.decode_stream = self.flag = None
