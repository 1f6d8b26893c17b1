"""File bytes to a device through double-buffered pinned staging buffers.

The checkpoint's bytes (the wanted tensors, in file order) are cut into chunks of at most
``chunk_bytes``; a tensor larger than a chunk is split across several. For each chunk:

1. wait until its staging buffer is free again (the host waits on the event recorded after the
   buffer's previous copies -- the only host wait in the loop);
2. read the chunk's bytes into the pinned buffer (split across reader threads);
3. enqueue the host->device copies on the shared copy stream
   (:func:`vramkit.memory.transfer.transfer_streams`), so they run while the next chunk is
   read into the other buffer; when a tensor's stored dtype differs from the one wanted, the
   bytes land in a device scratch buffer and are converted into the tensor by a kernel on the
   same stream (conversion on the GPU, in chunk-sized pieces);
4. record the buffer's "free" event; for every tensor whose last bytes were in the chunk, record
   an event and make the caller's current stream wait on it (a device-side wait), then hand the
   tensor over.

Destinations are allocated on the caller's stream, and the copy stream waits for that stream
before writing into them, so memory the caching allocator recycled is never overwritten early.
On the CPU the same code runs on :class:`~vramkit.memory.transfer.HostStreams` (copies happen
at once), which is how the pipeline is unit-tested without a GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vramkit._validate import check_int
from vramkit.errors import ConfigError
from vramkit.io._header import TensorEntry
from vramkit.io.lazy import LazySafetensors, ReadThreads
from vramkit.memory.layout import align_up, calculate_alignment
from vramkit.memory.pool import Block, MemoryPool
from vramkit.memory.transfer import Streams

__all__ = ["DeviceStager", "Piece", "plan_chunks"]

logger = logging.getLogger(__name__)

_ALIGN = 16  # staging offsets: every element size divides it, so any piece can be viewed as its dtype


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor placed in a staging chunk.

    Args:
        entry: the tensor.
        start: first byte inside the tensor's data.
        nbytes: bytes in this piece.
        staging_offset: where the bytes go in the staging buffer.
    """

    entry: TensorEntry
    start: int
    nbytes: int
    staging_offset: int

    @property
    def last(self) -> bool:
        """Whether the piece holds the tensor's final bytes."""
        return self.start + self.nbytes == self.entry.nbytes


@dataclass
class _Chunk:
    pieces: list[Piece] = field(default_factory=list)
    used: int = 0


def plan_chunks(entries: Sequence[TensorEntry], chunk_bytes: int) -> Iterator[list[Piece]]:
    """Cut the tensors' bytes into chunks of at most ``chunk_bytes`` staging bytes.

    Tensors are packed in the given order; a tensor that does not fit in what is left of a chunk
    fills it and continues in the next one. Piece boundaries inside a tensor fall on multiples of
    16 bytes, so every piece holds whole elements. Empty tensors get an empty piece (so they are
    still delivered).

    Args:
        entries: the tensors, in read order.
        chunk_bytes: the staging buffer size, a multiple of 16 of at least 16 bytes.

    Yields:
        The pieces of each chunk.
    """
    if chunk_bytes < _ALIGN or chunk_bytes % _ALIGN:
        raise ConfigError(f"chunk_bytes must be a positive multiple of {_ALIGN}, got {chunk_bytes}",
                          hint="Use a staging chunk that is a multiple of 16 bytes, e.g. "
                               "chunk_bytes='64MiB' (the default).")
    chunk = _Chunk()
    for entry in entries:
        start = 0
        while True:
            # calculate_alignment: 256 bytes (a cudaMalloc's alignment, whole DMA bursts) for
            # all but tiny pieces; always a multiple of 16, so the piece arithmetic holds.
            offset = align_up(chunk.used, calculate_alignment(entry.nbytes - start))
            room = chunk_bytes - offset
            left = entry.nbytes - start
            if left == 0 and start == 0:  # an empty tensor: deliver it, use no room
                chunk.pieces.append(Piece(entry, 0, 0, min(offset, chunk_bytes)))
                break
            if room < _ALIGN and left > room:
                yield chunk.pieces
                chunk = _Chunk()
                continue
            take = left if left <= room else room - room % _ALIGN
            chunk.pieces.append(Piece(entry, start, take, offset))
            chunk.used = offset + take
            start += take
            if start == entry.nbytes:
                break
            yield chunk.pieces
            chunk = _Chunk()
    if chunk.pieces:
        yield chunk.pieces


