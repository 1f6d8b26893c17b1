"""The strip runner of exact tiling: full-size planes, strips moved between them, run statistics.

Planes (one sample's full-size intermediates) are stored ``(H, W, C)`` contiguous, so a
full-width strip is one contiguous range: on the device while they fit the budget, otherwise in
pinned host memory (reused across runs). Uploads and downloads run on two copy streams (both
PCIe directions at once), ordered by CUDA events; the upload of a strip is enqueued before the
compute stream needs it (prefetch), its output is downloaded while the next strip computes, and
the CPU is kept at most ``_MAX_STRIPS_AHEAD`` strips ahead of the GPU so strip buffers stay
bounded. :class:`ExactRunStats` records the bytes moved per step and, on CUDA, how long the
compute stream waited for uploads.

What runs on the strips (the program of conv and attention steps) is
:mod:`vramkit.tiling._program`.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ExactRunStats", "Plane", "StepRecord", "StripRunner", "release_host_buffers"]


# --------------------------------------------------------------------------------------------
# Run statistics
# --------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one step of an exact run did (one entry of :attr:`ExactRunStats.step_records`).

    Args:
        name: the layer, e.g. ``"up_blocks.3.resnets.0.conv2"``.
        out_shape: ``(C, H, W)`` of the step's output plane.
        out_on_host: whether that plane lives in pinned host memory.
        strips: strips computed (an attention step counts its key/value and query passes).
        h2d_bytes: bytes this step uploaded (strips read from host planes).
        d2h_bytes: bytes this step downloaded (strips written to a host plane).
    """

    name: str
    out_shape: tuple[int, int, int]
    out_on_host: bool = False
    strips: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


@dataclass
class ExactRunStats:
    """What one exact run did (reported by ``VAETiling.last_exact_stats``).

    ``steps``, ``strips``, ``h2d_bytes`` and ``d2h_bytes`` are the sums over ``step_records``.

    Args:
        steps: steps run (convolutions, attention blocks).
        strips: strips computed, over all steps.
        device_plane_bytes_peak: peak bytes of intermediates (planes and the attention's keys
            and values) held on the compute device.
        host_plane_bytes_peak: peak bytes of planes held in pinned host memory.
        attention_kv_bytes: bytes of the largest attention step's keys + values (on the device).
        h2d_bytes: bytes copied host -> device.
        d2h_bytes: bytes copied device -> host.
        host_bytes_newly_pinned: pinned host bytes this run had to allocate (0 once a previous
            run of the same shapes left its buffers in the cache).
        seam_rows: strip boundaries of every step, in pixels of the image.
        step_records: one :class:`StepRecord` per step, in order.
    """

    steps: int = 0
    strips: int = 0
    device_plane_bytes_peak: int = 0
    host_plane_bytes_peak: int = 0
    attention_kv_bytes: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    host_bytes_newly_pinned: int = 0
    seam_rows: list[int] = field(default_factory=list)
    step_records: list[StepRecord] = field(default_factory=list)
    _step_events: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    _wait_events: list[tuple[Any, Any]] = field(default_factory=list, repr=False)

    def timings(self) -> dict[str, Any] | None:
        """Where the compute stream's time went (CUDA runs only; ``None`` on the CPU).

        Waits for the run to finish (a host synchronisation: call it after the run, not in a
        loop).

        Returns:
            ``{"steps_ms": total, "copy_wait_ms": time the compute stream stalled waiting for
            uploads, "step_ms": [per step]}``.
        """
        if not self._step_events:
            return None
        self._step_events[-1][1].synchronize()
        step_ms = [start.elapsed_time(end) for start, end in self._step_events]
        wait_ms = sum(start.elapsed_time(end) for start, end in self._wait_events)
        return {"steps_ms": sum(step_ms), "copy_wait_ms": wait_ms, "step_ms": step_ms}


# --------------------------------------------------------------------------------------------
# Pinned host buffers, reused across runs
# --------------------------------------------------------------------------------------------

# Pinned buffers not in use, reused best-fit. Kept across runs on purpose: pinning gigabytes
# (cudaHostRegister) costs ~1 s per 5 GB, far more than a decode's copies, and the pool's own
# free path cannot help here: it only reuses a block once an event recorded at free time has
# completed, which is never the case while the CPU runs ahead of the GPU, so every run grew it.
_HOST_FREE: list[torch.Tensor] = []
_HOST_LOCK = threading.Lock()
_PINNED_POOL: Any = None


def _pinned_pool() -> Any:
    global _PINNED_POOL
    if _PINNED_POOL is None:
        from vramkit.memory.pool import MemoryPool, PoolConfig
        _PINNED_POOL = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    return _PINNED_POOL


