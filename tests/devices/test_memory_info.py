"""vramkit.devices.memory_info: the one device-memory record and its reader (host and faked CUDA)."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any

import psutil
import pytest
import torch

from vramkit.devices import nvml
from vramkit.devices.env import GpuMemoryInfo, get_gpu_memory_info
from vramkit.devices.memory_info import MemoryInfo, read_memory_info
from vramkit.errors import ConfigError, DeviceError, InvalidDeviceError
from vramkit.kernels.stats import memory_stats
from vramkit.observe.oom import DeviceMemoryReading, read_device_memory
from vramkit.observe.recovery import DeviceMemoryReading as RecoveryReading

GiB = 1 << 30
MiB = 1 << 20


# -- the record ----------------------------------------------------------------------------------


def test_the_old_names_are_the_one_class() -> None:
    assert GpuMemoryInfo is MemoryInfo
    assert DeviceMemoryReading is MemoryInfo
    assert RecoveryReading is MemoryInfo


def test_positional_and_keyword_forms_build_equal_records() -> None:
    # How get_gpu_memory_info's record was built (positionally) and how the OOM reading was
    # (by keyword, without ``used``) describe the same memory.
    positional = GpuMemoryInfo("cuda:1", 8 * GiB, 3 * GiB, 5 * GiB, 1 * GiB, 2 * GiB,
                               2 * GiB, 4 * GiB, kind="cuda", name="Fake GPU")
    by_keyword = DeviceMemoryReading(device="cuda:1", total=8 * GiB, free=3 * GiB,
                                     reserved=2 * GiB, allocated=1 * GiB, max_allocated=2 * GiB,
                                     max_reserved=4 * GiB, name="Fake GPU")
    assert positional == by_keyword
    assert by_keyword.used == 5 * GiB  # derived as total - free
    assert hash(positional) == hash(by_keyword)


def test_given_used_is_kept() -> None:
    assert MemoryInfo("cuda:0", 8 * GiB, 3 * GiB, used=4 * GiB).used == 4 * GiB


def test_record_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MemoryInfo("cpu", 1, 1, kind="host").free = 0  # type: ignore[misc]


def test_derived_figures() -> None:
    reading = DeviceMemoryReading(device="cuda:0", total=80 * GiB, free=2 * GiB,
                                  reserved=48 * GiB, allocated=47 * GiB, limit=60 * GiB)
    assert reading.cached_free == 1 * GiB
    assert reading.outside_pytorch == 30 * GiB
    assert reading.usable == 60 * GiB
    assert dataclasses.replace(reading, limit=None).usable == 80 * GiB
    assert dataclasses.replace(reading, allocated=50 * GiB).cached_free == 0  # never negative


def test_derived_figures_are_unknown_without_their_inputs() -> None:
    host = MemoryInfo("cpu", None, None, None, kind="host")
    assert (host.used, host.cached_free, host.outside_pytorch, host.usable) == (None,) * 4
    assert str(host) == "no CUDA GPU; host RAM n/a used of n/a (n/a free)"


def test_cuda_text() -> None:
    info = GpuMemoryInfo("cuda:1", 8 * GiB, 3 * GiB, 5 * GiB, 1 * GiB, 2 * GiB, 2 * GiB,
                         4 * GiB, kind="cuda", name="Fake GPU 1")
    assert str(info) == ("cuda:1 (Fake GPU 1): 5.0 GiB used of 8.0 GiB (3.0 GiB free); "
                         "PyTorch allocated 1.0 GiB, reserved 2.0 GiB, peak allocated 2.0 GiB, "
                         "peak reserved 4.0 GiB")


# -- the host ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0"])
def test_host_record(device: Any) -> None:
    info = read_memory_info(device)
    memory = psutil.virtual_memory()
    assert (info.kind, info.device) == ("host", "cpu")
    assert info.total == memory.total
    assert info.free is not None and 0 < info.free <= info.total
    assert info.used == info.total - info.free
    assert (info.allocated, info.reserved, info.max_allocated, info.max_reserved) == (None,) * 4
    assert (info.name, info.limit, info.largest_cached_block, info.other_processes) == (None,) * 4
    assert str(info).startswith("no CUDA GPU; host RAM")


def test_default_is_the_host_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert read_memory_info().kind == "host"


def test_host_record_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert read_memory_info("cpu") == MemoryInfo("cpu", None, None, None, kind="host")


# -- a faked CUDA machine ----------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Two visible GPUs; every torch.cuda call read_memory_info may make is answered here."""
    calls: dict[str, list[Any]] = {"memory_stats": [], "mem_get_info": []}

    def mem_get_info(index: int) -> tuple[int, int]:
        calls["mem_get_info"].append(index)
        return (3 * GiB, 8 * GiB)

    def stats(index: int) -> dict[str, int]:
        calls["memory_stats"].append(index)
        return {"allocated_bytes.all.current": 1 * GiB, "reserved_bytes.all.current": 2 * GiB,
                "allocated_bytes.all.peak": 2 * GiB, "reserved_bytes.all.peak": 4 * GiB}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_stats", stats)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Fake GPU {index}")
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.5,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [
        {"device": 1, "blocks": [{"state": "inactive", "size": 64 * MiB},
                                 {"state": "inactive", "size": 16 * MiB},
                                 {"state": "active_allocated", "size": GiB}]},
        {"device": 0, "blocks": [{"state": "inactive", "size": GiB}]}])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid="GPU-0001"))
    processes = (nvml.NvmlProcess(pid=os.getpid(), used_memory=2 * GiB),
                 nvml.NvmlProcess(pid=999_999, used_memory=3 * GiB))
    snapshot = nvml.NvmlSnapshot(available=True, devices=(
        nvml.NvmlDevice(index=1, uuid="GPU-0001", name="fake", processes=processes),))
    monkeypatch.setattr(nvml, "query_nvml", lambda include_processes=True: snapshot)
    return calls


