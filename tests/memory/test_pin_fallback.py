"""Pinned pools that cannot pin: fallback to pageable memory, said once (no GPU needed).

A stand-in for ``torch.cuda.cudart()`` whose ``cudaHostRegister`` returns an error code, and a
monkeypatched :func:`vramkit.devices.host.read_host_memory` for the host's pinning cap.
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Iterator

import pytest
import torch

from tests.memory.test_pool import install_fake_cuda
from vramkit.devices import host as host_module
from vramkit.devices.host import HostMemory
from vramkit.errors import ConfigError, DeviceError, VramkitWarning
from vramkit.memory import _segments
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import transfer_streams

KiB = 1024
MiB = 1024 * 1024


class FailingCudart:
    """Stands in for torch.cuda.cudart(): ``cudaHostRegister`` fails with ``fail_with`` (0 = ok)."""

    def __init__(self, fail_with: int = 2) -> None:
        self.fail_with = fail_with
        self.registered: dict[int, int] = {}
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []
        self.last_error = 0
        self.drained = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.register_calls.append((ptr, size))
        if self.fail_with:
            self.last_error = self.fail_with  # what the real runtime latches for the thread
            return self.fail_with
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregister_calls.append(ptr)
        return 0 if self.registered.pop(ptr, None) is not None else 713

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        self.drained += 1
        return error


def host_memory(pin_limit: int | None = None, source: str = "none",
                memlock: int | None = None) -> HostMemory:
    return HostMemory(total=64 << 30, available=32 << 30, memlock_limit=memlock,
                      pin_limit=pin_limit, pin_limit_source=source)


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a fresh process would: not yet warned, no cap unless it sets one."""
    gc.collect()  # pools of earlier tests leave the pinned count through their finalizers
    _segments._reset_pin_fallback_warning()
    monkeypatch.setattr(host_module, "read_host_memory", lambda **_: host_memory())
    yield
    _segments._reset_pin_fallback_warning()


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> tuple[FailingCudart, list[tuple[str, int]]]:
    """CUDA 'available' with a failing runtime; ("freed", base) is logged when a mapping goes."""
    fake = FailingCudart()
    log = install_fake_cuda(monkeypatch, fake)
    return fake, log


def vramkit_warnings(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(r.message) for r in records if issubclass(r.category, VramkitWarning)]


# -- config ----------------------------------------------------------------------------------


def test_pin_fallback_is_on_by_default_and_validated() -> None:
    assert PoolConfig().pin_fallback is True
    config = PoolConfig(pin_fallback=False)
    assert PoolConfig.from_dict(config.to_dict()) == config
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="pin_fallback"):
            PoolConfig(pin_fallback=bad)  # type: ignore[arg-type]


# -- cudaHostRegister fails ------------------------------------------------------------------


def test_failed_registration_falls_back_and_warns_once(
        cudart: tuple[FailingCudart, list], caplog: pytest.LogCaptureFixture) -> None:
    fake, _ = cudart
    with warnings.catch_warnings(record=True) as records, \
            caplog.at_level(logging.DEBUG, logger=_segments.__name__):
        warnings.simplefilter("always")  # the one warning must come from vramkit, not the filter
        pools = [MemoryPool.pinned(PoolConfig(growth_factor=1.0)) for _ in range(2)]
        blocks = [pool.allocate(size) for pool in pools for size in (4 * KiB, 64 * KiB, MiB)]
    assert len(fake.register_calls) == 6  # every segment tried, every one failed
    (message,) = vramkit_warnings(records)
    assert records[0].filename == __file__  # points at the code that allocated
    for part in ("cudaHostRegister", "cudaErrorMemoryAllocation", "cudaError 2",
                 "segment 4.0 KiB", "already pinned by vramkit in this process",
                 "pageable memory", "block the Python thread", "several times slower",
                 "benchmarks/pinning_fallback.py", "ulimit -l", "host_budget", "pin_fallback=False"):
        assert part in message, part
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].getMessage() == message
    later = [r for r in caplog.records if r.levelno == logging.DEBUG and "pageable" in
             r.getMessage()]
    assert len(later) == 5  # the other segments: debug only
    assert fake.drained == 6 and fake.last_error == 0  # no stale error left for torch to find
    for block in blocks:
        block.free()


