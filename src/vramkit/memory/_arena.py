"""Pure bookkeeping for :class:`vramkit.memory.pool.MemoryPool` (no torch): free ranges and records.

:class:`Arena` tracks free byte ranges; :class:`PoolStats`, :class:`LiveBlock`,
:class:`DefragmentResult` and :class:`AllocationTracker` are the records the pool reports (all
re-exported by :mod:`vramkit.memory.pool`, which is where users import them from).

The arena knows segments (numbered in creation order) and which byte ranges inside them are free.
It never touches memory: the pool owns the storage, copies bytes during compaction and decides
what a block is. Keeping this part pure lets the property tests drive it quickly and lets the
pool's lock cover a small, predictable amount of work.

Data structures, and why:

* ``_by_size``: a sorted list of ``(size, segment, offset)`` keys. Best fit is one ``bisect`` for
  the first key whose size is >= the request; ties go to the lowest segment and offset, so
  allocations pack towards the start of the arena (which makes trimming and compaction
  effective). Inserting or deleting is a ``bisect`` plus a ``list`` memmove, which for the few
  thousand free ranges a planned-memory pool ever has is far cheaper than a balanced tree in
  Python.
* ``_by_start`` / ``_by_end``: dicts keyed by ``(segment, offset)`` of a free range's first byte
  and one-past-last byte. Coalescing a returned range with its free neighbours is two dict
  lookups, so freeing is O(log n) overall and never scans.
"""

from __future__ import annotations

import math
import os
import threading
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

from vramkit._validate import check_bool, check_int, check_known_fields, check_number, check_size
from vramkit.errors import ConfigError
from vramkit.memory._stacks import format_frames, python_stack
from vramkit.units import format_size

__all__ = [
    "AllocationTracker",
    "Arena",
    "DefragmentResult",
    "LiveBlock",
    "PoolConfig",
    "PoolLedger",
    "PoolStats",
    "RawStack",
    "capture_stack",
    "fit_segment",
    "format_stack",
    "pow2_ceil",
]

_STACK_DEPTH = 12  # frames kept per allocation stack: enough to find the caller, cheap to store

# ``(filename, line, function)`` per frame, innermost first, unformatted (_stacks.py's format).
RawStack = tuple[tuple[str, int, str], ...]
_MEMORY_DEBUG_ENV = "VRAMKIT_MEMORY_DEBUG"
_CUDA_LARGE_ROUND = 2 << 20  # PyTorch rounds CUDA allocations above 1 MiB to 2 MiB multiples


