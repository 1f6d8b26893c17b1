"""What both report timelines (the HTML report's SVG and the PNG) share: the y axis, the colours,
the series and the reductions of the history they draw (downsampling, phase runs, event buckets).

Drawing is left to :mod:`vramkit.observe.report_svg` and :mod:`vramkit.observe.report_png`, so both
show the same range in the same unit and colours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramkit.observe.report import MemoryReport, MemorySnapshot, ProfileEvent

__all__ = ["TimelineAxis", "timeline_axis"]

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

