"""MemoryProfiler: leak verdicts per workload, optimizer-step counting, events, budget and cap
lines, and the allocation-trace check."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from vramkit.errors import ConfigError, DeviceError
from vramkit.observe import leaks as leaks_mod
from vramkit.observe import profiler as profiler_mod
from vramkit.observe.leaks import LeakDetector
from vramkit.observe.profiler import MemoryProfiler, trace_unsupported_reason
from vramkit.observe.report import load_report
from vramkit.observe.report_html import render_html

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler_mod, "nvml_process_memory", lambda pid=None: None)


class _FakeAllocator:
    """A CUDA allocator whose allocated bytes the test sets."""

    def __init__(self) -> None:
        self.current = 100 * MIB

    def read(self, index: int) -> tuple[int, int, int, int, int]:
        return (self.current, 2 * self.current, self.current, self.current, 2 * self.current)

    def flat(self, index: int | None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.current}


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeAllocator:
    fake = _FakeAllocator()
    for module in (profiler_mod, leaks_mod):
        monkeypatch.setattr(module, "resolve_cuda_index", lambda device=None: 0)
        monkeypatch.setattr(module, "cuda_initialized", lambda: True)
        monkeypatch.setattr(module, "read_cuda_figures", fake.read)
    monkeypatch.setattr(profiler_mod, "reset_cuda_peak", lambda index: None)
    monkeypatch.setattr(profiler_mod, "read_memory_stats", fake.flat)
    monkeypatch.setattr(profiler_mod, "reserved_all_devices", lambda: 0)
    monkeypatch.setattr(profiler_mod, "_cuda_memory_limit", lambda index: None)
    return fake


# --- leak verdicts per workload ----------------------------------------------------------------

def _two_runs(profiler: MemoryProfiler, fake: _FakeAllocator, *, named: bool,
              resident_leak: int = 0) -> None:
    """8 flat steps of a swapped run at 100 MiB, then 8 of a resident run at 600 MiB (the whole
    model on the device), optionally growing by ``resident_leak`` bytes per step."""
    for _ in range(8):
        fake.current = 100 * MIB
        if named:
            with profiler.workload("swapped"):
                profiler.step()
        else:
            profiler.step()
    for i in range(8):
        fake.current = 600 * MIB + i * resident_leak
        if named:
            with profiler.workload("resident"):
                profiler.step()
        else:
            profiler.step()


def test_a_second_run_after_the_first_is_not_a_leak(fake_cuda: _FakeAllocator) -> None:
    with MemoryProfiler(0, sample_interval=10.0) as unnamed:
        _two_runs(unnamed, fake_cuda, named=False)
    # one timeline judged as one workload: the switch reads as growth
    assert unnamed.report().leak is not None and unnamed.report().leak.leak

    with MemoryProfiler(0, sample_interval=10.0) as profiler:
        _two_runs(profiler, fake_cuda, named=True)
        assert profiler.current_workload is None  # restored after each block
    report = profiler.report()
    assert report.leak is not None and not report.leak.leak and report.leak.conclusive
    assert set(report.leak_by_workload) == {"swapped", "resident"}
    assert all(v.steps == 8 and not v.leak for v in report.leak_by_workload.values())
    assert report.steps == 16
    assert "LEAK" not in dict(report.summary_rows())["leak"]


@pytest.mark.parametrize("detector", [False, True])
def test_a_leak_within_one_workload_is_still_reported(fake_cuda: _FakeAllocator,
                                                      detector: bool) -> None:
    leak_detector = LeakDetector(0, record_stacks=False) if detector else False
    with MemoryProfiler(0, sample_interval=10.0, detect_leaks=leak_detector) as profiler:
        _two_runs(profiler, fake_cuda, named=True, resident_leak=MIB)
    report = profiler.report()
    assert report.leak is not None and report.leak.leak
    assert report.leak.workload == "resident"
    assert report.leak.bytes_per_step == pytest.approx(MIB)
    assert not report.leak_by_workload["swapped"].leak
    assert dict(report.summary_rows())["leak"].startswith("LEAK in resident: 1.0 MiB/step")


def test_alternating_workloads_are_each_judged_on_their_own_steps(
        fake_cuda: _FakeAllocator) -> None:
    """Steps of two runs interleaved (paired timing): each run at its own level."""
    with MemoryProfiler(0, sample_interval=10.0) as profiler:
        for _ in range(8):
            for name, level in (("swapped", 100), ("resident", 600)):
                fake_cuda.current = level * MIB
                with profiler.workload(name):
                    profiler.step()
    report = profiler.report()
    assert not report.leak.leak  # type: ignore[union-attr]
    assert {k: v.steps for k, v in report.leak_by_workload.items()} == {
        "swapped": 8, "resident": 8}
    assert all(v.growth_bytes == 0 for v in report.leak_by_workload.values())


def test_too_few_steps_of_a_workload_are_not_judged(fake_cuda: _FakeAllocator) -> None:
    with MemoryProfiler(0, sample_interval=10.0) as profiler:
        for i in range(3):  # growing, but 3 steps are no steady state
            fake_cuda.current = (100 + 50 * i) * MIB
            with profiler.workload("short"):
                profiler.step()
    verdict = profiler.report().leak_by_workload["short"]
    assert not verdict.leak and not verdict.conclusive
    assert "too few steps" in dict(profiler.report().summary_rows())["leak"]


def test_workload_names_are_checked() -> None:
    profiler = MemoryProfiler("cpu")
    for bad in ("", 3):
        with pytest.raises(ConfigError):
            profiler.set_workload(bad)  # type: ignore[arg-type]


def test_cpu_detector_judges_workloads_apart() -> None:
    """The CPU detector's readings (live tensor bytes): the second run's optimizer state
    appears at the switch; it is no leak."""
    state: list[torch.Tensor] = []
    with LeakDetector("cpu", record_stacks=False) as detector:
        for _ in range(6):
            detector.step(workload="a")
        state.append(torch.zeros(4 * MIB // 4))  # the second run's state, made once
        for _ in range(6):
            detector.step(workload="b")
        verdicts = detector.verdicts()
        assert set(verdicts) == {"a", "b"}
        assert not any(v.leak for v in verdicts.values())
        assert not detector.verdict().leak
        for _ in range(5):  # now b leaks 1 MiB per step
            state.append(torch.zeros(MIB // 4))
            detector.step(workload="b")
        assert detector.verdict().leak and detector.verdict().workload == "b"
        assert not detector.verdicts()["a"].leak


# --- counting optimizer steps ------------------------------------------------------------------

def _hooks() -> int:
    from torch.optim import optimizer as optimizer_mod

    return len(optimizer_mod._global_optimizer_post_hooks)


def test_optimizer_steps_are_counted_without_step_calls() -> None:
    """A plain training loop that never calls prof.step(): steps and leak checks still run."""
    hooks_before = _hooks()
    w = torch.randn(32, 32, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.01)
    store: list[torch.Tensor] = []
    with MemoryProfiler("cpu", sample_interval=10.0, count_optimizer_steps=True,
                        detect_leaks=LeakDetector("cpu", record_stacks=False)) as profiler:
        assert _hooks() == hooks_before + 1
        for _ in range(6):
            (w @ w).sum().backward()
            opt.step()
            opt.zero_grad()
            store.append(torch.ones(MIB // 4))  # a 1 MiB leak per iteration
    assert _hooks() == hooks_before  # removed at stop
    report = profiler.report()
    assert report.steps == 6
    assert report.leak is not None and report.leak.leak and report.leak.steps == 6
    opt.step()  # after stop: not counted
    assert profiler.steps == 6


def test_several_optimizers_in_one_iteration_count_once() -> None:
    g = torch.randn(8, requires_grad=True)
    d = torch.randn(8, requires_grad=True)
    opt_g, opt_d = torch.optim.SGD([g], lr=0.1), torch.optim.SGD([d], lr=0.1)
    with MemoryProfiler("cpu", sample_interval=10.0, count_optimizer_steps=True) as profiler:
        for _ in range(5):
            for _ in range(2):  # two critic steps per generator step (a GAN-style loop)
                (d * g.detach()).sum().backward()
                opt_d.step()
            (d.detach() * g).sum().backward()
            opt_g.step()
    # counted at the first optimizer of each iteration (opt_d); its repeat within the
    # iteration counts too, by the rule (an optimizer that already stepped)
    assert profiler.steps == 10
    with MemoryProfiler("cpu", sample_interval=10.0, count_optimizer_steps=True) as profiler:
        for _ in range(5):
            (d * g).sum().backward()
            opt_d.step()
            opt_g.step()
    assert profiler.steps == 5
    assert [s.step for s in profiler.history if s.kind == "step"] == [0, 1, 2, 3, 4]


def test_optimizer_steps_are_not_counted_by_default_or_after_a_manual_step() -> None:
    w = torch.randn(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    with MemoryProfiler("cpu", sample_interval=10.0) as profiler:
        for _ in range(3):
            w.sum().backward()
            opt.step()
    assert profiler.steps == 0
    with MemoryProfiler("cpu", sample_interval=10.0, count_optimizer_steps=True) as profiler:
        w.sum().backward()
        opt.step()  # counted: 1
        profiler.step()  # the script counts from here on: 2
        opt.step()  # not counted
        profiler.step()  # 3
    assert profiler.steps == 3
    with pytest.raises(ConfigError):
        MemoryProfiler("cpu", count_optimizer_steps=1)  # type: ignore[arg-type]


# --- events, budget, cap ------------------------------------------------------------------------

def test_events_budget_and_cap_reach_the_report(fake_cuda: _FakeAllocator, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    limits = iter([None, 900 * MIB, 700 * MIB, None])
    monkeypatch.setattr(profiler_mod, "_cuda_memory_limit", lambda index: next(limits, None))
    profiler = MemoryProfiler(0, sample_interval=10.0, nvml_interval=1e-9, budget="512MiB")
    profiler.event("block loads")  # not running: ignored
    with profiler:
        with profiler.workload("swapped"):
            profiler.event("block loads", "3 loads in forward", 3)
            profiler.mark("forward")
            profiler.event("block loads", count=2)
        for _ in range(3):
            profiler._record("sample", full=True)  # readings of the cap
    report = profiler.report()
    assert [(e.kind, e.label, e.count, e.workload) for e in report.events] == [
        ("block loads", "3 loads in forward", 3, "swapped"), ("block loads", None, 2, "swapped")]
    assert report.budget == 512 * MIB and report.budget_label == "budget 512.0 MiB"
    assert report.memory_limit == 700 * MIB  # the lowest cap seen
    rows = dict(report.summary_rows())
    assert rows["events"] == "block loads: 5" and rows["per-process CUDA cap"] == "700.0 MiB"
    path = report.save(tmp_path / "r.json")
    assert load_report(path) == report
    html = render_html(report)
    assert "block loads (tick height: count)" in html and "budget 512.0 MiB" in html
    profiler.set_budget(None)
    assert profiler.report().budget is None
    for bad in (("", None, 1), ("x", None, 0), ("x", 3, 1)):
        with pytest.raises(ConfigError):
            profiler.event(*bad)  # type: ignore[arg-type]


# --- allocation traces -------------------------------------------------------------------------

def test_trace_check_says_why_before_anything_runs(fake_cuda: _FakeAllocator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert trace_unsupported_reason(0) is None  # a CUDA device in this process
    other = os.getpid() + 1
    reason = trace_unsupported_reason(0, pid=other)
    assert reason is not None and f"process {other}" in reason
    with pytest.raises(DeviceError) as info:
        MemoryProfiler(0, trace=True, pid=other)
    assert "--subprocess" in (info.value.hint or "")
    monkeypatch.setattr(profiler_mod, "resolve_cuda_index", lambda device=None: None)
    reason = trace_unsupported_reason("cpu")
    assert reason is not None and "needs a CUDA device" in reason
    with pytest.raises(DeviceError) as info:
        MemoryProfiler("cpu", trace=True)
    assert "CUDA GPU" in (info.value.hint or "") and "still works" in (info.value.hint or "")


def test_save_trace_writes_the_memory_viz_snapshot(fake_cuda: _FakeAllocator, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    history: list[dict[str, Any]] = []
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}
    dumped: list[str] = []

    def dump(path: str) -> None:
        dumped.append(path)
        with open(path, "wb") as fh:
            pickle.dump(snapshot, fh)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kwargs: history.append(kwargs))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    with MemoryProfiler(0, sample_interval=10.0, trace=True) as profiler:
        live = profiler.save_trace(tmp_path / "live" / "trace.pickle")
    after = profiler.save_trace(tmp_path / "after.pickle")
    # while running: PyTorch's own writer, into a temporary beside the target, then renamed
    assert len(dumped) == 1 and Path(dumped[0]).parent == live.parent
    assert Path(dumped[0]).name.startswith(f".{live.name}.") and not Path(dumped[0]).exists()
    for path in (live, after):
        with open(path, "rb") as fh:
            assert pickle.load(fh) == snapshot
    assert history[0]["enabled"] == "all" and history[-1]["enabled"] is None
