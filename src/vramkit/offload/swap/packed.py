"""Compressed masters (``SwapConfig.compress``): fewer bytes over the host link, the same bits.

A frozen swapped block's master is encoded once at attach (:mod:`vramkit.compress`: bf16
exponents and 8-bit storage entropy-coded, everything else raw) into pinned host memory
(ordinary memory with ``host_memory="pageable"``: the staging pool's worker copies the payload,
then launches its decode), and its raw master is given back, so the host holds the compressed
bytes only. Beside a background fill (``checkpoint=``) one thread encodes each block as soon as
it is filled (:meth:`PackedMasters.encode_in_background`): until then the block loads from its
raw master, and :attr:`PackedMasters.lock` makes the switch atomic for the loads. A load then copies
the compressed payload into a device scratch buffer on the copy stream and decodes it into the
block's slot on a decode stream that waits for the copy (the Triton kernel on a GPU, the torch
reference on the CPU); the slot's *loaded* event is recorded after the decode, so the ring's
ordering is unchanged. Two scratch buffers take turns: the copy of the next block runs while
this one decodes (the copy engine never waits for a kernel), and a copy into a buffer waits
for the decode that last read it.

Only frozen blocks are compressed: a trainable master changes every step (an optimizer writes
it), and encoding it again each step would cost more than the copy it saves. Blocks in
node-shared memory (``vramkit.distributed``) keep raw masters. With a collective
``block_loader`` (sharded uploads) the masters are encoded before the attach returns, alike in
every process (alignment gaps zeroed: the bytes must be equal), and each load gathers the
compressed payload: a process copies its piece, the others' arrive over the GPU links, each
process decodes the whole.
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

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
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
from vramkit.errors import OffloadError
from vramkit.memory.pool import MemoryPool
from vramkit.memory.transfer import Streams
from vramkit.offload.swap.records import SwappedBlock
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.offload.swap.fill import MasterFill
    from vramkit.offload.swap.ring import BlockLoader
    from vramkit.offload.swap.staged import StagedCopies

__all__ = ["AUTO_MAX_RATIO", "COMPRESS_MODES", "PackedMasters"]

logger = logging.getLogger(__name__)

COMPRESS_MODES = ("off", "on", "auto")
#: Device scratch buffers (each the largest payload) on a GPU: two let copy and decode overlap.
SCRATCH_BUFFERS = 2
#: "auto" keeps a block compressed at this ratio or below: the copy saved must repay the decode
#: (a decode at the GPU's rate costs a few percent of a copy at the host link's rate).
AUTO_MAX_RATIO = 0.9
_POLL_SECONDS = 0.05  # how often a background encode waiting for a fill checks for a cancel
_BACKGROUND_CHUNK_GROUPS = 64  # a background encode's chunk: ~100 MiB of device temporaries
_UNGUARDED = contextlib.nullcontext()


class PackedMasters:
    """The compressed masters of a swapper (see the module docstring).

    Args:
        mode: ``"on"`` or ``"auto"``.
        device: the compute device (the encode runs there when it is a GPU).
        streams: its copy streams.
        pool: makes the pinned pool the payloads are allocated from (``HostStore.pool``).
        only: the blocks to compress (``SwapConfig.compressed_blocks``; ``None``: all).
    """

    def __init__(self, mode: str, device: torch.device, streams: Streams,
                 pool: Callable[..., MemoryPool], only: Sequence[str] | None = None) -> None:
        self.mode = mode
        self.only = None if only is None else frozenset(only)  # SwapConfig.compressed_blocks
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
        self._largest = 0  # the largest payload (the scratch buffers' size)
        # A background encode (encode_in_background) switches a block from its raw master to
        # its compressed one under this lock; a load that may still read the raw master
        # chooses and enqueues its copy under it too (guard), so a block is never half
        # switched and a raw master is given back only after the copies that read it.
        self.lock = threading.RLock()
        self._encoder: _BackgroundEncode | None = None
        if device.type == "cuda" and not triton_decoder_available(device):
            logger.warning("BlockSwapper: SwapConfig.compress=%r without Triton: the torch "
                           "reference decodes on the GPU (many small kernels and a host sync "
                           "per load); install triton for the GPU decoder", mode)

    def eligible(self, block: SwappedBlock) -> bool:
        """Frozen, with a master of its own in RAM, and among ``compressed_blocks`` if given."""
        return (not block.trainable_entries and not block.on_disk and block.nbytes > 0
                and (self.only is None or block.name in self.only))

    def holds(self, block: SwappedBlock) -> bool:
        return id(block) in self.packed

    def pack(self, block: SwappedBlock, master: torch.Tensor) -> bool:
        """Encode ``block``'s filled ``master``; returns whether the block is now compressed
        (the caller then gives the raw master back)."""
        encoded = self._encode(block, master)
        if encoded is None:
            return False
        with self.lock:
            self._adopt(block, *encoded)
        return True

    def _encode(self, block: SwappedBlock, master: torch.Tensor, *,
                chunk_groups: int | None = None) -> tuple[Compressed, list[Any]] | None:
        """``block``'s compressed master and its payload's pool blocks, or ``None`` where it
        stays raw (``"auto"``); the block is not switched yet (:meth:`_adopt`)."""
        if self.pool is None:
            self.pool = self._make_pool(None, initial=0, pinned=not self.pageable)
        handles: list[Any] = []

        def alloc(n: int) -> torch.Tensor:
            handle = self.pool.allocate(max(n, 1))  # type: ignore[union-attr]
            handles.append(handle)
            return handle.view((max(n, 1),), torch.uint8)[:n]

        regions = _regions(block, master)
        work = self.device if self.device.type == "cuda" else torch.device("cpu")
        # no crc32 here: in RAM every decode checks each group's checksum and stream ends,
        # and a crc of the payload would cost a pass over it per block at attach
        try:
            c = encode(master[:block.nbytes], regions, device=work, alloc=alloc, crc=False,
                       chunk_groups=chunk_groups)
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
            return None
        return c, handles

    def _adopt(self, block: SwappedBlock, c: Compressed, handles: list[Any]) -> None:
        # under self.lock: loads of the block decode from now on
        self.packed[id(block)] = c
        self._handles += handles
        self.raw_bytes += block.nbytes
        self._largest = max(self._largest, c.compressed_nbytes)

    def pack_for_disk(self, block: SwappedBlock, raw: torch.Tensor) -> Compressed | None:
        """Encode a disk-tier block's bytes (``raw``, host memory) for the disk tier's cache
        file; ``None`` where it would not shrink (``"auto"`` above :data:`AUTO_MAX_RATIO`, or
        larger than the raw bytes: its staging buffer holds the raw size; or not among
        ``compressed_blocks``)."""
        if self.only is not None and block.name not in self.only:
            return None
        regions = _regions(block, raw)
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
        self._largest = max(self._largest, c.compressed_nbytes)
        return c

    # -- encoding in the background -----------------------------------------------------

    def encode_in_background(self, blocks: Sequence[SwappedBlock], fill: MasterFill,
                             give_back: Callable[[SwappedBlock], Callable[[], None]],
                             fence: Callable[[], None],
                             on_done: Callable[[], None] | None = None) -> None:
        """Encode ``blocks`` (eligible, in fill order) on one thread as ``fill`` fills them.

        Each block is encoded once its master is filled and switched to its compressed master
        under :attr:`lock`: ``give_back(block)`` (called under the lock) unlinks its raw
        master from the block and returns what frees it; ``fence()`` (outside the lock) returns
        once every copy enqueued from a raw master before it has read its bytes; then the raw
        master is freed. Pinned memory holds raw and compressed bytes of at most one block at
        once. ``on_done`` runs on the thread once every block is done (or the encode was
        cancelled)."""
        self._encoder = _BackgroundEncode(self, blocks, fill, give_back, fence, on_done)

    @property
    def encoding(self) -> bool:
        """Whether a background encode is still under way."""
        return self._encoder is not None and not self._encoder.done

    def guard(self, block: SwappedBlock) -> contextlib.AbstractContextManager[Any]:
        """Hold this around a load's choice between the compressed and the raw master and the
        enqueueing of its copy: while ``block``'s background encode is under way the switch
        cannot happen in between (nothing to hold before or after it).

        Raises:
            OffloadError: the block's encode failed.
        """
        encoder = self._encoder
        if encoder is None:
            return _UNGUARDED
        done = encoder.events.get(id(block))
        if done is None:
            return _UNGUARDED
        if done.is_set():  # switched (or kept raw) for good
            encoder.check(block)
            return _UNGUARDED
        return self.lock

    def wait_encoded(self, block: SwappedBlock | None = None) -> None:
        """Wait until ``block`` (every block: ``None``) is encoded or kept raw.

        Raises:
            OffloadError: its encode (the first failed one) failed.
        """
        if self._encoder is not None:
            self._encoder.wait(block)

    def encode_error(self, block: SwappedBlock) -> OffloadError | None:
        """Why ``block``'s background encode failed (it kept its raw master), if it did."""
        if self._encoder is None:
            return None
        try:
            self._encoder.check(block)
        except OffloadError as exc:
            return exc
        return None

    def cancel_encode(self) -> None:
        """Stop a background encode (detach, a failed attach): returns once nothing switches
        any more; the blocks not encoded by then keep their raw masters."""
        if self._encoder is not None:
            self._encoder.cancel()

    def finish(self) -> None:
        """After the last :meth:`pack` of a foreground encode: the device scratch (the largest
        payload) and the flag, before the first load."""
        if not self.packed:
            return
        self._scratch_for(self._largest)
        logger.info("BlockSwapper: %d frozen masters compressed, %s -> %s (%.3f), scratch %s",
                    len(self.packed), format_size(self.raw_bytes),
                    format_size(self.compressed_bytes), self.ratio,
                    f"{len(self.scratch)} x {format_size(self.scratch[0].numel())}")

    def _scratch_for(self, nbytes: int) -> None:
        """Scratch buffers of at least ``nbytes`` (main thread, at a load).

        A background encode (:meth:`encode_in_background`) learns the largest payload only at
        its end, after the first loads. The buffers are allocated here, at the first
        compressed load, and grown when a larger payload comes, to the largest one known then,
        rather than sized up front from a bound (the raw size of the largest block, or the
        codec's worst case): a bound would hold about 1/ratio (~1.45x) of the scratch the
        planner prices (``planning/_compression.py``: two buffers of the largest *compressed*
        block) for the whole first pass; grown, the device holds what was planned. Growing
        happens on the thread that issues the loads, so no load is using a buffer as it is
        replaced; the old buffers are handed to the caching allocator recorded on the copy and
        decode streams (their memory is reused only after the copies and decodes already
        queued on them), and a staged load's worker keeps a reference until it has enqueued
        its work."""
        if self.scratch and self.scratch[0].numel() >= nbytes:
            return
        count = SCRATCH_BUFFERS if self.device.type == "cuda" else 1
        if not self.scratch:  # the first compressed load (or a foreground finish)
            self._scratch_free = [None] * count
            if self.device.type == "cuda":
                self.decode_stream = torch.cuda.Stream(self.device)
                # created up front: a staged load's waits name them before the worker
                # records them
                self._scratch_free = [self.streams.event() for _ in range(count)]
                self._copied = [self.streams.event() for _ in range(count)]
            self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        elif self.device.type == "cuda":
            for old in self.scratch:
                old.record_stream(self.streams.h2d)
                old.record_stream(self.decode_stream)
        size = max(nbytes, self._largest)
        self.scratch = [torch.empty(size, dtype=torch.uint8, device=self.device)
                        for _ in range(count)]

    @property
    def compressed_bytes(self) -> int:
        with self.lock:  # a background encode adds blocks
            return sum(c.compressed_nbytes for c in self.packed.values())

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / self.raw_bytes if self.raw_bytes else 1.0

    def load(self, block: SwappedBlock, dest: torch.Tensor, source: torch.Tensor | None = None,
             loaded_event: Any = None, *, loader: BlockLoader | None = None
             ) -> tuple[int, Any]:
        """Fill ``dest`` (the block's bytes of a slot) from its compressed master (or, for a
        disk-tier block, the staging bytes ``source`` it was read into): the copy into a
        scratch buffer on the copy stream (ordered as the ring ordered it), then the decode.
        With a collective ``loader`` (sharded uploads) this process copies its piece of the
        payload and the processes all-gather the rest into the scratch buffer (every process
        loads the same compressed block here: the swapper encodes before its attach returns).
        Returns the bytes copied from the host and the stream the decode runs on (the slot's
        *loaded* event goes there) -- or ``None`` with pageable payloads: the staging worker
        copies them, launches the decode and records ``loaded_event`` itself (the ring's
        ``settle(loaded_event)`` waits for that)."""
        self.poll()
        c = self.packed[id(block)]
        if source is not None:
            c = c.to(source[:c.compressed_nbytes])
        n = c.compressed_nbytes
        # a collective loader (sharded uploads) gathers the payload in equal padded pieces
        padded = loader.padded_bytes(n) if loader is not None else n
        self._scratch_for(padded)
        assert self.scratch and self.flag is not None
        streams = self.streams
        turn = self._turn
        self._turn = (turn + 1) % len(self.scratch)
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
        if loader is not None:  # this process's piece from the host, the rest gathered
            n = loader.load(self.scratch[turn][:padded], c.payload, streams, block.name)
        else:
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
        with self.lock:  # one consistent view while a background encode switches blocks
            pinned = (self.pool.stats().reserved if self.pool is not None and not self.pageable
                      else 0)
            return {"compressed_blocks": len(self.packed),
                    "compressed_bytes": self.compressed_bytes,
                    "compressed_raw_bytes": self.raw_bytes,
                    "compress_scratch_bytes": sum(s.numel() for s in self.scratch),
                    "pinned": pinned}

    def close(self) -> None:
        self.cancel_encode()
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


