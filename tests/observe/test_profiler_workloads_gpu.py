"""GPU checks of the profiler's workloads, optimizer-step counting, per-process cap and a trace
started before CUDA (marked gpu; run by the lead on the GPU machine)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from vramkit.observe.profiler import MemoryProfiler, trace_unsupported_reason

pytestmark = pytest.mark.gpu

MIB = 1 << 20
SRC = Path(__file__).resolve().parents[2] / "src"


def _device() -> torch.device:
    torch.cuda.init()
    return torch.device("cuda", torch.cuda.current_device())


def test_optimizer_steps_count_and_a_cuda_leak_is_found_without_step_calls() -> None:
    device = _device()
    model = nn.Linear(256, 256, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=device)
    store: list[torch.Tensor] = []
    with MemoryProfiler(device, sample_interval=0.01, count_optimizer_steps=True) as profiler:
        for _ in range(8):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            store.append(torch.empty(MIB, dtype=torch.uint8, device=device))
    report = profiler.report()
    assert report.steps == 8
    assert report.leak is not None and report.leak.leak and report.leak.metric == "allocated"


def test_two_runs_in_one_profile_are_judged_apart() -> None:
    device = _device()
    small = nn.Linear(256, 256, device=device)
    big = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))).to(device)
    with MemoryProfiler(device, sample_interval=0.01) as profiler:
        for name, model, width in (("small", small, 256), ("big", big, 1024)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(32, width, device=device)
            with profiler.workload(name):
                for _ in range(8):
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    profiler.step()
    report = profiler.report()
    assert set(report.leak_by_workload) == {"small", "big"}
    assert report.leak is not None and not report.leak.leak


def test_the_per_process_cap_is_reported() -> None:
    device = _device()
    index = device.index
    before = torch.cuda.get_per_process_memory_fraction(index)
    total = torch.cuda.get_device_properties(index).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction(0.25, index)
        with MemoryProfiler(device, sample_interval=0.01, nvml_interval=0.01) as profiler:
            torch.cuda.synchronize()
            time.sleep(0.1)
    finally:
        torch.cuda.set_per_process_memory_fraction(before, index)
    assert profiler.report().memory_limit == int(0.25 * total)


def test_trace_started_before_cuda_records_the_script(tmp_path: Path) -> None:
    """`vramkit profile --trace` starts the profiler before the script touches CUDA."""
    assert trace_unsupported_reason("cuda") is None
    out = tmp_path / "trace.pickle"
    script = textwrap.dedent(f"""
        import torch
        from vramkit.observe.profiler import MemoryProfiler
        assert not torch.cuda.is_initialized()
        profiler = MemoryProfiler(trace=True, sample_interval=0.01)
        profiler.start()
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        del x, y
        profiler.stop()
        profiler.save_trace({str(out)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(SRC)})
    with open(out, "rb") as fh:
        snapshot = pickle.load(fh)
    actions = {e.get("action") for trace in snapshot["device_traces"] for e in trace}
    assert "alloc" in actions
