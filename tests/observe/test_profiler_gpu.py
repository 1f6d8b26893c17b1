"""GPU checks of allocator statistics, the profiler, traces and leak detection (marked gpu)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from vramkit.observe.leaks import LeakDetector
from vramkit.observe.profiler import MemoryProfiler, with_memory_tracking
from vramkit.observe.stats import (
    CudaAllocator,
    allocator_stats,
    read_cuda_figures,
    reserved_all_devices,
)

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def _device() -> torch.device:
    torch.cuda.init()
    return torch.device("cuda", torch.cuda.current_device())


def test_allocator_stats_reflect_an_allocation() -> None:
    device = _device()
    before = allocator_stats(device)
    block = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    after = allocator_stats(device)
    assert after.cuda_initialized and after.device == f"cuda:{device.index}"
    assert after.allocated - before.allocated >= 64 * MIB
    assert after.reserved >= after.allocated and after.peak_allocated >= after.allocated
    assert after.allocations_total > before.allocations_total
    assert after.reserved_all_devices >= after.reserved
    if after.nvml_process_used is not None:  # None when NVML is not reachable
        assert after.outside_torch == after.nvml_process_used - after.reserved_all_devices
    allocator = CudaAllocator(device)
    assert allocator.current_allocated() == torch.cuda.memory_allocated(device)
    del block
    allocator.reset_peak()
    assert allocator.peak_allocated() == allocator.current_allocated()


class _Spike(nn.Module):
    """Allocates and frees 512 MiB inside its forward: only the allocator watermark sees it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(512 * MIB, dtype=torch.uint8, device=x.device)
        del scratch
        return x * 2


def test_profiler_finds_the_peak_phase_and_module() -> None:
    device = _device()
    model = nn.Sequential(nn.Linear(256, 256), _Spike(), nn.Linear(256, 256)).to(device)
    x = torch.randn(64, 256, device=device)
    torch.cuda.synchronize()
    profiler = MemoryProfiler(device, sample_interval=0.005).attach(model)
    with profiler:
        with profiler.phase("forward"):
            y = model(x)
        with profiler.phase("backward"):
            y.sum().backward()
        profiler.step()
    profiler.detach()
    report = profiler.report()
    assert report.metric == "allocated"
    assert report.peak.value >= 512 * MIB
    assert report.peak.phase == "forward" and report.peak.module == "1"
    assert report.phase_peaks["forward"].allocated >= 512 * MIB
    assert report.phase_peaks["backward"].allocated < 512 * MIB
    assert report.num_allocations is not None and report.num_allocations > 0
    assert report.fragmentation is not None and 0.0 <= report.fragmentation <= 1.0
    assert {m.name for m in report.top_modules} >= {"0", "1", "2"}


def test_trace_snapshot_is_written_and_loads(tmp_path: Path) -> None:
    device = _device()
    profiler = MemoryProfiler(device, sample_interval=0.01, trace=True)
    with profiler:
        a = torch.randn(1024, 1024, device=device)
        b = a @ a
        del a, b
        live = profiler.save_trace(tmp_path / "live.pickle")
    after = profiler.save_trace(tmp_path / "after.pickle")
    for path in (live, after):
        with open(path, "rb") as fh:
            snapshot = pickle.load(fh)
        assert "segments" in snapshot and "device_traces" in snapshot
        actions = {e.get("action") for trace in snapshot["device_traces"] for e in trace}
        assert "alloc" in actions
    with profiler.trace(tmp_path / "ctx.pickle"):
        torch.ones(1000, device=device).sum()
    with open(tmp_path / "ctx.pickle", "rb") as fh:
        assert "segments" in pickle.load(fh)


def _leak_cuda(store: list[torch.Tensor], device: torch.device) -> None:
    store.append(torch.empty(MIB, dtype=torch.uint8, device=device))


def _cuda_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_leak_detector_catches_a_cuda_leak_within_five_steps() -> None:
    device = _device()
    model = nn.Linear(64, 64).to(device)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64, device=device)
    store: list[torch.Tensor] = []
    with LeakDetector(device) as detector:
        flagged_at = None
        for step in range(1, 6):
            _cuda_step(model, opt, x)
            _leak_cuda(store, device)
            detector.step()
            if flagged_at is None and detector.verdict().leak:
                flagged_at = step
        report = detector.report()
    assert flagged_at is not None and flagged_at <= 5
    assert report.metric == "cuda_allocated"
    assert report.bytes_per_step == pytest.approx(MIB, rel=0.05)
    assert any("_leak_cuda" in frame for frame in report.suspects[0].stack), report.suspects


def test_leak_detector_clean_cuda_loop() -> None:
    device = _device()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(device)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64, device=device)
    with LeakDetector(device) as detector:
        for _ in range(1000):
            _cuda_step(model, opt, x)
            detector.step()
        verdict = detector.verdict()
    assert not verdict.leak and verdict.conclusive and verdict.steps == 1000


def test_fast_reader_matches_memory_stats() -> None:
    device = _device()
    block = torch.empty(8 * MIB, dtype=torch.uint8, device=device)
    flat = torch.cuda.memory_stats(device)
    figures = read_cuda_figures(device.index)
    assert figures == (flat["allocated_bytes.all.current"], flat["reserved_bytes.all.current"],
                       flat["active_bytes.all.current"], flat["allocated_bytes.all.peak"],
                       flat["reserved_bytes.all.peak"])
    assert reserved_all_devices() == sum(torch.cuda.memory_reserved(i)
                                         for i in range(torch.cuda.device_count()))
    del block


def test_profiler_hands_its_reading_to_a_cuda_leak_detector() -> None:
    device = _device()
    detector = LeakDetector(device, record_stacks=False)
    store: list[torch.Tensor] = []
    expected: list[int] = []
    with MemoryProfiler(device, sample_interval=0.01, detect_leaks=detector) as profiler:
        for _ in range(6):
            _leak_cuda(store, device)
            expected.append(torch.cuda.memory_allocated(device))
            profiler.step()
    assert detector.readings == expected
    leak = profiler.report().leak
    assert leak is not None and leak.leak and leak.metric == "cuda_allocated"


def test_with_memory_tracking_on_cuda() -> None:
    device = _device()

    def work() -> torch.Tensor:
        a = torch.empty(32 * MIB, dtype=torch.uint8, device=device)
        b = torch.empty(16 * MIB, dtype=torch.uint8, device=device)
        del a
        return b

    kept, stats = with_memory_tracking("work", work)
    assert stats.source == "cuda_allocator" and stats.device == f"cuda:{device.index}"
    assert stats.num_allocations >= 2 and stats.total_allocated >= 48 * MIB
    assert stats.peak_delta >= 48 * MIB
    assert stats.end_allocated - stats.start_allocated >= 16 * MIB
    del kept
