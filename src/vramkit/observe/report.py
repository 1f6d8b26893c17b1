"""Memory reports: the records a :class:`~vramkit.observe.profiler.MemoryProfiler` produces, and
their files.

:class:`MemoryReport` holds the summary (peaks with time, step, phase and module; means; per-phase
peaks; top modules by activation memory; allocator counters; the leak verdict) and the sampled
history. :func:`save_report` writes it by file suffix:

- ``.json``: every field, loadable again with :func:`load_report` (equal to the original).
- ``.html``: one self-contained file (inline CSS and an inline SVG timeline; no script, no network).
- ``.png``: the timeline drawn with matplotlib's Agg canvas (matplotlib is imported only here).

The timeline (HTML and PNG alike): memory series as lines (Okabe-Ito colours, which stay apart
under the common colour-vision deficiencies, plus distinct dash patterns); the budget and the
per-process cap as labelled lines; the y axis in one binary unit with ticks at 1, 2 or 5 x 10^k
of it, the same range in both files (:func:`timeline_axis`); under the plot, a *phases* lane
(each phase a colour, a fill pattern and, where it fits, its name) and one lane of ticks per
event kind (:meth:`~vramkit.observe.profiler.MemoryProfiler.event`: block loads of a swapper...),
tick height following the count; the legend in its own rows below, never over the plot.

The drawing lives beside this module: :mod:`~vramkit.observe.report_timeline` (the axis, palette and
series both timelines share), :mod:`~vramkit.observe.report_svg` (the HTML report's timeline and
its legend), :mod:`~vramkit.observe.report_html` (the HTML page) and
:mod:`~vramkit.observe.report_png` (the PNG).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramkit._files import atomic_path
from vramkit.errors import ConfigError
from vramkit.observe.leaks import LeakVerdict
from vramkit.observe.report_html import write_html
from vramkit.observe.report_png import write_png
from vramkit.units import format_size

__all__ = ["MemoryReport", "MemorySnapshot", "ModuleMemory", "PeakPoint", "PhasePeak",
           "ProfileEvent", "load_report", "save_report"]

logger = logging.getLogger(__name__)

_FORMAT = "vramkit.memory_report"
_VERSION = 2  # 2: workloads' leak verdicts, events, budget and memory limit (1 still loads)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """One reading of memory (EriDiffusion ``MemorySnapshot`` plus context).

    Attributes:
        timestamp: seconds since the profiler started (monotonic clock).
        allocated: bytes in live CUDA tensors (0 on the CPU: PyTorch exposes no CPU allocator
            statistics, so ``host_rss`` carries the signal there).
        reserved: bytes the CUDA caching allocator holds (0 on the CPU).
        active: allocated bytes plus blocks waiting on a stream (0 on the CPU).
        nvml_used: GPU bytes NVML charges to the process, ``None`` when unknown.
        host_rss: resident set size of the process in bytes, ``None`` when unknown.
        phase: the phase set by ``mark()`` (``None`` before the first mark).
        pinned: bytes reserved by live pinned host pools.
        step: steps completed when the reading was taken.
        module: the innermost module running when the reading was taken (attached models only).
        kind: ``"sample"`` (background thread), ``"mark"``, ``"step"``, ``"start"`` or ``"stop"``.
    """

    timestamp: float
    allocated: int
    reserved: int
    active: int
    nvml_used: int | None
    host_rss: int | None
    phase: str | None
    pinned: int = 0
    step: int = 0
    module: str | None = None
    kind: str = "sample"


@dataclass(frozen=True, slots=True)
class ProfileEvent:
    """Something that happened at one instant, drawn as a tick in its kind's lane.

    Attributes:
        timestamp: seconds since the profiler started.
        kind: the lane (``"block loads"``).
        label: tooltip text, ``None`` for ``"<count> <kind>"``.
        count: how many things (tick height follows it), >= 1.
        step: steps completed when it was recorded.
        workload: the profiler's workload then, ``None`` for none.
    """

    timestamp: float
    kind: str
    label: str | None = None
    count: int = 1
    step: int = 0
    workload: str | None = None


@dataclass(frozen=True)
class PeakPoint:
    """Where and when a figure peaked.

    Attributes:
        value: the peak, in bytes.
        timestamp: seconds since start of the reading that saw it (for the CUDA allocator's
            watermark: the first reading after the peak, so an upper bound).
        step, phase, module: the context of that reading.
    """

    value: int = 0
    timestamp: float = 0.0
    step: int = 0
    phase: str | None = None
    module: str | None = None

    def where(self) -> str:
        """``"t=1.20s, step 3, phase forward, module blocks.0"``: when and in what context."""
        parts = [f"t={self.timestamp:.2f}s", f"step {self.step}"]
        if self.phase:
            parts.append(f"phase {self.phase}")
        if self.module:
            parts.append(f"module {self.module}")
        return ", ".join(parts)


@dataclass(frozen=True)
class PhasePeak:
    """Peaks seen while one phase was marked.

    Attributes:
        allocated, reserved: CUDA figures (0 on the CPU).
        host_rss: peak resident set size, ``None`` when unknown.
        readings: readings taken in the phase.
    """

    allocated: int = 0
    reserved: int = 0
    host_rss: int | None = None
    readings: int = 0


@dataclass(frozen=True)
class ModuleMemory:
    """Memory attributed to one module by the profiler's hooks.

    Attributes:
        name: qualified module name (the root is its class name).
        type: the module's class name.
        calls: forward calls seen.
        activation_bytes: largest growth between a forward entry and exit (memory the call
            left alive: outputs and saved tensors), counting submodules.
        activation_bytes_total: the same summed over calls.
        backward_bytes: largest growth between a backward entry and exit.
        peak_hits: times the running peak rose while this module was the innermost one.
    """

    name: str
    type: str
    calls: int = 0
    activation_bytes: int = 0
    activation_bytes_total: int = 0
    backward_bytes: int = 0
    peak_hits: int = 0


@dataclass(frozen=True)
class MemoryReport:
    """Summary of one profiling session (EriDiffusion ``MemoryReport``).

    ``metric`` names the figure that drives ``peak``: ``"allocated"`` on a CUDA device,
    ``"host_rss"`` on the CPU.

    ``leak`` is the verdict shown (with several workloads, the one
    :func:`~vramkit.observe.leaks.combine_verdicts` picks); ``leak_by_workload`` holds each
    workload's own verdict (empty when no workload was named; key ``""``: steps outside any).
    ``events`` are the profiler's :class:`ProfileEvent` records; ``budget`` (with its legend
    ``budget_label``) and ``memory_limit`` (the lowest per-process CUDA cap seen, bytes) are drawn
    as lines.
    """

    device: str
    metric: str
    started_at: float
    duration_s: float
    sample_interval: float
    num_samples: int
    steps: int
    peak: PeakPoint
    peak_allocated: PeakPoint
    peak_reserved: PeakPoint
    peak_host_rss: PeakPoint | None
    peak_nvml_used: int | None
    peak_pinned: int
    mean_allocated: float
    mean_reserved: float
    mean_host_rss: float | None
    phase_peaks: dict[str, PhasePeak] = field(default_factory=dict)
    top_modules: tuple[ModuleMemory, ...] = ()
    num_allocations: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    fragmentation: float | None = None
    inactive_split_ratio: float | None = None
    outside_torch: int | None = None
    leak: LeakVerdict | None = None
    history: tuple[MemorySnapshot, ...] = ()
    history_dropped: int = 0
    leak_by_workload: dict[str, LeakVerdict] = field(default_factory=dict)
    events: tuple[ProfileEvent, ...] = ()
    events_dropped: int = 0
    budget: int | None = None
    budget_label: str | None = None
    memory_limit: int | None = None

    # serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready types (history as lists of field values)."""
        data: dict[str, Any] = {"format": _FORMAT, "version": _VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "history":
                data["history_fields"] = [h.name for h in dataclasses.fields(MemorySnapshot)]
                data["history"] = [list(dataclasses.astuple(s)) for s in value]
            elif f.name == "leak":
                data["leak"] = value.to_dict() if value is not None else None
            elif f.name == "leak_by_workload":
                data[f.name] = {k: v.to_dict() for k, v in value.items()}
            elif f.name == "events":
                data["event_fields"] = [h.name for h in dataclasses.fields(ProfileEvent)]
                data["events"] = [list(dataclasses.astuple(e)) for e in value]
            elif f.name == "phase_peaks":
                data["phase_peaks"] = {k: dataclasses.asdict(v) for k, v in value.items()}
            elif f.name == "top_modules":
                data["top_modules"] = [dataclasses.asdict(m) for m in value]
            elif dataclasses.is_dataclass(value):
                data[f.name] = dataclasses.asdict(value)
            else:
                data[f.name] = value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: when ``data`` is not a vramkit memory report.
        """
        if data.get("format") != _FORMAT:
            raise ConfigError("not a vramkit memory report (missing 'format' marker)",
                              "Load files written by MemoryProfiler.save_profile('....json').")
        names = data.get("history_fields") or [f.name for f in dataclasses.fields(MemorySnapshot)]
        history = tuple(MemorySnapshot(**dict(zip(names, row, strict=True)))
                        for row in data.get("history", ()))
        rss = data.get("peak_host_rss")
        event_names = (data.get("event_fields")
                       or [f.name for f in dataclasses.fields(ProfileEvent)])
        events = tuple(ProfileEvent(**dict(zip(event_names, row, strict=True)))
                       for row in data.get("events", ()))
        return cls(
            device=data["device"], metric=data["metric"], started_at=data["started_at"],
            duration_s=data["duration_s"], sample_interval=data["sample_interval"],
            num_samples=data["num_samples"], steps=data["steps"],
            peak=PeakPoint(**data["peak"]), peak_allocated=PeakPoint(**data["peak_allocated"]),
            peak_reserved=PeakPoint(**data["peak_reserved"]),
            peak_host_rss=PeakPoint(**rss) if rss is not None else None,
            peak_nvml_used=data["peak_nvml_used"], peak_pinned=data["peak_pinned"],
            mean_allocated=data["mean_allocated"], mean_reserved=data["mean_reserved"],
            mean_host_rss=data["mean_host_rss"],
            phase_peaks={k: PhasePeak(**v) for k, v in data["phase_peaks"].items()},
            top_modules=tuple(ModuleMemory(**m) for m in data["top_modules"]),
            num_allocations=data["num_allocations"], alloc_retries=data["alloc_retries"],
            ooms=data["ooms"], fragmentation=data["fragmentation"],
            inactive_split_ratio=data["inactive_split_ratio"],
            outside_torch=data["outside_torch"],
            leak=LeakVerdict.from_dict(data["leak"]) if data.get("leak") else None,
            history=history, history_dropped=data["history_dropped"],
            leak_by_workload={k: LeakVerdict.from_dict(v)
                              for k, v in (data.get("leak_by_workload") or {}).items()},
            events=events, events_dropped=data.get("events_dropped", 0),
            budget=data.get("budget"), budget_label=data.get("budget_label"),
            memory_limit=data.get("memory_limit"))

    def save(self, path: str | Path) -> Path:
        """Write the report; the format follows the suffix (see :func:`save_report`)."""
        return save_report(self, path)

    @property
    def measures_cuda(self) -> bool:
        """Whether the report is of a CUDA device (whose allocator and pinned pools are read);
        on the CPU those figures were not measured and show as n/a, never 0 B."""
        return self.device.startswith("cuda")

    def _allocator_size(self, nbytes: int) -> str:
        return format_size(nbytes) if self.measures_cuda else "n/a (no CUDA allocator)"

    def summary_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows for tables (CLI and HTML)."""
        rows = [
            ("device", self.device),
            ("duration", f"{self.duration_s:.2f} s ({self.num_samples} samples, "
                         f"{self.steps} steps)"),
            (f"peak ({self.metric})", f"{format_size(self.peak.value)} at "
                                      f"{self.peak.where()}"),
            ("peak allocated", self._allocator_size(self.peak_allocated.value)),
            ("peak reserved", self._allocator_size(self.peak_reserved.value)),
            ("mean allocated", self._allocator_size(self.mean_allocated)),
        ]
        if self.peak_host_rss is not None:
            rows.append(("peak host RSS", format_size(self.peak_host_rss.value)))
        if self.peak_nvml_used is not None:
            rows.append(("peak NVML process memory", format_size(self.peak_nvml_used)))
        if self.outside_torch is not None:
            rows.append(("GPU memory outside PyTorch", format_size(self.outside_torch)))
        rows.append(("peak pinned pools", self._allocator_size(self.peak_pinned)))
        if self.budget is not None:
            size = format_size(self.budget)
            label = self.budget_label
            rows.append(("budget", size if label in (None, f"budget {size}")
                         else f"{size} ({label})"))
        if self.memory_limit is not None:
            rows.append(("per-process CUDA cap", format_size(self.memory_limit)))
        if self.events:
            counts: dict[str, int] = {}
            for event in self.events:
                counts[event.kind] = counts.get(event.kind, 0) + event.count
            rows.append(("events", ", ".join(f"{kind}: {n}" for kind, n in counts.items())))
        rows.append(("allocations", _opt(self.num_allocations)))
        if self.fragmentation is not None:
            rows.append(("fragmentation (1 - alloc/reserved)", f"{self.fragmentation:.1%}"))
        if self.alloc_retries is not None:
            rows.append(("allocator retries / OOMs", f"{self.alloc_retries} / {self.ooms}"))
        rows.append(("leak", _leak_text(self.leak, self.leak_by_workload)))
        return rows


def _opt(value: object) -> str:
    return "n/a" if value is None else str(value)



def _leak_text(verdict: LeakVerdict | None,
               by_workload: dict[str, LeakVerdict] | None = None) -> str:
    if verdict is None:
        return "not checked (no step() calls)"
    if by_workload and len(by_workload) > 1:
        # each workload judged on its own steps; leaking ones first
        ranked = sorted(by_workload.items(), key=lambda kv: not kv[1].leak)
        return "; ".join(_workload_leak_text(k, v) for k, v in ranked)
    if verdict.leak:
        where = f" in {verdict.workload}" if verdict.workload else ""
        return (f"LEAK{where}: {format_size(verdict.bytes_per_step)}/step since step "
                f"{verdict.first_leak_step} ({verdict.metric})")
    state = "no leak" if verdict.conclusive else "no leak so far (too few steps to be sure)"
    return f"{state} ({verdict.steps} steps, {verdict.metric})"


def _workload_leak_text(name: str, verdict: LeakVerdict) -> str:
    name = name or "(no workload)"
    if verdict.leak:
        return (f"LEAK in {name}: {format_size(verdict.bytes_per_step)}/step since step "
                f"{verdict.first_leak_step} ({verdict.metric})")
    state = "no leak" if verdict.conclusive else "no leak so far (too few steps to be sure)"
    return f"{name}: {state} ({verdict.steps} steps, {verdict.metric})"



# --- files -------------------------------------------------------------------------------------

def save_report(report: MemoryReport, path: str | Path) -> Path:
    """Write ``report`` to ``path``; the suffix picks the format (.json, .html, .png).

    Args:
        report: the report to write.
        path: destination file; parent directories are created.

    Returns:
        The path written.

    Raises:
        ConfigError: for another suffix.
        ImportError: (a vramkit error) for ``.png`` without matplotlib.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    writers = {".json": _write_json, ".html": write_html, ".htm": write_html,
               ".png": write_png}
    writer = writers.get(suffix)
    if writer is None:
        raise ConfigError(f"cannot save a memory report as {suffix or 'a file without suffix'!r}",
                          "Use a path ending in .json, .html or .png.")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed: a process killed while writing leaves the
    # previous report whole, and no half-written file under the report's name.
    with atomic_path(target) as temporary:
        writer(report, temporary)
    logger.debug("wrote memory report %s", target)
    return target


def load_report(path: str | Path) -> MemoryReport:
    """Read a report written as ``.json`` by :func:`save_report`."""
    with open(path, encoding="utf-8") as fh:
        return MemoryReport.from_dict(json.load(fh))


def _write_json(report: MemoryReport, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report.to_dict(), fh, indent=1, allow_nan=False)

