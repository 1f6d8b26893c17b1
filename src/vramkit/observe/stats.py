"""Allocator statistics: what PyTorch's CUDA caching allocator, NVML and the host report.

:func:`allocator_stats` reads one frozen :class:`AllocatorStats` record from
``torch.cuda.memory_stats`` (current and peak allocated/reserved/active bytes, inactive split
bytes, requested bytes, allocation retries, OOMs, ``cudaMalloc`` counts), adds the NVML figure
for this process (memory the driver charges to the process, which includes the CUDA context,
cuBLAS workspaces and anything allocated outside PyTorch) and the host RSS.

Reading never initializes CUDA: when this process has not touched CUDA yet the torch figures are
zero, which is the truth (nothing has been allocated). On a CPU-only machine the record holds
zeros and ``None`` and nothing raises.

:class:`CudaAllocator` is the EriDiffusion-style accessor object (``current_allocated()``,
``peak_allocated()``, ``reset_peak()``) over the same figures, and
:func:`with_memory_tracking` measures one call (re-exported by :mod:`vramkit.observe.profiler`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil

from vramkit._validate import check_device
from vramkit.devices import _runtime
from vramkit.devices._runtime import cuda_initialized
from vramkit.devices.resolve import cuda_ordinal

__all__ = ["AllocatorStats", "CudaAllocator", "MemoryStats", "allocator_stats",
           "with_memory_tracking"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# torch.cuda.memory_stats keys: the one table every reader of the flat dict uses.
_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "reserved": "reserved_bytes.all.current",
    "peak_reserved": "reserved_bytes.all.peak",
    "active": "active_bytes.all.current",
    "peak_active": "active_bytes.all.peak",
    "inactive_split": "inactive_split_bytes.all.current",
    "requested": "requested_bytes.all.current",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "num_device_allocs": "num_device_alloc",
    "num_device_frees": "num_device_free",
    "segments": "segment.all.current",
    "allocations_total": "allocation.all.allocated",
    "allocated_bytes_total": "allocated_bytes.all.allocated",
}


@dataclass(frozen=True)
class AllocatorStats:
    """One reading of the CUDA caching allocator, NVML and host memory.

    Torch figures are bytes for one device (``device``); they are 0 when CUDA is not available or
    not initialized in this process (``cuda_initialized`` says which).

    Attributes:
        device: ``"cuda:N"`` or ``"cpu"``.
        cuda_initialized: whether this process had initialized CUDA when the record was read.
        allocated / peak_allocated: bytes in live tensors (now / peak since the last reset).
        reserved / peak_reserved: bytes the caching allocator holds from the driver.
        active / peak_active: allocated bytes plus blocks waiting for a stream to finish.
        inactive_split: cached-but-free bytes inside split segments (unusable for big requests).
        requested: bytes callers asked for (``allocated`` is rounded up from this).
        num_alloc_retries: times the allocator freed its cache and retried a ``cudaMalloc``.
        num_ooms: out-of-memory errors the allocator raised.
        num_device_allocs / num_device_frees: ``cudaMalloc`` / ``cudaFree`` calls.
        segments: segments (``cudaMalloc`` blocks) currently held.
        allocations_total: cumulative allocation count (``allocation.all.allocated``).
        allocated_bytes_total: cumulative bytes allocated (``allocated_bytes.all.allocated``).
        reserved_all_devices: reserved bytes summed over every device this process initialized.
        nvml_process_used: GPU bytes NVML charges to this process over all GPUs, ``None`` when
            NVML is unavailable or was not asked.
        host_rss: resident set size of this process in bytes (``None`` if the OS refused to tell).
    """

    device: str
    cuda_initialized: bool
    allocated: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    peak_reserved: int = 0
    active: int = 0
    peak_active: int = 0
    inactive_split: int = 0
    requested: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_allocs: int = 0
    num_device_frees: int = 0
    segments: int = 0
    allocations_total: int = 0
    allocated_bytes_total: int = 0
    reserved_all_devices: int = 0
    nvml_process_used: int | None = None
    host_rss: int | None = None

    @property
    def fragmentation(self) -> float:
        """``1 - allocated / reserved``: share of reserved memory not holding tensors (0 if none)."""
        return fragmentation_ratios(self.allocated, self.reserved, self.inactive_split)[0]

    @property
    def inactive_split_ratio(self) -> float:
        """``inactive_split / reserved``: share of reserved memory stranded in split blocks."""
        return fragmentation_ratios(self.allocated, self.reserved, self.inactive_split)[1]

    @property
    def outside_torch(self) -> int | None:
        """GPU bytes this process holds outside PyTorch's allocator (context, cuBLAS, NCCL, ...).

        ``nvml_process_used - reserved_all_devices``; ``None`` when NVML gave no figure.
        """
        if self.nvml_process_used is None:
            return None
        return self.nvml_process_used - self.reserved_all_devices

    def to_dict(self) -> dict[str, Any]:
        """All fields plus the derived figures, as JSON-ready types."""
        data = dataclasses.asdict(self)
        data["fragmentation"] = self.fragmentation
        data["inactive_split_ratio"] = self.inactive_split_ratio
        data["outside_torch"] = self.outside_torch
        return data


def fragmentation_ratios(allocated: int, reserved: int, inactive_split: int) -> tuple[float, float]:
    """``(1 - allocated / reserved, inactive_split / reserved)``; both 0.0 when nothing is reserved.

    Args:
        allocated: bytes in live tensors.
        reserved: bytes the caching allocator holds.
        inactive_split: cached-but-free bytes inside split segments.

    Returns:
        ``(fragmentation, inactive_split_ratio)``.
    """
    if reserved <= 0:
        return 0.0, 0.0
    return max(0.0, 1.0 - allocated / reserved), inactive_split / reserved


def resolve_cuda_index(device: Any = None) -> int | None:
    """The CUDA ordinal ``device`` names, or ``None`` for the CPU.

    Args:
        device: ``None`` (the current CUDA device when CUDA is initialized, else 0 when CUDA is
            available, else the CPU), an int ordinal, ``"cuda"``, ``"cuda:N"``, ``"cpu"`` or a
            ``torch.device``. Default ``None``.

    Returns:
        The ordinal, or ``None`` when the device is the CPU or CUDA is not available.

    Raises:
        ConfigError: (an ``InvalidDeviceError``) for a negative ordinal, an unparseable device
            string or a device type other than cpu/cuda.
        DeviceError: for a CUDA ordinal this process cannot see.
    """
    parsed = check_device("measured device", "cuda" if device is None else device)
    if parsed.type == "cpu" or not _runtime.is_cuda_available():
        return None
    return cuda_ordinal(parsed, owner="allocator statistics")


def read_memory_stats(index: int | None) -> dict[str, Any]:
    """``torch.cuda.memory_stats(index)``, or ``{}`` on the CPU or before CUDA is initialized."""
    if index is None or not cuda_initialized():
        return {}
    import torch

    return torch.cuda.memory_stats(index)


def read_cuda_figures(index: int) -> tuple[int, int, int, int, int]:
    """(allocated, reserved, active, peak allocated, peak reserved) bytes of one CUDA device.

    The fast reader for loops: it takes the nested dict PyTorch builds in C++ (what
    ``torch.cuda.memory_stats`` flattens in Python, several times slower) and falls back to the
    public call if the private one moves. The caller checks that CUDA is initialized
    (:func:`vramkit.devices._runtime.cuda_initialized`); this does not, to stay cheap.

    Args:
        index: the CUDA ordinal.

    Returns:
        The five figures, in bytes.
    """
    import torch

    try:
        raw = torch._C._cuda_memoryStats(index)
        alloc, res, act = (raw["allocated_bytes"]["all"], raw["reserved_bytes"]["all"],
                           raw["active_bytes"]["all"])
        return (int(alloc["current"]), int(res["current"]), int(act["current"]),
                int(alloc["peak"]), int(res["peak"]))
    except (AttributeError, KeyError, TypeError):
        flat = torch.cuda.memory_stats(index)
        return tuple(int(flat.get(_KEYS[name], 0)) for name in  # type: ignore[return-value]
                     ("allocated", "reserved", "active", "peak_allocated", "peak_reserved"))


class HostRssReader:
    """Resident set size of one process, optionally plus its descendants.

    Holds the ``psutil.Process`` (made at the first reading), so repeated readings cost one
    ``/proc`` read each.

    Args:
        pid: the process; ``None`` (default) means this process.
        include_children: add the RSS of every live descendant (default ``False``).
    """

    def __init__(self, pid: int | None = None, *, include_children: bool = False) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.include_children = include_children
        self._process: psutil.Process | None = None

    def _proc(self) -> psutil.Process:
        if self._process is None:
            self._process = psutil.Process(self.pid)
        return self._process

    def read(self) -> int | None:
        """Bytes resident now, or ``None`` when the process is gone or not readable (a process
        that exited and was not reaped yet reads 0 bytes: that is no reading either)."""
        try:
            process = self._proc()
            rss = int(process.memory_info().rss)
            if rss == 0:  # a zombie: a live process always has resident pages
                return None
            if self.include_children:
                for child in process.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        rss += int(child.memory_info().rss)
            return rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def pids(self) -> set[int]:
        """The process id plus, with ``include_children``, those of its live descendants."""
        pids = {self.pid}
        if self.include_children:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                pids.update(child.pid for child in self._proc().children(recursive=True))
        return pids


_own_rss: HostRssReader | None = None


def host_rss() -> int | None:
    """Resident set size of this process in bytes (``None`` only if the OS refuses to tell)."""
    global _own_rss
    reader = _own_rss
    if reader is None or reader.pid != os.getpid():  # a forked child must not read its parent
        reader = _own_rss = HostRssReader()
    return reader.read()


def nvml_process_memory(pid: int | Iterable[int] | None = None) -> int | None:
    """NVML's GPU bytes for one or more processes, summed (one NVML session), or ``None``.

    Args:
        pid: a process id, several, or ``None`` (default) for this process.

    Returns:
        See :func:`vramkit.devices.nvml.process_memory` (imported lazily so importing this
        module never touches NVML).
    """
    from vramkit.devices.nvml import process_memory

    return process_memory(pid)


def reset_cuda_peak(index: int) -> None:
    """``torch.cuda.reset_peak_memory_stats(index)``: peaks restart from the current figures."""
    import torch

    torch.cuda.reset_peak_memory_stats(index)


def reserved_all_devices() -> int:
    """Bytes PyTorch's caching allocator reserves, summed over every device (0 before CUDA init)."""
    if not cuda_initialized():
        return 0
    import torch

    return sum(read_cuda_figures(i)[1] for i in range(torch.cuda.device_count()))


