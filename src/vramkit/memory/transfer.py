"""Copy streams and events for offloading, with a host stand-in that records what it was asked.

Every offloader (the block swapper, activation offload, the CPU-offloaded optimizer) moves bytes
through :func:`transfer_streams` for its device, so they share one host->device and one
device->host stream per GPU: their copies queue behind each other instead of competing for the
PCIe link, which is the copy budget they share.

On a CPU device the same interface runs synchronously (copies happen at once, events are always
complete) and can keep a log of every record/wait/copy, which is how the event and slot ordering
is unit-tested without a GPU.

Host memory need not be page-locked: a pinned pool whose segment could not be pinned hands out
pageable memory (``PoolConfig.pin_fallback``), and :meth:`CudaStreams.copy` stays correct with it
without a per-copy check. PyTorch turns a non-blocking host<->device ``copy_`` into one
``cudaMemcpyAsync`` on the copy stream whatever the host memory is. From pageable memory the
driver stages the bytes through its own pinned bounce buffers (fixed in size: nothing is
allocated per copy) and returns once the source has been read, so the source may be reused at
once; into pageable memory it returns once the copy has landed (CUDA's "API synchronization
behavior"; on systems where the GPU reads pageable memory directly, HMM/ATS, the copy may stay
asynchronous). Either way a pageable copy is never *more* asynchronous than a pinned one, so the
event ordering every caller already needs for pinned memory (record after the copy, wait or
query before the host reads the destination or reuses the source) covers it. The price is
speed: the staged copy blocks the calling thread and runs at a fraction of pinned bandwidth
(``benchmarks/pinning_fallback.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vramkit._validate import check_device
from vramkit.devices._runtime import current_cuda_ordinal
from vramkit.devices.resolve import resolve_device
from vramkit.kernels.stats import record_transfer

__all__ = ["CudaStreams", "HostStreams", "StreamOp", "Streams", "resolve_offload_device",
           "transfer_streams"]


@dataclass
class StreamOp:
    """One logged operation of :class:`HostStreams`: ``kind`` is record/wait/copy/sync."""

    kind: str
    stream: str
    event: int | None = None
    what: str = ""


class Streams:
    """The interface both backends implement (CUDA streams, or a synchronous host stand-in)."""

    device: torch.device
    h2d: Any
    d2h: Any

    def current(self) -> Any:
        raise NotImplementedError

    def event(self) -> Any:
        raise NotImplementedError

    def record(self, event: Any, stream: Any) -> None:
        raise NotImplementedError

    def wait(self, stream: Any, event: Any) -> None:
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, what: str = "") -> None:
        raise NotImplementedError

    def done(self, event: Any) -> bool:
        raise NotImplementedError

    def synchronize(self, event: Any) -> None:
        raise NotImplementedError

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError


class CudaStreams(Streams):
    """Dedicated host->device and device->host streams on one CUDA device.

    The swapper calls :meth:`current`, :meth:`record`, :meth:`wait` and :meth:`copy` a few times
    per block and step, and where a model is host-bound every microsecond of them shows in the
    step time. So they skip ``torch.cuda``'s Python wrappers where PyTorch exposes the C entry
    points (``torch._C._cuda_getCurrentRawStream``/``_cuda_setStream``, the event base class):
    the current stream object is reused while its handle is unchanged, and a copy sets the
    copy stream of this device only (no device switch: a host<->device copy runs on the
    current stream of its CUDA end, whatever the current device). Each falls back to the public
    API when PyTorch lacks the entry point.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(device):
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        c = torch._C
        self._raw_stream = getattr(c, "_cuda_getCurrentRawStream", None)
        self._get_stream = getattr(c, "_cuda_getCurrentStream", None)
        self._set_stream = getattr(c, "_cuda_setStream", None)
        base = getattr(c, "_CudaEventBase", None)
        self._record = getattr(base, "record", None)
        self._wait = getattr(base, "wait", None)
        self._current_raw: int | None = None
        self._current: Any = None

    def current(self) -> Any:
        if self._raw_stream is not None:
            raw = self._raw_stream(self._index)
            if raw != self._current_raw:
                self._current = torch.cuda.current_stream(self.device)
                self._current_raw = raw
            return self._current
        return torch.cuda.current_stream(self.device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        if self._record is not None and type(event) is torch.cuda.Event:
            self._record(event, stream)
        else:
            event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        if self._wait is not None and type(event) is torch.cuda.Event:
            self._wait(event, stream)
        else:
            stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, what: str = "") -> None:
        if (self._set_stream is not None and self._get_stream is not None
                and stream.device_index == self._index):
            previous = self._get_stream(self._index)  # (stream_id, device_index, device_type)
            self._set_stream(stream_id=stream.stream_id, device_index=self._index,
                             device_type=stream.device_type)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                self._set_stream(stream_id=previous[0], device_index=previous[1],
                                 device_type=previous[2])
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        if dst.is_cuda != src.is_cuda:  # counted in vramkit.kernels.performance_stats()
            record_transfer("h2d" if dst.is_cuda else "d2h", dst.numel() * dst.element_size(),
                            self._index)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


