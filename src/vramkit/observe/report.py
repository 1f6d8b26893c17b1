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
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramkit.errors import ConfigError, VramkitError
from vramkit.observe.leaks import LeakVerdict
from vramkit.units import format_size

__all__ = ["MemoryReport", "MemorySnapshot", "ModuleMemory", "PeakPoint", "PhasePeak",
           "ProfileEvent", "TimelineAxis", "load_report", "render_html", "save_report",
           "timeline_axis", "timeline_svg"]

logger = logging.getLogger(__name__)

_FORMAT = "vramkit.memory_report"
_VERSION = 2  # 2: workloads' leak verdicts, events, budget and memory limit (1 still loads)


class _MissingDependencyError(VramkitError, ImportError):
    """An optional library needed for one output format is not installed."""

    default_hint = "pip install matplotlib (or save the report as .json or .html)."


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
                                      f"{_where(self.peak)}"),
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


def _where(point: PeakPoint) -> str:
    parts = [f"t={point.timestamp:.2f}s", f"step {point.step}"]
    if point.phase:
        parts.append(f"phase {point.phase}")
    if point.module:
        parts.append(f"module {point.module}")
    return ", ".join(parts)


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
    writers = {".json": _write_json, ".html": _write_html, ".htm": _write_html,
               ".png": _write_png}
    writer = writers.get(suffix)
    if writer is None:
        raise ConfigError(f"cannot save a memory report as {suffix or 'a file without suffix'!r}",
                          "Use a path ending in .json, .html or .png.")
    target.parent.mkdir(parents=True, exist_ok=True)
    writer(report, target)
    logger.debug("wrote memory report %s", target)
    return target


def load_report(path: str | Path) -> MemoryReport:
    """Read a report written as ``.json`` by :func:`save_report`."""
    with open(path, encoding="utf-8") as fh:
        return MemoryReport.from_dict(json.load(fh))


def _write_json(report: MemoryReport, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report.to_dict(), fh, indent=1, allow_nan=False)


# --- the timeline (shared by HTML and PNG) -------------------------------------------------------

# Okabe & Ito's palette: told apart under protanopia, deuteranopia and tritanopia.
_OKABE_ITO = {"black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73",
              "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00",
              "purple": "#CC79A7"}
# Series: (attribute, label, colour, SVG dash array or "", matplotlib line style).
_SERIES = (("allocated", "allocated", _OKABE_ITO["blue"], "", "-"),
           ("reserved", "reserved", _OKABE_ITO["orange"], "7 3", (0, (7, 3))),
           ("nvml_used", "NVML process", _OKABE_ITO["purple"], "2 2", (0, (2, 2))),
           ("host_rss", "host RSS", _OKABE_ITO["green"], "", "-"),
           ("pinned", "pinned pools", _OKABE_ITO["sky"], "9 3 2 3", (0, (9, 3, 2, 3))))
# Phases: colour i and fill pattern i (so phases differ by pattern too, and by the label drawn
# in the lane where it fits); neighbours in the list contrast in lightness.
_PHASE_COLOURS = tuple(_OKABE_ITO[k] for k in ("sky", "orange", "green", "purple", "yellow",
                                               "blue", "vermillion"))
