"""CPU tests of vramkit.observe.oom: OOM detection and classification.

OOMs are simulated by raising real exception instances (torch.OutOfMemoryError etc.); device
state for classification comes from monkeypatched torch.cuda / NVML.
"""

from __future__ import annotations

import types

import pytest
import torch

from vramkit.devices.nvml import NvmlDevice, NvmlProcess, NvmlSnapshot
from vramkit.errors import ConfigError, PoolExhaustedError, RecoveryError
from vramkit.observe import oom
from vramkit.observe.oom import (
    DeviceMemoryReading,
    classify_oom,
    diagnose_memory,
    is_oom_error,
)

GiB = 1 << 30
MiB = 1 << 20


# -- is_oom_error ---------------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory"),
    torch.cuda.OutOfMemoryError("HIP out of memory"),  # ROCm raises the same class
    MemoryError(),
    PoolExhaustedError("pool full", requested=10),
])
def test_is_oom_error_by_type(error: BaseException) -> None:
    assert is_oom_error(error)


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # text alone is not a type
    ValueError("out of memory"),
    RecoveryError("gave up"),  # a MemoryError, but not a fresh OOM
    KeyboardInterrupt(),
])
def test_is_oom_error_rejects_other_types(error: BaseException) -> None:
    assert not is_oom_error(error)


@pytest.mark.parametrize("backend", ["xpu", "mps"])
def test_is_oom_error_other_backends(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    fake_oom = type(f"{backend}OutOfMemoryError", (RuntimeError,), {})
    module = getattr(torch, backend, None)
    if module is None:
        module = types.SimpleNamespace()
        monkeypatch.setattr(torch, backend, module, raising=False)
    assert not is_oom_error(fake_oom())
    monkeypatch.setattr(module, "OutOfMemoryError", fake_oom, raising=False)
    assert is_oom_error(fake_oom())


# -- classification ---------------------------------------------------------------------------


def _reading(**kw: int | None) -> DeviceMemoryReading:
    base: dict = dict(device="cuda:0", total=80 * GiB, free=1 * GiB, reserved=78 * GiB,
                      allocated=77 * GiB, largest_cached_block=256 * MiB)
    base.update(kw)
    return DeviceMemoryReading(**base)


def test_diagnose_capacity() -> None:
    d = diagnose_memory(_reading(), requested=4 * GiB)
    assert d.kind == "capacity" and "batch" in d.hint
    assert diagnose_memory(_reading()).kind == "capacity"


def test_diagnose_fragmentation() -> None:
    # 10 GiB cached but split into pieces below the 4 GiB request.
    r = _reading(reserved=78 * GiB, allocated=68 * GiB, largest_cached_block=512 * MiB)
    d = diagnose_memory(r, requested=4 * GiB)
    assert d.kind == "fragmentation" and "expandable_segments" in d.hint
    assert d.cached_free == 10 * GiB
    assert diagnose_memory(r).kind == "fragmentation"  # request size unknown


def test_diagnose_outside_pytorch() -> None:
    # 30 GiB used on the device that this allocator does not hold.
    r = _reading(reserved=48 * GiB, allocated=47 * GiB, free=2 * GiB)
    assert r.outside_pytorch == 30 * GiB
    d = diagnose_memory(r, requested=4 * GiB)
    assert d.kind == "outside_pytorch" and "nvidia-smi" in d.hint
    assert diagnose_memory(r).kind == "outside_pytorch"


def test_diagnose_cap_is_capacity_with_a_hint() -> None:
    # The driver has 59 GiB free, but this process is capped at 20 GiB (a simulated 20 GB card).
    r = _reading(reserved=20 * GiB, allocated=20 * GiB, free=59 * GiB, limit=20 * GiB)
    assert r.usable == 20 * GiB and r.outside_pytorch == 1 * GiB
    d = diagnose_memory(r, requested=1 * GiB)
    assert d.kind == "capacity" and "set_per_process_memory_fraction" in d.hint
    # Without the cap the same reading would not have failed for lack of capacity.
    assert "set_per_process_memory_fraction" not in diagnose_memory(
        _reading(reserved=79 * GiB, allocated=79 * GiB, free=0), requested=1 * GiB).hint


def test_diagnose_outside_respects_cap() -> None:
    # Others hold 30 GiB, but the request would not fit under this process's cap even if they
    # left: freeing them would not help, so it is capacity.
    r = _reading(reserved=20 * GiB, allocated=20 * GiB, free=2 * GiB, limit=30 * GiB)
    assert diagnose_memory(r, requested=12 * GiB).kind == "capacity"
    assert diagnose_memory(r, requested=4 * GiB).kind == "outside_pytorch"


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, *, free: int, total: int, reserved: int,
               allocated: int, largest: int, other_pid_bytes: int | None,
               fraction: float = 1.0) -> None:
    from vramkit.devices import nvml
    from vramkit.observe import stats

    monkeypatch.setattr(stats, "resolve_cuda_index", lambda device=None: 0)
    # A machine with one CUDA device, as read_device_memory checks it is there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda index=None: {
        "reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated})
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda index=None: fraction, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [
        {"device": 0, "blocks": [{"state": "inactive", "size": largest},
                                 {"state": "active_allocated", "size": 40 * GiB}]}])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid="GPU-0000"))
    procs = [NvmlProcess(pid=__import__("os").getpid(), used_memory=reserved)]
    if other_pid_bytes is not None:
        procs.append(NvmlProcess(pid=999_999, used_memory=other_pid_bytes))
    snap = NvmlSnapshot(available=True, devices=(
        NvmlDevice(index=0, uuid="GPU-0000", name="fake", processes=tuple(procs)),))
    monkeypatch.setattr(nvml, "query_nvml", lambda include_processes=True: snap)