def test_fallback_memory_holds_data_and_counts_as_pageable(
        cudart: tuple[FailingCudart, list]) -> None:
    fake, _ = cudart
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    with pytest.warns(VramkitWarning):
        a, b = pool.allocate(4 * KiB), pool.allocate(MiB)
    a.view(1024, torch.float32).copy_(torch.arange(1024, dtype=torch.float32))
    payload = torch.randint(0, 255, (MiB,), dtype=torch.uint8)
    streams = transfer_streams("cpu")
    streams.copy(b.tensor, payload, streams.h2d, "in")
    out = torch.empty_like(payload)
    streams.copy(out, b.tensor, streams.d2h, "out")
    assert torch.equal(out, payload)
    assert torch.equal(a.view(1024, torch.float32), torch.arange(1024, dtype=torch.float32))
    tensor = pool.tensor((256,), torch.int32)
    tensor.fill_(7)
    assert int(tensor.sum()) == 7 * 256
    stats = pool.stats()
    assert stats.pageable_bytes == stats.reserved == 4 * KiB + MiB + KiB
    assert stats.to_dict()["pageable_bytes"] == stats.pageable_bytes
    assert "pageable=" in repr(pool)
    assert not any(pool._backend.page_locked(s.storage) for s in pool._segments.values())
    assert not fake.registered
    a.free()
    b.free()


def test_mixed_pool_counts_only_the_fallback_segments(cudart: tuple[FailingCudart, list]) -> None:
    fake, _ = cudart
    fake.fail_with = 0
    before = _segments.pinned_bytes()
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    pinned = pool.allocate(64 * KiB)
    fake.fail_with = 1  # cudaErrorInvalidValue from now on
    with pytest.warns(VramkitWarning, match="cudaErrorInvalidValue"):
        pageable = pool.allocate(128 * KiB)
    stats = pool.stats()
    assert (stats.reserved, stats.pageable_bytes) == (192 * KiB, 128 * KiB)
    assert _segments.pinned_bytes() - before == stats.reserved - stats.pageable_bytes
    assert pool._backend.page_locked(pool._segments[pinned.segment].storage)
    assert not pool._backend.page_locked(pool._segments[pageable.segment].storage)
    pinned.free()
    pageable.free()


def test_release_never_unregisters_a_fallback_segment(cudart: tuple[FailingCudart, list]) -> None:
    fake, log = cudart
    fake.fail_with = 0
    before = _segments.pinned_bytes()
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    keep = pool.allocate(4 * KiB)
    (registered_ptr,) = fake.registered
    fake.fail_with = 2
    with pytest.warns(VramkitWarning):
        pool.allocate(64 * KiB).free()
    pageable_ptr = fake.register_calls[-1][0]
    assert pool.trim() == 64 * KiB
    gc.collect()
    assert fake.unregister_calls == []  # the pageable segment was never registered
    assert ("freed", pageable_ptr) in log  # and its mapping is gone
    assert pool.stats().pageable_bytes == 0
    pool.clear(force=True)
    assert fake.unregister_calls == [registered_ptr] and not fake.registered
    assert _segments.pinned_bytes() == before
    del keep


def test_pin_fallback_false_raises_and_keeps_nothing(cudart: tuple[FailingCudart, list]) -> None:
    fake, log = cudart
    pool = MemoryPool.pinned(PoolConfig(pin_fallback=False))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with pytest.raises(DeviceError, match="cudaErrorMemoryAllocation") as info:
            pool.allocate(4 * KiB)
    assert not vramkit_warnings(records)
    assert "pin_fallback" in info.value.hint
    del info
    gc.collect()
    assert pool.stats().reserved == 0 and [kind for kind, _ in log] == ["freed"]
    assert fake.drained == 1


def test_pool_garbage_collection_releases_the_pinned_count(
        cudart: tuple[FailingCudart, list]) -> None:
    fake, _ = cudart
    fake.fail_with = 0
    before = _segments.pinned_bytes()
    pool = MemoryPool.pinned(PoolConfig(initial_size=MiB))
    assert _segments.pinned_bytes() - before == MiB
    del pool
    gc.collect()
    assert _segments.pinned_bytes() == before and not fake.registered


# -- the host's pinning cap ------------------------------------------------------------------