def allocator_stats(device: Any = None, *, include_nvml: bool = True) -> AllocatorStats:
    """Read the allocator, NVML and host figures for ``device`` without initializing CUDA.

    Args:
        device: see :func:`resolve_cuda_index`; default ``None`` (current CUDA device, or CPU).
        include_nvml: query NVML for this process's GPU memory (default ``True``; NVML takes a
            few milliseconds, so pass ``False`` in tight loops).

    Returns:
        An :class:`AllocatorStats`. Torch figures are 0 on the CPU and before CUDA is initialized.
    """
    index = resolve_cuda_index(device)
    stats = read_memory_stats(index)
    values = {field: int(stats.get(key, 0)) for field, key in _KEYS.items()}
    return AllocatorStats(
        device="cpu" if index is None else f"cuda:{index}",
        cuda_initialized=cuda_initialized(),
        reserved_all_devices=reserved_all_devices(),
        nvml_process_used=nvml_process_memory() if include_nvml else None,
        host_rss=host_rss(),
        **values,
    )


class CudaAllocator:
    """Accessors for one CUDA device's caching allocator (EriDiffusion ``CudaAllocator``).

    Figures are 0 when CUDA is unavailable or not initialized (no CUDA memory has been allocated);
    nothing here initializes CUDA.

    Args:
        device: see :func:`resolve_cuda_index`; default ``None`` (the current CUDA device).
    """

    def __init__(self, device: Any = None) -> None:
        self._index = resolve_cuda_index(device)

    @property
    def device(self) -> str:
        """``"cuda:N"``, or ``"cpu"`` when CUDA is not available."""
        return "cpu" if self._index is None else f"cuda:{self._index}"

    def _read(self, key: str) -> int:
        return int(read_memory_stats(self._index).get(key, 0))

    def current_allocated(self) -> int:
        """Bytes held by live tensors on this device now."""
        return self._read(_KEYS["allocated"])

    def peak_allocated(self) -> int:
        """Largest ``current_allocated()`` since the process started or the last :meth:`reset_peak`."""
        return self._read(_KEYS["peak_allocated"])

    def current_reserved(self) -> int:
        """Bytes the caching allocator holds from the driver now."""
        return self._read(_KEYS["reserved"])

    def peak_reserved(self) -> int:
        """Largest ``current_reserved()`` since the last reset."""
        return self._read(_KEYS["peak_reserved"])

    def reset_peak(self) -> None:
        """Reset the device's peak counters to the current values (no-op before CUDA init)."""
        if self._index is None or not cuda_initialized():
            return
        reset_cuda_peak(self._index)

    def stats(self, *, include_nvml: bool = False) -> AllocatorStats:
        """The full :class:`AllocatorStats` record for this device.

        Args:
            include_nvml: also query NVML (default ``False``: the accessors stay cheap).
        """
        return allocator_stats(self.device, include_nvml=include_nvml)

    def __repr__(self) -> str:
        return f"CudaAllocator(device={self.device!r})"


