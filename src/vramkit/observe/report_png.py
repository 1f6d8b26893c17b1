"""The memory report's timeline as a PNG, drawn with matplotlib's Agg canvas.

matplotlib is imported only when a PNG is drawn, and only here: it is an optional dependency.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramkit.errors import VramkitError
from vramkit.observe.report_timeline import (
    _BUDGET_COLOUR,
    _EVENT_COLOUR,
    _LIMIT_COLOUR,
    _PHASE_COLOURS,
    _PHASE_HATCHES,
    _SERIES,
    _bucket_events,
    _event_kinds,
    _phase_spans,
    _phase_styles,
    _time_range,
    timeline_axis,
)
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.observe.report import MemoryReport

__all__: list[str] = []  # reached through save_report (.png)


class _MissingDependencyError(VramkitError, ImportError):
    """An optional library needed for one output format is not installed."""

    default_hint = "pip install matplotlib (or save the report as .json or .html)."



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


def write_png(report: MemoryReport, path: Path) -> None:
    """Draw ``report``'s timeline (:func:`_png_figure`) into a PNG file at ``path``."""
    _png_figure(report).savefig(str(path), format="png")
