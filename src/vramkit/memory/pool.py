"""MemoryPool: an arena for planned memory on a CUDA device, in pinned host memory or plain host memory.

PyTorch's caching allocator already does best-fit with splitting for ordinary ops; this pool does
not replace it. It serves *planned* memory -- swap slots, pinned masters, staging buffers, batch
buffers -- where a program wants a hard cap, honest statistics, stream-ordered reuse it controls,
compaction and leak reports.

How it works:

* **Segments.** The pool obtains memory a segment at a time (:mod:`vramkit.memory._segments`):
  one ``torch.empty(n, dtype=uint8)`` on the device; for pinned host pools one host buffer of
  exactly ``n`` bytes (an anonymous mmap) page-locked with ``cudaHostRegister`` -- never
  per-tensor pinning, and no power-of-two rounding (PyTorch versions without
  ``torch.cuda.cudart().cudaHostRegister`` fall back to ``torch.empty(n, pin_memory=True)``
  sized in powers of two). A pinned segment that cannot be page-locked -- the call fails, or it
  would pass the host's pinning cap (a container's memory limit, WSL's) -- is kept as pageable
  memory with one warning per process (``PoolConfig.pin_fallback``; counted in
  ``PoolStats.pageable_bytes``). When it needs more it grows the reserved total by ``growth_factor``
  (at least by the request), never past ``max_size``. A pinned segment is unregistered when it
  is released (only ever when it holds no live or pending block), and a finalizer unregisters
  what is left when the pool is garbage collected or the interpreter exits.
* **Sub-allocation.** Blocks are carved best-fit from the segments' free ranges with splitting and
  coalescing (:class:`vramkit.memory._arena.Arena`, O(log n) per operation). Repeated sizes take
  an exact-size fast path: a freed block is first kept in a per-size cache (at most
  ``max_cached_buffers`` per size) and handed back on the next request of that size (a *cache
  hit*). Cached blocks expire back into the arena after ``cleanup_interval`` seconds; expiry is
  checked lazily on allocate, free and trim, so there is no background thread.
* **Stream-ordered reuse.** Like PyTorch's allocator, the pool assumes a device block is used on
  the stream that is current when it is freed; use on other streams is declared with
  :meth:`Block.record_stream`. At free time an event is recorded on each declared stream and the
  block stays *pending* -- skipped, never waited for -- until every event has completed (the
  events are queried when an allocation misses the exact-size cache, and by ``stats``, ``trim``
  and ``defragment``; a cache hit never pays for them). Pinned
  pools also record an event on the current stream at every free, because a non-blocking copy
  from host memory may still be reading the block. Plain host pools have no streams:
  ``record_stream`` is a no-op there.
* **Handles.** :meth:`MemoryPool.allocate` returns a :class:`Block`. A block dropped without
  :meth:`Block.free` is returned by its finalizer (``Block.__del__``, chosen over
  ``weakref.finalize`` because it costs ~0.3 µs instead of ~1.5 µs on the allocation fast path)
  at the pool's next operation, and counted in ``PoolStats.leaked_frees``.

Alignment: every block offset and size is a multiple of ``PoolConfig.alignment`` (default 512
bytes, the granularity of PyTorch's CUDA allocator; vectorized CUDA loads need 16 bytes, TMA and
cuBLAS prefer 128-256). Segment bases are at least that aligned, so ``block.data_ptr`` is too.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import operator
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vramkit._validate import check_device, check_int
from vramkit.devices import _runtime
from vramkit.devices.cuda_errors import is_cuda_out_of_memory
from vramkit.devices.resolve import cuda_ordinal
from vramkit.errors import (
    ConfigError,
    DeviceError,
    DeviceMismatchError,
    InvalidBlockError,
    PoolExhaustedError,
)
from vramkit.memory._arena import (
    AllocationTracker,
    DefragmentResult,
    LiveBlock,
    PoolConfig,
    PoolLedger,
    PoolStats,
    capture_stack,
    fit_segment,
    format_stack,
    pow2_ceil,
)
from vramkit.memory._block import AllocRecord, Block, CudaBlockBuffer, Segment, shape_tuple
from vramkit.memory._segments import (
    PinnedSegmentBackend,
    PowerOfTwoPinnedSegments,
    make_segment_backend,
    register_finalizer,
)
from vramkit.units import format_size

__all__ = [
    "AllocationTracker",
    "Block",
    "DefragmentResult",
    "LiveBlock",
    "MemoryPool",
    "PoolConfig",
    "PoolStats",
    "live_pools",
]

logger = logging.getLogger(__name__)

# Indirection so tests can drive cache expiry without sleeping.
_clock = time.monotonic

_OVERLAP_CHUNK_LIMIT = 64  # beyond this many chunks an overlapping move goes through a temporary

_LIVE_POOLS: weakref.WeakSet[MemoryPool] = weakref.WeakSet()


def live_pools() -> list[MemoryPool]:
    """All :class:`MemoryPool` objects alive in this process (the memory profiler reports them).

    Returns:
        A new list; holding it keeps the pools alive, so do not store it.
    """
    return list(_LIVE_POOLS)


# The public home of the config, records and handles is this module (they live in private ones).
for _public in (AllocationTracker, Block, DefragmentResult, LiveBlock, PoolConfig, PoolStats):
    _public.__module__ = __name__
del _public


# --------------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------------


class MemoryPool:
    """An arena of planned memory on one CUDA device, in pinned host memory, or in host memory.

    Args:
        device: ``"cuda"``, ``"cuda:N"``, an int, a ``torch.device``, or ``"cpu"`` (default
            ``"cuda"``, the current CUDA device).
        config: the pool's settings (default ``PoolConfig()``).
        pinned: with ``device="cpu"``, back the pool with page-locked host memory (needs CUDA).

    Raises:
        DeviceError: when the device does not exist or CUDA is unavailable for it.
        ConfigError: for an invalid config or ``pinned=True`` on a CUDA device.

    Example:
        >>> pool = MemoryPool("cpu", PoolConfig(max_size="64MiB"))
        >>> block = pool.allocate(4096)
        >>> block.view((1024,), torch.float32).fill_(1.0).sum().item()
        1024.0
        >>> block.free()
    """

    def __init__(self, device: str | int | torch.device = "cuda",
                 config: PoolConfig | None = None, *, pinned: bool = False) -> None:
        if config is None:
            config = PoolConfig()
        elif not isinstance(config, PoolConfig):
            raise ConfigError(f"config must be a PoolConfig, got {type(config).__name__}",
                              hint="Pass a PoolConfig, e.g. MemoryPool('cuda', "
                                   "PoolConfig(max_size='4GiB')), or leave config out for the "
                                   "defaults.")
        self.config = config
        self.device, self.kind = _resolve_device(device, pinned)
        self._lock = threading.Lock()
        self._book = PoolLedger(config.max_cached_buffers, config.cleanup_interval)
        self._segments: dict[int, Segment] = {}
        self._segment_ids = itertools.count()
        self._serials = itertools.count()
        self._live: dict[int, AllocRecord] = {}
        self._dropped: deque[AllocRecord] = deque()  # appended by Block.__del__ without the lock
        self._trackers: list[AllocationTracker] = []  # replaced, never mutated: read unlocked
        self._mem_pool: Any = None
        self._alignment = config.alignment
        self._align_mask = config.alignment - 1
        self._tracking = config.enable_memory_tracking
        self._backend = make_segment_backend(self.kind, self.device, config.alignment,
                                             pin_fallback=config.pin_fallback)
        # Pinned registrations must be undone while the memory is still held (weakref.finalize,
        # not __del__: it also runs at interpreter exit).
        register_finalizer(self, self._backend, self._book)
        if config.initial_size:
            with self._lock:
                initial = (config.initial_size + self._align_mask) & ~self._align_mask
                if self._grow_locked(initial) is None:
                    raise ConfigError("PoolConfig.initial_size does not fit under max_size once "
                                      "rounded to this pool's segment sizes",
                                      hint="Lower PoolConfig.initial_size or raise "
                                           "PoolConfig.max_size so initial_size fits with room to "
                                           "spare (segment sizes are rounded up).")
        _LIVE_POOLS.add(self)
        logger.debug("created %s", self)

    @classmethod
    def pinned(cls, config: PoolConfig | None = None) -> MemoryPool:
        """A pool of page-locked host memory, for fast asynchronous host<->device copies.

        Each segment is one host buffer of exactly its size (rounded only to
        ``PoolConfig.alignment``), page-locked with ``cudaHostRegister``, so ``reserved`` is the
        number of bytes really pinned and a capped pool can hold any block up to ``max_size``.
        Segments are unregistered when trimmed or cleared and when the pool is garbage collected.
        On a PyTorch whose ``torch.cuda.cudart()`` lacks ``cudaHostRegister`` the pool warns and
        falls back to ``torch.empty(n, pin_memory=True)``, whose allocator rounds every
        allocation up to a power of two; segments are then sized as powers of two.

        When a segment cannot be page-locked (``cudaHostRegister`` returns an error,
        PyTorch's pinned allocator raises a CUDA error, or the segment would take vramkit's
        pinned bytes in this process past the host's pinning cap, see
        :func:`vramkit.devices.host.read_host_memory`), the pool keeps it as plain pageable
        memory and warns once per process with the figures (``PoolConfig.pin_fallback``, on by
        default; off, it raises ``DeviceError``). Copies from and into such memory are correct
        but slower and block the calling thread; ``stats().pageable_bytes`` counts it, and a
        block's ``tensor.is_pinned()`` tells which memory it is in. Before falling back, a pool
        whose growth would pass the cap grows by only the request when that fits under it.

        Args:
            config: the pool's settings (default ``PoolConfig()``).
        """
        return cls("cpu", config, pinned=True)

    # -- allocation -------------------------------------------------------------------------

    def allocate(self, nbytes: int, *, relocatable: bool = False) -> Block:
        """Allocate ``nbytes`` (rounded up to the alignment).

        Args:
            nbytes: bytes wanted, an int > 0.
            relocatable: let :meth:`defragment` move the block (default ``False``). Derive
                tensors from the handle after compaction.

        Returns:
            A :class:`Block` handle.

        Raises:
            ConfigError: when ``nbytes`` is not a positive int.
            PoolExhaustedError: when the request cannot fit under ``max_size``.
            torch.OutOfMemoryError: when the device itself runs out while growing (or
                ``torch.AcceleratorError`` with the code ``cudaErrorMemoryAllocation``, which
                :func:`~vramkit.observe.oom.is_oom_error` recognizes too). Growing by the
                growth factor that runs out is retried once at the request's own size first.
        """
        if type(nbytes) is not int or nbytes <= 0:  # the fast path skips the full check
            nbytes = _as_nbytes(nbytes)
        capacity = (nbytes + self._align_mask) & ~self._align_mask
        trackers = self._trackers
        stack = capture_stack() if (self._tracking or trackers) else None
        book = self._book
        with self._lock:
            if self._dropped:
                self._drain_dropped_locked()
            now = _clock()
            if now >= book.next_expiry:
                book.expire(now)
            bucket = book.cache.get(capacity)
            if not bucket and book.pending:
                # Only on a miss: querying every pending block's events costs too much for the
                # fast path, and a reclaimed block of this size may still turn the miss into a hit.
                book.reclaim_pending(now)
                bucket = book.cache.get(capacity)
            if bucket:  # exact-size fast path
                segment_id, offset, _ = bucket.pop()
                book.cached_bytes -= capacity
                hit = True
            else:
                segment_id, offset = self._carve_locked(capacity, nbytes)
                hit = False
            rec = AllocRecord(next(self._serials), self._segments[segment_id], offset, capacity,
                              nbytes, relocatable, now, stack)
            self._live[rec.serial] = rec
            # Counted inline (not through a PoolLedger method): this is the hot path.
            book.allocated += capacity
            book.requested += nbytes
            if book.allocated > book.peak_allocated:
                book.peak_allocated = book.allocated
            book.num_allocations += 1
            book.total_allocated += capacity
            if hit:
                book.cache_hits += 1
            else:
                book.cache_misses += 1
            if relocatable:
                book.relocatable_live += 1
        block = object.__new__(Block)
        block._pool = self
        block._rec = rec
        if stack is not None:
            for tracker in trackers:
                tracker._add(nbytes, stack)
        return block

    def free(self, block: Block) -> None:
        """Return a block to the pool.

        Args:
            block: a live block from this pool.

        Raises:
            InvalidBlockError: on a double free, a block of another pool, or a non-block.
        """
        try:
            rec = block._rec
            owner = block._pool
        except AttributeError:
            raise InvalidBlockError(f"free() expects a Block, got {type(block).__name__}") from None
        if owner is not self:
            raise InvalidBlockError(f"{block!r} belongs to another pool ({owner.device}), not this "
                                    f"one ({self.device})",
                                    hint="Free a block through the pool that allocated it.")
        with self._lock:
            if rec.freed:
                raise InvalidBlockError(f"double free of a {rec.nbytes}-byte block")
            self._release_locked(rec, _clock())

    def tensor(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor backed by pool memory, returned to the pool when the tensor is garbage collected.

        The tensor owns its block: once the last tensor sharing its storage (views included) is
        collected, the block returns to the pool at the pool's next operation (not counted as a
        leak). Such blocks are never relocated. For use on a non-current stream, use
        :meth:`allocate` and :meth:`Block.record_stream` instead: a tensor's own
        ``record_stream`` does not reach the pool. On CUDA this relies on
        ``__cuda_array_interface__``, which PyTorch supports only when NumPy is installed.

        Args:
            shape: the tensor shape.
            dtype: element type (default ``torch.float32``).

        Returns:
            An uninitialized tensor on the pool's device (page-locked for pinned pools).
        """
        dims = shape_tuple(shape)
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype, device=self.device)
        block = self.allocate(nbytes)
        block._rec.auto_free = True
        try:
            raw = self._owning_bytes(block, nbytes)
        except BaseException:
            block.free()
            raise
        return raw.view(dtype).view(dims)

    def _owning_bytes(self, block: Block, nbytes: int) -> torch.Tensor:
        ptr = block.data_ptr
        if self.kind == "cuda":
            try:
                return torch.as_tensor(CudaBlockBuffer(block, ptr, nbytes), device=self.device)
            except (RuntimeError, TypeError) as exc:
                raise DeviceError(f"cannot wrap pool memory as a CUDA tensor: {exc}",
                                  hint="Install numpy (PyTorch needs it for "
                                       "__cuda_array_interface__) or use pool.allocate().view()."
                                  ) from exc
        # A ctypes array over the block; torch.frombuffer keeps it (and so the block) alive.
        buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buffer._vramkit_block = block  # type: ignore[attr-defined]
        return torch.frombuffer(buffer, dtype=torch.uint8)

    # -- maintenance ------------------------------------------------------------------------

    def defragment(self) -> DefragmentResult:
        """Compact relocatable blocks towards the start of the arena, then release empty segments.

        Each relocatable block moves to the lowest free range that fits (never upwards). On CUDA
        the bytes are copied device-to-device on the current stream, after it waits (on the GPU,
        without a host sync) for events recorded on the block's streams; make other streams wait
        on the current stream before they use a moved block. Pinned pools copy on the CPU and so
        first wait (on the host) for the current stream and the block's streams. Handles stay
        valid; tensors obtained from a moved block before compaction are not.

        Returns:
            What moved and what was released.
        """
        with self._lock:
            if self._dropped:
                self._drain_dropped_locked()
            return self._defragment_locked()

    def trim(self) -> int:
        """Give empty segments back: cached blocks return to the arena first, then every segment
        with no live or pending block is released. CUDA pools then call
        ``torch.cuda.empty_cache()`` so the bytes go back to the driver; pinned segments are
        unregistered (``cudaHostUnregister``) and unmapped once no tensor views them (on the
        power-of-two fallback, ``torch._C._host_emptyCache()`` returns them).

        Returns:
            Bytes released.
        """
        with self._lock:
            if self._dropped:
                self._drain_dropped_locked()
            if self._book.pending:  # first, so reclaimed ranges are flushed from the cache too
                self._book.reclaim_pending(_clock())
            self._book.flush_cache()
            _, released = self._release_empty_segments_locked()
        self._backend.empty_cache()
        return released

    def clear(self, force: bool = False) -> None:
        """Release every segment.

        Args:
            force: also invalidate live blocks (their handles then raise ``InvalidBlockError``);
                default ``False``.

        Raises:
            InvalidBlockError: when blocks are live and ``force`` is false.
        """
        with self._lock:
            if self._dropped:
                self._drain_dropped_locked()
            if self._live and not force:
                live_bytes = sum(r.nbytes for r in self._live.values())
                raise InvalidBlockError(
                    f"clear(): {len(self._live)} blocks ({format_size(live_bytes)}) are still live",
                    hint="Free them first (pool.check_leaks() lists them), or call "
                         "clear(force=True) to invalidate their handles.")
            for rec in self._live.values():
                rec.freed = True
            self._live.clear()
            self._wait_pending_before_release_locked()
            for segment in self._segments.values():
                self._backend.release(segment)
            self._segments.clear()
            self._book.clear()

    def reset_stats(self) -> None:
        """Reset peaks to the current values and all counters to zero.

        Counters are ``num_allocations``, ``num_frees``, ``total_allocated``, ``cache_hits``,
        ``cache_misses``, ``leaked_frees``, ``cache_expired`` and ``defragmentations``; the
        current figures (``allocated``, ``reserved``, ...) are not counters and stay as they are.
        """
        with self._lock:
            self._book.peak_allocated = self._book.allocated
            self._book.peak_reserved = self._book.reserved
            self._book.reset_counters()

    # -- observation ------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """A consistent snapshot of the pool's statistics."""
        with self._lock:
            if self._dropped:
                self._drain_dropped_locked()
            if self._book.pending:
                self._book.reclaim_pending(_clock())
            return self._book.snapshot(len(self._live))

    def check_leaks(self, min_age: float = 0.0) -> list[LiveBlock]:
        """Live blocks, oldest first: at the end of a phase, everything here is a leak candidate.

        Args:
            min_age: only report blocks alive for at least this many seconds (default 0).

        Returns:
            One :class:`LiveBlock` per block, with its allocation stack when tracking was on.
        """
        with self._lock:
            if self._dropped:
                self._drain_dropped_locked()
            now = _clock()
            recs = [r for r in self._live.values() if now - r.created >= min_age]
        return [LiveBlock(nbytes=r.nbytes, capacity=r.capacity, segment=r.segment.id,
                          offset=r.offset, age=now - r.created, relocatable=r.relocatable,
                          stack=format_stack(r.stack) if r.stack is not None else None)
                for r in recs]

    def track_allocations(self) -> AllocationTracker:
        """Start recording ``(size, stack)`` of every allocation until the tracker stops.

        Returns:
            An active :class:`AllocationTracker`; use it as a context manager or call ``stop()``.
        """
        tracker = AllocationTracker(self._stop_tracker)
        with self._lock:
            self._trackers = [*self._trackers, tracker]
        return tracker

    def _stop_tracker(self, tracker: AllocationTracker) -> None:
        with self._lock:
            self._trackers = [t for t in self._trackers if t is not tracker]

    def segment_sizes(self) -> dict[int, int]:
        """``{segment id: bytes}`` of the segments currently reserved."""
        with self._lock:
            return self._book.arena.segments()

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        """Route PyTorch's own CUDA allocations inside the ``with`` block into a private
        ``torch.cuda.MemPool`` owned by this pool (``torch.cuda.use_mem_pool``).

        Those allocations are managed by PyTorch's allocator (not counted in :meth:`stats`); the
        MemPool keeps them apart from the global cache, so their memory is released with the pool.

        Yields:
            The ``torch.cuda.MemPool``.

        Raises:
            DeviceError: on host pools, or when the installed PyTorch lacks MemPool.
        """
        if self.kind != "cuda":
            raise DeviceError(f"pool.scope() routes CUDA allocations; this is a {self.kind} pool",
                              hint="Use a CUDA pool: MemoryPool('cuda').")
        mem_pool_cls = getattr(torch.cuda, "MemPool", None)
        use_mem_pool = getattr(torch.cuda, "use_mem_pool", None)
        if mem_pool_cls is None or use_mem_pool is None:
            raise DeviceError(f"PyTorch {torch.__version__} has no torch.cuda.MemPool / "
                              "use_mem_pool", hint="Upgrade to PyTorch 2.8 or newer.")
        with self._lock:
            if self._mem_pool is None:
                self._mem_pool = mem_pool_cls()
            mem_pool = self._mem_pool
        with use_mem_pool(mem_pool, device=self.device):
            yield mem_pool

    @property
    def mem_pool(self) -> Any:
        """The ``torch.cuda.MemPool`` used by :meth:`scope` (``None`` before the first use)."""
        return self._mem_pool

    def __repr__(self) -> str:
        cap = format_size(self.config.max_size) if self.config.max_size else "unlimited"
        pageable = (f", pageable={format_size(self._book.pageable_bytes)}"
                    if self.kind == "pinned" and self._book.pageable_bytes else "")
        return (f"MemoryPool({self.kind}, device={self.device}, reserved="
                f"{format_size(self._book.reserved)}, allocated="
                f"{format_size(self._book.allocated)}{pageable}, max_size={cap})")

    # -- internals: release paths -----------------------------------------------------------

    def _check_stream(self, stream: Any) -> None:
        if self.kind == "cpu":
            return
        device = getattr(stream, "device", None)
        if device is None or not hasattr(stream, "query") or torch.device(device).type != "cuda":
            raise ConfigError(f"record_stream expects a torch.cuda.Stream, got {stream!r}",
                              hint="Pass a torch.cuda.Stream on the pool's device, e.g. "
                                   "block.record_stream(torch.cuda.current_stream()).")
        if self.kind == "cuda" and torch.device(device) != self.device:
            raise DeviceMismatchError(self.device, torch.device(device), what="stream")

    def _release_locked(self, rec: AllocRecord, now: float) -> None:
        rec.freed = True
        del self._live[rec.serial]
        book = self._book
        book.freed_block(rec.capacity, rec.nbytes, rec.relocatable)
        if rec.streams or self.kind == "pinned":
            book.add_pending(rec.segment.id, rec.offset, rec.capacity,
                             self._free_events(rec.streams))
        else:
            book.put_free(rec.segment.id, rec.offset, rec.capacity, now)

    def _free_events(self, streams: list[Any] | None) -> list[Any]:
        if self.kind == "pinned":
            # A non-blocking copy on the current stream may still read or write the block.
            current = torch.cuda.current_stream()
            streams = [current, *(s for s in streams or () if s != current)]
        events = []
        for stream in streams:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def _wait_pending_before_release_locked(self) -> None:
        """Order the release of segments holding pending blocks after the work using them."""
        if not self._book.pending:
            return
        if self.kind == "cuda":
            current = torch.cuda.current_stream(self.device)
            for *_, events in self._book.pending:
                for event in events:
                    current.wait_event(event)  # GPU-side wait, no host sync
        else:  # pinned: the host may reuse the memory at once, so wait on the host
            for *_, events in self._book.pending:
                for event in events:
                    event.synchronize()

    def _drain_dropped_locked(self) -> None:
        while self._dropped:
            rec = self._dropped.popleft()
            if rec.freed:
                continue
            if not rec.auto_free:
                self._book.leaked_frees += 1
                where = ("\n".join(format_stack(rec.stack)) if rec.stack is not None
                         else "(set VRAMKIT_MEMORY_DEBUG=1 to record allocation stacks)")
                logger.warning("%s: a %d-byte block was dropped without free(); returned by its "
                               "finalizer. Allocated at:\n%s", self, rec.nbytes, where)
            self._release_locked(rec, _clock())

    # -- internals: growth and compaction ---------------------------------------------------

    def _carve_locked(self, capacity: int, nbytes: int) -> tuple[int, int]:
        place = self._book.arena.take(capacity)
        return place if place is not None else self._carve_slow_locked(capacity, nbytes)

    def _carve_slow_locked(self, capacity: int, nbytes: int) -> tuple[int, int]:
        book = self._book
        max_size = self.config.max_size
        if max_size is not None and capacity > max_size:
            raise self._exhausted_locked(nbytes, capacity, "the request is larger than max_size")
        if book.cached_bytes:  # cached blocks of other sizes may coalesce into a fit
            book.flush_cache()
            place = book.arena.take(capacity)
            if place is not None:
                return place
        if book.relocatable_live and book.fragmentation() > self.config.defrag_threshold:
            self._defragment_locked()
            place = book.arena.take(capacity)
            if place is not None:
                return place
        grown = self._grow_locked(capacity)
        if grown is None and book.arena.empty_segments():
            # Empty segments count against the cap; releasing them may leave room for one that fits.
            self._release_empty_segments_locked()
            grown = self._grow_locked(capacity)
        if grown is None:
            raise self._exhausted_locked(nbytes, capacity, "it does not fit under max_size")
        place = book.arena.take(capacity)
        if place is None:  # pragma: no cover - a fresh segment always fits the request
            raise RuntimeError("internal error: a new segment does not fit the request")
        return place

    def _grow_locked(self, capacity: int) -> Segment | None:
        book, cap = self._book, self.config.max_size
        room = None if cap is None else cap - book.reserved
        if self._segments:
            target = max(capacity, math.ceil(book.reserved * (self.config.growth_factor - 1.0)))
        else:
            target = max(capacity, self.config.initial_size)
        sizing = self._backend.sizing
        size = fit_segment(sizing, capacity, target, room, self._alignment)
        if size is None:
            return None
        if isinstance(self._backend, PinnedSegmentBackend):
            size = self._fit_pin_room_locked(size, capacity, room)
        try:
            storage = self._backend.new_storage(size)
        except RuntimeError as exc:
            # Out of memory by type (the caching allocator) or by CUDA error code (pinned
            # memory from cudaHostAlloc raises torch.AcceleratorError), never by message.
            if not is_cuda_out_of_memory(exc):
                raise
            smaller = fit_segment(sizing, capacity, capacity, room, self._alignment)
            if smaller is None or smaller >= size:
                raise
            logger.info("%s: growing by %s ran out of device memory; trying %s", self,
                        format_size(size), format_size(smaller))
            size = smaller
            storage = self._backend.new_storage(size)
        segment = Segment(next(self._segment_ids), storage)
        self._segments[segment.id] = segment
        book.add_segment(segment.id, size,
                         pageable=self.kind != "cuda" and not self._backend.page_locked(storage))
        logger.debug("%s: new segment %d of %s", self, segment.id, format_size(size))
        return segment

    def _fit_pin_room_locked(self, size: int, capacity: int, room: int | None) -> int:
        """Grow a pinned pool by only the request when growing by ``size`` would pass the host's
        pinning cap but the request alone fits under it (else the segment falls back to pageable
        memory in the backend)."""
        pin_room = self._backend.pin_room()  # type: ignore[attr-defined]
        if pin_room is None or size <= pin_room:
            return size
        smaller = fit_segment(self._backend.sizing, capacity, capacity, room, self._alignment)
        if smaller is None or smaller >= size or smaller > pin_room:
            return size
        logger.info("%s: growing by %s would pass the host's pinning cap (%s left); growing by "
                    "%s", self, format_size(size), format_size(pin_room), format_size(smaller))
        return smaller

    def _release_empty_segments_locked(self) -> tuple[int, int]:
        count = released = 0
        for segment_id in self._book.arena.empty_segments():
            released += self._book.remove_segment(segment_id)
            self._backend.release(self._segments.pop(segment_id))
            count += 1
        if count:
            logger.debug("%s: released %d empty segments (%s)", self, count, format_size(released))
        return count, released

    def _defragment_locked(self) -> DefragmentResult:
        book = self._book
        if book.pending:  # first, so reclaimed ranges are flushed from the cache too
            book.reclaim_pending(_clock())
        book.flush_cache()
        movable = sorted((r for r in self._live.values() if r.relocatable),
                         key=lambda r: (r.segment.id, r.offset))
        if movable and self.kind == "pinned":
            torch.cuda.current_stream().synchronize()  # host copies must not race a DMA
        moved = moved_bytes = 0
        for rec in movable:
            source, source_offset = rec.segment, rec.offset
            book.arena.give(source.id, source_offset, rec.capacity)
            place = book.arena.take_lowest(rec.capacity)  # its own, now free, range always fits
            if place is None or place == (source.id, source_offset):
                if place is None:  # pragma: no cover - defensive
                    raise RuntimeError("internal error: compaction lost a block's range")
                continue
            target = self._segments[place[0]]
            self._move_bytes(source, source_offset, target, place[1], rec.nbytes, rec.streams)
            rec.segment, rec.offset = target, place[1]
            moved += 1
            moved_bytes += rec.nbytes
        count, released = self._release_empty_segments_locked()
        book.defragmentations += 1
        logger.debug("%s: defragment moved %d blocks (%s), released %s", self, moved,
                     format_size(moved_bytes), format_size(released))
        return DefragmentResult(moved, moved_bytes, count, released)

    def _move_bytes(self, source: Segment, source_offset: int, target: Segment,
                    target_offset: int, nbytes: int, streams: list[Any] | None) -> None:
        if streams and self.kind == "cuda":
            current = torch.cuda.current_stream(self.device)
            for stream in streams:
                event = torch.cuda.Event()
                event.record(stream)
                current.wait_event(event)
        elif streams and self.kind == "pinned":
            for stream in streams:
                stream.synchronize()
        src, dst = source.storage, target.storage
        shift = source_offset - target_offset
        if source is target and 0 < shift < nbytes:
            # Overlapping slide down: copy chunks no longer than the shift, front to back, so no
            # chunk's destination overlaps source bytes not yet copied (torch rejects overlap).
            if math.ceil(nbytes / shift) <= _OVERLAP_CHUNK_LIMIT:
                for start in range(0, nbytes, shift):
                    n = min(shift, nbytes - start)
                    dst[target_offset + start:target_offset + start + n].copy_(
                        src[source_offset + start:source_offset + start + n])
                return
            staged = src[source_offset:source_offset + nbytes].clone()
            dst[target_offset:target_offset + nbytes].copy_(staged)
            return
        dst[target_offset:target_offset + nbytes].copy_(src[source_offset:source_offset + nbytes])

    def _exhausted_locked(self, nbytes: int, capacity: int, why: str) -> PoolExhaustedError:
        stats = self._book.snapshot(len(self._live))
        cap = self.config.max_size
        pageable = (f", {format_size(stats.pageable_bytes)} of it pageable"
                    if self.kind == "pinned" and stats.pageable_bytes else "")
        message = (f"{self.kind} pool on {self.device} cannot allocate {format_size(nbytes)}: {why} "
                   f"(reserved {format_size(stats.reserved)}{pageable} of max_size "
                   f"{format_size(cap) if cap else 'unlimited'}, allocated "
                   f"{format_size(stats.allocated)}, largest free block "
                   f"{format_size(stats.largest_free_block)}, pending {format_size(stats.pending)})")
        hint = None
        if cap is not None and capacity > cap:
            hint = f"Raise PoolConfig.max_size to at least {format_size(capacity)}."
        elif isinstance(self._backend, PowerOfTwoPinnedSegments) and cap is not None:
            hint = ("Pinned segments are powers of two on this PyTorch (no cudaHostRegister in "
                    "torch.cuda.cudart()); free blocks or raise max_size to at least "
                    f"{format_size(stats.reserved + pow2_ceil(capacity))}.")
        elif stats.pending:
            hint = ("Some freed blocks still wait for their streams; free earlier, or raise "
                    "PoolConfig.max_size.")
        return PoolExhaustedError(message, requested=nbytes, stats=stats, hint=hint)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _as_nbytes(value: object) -> int:
    """``value`` as a positive int byte count (numpy integers and other index types accepted)."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            value = operator.index(value)  # type: ignore[arg-type]
    return check_int("allocation size", value, minimum=1,  # type: ignore[no-any-return]
                     hint="Give a positive int number of bytes; vramkit.parse_size('64MiB') "
                          "converts a string.")


def _resolve_device(device: str | int | torch.device, pinned: bool) -> tuple[torch.device, str]:
    parsed = check_device("MemoryPool device", device)
    if parsed.type == "cpu":
        if pinned and not _runtime.is_cuda_available():
            raise DeviceError("a pinned host pool needs CUDA, which this process cannot use",
                              hint="Use MemoryPool('cpu') for plain host memory on machines "
                                   "without a GPU.")
        return torch.device("cpu"), "pinned" if pinned else "cpu"
    if pinned:
        raise ConfigError("pinned=True applies to host pools: use MemoryPool('cpu', pinned=True) "
                          "or MemoryPool.pinned()",
                          hint="Drop pinned=True for a device pool; pinned memory is host memory.")
    return torch.device("cuda", cuda_ordinal(parsed, owner="MemoryPool")), "cuda"