@dataclass
class _Pending:
    out: torch.Tensor  # the destination, in the wanted dtype
    convert: bool


class DeviceStager:
    """Loads tensors from a checkpoint to a device through pinned staging buffers.

    Args:
        device: the destination device (CUDA; ``cpu`` runs the same pipeline on host streams).
        streams: the device's copy streams (``transfer_streams(device)``).
        pool: the host pool the staging buffers come from (pinned for CUDA).
        chunk_bytes: size of each staging buffer.
        num_buffers: how many staging buffers rotate (2 = double buffering).
        threads: threads that read each chunk in parallel (``None``: read in this thread).
    """

    def __init__(self, device: torch.device, streams: Streams, pool: MemoryPool, *,
                 chunk_bytes: int, num_buffers: int = 2, threads: ReadThreads | None = None) -> None:
        check_int("num_buffers", num_buffers, minimum=1)
        if device.type == "cuda" and pool.kind != "pinned":
            raise ConfigError("staging to a CUDA device needs a pinned host pool: copies from "
                              "pageable memory are synchronous",
                              hint="Pass MemoryPool.pinned(PoolConfig(...)).")
        self.device = device
        self.streams = streams
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.num_buffers = num_buffers
        self.threads = threads
        self.h2d_bytes = 0
        self.file_bytes = 0
        self.chunks = 0

    def _copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        # The one place host->device copies are enqueued: the transfer byte count lives here.
        self.streams.copy(dst, src, self.streams.h2d, what)
        self.h2d_bytes += src.numel() * src.element_size()

    def load(self, checkpoint: LazySafetensors, entries: Sequence[TensorEntry],
             dtype_for: Callable[[TensorEntry], torch.dtype],
             deliver: Callable[[str, torch.Tensor], None],
             progress: Callable[[int], None] | None = None) -> None:
        """Load ``entries`` to the device, handing each tensor to ``deliver`` when it is ready.

        A delivered tensor may be used on the caller's current stream at once (that stream
        already waits for its copies); the host never waits for it.

        Args:
            checkpoint: the open checkpoint the entries belong to.
            entries: the tensors to load, in read order.
            dtype_for: the dtype each tensor should have on the device.
            deliver: called with ``(name, tensor)`` once per tensor, in order.
            progress: called with the number of bytes of each chunk once it is enqueued.
        """
        # A small load gets buffers just big enough for it (with each piece's alignment padding).
        total = 0  # what plan_chunks would use in one unbounded chunk
        for entry in entries:
            total = align_up(total, calculate_alignment(entry.nbytes)) + entry.nbytes
        total = align_up(total, _ALIGN)
        buffer_bytes = min(self.chunk_bytes, max(_ALIGN, total))
        count = min(self.num_buffers, max(1, math.ceil(total / buffer_bytes)))
        blocks: list[Block] = []
        free_events: list[Any] = [None] * count
        scratch: list[torch.Tensor | None] = [None] * count
        try:
            for _ in range(count):
                block = self.pool.allocate(buffer_bytes)
                if self.device.type == "cuda":
                    block.record_stream(self.streams.h2d)  # the pool reuses it only after our copies
                blocks.append(block)
            staging = [block.view(buffer_bytes) for block in blocks]
            pending: dict[str, _Pending] = {}
            for number, pieces in enumerate(plan_chunks(entries, buffer_bytes)):
                slot = number % count
                if free_events[slot] is not None:
                    self.streams.synchronize(free_events[slot])  # staging buffer free again
                self._read_chunk(checkpoint, pieces, staging[slot])
                self._start_tensors(pieces, pending, dtype_for, scratch, slot, buffer_bytes)
                chunk_bytes = self._enqueue_chunk(pieces, pending, staging[slot], scratch[slot],
                                                  deliver)
                event = self.streams.event()
                self.streams.record(event, self.streams.h2d)
                free_events[slot] = event
                self.chunks += 1
                if progress is not None:
                    progress(chunk_bytes)
        finally:
            for block in blocks:
                block.free()

    def _read_chunk(self, checkpoint: LazySafetensors, pieces: Sequence[Piece],
                    staging: torch.Tensor) -> None:
        # Merge pieces that are adjacent both in the file and in the buffer into one read.
        runs: list[list[Any]] = []
        for piece in pieces:
            if piece.nbytes == 0:
                continue
            file_offset = piece.entry.file_offset + piece.start
            if runs:
                run = runs[-1]
                if (run[0] == piece.entry.path and run[1] + run[3] == file_offset
                        and run[2] + run[3] == piece.staging_offset):
                    run[3] += piece.nbytes
                    continue
            runs.append([piece.entry.path, file_offset, piece.staging_offset, piece.nbytes])
        for path, file_offset, staging_offset, nbytes in runs:
            dst = staging[staging_offset:staging_offset + nbytes]
            checkpoint.reader(path).read_into(dst, file_offset, self.threads)
            self.file_bytes += nbytes

    def _start_tensors(self, pieces: Sequence[Piece], pending: dict[str, _Pending],
                       dtype_for: Callable[[TensorEntry], torch.dtype],
                       scratch: list[torch.Tensor | None], slot: int, buffer_bytes: int) -> None:
        started = False
        for piece in pieces:
            entry = piece.entry
            state = pending.get(entry.name)
            if state is None:
                dtype = dtype_for(entry)
                out = torch.empty(entry.shape, dtype=dtype, device=self.device)
                state = pending[entry.name] = _Pending(out, dtype != entry.dtype)
                started = True
            # A tensor continued from the previous chunk may need this slot's scratch too.
            if state.convert and piece.nbytes and scratch[slot] is None:
                scratch[slot] = torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device)
                started = True
        if started:
            # New memory comes from the caller's stream; the copy stream must not write into it
            # before work queued there (that may still read recycled memory) is done.
            ready = self.streams.event()
            self.streams.record(ready, self.streams.current())
            self.streams.wait(self.streams.h2d, ready)

    def _enqueue_chunk(self, pieces: Sequence[Piece], pending: dict[str, _Pending],
                       staging: torch.Tensor, scratch: torch.Tensor | None,
                       deliver: Callable[[str, torch.Tensor], None]) -> int:
        enqueued = 0
        for piece in pieces:
            entry = piece.entry
            state = pending[entry.name]
            if piece.nbytes:
                src = staging[piece.staging_offset:piece.staging_offset + piece.nbytes]
                if not state.convert:
                    flat = state.out.reshape(-1).view(torch.uint8)
                    self._copy_to_device(flat[piece.start:piece.start + piece.nbytes], src,
                                         entry.name)
                else:
                    if scratch is None:  # _start_tensors allocates it for every converting slot
                        raise RuntimeError("internal error: no conversion scratch buffer")
                    raw = scratch[piece.staging_offset:piece.staging_offset + piece.nbytes]
                    self._copy_to_device(raw, src, entry.name)
                    size = entry.dtype.itemsize
                    first = piece.start // size
                    with self.streams.on(self.streams.h2d):
                        state.out.view(-1)[first:first + piece.nbytes // size].copy_(
                            raw.view(entry.dtype))
                enqueued += piece.nbytes
            if piece.last:
                done = self.streams.event()
                self.streams.record(done, self.streams.h2d)
                self.streams.wait(self.streams.current(), done)
                del pending[entry.name]
                deliver(entry.name, state.out)
        return enqueued
