"""KernelManager logic on CPU: availability, compile/disk-cache flow, argument checks, launches.

A fake backend stands in for NVRTC/cuda-core (the GPU tests use the real one); its "device" is
the CPU so CPU tensors are valid pointer arguments and meta tensors are on another device.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vramkit.errors import ConfigError, DeviceError, DeviceMismatchError, KernelError
from vramkit.kernels import _nvrtc
from vramkit.kernels import manager as manager_module
from vramkit.kernels.launch import DeviceLimits, LaunchConfig
from vramkit.kernels.manager import (
    CompiledKernel,
    KernelManager,
    KernelScalar,
    float16,
    float64,
    int8,
    int64,
    is_available,
    uint32,
    uint64,
)
from vramkit.kernels.stats import PerformanceStats

LIMITS = DeviceLimits(
    name="fake GPU", compute_capability=(9, 0), multiprocessor_count=4,
    max_threads_per_multiprocessor=2048, max_blocks_per_multiprocessor=32,
    max_shared_memory_per_block_optin=100 * 1024)
SOURCE = 'extern "C" __global__ void scale(float* out, const float* in, int n) {}'
# scale(float*, const float*, int)
INFO = _nvrtc.KernelInfo(num_arguments=3, argument_sizes=(8, 8, 4), max_threads_per_block=512,
                         num_regs=20, static_shared_bytes=0, local_bytes=0)


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_on: Any = None

    def record(self, stream: Any) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.25


class FakeBackend:
    """Records what the manager asks; "compiles" to bytes that name the kernel."""

    def __init__(self, info: _nvrtc.KernelInfo = INFO, compiler: str = "nvrtc-13.0") -> None:
        self.device = torch.device("cpu")
        self.arch = "sm_90"
        self.compiler = compiler
        self.limits = LIMITS
        self.info = info
        self.compiled: list[tuple[str, str, tuple[str, ...]]] = []
        self.loaded: list[bytes] = []
        self.launches: list[tuple[Any, LaunchConfig, list[tuple[str, Any]], Any]] = []
        self.events: list[FakeEvent] = []
        self.launch_error: Exception | None = None

    def compile(self, name: str, source: str, options: Sequence[str]) -> bytes:
        self.compiled.append((name, source, tuple(options)))
        if "syntax error" in source:
            raise KernelError("compile failed", log="scale.cu(1): error: expected a ';'")
        return f"CUBIN {name} {hash((source, tuple(options)))}".encode()

    def load(self, name: str, binary: bytes) -> Any:
        self.loaded.append(binary)
        if not binary.startswith(f"CUBIN {name} ".encode()):
            raise KernelError("not a cubin")
        return SimpleNamespace(name=name, binary=binary)

    def kernel_info(self, kernel: Any) -> _nvrtc.KernelInfo:
        return self.info

    def max_potential_block_size(self, kernel: Any, shared_mem: int) -> int | None:
        return 384

    def max_active_blocks(self, kernel: Any, block_size: int, shared_mem: int) -> int | None:
        return 2048 // block_size

    def resolve_stream(self, stream: Any) -> Any:
        return "current-stream" if stream is None else stream

    def new_timing_event(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]

    def launch(self, kernel: Any, config: LaunchConfig, args: Sequence[tuple[str, Any]],
               stream: Any) -> None:
        if self.launch_error is not None:
            raise self.launch_error
        self.launches.append((kernel, config, list(args), stream))


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> PerformanceStats:
    collector = PerformanceStats()
    monkeypatch.setattr(manager_module, "performance_stats", lambda: collector)
    return collector


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def manager(backend: FakeBackend, tmp_path: Path, stats: PerformanceStats) -> KernelManager:
    return KernelManager(backend, cache_dir=tmp_path)


# ---------------------------------------------------------------------------- availability


def _hide_cuda_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvrtc, "_cuda_core", None)
    for name in ("cuda.core", "cuda.core.experimental"):
        monkeypatch.setitem(sys.modules, name, None)


def test_without_cuda_core_nothing_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_cuda_core(monkeypatch)
    monkeypatch.setattr(manager_module, "_MANAGERS", {})
    assert is_available() is False
    with pytest.raises(KernelError, match="cuda-core") as info:
        KernelManager.get(0)
    assert "pip install" in info.value.hint


def test_without_a_gpu_nothing_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_core = SimpleNamespace(Device=object, LaunchConfig=object, ObjectCode=object,
                                launch=print, legacy_default_stream=None, name="fake")
    monkeypatch.setattr(_nvrtc, "_cuda_core", fake_core)
    monkeypatch.setattr("vramkit.devices._runtime.is_cuda_available", lambda: False)
    monkeypatch.setattr(manager_module, "_MANAGERS", {})
    assert is_available() is False
    with pytest.raises(KernelError, match="CUDA GPU"):
        KernelManager.get("cuda:0")


def test_a_cpu_device_is_refused() -> None:
    with pytest.raises(DeviceError):
        KernelManager.get("cpu")


def test_get_returns_one_manager_per_device(monkeypatch: pytest.MonkeyPatch,
                                            backend: FakeBackend) -> None:
    existing = KernelManager(backend)
    monkeypatch.setattr(manager_module, "_MANAGERS", {3: existing})
    assert KernelManager.get(3) is existing
    assert KernelManager.get("cuda:3") is existing


# ---------------------------------------------------------------------------- compiling


def test_compiles_once_and_reuses_in_memory(manager: KernelManager,
                                            backend: FakeBackend) -> None:
    first = manager.ensure_kernel("scale", SOURCE, options=("-O3",))
    again = manager.ensure_kernel("scale", SOURCE, options=["-O3"])
    assert again is first
    assert backend.compiled == [("scale", SOURCE, ("-O3",))]
    stats = manager.cache_stats()
    assert (stats.compiles, stats.memory_hits, stats.disk_hits) == (1, 1, 0)
    assert manager.kernels == ("scale",)
    assert manager.kernel("scale") is first
    assert isinstance(first, CompiledKernel) and first.num_arguments == 3
    assert first.max_threads_per_block == 512 and first.num_regs == 20


def test_a_new_manager_loads_from_disk_without_compiling(tmp_path: Path,
                                                         stats: PerformanceStats) -> None:
    first_backend = FakeBackend()
    KernelManager(first_backend, cache_dir=tmp_path).ensure_kernel("scale", SOURCE)
    second_backend = FakeBackend()
    second = KernelManager(second_backend, cache_dir=tmp_path)
    second.ensure_kernel("scale", SOURCE)
    assert second_backend.compiled == []
    assert (second.cache_stats().compiles, second.cache_stats().disk_hits) == (0, 1)
    # Another NVRTC version is another key: compiled again.
    third_backend = FakeBackend(compiler="nvrtc-12.8")
    KernelManager(third_backend, cache_dir=tmp_path).ensure_kernel("scale", SOURCE)
    assert len(third_backend.compiled) == 1


def test_disk_cache_off_always_compiles_and_writes_nothing(tmp_path: Path,
                                                           stats: PerformanceStats) -> None:
    for _ in range(2):
        backend = FakeBackend()
        KernelManager(backend, cache_dir=tmp_path).ensure_kernel("scale", SOURCE,
                                                                 disk_cache=False)
        assert len(backend.compiled) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_entry_is_recompiled(tmp_path: Path, stats: PerformanceStats) -> None:
    KernelManager(FakeBackend(), cache_dir=tmp_path).ensure_kernel("scale", SOURCE)
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(entry.read_bytes()[:-3])
    backend = FakeBackend()
    manager = KernelManager(backend, cache_dir=tmp_path)
    manager.ensure_kernel("scale", SOURCE)
    assert len(backend.compiled) == 1
    assert manager.cache_stats().corrupt_entries == 1


def test_an_entry_that_does_not_load_is_recompiled(tmp_path: Path,
                                                   stats: PerformanceStats) -> None:
    first = KernelManager(FakeBackend(), cache_dir=tmp_path)
    first.ensure_kernel("scale", SOURCE)
    key = _nvrtc.KernelDiskCache.key("scale", SOURCE, (), "sm_90", "nvrtc-13.0")
    first._disk.store(key, b"valid entry, wrong binary")
    backend = FakeBackend()
    KernelManager(backend, cache_dir=tmp_path).ensure_kernel("scale", SOURCE)
    assert len(backend.compiled) == 1


def test_new_source_or_options_replace_the_kernel(manager: KernelManager,
                                                  backend: FakeBackend) -> None:
    first = manager.ensure_kernel("scale", SOURCE)
    second = manager.ensure_kernel("scale", SOURCE, options=("-DFAST",))
    third = manager.ensure_kernel("scale", SOURCE + "\n// v2")
    assert len({id(first), id(second), id(third)}) == 3
    assert len(backend.compiled) == 3
    assert manager.kernel("scale") is third


def test_compile_errors_carry_the_log(manager: KernelManager) -> None:
    with pytest.raises(KernelError) as info:
        manager.ensure_kernel("scale", "syntax error here")
    assert "expected a ';'" in (info.value.log or "")
    assert manager.kernels == ()


@pytest.mark.parametrize("name, source, options", [
    ("", SOURCE, ()), ("not valid", SOURCE, ()), (3, SOURCE, ()), ("scale", "  ", ()),
    ("scale", SOURCE, "-O3"), ("scale", SOURCE, (3,)), ("scale", SOURCE, ("-arch=sm_80",)),
    ("scale", SOURCE, ("--gpu-architecture=sm_80",)),
])
def test_bad_ensure_arguments(manager: KernelManager, name: Any, source: Any,
                              options: Any) -> None:
    with pytest.raises(ConfigError):
        manager.ensure_kernel(name, source, options=options)


def test_unknown_kernel_name(manager: KernelManager) -> None:
    with pytest.raises(KernelError, match="ensure_kernel"):
        manager.kernel("nope")
    with pytest.raises(KernelError):
        manager.launch("nope", LaunchConfig(1, 32))


# ---------------------------------------------------------------------------- arguments


def test_arguments_are_packed_by_type(manager: KernelManager, backend: FakeBackend) -> None:
    backend.info = _nvrtc.KernelInfo(None, None, 1024, 10, 0, 0)  # no parameter info
    manager.ensure_kernel("scale", SOURCE)
    tensor = torch.ones(4)
    manager.launch("scale", LaunchConfig(1, 32), tensor, None, 7, 2.5, int64(2**40),
                   uint32(5), float64(0.1), float16(1.5), int8(-3), np.int16(9),
                   np.float64(3.0), np.uint64(11), np.bool_(True))
    (_, _, args, stream), = backend.launches
    assert args == [("ptr", tensor.data_ptr()), ("ptr", 0), ("int32", 7), ("float32", 2.5),
                    ("int64", 2**40), ("uint32", 5), ("float64", 0.1), ("float16", 1.5),
                    ("int8", -3), ("int16", 9), ("float64", 3.0), ("uint64", 11),
                    ("bool", True)]
    assert stream == "current-stream"


def test_argument_count_is_checked(manager: KernelManager, backend: FakeBackend) -> None:
    manager.ensure_kernel("scale", SOURCE)
    out, inp = torch.empty(8), torch.ones(8)
    with pytest.raises(KernelError, match="takes 3 arguments, got 2"):
        manager.launch("scale", LaunchConfig(1, 32), out, inp)
    with pytest.raises(KernelError, match="got 4"):
        manager.launch("scale", LaunchConfig(1, 32), out, inp, 8, 1)
    assert backend.launches == []
    manager.launch("scale", LaunchConfig(1, 32), out, inp, 8)
    assert len(backend.launches) == 1


@pytest.mark.parametrize("args, match", [
    ((torch.empty(1), torch.empty(1), int64(8)), "argument 2 is 4 bytes"),
    ((torch.empty(1), 5, 8), "argument 1 is 8 bytes"),
    ((torch.empty(1), torch.empty(1), float64(1.0)), "double"),
])
def test_argument_sizes_are_checked(manager: KernelManager, backend: FakeBackend,
                                    args: tuple[Any, ...], match: str) -> None:
    manager.ensure_kernel("scale", SOURCE)
    with pytest.raises(KernelError, match=match):
        manager.launch("scale", LaunchConfig(1, 32), *args)
    assert backend.launches == []


def test_tensors_on_another_device_are_refused(manager: KernelManager,
                                               backend: FakeBackend) -> None:
    manager.ensure_kernel("scale", SOURCE)
    with pytest.raises(DeviceMismatchError, match="kernel argument 1"):
        manager.launch("scale", LaunchConfig(1, 32), torch.empty(2),
                       torch.empty(2, device="meta"), 2)
    assert backend.launches == []


def test_non_contiguous_tensors_are_refused(manager: KernelManager,
                                            backend: FakeBackend) -> None:
    manager.ensure_kernel("scale", SOURCE)
    strided = torch.empty(4, 6).t()
    with pytest.raises(KernelError, match="non-contiguous") as info:
        manager.launch("scale", LaunchConfig(1, 32), torch.empty(24), strided, 24)
    assert "contiguous()" in info.value.hint
    assert backend.launches == []
    manager.launch("scale", LaunchConfig(1, 32), torch.empty(24), strided.contiguous(), 24)
    assert len(backend.launches) == 1


@pytest.mark.parametrize("value, match", [
    (2**31, "does not fit"), (-(2**31) - 1, "does not fit"), (True, "bool"),
    ("text", "unsupported type"), ([1, 2], "unsupported type"), (np.complex64(1), "no kernel"),
])
def test_unsupported_or_out_of_range_scalars(manager: KernelManager, value: Any,
                                             match: str) -> None:
    manager.ensure_kernel("scale", SOURCE)
    with pytest.raises(KernelError, match=match):
        manager.launch("scale", LaunchConfig(1, 32), torch.empty(1), torch.empty(1), value)


def test_int32_boundaries_are_accepted(manager: KernelManager, backend: FakeBackend) -> None:
    manager.ensure_kernel("scale", SOURCE)
    for value in (2**31 - 1, -(2**31)):
        manager.launch("scale", LaunchConfig(1, 32), torch.empty(1), torch.empty(1), value)
    assert [launch[2][2] for launch in backend.launches] == [("int32", 2**31 - 1),
                                                              ("int32", -(2**31))]


@pytest.mark.parametrize("ctype, value", [
    ("int8", 128), ("uint8", -1), ("uint32", 2**32), ("int64", 2**63), ("uint64", 2**64),
    ("int32", 1.5), ("float32", "x"), ("complex", 1), ("ptr", 0),
])
def test_scalar_wrappers_validate(ctype: str, value: Any) -> None:
    with pytest.raises((ConfigError, ValueError)):
        KernelScalar(ctype, value)


def test_scalar_wrapper_values() -> None:
    assert uint64(2**64 - 1).value == 2**64 - 1
    assert int64(np.int64(-5)).value == -5
    assert float64(1).value == 1.0 and isinstance(float64(1).value, float)
    assert KernelScalar("bool", 1).value is True
    assert int64(3).nbytes == 8 and int8(3).nbytes == 1


# ---------------------------------------------------------------------------- launching


def test_config_is_validated_against_device_and_kernel(manager: KernelManager,
                                                       backend: FakeBackend) -> None:
    manager.ensure_kernel("scale", SOURCE)
    args = (torch.empty(1), torch.empty(1), 1)
    with pytest.raises(ConfigError, match="register"):
        manager.launch("scale", LaunchConfig(1, 1024), *args)  # kernel max is 512
    with pytest.raises(ConfigError, match="fake GPU"):
        manager.launch("scale", LaunchConfig(1, 32, shared_mem=200 * 1024), *args)
    with pytest.raises(ConfigError):
        manager.launch("scale", (1, 32), *args)  # type: ignore[arg-type]
    assert backend.launches == []


def test_launch_by_compiled_kernel_and_explicit_stream(manager: KernelManager,
                                                       backend: FakeBackend) -> None:
    kernel = manager.ensure_kernel("scale", SOURCE)
    config = LaunchConfig.for_elements(1000, manager.limits, kernel)
    # The backend suggests 384 (5 x 384 = 1920 resident threads); 256 reaches 8 x 256 = 2048.
    assert config.block == (256, 1, 1)
    kernel.launch(config, torch.empty(1), torch.empty(1), 1000, stream="side-stream")
    assert backend.launches[0][1] == config
    assert backend.launches[0][3] == "side-stream"


def test_a_kernel_of_another_manager_is_refused(manager: KernelManager, tmp_path: Path,
                                                stats: PerformanceStats) -> None:
    other = KernelManager(FakeBackend(), cache_dir=tmp_path / "other")
    kernel = other.ensure_kernel("scale", SOURCE)
    with pytest.raises(KernelError, match="not a kernel of"):
        manager.launch(kernel, LaunchConfig(1, 32), torch.empty(1), torch.empty(1), 1)


def test_launch_failures_become_kernel_errors_with_a_hint(manager: KernelManager,
                                                          backend: FakeBackend) -> None:
    manager.ensure_kernel("scale", SOURCE)
    backend.launch_error = RuntimeError("CUDA error: too many resources requested for launch")
    with pytest.raises(KernelError, match="launch of kernel 'scale' failed") as info:
        manager.launch("scale", LaunchConfig(1, 32), torch.empty(1), torch.empty(1), 1)
    assert "launch parameters" in info.value.hint
    assert isinstance(info.value.__cause__, RuntimeError)


def test_launches_are_counted_and_timed_on_demand(manager: KernelManager, backend: FakeBackend,
                                                  stats: PerformanceStats) -> None:
    manager.ensure_kernel("scale", SOURCE)
    args = (torch.empty(1), torch.empty(1), 1)
    manager.launch("scale", LaunchConfig(1, 32), *args)
    assert backend.events == []  # timing off: no events at all
    stats.enable_timing()
    manager.launch("scale", LaunchConfig(1, 32), *args, stream="s1")
    start, end = backend.events
    assert start.recorded_on == end.recorded_on == "s1"
    snap = stats.snapshot(0)
    assert (snap.kernel_launches, snap.timed_launches) == (2, 1)
    assert snap.kernel_time_ms == pytest.approx(0.25)


def test_repr_mentions_the_kernels(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("scale", SOURCE)
    assert "scale" in repr(manager) and "scale" in repr(kernel)
