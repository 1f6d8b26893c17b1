"""The timeline of memory reports, in HTML (SVG) and PNG: one y axis at round ticks for both,
a budget and a cap line, phases told apart by colour-blind-safe colours and patterns, event
lanes, and a legend outside the plot."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramkit.observe.leaks import LeakVerdict
from vramkit.observe.report import (
    MemoryReport,
    MemorySnapshot,
    PeakPoint,
    ProfileEvent,
    load_report,
    save_report,
)
from vramkit.observe.report_png import _png_figure
from vramkit.observe.report_svg import timeline_svg
from vramkit.observe.report_timeline import timeline_axis

MIB = 1 << 20
GIB = 1 << 30
OKABE_ITO = {"#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00",
             "#CC79A7"}
PHASES = ("swapped forward", "swapped backward", "swapped optimizer", "resident forward",
          "resident backward", "resident optimizer")


def _report(*, budget: int | None = None, limit: int | None = None, events: bool = True,
            top: int = 3 * GIB) -> MemoryReport:
    history = []
    t = 0.0
    for step in range(6):
        for k, phase in enumerate(PHASES[3 * (step % 2):3 * (step % 2) + 3]):
            for i in range(10):
                alloc = top // 2 + (k == 0) * i * (top // 20)
                history.append(MemorySnapshot(t, alloc, alloc + top // 10, alloc, None,
                                              top // 3, phase, top // 8, step, None,
                                              "mark" if i == 9 else "sample"))
                t += 0.01
    best = max(history, key=lambda s: s.allocated)
    peak = PeakPoint(best.allocated, best.timestamp, best.step, best.phase, None)
    marks = tuple(ProfileEvent(0.05 + 0.35 * i, "block loads", f"{i + 1} loads", i + 1, i,
                               "swapped") for i in range(5)) if events else ()
    return MemoryReport(
        device="cuda:0", metric="allocated", started_at=0.0, duration_s=t,
        sample_interval=0.01, num_samples=len(history), steps=6, peak=peak, peak_allocated=peak,
        peak_reserved=peak, peak_host_rss=None, peak_nvml_used=None, peak_pinned=top // 8,
        mean_allocated=0.0, mean_reserved=0.0, mean_host_rss=None, history=tuple(history),
        events=marks, budget=budget, budget_label=None if budget is None else "budget",
        memory_limit=limit)


def _boxes(svg: str) -> dict[str, tuple[float, ...]]:
    return {m.group(1): tuple(float(v) for v in m.group(2).split())
            for m in re.finditer(r'id="(vk-[a-z]+)" data-box="([^"]+)"', svg)}


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


# --- the y axis ----------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=1, max_value=1 << 45))
def test_axis_ticks_are_round_values_of_one_unit(high: int) -> None:
    report = dataclasses.replace(_report(events=False), history=(
        MemorySnapshot(0.0, high, 0, 0, None, None, None),), peak=PeakPoint(high))
    axis = timeline_axis(report)
    mantissa = axis.step / 10 ** math.floor(math.log10(axis.step))
    assert round(mantissa, 9) in (1.0, 2.0, 5.0)
    assert axis.top_bytes >= high  # every value fits
    assert axis.top - axis.step < high / axis.unit_bytes * 1.03  # and not much more
    assert 2 <= len(axis.ticks) <= 11 and axis.ticks[0] == 0 and axis.ticks[-1] == axis.top
    assert 1 <= high / axis.unit_bytes < 1024 or axis.unit in ("B", "TiB")
    assert all(abs(t / axis.step - round(t / axis.step)) < 1e-9 for t in axis.ticks)


def test_axis_covers_the_budget_and_the_cap() -> None:
    plain = timeline_axis(_report())
    assert plain.unit == "GiB" and plain.top_bytes >= 3 * GIB
    assert timeline_axis(_report(budget=8 * GIB)).top_bytes >= 8 * GIB
    assert timeline_axis(_report(limit=20 * GIB)).top_bytes >= 20 * GIB


def test_html_and_png_share_the_y_range_and_ticks() -> None:
    report = _report(budget=4 * GIB, limit=int(4.2 * GIB))
    svg = timeline_svg(report)
    axis = timeline_axis(report)
    top = int(re.search(r'data-y-top-bytes="(\d+)"', svg).group(1))  # type: ignore[union-attr]
    labels = re.findall(r'text-anchor="end" font-size="11">([^<]+)</text>', svg)
    assert top == axis.top_bytes
    assert labels[:len(axis.ticks)] == [axis.label(t) for t in axis.ticks]
    fig = _png_figure(report)
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert low == 0 and high * axis.unit_bytes == pytest.approx(top)
    assert list(ax.get_yticks()) == pytest.approx(axis.ticks)
    assert [t.get_text() for t in ax.get_yticklabels()] == [axis.label(t) for t in axis.ticks]


# --- lines, phases, events, legend -------------------------------------------------------------

def test_budget_and_cap_are_lines_at_their_values() -> None:
    report = _report(budget=4 * GIB, limit=5 * GIB)
    svg = timeline_svg(report)
    axis = timeline_axis(report)
    plot = _boxes(svg)["vk-plot"]

    def y_of(value: int) -> float:
        return plot[1] + plot[3] - value / axis.top_bytes * plot[3]

    for value, colour in ((4 * GIB, "#D55E00"), (5 * GIB, "#000000")):
        line = re.search(rf'<line x1="[\d.]+" x2="[\d.]+" y1="{y_of(value):.1f}" '
                         rf'y2="{y_of(value):.1f}" stroke="{colour}"', svg)
        assert line, value
    assert ">budget</text>" in svg and ">per-process cap 5.0 GiB</text>" in svg
    fig = _png_figure(report)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "budget" in labels and "per-process cap 5.0 GiB" in labels
    lines = {line.get_label(): line.get_ydata()[0] for line in fig.axes[0].get_lines()}
    assert lines["budget"] * axis.unit_bytes == pytest.approx(4 * GIB)
    assert "budget" not in timeline_svg(_report())


def test_phases_differ_by_colour_pattern_and_label() -> None:
    svg = timeline_svg(_report())
    lane = svg.split('id="vk-lanes"')[1].split("</g>")[0]
    styles: dict[str, tuple[str, str]] = {}
    for match in re.finditer(r'<rect [^>]*fill="(#[0-9A-F]{6})"><title>([^<(]+) \(', lane):
        colour, phase = match.group(1), match.group(2).strip()
        following = lane[match.end():].split("<rect", 2)
        pattern = ""
        if len(following) > 1 and "url(#vk-phase-pattern-" in following[1]:
            pattern = following[1].split("url(#vk-phase-pattern-")[1].split(")")[0]
        styles.setdefault(phase, (colour, pattern))
    assert set(styles) == set(PHASES)
    colours = [c for c, _ in styles.values()]
    patterns = [p for _, p in styles.values()]
    assert len(set(colours)) == len(PHASES) and set(colours) <= OKABE_ITO
    assert len(set(patterns)) == len(PHASES)  # told apart without colour too
    legend = svg.split('id="vk-legend"')[1]
    for phase in PHASES:
        assert f">phase: {phase}</text>" in legend
    fig = _png_figure(_report())
    hatches = {t.get_text(): h.get_hatch() for t, h in
               zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles, strict=True)
               if t.get_text().startswith("phase: ")}
    assert len(hatches) == len(PHASES) and len(set(hatches.values())) == len(PHASES)


def test_event_lane_draws_one_tick_per_event_sized_by_count() -> None:
    svg = timeline_svg(_report())
    lanes = svg.split('id="vk-lanes"')[1].split("</g>")[0]
    assert ">block loads</text>" in lanes
    ticks = re.findall(r'<line x1="([\d.]+)" x2="[\d.]+" y1="([\d.]+)" y2="([\d.]+)" '
                       r'stroke="#000000" stroke-width="1.5"><title>(\d) loads', lanes)
    assert len(ticks) == 5
    heights = [float(y1) - float(y2) for _, y1, y2, _ in ticks]
    assert heights == sorted(heights) and heights[0] < heights[-1]  # counts 1..5
    xs = [float(x) for x, _, _, _ in ticks]
    assert xs == sorted(xs)
    no_events = timeline_svg(_report(events=False))
    assert "block loads" not in no_events


def test_svg_legend_sits_below_the_plot_and_lanes_and_holds_its_text() -> None:
    svg = timeline_svg(_report(budget=4 * GIB, limit=5 * GIB))
    boxes = _boxes(svg)
    plot, lanes, legend = boxes["vk-plot"], boxes["vk-lanes"], boxes["vk-legend"]
    assert not _overlap(legend, plot) and not _overlap(legend, lanes)
    assert not _overlap(lanes, plot) and legend[1] >= lanes[1] + lanes[3]
    height = float(re.search(r'<svg width="\d+" height="(\d+)"', svg).group(1))  # type: ignore[union-attr]
    assert legend[1] + legend[3] <= height
    # every legend label, at a generous 0.62 em per glyph, ends inside the legend box
    for x, text in re.findall(r'<text x="([\d.]+)" y="[\d.]+">([^<]+)</text>',
                              svg.split('id="vk-legend"')[1]):
        assert float(x) + len(text) * 0.62 * 12 <= legend[0] + legend[2]


def test_png_legend_is_outside_the_axes(tmp_path: Path) -> None:
    fig = _png_figure(_report(budget=4 * GIB, limit=5 * GIB))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert not legend.overlaps(ax.get_window_extent(renderer))
    assert len(fig.axes) == 3  # the plot, the phase lane, the block-loads lane
    assert save_report(_report(), tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# --- files -----------------------------------------------------------------------------------------

def test_version_1_files_still_load(tmp_path: Path) -> None:
    report = _report(budget=GIB, limit=2 * GIB)
    verdict = LeakVerdict(False, True, 0.0, 0, 8, None, "allocated", 262144, (), "swapped")
    report = dataclasses.replace(report, leak=verdict, leak_by_workload={"swapped": verdict})
    path = save_report(report, tmp_path / "r.json")
    assert load_report(path) == report
    data = json.loads(path.read_text())
    for key in ("leak_by_workload", "events", "event_fields", "events_dropped", "budget",
                "budget_label", "memory_limit"):
        data.pop(key)
    data["version"] = 1
    data["leak"].pop("workload")
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(data))
    loaded = load_report(old)
    assert loaded.events == () and loaded.budget is None and loaded.leak_by_workload == {}
    assert loaded.leak is not None and loaded.leak.workload is None