def test_segment_past_the_pinning_cap_is_not_registered(
        cudart: tuple[FailingCudart, list], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = cudart
    fake.fail_with = 0
    limit = _segments.pinned_bytes() + 96 * KiB
    monkeypatch.setattr(host_module, "read_host_memory",
                        lambda **_: host_memory(limit, "cgroup memory.max", memlock=8 * MiB))
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    first = pool.allocate(64 * KiB)  # under the cap: pinned
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        second = pool.allocate(64 * KiB)  # would pass it: pageable, never registered
        third = pool.allocate(64 * KiB)
    assert [size for _, size in fake.register_calls] == [64 * KiB]
    (message,) = vramkit_warnings(records)
    for part in ("pinning cap", "cgroup memory.max", "OOM-killed", "already pinned by vramkit",
                 "RLIMIT_MEMLOCK 8.0 MiB", "container's memory limit", "host_budget"):
        assert part in message, part
    assert pool.stats().pageable_bytes == 128 * KiB
    for block in (first, second, third):
        block.free()


def test_growth_shrinks_to_the_request_to_stay_under_the_cap(
        cudart: tuple[FailingCudart, list], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = cudart
    fake.fail_with = 0
    limit = _segments.pinned_bytes() + 3 * MiB
    monkeypatch.setattr(host_module, "read_host_memory",
                        lambda **_: host_memory(limit, "WSL (half of RAM)"))
    pool = MemoryPool.pinned(PoolConfig(growth_factor=4.0))
    first = pool.allocate(MiB)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        second = pool.allocate(2 * MiB)  # growth wants 3 MiB more (past the cap); 2 MiB fits
    assert not vramkit_warnings(records)
    assert [size for _, size in fake.register_calls] == [MiB, 2 * MiB]
    assert pool.stats().pageable_bytes == 0
    with pytest.warns(VramkitWarning, match=r"WSL \(half of RAM\)") as caught:
        third = pool.allocate(KiB)  # nothing fits under the cap any more
    assert ".wslconfig" in str(caught[0].message)
    assert pool.stats().pageable_bytes > 0
    for block in (first, second, third):
        block.free()


def test_cap_with_pin_fallback_false_raises(cudart: tuple[FailingCudart, list],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    fake, log = cudart
    fake.fail_with = 0
    limit = _segments.pinned_bytes() + 32 * KiB
    monkeypatch.setattr(host_module, "read_host_memory",
                        lambda **_: host_memory(limit, "cgroup memory.max"))
    pool = MemoryPool.pinned(PoolConfig(pin_fallback=False))
    with pytest.raises(DeviceError, match="pinning cap") as info:
        pool.allocate(64 * KiB)
    assert "container's memory limit" in info.value.hint
    assert "pin_fallback=True" in info.value.hint
    del info
    gc.collect()
    assert not fake.register_calls and [kind for kind, _ in log] == ["freed"]


def test_unreadable_host_memory_means_no_cap(cudart: tuple[FailingCudart, list],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = cudart
    fake.fail_with = 0

    def broken(**_: object) -> HostMemory:
        raise OSError("no /proc here")

    monkeypatch.setattr(host_module, "read_host_memory", broken)
    pool = MemoryPool.pinned()
    block = pool.allocate(64 * KiB)
    assert fake.registered and pool.stats().pageable_bytes == 0
    block.free()


# -- the power-of-two backend (torch.empty(pin_memory=True)) --------------------------------


class FakeAcceleratorError(RuntimeError):
    """torch.AcceleratorError as torch >= 2.8 raises it: a RuntimeError with the CUDA code."""

    def __init__(self, code: int) -> None:
        super().__init__("CUDA error: out of memory")
        self.error_code = code


@pytest.fixture
def power_of_two(cudart: tuple[FailingCudart, list], monkeypatch: pytest.MonkeyPatch) -> list:
    """A torch without cudaHostRegister in cudart; ``raised`` holds what ``_raw`` raises next."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: object())
    raised: list[BaseException] = []

    def raw(self: object, n: int) -> torch.Tensor:
        if raised:
            raise raised[0]
        return torch.empty(n, dtype=torch.uint8)  # stands in for pinned memory

    monkeypatch.setattr(_segments.PowerOfTwoPinnedSegments, "_raw", raw)
    return raised


def test_power_of_two_backend_falls_back_on_a_cuda_error_code(power_of_two: list) -> None:
    before = _segments.pinned_bytes()
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    assert isinstance(pool._backend, _segments.PowerOfTwoPinnedSegments)
    pinned = pool.allocate(4 * KiB)
    assert _segments.pinned_bytes() - before == 4 * KiB
    power_of_two.append(FakeAcceleratorError(2))
    with pytest.warns(VramkitWarning, match=r"torch.empty\(pin_memory=True\).*cudaError 2"):
        pageable = pool.allocate(64 * KiB)
    pageable.tensor.fill_(3)
    assert int(pageable.tensor.sum()) == 3 * 64 * KiB
    assert pool.stats().pageable_bytes == 64 * KiB
    pinned.free()
    pageable.free()
    pool.clear()
    assert _segments.pinned_bytes() == before


def test_power_of_two_backend_reads_no_message_text(power_of_two: list) -> None:
    # A RuntimeError that only *says* out of memory carries no CUDA code: not taken for a
    # pinning failure, so it propagates.
    power_of_two.append(RuntimeError("CUDA error: out of memory"))
    pool = MemoryPool.pinned()
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.allocate(4 * KiB)


def test_power_of_two_backend_without_fallback_raises(power_of_two: list) -> None:
    power_of_two.append(FakeAcceleratorError(2))
    pool = MemoryPool.pinned(PoolConfig(pin_fallback=False))
    with pytest.raises(FakeAcceleratorError):
        pool.allocate(4 * KiB)
    assert pool.stats().reserved == 0
