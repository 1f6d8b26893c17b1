"""One record of a device's memory, and the one reader that fills it.

:class:`MemoryInfo` is what vramkit knows about one device's memory at one moment: the
device-wide figures (``cudaMemGetInfo``, or host RAM from psutil), this process's PyTorch caching
allocator (current and peak allocated/reserved bytes), and, when asked, what an out-of-memory
diagnosis needs (the per-process cap, the largest cached free block, other processes' memory
from NVML). Every reader of device memory in vramkit goes through :func:`read_memory_info`:
:func:`vramkit.devices.env.get_gpu_memory_info` (whose ``GpuMemoryInfo`` is this class),
:func:`vramkit.observe.oom.read_device_memory` (``DeviceMemoryReading``, this class too) and
:func:`vramkit.kernels.stats.memory_stats` (its ``(free, total)`` tuple is made from one).

Importing this module does not import torch; reading a CUDA device creates its CUDA context
(``cudaMemGetInfo`` needs one), reading the host does not.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from vramkit.devices import _runtime
from vramkit.devices.resolve import resolve_device
from vramkit.units import format_size

__all__ = ["MemoryInfo", "read_memory_info"]

logger = logging.getLogger(__name__)

# torch.cuda.memory_stats keys of the allocator figures a MemoryInfo holds.
_ALLOCATOR_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "max_allocated": "allocated_bytes.all.peak",
    "max_reserved": "reserved_bytes.all.peak",
}


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one CUDA device, or of the host (``kind="host"``). Bytes; ``None`` = unknown.

    ``total``/``free``/``used`` are device-wide (every process, from ``cudaMemGetInfo``; host RAM
    from psutil, ``free`` being the *available* memory, for ``kind="host"``). ``allocated`` /
    ``reserved`` and their peaks are this process's PyTorch caching allocator, ``None`` on the
    host. ``largest_cached_block``, ``limit`` and ``other_processes`` are read only when asked
    (an OOM diagnosis asks). Equivalent query: ``nvidia-smi --query-gpu=memory.total,memory.free,
    memory.used``.

    Attributes:
        device: ``"cuda:N"`` or ``"cpu"``.
        total: device memory.
        free: memory the driver (or the OS) could still hand out.
        used: ``total - free`` (derived when not given).
        allocated: bytes in live tensors of this process.
        reserved: bytes held by this process's caching allocator.
        max_allocated / max_reserved: their peaks since the last reset.
        kind: ``"cuda"`` or ``"host"``.
        name: the device name.
        largest_cached_block: the largest free block inside the allocator's segments.
        limit: the cap on ``reserved`` (``set_per_process_memory_fraction`` x total), ``None``
            without a cap.
        other_processes: memory NVML charges to other processes on this device.
    """

    device: str
    total: int | None
    free: int | None
    used: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    max_allocated: int | None = None
    max_reserved: int | None = None
    kind: Literal["cuda", "host"] = "cuda"
    name: str | None = None
    largest_cached_block: int | None = None
    limit: int | None = None
    other_processes: int | None = None

    def __post_init__(self) -> None:
        if self.used is None and self.total is not None and self.free is not None:
            object.__setattr__(self, "used", self.total - self.free)

    @property
    def cached_free(self) -> int | None:
        """Reserved but unallocated bytes (the allocator's cache)."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def outside_pytorch(self) -> int | None:
        """Device bytes in use that this process's allocator does not hold."""
        if self.total is None or self.free is None or self.reserved is None:
            return None
        return max(0, self.total - self.free - self.reserved)

    @property
    def usable(self) -> int | None:
        """The most ``reserved`` may grow to: the cap, or the device size."""
        if self.total is None:
            return None
        return self.total if self.limit is None else min(self.total, self.limit)

    def __str__(self) -> str:
        def size(value: int | None) -> str:
            return format_size(value) if value is not None else "n/a"

        if self.kind == "host":
            return (f"no CUDA GPU; host RAM {size(self.used)} used of {size(self.total)} "
                    f"({size(self.free)} free)")
        label = f"{self.device} ({self.name})" if self.name else self.device
        return (f"{label}: {size(self.used)} used of {size(self.total)} ({size(self.free)} free); "
                f"PyTorch allocated {size(self.allocated)}, reserved {size(self.reserved)}, "
                f"peak allocated {size(self.max_allocated)}, peak reserved "
                f"{size(self.max_reserved)}")


