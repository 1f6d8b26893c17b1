"""Memory reports: the records a :class:`~vramkit.memory.profiler.MemoryProfiler` produces, and
their files.

:class:`MemoryReport` holds the summary (peaks with time, step, phase and module; means; per-phase
peaks; top modules by activation memory; allocator counters; the leak verdict) and the sampled
history. :func:`save_report` writes it by file suffix:

- ``.json``: every field, loadable again with :func:`load_report` (equal to the original).
- ``.html``: one self-contained file (inline CSS and an inline SVG timeline; no script, no network).
- ``.png``: the timeline drawn with matplotlib's Agg canvas (matplotlib is imported only here).
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
from vramkit.memory.leaks import LeakVerdict
from vramkit.units import format_size

__all__ = ["MemoryReport", "MemorySnapshot", "ModuleMemory", "PeakPoint", "PhasePeak",
           "load_report", "save_report"]

logger = logging.getLogger(__name__)

_FORMAT = "vramkit.memory_report"
_VERSION = 1


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
            history=history, history_dropped=data["history_dropped"])

    def save(self, path: str | Path) -> Path:
        """Write the report; the format follows the suffix (see :func:`save_report`)."""
        return save_report(self, path)

    def summary_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows for tables (CLI and HTML)."""
        rows = [
            ("device", self.device),
            ("duration", f"{self.duration_s:.2f} s ({self.num_samples} samples, "
                         f"{self.steps} steps)"),
            (f"peak ({self.metric})", f"{format_size(self.peak.value)} at "
                                      f"{_where(self.peak)}"),
            ("peak allocated", format_size(self.peak_allocated.value)),
            ("peak reserved", format_size(self.peak_reserved.value)),
            ("mean allocated", format_size(self.mean_allocated)),
        ]
        if self.peak_host_rss is not None:
            rows.append(("peak host RSS", format_size(self.peak_host_rss.value)))
        if self.peak_nvml_used is not None:
            rows.append(("peak NVML process memory", format_size(self.peak_nvml_used)))
        if self.outside_torch is not None:
            rows.append(("GPU memory outside PyTorch", format_size(self.outside_torch)))
        rows.append(("peak pinned pools", format_size(self.peak_pinned)))
        rows.append(("allocations", _opt(self.num_allocations)))
        if self.fragmentation is not None:
            rows.append(("fragmentation (1 - alloc/reserved)", f"{self.fragmentation:.1%}"))
        if self.alloc_retries is not None:
            rows.append(("allocator retries / OOMs", f"{self.alloc_retries} / {self.ooms}"))
        rows.append(("leak", _leak_text(self.leak)))
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


def _leak_text(verdict: LeakVerdict | None) -> str:
    if verdict is None:
        return "not checked (no step() calls)"
    if verdict.leak:
        return (f"LEAK: {format_size(verdict.bytes_per_step)}/step since step "
                f"{verdict.first_leak_step} ({verdict.metric})")
    state = "no leak" if verdict.conclusive else "no leak so far (too few steps to be sure)"
    return f"{state} ({verdict.steps} steps, {verdict.metric})"


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


# Series drawn on the timeline: (attribute, label, colour).
_SERIES = (("allocated", "allocated", "#1f77b4"), ("reserved", "reserved", "#ff7f0e"),
           ("nvml_used", "NVML process", "#9467bd"), ("host_rss", "host RSS", "#2ca02c"),
           ("pinned", "pinned pools", "#8c564b"))
_PHASE_COLOURS = ("#dbe7fb", "#fde8e8", "#e6f4ea", "#fef7e0", "#f3e8fd", "#e0f7fa", "#fce4ec")


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


def _height(snap: MemorySnapshot) -> int:
    return max(snap.allocated, snap.reserved, snap.nvml_used or 0, snap.host_rss or 0)


def _phase_spans(history: Sequence[MemorySnapshot]) -> list[tuple[float, float, str]]:
    spans: list[tuple[float, float, str]] = []
    for snap in history:
        if snap.phase is None:
            continue
        if spans and spans[-1][2] == snap.phase:
            spans[-1] = (spans[-1][0], snap.timestamp, snap.phase)
        else:
            spans.append((snap.timestamp, snap.timestamp, snap.phase))
    return spans


def _nice_ticks(top: float, count: int = 5) -> list[float]:
    if top <= 0:
        return [0.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(top / step) + 1)]


