"""The HTML report's timeline as inline SVG: the plot, the lanes under it and the legend.

:func:`timeline_svg` draws it; :func:`_svg_swatch` draws one legend swatch and
:func:`_svg_patterns` the phases' fill patterns. Scales, colours and series come from
:mod:`vramkit.observe.report_timeline` (shared with the PNG).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from vramkit.observe.report_timeline import (
    _BUDGET_COLOUR,
    _EVENT_COLOUR,
    _LIMIT_COLOUR,
    _PHASE_COLOURS,
    _PHASE_HATCHES,
    _SERIES,
    _bucket_events,
    _downsample,
    _event_kinds,
    _phase_spans,
    _phase_styles,
    _time_range,
    _time_ticks,
    timeline_axis,
)
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.observe.report import MemoryReport

__all__ = ["timeline_svg"]

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
                   f'({html.escape(peak.where())})</title></circle>')
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
