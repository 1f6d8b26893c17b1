"""The memory profiler: a background sampler, phase marks, per-module attribution, leak detection.

:class:`MemoryProfiler` runs a daemon thread that reads, every ``sample_interval`` seconds:

- the CUDA caching allocator (allocated, reserved, active bytes and the allocator's own peak
  watermark) with one ``memory_stats`` call, which is host-side bookkeeping (no sync);
- NVML's figure for this process (memory held outside PyTorch shows here). NVML is slower (a
  few milliseconds per query), so it is read every ``nvml_interval`` seconds (default 0.5 s) and
  the samples in between carry the last value;
- bytes reserved by live pinned host pools (:func:`vramkit.memory.pool.live_pools`), read on
  the NVML cadence (``nvml_interval``) too, with the samples in between carrying the last value;
- the host resident set size (psutil).

On a CPU-only machine ``allocated``/``reserved``/``active`` are 0 (PyTorch exposes no CPU
allocator statistics) and ``host_rss`` carries the signal: the report's ``metric`` is then
``"host_rss"``.

Peaks between samples are not lost on CUDA: every reading also takes the allocator's peak
watermark, and when it rose since the previous reading the peak is attributed to the step, phase
and module of that interval. ``reset_peak=True`` (default) resets the watermark at ``start()``
(``torch.cuda.reset_peak_memory_stats``) so it covers the profiled region only.

:meth:`MemoryProfiler.attach` adds forward (and full backward) hooks on every submodule; each
hook takes a reading, so the report can name the modules that keep the most activation memory and
the module in which the peak happened.

**Steps and workloads.** :meth:`MemoryProfiler.step` marks the end of a training step; with
``count_optimizer_steps=True`` the profiler counts steps itself from
``torch.optim.Optimizer.step`` (a global post hook, so ordinary training scripts need no change).
Leak verdicts judge the readings at step boundaries of *one workload*: steps taken inside
:meth:`MemoryProfiler.workload` (``with prof.workload("swapped"): ...``) are judged per workload,
so a second run that follows (or alternates with) the first is never taken for growth.

**Annotations.** :meth:`MemoryProfiler.event` records an instant of a named kind (block loads
of a swapper, data-loader waits...), drawn as a lane of ticks under the report's timeline;
:meth:`MemoryProfiler.set_budget` draws a budget line. A per-process CUDA cap
(``torch.cuda.set_per_process_memory_fraction``) seen while sampling is reported as
``memory_limit`` and drawn too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from vramkit._files import atomic_open, atomic_path
from vramkit._validate import check_bool, check_int, check_number, check_size
from vramkit.devices._runtime import cuda_initialized
from vramkit.errors import ConfigError, DeviceError
from vramkit.observe._module_attribution import ModuleAttribution
from vramkit.observe.leaks import (
    GrowthTracker,
    LeakDetector,
    LeakVerdict,
    acquire_memory_history,
    combine_verdicts,
    release_memory_history,
)
from vramkit.observe.report import (
    MemoryReport,
    MemorySnapshot,
    PeakPoint,
    PhasePeak,
    ProfileEvent,
    save_report,
)
from vramkit.observe.stats import (
    _KEYS,
    HostRssReader,
    MemoryStats,
    fragmentation_ratios,
    nvml_process_memory,
    read_cuda_figures,
    read_memory_stats,
    reserved_all_devices,
    reset_cuda_peak,
    resolve_cuda_index,
    with_memory_tracking,
)
from vramkit.units import format_size

__all__ = ["LeakDetector", "MemoryProfiler", "MemoryReport", "MemorySnapshot", "MemoryStats",
           "trace_unsupported_reason", "with_memory_tracking"]

logger = logging.getLogger(__name__)

_ZERO = (0, 0, 0, 0, 0)
_NVML_GIVE_UP_AFTER = 3  # consecutive None answers: NVML is not there, stop asking
_TRACE_HINT = ("Run on a machine with a CUDA GPU, in the process that allocates (for `vramkit "
               "profile`: a Python target, without --subprocess). Without the trace, the "
               "sampled timeline report (JSON, HTML, PNG) still works, on the CPU too.")


def trace_unsupported_reason(device: Any = None, pid: int | None = None) -> str | None:
    """Why an allocation trace (a memory_viz snapshot) cannot be recorded, or ``None`` if it can.

    PyTorch records allocation history only for its own CUDA caching allocator, in the process
    that allocates: there is none on the CPU, and another process cannot be traced from here.

    Args:
        device: the profiler's device (as for :class:`MemoryProfiler`).
        pid: the profiled process, ``None`` for this one.

    Raises:
        ConfigError: for a device value that is not a device.
    """
    if pid is not None and pid != os.getpid():
        return (f"an allocation trace records PyTorch's CUDA allocator of this process; it "
                f"cannot record process {pid} from outside")
    if resolve_cuda_index(device) is None:
        return ("an allocation trace (memory_viz snapshot) needs a CUDA device: PyTorch records "
                "allocation history only for its CUDA caching allocator, and this process has "
                f"none for device {'cuda' if device is None else device!s}")
    return None


def _cuda_memory_limit(index: int) -> int | None:
    """Bytes this process may reserve on ``index`` under a per-process fraction below 1, else
    ``None`` (no cap, or a PyTorch without the getter)."""
    import torch

    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is None:
        return None
    fraction = float(get_fraction(index))
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(index).total_memory)


class _Peak:
    """A running maximum with the context of the reading that set it."""

    __slots__ = ("module", "phase", "step", "t", "value")

    def __init__(self) -> None:
        self.value, self.t, self.step = 0, 0.0, 0
        self.phase: str | None = None
        self.module: str | None = None

    def offer(self, value: int, t: float, ctx: tuple[int, str | None, str | None]) -> bool:
        if value <= self.value:
            return False
        self.value, self.t = value, t
        self.step, self.phase, self.module = ctx
        return True

    def point(self) -> PeakPoint:
        return PeakPoint(self.value, self.t, self.step, self.phase, self.module)


class MemoryProfiler:
    """Sample memory in the background and attribute it to steps, phases and modules.

    Use as a context manager or with :meth:`start` / :meth:`stop`. :meth:`start` begins a fresh
    session (history and aggregates are cleared).

    Args:
        device: the CUDA device whose allocator is read (see
            :func:`vramkit.observe.stats.resolve_cuda_index`); ``"cpu"`` or a machine without CUDA
            reads host memory only. Default ``None``: the current CUDA device, else the CPU.
        sample_interval: seconds between background samples, > 0 (default 0.01).
        nvml_interval: seconds between NVML and pinned-pool readings, > 0 (default 0.5).
        max_history: snapshots kept (oldest dropped first; peaks, means and phase peaks are
            kept exactly regardless), >= 1 (default 1_000_000, about 150 MB at most).
        reset_peak: reset the CUDA allocator's peak watermark at ``start()`` so between-sample
            peaks of the profiled region are caught (default ``True``; turn off if your own code
            reads ``torch.cuda.max_memory_allocated`` across the region).
        trace: record PyTorch's allocation history with Python stacks from ``start()`` (CUDA
            only; see :meth:`save_trace`). Default ``False``.
        trace_max_entries: allocation events kept by the trace (default 100_000).
        detect_leaks: ``True`` to run a :class:`LeakDetector` on this device at every
            :meth:`step`, or a detector to use (a CUDA detector on the profiler's device is
            handed the profiler's reading instead of reading the allocator again). Default
            ``False``: the report's leak verdict then judges the step-boundary readings of
            ``metric`` (no suspects).
        pid: sample another process (host RSS of it and its children, NVML); torch figures are
            then 0. Default ``None``: this process.
        top_modules: modules listed in the report (default 10).
        count_optimizer_steps: count a step at every ``torch.optim.Optimizer.step`` while
            running (a global post hook, removed at :meth:`stop`), so scripts that never call
            :meth:`step` still get leak checks. Several optimizers stepping in one iteration
            count once: a step is counted when an optimizer steps and either none has stepped
            since the last count or this one already has (so the count follows the first
            optimizer of each iteration). Once :meth:`step` is called by hand, optimizer steps
            are no longer counted. Default ``False``.
        budget: a budget in bytes (or a size string) drawn as a line on the timeline; see
            :meth:`set_budget`. Default ``None``.

    Raises:
        ConfigError: for a bad interval or count.
        DeviceError: ``trace=True`` where no trace can be recorded (no CUDA device, or another
            process); :func:`trace_unsupported_reason` says so before anything starts.
    """

    def __init__(self, device: Any = None, sample_interval: float = 0.01, *,
                 nvml_interval: float = 0.5, max_history: int = 1_000_000,
                 reset_peak: bool = True, trace: bool = False,
                 trace_max_entries: int = 100_000,
                 detect_leaks: bool | LeakDetector = False, pid: int | None = None,
                 top_modules: int = 10, count_optimizer_steps: bool = False,
                 budget: int | str | None = None) -> None:
        self.sample_interval = check_number("sample_interval", sample_interval, minimum=0.0,
                                            low_open=True, hint="Give seconds, > 0.")
        self.nvml_interval = check_number("nvml_interval", nvml_interval, minimum=0.0,
                                          low_open=True, hint="Give seconds, > 0.")
        for name, value in (("max_history", max_history), ("top_modules", top_modules),
                            ("trace_max_entries", trace_max_entries)):
            check_int(name, value, minimum=1)
        check_int("pid", pid, minimum=1, allow_none=True)
        self.pid = pid
        self._external = pid is not None and pid != os.getpid()
        index = resolve_cuda_index(device)
        self.device = "cpu" if index is None else f"cuda:{index}"
        self._index = None if self._external else index
        self.metric = "host_rss" if self._index is None else "allocated"
        self._cuda_seen = False  # CUDA, once initialized, stays so: stop asking then
        self._rss_reader = HostRssReader(pid if self._external else None,
                                         include_children=self._external)
        if trace:
            reason = trace_unsupported_reason(device, pid)
            if reason is not None:
                raise DeviceError(f"trace=True: {reason}", _TRACE_HINT)
        self.count_optimizer_steps = check_bool("count_optimizer_steps", count_optimizer_steps)
        self._budget: int | None = None
        self._budget_label: str | None = None
        self.set_budget(budget)
        self.max_history = max_history
        self.reset_peak = reset_peak
        self.trace_on_start = trace
        self.trace_max_entries = trace_max_entries
        self.top_modules = top_modules
        if isinstance(detect_leaks, LeakDetector):
            self._leak_detector: LeakDetector | None = detect_leaks
        else:
            self._leak_detector = LeakDetector(self.device) if detect_leaks else None
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._attribution = ModuleAttribution(self._module_reading)
        self._phase: str | None = None
        self._trace_token: int | None = None
        self._trace_snapshot: dict[str, Any] | None = None
        self._leak_report: LeakVerdict | None = None
        self._leak_verdicts: dict[str | None, LeakVerdict] = {}
        self._workload: str | None = None
        self._optimizer_hook: Any = None
        self._reset_session()

    # session state --------------------------------------------------------------------------
    def _reset_session(self) -> None:
        self._history: deque[MemorySnapshot] = deque(maxlen=self.max_history)
        self._dropped = 0
        self._step = 0
        self._t0 = time.perf_counter()
        self._started_at = time.time()
        self._stopped_at: float | None = None
        self._peak = {k: _Peak() for k in ("allocated", "reserved", "host_rss")}
        self._watermark = (0, 0)  # allocator peak watermark at the last reading
        self._peak_nvml: int | None = None
        self._peak_pinned = 0
        self._samples = 0
        self._sums = [0.0, 0.0, 0.0, 0]  # allocated, reserved, host_rss, readings with rss
        self._phase_peaks: dict[str, list[Any]] = {}
        self._attribution.reset()
        # the verdicts without a detector, kept incrementally, one per workload
        self._step_growth: dict[str | None, GrowthTracker] = {}
        self._events: deque[ProfileEvent] = deque(maxlen=self.max_history)
        self._events_dropped = 0
        self._stepped_by_hand = False
        self._optimizers_since_step: set[int] = set()
        self._memory_limit: int | None = None
        self._limit_due = 0.0
        self._last_rss: int | None = None
        self._last_nvml: int | None = None
        self._nvml_due = 0.0
        self._nvml_misses = 0
        self._last_pinned = 0
        self._pinned_due = 0.0
        self._counters0: dict[str, Any] = {}
        self._counters1: dict[str, Any] | None = None
        self._warned = False

    @property
    def running(self) -> bool:
        """Whether a session is in progress."""
        return self._running

    @property
    def history(self) -> list[MemorySnapshot]:
        """The snapshots of the current (or last) session, oldest first."""
        with self._lock:
            return list(self._history)

    @property
    def current_phase(self) -> str | None:
        """The phase set by the last :meth:`mark`."""
        return self._phase

    @property
    def steps(self) -> int:
        """Steps marked in the current (or last) session (all workloads)."""
        return self._step

    @property
    def current_workload(self) -> str | None:
        """The workload set by :meth:`workload` / :meth:`set_workload` (``None``: none)."""
        return self._workload

    def start(self) -> MemoryProfiler:
        """Start a fresh session and the sampler thread (no-op if already running)."""
        if self._running:
            logger.debug("MemoryProfiler.start(): already running")
            return self
        self._reset_session()
        self._trace_snapshot = None
        self._leak_report = None
        if self._index is not None and self._cuda_ready():
            if self.reset_peak:
                reset_cuda_peak(self._index)
            reading = read_cuda_figures(self._index)
            self._watermark = (reading[3], reading[4])
        self._counters0 = read_memory_stats(self._index)
        if self.trace_on_start:
            self._trace_token = acquire_memory_history("all", self.trace_max_entries)
        if self._leak_detector is not None:
            self._leak_detector.start()
        if self.count_optimizer_steps:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._optimizer_hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        self._running = True
        self._record("start", full=True)
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._run, name="vramkit-memory-profiler",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MemoryReport:
        """Stop sampling and return the session's :meth:`report` (no-op if not running)."""
        if not self._running:
            return self.report()
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._record("stop", full=True)
        self._running = False
        self._stopped_at = time.perf_counter()
        self._counters1 = read_memory_stats(self._index)
        if self._trace_token is not None:
            import torch

            # Keep the trace: releasing the history may drop the recorded events.
            self._trace_snapshot = torch.cuda.memory._snapshot()
            release_memory_history(self._trace_token)
            self._trace_token = None
        if self._leak_detector is not None:
            self._leak_report = self._leak_detector.report()
            self._leak_verdicts = self._leak_detector.verdicts()
            self._leak_detector.stop()
        return self.report()

    def __enter__(self) -> MemoryProfiler:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        deadline = time.perf_counter()
        while not self._stop_event.is_set():
            try:
                self._record("sample", full=True)
            except Exception as err:  # a failing reader must not kill the training run
                if not self._warned:
                    logger.warning("memory sampling failed (%s); continuing", err)
                    self._warned = True
            deadline += self.sample_interval
            delay = deadline - time.perf_counter()
            if delay < 0:  # fell behind (a long GIL hold): resume the cadence, no burst
                deadline, delay = time.perf_counter(), 0.0
            if self._stop_event.wait(delay):
                break

    # readings -------------------------------------------------------------------------------
    def _cuda_ready(self) -> bool:
        """Whether this profiler's allocator can be read (cached once CUDA is initialized)."""
        if not self._cuda_seen and self._index is not None and cuda_initialized():
            self._cuda_seen = True
        return self._cuda_seen

    def _read_nvml(self, now: float) -> int | None:
        if now < self._nvml_due or self._nvml_misses >= _NVML_GIVE_UP_AFTER:
            return self._last_nvml
        self._nvml_due = now + self.nvml_interval
        # the child processes of an external target hold GPU memory too: one query for them all
        total = nvml_process_memory(self._rss_reader.pids() if self._external else None)
        self._nvml_misses = 0 if total is not None else self._nvml_misses + 1
        if total is None and self._nvml_misses >= _NVML_GIVE_UP_AFTER:
            logger.debug("NVML gave no process figure %d times; no longer asking",
                         _NVML_GIVE_UP_AFTER)
        self._last_nvml = total
        return total

    def _read_pinned(self, now: float) -> int:
        if self._external or now < self._pinned_due:
            return self._last_pinned
        self._pinned_due = now + self.nvml_interval
        from vramkit.memory.pool import live_pools

        total = 0
        try:
            for pool in live_pools():
                if pool.kind == "pinned":
                    total += int(pool.stats().reserved)
        except Exception as err:  # a pool mid-teardown must not stop sampling
            logger.debug("reading pinned pools failed: %s", err)
            return self._last_pinned
        self._last_pinned = total
        return total

    def _record(self, kind: str, *, full: bool) -> int:
        """Take one reading, update the aggregates; returns the value of ``metric``."""
        now = time.perf_counter() - self._t0
        index = self._index
        alloc, reserved, active, peak_a, peak_r = (
            read_cuda_figures(index) if index is not None and self._cuda_ready() else _ZERO)
        rss = self._rss_reader.read() if (full or index is None) else self._last_rss
        if full:
            nvml = self._read_nvml(now)
            pinned = self._read_pinned(now)
            if index is not None and now >= self._limit_due and self._cuda_ready():
                self._limit_due = now + self.nvml_interval
                self._note_limit(index)
        else:
            nvml, pinned = self._last_nvml, self._last_pinned
        with self._lock:
            # The allocator's watermark tells of a peak between readings only when it rose since
            # the previous reading; that peak belongs to the context of this interval.
            alloc_high, reserved_high = alloc, reserved
            if peak_a > self._watermark[0]:
                alloc_high = max(alloc, peak_a)
            if peak_r > self._watermark[1]:
                reserved_high = max(reserved, peak_r)
            self._watermark = (max(peak_a, self._watermark[0]), max(peak_r, self._watermark[1]))
            self._last_rss = rss
            module = self._attribution.current
            ctx = (self._step, self._phase, module)
            alloc_rose = self._peak["allocated"].offer(alloc_high, now, ctx)
            self._peak["reserved"].offer(reserved_high, now, ctx)
            rss_rose = rss is not None and self._peak["host_rss"].offer(rss, now, ctx)
            metric_rose = alloc_rose if index is not None else rss_rose
            if metric_rose:
                self._attribution.note_peak(module)
            if nvml is not None:
                self._peak_nvml = max(self._peak_nvml or 0, nvml)
            self._peak_pinned = max(self._peak_pinned, pinned)
            if self._phase is not None:
                entry = self._phase_peaks.get(self._phase)
                if entry is None:
                    entry = self._phase_peaks[self._phase] = [0, 0, None, 0]
                entry[0] = max(entry[0], alloc_high)
                entry[1] = max(entry[1], reserved_high)
                if rss is not None:
                    entry[2] = max(entry[2] or 0, rss)
                entry[3] += 1
            if kind == "sample":
                self._samples += 1
                self._sums[0] += alloc
                self._sums[1] += reserved
                if rss is not None:
                    self._sums[2] += rss
                    self._sums[3] += 1
            if kind != "module":
                if len(self._history) == self.max_history:
                    self._dropped += 1
                self._history.append(MemorySnapshot(
                    timestamp=now, allocated=alloc, reserved=reserved, active=active,
                    nvml_used=nvml, host_rss=rss, phase=self._phase, pinned=pinned,
                    step=self._step, module=module, kind=kind))
        return alloc if index is not None else (rss or 0)

    def _note_limit(self, index: int) -> None:
        try:
            limit = _cuda_memory_limit(index)
        except Exception as err:  # a reader must not stop sampling
            logger.debug("reading the per-process memory fraction failed: %s", err)
            return
        if limit is not None and (self._memory_limit is None or limit < self._memory_limit):
            self._memory_limit = limit

    # phases, steps, workloads, events -------------------------------------------------------
    def mark(self, phase: str | None) -> None:
        """Enter ``phase`` (``"forward"``, ``"backward"``, ``"optimizer"``, ...; ``None`` clears).

        The reading taken here closes the previous phase, so a peak since the last reading is
        attributed to the phase it happened in.
        """
        if phase is not None and not isinstance(phase, str):
            raise ConfigError(f"phase must be a string or None, got {phase!r}",
                              hint="Name the phase with a string such as 'forward', or pass None "
                                   "to clear it.")
        if self._running:
            self._record("mark", full=False)
        self._phase = phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark ``name`` for the duration of a ``with`` block, then restore the previous phase."""
        previous = self._phase
        self.mark(name)
        try:
            yield
        finally:
            self.mark(previous)

    def step(self) -> None:
        """Mark the end of a training step of the current workload (and step the leak detector,
        if any). Calling it turns off ``count_optimizer_steps`` counting: the script counts."""
        self._stepped_by_hand = True
        self._count_step()

    mark_step = step

    def _count_step(self) -> None:
        if not self._running:
            self._step += 1
            return
        value = self._record("step", full=False)
        workload = self._workload
        tracker = self._step_growth.get(workload)
        if tracker is None:
            tracker = self._step_growth[workload] = GrowthTracker()
        tracker.add(value)
        self._step += 1
        detector = self._leak_detector
        if detector is not None:
            # A CUDA detector on this device reads the very figure just read: hand it over.
            same = self._index is not None and detector.device == self.device
            detector.step(value if same else None, workload=workload)

    def _on_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The global optimizer post hook: one step per iteration, however many optimizers."""
        if not self._running or self._stepped_by_hand:
            return
        key = id(optimizer)
        seen = self._optimizers_since_step
        if not seen or key in seen:
            seen.clear()
            seen.add(key)
            self._count_step()
        else:
            seen.add(key)

    def set_workload(self, name: str | None) -> None:
        """Attribute the following steps to workload ``name`` (``None``: no workload).

        Leak verdicts judge each workload's step readings apart, so a run of another model,
        optimizer or configuration, before, after or alternating with this one, is never
        mistaken for growth.
        """
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"a workload name must be a non-empty string or None, got "
                              f"{name!r}", "Name the workload, e.g. prof.workload('swapped').")
        self._workload = name

    @contextlib.contextmanager
    def workload(self, name: str) -> Iterator[None]:
        """Attribute the steps of a ``with`` block to workload ``name`` (restored on exit)."""
        previous = self._workload
        self.set_workload(name)
        try:
            yield
        finally:
            self._workload = previous

    def event(self, kind: str, label: str | None = None, count: int = 1) -> None:
        """Record that ``count`` things of ``kind`` happened now (drawn as ticks in a lane of
        ``kind`` under the timeline; ``label`` is their tooltip). No-op when not running.

        Raises:
            ConfigError: for an empty ``kind`` or a ``count`` below 1.
        """
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"an event kind must be a non-empty string, got {kind!r}",
                              hint="Name the event kind with a non-empty string, e.g. "
                                   "profiler.event('swap').")
        check_int("count", count, minimum=1)
        if label is not None and not isinstance(label, str):
            raise ConfigError(f"an event label must be a string or None, got {label!r}",
                              hint="Pass label as a string (shown as the tick's tooltip) or leave "
                                   "it out.")
        if not self._running:
            return
        now = time.perf_counter() - self._t0
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._events_dropped += 1
            self._events.append(ProfileEvent(now, kind, label, count, self._step,
                                             self._workload))

    def set_budget(self, nbytes: int | str | None, label: str | None = None) -> None:
        """Draw a budget line at ``nbytes`` (of the report's ``metric``) on the timeline.

        Args:
            nbytes: bytes or a size string; ``None`` removes it.
            label: its legend text (default ``"budget <size>"``).
        """
        self._budget = check_size("budget", nbytes, allow_none=True)
        self._budget_label = None if self._budget is None else (
            label or f"budget {format_size(self._budget)}")

    # module attribution ---------------------------------------------------------------------
    def attach(self, model: Any = None, *, backward: bool = True) -> MemoryProfiler:
        """Add hooks that take a reading at entry and exit of every module.

        Args:
            model: an ``nn.Module`` (hooks on it and every submodule), or ``None`` for PyTorch's
                global module hooks (every module that runs; names come from the outermost
                module that ran). Default ``None``.
            backward: also add full backward (pre-)hooks (default ``True``). They wrap module
                inputs and outputs in autograd functions, which PyTorch refuses when a following
                op modifies an output in place (``nn.ReLU(inplace=True)``): pass ``False`` then.

        Returns:
            ``self``; :meth:`detach` removes every hook.
        """
        self._attribution.attach(model, backward=backward)
        return self

    def detach(self) -> None:
        """Remove every hook added by :meth:`attach`."""
        self._attribution.detach()

    @property
    def hook_count(self) -> int:
        """Hooks currently installed by :meth:`attach`."""
        return self._attribution.hook_count

    def _module_reading(self) -> int | None:
        """The reading a module hook takes, ``None`` when not running (the hook then skips)."""
        return self._record("module", full=False) if self._running else None

    # tracing --------------------------------------------------------------------------------
    def _require_cuda(self, what: str) -> None:
        if self._index is None:
            reason = trace_unsupported_reason(self.device, self.pid) or "no CUDA device"
            raise DeviceError(f"{what}: {reason}", _TRACE_HINT)

    @contextlib.contextmanager
    def trace(self, path: str | Path | None = None) -> Iterator[None]:
        """Record PyTorch's allocation history (with Python stacks) for a ``with`` block.

        Args:
            path: where to write the snapshot pickle on exit (open it at pytorch.org/memory_viz);
                ``None`` (default) writes nothing.

        Raises:
            DeviceError: without a CUDA device.
        """
        self._require_cuda("profiler.trace()")
        import torch

        token = acquire_memory_history("all", self.trace_max_entries)
        try:
            yield
        finally:
            try:
                if path is not None:
                    torch.cuda.memory._dump_snapshot(str(path))
            finally:
                release_memory_history(token)

    def save_trace(self, path: str | Path) -> Path:
        """Write the allocation history recorded with ``trace=True`` as a memory_viz pickle.

        While running this is ``torch.cuda.memory._dump_snapshot``; after :meth:`stop` it writes
        the snapshot taken at stop.

        Raises:
            DeviceError: without a CUDA device.
            ConfigError: when no trace was recorded (``trace=False``).
        """
        self._require_cuda("save_trace()")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if self._trace_token is not None:
            import torch

            with atomic_path(target) as temporary:
                torch.cuda.memory._dump_snapshot(str(temporary))
        elif self._trace_snapshot is not None:
            with atomic_open(target, "wb") as fh:
                pickle.dump(self._trace_snapshot, fh)
        else:
            raise ConfigError("no allocation trace was recorded",
                              "Create the profiler with trace=True, or use profiler.trace(path).")
        return target

    # reports --------------------------------------------------------------------------------
    def report(self) -> MemoryReport:
        """The :class:`MemoryReport` of the current (running) or last session."""
        end = (self._counters1 if self._counters1 is not None and not self._running
               else read_memory_stats(self._index))
        start = self._counters0
        on_cuda = self._index is not None

        def figure(counters: dict[str, Any], field: str) -> int:
            return int(counters.get(_KEYS[field], 0))

        def delta(field: str) -> int | None:
            return figure(end, field) - figure(start, field) if on_cuda else None

        fragmentation = inactive_ratio = None
        if on_cuda:
            fragmentation, inactive_ratio = fragmentation_ratios(
                figure(end, "allocated"), figure(end, "reserved"), figure(end, "inactive_split"))
        outside = None
        if self._last_nvml is not None and not self._external:
            outside = self._last_nvml - reserved_all_devices()
        if self._leak_detector is not None:
            if not self._running and self._leak_report is not None:
                leak, verdicts = self._leak_report, self._leak_verdicts
            else:
                leak, verdicts = self._leak_detector.report(), self._leak_detector.verdicts()
        else:
            verdicts = {name: tracker.verdict(self.metric, workload=name)
                        for name, tracker in list(self._step_growth.items())}
            leak = combine_verdicts(verdicts.values())
        by_workload = ({name or "": verdict for name, verdict in verdicts.items()}
                       if any(name is not None for name in verdicts) else {})
        finished = (self._stopped_at if self._stopped_at is not None and not self._running
                    else time.perf_counter())
        with self._lock:
            samples, sums = self._samples, list(self._sums)
            rss_peak = self._peak["host_rss"]
            return MemoryReport(
                device=self.device, metric=self.metric, started_at=self._started_at,
                duration_s=finished - self._t0, sample_interval=self.sample_interval,
                num_samples=samples, steps=self._step,
                peak=self._peak["allocated" if on_cuda else "host_rss"].point(),
                peak_allocated=self._peak["allocated"].point(),
                peak_reserved=self._peak["reserved"].point(),
                peak_host_rss=rss_peak.point() if rss_peak.value > 0 else None,
                peak_nvml_used=self._peak_nvml, peak_pinned=self._peak_pinned,
                mean_allocated=sums[0] / samples if samples else 0.0,
                mean_reserved=sums[1] / samples if samples else 0.0,
                mean_host_rss=sums[2] / sums[3] if sums[3] else None,
                phase_peaks={name: PhasePeak(a, r, rss, n)
                             for name, (a, r, rss, n) in self._phase_peaks.items()},
                top_modules=self._attribution.top(self.top_modules),
                num_allocations=delta("allocations_total"),
                alloc_retries=delta("num_alloc_retries"), ooms=delta("num_ooms"),
                fragmentation=fragmentation, inactive_split_ratio=inactive_ratio,
                outside_torch=outside, leak=leak, history=tuple(self._history),
                history_dropped=self._dropped, leak_by_workload=by_workload,
                events=tuple(self._events), events_dropped=self._events_dropped,
                budget=self._budget, budget_label=self._budget_label,
                memory_limit=self._memory_limit)

    def save_profile(self, path: str | Path) -> Path:
        """Write :meth:`report` to ``path`` (``.json``, ``.html`` or ``.png`` by suffix)."""
        return save_report(self.report(), path)

    def __repr__(self) -> str:
        return (f"MemoryProfiler(device={self.device!r}, sample_interval={self.sample_interval},"
                f" running={self._running}, snapshots={len(self._history)})")