def timeline_svg(report: MemoryReport, width: int = 960, height: int = 320) -> str:
    """The timeline as an inline ``<svg>`` element (lines per series, phase bands, the peak)."""
    left, right, top, bottom = 80, 20, 20, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    history = _downsample(report.history, plot_w)
    # No xmlns: inline SVG in HTML5 needs none, and the file must hold no URL at all.
    out = [f'<svg width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="memory timeline">',
           f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fff" '
           'stroke="#999"/>']
    if not history:
        out.append(f'<text x="{left + 10}" y="{top + 20}">no samples</text></svg>')
        return "".join(out)
    t0 = history[0].timestamp
    t_span = (history[-1].timestamp - t0) or 1.0
    y_top = max(_height(s) for s in history) * 1.05 or 1.0

    def x_of(t: float) -> float:
        return left + (t - t0) / t_span * plot_w

    def y_of(v: float) -> float:
        return top + plot_h - v / y_top * plot_h

    phases = sorted({s.phase for s in report.history if s.phase is not None})
    colour_of = {p: _PHASE_COLOURS[i % len(_PHASE_COLOURS)] for i, p in enumerate(phases)}
    for start, end, phase in _phase_spans(report.history):
        x0, x1 = x_of(start), x_of(end)
        out.append(f'<rect x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 1.0):.1f}" '
                   f'height="{plot_h}" fill="{colour_of[phase]}"><title>{html.escape(phase)}'
                   '</title></rect>')
    for tick in _nice_ticks(y_top / 1.05):
        y = y_of(tick)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">'
                   f'{html.escape(format_size(tick))}</text>')
    for tick in _nice_ticks(t_span):
        x = x_of(t0 + tick)
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" font-size="11" '
                   f'text-anchor="middle">{tick:g}s</text>')
    for attr, label, colour in _SERIES:
        values = [getattr(s, attr) for s in history]
        if all(v is None or v == 0 for v in values):
            continue
        points = " ".join(f"{x_of(s.timestamp):.1f},{y_of(v):.1f}"
                          for s, v in zip(history, values, strict=True) if v is not None)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                   f'points="{points}"><title>{label}</title></polyline>')
    peak = report.peak
    if peak.value > 0:
        px, py = x_of(min(max(peak.timestamp, t0), t0 + t_span)), y_of(peak.value)
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#d62728">'
                   f'<title>peak {html.escape(format_size(peak.value))} '
                   f'({html.escape(_where(peak))})</title></circle>')
    legend_x = left + 8
    for attr, label, colour in _SERIES:
        if all(getattr(s, attr) in (None, 0) for s in history):
            continue
        out.append(f'<rect x="{legend_x}" y="{top + 6}" width="10" height="10" '
                   f'fill="{colour}"/><text x="{legend_x + 14}" y="{top + 15}" '
                   f'font-size="11">{label}</text>')
        legend_x += 24 + 7 * len(label)
    for phase in phases:
        out.append(f'<rect x="{legend_x}" y="{top + 6}" width="10" height="10" '
                   f'fill="{colour_of[phase]}" stroke="#999"/><text x="{legend_x + 14}" '
                   f'y="{top + 15}" font-size="11">{html.escape(phase)}</text>')
        legend_x += 24 + 7 * len(phase)
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 6}" font-size="11" '
               'text-anchor="middle">seconds since start</text></svg>')
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
                            [(name, format_size(p.allocated), format_size(p.reserved),
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


def _write_png(report: MemoryReport, path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise _MissingDependencyError(
            f"saving a PNG memory timeline needs matplotlib ({err})") from err
    # A bare Figure on the Agg canvas: no pyplot, so the user's backend choice is left alone.
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    history = report.history
    times = [s.timestamp for s in history]
    phases = sorted({s.phase for s in history if s.phase is not None})
    labelled: set[str] = set()
    for start, end, phase in _phase_spans(history):
        colour = _PHASE_COLOURS[phases.index(phase) % len(_PHASE_COLOURS)]
        ax.axvspan(start, max(end, start + 1e-9), color=colour, alpha=0.8, lw=0,
                   label=None if phase in labelled else f"phase {phase}")
        labelled.add(phase)
    for attr, label, colour in _SERIES:
        values = [getattr(s, attr) for s in history]
        if all(v is None or v == 0 for v in values):
            continue
        ax.plot(times, [(v or 0) / 2**20 for v in values], label=label, color=colour, lw=1.2)
    if report.peak.value > 0:
        ax.plot([report.peak.timestamp], [report.peak.value / 2**20], "o", color="#d62728",
                label=f"peak {format_size(report.peak.value)}")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("MiB")
    ax.set_title(f"vramkit memory timeline ({report.device})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