def _take_host_buffer(nbytes: int, pinned: bool) -> tuple[torch.Tensor, int]:
    """A ``uint8`` host buffer of at least ``nbytes`` and the bytes newly allocated for it."""
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8), nbytes
    with _HOST_LOCK:
        fits = [i for i, buf in enumerate(_HOST_FREE) if buf.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda i: _HOST_FREE[i].numel())
            return _HOST_FREE.pop(best), 0
    return _pinned_pool().tensor((nbytes,), torch.uint8), nbytes


def _return_host_buffer(buffer: torch.Tensor, pinned: bool) -> None:
    if pinned:
        with _HOST_LOCK:
            _HOST_FREE.append(buffer)


def release_host_buffers() -> int:
    """Give the pinned host buffers that exact runs keep for reuse back to the pinned pool.

    Call it between runs (never during one) to return the host memory.

    Returns:
        The number of bytes released.
    """
    with _HOST_LOCK:
        released = sum(buf.numel() for buf in _HOST_FREE)
        _HOST_FREE.clear()
    if _PINNED_POOL is not None:
        _PINNED_POOL.trim()
    return released


# --------------------------------------------------------------------------------------------
# Planes: full-size intermediates on the device or in pinned host memory
# --------------------------------------------------------------------------------------------


class Plane:
    """One full-size ``(C, H, W)`` intermediate of one sample, stored ``(H, W, C)``."""

    def __init__(self, data: torch.Tensor, on_host: bool, runner: StripRunner,
                 buffer: torch.Tensor | None = None, counted: bool = False) -> None:
        self.data = data  # (H, W, C) or a strided (H, W, C) view of an NCHW tensor
        self.on_host = on_host
        self.runner = runner
        self.buffer = buffer  # the host buffer behind ``data`` (returned on release)
        self.counted = counted  # a device plane counted against the budget
        self.height, self.width, self.channels = data.shape
        self.nbytes = data.numel() * data.element_size()

    def read(self, y0: int, y1: int) -> torch.Tensor:
        """Rows ``[y0, y1)`` as a ``(1, C, rows, W)`` (channels-last) tensor on the device."""
        rows = self.data[y0:y1]
        runner = self.runner
        if self.on_host:
            runner.count_copy(rows.numel() * rows.element_size(), upload=True)
            if runner.cuda:
                # Enqueued on the upload stream as soon as the CPU gets here, up to
                # _MAX_STRIPS_AHEAD strips before the compute stream needs it (prefetch).
                with torch.cuda.stream(runner.h2d_stream):
                    rows = rows.to(runner.device, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(runner.h2d_stream)
                runner.wait_upload(ready)
                rows.record_stream(runner.compute_stream)  # allocated on the copy stream
            else:
                rows = rows.to(runner.device)
        return rows.permute(2, 0, 1).unsqueeze(0)

    def write(self, y0: int, strip: torch.Tensor) -> None:
        """Store a ``(1, C, rows, W)`` strip at rows ``[y0, y0 + rows)``."""
        rows = strip[0].permute(1, 2, 0)
        dest = self.data[y0:y0 + rows.shape[0]]
        runner = self.runner
        if self.on_host:
            runner.count_copy(rows.numel() * rows.element_size(), upload=False)
        if self.on_host and runner.cuda:
            done = torch.cuda.Event()
            done.record(runner.compute_stream)
            runner.d2h_stream.wait_event(done)
            with torch.cuda.stream(runner.d2h_stream):
                dest.copy_(rows, non_blocking=True)
            rows.record_stream(runner.d2h_stream)
        else:
            dest.copy_(rows)

    def full(self) -> torch.Tensor:
        """The whole plane as a ``(1, C, H, W)`` tensor on the compute device."""
        return self.read(0, self.height)


# The CPU may enqueue at most this many strips before the GPU finishes them. Enough to keep the
# copy streams a strip or two ahead of the compute stream; a bound because the caching allocator
# can only reuse a strip's buffers once the GPU is done with them, so an unbounded lead (a few
# hundred microseconds of Python per strip against milliseconds of GPU work) would hold one set
# of strip buffers per strip enqueued and break the device budget.
_MAX_STRIPS_AHEAD = 3


class StripRunner:
    """Allocates planes (device while under budget, else pinned host), moves strips, keeps the
    run's statistics. Two copy streams (upload, download) so both PCIe directions run at once."""

    def __init__(self, device: torch.device, dtype: torch.dtype, storage: str,
                 device_budget: int | None, strip_elements: int) -> None:
        self.device = device
        self.dtype = dtype
        self.storage = storage
        self.strip_elements = strip_elements
        self.stats = ExactRunStats()
        self.device_live = 0
        self.host_live = 0
        self.record: StepRecord | None = None
        self.cuda = device.type == "cuda"
        self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        self._step_start: Any = None
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            # Host buffers come from earlier runs: their copies (ordered before the compute
            # stream by finish()) must be done before this run's copies touch them.
            self.h2d_stream.wait_stream(self.compute_stream)
            self.d2h_stream.wait_stream(self.compute_stream)
        if device_budget is None:
            if self.cuda:
                free, _total = torch.cuda.mem_get_info(device)
                device_budget = free // 2  # the other half is for strips, weights, the caller
            else:
                device_budget = 1 << 62  # "device" memory is host memory here
        self.device_budget = device_budget

    # -- memory ------------------------------------------------------------------------------

    def new_plane(self, channels: int, height: int, width: int) -> Plane:
        nbytes = channels * height * width * self.dtype.itemsize
        on_host = self.storage == "host" or (
            self.storage == "auto" and self.device_live + nbytes > self.device_budget)
        if not on_host:
            data = torch.empty((height, width, channels), dtype=self.dtype, device=self.device)
            self._device_delta(nbytes)
            return Plane(data, False, self, counted=True)
        buffer, new = _take_host_buffer(nbytes, pinned=self.cuda)
        self.stats.host_bytes_newly_pinned += new if self.cuda else 0
        data = buffer[:nbytes].view(self.dtype).view(height, width, channels)
        self.host_live += nbytes
        self.stats.host_plane_bytes_peak = max(self.stats.host_plane_bytes_peak, self.host_live)
        return Plane(data, True, self, buffer)

    def device_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A device tensor counted as an intermediate (attention keys/values): it always lives
        on the device, and planes created while it is alive see that much less budget."""
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._device_delta(tensor.numel() * tensor.element_size())
        return tensor

    def free_device(self, tensor: torch.Tensor) -> None:
        self._device_delta(-tensor.numel() * tensor.element_size())

    def _device_delta(self, nbytes: int) -> None:
        self.device_live += nbytes
        self.stats.device_plane_bytes_peak = max(self.stats.device_plane_bytes_peak,
                                                 self.device_live)

    def release(self, plane: Plane) -> None:
        """Forget a plane. Device memory returns to the caching allocator (stream-ordered). A
        host buffer is reusable at once: it is released after the last step reading it has
        ended, and :meth:`end_step` ordered every later download (the only writes) after
        every upload enqueued so far."""
        if plane.on_host:
            self.host_live -= plane.nbytes
            if plane.buffer is not None:
                _return_host_buffer(plane.buffer, pinned=self.cuda)
        elif plane.counted:
            self._device_delta(-plane.nbytes)
        plane.data = plane.buffer = None  # type: ignore[assignment]

    # -- copies, strips and steps -----------------------------------------------------------

    def count_copy(self, nbytes: int, upload: bool) -> None:
        if upload:
            self.stats.h2d_bytes += nbytes
        else:
            self.stats.d2h_bytes += nbytes
        if self.record is not None:
            if upload:
                self.record.h2d_bytes += nbytes
            else:
                self.record.d2h_bytes += nbytes

    def wait_upload(self, ready: Any) -> None:
        """Make the compute stream wait for an upload, timing the stall with two events."""
        before = torch.cuda.Event(enable_timing=True)
        before.record(self.compute_stream)
        self.compute_stream.wait_event(ready)
        after = torch.cuda.Event(enable_timing=True)
        after.record(self.compute_stream)
        self.stats._wait_events.append((before, after))

    def begin_step(self, name: str, out: Plane | None, shape: tuple[int, int, int]) -> None:
        self.record = StepRecord(name, shape, out_on_host=bool(out is not None and out.on_host))
        self.stats.step_records.append(self.record)
        self.stats.steps += 1
        if self.cuda:
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record(self.compute_stream)

    def end_strip(self) -> None:
        """Count a strip and bound how far the CPU runs ahead of the GPU (see
        ``_MAX_STRIPS_AHEAD``): waits, on the host, for the strip that many strips back."""
        self.stats.strips += 1
        if self.record is not None:
            self.record.strips += 1
        if not self.cuda:
            return
        computed, downloaded = torch.cuda.Event(), torch.cuda.Event()
        computed.record(self.compute_stream)
        downloaded.record(self.d2h_stream)
        self._in_flight.append((computed, downloaded))
        if len(self._in_flight) > _MAX_STRIPS_AHEAD:
            for event in self._in_flight.popleft():
                event.synchronize()

    def end_step(self) -> None:
        """Order the copy streams after each other: every later upload sees this step's
        downloads, and a reused host buffer is only overwritten (on the download stream)
        after every upload from it."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.compute_stream)
            self.stats._step_events.append((self._step_start, end))
            self.h2d_stream.wait_stream(self.d2h_stream)
            self.d2h_stream.wait_stream(self.h2d_stream)
        self.record = None

    def finish(self) -> None:
        """Make the compute stream wait for every copy (no host synchronisation)."""
        if self.cuda:
            self.compute_stream.wait_stream(self.h2d_stream)
            self.compute_stream.wait_stream(self.d2h_stream)
        self._in_flight.clear()

    def strip_rows(self, width: int, channels: int) -> int:
        return max(1, self.strip_elements // max(1, width * channels))
