"""The memory report as one self-contained HTML page: the SVG timeline and the tables."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vramkit.observe.report_svg import timeline_svg
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.observe.report import MemoryReport

__all__ = ["render_html"]  # write_html is reached through save_report


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


def write_html(report: MemoryReport, path: Path) -> None:
    """Write :func:`render_html` of ``report`` to ``path`` (UTF-8)."""
    path.write_text(render_html(report), encoding="utf-8")