@dataclass(eq=False)
class _HostStream:
    name: str


@dataclass(eq=False)
class _HostEvent:
    id: int
    recorded: int = 0  # how many times it was recorded


@dataclass
class HostStreams(Streams):
    """Synchronous stand-in on the CPU: copies run at once, events are complete when recorded.

    Args:
        device: a CPU device.
        log: when a list, every operation is appended to it as a :class:`StreamOp`.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    log: list[StreamOp] | None = None

    def __post_init__(self) -> None:
        self.h2d = _HostStream("h2d")
        self.d2h = _HostStream("d2h")
        self._compute = _HostStream("compute")
        self._stack: list[_HostStream] = []
        self._ids = 0

    def current(self) -> Any:
        return self._stack[-1] if self._stack else self._compute

    def event(self) -> Any:
        self._ids += 1
        return _HostEvent(self._ids)

    def record(self, event: Any, stream: Any) -> None:
        event.recorded += 1
        self._log("record", stream, event)

    def wait(self, stream: Any, event: Any) -> None:
        self._log("wait", stream, event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, what: str = "") -> None:
        self._log("copy", stream, None, what)
        dst.copy_(src)

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        self._log("sync", self.current(), event)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[Any]:
        self._stack.append(stream)
        try:
            yield stream
        finally:
            self._stack.pop()

    def _log(self, kind: str, stream: Any, event: Any, what: str = "") -> None:
        if self.log is not None:
            self.log.append(StreamOp(kind, stream.name, event.id if event is not None else None,
                                     what))


_SHARED: dict[torch.device, Streams] = {}
_SHARED_LOCK = threading.Lock()


def transfer_streams(device: torch.device | str) -> Streams:
    """The process-wide copy streams of ``device`` (created on first use).

    Args:
        device: a CUDA device (``cuda:N``; plain ``cuda`` means the current device) or ``cpu``.

    Returns:
        :class:`CudaStreams` for a CUDA device, :class:`HostStreams` for the CPU.

    Raises:
        InvalidDeviceError: (a ``ValueError``) for another device type.
    """
    if type(device) is torch.device:  # the hot path: a tensor's device, seen before
        streams = _SHARED.get(device)
        if streams is not None:
            return streams
    device = check_device("transfer_streams", device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", current_cuda_ordinal())
    with _SHARED_LOCK:
        streams = _SHARED.get(device)
        if streams is None:
            streams = CudaStreams(device) if device.type == "cuda" else HostStreams(device)
            _SHARED[device] = streams
        return streams


def resolve_offload_device(device: str | int | torch.device | None, owner: str) -> torch.device:
    """The device an offloader computes on, checked once for all offloaders.

    Args:
        device: ``"cuda"``, ``"cuda:N"``, an int, a ``torch.device``, ``"cpu"``, or ``None``
            (the current CUDA device).
        owner: the offloader's name, for messages.

    Returns:
        ``cpu`` or ``cuda:N`` with an explicit index
        (:func:`vramkit.devices.resolve.resolve_device`).

    Raises:
        InvalidDeviceError: (a ``ConfigError``) for a value that is not a device, or a device
            type other than cuda/cpu.
        DeviceError: when CUDA is not available or the index is out of range.
    """
    return resolve_device(device, owner=owner)