_PHASE_HATCHES = (None, "//", "..", "--", "\\\\", "xx", "||")  # matplotlib's names
_BUDGET_COLOUR = _OKABE_ITO["vermillion"]
_LIMIT_COLOUR = _OKABE_ITO["black"]
_EVENT_COLOUR = _OKABE_ITO["black"]
_UNITS = (("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40))


@dataclass(frozen=True)
class TimelineAxis:
    """The y axis both timelines use.

    Attributes:
        unit: ``"MiB"``, ``"GiB"``...; ``unit_bytes`` its size.
        step: tick spacing in ``unit``: 1, 2 or 5 x 10^k.
        top: the axis' upper end in ``unit`` (a whole number of steps; the axis starts at 0).
    """

    unit: str
    unit_bytes: int
    step: float
    top: float

    @property
    def ticks(self) -> list[float]:
        """Tick values in ``unit``, from 0 to ``top``."""
        return [_round(i * self.step) for i in range(round(self.top / self.step) + 1)]

    @property
    def top_bytes(self) -> int:
        return round(self.top * self.unit_bytes)

    def label(self, value: float) -> str:
        return f"{_round(value):g} {self.unit}" if value else "0"


def _round(value: float) -> float:
    return float(f"{value:.12g}")


def _nice_step(raw: float) -> float:
    """The least 1, 2 or 5 x 10^k that is >= ``raw`` (> 0)."""
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * magnitude >= raw * (1 - 1e-9):
            return _round(m * magnitude)
    return _round(10 * magnitude)  # pragma: no cover - the loop always returns


def _height(snap: MemorySnapshot) -> int:
    return max(snap.allocated, snap.reserved, snap.nvml_used or 0, snap.host_rss or 0,
               snap.pinned)


def timeline_axis(report: MemoryReport, ticks: int = 5) -> TimelineAxis:
    """The y axis of ``report``'s timeline: one binary unit, ticks at 1/2/5 x 10^k of it, the
    top a whole number of ticks above every drawn value (series, peak, budget, cap)."""
    high = max([_height(s) for s in report.history]
               + [report.peak.value if report.history else 0, report.budget or 0,
                  report.memory_limit or 0])
    unit, size = _UNITS[0]
    for name, nbytes in _UNITS:
        if high >= nbytes:
            unit, size = name, nbytes
    if high <= 0:
        return TimelineAxis(unit, size, 1.0, 1.0)
    value = high / size * 1.02  # a little headroom: a line at the top stays visible
    step = _nice_step(value / ticks)
    return TimelineAxis(unit, size, step, _round(math.ceil(value / step - 1e-9) * step))


def _time_ticks(t_lo: float, t_hi: float, count: int = 8) -> list[float]:
    span = t_hi - t_lo
    if span <= 0:
        return [t_lo]
    step = _nice_step(span / count)
    first = math.ceil(t_lo / step - 1e-9)
    return [_round(i * step) for i in range(first, math.floor(t_hi / step + 1e-9) + 1)]


def _time_range(history: Sequence[MemorySnapshot]) -> tuple[float, float]:
    """The x range: from 0 (the profiler's start) unless the history's beginning was dropped."""
    t_lo, t_hi = history[0].timestamp, history[-1].timestamp
    if t_lo <= 0.05 * (t_hi - t_lo):
        t_lo = 0.0
    return t_lo, t_hi


def _downsample(history: Sequence[MemorySnapshot], buckets: int) -> list[MemorySnapshot]:
    """At most ``buckets`` snapshots, keeping each bucket's highest reading so peaks survive."""
    if len(history) <= buckets:
        return list(history)
    t0, t1 = history[0].timestamp, history[-1].timestamp
    span = (t1 - t0) or 1.0
    best: dict[int, MemorySnapshot] = {}
    for snap in history:
        slot = min(buckets - 1, int((snap.timestamp - t0) / span * buckets))
        held = best.get(slot)
        if held is None or _height(snap) > _height(held):
            best[slot] = snap
    return [best[k] for k in sorted(best)]


def _phase_spans(history: Sequence[MemorySnapshot]) -> list[tuple[float, float, str]]:
    """``(start, end, phase)`` runs. A mark's reading carries the phase it closes, so a phase
    entered at a mark starts at that mark's time."""
    spans: list[tuple[float, float, str]] = []
    previous: MemorySnapshot | None = None
    for snap in history:
        if snap.phase is not None:
            if (spans and spans[-1][2] == snap.phase and previous is not None
                    and previous.phase == snap.phase):
                spans[-1] = (spans[-1][0], snap.timestamp, snap.phase)
            else:
                start = (previous.timestamp if previous is not None and previous.kind == "mark"
                         else snap.timestamp)
                spans.append((start, snap.timestamp, snap.phase))
        previous = snap
    return spans


def _phase_styles(report: MemoryReport) -> dict[str, int]:
    """Phase -> style index, in order of first appearance."""
    order: dict[str, int] = {}
    for snap in report.history:
        if snap.phase is not None and snap.phase not in order:
            order[snap.phase] = len(order)
    return order


def _event_kinds(report: MemoryReport) -> list[str]:
    kinds: dict[str, None] = {}
    for event in report.events:
        kinds.setdefault(event.kind, None)
    return list(kinds)


def _bucket_events(events: Sequence[ProfileEvent], key: Any) -> list[tuple[float, int, str]]:
    """Events merged per ``key(timestamp)`` bucket: (mean time, total count, tooltip)."""
    merged: dict[Any, list[Any]] = {}
    for e in events:
        entry = merged.setdefault(key(e.timestamp), [0.0, 0, []])
        entry[0] += e.timestamp * e.count
        entry[1] += e.count
        entry[2].append(e.label or f"{e.count} {e.kind}")
    out = []
    for total_t, count, labels in merged.values():
        text = labels[0] if len(labels) == 1 else (
            f"{count} in {len(labels)} events: " + "; ".join(labels[:3])
            + ("; ..." if len(labels) > 3 else ""))
        out.append((total_t / count, count, text))
    return out


# SVG geometry, in px of the viewBox
_SVG_LEFT, _SVG_RIGHT, _SVG_TOP = 84, 24, 14
_PLOT_H, _LANE_H, _LANE_GAP = 250, 18, 5
_FONT, _LEGEND_ROW = 12, 20
_CHAR_W = 0.62 * _FONT  # a generous mean glyph width of system-ui at this size


def _svg_patterns() -> str:
    """One <pattern> per phase style (index 0: none)."""
    line = 'stroke="#000" stroke-opacity="0.45" stroke-width="1.2"'
    bodies = ("",
              f'<path d="M-2,2 l4,-4 M0,8 l8,-8 M6,10 l4,-4" {line}/>',
              '<circle cx="2" cy="2" r="1.1" fill="#000" fill-opacity="0.5"/>'
              '<circle cx="6" cy="6" r="1.1" fill="#000" fill-opacity="0.5"/>',
              f'<path d="M0,2 h8 M0,6 h8" {line}/>',
              f'<path d="M-2,6 l4,4 M0,0 l8,8 M6,-2 l4,4" {line}/>',
              f'<path d="M0,0 l8,8 M8,0 l-8,8" {line}/>',
              f'<path d="M2,0 v8 M6,0 v8" {line}/>')
    return "".join(f'<pattern id="vk-phase-pattern-{i}" width="8" height="8" '
                   f'patternUnits="userSpaceOnUse">{body}</pattern>'
                   for i, body in enumerate(bodies) if body)


def _svg_swatch(x: float, y: float, kind: str, style: Any) -> str:
    """A legend swatch (26 x 12 px) at (x, y): a line, a marker or a patterned box."""
    mid = y + 6
    if kind == "line":
        colour, dash, width = style
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        return (f'<line x1="{x:.1f}" x2="{x + 26:.1f}" y1="{mid:.1f}" y2="{mid:.1f}" '
                f'stroke="{colour}" stroke-width="{width}"{dash_attr}/>')
    if kind == "peak":
        return (f'<circle cx="{x + 13:.1f}" cy="{mid:.1f}" r="4.5" fill="#fff" '
                f'stroke="#000" stroke-width="2"/>')
    if kind == "tick":
        return (f'<line x1="{x + 13:.1f}" x2="{x + 13:.1f}" y1="{y:.1f}" y2="{y + 12:.1f}" '
                f'stroke="{_EVENT_COLOUR}" stroke-width="2"/>')
    index = style
    colour = _PHASE_COLOURS[index % len(_PHASE_COLOURS)]
    pattern = index % len(_PHASE_HATCHES)
    out = (f'<rect x="{x:.1f}" y="{y:.1f}" width="26" height="12" fill="{colour}" '
           'stroke="#555" stroke-width="0.8"/>')
    if pattern:
        out += (f'<rect x="{x:.1f}" y="{y:.1f}" width="26" height="12" '
                f'fill="url(#vk-phase-pattern-{pattern})"/>')
    return out


def timeline_svg(report: MemoryReport, width: int = 960, height: int | None = None) -> str:
    """The timeline as an inline ``<svg>`` element (see the module docstring for what it shows).

    Args:
        report: the report.
        width: the drawing's width in px (default 960); it scales down with the page.
        height: ignored (the height follows the lanes and legend rows); kept for callers.

    The elements a reader (or a test) locates carry ids and their boxes in ``data-box``
    (``"x y width height"``): ``vk-plot`` (the plot area), ``vk-lanes`` and ``vk-legend``; the
    ``<svg>`` carries the y axis (``data-y-top-bytes``, ``data-y-step``, ``data-y-unit``).
    """
    del height
    left, top = _SVG_LEFT, _SVG_TOP
    plot_w = width - left - _SVG_RIGHT
    history = _downsample(report.history, plot_w)
    axis = timeline_axis(report)
    styles = _phase_styles(report)
    kinds = _event_kinds(report)
    lanes = (["phases"] if styles else []) + kinds
    lanes_top = top + _PLOT_H + 8
    lanes_h = len(lanes) * (_LANE_H + _LANE_GAP)
    ticks_y = lanes_top + lanes_h + 14
    title_y = ticks_y + 18

    # the legend: (kind, style, label) items flowed into rows of the plot's width
    items: list[tuple[str, Any, str]] = []
    for attr, label, colour, dash, _ in _SERIES:
        if any(getattr(s, attr) for s in history):
            items.append(("line", (colour, dash, 2 if attr == "allocated" else 1.6), label))
    if report.peak.value > 0 and history:
        items.append(("peak", None, f"peak {format_size(report.peak.value)}"))
    if report.budget is not None:
        items.append(("line", (_BUDGET_COLOUR, "8 4", 2),
                      report.budget_label or f"budget {format_size(report.budget)}"))
    if report.memory_limit is not None:
        items.append(("line", (_LIMIT_COLOUR, "2 3", 1.6),
                      f"per-process cap {format_size(report.memory_limit)}"))
    items += [("phase", index, f"phase: {name}") for name, index in styles.items()]
    items += [("tick", None, f"{kind} (tick height: count)") for kind in kinds]
    legend_top = title_y + 14
    rows: list[list[tuple[float, str, Any, str]]] = [[]]
    x = 0.0
    for kind, style, label in items:
        item_w = 26 + 6 + len(label) * _CHAR_W
        if rows[-1] and x + item_w > plot_w - 12:
            rows.append([])
            x = 0.0
        rows[-1].append((x, kind, style, label))
        x += item_w + 18
    legend_h = len(rows) * _LEGEND_ROW + 8 if items else 0
    total_h = legend_top + legend_h + 6

    out = [f'<svg width="{width}" height="{total_h}" viewBox="0 0 {width} {total_h}" '
           'role="img" aria-label="memory timeline" style="max-width:100%;height:auto" '
           f'font-family="system-ui,sans-serif" font-size="{_FONT}" '
           f'data-y-top-bytes="{axis.top_bytes}" data-y-step="{axis.step:g}" '
           f'data-y-unit="{axis.unit}">',
           f"<defs>{_svg_patterns()}</defs>",
           f'<g id="vk-plot" data-box="{left} {top} {plot_w} {_PLOT_H}">'
           f'<rect x="{left}" y="{top}" width="{plot_w}" height="{_PLOT_H}" fill="#fff" '
           'stroke="#888"/>']
    if not history:
        out.append(f'<text x="{left + 10}" y="{top + 20}">no samples</text></g></svg>')
        return "".join(out)
    t_lo, t_hi = _time_range(history)
    t_span = (t_hi - t_lo) or 1.0

    def x_of(t: float) -> float:
        return left + (min(max(t, t_lo), t_lo + t_span) - t_lo) / t_span * plot_w

    def y_of(value: float) -> float:
        return top + _PLOT_H - value / axis.top_bytes * _PLOT_H

    spans = _phase_spans(report.history)
    for start, end, phase in spans:  # faint bands behind the lines
        x0, x1 = x_of(start), x_of(end)
        colour = _PHASE_COLOURS[styles[phase] % len(_PHASE_COLOURS)]
        out.append(f'<rect x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 0.5):.1f}" '
                   f'height="{_PLOT_H}" fill="{colour}" fill-opacity="0.13"/>')
    for tick in axis.ticks:
        y = y_of(tick * axis.unit_bytes)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#000" stroke-opacity="0.12"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" '
                   f'font-size="11">{html.escape(axis.label(tick))}</text>')
    for attr, label, colour, dash, _ in _SERIES:
        values = [getattr(s, attr) for s in history]
        if not any(values):
            continue
        points = " ".join(f"{x_of(s.timestamp):.1f},{y_of(v):.1f}"
                          for s, v in zip(history, values, strict=True) if v is not None)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline fill="none" stroke="{colour}" '
                   f'stroke-width="{2 if attr == "allocated" else 1.6}"{dash_attr} '
                   f'stroke-linejoin="round" points="{points}"><title>{label}</title>'
                   '</polyline>')
    # budget and cap: lines named in the legend (labels inside the plot collide when the two
    # lie close, as they do when the cap enforces the budget)
    for value, colour, dash, label in (
            (report.budget, _BUDGET_COLOUR, "8 4",
             report.budget_label or f"budget {format_size(report.budget or 0)}"),
            (report.memory_limit, _LIMIT_COLOUR, "2 3",
             f"per-process cap {format_size(report.memory_limit or 0)}")):
        if value is None:
            continue
        y = y_of(value)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}">'
                   f'<title>{html.escape(label)}</title></line>')
    peak = report.peak
    if peak.value > 0:
        out.append(f'<circle cx="{x_of(peak.timestamp):.1f}" cy="{y_of(peak.value):.1f}" '
                   'r="4.5" fill="#fff" stroke="#000" stroke-width="2">'
                   f'<title>peak {html.escape(format_size(peak.value))} '
                   f'({html.escape(_where(peak))})</title></circle>')
    out.append("</g>")

    # lanes under the plot, on the same time axis
    out.append(f'<g id="vk-lanes" data-box="{left} {lanes_top} {plot_w} {lanes_h}">')
    lane_y = lanes_top
    if styles:
        out.append(f'<text x="{left - 6}" y="{lane_y + 13}" text-anchor="end" '
                   'font-size="11">phases</text>')
        for start, end, phase in spans:
            x0, x1 = x_of(start), x_of(end)
            w = max(x1 - x0, 0.5)
            index = styles[phase]
            colour = _PHASE_COLOURS[index % len(_PHASE_COLOURS)]
            pattern = index % len(_PHASE_HATCHES)
            name = html.escape(phase)
            out.append(f'<rect x="{x0:.1f}" y="{lane_y}" width="{w:.1f}" height="{_LANE_H}" '
                       f'fill="{colour}"><title>{name} ({end - start:.3g} s)</title></rect>')
            if pattern:
                out.append(f'<rect x="{x0:.1f}" y="{lane_y}" width="{w:.1f}" '
                           f'height="{_LANE_H}" fill="url(#vk-phase-pattern-{pattern})" '
                           'pointer-events="none"/>')
            if w > len(phase) * 6.2 + 8:
                out.append(f'<text x="{x0 + w / 2:.1f}" y="{lane_y + 13}" text-anchor="middle" '
                           'font-size="10" stroke="#fff" stroke-width="3" paint-order="stroke"'
                           f' pointer-events="none">{name}</text>')
        out.append(f'<rect x="{left}" y="{lane_y}" width="{plot_w}" height="{_LANE_H}" '
                   'fill="none" stroke="#888"/>')
        lane_y += _LANE_H + _LANE_GAP
    for kind in kinds:
        events = [e for e in report.events if e.kind == kind]
        merged = _bucket_events(events, lambda t: int(x_of(t)))
        most = max(count for _, count, _ in merged)
        out.append(f'<text x="{left - 6}" y="{lane_y + 13}" text-anchor="end" '
                   f'font-size="11">{html.escape(kind)}</text>'
                   f'<rect x="{left}" y="{lane_y}" width="{plot_w}" height="{_LANE_H}" '
                   'fill="#f7f7f7" stroke="#888"/>')
        for t, count, text in merged:
            x = x_of(t)
            h = (_LANE_H - 2) * (0.3 + 0.7 * count / most)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{lane_y + _LANE_H - 1}" '
                       f'y2="{lane_y + _LANE_H - 1 - h:.1f}" stroke="{_EVENT_COLOUR}" '
                       f'stroke-width="1.5"><title>{html.escape(text)} at {t:.2f} s</title>'
                       '</line>')
        lane_y += _LANE_H + _LANE_GAP
    out.append("</g>")

    for tick in _time_ticks(t_lo, t_hi):
        x = x_of(tick)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + _PLOT_H}" '
                   f'y2="{lanes_top + lanes_h:.1f}" stroke="#000" stroke-opacity="0.25"/>'
                   f'<text x="{x:.1f}" y="{ticks_y}" font-size="11" text-anchor="middle">'
                   f'{tick:g}</text>')
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{title_y}" font-size="11" '
               'text-anchor="middle">seconds since start</text>')
    if items:
        out.append(f'<g id="vk-legend" data-box="{left} {legend_top} {plot_w} {legend_h}">'
                   f'<rect x="{left}" y="{legend_top}" width="{plot_w}" height="{legend_h}" '
                   'fill="#fff" stroke="#ccc"/>')
        for row_index, row in enumerate(rows):
            y = legend_top + 6 + row_index * _LEGEND_ROW
            for x, kind, style, label in row:
                out.append(_svg_swatch(left + 8 + x, y, kind, style))
                out.append(f'<text x="{left + 8 + x + 32:.1f}" y="{y + 10.5:.1f}">'
                           f'{html.escape(label)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: MemoryReport) -> str:
    """The whole report as one self-contained HTML document."""
    parts = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
             "<title>vramkit memory report</title><style>",
             "body{font-family:system-ui,sans-serif;margin:24px;color:#222}",
             "table{border-collapse:collapse;margin:8px 0 24px}",
             "td,th{border:1px solid #ccc;padding:4px 10px;text-align:left;font-size:13px}",
             "th{background:#f4f4f4}h2{margin-top:28px}code{font-size:12px}",
             "</style></head><body><h1>vramkit memory report</h1>",
             "<h2>Timeline</h2>", timeline_svg(report),
             "<h2>Summary</h2>", _table(("figure", "value"), report.summary_rows())]
    if report.phase_peaks:
        parts.append("<h2>Phases</h2>")
        parts.append(_table(("phase", "peak allocated", "peak reserved", "peak host RSS",
                             "readings"),
                            [(name, report._allocator_size(p.allocated),
                              report._allocator_size(p.reserved),
                              format_size(p.host_rss) if p.host_rss is not None else "n/a",
                              p.readings) for name, p in report.phase_peaks.items()]))
    if report.top_modules:
        parts.append("<h2>Top modules by activation memory</h2>")
        parts.append(_table(("module", "type", "calls", "activation / call", "activation total",
                             "backward", "peak hits"),
                            [(m.name, m.type, m.calls, format_size(m.activation_bytes),
                              format_size(m.activation_bytes_total),
                              format_size(m.backward_bytes), m.peak_hits)
                             for m in report.top_modules]))
    if report.leak is not None and report.leak.suspects:
        parts.append("<h2>Leak suspects (alive, allocated after the baseline)</h2>")
        parts.append(_table(("bytes", "count", "example", "stack (innermost first)"),
                            [(format_size(s.bytes), s.count, s.example, " | ".join(s.stack))
                             for s in report.leak.suspects]))
    parts.append("</body></html>")
    return "".join(parts)