def test_classify_oom_capacity_from_torch_and_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=512 * MiB, total=80 * GiB, reserved=79 * GiB,
               allocated=79 * GiB - 64 * MiB, largest=64 * MiB, other_pid_bytes=None)
    d = classify_oom(torch.OutOfMemoryError("x"), requested=2 * GiB)
    assert d.kind == "capacity" and d.device == "cuda:0" and d.other_processes == 0
    assert d.largest_free_block == 64 * MiB and d.error_type == "OutOfMemoryError"


def test_classify_oom_fragmentation_from_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=512 * MiB, total=80 * GiB, reserved=79 * GiB,
               allocated=60 * GiB, largest=300 * MiB, other_pid_bytes=None)
    d = classify_oom(torch.OutOfMemoryError("x"))
    assert d.kind == "fragmentation" and d.largest_free_block == 300 * MiB


def test_classify_oom_other_process_via_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=256 * MiB, total=80 * GiB, reserved=40 * GiB,
               allocated=40 * GiB, largest=0, other_pid_bytes=39 * GiB)
    d = classify_oom(torch.OutOfMemoryError("x"), requested=8 * GiB)
    assert d.kind == "outside_pytorch" and d.other_processes == 39 * GiB


def test_classify_oom_uses_observed_request(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=512 * MiB, total=80 * GiB, reserved=79 * GiB,
               allocated=70 * GiB, largest=300 * MiB, other_pid_bytes=None)
    oom._record_failed_request(0, 50 * GiB, 0, 0)  # what the allocator observer reports
    d = classify_oom(torch.OutOfMemoryError("x"))
    assert d.requested == 50 * GiB and d.kind == "capacity"


def test_classify_host_and_pool_errors() -> None:
    d = classify_oom(MemoryError())
    assert d.device == "cpu" and d.kind == "capacity" and d.total and d.total > 0
    fragmented = types.SimpleNamespace(reserved=100, allocated=40, largest_free_block=20)
    d = classify_oom(PoolExhaustedError("full", requested=50, stats=fragmented))
    assert d.kind == "fragmentation" and d.requested == 50 and "defragment" in d.hint
    full = types.SimpleNamespace(reserved=100, allocated=90, largest_free_block=10)
    assert classify_oom(PoolExhaustedError("full", requested=50, stats=full)).kind == "capacity"
    with pytest.raises(ConfigError):
        classify_oom(ValueError("no"))


# -- out-of-memory by CUDA error code (torch.AcceleratorError, torch >= 2.8) -------------------


def _accelerator_oom(message: str = "CUDA error: out of memory") -> torch.AcceleratorError:
    # Built as torch builds it: the message, then the cudaError_t value as ``error_code``.
    error = torch.AcceleratorError(message)
    error.error_code = 2  # type: ignore[attr-defined]  # cudaErrorMemoryAllocation
    return error


class _CodedError(RuntimeError):
    def __init__(self, message: str, error_code: int) -> None:
        super().__init__(message)
        self.error_code = error_code


@pytest.mark.parametrize("error", [
    _accelerator_oom(),
    _accelerator_oom("an unrelated message"),
    _CodedError("anything", 2),
])
def test_is_oom_error_by_cuda_error_code(error: BaseException) -> None:
    assert is_oom_error(error)


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: out of memory"),  # what torch < 2.8 had: text only
    _CodedError("CUDA out of memory. Tried to allocate 2.00 GiB", 700),  # another code
])
def test_is_oom_error_never_reads_the_message(error: BaseException) -> None:
    assert not is_oom_error(error)
    with pytest.raises(ConfigError):
        classify_oom(error)


def test_classify_oom_reads_the_device_for_a_cuda_error_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=512 * MiB, total=80 * GiB, reserved=79 * GiB,
               allocated=60 * GiB, largest=300 * MiB, other_pid_bytes=None)
    # A stale allocator observation belongs to another failure (the observer only sees the
    # caching allocator's, which raise OutOfMemoryError): it must not be taken for this one.
    oom._record_failed_request(0, 50 * GiB, 0, 0)
    d = classify_oom(_accelerator_oom())
    assert d.device == "cuda:0" and d.error_type == "AcceleratorError"
    assert d.kind == "fragmentation" and d.requested is None
    assert d.reserved == 79 * GiB and d.largest_free_block == 300 * MiB
    d = classify_oom(_CodedError("x", 2), requested=1 * GiB)
    assert d.device == "cuda:0" and d.requested == 1 * GiB
    oom._last_request.clear()


def test_classify_oom_cuda_error_code_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.observe import stats

    monkeypatch.setattr(stats, "resolve_cuda_index", lambda device=None: None)
    d = classify_oom(_accelerator_oom(), requested=4096)
    # A CUDA error, not a host one: without a CUDA device to read, a bare capacity diagnosis.
    assert d.device == "cuda" and d.kind == "capacity" and d.requested == 4096
