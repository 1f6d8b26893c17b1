"""Out-of-memory errors: recognize one, and say which kind it is.

* :func:`is_oom_error` recognizes an out-of-memory error by its exception *type* or its CUDA
  *error code*, never by matching words in its message: ``torch.OutOfMemoryError`` (raised by
  CUDA and by ROCm/HIP builds, which report through the same CUDA caching allocator), an error
  carrying the CUDA code ``cudaErrorMemoryAllocation`` (read by
  :func:`vramkit.devices.cuda_errors.cuda_error_code`: ``torch.AcceleratorError``'s
  ``error_code`` from torch >= 2.8; before torch 2.8, which raised CUDA runtime failures as plain
  ``RuntimeError``s without a code, a plain ``RuntimeError`` whose first line is exactly the one
  ``C10_CUDA_CHECK`` formats for that code,
  :data:`~vramkit.devices.cuda_errors.C10_CUDA_CHECK_OOM_LINE`), the XPU/MPS classes where a
  torch build defines them, Python's ``MemoryError`` and vramkit's
  :class:`~vramkit.errors.PoolExhaustedError`. PyTorch's CPU allocator raises a plain
  ``RuntimeError`` when ``malloc`` fails (torch 2.13 has no type for it), and other messages
  that merely mention running out of memory carry no code; such errors are *not* recognized,
  because matching their text is what this module refuses to do.
* :func:`classify_oom` says why memory ran out -- capacity, fragmentation or memory held outside
  PyTorch -- from the caching allocator's statistics, ``cudaMemGetInfo`` and NVML, with a hint;
  :func:`diagnose_memory` is its pure part, over a :class:`DeviceMemoryReading` (the one
  :class:`~vramkit.devices.memory_info.MemoryInfo` record) that :func:`read_device_memory` reads.
* An allocator observer (installed by :mod:`vramkit.observe.recovery` once CUDA is up) records the
  size of each failed CUDA request, so a diagnosis knows what was asked for.

Recovering from an OOM (retrying smaller) is :mod:`vramkit.observe.recovery`'s job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vramkit.devices.cuda_errors import is_cuda_out_of_memory
from vramkit.devices.memory_info import MemoryInfo, read_memory_info
from vramkit.errors import ConfigError, PoolExhaustedError, RecoveryError
from vramkit.units import format_size

__all__ = [
    "DeviceMemoryReading",
    "OomDiagnosis",
    "classify_oom",
    "diagnose_memory",
    "is_oom_error",
    "read_device_memory",
]

logger = logging.getLogger(__name__)

OomKind = Literal["capacity", "fragmentation", "outside_pytorch"]

# Thresholds of the classification, as fractions of the memory PyTorch may use on the device.
# Cached-but-unallocated bytes above this share mean the allocator's cache is fragmented.
_FRAGMENTED_SHARE = 0.10
# Bytes held on the device outside this process's allocator above this share (besides the CUDA
# context, a few hundred MiB) mean someone else holds the memory.
_OUTSIDE_SHARE = 0.10

_HINTS: dict[str, str] = {
    "capacity": ("The step needs more memory than the device has: lower the batch size, enable "
                 "gradient checkpointing, swap blocks (BlockSwapper), offload the optimizer "
                 "(CPUOffloadOptimizer) or quantize the frozen weights."),
    "fragmentation": ("Enough bytes are free but not in one piece: set "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA "
                      "call (vramkit.setup_cuda_memory_management), call torch.cuda.empty_cache() "
                      "between phases, or preallocate fixed buffers with a MemoryPool."),
    "outside_pytorch": ("Memory is held outside this process's PyTorch allocator (other "
                        "processes, another framework such as JAX/CuPy, or a memory cap): check "
                        "`vramkit info` / nvidia-smi, stop other jobs, or set "
                        "XLA_PYTHON_CLIENT_PREALLOCATE=false when JAX shares the GPU."),
    "host": ("The host ran out of memory: offload less to the CPU, use a smaller pinned pool "
             "(PoolConfig.max_size), or load checkpoints lazily (vramkit.io)."),
}


# ------------------------------------------------------------------------------------------
# Detection
# ------------------------------------------------------------------------------------------


def _oom_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [MemoryError]  # PoolExhaustedError is a MemoryError
    for owner in (torch, getattr(torch, "cuda", None), getattr(torch, "xpu", None),
                  getattr(torch, "mps", None)):
        cls = getattr(owner, "OutOfMemoryError", None)
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in types:
            types.append(cls)
    return tuple(types)


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error, judged by its type or CUDA error code.

    Recognized: ``torch.OutOfMemoryError`` (CUDA and ROCm/HIP), a ``RuntimeError`` carrying the
    CUDA error code ``cudaErrorMemoryAllocation`` (2) -- ``torch.AcceleratorError`` from
    torch >= 2.8, or with torch < 2.8 a plain ``RuntimeError`` whose first line is exactly
    ``C10_CUDA_CHECK``'s line for that code; see
    :func:`vramkit.devices.cuda_errors.is_cuda_out_of_memory` --,
    ``torch.xpu.OutOfMemoryError`` and ``torch.mps.OutOfMemoryError`` when the torch build
    defines them, ``MemoryError`` (host) and vramkit's
    :class:`~vramkit.errors.PoolExhaustedError`. Otherwise the message is not read: a
    ``RuntimeError`` that only *says* "CUDA out of memory" somewhere in its text is not
    recognized. A :class:`~vramkit.errors.RecoveryError` (a ``MemoryError`` raised when recovery
    gave up) is not a fresh OOM and returns ``False``, so nested recovery loops do not retry it.

    Args:
        error: any exception.

    Returns:
        ``True`` for the errors above.
    """
    if isinstance(error, RecoveryError):
        return False
    return isinstance(error, _oom_types()) or is_cuda_out_of_memory(error)