def test_cuda_record(fake_cuda: dict[str, list[Any]]) -> None:
    info = read_memory_info("cuda:1")
    assert info == MemoryInfo("cuda:1", 8 * GiB, 3 * GiB, 5 * GiB, 1 * GiB, 2 * GiB, 2 * GiB,
                              4 * GiB, kind="cuda", name="Fake GPU 1")
    assert fake_cuda["memory_stats"] == [1]  # the four allocator figures in one call


def test_cuda_record_with_what_a_diagnosis_needs(fake_cuda: dict[str, list[Any]]) -> None:
    info = read_memory_info(1, limit=True, largest_block=True, other_processes=True)
    assert info.limit == 4 * GiB  # half of 8 GiB
    assert info.largest_cached_block == 64 * MiB  # inactive blocks of this device only
    assert info.other_processes == 3 * GiB  # NVML's figure for the other PID
    assert info.usable == 4 * GiB and info.cached_free == 1 * GiB


def test_cuda_record_free_and_total_only(fake_cuda: dict[str, list[Any]]) -> None:
    info = read_memory_info(torch.device("cuda", 0), allocator=False, name=False)
    assert (info.free, info.total, info.used) == (3 * GiB, 8 * GiB, 5 * GiB)
    assert (info.allocated, info.name) == (None, None)
    assert fake_cuda["memory_stats"] == []


def test_bare_cuda_and_default_read_the_current_device(fake_cuda: dict[str, list[Any]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_memory_info().device == "cuda:0"  # CUDA not initialized: device 0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert read_memory_info("cuda").device == "cuda:1"


def test_the_readers_read_through_read_memory_info(fake_cuda: dict[str, list[Any]]) -> None:
    assert get_gpu_memory_info(1) == read_memory_info(1)
    reading = read_device_memory(1)
    assert reading == read_memory_info(1, name=False, limit=True, largest_block=True,
                                       other_processes=True)
    assert reading.name is None and reading.limit == 4 * GiB
    free, total = memory_stats("cuda:1")
    assert (free, total) == (3 * GiB, 8 * GiB)


def test_unusable_devices(fake_cuda: dict[str, list[Any]],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeviceError, match="does not exist"):
        read_memory_info("cuda:2")
    with pytest.raises(InvalidDeviceError):
        read_memory_info("meta")
    with pytest.raises(ConfigError):
        read_memory_info(True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        read_memory_info("cuda:0", owner="my reader")
    with pytest.raises(DeviceError, match="my reader"):
        read_memory_info(0, owner="my reader")