def read_memory_info(device: Any = None, *, allocator: bool = True, name: bool = True,
                     limit: bool = False, largest_block: bool = False,
                     other_processes: bool = False, owner: str = "read_memory_info"
                     ) -> MemoryInfo:
    """Read the memory of a device now.

    Args:
        device: ``"cpu"`` (the host record), a CUDA device (``"cuda"``, ``"cuda:N"``, an int
            ordinal, a ``torch.device``, a vramkit ``Device``), or ``None`` (default): the current
            CUDA device when CUDA is available, else the host.
        allocator: read this process's caching-allocator figures (default ``True``).
        name: read the device name (default ``True``).
        limit: read the per-process cap (default ``False``).
        largest_block: walk ``torch.cuda.memory_snapshot()`` for the largest cached free block
            (default ``False``; a few ms, fine after an OOM, not on a hot path).
        other_processes: ask NVML for other processes' memory on the device (default
            ``False``).
        owner: who asks, for error messages (default ``"read_memory_info"``).

    Returns:
        A :class:`MemoryInfo`; for the host, one with ``kind="host"`` and the CUDA-only flags
        ignored.

    Raises:
        InvalidDeviceError: ``device`` is not a CPU or CUDA device.
        DeviceError: a CUDA device is asked for but CUDA is not available, or it is not visible.
    """
    if device is None and not _runtime.is_cuda_available():
        return _host_memory_info()
    target = resolve_device(device, owner=owner)
    if target.type == "cpu":
        return _host_memory_info()
    return _cuda_memory_info(int(target.index), allocator=allocator, name=name, limit=limit,
                             largest_block=largest_block, other_processes=other_processes)


def _host_memory_info() -> MemoryInfo:
    try:
        import psutil
    except ImportError:
        return MemoryInfo("cpu", None, None, None, kind="host")
    memory = psutil.virtual_memory()
    return MemoryInfo("cpu", int(memory.total), int(memory.available), kind="host")


def _cuda_memory_info(index: int, *, allocator: bool, name: bool, limit: bool,
                      largest_block: bool, other_processes: bool) -> MemoryInfo:
    import torch

    free, total = torch.cuda.mem_get_info(index)
    fields: dict[str, Any] = {}
    if allocator:
        # One call for the four figures (torch.cuda.memory_allocated and friends each build the
        # whole dict again).
        stats = torch.cuda.memory_stats(index)
        fields.update({field: int(stats.get(key, 0)) for field, key in _ALLOCATOR_KEYS.items()})
    if name:
        fields["name"] = str(torch.cuda.get_device_name(index))
    if limit:
        fields["limit"] = _memory_limit(index, int(total))
    if largest_block:
        fields["largest_cached_block"] = _largest_cached_block(index)
    if other_processes:
        fields["other_processes"] = _other_processes_memory(index)
    return MemoryInfo(device=f"cuda:{index}", total=int(total), free=int(free), kind="cuda",
                      **fields)


def _memory_limit(index: int, total: int) -> int | None:
    import torch

    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is None:
        return None
    fraction = float(get_fraction(index))
    return int(fraction * total) if fraction < 1.0 else None


def _largest_cached_block(index: int) -> int | None:
    import torch

    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:  # allocator backends without snapshots (cudaMallocAsync)
        return None
    largest = 0
    for segment in segments:
        if segment.get("device") != index:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
    return largest


def _other_processes_memory(index: int) -> int | None:
    import torch

    from vramkit.devices.nvml import query_nvml

    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        snapshot = query_nvml(include_processes=True)
    except Exception as err:  # NVML trouble must not mask the OOM being diagnosed
        logger.debug("NVML unavailable for the memory reading: %s", err)
        return None
    device = snapshot.by_uuid(uuid) if snapshot.available else None
    if device is None or not device.processes:
        return None
    pid = os.getpid()
    if all(p.pid != pid for p in device.processes):
        return None  # another PID namespace: we cannot tell our own entry from the others
    sizes = [p.used_memory for p in device.processes if p.pid != pid]
    if any(s is None for s in sizes):
        return None
    return int(sum(s for s in sizes if s is not None))