# ------------------------------------------------------------------------------------------
# Classification
# ------------------------------------------------------------------------------------------

#: What one device's memory looked like when an OOM happened: the one
#: :class:`~vramkit.devices.memory_info.MemoryInfo` record, under the name the diagnosis uses
#: (``device``, ``total``, ``free``, ``reserved``, ``allocated``, ``largest_cached_block``,
#: ``limit``, ``other_processes``; bytes, ``None`` = unknown).
DeviceMemoryReading = MemoryInfo


@dataclass(frozen=True)
class OomDiagnosis:
    """Why memory ran out. Holds no reference to the exception (its frames hold tensors).

    Attributes:
        kind: ``"capacity"`` (the work needs more than the device offers), ``"fragmentation"``
            (enough bytes are free, not in one piece) or ``"outside_pytorch"`` (memory held by
            other processes, other frameworks or non-PyTorch allocations in this process).
        device: ``"cuda:N"``, ``"cpu"`` (host) or ``"pool"`` (a vramkit MemoryPool).
        error_type: the exception's class name.
        requested: bytes of the failed allocation, when known.
        free / reserved / allocated / total / limit: the reading (see
            :class:`DeviceMemoryReading`); ``None`` when unknown.
        cached_free: reserved-but-unallocated bytes.
        largest_free_block: the largest free block in the allocator's cache or the pool.
        outside_pytorch: device bytes used outside this process's allocator.
        other_processes: bytes NVML charges to other processes.
        hint: what to try.
    """

    kind: OomKind
    device: str
    error_type: str
    requested: int | None = None
    free: int | None = None
    reserved: int | None = None
    allocated: int | None = None
    total: int | None = None
    limit: int | None = None
    cached_free: int | None = None
    largest_free_block: int | None = None
    outside_pytorch: int | None = None
    other_processes: int | None = None
    hint: str = ""

    def __str__(self) -> str:
        def size(value: int | None) -> str:
            return "?" if value is None else format_size(value)

        return (f"{self.error_type} on {self.device}: {self.kind} (requested "
                f"{size(self.requested)}, free {size(self.free)}, reserved "
                f"{size(self.reserved)}, allocated {size(self.allocated)}, outside PyTorch "
                f"{size(self.outside_pytorch)})\n  hint: {self.hint}")