class Arena:
    """Best-fit sub-allocation with splitting and coalescing over numbered segments.

    Offsets and sizes are plain integers; the caller is responsible for alignment (the pool
    rounds every size and segment to its alignment, so every offset stays aligned).
    """

    __slots__ = ("_by_end", "_by_size", "_by_start", "_segments", "_total_free")

    def __init__(self) -> None:
        self._by_size: list[tuple[int, int, int]] = []
        self._by_start: dict[tuple[int, int], int] = {}
        self._by_end: dict[tuple[int, int], int] = {}
        self._segments: dict[int, int] = {}  # segment id -> size
        self._total_free = 0

    # -- segments ---------------------------------------------------------------------------

    def add_segment(self, segment: int, size: int) -> None:
        """Register a new segment whose bytes are all free.

        Args:
            segment: a segment id not in use.
            size: the segment's size in bytes (> 0).
        """
        if segment in self._segments:
            raise KeyError(f"segment {segment} already exists")
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        self._segments[segment] = size
        self._insert(segment, 0, size)

    def remove_segment(self, segment: int) -> int:
        """Forget an empty segment.

        Args:
            segment: the id of a segment whose bytes are all free.

        Returns:
            The segment's size in bytes.

        Raises:
            ValueError: when part of the segment is not free.
        """
        size = self._segments[segment]
        if self._by_start.get((segment, 0)) != size:
            raise ValueError(f"segment {segment} is not empty")
        self._remove(segment, 0, size)
        del self._segments[segment]
        return size

    def empty_segments(self) -> list[int]:
        """Ids of segments whose bytes are all free, in creation order."""
        return [s for s, size in self._segments.items() if self._by_start.get((s, 0)) == size]

    def segments(self) -> dict[int, int]:
        """A copy of ``{segment id: size}``."""
        return dict(self._segments)

    @property
    def num_segments(self) -> int:
        """Number of segments."""
        return len(self._segments)

    # -- allocation -------------------------------------------------------------------------

    def take(self, size: int) -> tuple[int, int] | None:
        """Carve ``size`` bytes from the smallest free range that fits (best fit).

        Args:
            size: bytes wanted (> 0).

        Returns:
            ``(segment, offset)`` of the carved range, or ``None`` when no free range fits.
        """
        by_size = self._by_size
        i = bisect_left(by_size, (size, -1, -1))
        if i == len(by_size):
            return None
        free_size, segment, offset = by_size[i]
        self._remove_at(i, free_size, segment, offset)
        if free_size > size:  # split: the tail stays free
            self._insert(segment, offset + size, free_size - size)
        return segment, offset

    def take_lowest(self, size: int) -> tuple[int, int] | None:
        """Carve ``size`` bytes from the lowest-addressed free range that fits (for compaction).

        Args:
            size: bytes wanted (> 0).

        Returns:
            ``(segment, offset)`` or ``None`` when nothing fits.
        """
        best: tuple[int, int] | None = None
        for (segment, offset), free_size in self._by_start.items():
            if free_size >= size and (best is None or (segment, offset) < best):
                best = (segment, offset)
        if best is None:
            return None
        segment, offset = best
        free_size = self._by_start[best]
        self._remove(segment, offset, free_size)
        if free_size > size:
            self._insert(segment, offset + size, free_size - size)
        return best

    def give(self, segment: int, offset: int, size: int) -> None:
        """Return a range, merging it with free neighbours on either side.

        Args:
            segment: the segment id.
            offset: the range's first byte.
            size: the range's length (> 0).
        """
        seg_size = self._segments.get(segment)
        if seg_size is None or offset < 0 or offset + size > seg_size or size <= 0:
            raise ValueError(f"range ({segment}, {offset}, {size}) is outside the arena")
        if (segment, offset) in self._by_start:
            raise ValueError(f"range ({segment}, {offset}) is already free")
        start, end = offset, offset + size
        left_start = self._by_end.get((segment, start))
        if left_start is not None:
            self._remove(segment, left_start, start - left_start)
            start = left_start
        right_size = self._by_start.get((segment, end))
        if right_size is not None:
            self._remove(segment, end, right_size)
            end += right_size
        self._insert(segment, start, end - start)

    # -- queries ----------------------------------------------------------------------------

    @property
    def total_free(self) -> int:
        """Free bytes over all segments."""
        return self._total_free

    @property
    def largest_free(self) -> int:
        """Size of the largest free range (0 when none)."""
        return self._by_size[-1][0] if self._by_size else 0

    # -- internals --------------------------------------------------------------------------

    def _insert(self, segment: int, offset: int, size: int) -> None:
        insort(self._by_size, (size, segment, offset))
        self._by_start[(segment, offset)] = size
        self._by_end[(segment, offset + size)] = offset
        self._total_free += size

    def _remove(self, segment: int, offset: int, size: int) -> None:
        i = bisect_left(self._by_size, (size, segment, offset))
        self._remove_at(i, size, segment, offset)

    def _remove_at(self, i: int, size: int, segment: int, offset: int) -> None:
        del self._by_size[i]
        del self._by_start[(segment, offset)]
        del self._by_end[(segment, offset + size)]
        self._total_free -= size


