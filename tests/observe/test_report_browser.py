"""The HTML memory report in a real browser: headless Chromium renders it, and what it draws is
checked: the plot has content, the legend, lanes and plot do not overlap (measured by the
browser's own layout), and a screenshot shows the plot area in colour.

Skipped where no Chromium binary is installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vramkit.observe.leaks import LeakVerdict
from vramkit.observe.report import (
    MemoryReport,
    MemorySnapshot,
    PeakPoint,
    ProfileEvent,
    save_report,
)

MIB = 1 << 20
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_WINDOW = (1400, 900)


def _browser() -> str | None:
    for name in _BROWSERS:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


pytestmark = pytest.mark.skipif(_browser() is None,
                                reason="no chromium binary (apt-get install chromium)")


def _run_browser(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    browser = _browser()
    assert browser is not None
    profile = tmp_path / "chromium-profile"
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--window-size={_WINDOW[0]},{_WINDOW[1]}", *args]
    env = {**os.environ, "HOME": str(tmp_path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env,
                            check=False)
    if result.returncode != 0:
        pytest.fail(f"chromium failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


def _demo_like_report() -> MemoryReport:
    """Two workloads with three phases each, block loads in the swapped one, a budget and a cap."""
    history: list[MemorySnapshot] = []
    events: list[ProfileEvent] = []
    t, step = 0.0, 0
    for run, workload in enumerate(("swapped", "resident")):
        for _ in range(5):
            for k, phase in enumerate(("forward", "backward", "optimizer")):
                n = (12, 20, 4)[k]
                for i in range(n):
                    base = (900 if run == 0 else 2400) * MIB
                    alloc = base + (k == 0) * i * 40 * MIB + (k == 1) * (n - i) * 30 * MIB
                    history.append(MemorySnapshot(
                        t, alloc, alloc + 300 * MIB, alloc, None, 3000 * MIB,
                        f"{workload} {phase}", 512 * MIB, step, None,
                        "mark" if i == n - 1 else "sample"))
                    t += 0.01
                if workload == "swapped" and k < 2:
                    events.append(ProfileEvent(t, "block loads", f"{6 + k} loads in {phase}",
                                               6 + k, step, workload))
            step += 1
    top = max(history, key=lambda s: s.allocated)
    peak = PeakPoint(top.allocated, top.timestamp, top.step, top.phase, None)
    verdict = LeakVerdict(False, True, 0.0, 0, 5, None, "allocated", 262144, (), "swapped")
    return MemoryReport(
        device="cuda:0", metric="allocated", started_at=0.0, duration_s=t,
        sample_interval=0.01, num_samples=len(history), steps=step, peak=peak,
        peak_allocated=peak, peak_reserved=peak, peak_host_rss=None, peak_nvml_used=None,
        peak_pinned=512 * MIB, mean_allocated=0.0, mean_reserved=0.0, mean_host_rss=None,
        leak=verdict, leak_by_workload={"swapped": verdict, "resident": verdict},
        history=tuple(history), events=tuple(events), budget=4096 * MIB,
        budget_label="budget 4 GiB", memory_limit=4200 * MIB)


# Measures what the browser laid out and writes it into the page (the report itself holds no
# script: this runs on a copy).
_MEASURE = """<script>
const box = el => { const r = el.getBoundingClientRect();
  return [r.left, r.top, r.width, r.height]; };
const q = s => document.querySelector(s);
const out = {
  plot: box(q('#vk-plot > rect')), lanes: box(q('#vk-lanes')),
  legend: box(q('#vk-legend > rect')), legendGroup: box(q('#vk-legend')),
  legendTexts: [...document.querySelectorAll('#vk-legend text')].map(box),
  svg: box(q('svg')),
};
const pre = document.createElement('pre'); pre.id = 'vk-measure';
pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
</script>"""


def _measure(html_path: Path, tmp_path: Path) -> dict[str, Any]:
    probe = tmp_path / "probe.html"
    probe.write_text(html_path.read_text(encoding="utf-8").replace("</body>", _MEASURE + "</body>"),
                     encoding="utf-8")
    dom = _run_browser(["--dump-dom", probe.as_uri()], tmp_path).stdout
    found = re.search(r'<pre id="vk-measure">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def _overlap(a: list[float], b: list[float]) -> bool:
    return (a[0] < b[0] + b[2] and b[0] < a[0] + a[2]
            and a[1] < b[1] + b[3] and b[1] < a[1] + a[3])


def _inside(inner: list[float], outer: list[float], slack: float = 0.5) -> bool:
    return (inner[0] >= outer[0] - slack and inner[1] >= outer[1] - slack
            and inner[0] + inner[2] <= outer[0] + outer[2] + slack
            and inner[1] + inner[3] <= outer[1] + outer[3] + slack)


def test_browser_layout_keeps_the_legend_off_the_plot(tmp_path: Path) -> None:
    html_path = save_report(_demo_like_report(), tmp_path / "report.html")
    m = _measure(html_path, tmp_path)
    plot, lanes, legend = m["plot"], m["lanes"], m["legend"]
    assert plot[2] > 500 and plot[3] > 150  # drawn at a readable size
    assert not _overlap(legend, plot) and not _overlap(m["legendGroup"], plot)
    assert not _overlap(lanes, plot) and not _overlap(lanes, legend)
    assert legend[1] >= lanes[1] + lanes[3]  # the legend sits in its own rows, below
    texts = m["legendTexts"]
    assert len(texts) >= 10  # series, peak, budget, cap, six phases, block loads
    for text in texts:  # the browser's real glyph widths fit the box the legend drew
        assert _inside(text, legend), (text, legend)
    for a, b in ((a, b) for i, a in enumerate(texts) for b in texts[i + 1:]):
        assert not _overlap(a, b), (a, b)


def test_browser_screenshot_shows_the_plot(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    image_module = pytest.importorskip("matplotlib.image")
    html_path = save_report(_demo_like_report(), tmp_path / "report.html")
    m = _measure(html_path, tmp_path)
    shot = tmp_path / "report.png"
    _run_browser([f"--screenshot={shot}", html_path.as_uri()], tmp_path)
    pixels = image_module.imread(str(shot))[..., :3]
    assert pixels.shape[1] == _WINDOW[0]

    def crop(box: list[float]) -> Any:
        x, y, w, h = (round(v) for v in box)
        return pixels[y + 2:y + h - 2, x + 2:x + w - 2]

    plot = crop(m["plot"])
    assert plot.size > 0
    colours = {tuple(c) for c in (plot.reshape(-1, 3) * 255).round().astype(int).tolist()}
    assert len(colours) >= 12  # bands, lines, grid: not a blank box
    non_white = (plot < 0.97).any(axis=-1).mean()
    assert non_white > 0.3  # phase bands fill the background, lines on top
    lane = crop(m["lanes"])
    assert (lane < 0.97).any(axis=-1).mean() > 0.3  # the phase lane is filled
    legend = crop(m["legend"])
    assert 0.01 < (legend < 0.9).any(axis=-1).mean() < 0.6  # swatches and text, not a blot
    assert np.isfinite(pixels).all()