# --- with_memory_tracking ----------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryStats:
    """Memory used by one call (EriDiffusion ``MemoryStats``), from :func:`with_memory_tracking`.

    On CUDA every figure comes from the caching allocator's counters (exact, no sync). On the CPU
    ``peak_allocated``, ``start_allocated`` and ``end_allocated`` are host RSS (the whole
    process, sampled every millisecond), and ``total_allocated`` / ``num_allocations`` count the
    torch CPU tensor storages that ops created during the call (a dispatch mode sees each op);
    numpy arrays and Python objects are not counted.

    Attributes:
        name: the operation name passed in.
        device: ``"cuda:N"`` or ``"cpu"``.
        peak_allocated: peak bytes during the call (absolute, including what existed before).
        total_allocated: bytes allocated during the call, freed or not (a difference of
            the allocator's cumulative counter; ``PoolStats.total_allocated`` is the same
            counter for a :class:`~vramkit.memory.pool.MemoryPool`).
        num_allocations: allocations during the call.
        start_allocated / end_allocated: the figure before and after the call.
        duration_s: wall time of the call.
        source: ``"cuda_allocator"`` or ``"host_rss+cpu_dispatch"``.
    """

    name: str
    device: str
    peak_allocated: int
    total_allocated: int
    num_allocations: int
    start_allocated: int
    end_allocated: int
    duration_s: float
    source: str

    @property
    def peak_delta(self) -> int:
        """How far the call raised the figure above its starting value."""
        return self.peak_allocated - self.start_allocated


