"""Where a :class:`~vramkit.memory.pool.MemoryPool` gets its segments and how it releases them.

One backend per pool kind:

* :class:`DeviceSegments` -- ``torch.empty(n, dtype=uint8)`` on a CUDA device. On release the
  storage is ``record_stream``-ed on the current stream so PyTorch's caching allocator does not
  hand the memory to another stream before the pool's work on it is done.
* :class:`HostSegments` -- plain pageable host memory, ``torch.empty(n, dtype=uint8)``.
* :class:`RegisteredPinnedSegments` -- page-locked host memory of *exactly* the segment size: an
  anonymous ``mmap`` (page aligned, whole pages owned by the segment) wrapped with
  ``torch.frombuffer`` and page-locked with ``cudaHostRegister``. ``cudaHostUnregister`` runs when
  the segment is released, while the pool still holds the memory, so an unregister never reaches
  freed memory.
* :class:`PowerOfTwoPinnedSegments` -- the fallback when the installed PyTorch does not expose
  ``cudaHostRegister`` through ``torch.cuda.cudart()``: ``torch.empty(n, pin_memory=True)``, whose
  caching host allocator rounds every allocation up to a power of two, so segments are sized as
  powers of two to keep ``reserved`` equal to the bytes really pinned.

Why an anonymous mmap and not ``torch.empty`` for registered memory: ``cudaHostRegister`` locks
whole pages, and a heap allocation shares its first and last pages with neighbouring heap
allocations; registering two such ranges that touch one page fails with
``cudaErrorHostMemoryAlreadyRegistered``, and unregistering one would unlock a page the other still
relies on. An mmap owns its pages outright and is page aligned (4 KiB or more), which covers every
pool alignment up to the page size without padding. ``torch.frombuffer`` keeps the mapping alive
for as long as any tensor views it, so a stale view can never point at unmapped memory.

When pinning fails or is capped (:class:`PinnedSegmentBackend`), a pinned pool does not crash:
with ``PoolConfig.pin_fallback`` (the default) the segment is kept as plain pageable memory --
for the registered backend the same anonymous mapping, simply not registered (and so never
unregistered) -- and the process is told once, with the figures (:func:`warn_pin_fallback`).
That covers three cases:

* ``cudaHostRegister`` returns an error code (the driver could not lock the pages: RAM, a WSL
  cap, a driver limit);
* ``torch.empty(pin_memory=True)`` raises a CUDA error, recognized by type
  (``torch.OutOfMemoryError``) or by CUDA error code, never by message;
* before pinning, the segment would take the page-locked bytes of all vramkit pinned pools of
  this process past the host's pinning cap (``HostMemory.pin_limit`` of
  :func:`vramkit.devices.host.read_host_memory`: the cgroup memory limit, where exceeding it is
  an OOM kill and no error ever comes back, or half of RAM on WSL 2). The pool then falls back
  proactively (and, when the request alone fits, grows by less first:
  :meth:`PinnedSegmentBackend.pin_room`).

Pageable host memory is slower but correct for every copy vramkit makes (see
:mod:`vramkit.memory.transfer`); nothing is allocated per copy. With ``pin_fallback=False`` each
case raises :class:`~vramkit.errors.DeviceError` instead.

A failed ``cudaHostRegister`` also leaves its error as the CUDA runtime's *last error* of the
calling thread (torch's binding returns the code without clearing it), and PyTorch's next kernel
launch check (``cudaGetLastError``) would then raise that stale error from an unrelated op.
:func:`drain_last_cuda_error` consumes it right away.

``torch.cuda.cudart()`` exposes ``cudaHostRegister(ptr: int, size: int, flags: int)`` and
``cudaHostUnregister(ptr: int)`` (``torch/csrc/cuda/shared/cudart.cpp``, present from PyTorch
2.0 through at least 2.13); both return a ``cudaError`` enum whose ``int()`` is the CUDA error
code. Flags ``0`` is ``cudaHostRegisterDefault``: on 64-bit systems (unified virtual addressing)
the memory is both mapped and portable, i.e. pinned for every device's context.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from vramkit.devices.cuda_errors import cuda_error_code
from vramkit.errors import DeviceError, VramkitWarning
from vramkit.memory._block import Segment
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.devices.host import HostMemory

__all__ = [
    "DeviceSegments",
    "HostSegments",
    "PinnedSegmentBackend",
    "PowerOfTwoPinnedSegments",
    "RegisteredPinnedSegments",
    "SegmentBackend",
    "drain_last_cuda_error",
    "host_register_api",
    "make_segment_backend",
    "pinned_bytes",
    "warn_pin_fallback",
]

logger = logging.getLogger(__name__)

_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: mapped and portable under UVA

# Page-locked bytes held by every vramkit pinned pool of this process (what counts against the
# host's pinning cap), and whether the process was told that pinning fell back.
_PROCESS_LOCK = threading.Lock()
_pinned_total = 0
_fallback_warned = False

_MEMORY_DIR = os.path.dirname(os.path.abspath(__file__))


def pinned_bytes() -> int:
    """Page-locked bytes that vramkit's pinned pools hold in this process now.

    Returns:
        The sum over every live pinned segment (registered or from PyTorch's pinned allocator);
        segments that fell back to pageable memory are not counted.
    """
    return _pinned_total


def _count_pinned(delta: int) -> None:
    global _pinned_total
    with _PROCESS_LOCK:
        _pinned_total += delta


def _reset_pin_fallback_warning() -> None:
    """Forget that the pin-fallback warning was given (tests; the next fallback warns again)."""
    global _fallback_warned
    with _PROCESS_LOCK:
        _fallback_warned = False


class SegmentBackend:
    """Allocates and releases the storage of a pool's segments.

    Attributes:
        sizing: how :func:`vramkit.memory._arena.fit_segment` rounds segment sizes for this
            backend (``"cuda"``, ``"cpu"`` or ``"pinned"`` for powers of two).
    """

    sizing = "cpu"

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment

    def new_storage(self, size: int) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly ``size`` bytes whose address is ``alignment``-aligned.

        Args:
            size: bytes, a multiple of the alignment (> 0).

        Returns:
            The segment's storage.

        Raises:
            torch.OutOfMemoryError: when the memory cannot be obtained.
        """
        return self._aligned(size, self._raw)

    def page_locked(self, storage: torch.Tensor) -> bool:
        """Whether ``storage`` (from :meth:`new_storage`) is page-locked host memory.

        Args:
            storage: a segment's storage.

        Returns:
            ``True`` only for pinned segments; plain host memory, device memory and pinned
            segments that fell back to pageable memory give ``False``.
        """
        return False

    def release(self, segment: Segment) -> None:
        """Give a segment's storage back; the segment holds no live or pending block.

        Args:
            segment: the segment; its ``storage`` is set to ``None``.
        """
        segment.storage = None  # type: ignore[assignment]

    def empty_cache(self) -> None:
        """Ask the backing allocator to return cached memory to the system (after a trim)."""

    def _aligned(self, size: int, raw: Callable[[int], torch.Tensor]) -> torch.Tensor:
        storage = raw(size)
        if storage.data_ptr() % self.alignment:  # heap memory is only 64-byte aligned: pad
            del storage
            padded = raw(size + self.alignment)
            start = (-padded.data_ptr()) % self.alignment
            storage = padded[start:start + size]
        return storage

    def _raw(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)


class HostSegments(SegmentBackend):
    """Pageable host memory from PyTorch's CPU allocator."""


class DeviceSegments(SegmentBackend):
    """Device memory from PyTorch's CUDA caching allocator.

    Args:
        device: the CUDA device.
        alignment: segment base alignment in bytes.
    """

    sizing = "cuda"

    def __init__(self, device: torch.device, alignment: int) -> None:
        super().__init__(alignment)
        self.device = device

    def _raw(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def release(self, segment: Segment) -> None:
        if segment.storage is not None:
            # Blocks were used on the current stream: PyTorch must not hand the memory out
            # to another stream before that work is done.
            segment.storage.record_stream(torch.cuda.current_stream(self.device))
        segment.storage = None  # type: ignore[assignment]

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class PinnedSegmentBackend(SegmentBackend):
    """What the two pinned backends share: the pinning cap, the fallback, the byte count.

    Every segment that is really page-locked is listed in ``locked`` (base address -> bytes
    locked) and counted in :func:`pinned_bytes` until it is released; a segment that fell back to
    pageable memory is in neither.

    Args:
        alignment: segment base alignment in bytes.
        pin_fallback: keep a segment that cannot be pinned as pageable memory (warning once per
            process) instead of raising :class:`~vramkit.errors.DeviceError`.
    """

    def __init__(self, alignment: int, pin_fallback: bool = True) -> None:
        super().__init__(alignment)
        self.pin_fallback = pin_fallback
        self.locked: dict[int, int] = {}
        self._lock = threading.Lock()  # the finalizer may run on any thread

    def page_locked(self, storage: torch.Tensor) -> bool:
        return storage.data_ptr() in self.locked

    def pin_room(self) -> int | None:
        """Bytes this process may still pin before the host's pinning cap, if one is known.

        Returns:
            ``pin_limit - pinned_bytes()`` (at least 0), or ``None`` when no cap is known.
        """
        host = read_host()
        if host is None or host.pin_limit is None:
            return None
        return max(0, host.pin_limit - pinned_bytes())

    def close(self) -> None:
        """Forget every segment still counted as pinned (idempotent)."""
        with self._lock:
            released = sum(self.locked.values())
            self.locked.clear()
        if released:
            _count_pinned(-released)

    def _mark_locked(self, storage: torch.Tensor, nbytes: int) -> None:
        with self._lock:
            self.locked[storage.data_ptr()] = nbytes
        _count_pinned(nbytes)

    def _forget_locked(self, ptr: int) -> int:
        with self._lock:
            nbytes = self.locked.pop(ptr, 0)
        if nbytes:
            _count_pinned(-nbytes)
        return nbytes

    def _over_cap(self, host: HostMemory | None, size: int) -> str | None:
        """Why pinning ``size`` more bytes would pass the host's pinning cap, or ``None``."""
        if host is None or host.pin_limit is None:
            return None
        held = pinned_bytes()
        if held + size <= host.pin_limit:
            return None
        consequence = (" (pinned pages count against it and cannot be swapped out: past it the "
                       "process is OOM-killed, no error comes back)"
                       if host.pin_limit_source.startswith("cgroup") else "")
        return (f"pinning it would take vramkit's page-locked memory in this process to "
                f"{format_size(held + size)}, past the host's pinning cap of "
                f"{format_size(host.pin_limit)} ({host.pin_limit_source}){consequence}")

    def _not_pinned(self, size: int, cause: str, host: HostMemory | None, capped: bool) -> None:
        """The segment of ``size`` bytes will not be pinned: raise, or say so (once)."""
        if not self.pin_fallback:
            raise DeviceError(f"cannot pin a {format_size(size)} pool segment: {cause}",
                              hint=_fallback_hint(host, capped=capped, fallback_on=False))
        warn_pin_fallback(size, cause, host, capped=capped)


class PowerOfTwoPinnedSegments(PinnedSegmentBackend):
    """Pinned memory from PyTorch's caching host allocator, which rounds up to powers of two.

    When that allocation raises a CUDA error (by type or by CUDA error code) or the segment would
    pass the host's pinning cap, the segment is plain ``torch.empty(n)`` pageable memory (with
    ``pin_fallback``).
    """

    sizing = "pinned"

    def new_storage(self, size: int) -> torch.Tensor:
        host = read_host()
        cause = self._over_cap(host, size)
        capped = cause is not None
        if cause is None:
            try:
                storage = self._aligned(size, self._raw)
            except RuntimeError as exc:
                code = cuda_error_code(exc)
                out_of_memory = getattr(torch, "OutOfMemoryError", None)
                is_cuda = code is not None or (isinstance(out_of_memory, type)
                                               and isinstance(exc, out_of_memory))
                if not is_cuda or not self.pin_fallback:
                    raise  # as before: the pool retries a smaller size on out-of-memory
                what = f"cudaError {code}" if code is not None else "out of memory"
                cause = (f"torch.empty(pin_memory=True) raised {type(exc).__name__} ({what})")
            else:
                self._mark_locked(storage, storage.numel())
                return storage
        self._not_pinned(size, cause, host, capped)
        return self._aligned(size, _pageable)

    def release(self, segment: Segment) -> None:
        if segment.storage is not None:
            self._forget_locked(segment.base_ptr)
        segment.storage = None  # type: ignore[assignment]

    def empty_cache(self) -> None:
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()

    def _raw(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)


class RegisteredPinnedSegments(PinnedSegmentBackend):
    """Exact-size pinned segments: anonymous mmap + ``cudaHostRegister``.

    The backend keeps every registered segment's storage in ``registered`` (address -> storage)
    until it unregisters it, so the memory cannot be freed while registered; :func:`close`
    unregisters whatever is left (run by the pool's finalizer). A segment that fell back to
    pageable memory is the same mapping, never registered: it is not in ``registered`` and is
    never unregistered.

    Args:
        cudart: the module returned by ``torch.cuda.cudart()`` (or a stand-in with the same two
            functions).
        alignment: segment base alignment in bytes.
        pin_fallback: keep a segment that cannot be registered as pageable memory.
    """

    sizing = "cpu"  # exact: only rounded to the pool's alignment

    def __init__(self, cudart: Any, alignment: int, pin_fallback: bool = True) -> None:
        super().__init__(alignment, pin_fallback)
        self.cudart = cudart
        self.registered: dict[int, torch.Tensor] = {}

    def new_storage(self, size: int) -> torch.Tensor:
        # mmap is page aligned; only alignments above the page size need padding.
        pad = self.alignment if self.alignment > mmap.PAGESIZE else 0
        try:
            mapping = _anonymous_mmap(size + pad)
        except OSError as exc:
            raise DeviceError(f"cannot map {size} bytes of host memory for a pinned segment: "
                              f"{exc}", hint="Lower PoolConfig.max_size or free host memory."
                              ) from exc
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        del mapping  # the tensor keeps the mapping alive; it is unmapped with the last view
        populate(whole)
        start = (-whole.data_ptr()) % self.alignment
        storage = whole[start:start + size]
        del whole
        try:
            self.pin(storage)
        except DeviceError:
            del storage  # unmap now, not when the caller drops the traceback
            raise
        return storage  # page-locked, or the same mapping pageable

    def pin(self, storage: torch.Tensor) -> bool:
        """Page-lock ``storage`` (host memory mapped by this process: a segment, or a mapping
        shared with other processes) with ``cudaHostRegister``; it stays registered until
        :meth:`release`-d or :meth:`close`-d.

        Args:
            storage: a 1-D uint8 CPU tensor whose memory outlives the registration.

        Returns:
            ``True`` when locked; ``False`` when it stays pageable (the process is told once,
            :func:`warn_pin_fallback`).

        Raises:
            DeviceError: it cannot be locked and ``pin_fallback`` is off.
        """
        ptr, size = storage.data_ptr(), storage.numel()
        host = read_host()
        cause = self._over_cap(host, size)
        capped = cause is not None
        if cause is None:
            code = _cuda_code(self.cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_DEFAULT))
            if code == 0:
                with self._lock:
                    self.registered[ptr] = storage
                self._mark_locked(storage, size)
                return True
            drain_last_cuda_error(self.cudart)
            if not self.pin_fallback:
                del storage  # the traceback keeps this frame: it must not keep the memory
                raise DeviceError(
                    f"cudaHostRegister of a {size}-byte pinned segment failed: "
                    f"{_error_name(self.cudart, code)} (cudaError {code})",
                    hint="Page-locked memory comes out of physical RAM: lower "
                         "PoolConfig.max_size, use a plain host pool (MemoryPool('cpu')), or "
                         "leave PoolConfig.pin_fallback on to go on with pageable memory.")
            cause = (f"cudaHostRegister returned {_error_name(self.cudart, code)} "
                     f"(cudaError {code})")
        del storage
        self._not_pinned(size, cause, host, capped)
        return False

    def release(self, segment: Segment) -> None:
        if segment.storage is not None:
            self._unregister(segment.base_ptr)
        segment.storage = None  # type: ignore[assignment]  # the memory goes with the last view

    def close(self) -> None:
        """Unregister every segment still registered (idempotent; errors are logged)."""
        with self._lock:
            ptrs = list(self.registered)
        for ptr in ptrs:
            try:
                self._unregister(ptr)
            except Exception as exc:  # interpreter exit: CUDA may already be shutting down
                logger.debug("cudaHostUnregister(%#x) at pool teardown failed: %s", ptr, exc)

    def _unregister(self, ptr: int) -> None:
        with self._lock:
            storage = self.registered.pop(ptr, None)
        if storage is None:  # never unregister twice, nor a pageable (never registered) segment
            return
        self._forget_locked(ptr)
        # ``storage`` is still referenced here, so the memory is mapped while it is unregistered.
        code = _cuda_code(self.cudart.cudaHostUnregister(ptr))
        del storage
        if code != 0:
            drain_last_cuda_error(self.cudart)
            raise DeviceError(f"cudaHostUnregister({ptr:#x}) failed: "
                              f"{_error_name(self.cudart, code)} (cudaError {code})",
                              hint="A CUDA error from earlier work may be reported here; rerun "
                                   "with CUDA_LAUNCH_BLOCKING=1 to find it.")


def _pageable(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def read_host() -> HostMemory | None:
    """:func:`vramkit.devices.host.read_host_memory`, or ``None`` when it cannot be read."""
    try:
        from vramkit.devices.host import read_host_memory

        return read_host_memory()
    except Exception as exc:  # a reader that fails must not stop a pool from growing
        logger.debug("reading host memory for the pinning cap failed: %s", exc)
        return None


def warn_pin_fallback(size: int, cause: str, host: HostMemory | None, *,
                      capped: bool = False) -> None:
    """Say once per process that a pinned segment is pageable memory instead, with the figures.

    The first call warns (``VramkitWarning`` and ``logger.warning``); later calls log at debug
    level only.

    Args:
        size: bytes of the segment that is not pinned.
        cause: what failed or which cap applies.
        host: the host's memory figures, when read.
        capped: the cause is the host's pinning cap (the hint then says how to raise it).
    """
    global _fallback_warned
    with _PROCESS_LOCK:
        first = not _fallback_warned
        _fallback_warned = True
    held = pinned_bytes()
    if not first:
        logger.debug("pinned pool segment of %s is pageable memory: %s (vramkit holds %s "
                     "pinned)", format_size(size), cause, format_size(held))
        return
    figures = [f"segment {format_size(size)}",
               f"already pinned by vramkit in this process {format_size(held)}"]
    if host is not None and host.pin_limit is not None:
        figures.append(f"pinning cap {format_size(host.pin_limit)} ({host.pin_limit_source})")
    elif host is not None:
        figures.append("no pinning cap known")
    memlock = host.memlock_limit if host is not None else None
    if memlock is not None:
        figures.append(f"RLIMIT_MEMLOCK {format_size(memlock)} (not charged for CUDA pinning "
                       "by the NVIDIA driver)")
    message = (
        f"vramkit: a pinned host pool could not pin a new segment: {cause}. "
        f"Figures: {'; '.join(figures)}. "
        "The segment is plain pageable memory instead (and so is any later one that cannot be "
        "pinned; this is said once per process): results stay correct, but host<->device "
        "copies from or into it are staged by the CUDA driver, block the Python thread and run "
        "several times slower than from pinned memory (measured on an H100 by "
        "benchmarks/pinning_fallback.py: 8.6x host->device, 4.9x device->host). "
        f"Hint: {_fallback_hint(host, capped=capped, fallback_on=True)}")
    logger.warning("%s", message)
    warnings.warn(message, VramkitWarning, stacklevel=_caller_stacklevel())


def _fallback_hint(host: HostMemory | None, *, capped: bool, fallback_on: bool) -> str:
    source = host.pin_limit_source if host is not None else "none"
    if capped and source.startswith("WSL"):
        raise_it = "give the WSL 2 VM more memory (memory= in %UserProfile%\\.wslconfig)"
    elif capped:
        raise_it = ("raise the container's memory limit (docker run --memory, Kubernetes "
                    "resources.limits.memory, the cgroup's memory.max)")
    else:
        raise_it = ("free host memory or raise the limit that applies (the container's memory "
                    "limit; `ulimit -l` where pinned memory is charged to RLIMIT_MEMLOCK)")
    tail = ("PoolConfig(pin_fallback=False) makes this an error instead."
            if fallback_on else "PoolConfig(pin_fallback=True) goes on with pageable memory "
            "(slower copies) instead.")
    return (f"To pin, {raise_it}; or pin less: SwapConfig(host_budget=...) (vramkit.plan()/fit() "
            f"take host_budget= too), or a smaller PoolConfig.max_size. {tail}")


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside ``vramkit/memory`` (the code that allocated)."""
    level = 1
    frame = sys._getframe(1)  # the function calling warnings.warn is stacklevel 1
    while frame.f_back is not None and os.path.dirname(
            os.path.abspath(frame.f_code.co_filename)) == _MEMORY_DIR:
        frame = frame.f_back
        level += 1
    return level


def drain_last_cuda_error(cudart: Any) -> None:
    """Consume the CUDA runtime's last error that a failed call left on this thread.

    The cudart bindings return the error of ``cudaHostRegister`` without clearing it, and
    PyTorch's next ``C10_CUDA_KERNEL_LAUNCH_CHECK`` (``cudaGetLastError``) would raise it from an
    unrelated op. ``cudart.cudaGetLastError`` clears it where the bindings have it; otherwise a
    one-byte kernel launch in PyTorch's own runtime reads (and so clears) it, and the error that
    launch raises is the stale one, logged at debug level.

    Args:
        cudart: the runtime bindings the failed call went through.
    """
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if callable(get_last_error):
        try:
            get_last_error()
            return
        except Exception as exc:
            logger.debug("cudaGetLastError() failed: %s", exc)
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, dtype=torch.uint8, device=device).fill_(0)
    except RuntimeError as exc:  # the stale error, read and cleared by PyTorch's launch check
        logger.debug("cleared the CUDA error left by a failed call (cudaError %s)",
                     cuda_error_code(exc))
    except Exception as exc:  # no usable CUDA here (a stand-in runtime)
        logger.debug("could not clear the last CUDA error: %s", exc)


def host_register_api() -> Any | None:
    """The CUDA runtime bindings when they can register host memory, else ``None``.

    Returns:
        ``torch.cuda.cudart()`` when it has ``cudaHostRegister`` and ``cudaHostUnregister``.
    """
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError, AttributeError) as exc:
        logger.debug("torch.cuda.cudart() is unavailable: %s", exc)
        return None
    if cudart is None:
        return None
    if not (callable(getattr(cudart, "cudaHostRegister", None))
            and callable(getattr(cudart, "cudaHostUnregister", None))):
        return None
    return cudart


def make_segment_backend(kind: str, device: torch.device, alignment: int, *,
                         pin_fallback: bool = True) -> SegmentBackend:
    """The backend for a pool of ``kind`` (``"cuda"``, ``"pinned"`` or ``"cpu"``).

    Args:
        kind: the pool kind.
        device: the pool's device.
        alignment: segment base alignment in bytes.
        pin_fallback: pinned pools only: keep a segment that cannot be pinned as pageable
            memory (``PoolConfig.pin_fallback``).

    Returns:
        A new backend. Pinned pools get :class:`RegisteredPinnedSegments` when
        ``cudaHostRegister`` is available, else :class:`PowerOfTwoPinnedSegments` (logged as a
        warning).
    """
    if kind == "cuda":
        return DeviceSegments(device, alignment)
    if kind == "cpu":
        return HostSegments(alignment)
    cudart = host_register_api()
    if cudart is not None:
        return RegisteredPinnedSegments(cudart, alignment, pin_fallback)
    logger.warning("PyTorch %s does not expose cudaHostRegister through torch.cuda.cudart(); "
                   "pinned pool segments fall back to torch.empty(pin_memory=True), which rounds "
                   "every segment up to a power of two", torch.__version__)
    return PowerOfTwoPinnedSegments(alignment, pin_fallback)


def finalize_pinned_pool(backend: RegisteredPinnedSegments, pending: Any) -> None:
    """Pool finalizer: wait for freed blocks' copies, then unregister every segment left.

    Args:
        backend: the pool's pinned backend (holds the storages, so nothing is freed yet).
        pending: the pool's ledger; its ``pending`` entries carry the events of blocks that
            asynchronous copies may still read.
    """
    try:
        for *_, events in list(pending.pending):
            for event in events:
                event.synchronize()
    except Exception as exc:  # interpreter exit: CUDA may already be shutting down
        logger.debug("waiting for pinned copies at pool teardown failed: %s", exc)
    backend.close()


def register_finalizer(pool: object, backend: SegmentBackend, ledger: Any) -> None:
    """Unregister a pinned pool's memory when ``pool`` is collected or the interpreter exits.

    Args:
        pool: the pool (only weakly referenced).
        backend: its segment backend; only pinned backends need a finalizer (the power-of-two
            one to take its segments out of :func:`pinned_bytes`).
        ledger: the pool's :class:`~vramkit.memory._arena.PoolLedger`.
    """
    if isinstance(backend, RegisteredPinnedSegments):
        weakref.finalize(pool, finalize_pinned_pool, backend, ledger)
    elif isinstance(backend, PinnedSegmentBackend):
        weakref.finalize(pool, backend.close)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, without writing them
_POPULATE_CHUNK = 8 << 20
_libc: Any = None
_populate_pool: ThreadPoolExecutor | None = None
_populate_lock = threading.Lock()


def _madvise_populate(ptr: int, size: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    # ctypes releases the GIL for each call: other threads' Python goes on meanwhile. In
    # chunks: the kernel holds the process's memory-map lock (for reading) while it populates,
    # and another thread's mmap/munmap (any large malloc) waits for it -- at most one chunk's
    # time. Chunks run on a few threads: zeroing pages is CPU work (~2 GB/s per thread), as slow
    # as a disk read when done by one.
    chunks = [(ptr + start, min(_POPULATE_CHUNK, size - start))
              for start in range(0, size, _POPULATE_CHUNK)]
    if len(chunks) < 4:
        return all(_populate_chunk(c) for c in chunks)
    return all(_populate_threads().map(_populate_chunk, chunks))


def _populate_chunk(chunk: tuple[int, int]) -> bool:
    return int(_libc.madvise(chunk[0], chunk[1], _MADV_POPULATE_WRITE)) == 0


def _populate_threads() -> ThreadPoolExecutor:
    global _populate_pool
    with _populate_lock:
        if _populate_pool is None:
            _populate_pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)),
                                                thread_name_prefix="vramkit-populate")
        return _populate_pool


def populate(mapping: torch.Tensor) -> None:
    """Fault in every page of a *fresh* anonymous mapping (``mapping`` views it from its
    page-aligned start) before it is page-locked.

    ``cudaHostRegister`` of untouched pages faults them in itself, inside the CUDA driver, at
    1.5-2.3 GB/s, and holds the driver's lock all the while: every CUDA call of every other
    thread of the process waits (measured on an H100: another thread's small kernel launches fell
    from 101,000/s to 3-4/s; ``benchmarks/investigations/pin_contention.py``). Pages faulted in beforehand register at 17-22 GB/s. The kernel does
    it with ``madvise(MADV_POPULATE_WRITE)``, 8 MiB at a time on up to 4 threads, outside any
    lock of ours (the GIL is released); where that is missing (Linux < 5.14, other systems)
    one byte per page is written -- zero, which a fresh mapping already holds.
    """
    size = mapping.numel()
    if size == 0 or _madvise_populate(mapping.data_ptr(), size):
        return
    mapping[::mmap.PAGESIZE].zero_()


def _anonymous_mmap(size: int) -> mmap.mmap:
    private = getattr(mmap, "MAP_PRIVATE", None)
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if private is not None and anonymous is not None:
        # Private, so a fork()ed child gets copy-on-write pages, not shared pinned ones.
        return mmap.mmap(-1, size, flags=private | anonymous)
    return mmap.mmap(-1, size)  # Windows: an anonymous, page-aligned mapping


def _cuda_code(result: object) -> int:
    return int(result)  # type: ignore[call-overload]


# The cudaError_t names (driver_types.h) of what cudaHostRegister and cudaHostUnregister return.
_HOST_REGISTER_ERRORS = {
    1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError", 100: "cudaErrorNoDevice",
    304: "cudaErrorOperatingSystem", 712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered", 801: "cudaErrorNotSupported",
    999: "cudaErrorUnknown",
}


def _error_name(cudart: Any, code: int) -> str:
    name = _HOST_REGISTER_ERRORS.get(code)
    try:
        text = str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:  # a stand-in cudart, or an enum without that value
        text = None
    if name and text:
        return f"{name}: {text}"
    return name or text or "unknown error"