def _tracking_from_env() -> bool:
    return os.environ.get(_MEMORY_DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------
# Configuration (re-exported by vramkit.memory.pool)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolConfig:
    """Settings of a :class:`MemoryPool` (FLAME ``MemoryConfig`` + BitNet ``MemoryPoolConfig``).

    Sizes accept ints (bytes) or strings such as ``"2GiB"`` and are stored as ints.

    Args:
        initial_size: bytes reserved when the pool is created; also the size of the first segment
            after the pool was trimmed empty. ``0`` (default) reserves nothing until the first
            allocation.
        growth_factor: when the pool must grow, reserved bytes are multiplied by this factor (the
            new segment is at least the request). ``1.0`` grows by exactly what is needed.
            Default ``2.0``.
        max_size: hard cap on reserved bytes; ``None`` (default) means no cap beyond the
            device's memory. Allocations that cannot fit raise ``PoolExhaustedError``.
        defrag_threshold: fragmentation (0..1) above which an allocation that does not fit
            compacts relocatable blocks before growing the pool. Default ``0.7``; ``1.0``
            disables automatic compaction.
        max_cached_buffers: how many freed blocks of each exact size are kept for the fast path.
            ``0`` disables the cache. Default ``64``.
        cleanup_interval: seconds after which an unused cached block returns to the arena.
            Default ``30.0``.
        enable_memory_tracking: record the allocation stack of every block (shown by
            ``check_leaks``). Default: on when ``VRAMKIT_MEMORY_DEBUG=1``.
        alignment: byte alignment of every block offset and size, a power of two. Default ``512``.
        pin_fallback: pinned pools only. When a new segment cannot be page-locked
            (``cudaHostRegister`` or PyTorch's pinned allocator fails, or the segment would pass
            the host's pinning cap: a container's memory limit, WSL's half of RAM), keep it as
            plain pageable memory, warn once per process with the figures, and go on: copies
            stay correct but are several times slower (``PoolStats.pageable_bytes`` counts such
            segments). ``False`` raises ``DeviceError`` instead. Default ``True``.
    """

    initial_size: int | str = 0
    growth_factor: float = 2.0
    max_size: int | str | None = None
    defrag_threshold: float = 0.7
    max_cached_buffers: int = 64
    cleanup_interval: float = 30.0
    enable_memory_tracking: bool = field(default_factory=_tracking_from_env)
    alignment: int = 512
    pin_fallback: bool = True

    def __post_init__(self) -> None:
        initial = check_size("PoolConfig.initial_size", self.initial_size)
        object.__setattr__(self, "initial_size", initial)
        max_size = check_size("PoolConfig.max_size", self.max_size, minimum=1, allow_none=True)
        if max_size is not None and max_size < initial:
            raise ConfigError(
                f"PoolConfig.initial_size ({format_size(initial)}) exceeds "
                f"max_size ({format_size(max_size)})",
                hint="Lower initial_size or raise max_size.")
        object.__setattr__(self, "max_size", max_size)
        object.__setattr__(self, "growth_factor", check_number(
            "PoolConfig.growth_factor", self.growth_factor, minimum=1.0))
        object.__setattr__(self, "defrag_threshold", check_number(
            "PoolConfig.defrag_threshold", self.defrag_threshold, minimum=0.0, maximum=1.0))
        check_int("PoolConfig.max_cached_buffers", self.max_cached_buffers, minimum=0)
        object.__setattr__(self, "cleanup_interval", check_number(
            "PoolConfig.cleanup_interval", self.cleanup_interval, minimum=0.0, low_open=True,
            hint="Give the seconds an unused cached block is kept, > 0."))
        check_bool("PoolConfig.enable_memory_tracking", self.enable_memory_tracking)
        check_bool("PoolConfig.pin_fallback", self.pin_fallback)
        align = check_int("PoolConfig.alignment", self.alignment, minimum=1, maximum=1 << 30,
                          hint="A power of two; the default, 512, suits CUDA kernels.")
        if align & (align - 1):
            raise ConfigError(f"PoolConfig.alignment must be a power of two between 1 and 1 GiB, "
                              f"got {align!r}", hint="The default, 512, suits CUDA kernels.")

    @classmethod
    def development(cls, **overrides: Any) -> PoolConfig:
        """Debug-friendly: stacks recorded, small cache, quick expiry, eager compaction.

        ``enable_memory_tracking=True``, ``max_cached_buffers=16``, ``cleanup_interval=10``,
        ``defrag_threshold=0.5``, ``growth_factor=1.5``. Keyword overrides win.
        """
        values: dict[str, Any] = dict(enable_memory_tracking=True, max_cached_buffers=16,
                                      cleanup_interval=10.0, defrag_threshold=0.5,
                                      growth_factor=1.5)
        return cls(**{**values, **overrides})

    @classmethod
    def production(cls, **overrides: Any) -> PoolConfig:
        """Throughput: large cache kept for a minute, doubling growth, no stacks (unless the env
        variable asks for them).

        ``max_cached_buffers=1024``, ``cleanup_interval=60``, ``growth_factor=2.0``,
        ``defrag_threshold=0.8``. Keyword overrides win.
        """
        values: dict[str, Any] = dict(max_cached_buffers=1024, cleanup_interval=60.0,
                                      growth_factor=2.0, defrag_threshold=0.8)
        return cls(**{**values, **overrides})

    @classmethod
    def testing(cls, **overrides: Any) -> PoolConfig:
        """Small and deterministic: a 1 GiB cap, exact growth, tiny cache, stacks recorded.

        ``max_size="1GiB"``, ``growth_factor=1.0``, ``max_cached_buffers=4``,
        ``cleanup_interval=1``, ``enable_memory_tracking=True``. Keyword overrides win.
        """
        values: dict[str, Any] = dict(max_size=1 << 30, growth_factor=1.0, max_cached_buffers=4,
                                      cleanup_interval=1.0, enable_memory_tracking=True)
        return cls(**{**values, **overrides})

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serializable dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolConfig:
        """Build a config from :meth:`to_dict` output; unknown keys raise ``ConfigError``."""
        return cls(**check_known_fields(cls, data))


# --------------------------------------------------------------------------------------------
# Records the pool reports
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of a pool's statistics (all sizes in bytes).

    Invariants: ``allocated + free == reserved``; ``free`` includes ``cached`` (freed blocks kept
    for the exact-size fast path) and ``pending`` (freed blocks waiting for their streams).

    Attributes:
        allocated: bytes in live blocks (each block's size rounded up to the alignment).
        reserved: bytes in segments obtained from PyTorch.
        peak_allocated: highest ``allocated`` since creation or ``reset_stats``.
        peak_reserved: highest ``reserved`` since creation or ``reset_stats``.
        num_allocations: successful ``allocate`` calls.
        num_frees: blocks returned, explicitly or by the finalizer.
        total_allocated: bytes handed out by ``allocate`` (each block rounded up to the
            alignment, as in ``allocated``), freed or not: cumulative, the pool's counterpart of
            ``MemoryStats.total_allocated`` (:func:`vramkit.observe.stats.with_memory_tracking`)
            and of PyTorch's ``allocated_bytes.all.allocated``. Like the other counters it counts
            since creation or the last ``reset_stats``; compaction moves are not allocations.
        cache_hits: allocations served by the exact-size fast path.
        cache_misses: allocations carved from the arena.
        fragmentation: ``1 - largest_free_block / usable free bytes`` (0 when nothing is free);
            usable free bytes are ``free - pending``.
        largest_free_block: the largest request that fits without growing.
        segments: number of segments.
        requested: bytes asked for by live blocks (before alignment).
        free: ``reserved - allocated``.
        cached: bytes in the exact-size cache.
        pending: bytes freed but not yet reusable (their recorded streams are still busy).
        live_blocks: number of live blocks.
        leaked_frees: blocks returned by the finalizer because their handle was dropped.
        cache_expired: cached blocks returned to the arena after ``cleanup_interval``.
        defragmentations: compactions run (explicit or automatic).
        pageable_bytes: reserved host bytes that are not page-locked: on a pinned pool, the
            segments that fell back to pageable memory (``PoolConfig.pin_fallback``); on a plain
            host pool, all of ``reserved``; 0 on a CUDA pool. A host pool's page-locked bytes
            are ``reserved - pageable_bytes``.
    """

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    num_allocations: int
    num_frees: int
    cache_hits: int
    cache_misses: int
    fragmentation: float
    largest_free_block: int
    segments: int
    requested: int = 0
    free: int = 0
    cached: int = 0
    pending: int = 0
    live_blocks: int = 0
    leaked_frees: int = 0
    cache_expired: int = 0
    defragmentations: int = 0
    total_allocated: int = 0
    pageable_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """``cache_hits / (cache_hits + cache_misses)``, 0.0 before any allocation."""
        total = self.cache_hits + self.cache_misses
        return self.cache_hits / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The statistics as a JSON-serializable dict."""
        return asdict(self)


@dataclass(frozen=True)
class LiveBlock:
    """One live block, as reported by ``MemoryPool.check_leaks``.

    Attributes:
        nbytes: bytes requested.
        capacity: bytes reserved for it (aligned).
        segment: segment id.
        offset: byte offset in the segment.
        age: seconds since it was allocated.
        relocatable: whether compaction may move it.
        stack: the allocation stack as ``"file.py:12 in fn"`` lines (innermost last) when
            tracking was on, else ``None``.
    """

    nbytes: int
    capacity: int
    segment: int
    offset: int
    age: float
    relocatable: bool
    stack: tuple[str, ...] | None = None

    def __str__(self) -> str:
        head = (f"{self.nbytes} bytes at segment {self.segment} offset {self.offset}, "
                f"alive {self.age:.1f} s")
        if not self.stack:
            return head + " (set VRAMKIT_MEMORY_DEBUG=1 to record where it was allocated)"
        return head + ", allocated at:\n" + "\n".join(f"  {line}" for line in self.stack)


@dataclass(frozen=True)
class DefragmentResult:
    """What ``MemoryPool.defragment`` did.

    Attributes:
        moved_blocks: relocatable blocks copied to lower addresses.
        moved_bytes: bytes copied.
        released_segments: empty segments given back to PyTorch.
        released_bytes: bytes in those segments.
    """

    moved_blocks: int
    moved_bytes: int
    released_segments: int
    released_bytes: int


def capture_stack() -> RawStack:
    """The allocating code's frames, without the pool's (or torch's) own, left unformatted.

    Formatting waits until a report asks for it (:func:`format_stack`), so recording costs one
    bounded frame walk per allocation. It is the leak detector's walker, so both skip the same
    machinery frames (vramkit.memory, vramkit.observe, torch, contextlib, runpy).
    """
    return python_stack(_STACK_DEPTH)


def format_stack(stack: RawStack) -> tuple[str, ...]:
    """``"file.py:12 in step"`` lines of a :func:`capture_stack` result, innermost last.

    Args:
        stack: a raw stack, innermost first.

    Returns:
        Up to 12 formatted frames in traceback order (innermost last).
    """
    return tuple(reversed(format_frames(stack, _STACK_DEPTH)))


class AllocationTracker:
    """Records ``(size, stack)`` of every allocation a pool makes while it is active.

    Created active by ``MemoryPool.track_allocations()``; use it as a context manager or call
    :meth:`stop`. Safe to read from any thread.
    """

    def __init__(self, on_stop: Callable[[AllocationTracker], None]) -> None:
        self._records: list[tuple[int, RawStack]] = []
        self._lock = threading.Lock()
        self._on_stop = on_stop
        self.active = True

    def _add(self, nbytes: int, stack: RawStack) -> None:
        with self._lock:
            self._records.append((nbytes, stack))

    def allocations(self) -> list[tuple[int, list[str]]]:
        """Allocations recorded so far.

        Returns:
            ``(nbytes, stack)`` pairs in allocation order; ``stack`` is a list of formatted
            frames, innermost last.
        """
        with self._lock:
            records = list(self._records)
        return [(nbytes, list(format_stack(stack))) for nbytes, stack in records]

    def stop(self) -> None:
        """Stop recording (idempotent); recorded allocations stay readable."""
        if self.active:
            self.active = False
            self._on_stop(self)

    def __enter__(self) -> AllocationTracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# The ledger: free ranges + exact-size cache + pending list + counters
# --------------------------------------------------------------------------------------------


class PoolLedger:
    """A pool's accounting, without torch. The pool holds its lock around every call.

    Ranges are ``(segment id, offset, capacity)``. A freed range goes to the per-size cache (at
    most ``max_cached`` per size, stamped with the time) or, when that is full, to the arena. A
    range still used by streams goes to ``pending`` with its events (objects with ``query()``)
    until they complete. Cached entries older than ``interval`` seconds return to the arena when
    :meth:`expire` runs (the pool calls it lazily, when ``now >= next_expiry``).

    Args:
        max_cached: freed blocks kept per exact size (0 disables the cache).
        interval: seconds a cached block may stay unused.
    """

    def __init__(self, max_cached: int, interval: float) -> None:
        self.arena = Arena()
        self.max_cached = max_cached
        self.interval = interval
        self.cache: dict[int, deque[tuple[int, int, float]]] = {}
        self.cached_bytes = 0
        self.next_expiry = math.inf
        self.pending: list[tuple[int, int, int, list[Any]]] = []
        self.pending_bytes = 0
        self.allocated = self.requested = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.relocatable_live = 0
        self.pageable: dict[int, int] = {}  # segment id -> size, host segments not page-locked
        self.pageable_bytes = 0
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the event counters (peaks are the caller's business)."""
        self.num_allocations = self.num_frees = 0
        self.total_allocated = 0
        self.cache_hits = self.cache_misses = 0
        self.leaked_frees = self.cache_expired = self.defragmentations = 0

    # -- allocation side --------------------------------------------------------------------

    def freed_block(self, capacity: int, nbytes: int, relocatable: bool) -> None:
        """Count a block leaving the live set (its range is returned separately)."""
        self.allocated -= capacity
        self.requested -= nbytes
        self.num_frees += 1
        if relocatable:
            self.relocatable_live -= 1

    def put_free(self, segment: int, offset: int, capacity: int, now: float) -> None:
        """Return a range: into the exact-size cache when it has room, else into the arena."""
        if self.max_cached:
            bucket = self.cache.get(capacity)
            if bucket is None:
                bucket = self.cache[capacity] = deque()
            if len(bucket) < self.max_cached:
                bucket.append((segment, offset, now))
                self.cached_bytes += capacity
                if self.next_expiry == math.inf:
                    self.next_expiry = now + self.interval
                elif now >= self.next_expiry:
                    self.expire(now)
                return
        self.arena.give(segment, offset, capacity)

    def add_pending(self, segment: int, offset: int, capacity: int, events: list[Any]) -> None:
        """Park a range until every event's ``query()`` is true."""
        self.pending.append((segment, offset, capacity, events))
        self.pending_bytes += capacity

    def reclaim_pending(self, now: float) -> None:
        """Move ranges whose events have all completed to the free side (never waits)."""
        still_pending = []
        for entry in self.pending:
            segment, offset, capacity, events = entry
            if all(event.query() for event in events):
                self.pending_bytes -= capacity
                self.put_free(segment, offset, capacity, now)
            else:
                still_pending.append(entry)
        self.pending = still_pending

    def expire(self, now: float) -> None:
        """Return cached ranges unused for ``interval`` seconds to the arena."""
        horizon = now - self.interval
        next_expiry = math.inf
        emptied = []
        for capacity, bucket in self.cache.items():
            while bucket and bucket[0][2] <= horizon:  # oldest on the left (hits pop the right)
                segment, offset, _ = bucket.popleft()
                self.cached_bytes -= capacity
                self.cache_expired += 1
                self.arena.give(segment, offset, capacity)
            if bucket:
                next_expiry = min(next_expiry, bucket[0][2] + self.interval)
            else:
                emptied.append(capacity)
        # Drop empty buckets, or a workload of ever-new sizes grows the dict without bound.
        for capacity in emptied:
            del self.cache[capacity]
        self.next_expiry = next_expiry

    def flush_cache(self) -> None:
        """Return every cached range to the arena (coalescing them)."""
        for capacity, bucket in self.cache.items():
            while bucket:
                segment, offset, _ = bucket.pop()
                self.arena.give(segment, offset, capacity)
        self.cache.clear()
        self.cached_bytes = 0
        self.next_expiry = math.inf

    # -- segments ---------------------------------------------------------------------------

    def add_segment(self, segment: int, size: int, pageable: bool = False) -> None:
        """Register a new, all-free segment (``pageable``: host memory that is not page-locked)."""
        self.arena.add_segment(segment, size)
        self.reserved += size
        if pageable:
            self.pageable[segment] = size
            self.pageable_bytes += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def remove_segment(self, segment: int) -> int:
        """Forget an empty segment; returns its size."""
        size = self.arena.remove_segment(segment)
        self.reserved -= size
        self.pageable_bytes -= self.pageable.pop(segment, 0)
        return size

    def clear(self) -> None:
        """Forget every segment, cached and pending range (``clear(force=True)``)."""
        self.arena = Arena()
        self.cache.clear()
        self.pending.clear()
        self.cached_bytes = self.pending_bytes = 0
        self.next_expiry = math.inf
        self.allocated = self.requested = self.reserved = self.relocatable_live = 0
        self.pageable.clear()
        self.pageable_bytes = 0

    # -- reporting --------------------------------------------------------------------------

    def largest_free(self) -> int:
        """The largest range usable now: a free arena range or a cached block."""
        largest_cached = max((c for c, bucket in self.cache.items() if bucket), default=0)
        return max(self.arena.largest_free, largest_cached)

    def fragmentation(self) -> float:
        """``1 - largest free block / usable free bytes`` (pending bytes are not usable)."""
        usable = self.arena.total_free + self.cached_bytes
        return 1.0 - self.largest_free() / usable if usable else 0.0

    def snapshot(self, live_blocks: int) -> PoolStats:
        """The statistics as a :class:`PoolStats`."""
        return PoolStats(
            allocated=self.allocated, reserved=self.reserved,
            peak_allocated=self.peak_allocated, peak_reserved=self.peak_reserved,
            num_allocations=self.num_allocations, num_frees=self.num_frees,
            cache_hits=self.cache_hits, cache_misses=self.cache_misses,
            fragmentation=self.fragmentation(), largest_free_block=self.largest_free(),
            segments=self.arena.num_segments, requested=self.requested,
            free=self.reserved - self.allocated, cached=self.cached_bytes,
            pending=self.pending_bytes, live_blocks=live_blocks,
            leaked_frees=self.leaked_frees, cache_expired=self.cache_expired,
            defragmentations=self.defragmentations, total_allocated=self.total_allocated,
            pageable_bytes=self.pageable_bytes)


# --------------------------------------------------------------------------------------------
# Segment sizing
# --------------------------------------------------------------------------------------------


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def fit_segment(kind: str, request: int, target: int, room: int | None,
                 alignment: int) -> int | None:
    """Size of the next segment: ``target`` rounded the way the backing allocator rounds, but at
    most ``room`` (None: no cap) and at least ``request``; ``None`` when that is impossible.

    ``kind`` is the segment backend's sizing rule: ``"pinned"`` (the fallback pinned backend,
    ``torch.empty(pin_memory=True)``) gives powers of two, because PyTorch's caching host
    allocator rounds every allocation up to one: using the whole power keeps ``reserved`` equal
    to the bytes really pinned. ``"cuda"`` gives multiples of 2 MiB above 1 MiB, PyTorch's
    rounding for large device blocks. ``"cpu"`` (plain host memory, and pinned memory registered
    with ``cudaHostRegister``) rounds only to ``alignment``.
    """
    if kind == "pinned":
        size = pow2_ceil(max(target, alignment))
        if room is None or size <= room:
            return size
        size = _pow2_floor(room)
        return size if size >= request else None
    granule = (max(_CUDA_LARGE_ROUND, alignment) if kind == "cuda" and target > (1 << 20)
               else alignment)
    size = -(-target // granule) * granule
    if room is None or size <= room:
        return size
    for step in (granule, alignment):
        size = room // step * step
        if size >= request:
            return size
    return None
