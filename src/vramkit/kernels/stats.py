"""Measured statistics: device memory (free, total) and process-wide transfer/kernel counters.

Unlike the seed projects (where ``memory_stats`` returned constants and ``performance_stats``
was empty), every figure here is measured:

* :func:`memory_stats` asks the device (``cudaMemGetInfo`` through torch) or, for the CPU, the
  operating system (``psutil``).
* :class:`PerformanceStats` counts what vramkit itself does, per CUDA device: kernel launches by
  :class:`~vramkit.kernels.manager.KernelManager` (always), their GPU time (opt-in: CUDA events
  recorded around each launch and read only when the statistics are read, never a host sync per
  launch), and bytes copied host->device / device->host by vramkit's transfer paths, which call
  :func:`record_transfer` for each copy they enqueue.

Counters are plain int additions under the GIL: cheap enough for every swap copy. They are
best-effort statistics: two threads adding to the same device's counter in the same bytecode window
(say, the main thread and autograd's device thread during a backward) could lose one addition, so a
figure can be slightly low, never affect results.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from vramkit._validate import check_choice, check_device, check_int

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "MemoryAvailability",
    "PerformanceSnapshot",
    "PerformanceStats",
    "TimingEvent",
    "memory_stats",
    "performance_stats",
    "record_transfer",
]

Direction = Literal["h2d", "d2h"]
_DIRECTIONS = ("h2d", "d2h")
# Completed timing events are folded into the totals once this many are pending, by querying
# them (no sync), so a long run with timing on does not accumulate events without bound.
_FOLD_PENDING_AT = 1024


class MemoryAvailability(NamedTuple):
    """Free and total bytes of one device (a tuple: ``free, total = memory_stats(dev)``)."""

    free: int
    total: int

    @property
    def used(self) -> int:
        """``total - free`` bytes."""
        return self.total - self.free


def memory_stats(device: torch.device | str | int | None = None) -> MemoryAvailability:
    """Free and total memory of a device, measured now (BitNet ``memory_stats``).

    Args:
        device: a CUDA device (``"cuda:0"``, an ordinal, a ``torch.device``) or ``"cpu"``.
            Default ``None``: torch's current CUDA device when CUDA is available, else the CPU.

    Returns:
        ``(free, total)`` bytes of :func:`vramkit.devices.memory_info.read_memory_info`. For
        CUDA: ``torch.cuda.mem_get_info`` (the driver's view, which counts every process and
        PyTorch's cached-but-unused blocks as used; this creates the device's CUDA context if it
        does not exist yet). For the CPU: ``psutil``'s *available* host memory (what can be
        allocated without swapping) and total RAM.

    Raises:
        InvalidDeviceError: (a ``DeviceError``) ``device`` is neither a CUDA device nor the CPU.
        DeviceError: a CUDA device is asked for but CUDA is not available, or it is not visible.
    """
    from vramkit.devices.memory_info import read_memory_info

    info = read_memory_info(device, allocator=False, name=False, owner="memory_stats")
    return MemoryAvailability(free=int(info.free), total=int(info.total))  # type: ignore[arg-type]


class TimingEvent(Protocol):
    """What the statistics need of a CUDA event (``torch.cuda.Event(enable_timing=True)``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


@dataclass(frozen=True)
class PerformanceSnapshot:
    """A copy of the counters of one device (or of all devices when ``device`` is ``None``).

    Args:
        device: the CUDA ordinal, or ``None`` for the sum over devices.
        kernel_launches: kernels launched through :class:`KernelManager`.
        timed_launches: launches whose GPU time is included in ``kernel_time_ms``.
        pending_timings: timed launches whose events had not completed (read with
            ``wait=False``); they are counted once they complete.
        kernel_time_ms: GPU time of the timed launches, from CUDA events.
        bytes_h2d: bytes copied host->device by vramkit's transfer paths.
        bytes_d2h: bytes copied device->host by vramkit's transfer paths.
        transfers_h2d: number of host->device copies.
        transfers_d2h: number of device->host copies.
    """

    device: int | None
    kernel_launches: int
    timed_launches: int
    pending_timings: int
    kernel_time_ms: float
    bytes_h2d: int
    bytes_d2h: int
    transfers_h2d: int
    transfers_d2h: int

    @property
    def mean_kernel_time_ms(self) -> float | None:
        """Mean GPU time per timed launch, ``None`` before any timed launch completed."""
        return self.kernel_time_ms / self.timed_launches if self.timed_launches else None

    def to_dict(self) -> dict[str, Any]:
        """The snapshot as a JSON-serializable dict (with ``mean_kernel_time_ms``)."""
        data = asdict(self)
        data["mean_kernel_time_ms"] = self.mean_kernel_time_ms
        return data


class _DeviceCounters:
    __slots__ = ("bytes_d2h", "bytes_h2d", "kernel_launches", "kernel_time_ms", "pending",
                 "timed_launches", "transfers_d2h", "transfers_h2d")

    def __init__(self) -> None:
        self.kernel_launches = 0
        self.timed_launches = 0
        self.kernel_time_ms = 0.0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.transfers_h2d = 0
        self.transfers_d2h = 0
        self.pending: list[tuple[TimingEvent, TimingEvent]] = []

    def fold(self, wait: bool) -> None:
        """Add the GPU time of completed (or, with ``wait``, all) pending launches."""
        still_pending: list[tuple[TimingEvent, TimingEvent]] = []
        for start, end in self.pending:
            if wait:
                end.synchronize()
            elif not end.query():
                still_pending.append((start, end))
                continue
            self.kernel_time_ms += float(start.elapsed_time(end))
            self.timed_launches += 1
        self.pending = still_pending


def _device_key(device: torch.device | str | int | None) -> int:
    """The CUDA ordinal a counter belongs to (``None``: torch's current CUDA device).

    Checks the form only: counters may be kept for a device this process has not checked.
    """
    from vramkit.devices._runtime import current_cuda_ordinal

    if device is None:
        return current_cuda_ordinal()
    if type(device) is int and device >= 0:
        return device
    torch_device = check_device("statistics device", device, types=("cuda",))
    return current_cuda_ordinal() if torch_device.index is None else int(torch_device.index)


class PerformanceStats:
    """Process-wide counters of kernel launches, kernel GPU time and host<->device bytes.

    One instance per process (:func:`performance_stats`); counters are kept per CUDA device.
    Kernel GPU time is collected only while timing is enabled (:meth:`enable_timing`): each
    launch then records two CUDA events on its stream, read when :meth:`snapshot` is called.
    """

    def __init__(self) -> None:
        self._devices: dict[int, _DeviceCounters] = {}
        self._timing = False
        # Guards creating a device's counters and reset/snapshot, not the hot-path additions.
        self._lock = threading.Lock()

    def _counters(self, index: int) -> _DeviceCounters:
        counters = self._devices.get(index)
        if counters is None:
            with self._lock:
                counters = self._devices.setdefault(index, _DeviceCounters())
        return counters

    @property
    def timing_enabled(self) -> bool:
        """Whether launches record CUDA events for their GPU time (default ``False``)."""
        return self._timing

    def enable_timing(self, enabled: bool = True) -> None:
        """Turn GPU timing of kernel launches on or off.

        Args:
            enabled: ``True`` (default) to record CUDA events around each launch from now on.
        """
        self._timing = bool(enabled)

    def record_transfer(self, direction: Direction, nbytes: int,
                        device: torch.device | str | int | None = None) -> None:
        """Count one host<->device copy (see the module function :func:`record_transfer`)."""
        index = device if type(device) is int else _device_key(device)
        counters = self._devices.get(index) or self._counters(index)  # type: ignore[arg-type]
        if nbytes < 0:  # checked in full only then: this runs for every swap copy
            check_int("record_transfer nbytes", nbytes, minimum=0)
        if direction == "h2d":
            counters.bytes_h2d += nbytes
            counters.transfers_h2d += 1
        elif direction == "d2h":
            counters.bytes_d2h += nbytes
            counters.transfers_d2h += 1
        else:
            check_choice("record_transfer direction", direction, _DIRECTIONS)

    def record_launch(self, device: int,
                      events: tuple[TimingEvent, TimingEvent] | None = None) -> None:
        """Count one kernel launch on ``device``, with its (start, end) events when timed.

        Args:
            device: the CUDA ordinal.
            events: CUDA events recorded before and after the launch on its stream (default
                ``None``: the launch is counted, not timed).
        """
        counters = self._devices.get(device) or self._counters(device)
        counters.kernel_launches += 1
        if events is not None:
            counters.pending.append(events)
            if len(counters.pending) >= _FOLD_PENDING_AT:
                counters.fold(wait=False)

    def snapshot(self, device: torch.device | str | int | None = None, *,
                 all_devices: bool = False, wait: bool = True) -> PerformanceSnapshot:
        """A copy of the counters.

        Args:
            device: the CUDA device (default ``None``: torch's current device).
            all_devices: sum over every device instead (default ``False``); ``device`` is then
                ignored and the snapshot's ``device`` is ``None``.
            wait: wait for pending timing events to complete so ``kernel_time_ms`` covers every
                timed launch (default ``True``; this waits for the GPU, so read statistics
                outside the hot loop). ``False`` counts only launches that already completed.

        Returns:
            A :class:`PerformanceSnapshot`.
        """
        with self._lock:
            if all_devices:
                selected = list(self._devices.items())
            else:
                index = _device_key(device)
                selected = [(index, self._devices.get(index, _DeviceCounters()))]
            totals = dict.fromkeys(("kernel_launches", "timed_launches", "pending_timings",
                                    "bytes_h2d", "bytes_d2h", "transfers_h2d",
                                    "transfers_d2h"), 0)
            time_ms = 0.0
            for _, counters in selected:
                counters.fold(wait)
                for name in totals:
                    if name == "pending_timings":
                        totals[name] += len(counters.pending)
                    else:
                        totals[name] += getattr(counters, name)
                time_ms += counters.kernel_time_ms
        return PerformanceSnapshot(
            device=None if all_devices else selected[0][0], kernel_time_ms=time_ms, **totals)

    def reset(self, device: torch.device | str | int | None = None, *,
              all_devices: bool = True) -> None:
        """Zero the counters (pending timing events are dropped).

        Args:
            device: the CUDA device to reset when ``all_devices`` is ``False``.
            all_devices: reset every device (default ``True``).
        """
        with self._lock:
            if all_devices:
                self._devices.clear()
            else:
                self._devices.pop(_device_key(device), None)


_PROCESS_STATS = PerformanceStats()


def performance_stats() -> PerformanceStats:
    """The process-wide :class:`PerformanceStats` (BitNet ``performance_stats``).

    Returns:
        The single collector of this process; call ``.snapshot()`` to read it and
        ``.reset()`` to zero it.
    """
    return _PROCESS_STATS


def record_transfer(direction: Direction, nbytes: int,
                    device: torch.device | str | int | None = None) -> None:
    """Count one host<->device copy enqueued by a vramkit transfer path.

    Cheap (a dict lookup and two int additions for an int ``device``): meant to be called for
    every swap/offload/loader copy.

    Args:
        direction: ``"h2d"`` (host to device) or ``"d2h"`` (device to host).
        nbytes: bytes copied (>= 0).
        device: the CUDA device at the device end (default ``None``: torch's current device;
            an int ordinal is the fastest form).

    Raises:
        ConfigError: ``direction`` is not ``"h2d"``/``"d2h"``, ``nbytes < 0`` or ``device`` is
            not a CUDA device.
    """
    _PROCESS_STATS.record_transfer(direction, nbytes, device)
