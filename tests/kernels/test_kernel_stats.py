"""memory_stats and the process-wide PerformanceStats (transfers, launches, lazy event timing)."""

from __future__ import annotations

import psutil
import pytest
import torch

from vramkit.errors import ConfigError, DeviceError
from vramkit.kernels import stats as stats_module
from vramkit.kernels.stats import (
    MemoryAvailability,
    PerformanceStats,
    memory_stats,
    performance_stats,
    record_transfer,
)


class FakeEvent:
    """A CUDA timing event whose completion the test controls."""

    def __init__(self, done: bool = True, ms: float = 0.0) -> None:
        self.done = done
        self.ms = ms
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True

    def elapsed_time(self, end_event: FakeEvent) -> float:
        return end_event.ms


# ---------------------------------------------------------------------------- memory_stats


def test_cpu_memory_is_measured_from_the_os() -> None:
    free, total = memory_stats("cpu")
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert 0 < free <= total
    assert abs(free - vm.available) < 0.25 * total  # measured moments apart


def test_memory_stats_result_is_a_named_tuple() -> None:
    result = memory_stats(torch.device("cpu"))
    assert isinstance(result, MemoryAvailability)
    assert result.used == result.total - result.free


def test_default_device_without_cuda_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vramkit.devices._runtime.is_cuda_available", lambda: False)
    assert memory_stats().total == psutil.virtual_memory().total


def test_cuda_without_a_gpu_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vramkit.devices._runtime.is_cuda_available", lambda: False)
    with pytest.raises(DeviceError):
        memory_stats("cuda:0")
    with pytest.raises(DeviceError):
        memory_stats("meta")


def test_cuda_memory_comes_from_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        asked.append(index)
        return (3 * 2**30 + index, 8 * 2**30)

    monkeypatch.setattr("vramkit.devices._runtime.is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # the ordinals asked for exist
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert memory_stats(1) == (3 * 2**30 + 1, 8 * 2**30)
    assert memory_stats("cuda:2").free == 3 * 2**30 + 2
    assert memory_stats("cuda").free == 3 * 2**30  # current device: 0 before CUDA starts
    assert asked == [1, 2, 0]


# ---------------------------------------------------------------------------- transfers


def test_transfers_are_counted_per_device_and_direction() -> None:
    stats = PerformanceStats()
    stats.record_transfer("h2d", 100, 0)
    stats.record_transfer("h2d", 50, torch.device("cuda", 0))
    stats.record_transfer("d2h", 7, "cuda:1")
    zero = stats.snapshot(0)
    assert (zero.bytes_h2d, zero.transfers_h2d, zero.bytes_d2h) == (150, 2, 0)
    one = stats.snapshot("cuda:1")
    assert (one.bytes_d2h, one.transfers_d2h, one.bytes_h2d) == (7, 1, 0)
    both = stats.snapshot(all_devices=True)
    assert both.device is None
    assert ((both.bytes_h2d, both.bytes_d2h, both.transfers_h2d + both.transfers_d2h)
            == (150, 7, 3))


def test_default_device_is_the_current_one() -> None:
    stats = PerformanceStats()
    stats.record_transfer("h2d", 10)  # CUDA not initialized here: device 0
    assert stats.snapshot().bytes_h2d == 10
    assert stats.snapshot(0).bytes_h2d == 10


@pytest.mark.parametrize("direction, nbytes, device", [
    ("up", 1, 0), ("H2D", 1, 0), ("h2d", -1, 0), ("d2h", 1, "cpu"),
])
def test_bad_transfers_are_refused(direction: str, nbytes: int, device: object) -> None:
    with pytest.raises(ConfigError):
        PerformanceStats().record_transfer(direction, nbytes, device)  # type: ignore[arg-type]


def test_reset_all_or_one_device() -> None:
    stats = PerformanceStats()
    stats.record_transfer("h2d", 1, 0)
    stats.record_transfer("h2d", 2, 1)
    stats.reset(1, all_devices=False)
    assert stats.snapshot(1).bytes_h2d == 0
    assert stats.snapshot(0).bytes_h2d == 1
    stats.reset()
    assert stats.snapshot(all_devices=True).bytes_h2d == 0


def test_module_functions_use_the_process_wide_collector() -> None:
    assert performance_stats() is performance_stats()
    collector = performance_stats()
    before = collector.snapshot(3).bytes_d2h
    record_transfer("d2h", 4096, 3)
    assert collector.snapshot(3).bytes_d2h == before + 4096
    collector.reset(3, all_devices=False)


# ---------------------------------------------------------------------------- launches and timing


def test_launches_are_counted_without_timing() -> None:
    stats = PerformanceStats()
    assert not stats.timing_enabled
    for _ in range(3):
        stats.record_launch(0)
    snap = stats.snapshot(0)
    assert (snap.kernel_launches, snap.timed_launches, snap.kernel_time_ms) == (3, 0, 0.0)
    assert snap.mean_kernel_time_ms is None


def test_timed_launches_are_read_lazily() -> None:
    stats = PerformanceStats()
    stats.enable_timing()
    assert stats.timing_enabled
    finished = (FakeEvent(), FakeEvent(ms=2.0))
    running_end = FakeEvent(done=False, ms=6.0)
    stats.record_launch(0, finished)
    stats.record_launch(0, (FakeEvent(), running_end))
    # Recording touched no event: nothing waits at launch time.
    assert running_end.synchronized == 0
    early = stats.snapshot(0, wait=False)
    assert (early.kernel_launches, early.timed_launches, early.pending_timings) == (2, 1, 1)
    assert early.kernel_time_ms == pytest.approx(2.0)
    assert running_end.synchronized == 0
    late = stats.snapshot(0)  # wait=True: synchronizes the pending end event
    assert running_end.synchronized == 1
    assert (late.timed_launches, late.pending_timings) == (2, 0)
    assert late.kernel_time_ms == pytest.approx(8.0)
    assert late.mean_kernel_time_ms == pytest.approx(4.0)
    assert late.to_dict()["mean_kernel_time_ms"] == pytest.approx(4.0)
    stats.enable_timing(False)
    assert not stats.timing_enabled


def test_completed_events_are_folded_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_module, "_FOLD_PENDING_AT", 4)
    stats = PerformanceStats()
    ends = [FakeEvent(done=i % 2 == 0, ms=1.0) for i in range(4)]
    for end in ends:
        stats.record_launch(0, (FakeEvent(), end))
    counters = stats._devices[0]
    assert len(counters.pending) == 2  # the two completed ones were folded at the 4th launch
    assert counters.timed_launches == 2
    assert all(end.synchronized == 0 for end in ends)


def test_reset_drops_pending_timings() -> None:
    stats = PerformanceStats()
    stats.record_launch(0, (FakeEvent(), FakeEvent(done=False, ms=1.0)))
    stats.reset()
    assert stats.snapshot(0) == stats_module.PerformanceSnapshot(0, 0, 0, 0, 0.0, 0, 0, 0, 0)
