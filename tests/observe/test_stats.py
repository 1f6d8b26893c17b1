"""allocator_stats / AllocatorStats / CudaAllocator on a CPU machine, and with faked CUDA figures."""

from __future__ import annotations

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.observe import stats as stats_mod
from vramkit.observe.stats import (
    AllocatorStats,
    CudaAllocator,
    allocator_stats,
    fragmentation_ratios,
    host_rss,
    read_cuda_figures,
    reserved_all_devices,
    resolve_cuda_index,
)

_FAKE = {
    "allocated_bytes.all.current": 600, "allocated_bytes.all.peak": 900,
    "reserved_bytes.all.current": 1000, "reserved_bytes.all.peak": 1200,
    "active_bytes.all.current": 650, "active_bytes.all.peak": 950,
    "inactive_split_bytes.all.current": 100, "requested_bytes.all.current": 590,
    "num_alloc_retries": 2, "num_ooms": 1, "num_device_alloc": 7, "num_device_free": 3,
    "segment.all.current": 4, "allocation.all.allocated": 42,
    "allocated_bytes.all.allocated": 4096,
}


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Pretend cuda:0 exists, is initialized and reports _FAKE."""
    figures = dict(_FAKE)
    monkeypatch.setattr(stats_mod, "resolve_cuda_index", lambda device=None: 0)
    monkeypatch.setattr(stats_mod, "cuda_initialized", lambda: True)
    monkeypatch.setattr(stats_mod, "read_memory_stats", lambda index: figures)
    monkeypatch.setattr(stats_mod, "reserved_all_devices", lambda: 1000)
    return figures


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine has no CUDA device (so CPU expectations hold on a GPU machine too)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(stats_mod, "cuda_initialized", lambda: False)


def test_cpu_record_has_zeros_and_host_rss(monkeypatch: pytest.MonkeyPatch,
                                           no_cuda: None) -> None:
    monkeypatch.setattr(stats_mod, "nvml_process_memory", lambda pid=None: None)
    record = allocator_stats()
    assert isinstance(record, AllocatorStats)
    assert record.device == "cpu" and record.cuda_initialized is False
    assert record.allocated == record.reserved == record.peak_allocated == 0
    assert record.fragmentation == 0.0 and record.inactive_split_ratio == 0.0
    assert record.nvml_process_used is None and record.outside_torch is None
    assert record.host_rss is not None and record.host_rss > 1 << 20
    assert record.to_dict()["outside_torch"] is None


def test_reading_does_not_initialize_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("CUDA initialized")

    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "init", refuse)
    allocator_stats(include_nvml=False)
    allocator = CudaAllocator()
    assert allocator.current_allocated() == 0
    allocator.reset_peak()


def test_nvml_figure_shows_memory_outside_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_mod, "nvml_process_memory", lambda pid=None: 5000)
    record = allocator_stats("cpu")
    assert record.nvml_process_used == 5000
    assert record.outside_torch == 5000  # nothing reserved by torch on this machine


def test_include_nvml_false_skips_the_query(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(stats_mod, "nvml_process_memory", lambda pid=None: calls.append(pid))
    assert allocator_stats(include_nvml=False).nvml_process_used is None
    assert calls == []
    allocator_stats(include_nvml=True)
    assert calls == [None]


def test_fields_map_from_memory_stats(fake_cuda: dict[str, int],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_mod, "nvml_process_memory", lambda pid=None: 1500)
    record = allocator_stats(0)
    assert record.device == "cuda:0" and record.cuda_initialized
    assert ((record.allocated, record.peak_allocated, record.reserved, record.peak_reserved)
            == (600, 900, 1000, 1200))
    assert (record.active, record.inactive_split, record.requested) == (650, 100, 590)
    assert (record.num_alloc_retries, record.num_ooms) == (2, 1)
    assert (record.num_device_allocs, record.num_device_frees, record.segments) == (7, 3, 4)
    assert record.allocations_total == 42 and record.allocated_bytes_total == 4096
    assert record.fragmentation == pytest.approx(0.4)
    assert record.inactive_split_ratio == pytest.approx(0.1)
    assert record.outside_torch == 500


def test_cuda_allocator_accessors(fake_cuda: dict[str, int],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    resets: list[int] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    allocator = CudaAllocator(0)
    assert allocator.device == "cuda:0"
    assert allocator.current_allocated() == 600 and allocator.peak_allocated() == 900
    assert allocator.current_reserved() == 1000 and allocator.peak_reserved() == 1200
    allocator.reset_peak()
    assert resets == [0]
    assert "cuda:0" in repr(allocator)


def test_cuda_allocator_on_cpu_is_zero(no_cuda: None) -> None:
    allocator = CudaAllocator()
    assert allocator.device == "cpu"
    assert allocator.current_allocated() == allocator.peak_allocated() == 0
    assert allocator.stats().allocated == 0


@pytest.mark.parametrize("bad", [-1, "nonsense:zz", True, "mps"])
def test_bad_devices_are_config_errors(bad: object) -> None:
    with pytest.raises(ConfigError):
        resolve_cuda_index(bad)


def test_cpu_and_absent_cuda_resolve_to_none() -> None:
    assert resolve_cuda_index("cpu") is None
    assert resolve_cuda_index(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert resolve_cuda_index("cuda:0") is None
        assert resolve_cuda_index(0) is None


def test_fragmentation_ratios() -> None:
    assert fragmentation_ratios(600, 1000, 100) == pytest.approx((0.4, 0.1))
    assert fragmentation_ratios(0, 0, 0) == (0.0, 0.0)


def test_host_rss_holds_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    real = stats_mod.psutil.Process

    def counting(pid: int) -> object:
        made.append(pid)
        return real(pid)

    monkeypatch.setattr(stats_mod.psutil, "Process", counting)
    monkeypatch.setattr(stats_mod, "_own_rss", None)
    readings = [host_rss() for _ in range(3)]
    assert all(r is not None and r > 1 << 20 for r in readings)
    assert len(made) == 1


def test_an_exited_child_not_yet_reaped_gives_no_reading() -> None:
    """A zombie's /proc reads 0 resident bytes; that is no measurement (the profiler would
    print a peak host RSS of 0 B for a child sampled only after it exited)."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while stats_mod.psutil.Process(child.pid).status() != stats_mod.psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert stats_mod.HostRssReader(child.pid).read() is None
        assert stats_mod.HostRssReader(child.pid, include_children=True).read() is None
    finally:
        child.wait()


def test_read_cuda_figures_fast_path_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    nested = {name: {"all": {"current": cur, "peak": peak}}
              for name, cur, peak in (("allocated_bytes", 600, 900),
                                      ("reserved_bytes", 1000, 1200),
                                      ("active_bytes", 650, 950))}
    flat_calls: list[int] = []

    def flat(index: int) -> dict[str, int]:
        flat_calls.append(index)
        return _FAKE

    monkeypatch.setattr(torch.cuda, "memory_stats", flat)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: nested, raising=False)
    assert read_cuda_figures(0) == (600, 1000, 650, 900, 1200)
    assert flat_calls == []
    monkeypatch.delattr(torch._C, "_cuda_memoryStats", raising=False)
    assert read_cuda_figures(1) == (600, 1000, 650, 900, 1200)
    assert flat_calls == [1]


def test_reserved_all_devices_sums_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_mod, "cuda_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(stats_mod, "read_cuda_figures", lambda i: (0, 100 * (i + 1), 0, 0, 0))
    assert reserved_all_devices() == 600
    monkeypatch.setattr(stats_mod, "cuda_initialized", lambda: False)
    assert reserved_all_devices() == 0
