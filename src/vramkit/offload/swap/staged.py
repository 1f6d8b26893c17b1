"""Host->device copies from pageable host memory through a small pinned pool, off the main thread.

``SwapConfig(host_memory="pageable")`` keeps the swapped blocks' masters in ordinary (pageable)
host memory instead of pinning all of them. Pinning the whole model is what makes swapping fast
on a Linux host, but under Windows' display driver model (WSL 2 and native Windows) page-locked
memory is charged as "shared GPU memory" and capped at about half of RAM, and a machine with
little RAM cannot lock gigabytes at all. A plain non-blocking copy from pageable memory is
correct (the driver stages it through its own bounce buffers) but blocks the Python thread for
the whole copy at a fraction of the pinned rate (``benchmarks/pinning_fallback.py``).

:class:`StagedCopies` moves a block the way a driver would, but on its own thread: the block is
cut into chunks; for each chunk one worker thread waits until a pinned staging chunk is free
(the event of its last host->device copy), copies the pageable bytes into it (``memcpy``: a
torch CPU copy, which releases the GIL and runs on torch's intra-op threads), and enqueues the
host->device copy from the chunk on the copy stream, recording the chunk's event. With at least
two chunks the memcpy of one chunk overlaps the DMA of the one before, so a block moves at about
the slower of the two rates. The pinned bytes are the pool's, whatever the model's size.

The ring (:mod:`vramkit.offload.swap.ring`) hands a slot fill to :meth:`StagedCopies.copy_in`
with the events the copy must wait for and the slot's *loaded* event; the worker enqueues the
waits, the chunk copies and the *loaded* record on the copy stream. The ring's acquire calls
:meth:`StagedCopies.settle` before it orders the compute stream after *loaded*: a CUDA stream
that waits for an event not recorded yet would not wait at all, so the main thread waits (on
the host) only until the worker has *enqueued* the block's copies, never for the copies
themselves. Prefetches run ahead on the worker while the main thread launches kernels.

Errors on the worker are kept and raised on the main thread by the next :meth:`settle`,
:meth:`copy_in` or :meth:`drain`; :meth:`close` stops the worker (cancelling what it has not
started) and waits for the copies in flight before the pool is freed. A copier dropped without
:meth:`close` stops its worker too (the thread holds no reference to it).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vramkit.devices.host import HostMemoryChoice, choose_host_memory
from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams
from vramkit.offload.swap.records import ALIGN
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.offload.swap.config import SwapConfig
    from vramkit.offload.swap.records import SwappedBlock

__all__ = ["DEFAULT_CHUNK_BYTES", "StagedCopies", "measure_memcpy_bytes_per_s",
           "measure_staged_bytes_per_s",
           "resolve_host_memory", "staging_layout"]

# One chunk: large enough that a copy's fixed costs (an event, a launch, ~10 us) vanish against
# its transfer (64 MiB take ~1.2 ms at 55 GB/s), small enough that a 2 GiB pool holds 32 of
# them and the memcpy of one overlaps the DMA of several.
DEFAULT_CHUNK_BYTES = 64 << 20
_POLL_SECONDS = 0.25  # how often a waiting main thread checks that the worker is alive


def measure_memcpy_bytes_per_s(nbytes: int = DEFAULT_CHUNK_BYTES * 4, repeats: int = 3) -> float:
    """This host's rate of the staging worker's memcpy: a torch CPU copy of ``nbytes`` between
    two ordinary buffers, the best of ``repeats`` (after one to fault the pages in)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