def diagnose_memory(reading: DeviceMemoryReading, requested: int | None = None,
                    error_type: str = "OutOfMemoryError") -> OomDiagnosis:
    """Classify an OOM from a memory reading (the pure part of :func:`classify_oom`).

    Rules, in order (``growth`` = ``min(free, usable - reserved)``, the bytes ``reserved`` could
    still grow by):

    * **fragmentation** -- with ``requested`` known: ``requested <= cached_free + growth`` (the
      bytes were there, split up). Unknown: ``cached_free >= 10%`` of ``usable`` and the largest
      cached block (when known) is smaller than ``cached_free``.
    * **outside_pytorch** -- memory held outside this allocator (``total - free - reserved``,
      or NVML's figure for other processes, whichever is larger) is at least 10% of the device
      and, with ``requested`` known, the request would fit under the cap if that memory were
      free (unknown: ``reserved`` is below the cap minus that memory).
    * **capacity** -- otherwise (hitting a ``set_per_process_memory_fraction`` cap is
      capacity: the hint names the cap).

    Args:
        reading: the device's memory at the OOM.
        requested: bytes of the failed allocation, if known (default ``None``).
        error_type: the exception class name to record (default ``"OutOfMemoryError"``).

    Returns:
        The diagnosis, with a hint for its kind.

    Raises:
        ConfigError: the reading lacks ``total``, ``free``, ``reserved`` or ``allocated`` (a
            host record, say).
    """
    if None in (reading.total, reading.free, reading.reserved, reading.allocated):
        raise ConfigError(f"diagnose_memory needs a device reading with total, free, reserved "
                          f"and allocated bytes, got {reading!r}",
                          hint="Read the device with read_device_memory(index).")
    usable = reading.usable
    growth = max(0, min(reading.free, usable - reading.reserved))
    outside = reading.outside_pytorch
    held_elsewhere = max(outside, reading.other_processes or 0)
    significant = held_elsewhere >= _OUTSIDE_SHARE * reading.total
    kind: OomKind
    if requested is not None:
        if requested <= reading.cached_free + growth:
            kind = "fragmentation"
        elif significant and requested <= reading.cached_free + max(
                0, min(usable - reading.reserved, reading.free + held_elsewhere)):
            kind = "outside_pytorch"
        else:
            kind = "capacity"
    else:
        largest = reading.largest_cached_block
        if reading.cached_free >= _FRAGMENTED_SHARE * usable and (
                largest is None or largest < reading.cached_free):
            kind = "fragmentation"
        elif significant and reading.reserved < usable - held_elsewhere:
            kind = "outside_pytorch"
        else:
            kind = "capacity"
    hint = _HINTS[kind]
    if kind == "capacity" and reading.limit is not None and reading.limit < reading.total:
        hint = (f"This process is capped at {format_size(usable)} of {format_size(reading.total)} "
                "(torch.cuda.set_per_process_memory_fraction): raise the cap, or " +
                hint[0].lower() + hint[1:])
    return OomDiagnosis(
        kind=kind, device=reading.device, error_type=error_type, requested=requested,
        free=reading.free, reserved=reading.reserved, allocated=reading.allocated,
        total=reading.total, limit=reading.limit, cached_free=reading.cached_free,
        largest_free_block=reading.largest_cached_block, outside_pytorch=outside,
        other_processes=reading.other_processes, hint=hint)


def read_device_memory(index: int, *, use_nvml: bool = True,
                       largest_block: bool = True) -> DeviceMemoryReading:
    """Read one CUDA device's memory the way :func:`classify_oom` needs it.

    Args:
        index: CUDA ordinal.
        use_nvml: ask NVML for other processes' memory on the device (default ``True``).
        largest_block: walk ``torch.cuda.memory_snapshot()`` for the largest cached free block
            (default ``True``; a few ms, fine after an OOM, not on a hot path).

    Returns:
        The reading (:func:`~vramkit.devices.memory_info.read_memory_info` with the cap, and
        without the device name).

    Raises:
        DeviceError: CUDA is not available, or ``index`` is not visible.
    """
    return read_memory_info(index, name=False, limit=True, largest_block=largest_block,
                            other_processes=use_nvml, owner="read_device_memory")


_last_request: dict[int, int] = {}
_observer_installed = False


def _record_failed_request(*args: Any) -> None:
    # Called by the CUDA allocator as (device, requested bytes, device allocated, device free);
    # it must never raise (it runs inside the allocator's OOM path), hence *args.
    try:
        _last_request[int(args[0])] = int(args[1])
    except (IndexError, TypeError, ValueError):
        pass