def _regions(block: SwappedBlock, master: torch.Tensor) -> list[Region]:
    """The codec's regions of ``block``'s master, its alignment gaps zeroed first: the codec
    keeps every byte of the buffer, and a gap left as the pool found it made the same weights
    encode differently in two processes (sharded uploads gather one payload from pieces of
    each process's own: their bytes must be equal)."""
    end = 0
    for e in sorted(block.entries, key=lambda e: e.offset):
        if e.offset > end:
            master[end:e.offset].zero_()
        end = max(end, e.offset + e.nbytes)
    if block.nbytes > end:
        master[end:block.nbytes].zero_()
    return [Region(e.offset, e.nbytes, byte_kind(e.dtype)) for e in block.entries]


class _BackgroundEncode:
    """The thread of :meth:`PackedMasters.encode_in_background` and its per-block outcome."""

    def __init__(self, packed: PackedMasters, blocks: Sequence[SwappedBlock], fill: MasterFill,
                 give_back: Callable[[SwappedBlock], Callable[[], None]],
                 fence: Callable[[], None], on_done: Callable[[], None] | None) -> None:
        self.packed = packed
        self.blocks = list(blocks)
        self.events = {id(b): threading.Event() for b in self.blocks}  # set once switched
        # (or kept raw, or failed: then the error is here)
        self.errors: dict[int, BaseException] = {}
        self.done = False
        self.switched = 0  # blocks now compressed
        self._fill = fill
        self._give_back = give_back
        self._fence = fence
        self._on_done = on_done
        self._cancelled = False
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="vramkit-fill-encode",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        packed = self.packed
        try:
            if packed.device.type == "cuda":
                # The current device is per thread. The encode runs on the default stream, as
                # a foreground encode does: its temporaries go back to the caching allocator's
                # pool the steps allocate from (on a stream of its own they would stay cached
                # for that stream only, lost to the steps until empty_cache); its host syncs
                # then wait for the steps' queued kernels, which slows this thread only.
                torch.cuda.set_device(packed.device)
            for block in self.blocks:
                try:
                    if self._filled(block):
                        self._encode(block)
                except BaseException as exc:  # kept for the main thread (guard, wait)
                    self.errors[id(block)] = exc
                    logger.warning("BlockSwapper: encoding %s failed (its raw master is "
                                   "kept): %s: %s", block.name, type(exc).__name__, exc)
                finally:
                    self.events[id(block)].set()
        except BaseException as exc:  # no device for the encode: every block not done fails
            for block in self.blocks:
                if not self.events[id(block)].is_set():
                    self.errors[id(block)] = exc
        finally:
            self.done = True
            for event in self.events.values():
                event.set()
            if not self._cancelled:
                logger.info("BlockSwapper: %d of %d frozen masters compressed beside the fill "
                            "in %.1f s; all compressed: %s -> %s (%.3f)", self.switched,
                            len(self.blocks), time.perf_counter() - self._started,
                            format_size(packed.raw_bytes), format_size(packed.compressed_bytes),
                            packed.ratio)
            if self._on_done is not None:
                self._on_done()

    def _filled(self, block: SwappedBlock) -> bool:
        """Wait for ``block``'s fill; ``False`` when it failed (its loads raise the read error)
        or the encode was cancelled meanwhile."""
        while not self._fill.settled(block, _POLL_SECONDS):
            if self._cancelled:
                return False
        return not self._cancelled and not self._fill.failed(block)

    def _encode(self, block: SwappedBlock) -> None:
        packed = self.packed
        master = block.master
        assert master is not None  # filled
        # beside the training steps: smaller chunks (~100 MiB of temporaries on the device,
        # not the ~400 of a foreground encode), which the plan's headroom absorbs
        encoded = packed._encode(block, master, chunk_groups=_BACKGROUND_CHUNK_GROUPS)
        if encoded is None:  # "auto": it stays raw
            return
        with packed.lock:  # no load is between its choice and its copy's enqueueing
            packed._adopt(block, *encoded)
            free = self._give_back(block)
            self.switched += 1
        self._fence()  # the raw copies enqueued before the switch have read the master
        free()

    def check(self, block: SwappedBlock) -> None:
        exc = self.errors.get(id(block))
        if exc is None:
            return
        error = OffloadError(
            f"encoding the master of swapped block {block.name} "
            f"(SwapConfig.compress={self.packed.mode!r}) failed: {type(exc).__name__}: {exc}",
            hint="Its raw master was kept, so detach() still gives every weight back; "
                 "compress='off' skips the encode.")
        error.__cause__ = exc
        raise error

    def wait(self, block: SwappedBlock | None) -> None:
        blocks = self.blocks if block is None else [block]
        for b in blocks:
            event = self.events.get(id(b))
            if event is not None:
                event.wait()
        if block is None:
            self._join()
        for b in blocks:
            self.check(b)

    def cancel(self) -> None:
        self._cancelled = True
        self._join()

    def _join(self) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join()