def measure_staged_bytes_per_s(device: torch.device, nbytes: int = DEFAULT_CHUNK_BYTES * 8,
                               chunks: int = 4, repeats: int = 2) -> float:
    """The staged copy's own rate here: ``nbytes`` of pageable memory through a
    :class:`StagedCopies` of ``chunks`` pinned chunks into device memory, the best of
    ``repeats`` (after one that faults the pages in and starts the worker). The host's memcpy
    and the DMA out of the chunks run at once and share the host's memory bandwidth, which a
    memcpy timed alone does not see (on an H200 host, ``benchmarks/pageable.py``: 40.4 GB/s
    alone, 31.0 GB/s staged, 55.5 GB/s pinned). On a CPU device:
    :func:`measure_memcpy_bytes_per_s`."""
    if device.type != "cuda":
        return measure_memcpy_bytes_per_s()
    from vramkit.memory.transfer import transfer_streams

    streams = transfer_streams(device)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copier = StagedCopies(device, streams, chunk_bytes=min(DEFAULT_CHUNK_BYTES, nbytes // 2),
                          chunks=chunks)
    try:
        best = float("inf")
        for i in range(repeats + 1):
            done = streams.event()
            start = time.perf_counter()
            copier.copy_in(dst, src, done, what="the staged-copy probe")
            copier.settle(done)
            streams.synchronize(done)
            if i:
                best = min(best, time.perf_counter() - start)
    finally:
        copier.close()
    return nbytes / max(best, 1e-9)


def resolve_host_memory(config: SwapConfig, device: torch.device,
                        blocks: list[SwappedBlock], *, shared: bool = False,
                        loader: bool = False) -> HostMemoryChoice:
    """``config.host_memory`` for this swapper: what ``"auto"`` means here (the masters' bytes
    against the pinning cap, the platform), with its reason; a pageable choice the swapper
    cannot honour is refused (``"pageable"``) or turned down with the reason (``"auto"``)."""
    requested = config.host_memory
    if not blocks:
        return HostMemoryChoice("pinned", "nothing is swapped")
    conflict = ("trainable='swap' writes weights and optimizer state back into pinned masters"
                if config.trainable == "swap"
                else "master_memory= keeps the masters in memory the swapper does not own"
                if shared else "block_loader= copies from the masters itself" if loader else None)
    if requested == "pageable" and conflict is not None:
        raise ConfigError(f"SwapConfig(host_memory='pageable') cannot apply: {conflict}",
                          hint="Use host_memory='pinned' (or 'auto') here.")
    if requested == "auto":
        if device.type != "cuda":
            return HostMemoryChoice("pinned", "the CPU computes: nothing is copied to a GPU")
        if conflict is not None:
            return HostMemoryChoice("pinned", conflict)
    return choose_host_memory(requested, pinned_bytes=sum(b.nbytes for b in blocks))


def staging_layout(pool_bytes: int, largest_block: int, blocks_in_flight: int,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, int]:
    """The staging chunks a copier uses: ``(chunk_bytes, count)``, at least two chunks.

    The pool never holds more than the bytes that can be in flight at once (``blocks_in_flight``
    blocks of ``largest_block`` bytes: the ring's prefetch depth), so a small model pins little;
    a pool too small for two chunks of ``chunk_bytes`` gets two smaller chunks, and chunks are
    never larger than a block.

    Args:
        pool_bytes: the pinned bytes allowed (``SwapConfig.staging_pool``).
        largest_block: the largest swapped block's bytes.
        blocks_in_flight: blocks that may be on their way at once.
        chunk_bytes: the preferred chunk size.
    """
    block = -(-max(1, largest_block) // ALIGN) * ALIGN
    chunk = max(ALIGN, min(chunk_bytes, block, (pool_bytes // 2) // ALIGN * ALIGN))
    useful = -(-block * max(1, blocks_in_flight) // chunk)
    return chunk, max(2, min(pool_bytes // chunk, useful))


@dataclass(eq=False)
class _Job:
    """One block's copy, as the worker sees it: host->device (``done_event`` recorded behind
    the copies; ``enqueued`` once they are enqueued) or, with ``out``, device->host (``waits``
    ordering the copies after the producer; ``enqueued`` once the bytes are in ``dst``)."""

    dst: torch.Tensor
    src: torch.Tensor
    waits: tuple[Any, ...]
    done_event: Any
    what: str
    out: bool = False
    then: Callable[[], None] | None = None  # run by the worker right after the copies
    barrier: bool = False  # no copy: ``enqueued`` tells that every job before it is done
    enqueued: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _State:
    """What the worker thread shares with the copier (never the copier itself)."""

    def __init__(self, streams: Streams, chunks: list[torch.Tensor], device: torch.device) -> None:
        self.streams = streams
        self.chunks = chunks
        self.chunk_events: list[Any] = [None] * len(chunks)
        self.device = device
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.stopping = False
        self.error: BaseException | None = None
        self.next_chunk = 0
        self.lock = threading.Lock()
        self.counters = {"staged_copies": 0, "staged_copy_bytes": 0, "staged_chunk_waits": 0,
                         "staged_memcpy_seconds": 0.0, "staged_out_copies": 0,
                         "staged_out_bytes": 0}


_NOTHING = torch.empty(0, dtype=torch.uint8)


def _worker(state: _State) -> None:
    try:
        if state.device.type == "cuda":
            torch.cuda.set_device(state.device)  # the CUDA runtime's current device is per thread
    except BaseException as exc:  # kept for the main thread: every job then fails with it
        state.error = exc
    while True:
        job = state.jobs.get()
        if job is None:
            return
        if job.barrier:  # the jobs are taken in order: every one before it is done
            job.enqueued.set()
            continue
        if state.stopping or state.error is not None:
            job.error = state.error or OffloadError("the staged copier was closed",
                                                    hint="Detach the swapper last.")
            job.enqueued.set()
            continue
        try:
            (_run_out if job.out else _run)(state, job)
        except BaseException as exc:  # kept for the main thread, never lost on this one
            state.error = exc
            job.error = exc
        finally:
            # a gradient's device memory is free to go once its copies are enqueued (the
            # job itself may wait in the pending table until the next settle/drain)
            job.src = job.dst = _NOTHING
            job.enqueued.set()


def _run(state: _State, job: _Job) -> None:
    streams = state.streams
    for event in job.waits:  # enqueued here, so the copy stream waits just before the copies
        streams.wait(streams.h2d, event)
    nbytes = job.src.numel()
    offset = 0
    chunks, events = state.chunks, state.chunk_events
    while offset < nbytes:
        i = _take_chunk(state)  # its last DMA done before it is overwritten
        chunk = chunks[i]
        size = min(chunk.numel(), nbytes - offset)
        start = time.perf_counter()
        chunk[:size].copy_(job.src[offset:offset + size])  # pageable -> pinned (memcpy)
        state.counters["staged_memcpy_seconds"] += time.perf_counter() - start
        streams.copy(job.dst[offset:offset + size], chunk[:size], streams.h2d, job.what)
        streams.record(events[i], streams.h2d)
        offset += size
    streams.record(job.done_event, streams.h2d)
    if job.then is not None:  # e.g. a compressed master's decode, behind its copies
        job.then()


def _take_chunk(state: _State) -> int:
    """The next chunk, once its last copy (either way) is done."""
    streams, events = state.streams, state.chunk_events
    i = state.next_chunk
    state.next_chunk = (i + 1) % len(state.chunks)
    if events[i] is not None:
        if not streams.done(events[i]):
            state.counters["staged_chunk_waits"] += 1
            streams.synchronize(events[i])
    else:
        events[i] = streams.event()
    return i


def _run_out(state: _State, job: _Job) -> None:
    """Device->host: each piece copied into a chunk on the device->host stream, then (while
    the next piece's copy runs) from the chunk into the pageable destination."""
    streams = state.streams
    for event in job.waits:
        streams.wait(streams.d2h, event)
    nbytes = job.src.numel()
    landing: list[tuple[int, int, int]] = []

    def land() -> None:
        i, offset, size = landing.pop(0)
        streams.synchronize(state.chunk_events[i])
        job.dst[offset:offset + size].copy_(state.chunks[i][:size])

    offset = 0
    while offset < nbytes:
        i = _take_chunk(state)
        size = min(state.chunks[i].numel(), nbytes - offset)
        streams.copy(state.chunks[i][:size], job.src[offset:offset + size], streams.d2h,
                     job.what)
        streams.record(state.chunk_events[i], streams.d2h)
        landing.append((i, offset, size))
        if len(landing) > 1:
            land()
        offset += size
    while landing:
        land()
    if job.src.device.type == "cuda":  # freed by the caller: its memory is read on d2h
        job.src.record_stream(streams.d2h)
    state.counters["staged_out_copies"] += 1
    state.counters["staged_out_bytes"] += nbytes


def _shutdown(state: _State) -> None:
    state.stopping = True
    state.jobs.put(None)


class StagedCopies:
    """Copies pageable host bytes to the device through a bounded pinned pool, on a worker
    thread (see the module docstring).

    Args:
        device: the compute device (on a CPU device the same logic runs with a plain host pool
            and synchronous stand-in streams: how the tests exercise it).
        streams: the device's copy streams.
        chunk_bytes: bytes of each staging chunk.
        chunks: number of chunks (at least two, so a memcpy overlaps the previous chunk's DMA).
    """

    def __init__(self, device: torch.device, streams: Streams, *, chunk_bytes: int,
                 chunks: int) -> None:
        if chunks < 2:
            raise OffloadError(f"a staged copier needs at least two chunks, got {chunks}",
                               hint="Raise SwapConfig.staging_pool.")
        if device.type == "cuda" and device.index is None:  # the worker sets it by index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        config = PoolConfig(initial_size=chunk_bytes * chunks, max_size=chunk_bytes * chunks,
                            growth_factor=1.0, alignment=ALIGN, max_cached_buffers=0)
        self.pool = (MemoryPool.pinned(config) if device.type == "cuda"
                     else MemoryPool("cpu", config))
        self._handles = [self.pool.allocate(chunk_bytes) for _ in range(chunks)]
        views = [h.view((chunk_bytes,), torch.uint8) for h in self._handles]
        self._state = _State(streams, views, device)
        self._pending: dict[int, _Job] = {}  # id(done_event) -> the last job recording it
        self._thread = threading.Thread(target=_worker, args=(self._state,),
                                        name="vramkit-staged-copies", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        self.closed = False

    @property
    def pinned_bytes(self) -> int:
        """Bytes the staging pool holds (page-locked on a GPU, unless pinning fell back)."""
        return self.pool.stats().reserved

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, done_event: Any, *,
                waits: tuple[Any, ...] = (), what: str = "",
                then: Callable[[], None] | None = None, key: object = None) -> None:
        """Have the worker copy ``src`` (flat uint8 host bytes, pageable) into ``dst`` (flat
        uint8 device bytes) on the copy stream, after ``waits``, recording ``done_event``
        behind the copies, then call ``then`` (on the worker: work that must be enqueued after
        the copies, such as a compressed master's decode). Returns at once; :meth:`settle`
        with ``key`` (default ``done_event``) waits for the enqueueing, ``then`` included."""
        self._raise_error()
        if self.closed:
            raise OffloadError("the staged copier is closed",
                               hint="A swapped block was loaded after swapper.detach().")
        if dst.numel() != src.numel():
            raise OffloadError(f"staged copy of {what}: {src.numel()} bytes into {dst.numel()}",
                               hint="A block's master and its slot disagree in size: a vramkit "
                                    "bug; please report it with the model and "
                                    "host_memory='pageable'.")
        job = _Job(dst, src, tuple(waits), done_event, what, then=then)
        self._pending[id(done_event if key is None else key)] = job
        # counted as handed over (this thread), so stats never wait for the worker
        self._state.counters["staged_copies"] += 1
        self._state.counters["staged_copy_bytes"] += src.numel()
        self._state.jobs.put(job)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, key: object, *,
                 waits: tuple[Any, ...] = (), what: str = "") -> None:
        """Have the worker copy ``src`` (flat uint8 device bytes; kept alive until its copies
        are enqueued) into ``dst`` (flat uint8 host bytes, pageable) after ``waits``, through
        the staging chunks. :meth:`settle` with ``key`` (or :meth:`drain`) waits until the
        bytes are in ``dst``."""
        self._raise_error()
        if self.closed:
            raise OffloadError("the staged copier is closed",
                               hint="Run backward() before swapper.detach().")
        job = _Job(dst, src, tuple(waits), None, what, out=True)
        self._pending[id(key)] = job
        self._state.jobs.put(job)

    def settle(self, done_event: Any) -> None:
        """Return once the copy that records ``done_event`` is enqueued (at once when none is
        pending); raises the worker's error if it failed."""
        job = self._pending.pop(id(done_event), None)
        if job is not None:
            self._wait(job)
        self._raise_error()

    def drain(self) -> None:
        """Wait until every copy submitted so far is enqueued (before the host writes a master
        the worker may still be reading, and before a host sync on the copy stream)."""
        jobs, self._pending = list(self._pending.values()), {}
        for job in jobs:
            self._wait(job)
        self._raise_error()

    def barrier(self) -> None:
        """Return once the worker is done with every job submitted before this call: it no
        longer reads their sources. Unlike :meth:`drain`, callable from any thread (a
        background encode calls it before it gives a raw master back); returns at once when
        the worker has stopped."""
        job = _Job(_NOTHING, _NOTHING, (), None, "a barrier", barrier=True)
        self._state.jobs.put(job)
        while not job.enqueued.wait(_POLL_SECONDS):
            if not self._thread.is_alive():  # stopped: nothing reads the sources any more
                return

    def _wait(self, job: _Job) -> None:
        while not job.enqueued.wait(_POLL_SECONDS):
            if not self._thread.is_alive():
                raise OffloadError(
                    f"the staged copier's worker stopped before copying {job.what}",
                    hint="The worker thread ended without an error to pass on: a vramkit bug; "
                         "host_memory='pinned' avoids the staged copies meanwhile.")
        if job.error is not None:
            self._raise(job.error, job.what)

    def _raise_error(self) -> None:
        if self._state.error is not None:
            self._raise(self._state.error, "a swapped block")

    def _raise(self, error: BaseException, what: str) -> None:
        if isinstance(error, OffloadError):
            raise error
        raise OffloadError(f"staged copy of {what} through pinned memory failed: {error}",
                           hint="The masters are in pageable memory "
                                "(SwapConfig.host_memory='pageable'); check host memory, or "
                                "use host_memory='pinned'.") from error

    def counters(self) -> dict[str, Any]:
        """Copies and bytes handed to the worker, times a chunk was still in flight, seconds of
        memcpy."""
        return dict(self._state.counters)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the worker (jobs not started are cancelled), wait for the copies in flight and
        free the pool. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()  # stopping + the sentinel
        self._thread.join(timeout)
        if self._thread.is_alive():  # a copy stuck on the device: the pool must stay alive
            raise OffloadError(f"the staged copier's worker did not stop within {timeout} s",
                               hint="The device may be hung; check nvidia-smi.")
        self._pending = {}
        for event in self._state.chunk_events:
            if event is not None:
                self.streams.synchronize(event)
        for handle in self._handles:
            if not handle.freed:
                handle.free()
        self._handles = []
        self.pool.clear(force=True)

    def __repr__(self) -> str:
        return (f"StagedCopies({len(self._state.chunks)} chunks of "
                f"{format_size(self.chunk_bytes)}, device={self.device})")
