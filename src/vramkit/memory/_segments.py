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

``torch.cuda.cudart()`` exposes ``cudaHostRegister(ptr: int, size: int, flags: int)`` and
``cudaHostUnregister(ptr: int)`` (``torch/csrc/cuda/shared/cudart.cpp``, present from PyTorch
2.0 through at least 2.13); both return a ``cudaError`` enum whose ``int()`` is the CUDA error
code. Flags ``0`` is ``cudaHostRegisterDefault``: on 64-bit systems (unified virtual addressing)
the memory is both mapped and portable, i.e. pinned for every device's context.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from typing import Any

import torch

from vramkit.errors import DeviceError
from vramkit.memory._block import Segment

__all__ = [
    "DeviceSegments",
    "HostSegments",
    "PowerOfTwoPinnedSegments",
    "RegisteredPinnedSegments",
    "SegmentBackend",
    "host_register_api",
    "make_segment_backend",
]

logger = logging.getLogger(__name__)

_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: mapped and portable under UVA


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
        storage = self._raw(size)
        if storage.data_ptr() % self.alignment:  # heap memory is only 64-byte aligned: pad
            del storage
            padded = self._raw(size + self.alignment)
            start = (-padded.data_ptr()) % self.alignment
            storage = padded[start:start + size]
        return storage

    def release(self, segment: Segment) -> None:
        """Give a segment's storage back; the segment holds no live or pending block.

        Args:
            segment: the segment; its ``storage`` is set to ``None``.
        """
        segment.storage = None  # type: ignore[assignment]

    def empty_cache(self) -> None:
        """Ask the backing allocator to return cached memory to the system (after a trim)."""

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


class PowerOfTwoPinnedSegments(SegmentBackend):
    """Pinned memory from PyTorch's caching host allocator, which rounds up to powers of two."""

    sizing = "pinned"

    def _raw(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def empty_cache(self) -> None:
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()


class RegisteredPinnedSegments(SegmentBackend):
    """Exact-size pinned segments: anonymous mmap + ``cudaHostRegister``.

    The backend keeps every registered segment's storage in ``registered`` (address -> storage)
    until it unregisters it, so the memory cannot be freed while registered; :func:`close`
    unregisters whatever is left (run by the pool's finalizer).

    Args:
        cudart: the module returned by ``torch.cuda.cudart()`` (or a stand-in with the same two
            functions).
        alignment: segment base alignment in bytes.
    """

    sizing = "cpu"  # exact: only rounded to the pool's alignment

    def __init__(self, cudart: Any, alignment: int) -> None:
        super().__init__(alignment)
        self.cudart = cudart
        self.registered: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # the finalizer may run on any thread

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
        start = (-whole.data_ptr()) % self.alignment
        storage = whole[start:start + size]
        ptr = storage.data_ptr()
        code = _cuda_code(self.cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_DEFAULT))
        if code != 0:
            del whole, storage  # unmap now, not when the caller drops the traceback
            raise DeviceError(
                f"cudaHostRegister of a {size}-byte pinned segment failed: "
                f"{_error_name(self.cudart, code)} (cudaError {code})",
                hint="Page-locked memory comes out of physical RAM: lower PoolConfig.max_size, "
                     "or use a plain host pool (MemoryPool('cpu')).")
        with self._lock:
            self.registered[ptr] = storage
        return storage

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
        if storage is None:  # never unregister twice
            return
        # ``storage`` is still referenced here, so the memory is mapped while it is unregistered.
        code = _cuda_code(self.cudart.cudaHostUnregister(ptr))
        del storage
        if code != 0:
            raise DeviceError(f"cudaHostUnregister({ptr:#x}) failed: "
                              f"{_error_name(self.cudart, code)} (cudaError {code})",
                              hint="A CUDA error from earlier work may be reported here; rerun "
                                   "with CUDA_LAUNCH_BLOCKING=1 to find it.")


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


def make_segment_backend(kind: str, device: torch.device, alignment: int) -> SegmentBackend:
    """The backend for a pool of ``kind`` (``"cuda"``, ``"pinned"`` or ``"cpu"``).

    Args:
        kind: the pool kind.
        device: the pool's device.
        alignment: segment base alignment in bytes.

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
        return RegisteredPinnedSegments(cudart, alignment)
    logger.warning("PyTorch %s does not expose cudaHostRegister through torch.cuda.cudart(); "
                   "pinned pool segments fall back to torch.empty(pin_memory=True), which rounds "
                   "every segment up to a power of two", torch.__version__)
    return PowerOfTwoPinnedSegments(alignment)


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
        backend: its segment backend; only :class:`RegisteredPinnedSegments` needs a finalizer.
        ledger: the pool's :class:`~vramkit.memory._arena.PoolLedger`.
    """
    if isinstance(backend, RegisteredPinnedSegments):
        weakref.finalize(pool, finalize_pinned_pool, backend, ledger)


def _anonymous_mmap(size: int) -> mmap.mmap:
    private = getattr(mmap, "MAP_PRIVATE", None)
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if private is not None and anonymous is not None:
        # Private, so a fork()ed child gets copy-on-write pages, not shared pinned ones.
        return mmap.mmap(-1, size, flags=private | anonymous)
    return mmap.mmap(-1, size)  # Windows: an anonymous, page-aligned mapping


def _cuda_code(result: object) -> int:
    return int(result)  # type: ignore[call-overload]


def _error_name(cudart: Any, code: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:  # a stand-in cudart, or an enum without that value
        return "unknown error"