def _write_html(report: MemoryReport, path: Path) -> None:
    path.write_text(render_html(report), encoding="utf-8")


def _png_figure(report: MemoryReport) -> Any:
    """The PNG timeline as a matplotlib ``Figure`` on the Agg canvas (no pyplot)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as err:
        raise _MissingDependencyError(
            f"saving a PNG memory timeline needs matplotlib ({err})") from err
    history = report.history
    axis = timeline_axis(report)
    styles = _phase_styles(report)
    kinds = _event_kinds(report)
    lanes = (["phases"] if styles else []) + kinds
    # A bare Figure on the Agg canvas: the user's backend choice is left alone.
    fig = Figure(figsize=(11, 4.6 + 0.35 * len(lanes)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + len(lanes), 1, height_ratios=[10] + [0.9] * len(lanes))
    ax = fig.add_subplot(grid[0])
    lane_axes = [fig.add_subplot(grid[i + 1], sharex=ax) for i in range(len(lanes))]
    handles: list[Any] = []
    times = [s.timestamp for s in history]
    spans = _phase_spans(history)
    for start, end, phase in spans:
        ax.axvspan(start, max(end, start + 1e-9),
                   color=_PHASE_COLOURS[styles[phase] % len(_PHASE_COLOURS)], alpha=0.13, lw=0)
    scale = axis.unit_bytes
    for attr, label, colour, _, linestyle in _SERIES:
        values = [getattr(s, attr) for s in history]
        if not any(values):
            continue
        (line,) = ax.plot(times, [(v or 0) / scale for v in values], color=colour,
                          lw=2 if attr == "allocated" else 1.5, linestyle=linestyle, label=label)
        handles.append(line)
    if report.peak.value > 0 and history:
        (marker,) = ax.plot([report.peak.timestamp], [report.peak.value / scale], "o",
                            mfc="#fff", mec="#000", mew=2, ms=8,
                            label=f"peak {format_size(report.peak.value)}")
        handles.append(marker)
    if report.budget is not None:
        label = report.budget_label or f"budget {format_size(report.budget)}"
        handles.append(ax.axhline(report.budget / scale, color=_BUDGET_COLOUR, lw=2,
                                  linestyle=(0, (8, 4)), label=label))
    if report.memory_limit is not None:
        handles.append(ax.axhline(report.memory_limit / scale, color=_LIMIT_COLOUR, lw=1.6,
                                  linestyle=(0, (2, 3)),
                                  label=f"per-process cap {format_size(report.memory_limit)}"))
    ax.set_ylim(0, axis.top)
    ax.set_yticks(axis.ticks, [axis.label(t) for t in axis.ticks])
    ax.grid(axis="y", alpha=0.3)
    if history:
        t_lo, t_hi = _time_range(history)
        ax.set_xlim(t_lo, t_hi if t_hi > t_lo else t_lo + 1.0)
    ax.set_title(f"vramkit memory timeline ({report.device})")
    lane_iter = iter(lane_axes)
    if styles:
        lane = next(lane_iter)
        for start, end, phase in spans:
            index = styles[phase]
            lane.axvspan(start, max(end, start + 1e-9), ymin=0, ymax=1,
                         facecolor=_PHASE_COLOURS[index % len(_PHASE_COLOURS)],
                         hatch=_PHASE_HATCHES[index % len(_PHASE_HATCHES)], edgecolor="#444",
                         lw=0)
        handles += [Patch(facecolor=_PHASE_COLOURS[i % len(_PHASE_COLOURS)],
                          hatch=_PHASE_HATCHES[i % len(_PHASE_HATCHES)], edgecolor="#444",
                          label=f"phase: {name}") for name, i in styles.items()]
        lane.set_ylabel("phases", rotation=0, ha="right", va="center", fontsize=9)
    for kind in kinds:
        lane = next(lane_iter)
        events = [e for e in report.events if e.kind == kind]
        width = (times[-1] - times[0]) / 1000 if len(times) > 1 else 1.0
        merged = _bucket_events(events, lambda t, w=width: int(t / w) if w else t)
        most = max(count for _, count, _ in merged)
        lane.vlines([t for t, _, _ in merged], 0, [0.3 + 0.7 * c / most for _, c, _ in merged],
                    color=_EVENT_COLOUR, lw=1.2)
        lane.set_ylabel(kind, rotation=0, ha="right", va="center", fontsize=9)
        handles.append(Line2D([], [], color=_EVENT_COLOUR, lw=2, linestyle="none", marker="|",
                              ms=12, label=f"{kind} (tick height: count)"))
    for lane in lane_axes:
        lane.set_ylim(0, 1)
        lane.set_yticks([])
        lane.tick_params(labelbottom=False)
    (lane_axes[-1] if lane_axes else ax).set_xlabel("seconds since start")
    if lane_axes:
        ax.tick_params(labelbottom=False)
        lane_axes[-1].tick_params(labelbottom=True)
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)),
                   fontsize=9, frameon=True)
    return fig


def _write_png(report: MemoryReport, path: Path) -> None:
    _png_figure(report).savefig(str(path), format="png")