def _install_oom_observer() -> None:
    """Have the CUDA allocator report each failed request's size (called after CUDA is up)."""
    global _observer_installed
    if _observer_installed:
        return
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return
    try:
        attach(_record_failed_request)
        _observer_installed = True
    except RuntimeError as err:
        logger.debug("cannot attach the OOM observer: %s", err)


def classify_oom(error: BaseException, device: Any = None, *, requested: int | None = None,
                 use_nvml: bool = True) -> OomDiagnosis:
    """Say why ``error`` (an OOM) happened: capacity, fragmentation or memory outside PyTorch.

    Call it soon after the error, before memory is freed: it reads the current state.

    Args:
        error: an error :func:`is_oom_error` accepts. CUDA out-of-memory errors (by type or
            by the code ``cudaErrorMemoryAllocation``) are diagnosed from the device's memory;
            a code does not say whether device or page-locked host memory ran out, so the
            device is read either way.
        device: the CUDA device it happened on (default ``None``: the current CUDA device).
            Ignored for host errors and pool errors.
        requested: bytes of the failed allocation. Default ``None``: the pool's figure for
            :class:`~vramkit.errors.PoolExhaustedError`, else (for ``torch.OutOfMemoryError``)
            the size the CUDA allocator reported to vramkit's OOM observer (installed by
            :class:`~vramkit.observe.recovery.MemoryRecovery` and
            :func:`~vramkit.observe.recovery.find_executable_batch_size` on CUDA), else unknown.
        use_nvml: ask NVML for other processes' usage (default ``True``).

    Returns:
        An :class:`OomDiagnosis`.

    Raises:
        ConfigError: when ``error`` is not an OOM.
    """
    if not is_oom_error(error):
        raise ConfigError(f"not an out-of-memory error: {type(error).__name__}",
                          hint="Check is_oom_error(e) before classifying.")
    error_type = type(error).__name__
    if isinstance(error, PoolExhaustedError):
        return _classify_pool(error, requested, error_type)
    if not is_cuda_out_of_memory(error):
        return _classify_host(requested, error_type)
    from vramkit.observe.stats import resolve_cuda_index

    index = resolve_cuda_index(device)
    if index is None:
        return OomDiagnosis(kind="capacity", device="cuda", error_type=error_type,
                            requested=requested, hint=_HINTS["capacity"])
    if requested is None and isinstance(error, torch.OutOfMemoryError):
        # The observer sees the caching allocator's failures, which raise OutOfMemoryError; an
        # error known by its CUDA code came from elsewhere (cudaHostAlloc, an extension's own
        # cudaMalloc), so a recorded size would belong to another failure.
        requested = _last_request.pop(index, None)
    reading = read_device_memory(index, use_nvml=use_nvml)
    return diagnose_memory(reading, requested, error_type)


def _classify_pool(error: PoolExhaustedError, requested: int | None,
                   error_type: str) -> OomDiagnosis:
    stats = error.stats
    requested = error.requested if requested is None else requested
    reserved = getattr(stats, "reserved", None)
    allocated = getattr(stats, "allocated", None)
    largest = getattr(stats, "largest_free_block", None)
    free = None if reserved is None or allocated is None else reserved - allocated
    fragmented = free is not None and largest is not None and largest < requested <= free
    kind: OomKind = "fragmentation" if fragmented else "capacity"
    hint = ("The pool has the bytes but not in one piece: call pool.defragment(), or free "
            "long-lived blocks first." if fragmented else
            "The pool reached PoolConfig.max_size: raise it, or free blocks you no longer need.")
    return OomDiagnosis(kind=kind, device="pool", error_type=error_type, requested=requested,
                        free=free, reserved=reserved, allocated=allocated, cached_free=free,
                        largest_free_block=largest, hint=hint)


def _classify_host(requested: int | None, error_type: str) -> OomDiagnosis:
    from vramkit.observe.stats import host_rss

    host = read_memory_info("cpu")
    total, available = int(host.total or 0), int(host.free or 0)
    rss = host_rss() or 0
    outside = max(0, total - available - rss)
    kind: OomKind = "capacity"
    if (requested is not None and requested <= available + outside
            and outside >= _OUTSIDE_SHARE * total and requested > available):
        kind = "outside_pytorch"
    return OomDiagnosis(kind=kind, device="cpu", error_type=error_type, requested=requested,
                        free=host.free, allocated=rss, total=host.total,
                        outside_pytorch=outside, hint=_HINTS["host"])
