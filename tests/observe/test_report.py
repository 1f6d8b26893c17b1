"""MemoryReport files: JSON round trip, self-contained HTML with an SVG timeline, PNG."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.observe import profiler as profiler_mod
from vramkit.observe.leaks import LeakSuspect, LeakVerdict
from vramkit.observe.profiler import MemoryProfiler, MemoryReport
from vramkit.observe.report import (
    MemorySnapshot,
    ModuleMemory,
    PeakPoint,
    PhasePeak,
    load_report,
    save_report,
)
from vramkit.observe.report_html import render_html
from vramkit.observe.report_svg import timeline_svg

MIB = 1 << 20


def _synthetic(n: int = 50) -> MemoryReport:
    history = tuple(
        MemorySnapshot(timestamp=i * 0.01, allocated=(i % 10) * MIB, reserved=12 * MIB,
                       active=(i % 10) * MIB, nvml_used=20 * MIB if i % 2 else None,
                       host_rss=300 * MIB, phase="forward" if i < 25 else "<backward>",
                       pinned=MIB, step=i // 10, module="blocks.0" if i == 39 else None)
        for i in range(n))
    peak = PeakPoint(9 * MIB, 0.39, 3, "<backward>", "blocks.0")
    leak = LeakVerdict(True, True, float(MIB), 3 * MIB, 5, 5, "cuda_allocated", 262144,
                       (LeakSuspect(("train.py:12 in step", "train.py:40 in <module>"), 4 * MIB,
                                    4, "block of 1048576 B"),))
    return MemoryReport(
        device="cuda:0", metric="allocated", started_at=1_700_000_000.5, duration_s=0.5,
        sample_interval=0.01, num_samples=n, steps=5, peak=peak, peak_allocated=peak,
        peak_reserved=PeakPoint(12 * MIB, 0.0, 0, None, None),
        peak_host_rss=PeakPoint(300 * MIB, 0.0, 0, None, None), peak_nvml_used=20 * MIB,
        peak_pinned=MIB, mean_allocated=4.5 * MIB, mean_reserved=12.0 * MIB,
        mean_host_rss=300.0 * MIB,
        phase_peaks={"forward": PhasePeak(9 * MIB, 12 * MIB, 300 * MIB, 25),
                     "<backward>": PhasePeak(9 * MIB, 12 * MIB, 300 * MIB, 25)},
        top_modules=(ModuleMemory("blocks.0", "Block<T>", 5, 2 * MIB, 10 * MIB, MIB, 1),),
        num_allocations=123, alloc_retries=0, ooms=0, fragmentation=0.25,
        inactive_split_ratio=0.05, outside_torch=8 * MIB, leak=leak, history=history,
        history_dropped=7)


def test_json_round_trip(tmp_path: Path) -> None:
    report = _synthetic()
    path = save_report(report, tmp_path / "sub" / "r.json")
    assert path.exists()
    loaded = load_report(path)
    assert loaded == report
    data = json.loads(path.read_text())
    assert data["format"] == "vramkit.memory_report" and len(data["history"]) == 50


def test_json_round_trip_of_a_real_session(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler_mod, "nvml_process_memory", lambda pid=None: None)
    with MemoryProfiler("cpu", sample_interval=0.002) as profiler:
        with profiler.phase("forward"):
            torch.ones(MIB).sum()
            time.sleep(0.01)
        profiler.step()
    path = profiler.save_profile(tmp_path / "profile.json")
    assert load_report(path) == profiler.report()


def test_from_dict_rejects_other_json(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ConfigError):
        load_report(path)


def test_html_is_self_contained_with_svg(tmp_path: Path) -> None:
    report = _synthetic()
    path = save_report(report, tmp_path / "r.html")
    text = path.read_text(encoding="utf-8")
    assert "<svg" in text and "<polyline" in text
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text and "<link" not in text
    assert "&lt;backward&gt;" in text and "<backward>" not in text  # phase names are escaped
    assert "Block&lt;T&gt;" in text and "train.py:12 in step" in text
    assert "Top modules" in text and "Leak suspects" in text


def test_svg_keeps_the_peak_when_downsampling() -> None:
    history = [MemorySnapshot(i * 0.001, 0, 0, 0, None, 100 * MIB, None) for i in range(20_000)]
    history[12_345] = MemorySnapshot(12.345, 0, 0, 0, None, 900 * MIB, None)
    report = _synthetic()
    report = MemoryReport(**{**report.__dict__, "history": tuple(history), "leak": None})
    svg = timeline_svg(report, width=400)
    points = svg.split('<polyline')[1].split('points="')[1].split('"')[0].split()
    assert len(points) <= 400
    ys = [float(p.split(",")[1]) for p in points]
    assert min(ys) < 40 < 200 < max(ys)  # the 900 MiB spike still reaches the top


def test_png_is_written(tmp_path: Path) -> None:
    path = save_report(_synthetic(), tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_a_clear_error(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="matplotlib"):
        save_report(_synthetic(), tmp_path / "r.png")


def test_unknown_suffix_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        save_report(_synthetic(), tmp_path / "r.csv")


def test_summary_rows_name_peak_context() -> None:
    rows = dict(_synthetic().summary_rows())
    assert "blocks.0" in rows["peak (allocated)"] and "step 3" in rows["peak (allocated)"]
    assert rows["allocations"] == "123"
    assert rows["leak"].startswith("LEAK")
    html = render_html(_synthetic())
    assert "GPU memory outside PyTorch" in html


def test_cpu_reports_show_allocator_figures_as_not_measured() -> None:
    # Issue 17: figures that were not measured show as n/a, never "0 B".
    from vramkit.observe.profiler import MemoryProfiler

    with MemoryProfiler(device="cpu", sample_interval=0.01) as prof:
        prof.mark("work")
    report = prof.report()
    rows = dict(report.summary_rows())
    assert not report.measures_cuda
    for label in ("peak allocated", "peak reserved", "mean allocated", "peak pinned pools"):
        assert rows[label].startswith("n/a"), (label, rows[label])
    from vramkit.observe.report_html import render_html

    assert "n/a (no CUDA allocator)" in render_html(report)


def test_a_report_that_fails_while_written_leaves_the_previous_one_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.observe import report as report_module

    path = save_report(_synthetic(), tmp_path / "r.json")
    before = path.read_bytes()

    def half_written(report: object, target: Path) -> None:
        target.write_text('{"truncated": ')
        raise KeyboardInterrupt  # as a Ctrl-C or a kill would stop it midway

    monkeypatch.setattr(report_module, "_write_json", half_written)
    with pytest.raises(KeyboardInterrupt):
        save_report(_synthetic(), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