def with_memory_tracking(name: str, fn: Callable[..., _T], *args: Any,
                         **kwargs: Any) -> tuple[_T, MemoryStats]:
    """Run ``fn(*args, **kwargs)`` and measure its memory (EriDiffusion API).

    On CUDA this resets the device's peak counters (``torch.cuda.reset_peak_memory_stats``) so
    the peak belongs to this call. See :class:`MemoryStats` for what the CPU figures mean.

    Args:
        name: a label for logs and the returned record.
        fn: the callable.
        *args, **kwargs: passed to ``fn``.

    Returns:
        ``(result, MemoryStats)``.
    """
    index = resolve_cuda_index(None)
    started = time.perf_counter()
    if index is not None:
        if cuda_initialized():
            reset_cuda_peak(index)
        before = read_memory_stats(index)
        result = fn(*args, **kwargs)
        after = read_memory_stats(index)

        def figure(counters: dict[str, Any], field: str) -> int:
            return int(counters.get(_KEYS[field], 0))

        stats = MemoryStats(
            name=name, device=f"cuda:{index}",
            peak_allocated=figure(after, "peak_allocated"),
            total_allocated=figure(after, "allocated_bytes_total")
            - figure(before, "allocated_bytes_total"),
            num_allocations=figure(after, "allocations_total")
            - figure(before, "allocations_total"),
            start_allocated=figure(before, "allocated"),
            end_allocated=figure(after, "allocated"),
            duration_s=time.perf_counter() - started, source="cuda_allocator")
    else:
        counter = _make_allocation_counter()
        with _RssPeakSampler() as rss, counter:
            result = fn(*args, **kwargs)
        stats = MemoryStats(
            name=name, device="cpu", peak_allocated=rss.peak, total_allocated=counter.bytes,
            num_allocations=counter.count, start_allocated=rss.start, end_allocated=rss.end,
            duration_s=time.perf_counter() - started, source="host_rss+cpu_dispatch")
    logger.debug("%s: peak %d B, %d allocations, %d B allocated", name, stats.peak_allocated,
                 stats.num_allocations, stats.total_allocated)
    return result, stats


class _RssPeakSampler:
    """Host RSS at entry and exit and its peak, polled every ``interval`` seconds in between."""

    def __init__(self, interval: float = 0.001) -> None:
        self._interval = interval
        self._stop = threading.Event()
        self.start = self.end = self.peak = 0
        self._thread: threading.Thread | None = None

    @staticmethod
    def _rss() -> int:
        return host_rss() or 0

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> _RssPeakSampler:
        self.start = self.peak = self._rss()
        self._thread = threading.Thread(target=self._poll, name="vramkit-rss-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = self._rss()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.end)


def _make_allocation_counter() -> Any:
    """A TorchDispatchMode counting CPU storages created by ops (not views or in-place results)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _AllocationCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0
            self.bytes = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr()
                      for t in tree_flatten((args, kwargs or {}))[0]
                      if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
            for item in tree_flatten(out)[0]:
                if not isinstance(item, torch.Tensor) or item.device.type != "cpu":
                    continue
                storage = item.untyped_storage()
                ptr = storage.data_ptr()
                if ptr in inputs or (ptr == 0 and storage.nbytes() == 0):
                    continue
                inputs.add(ptr)  # an op returning one new storage twice counts it once
                self.count += 1
                self.bytes += int(storage.nbytes())
            return out

    return _AllocationCounter()
