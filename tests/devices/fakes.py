"""Fakes for device tests: NVML (``pynvml``), ``torch.cuda`` and JAX device state, no GPU needed.

Typical use::

    gpus = [make_gpu(0), make_gpu(1, compute_capability=(8, 0))]
    nvml = install_fake_nvml(monkeypatch, gpus)          # sys.modules["pynvml"] is the fake
    install_fake_torch_cuda(monkeypatch, [gpus[1]])      # torch sees only GPU 1, as cuda:0
    forbid_cuda(monkeypatch)                             # any CUDA initialization fails

``FakeGpu.not_supported`` names NVML getters that raise ``NOT_SUPPORTED`` for that GPU;
``unified_memory=True`` makes ``nvmlDeviceGetMemoryInfo`` raise it (GH200/Jetson style);
``FakeGpu.mig`` lists MIG instances (a non-empty list means MIG mode is on).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

GiB = 1024**3
MiB = 1024**2

# NVML return codes (nvml.h).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15


def gpu_uuid(n: int) -> str:
    """A distinct, valid NVML GPU UUID for fake GPU ``n``."""
    return f"GPU-{n:08x}-aaaa-bbbb-cccc-{n:012x}"


def mig_uuid(n: int, slot: int) -> str:
    """A distinct, valid NVML MIG UUID for instance ``slot`` of fake GPU ``n``."""
    return f"MIG-{n:08x}-dddd-eeee-{slot:04x}-{n:012x}"


@dataclass
class FakeMig:
    """One MIG instance of a :class:`FakeGpu`."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    memory_total: int = 40 * GiB
    memory_used: int = 0
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    sm_count: int = 60
    processes: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class FakeGpu:
    """One fake GPU: what NVML reports and what ``torch.cuda.get_device_properties`` returns."""

    uuid: str
    name: str = "NVIDIA H200"
    pci_bus_id: str = "00000000:01:00.0"
    memory_total: int = 80 * GiB
    memory_used: int = 1 * GiB
    compute_capability: tuple[int, int] = (9, 0)
    sm_count: int = 132
    cuda_cores: int | None = 16896
    max_sm_clock_mhz: int | None = 1980
    pcie: tuple[int, int, int, int] = (5, 16, 5, 16)  # current gen, width, max gen, max width
    utilization: tuple[int, int] = (0, 0)  # gpu %, memory %
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # compute (pid, bytes)
    graphics_processes: list[tuple[int, int | None]] = field(default_factory=list)
    unified_memory: bool = False
    not_supported: frozenset[str] = frozenset()
    lost: bool = False  # every per-device call raises GPU_IS_LOST
    mig: list[FakeMig] = field(default_factory=list)
    # torch properties
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 227 * 1024
    l2_cache_size: int = 60 * MiB
    warp_size: int = 32
    max_threads_per_block: int = 1024
    torch_missing_attrs: frozenset[str] = frozenset()  # simulate an older torch

    @property
    def memory_free(self) -> int:
        return self.memory_total - self.memory_used


def make_gpu(n: int, **overrides: Any) -> FakeGpu:
    """Fake GPU number ``n`` with a unique UUID and PCI bus id (bus ``n+1``), H200 defaults."""
    values: dict[str, Any] = {"uuid": gpu_uuid(n), "pci_bus_id": f"00000000:{n + 1:02X}:00.0"}
    values.update(overrides)
    return FakeGpu(**values)


class FakeNVMLError(Exception):
    """Stands in for ``pynvml.NVMLError``: carries the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NVML_ERROR_NOT_SUPPORTED: "Not Supported",
                NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
                NVML_ERROR_NOT_FOUND: "Not Found",
                NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
                NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
                NVML_ERROR_GPU_IS_LOST: "GPU is lost"}.get(self.value, f"code {self.value}")


@dataclass
class _Handle:
    gpu: FakeGpu
    mig: FakeMig | None = None


def _proc(pid: int, used: int | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


def build_fake_pynvml(gpus: Sequence[FakeGpu], *, driver_version: str = "560.35.03",
                      cuda_driver_version: int = 12060,
                      init_error: int | None = None) -> types.ModuleType:
    """A module with the subset of the ``pynvml`` API vramkit uses, backed by ``gpus``.

    The module counts ``init_calls`` and ``shutdown_calls`` so tests can check the pairing.
    """
    mod = types.ModuleType("pynvml")
    mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    mod.init_calls = 0  # type: ignore[attr-defined]
    mod.shutdown_calls = 0  # type: ignore[attr-defined]

    def check(handle: _Handle, fn: str) -> None:
        if handle.gpu.lost:
            raise FakeNVMLError(NVML_ERROR_GPU_IS_LOST)
        if fn in handle.gpu.not_supported:
            raise FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)

    def nvmlInit() -> None:
        if init_error is not None:
            raise FakeNVMLError(init_error)
        mod.init_calls += 1  # type: ignore[attr-defined]

    def nvmlShutdown() -> None:
        mod.shutdown_calls += 1  # type: ignore[attr-defined]

    def nvmlSystemGetDriverVersion() -> str:
        return driver_version

    def nvmlSystemGetCudaDriverVersion_v2() -> int:
        return cuda_driver_version

    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        return _Handle(gpus[index])

    def nvmlDeviceGetUUID(h: _Handle) -> str:
        check(h, "nvmlDeviceGetUUID")
        return h.mig.uuid if h.mig else h.gpu.uuid

    def nvmlDeviceGetName(h: _Handle) -> str:
        check(h, "nvmlDeviceGetName")
        return h.mig.name if h.mig else h.gpu.name

    def nvmlDeviceGetMemoryInfo(h: _Handle) -> types.SimpleNamespace:
        check(h, "nvmlDeviceGetMemoryInfo")
        if h.gpu.unified_memory:
            raise FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)
        total = h.mig.memory_total if h.mig else h.gpu.memory_total
        used = h.mig.memory_used if h.mig else h.gpu.memory_used
        return types.SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetPciInfo(h: _Handle) -> types.SimpleNamespace:
        check(h, "nvmlDeviceGetPciInfo")
        return types.SimpleNamespace(busId=h.gpu.pci_bus_id.encode())  # bytes, as pynvml

    def nvmlDeviceGetCudaComputeCapability(h: _Handle) -> tuple[int, int]:
        check(h, "nvmlDeviceGetCudaComputeCapability")
        return h.gpu.compute_capability

    def _pcie(position: int, name: str) -> Any:
        def getter(h: _Handle) -> int:
            check(h, name)
            return h.gpu.pcie[position]
        return getter

    def nvmlDeviceGetUtilizationRates(h: _Handle) -> types.SimpleNamespace:
        check(h, "nvmlDeviceGetUtilizationRates")
        return types.SimpleNamespace(gpu=h.gpu.utilization[0], memory=h.gpu.utilization[1])

    def nvmlDeviceGetNumGpuCores(h: _Handle) -> int:
        check(h, "nvmlDeviceGetNumGpuCores")
        if h.gpu.cuda_cores is None:
            raise FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)
        return h.gpu.cuda_cores

    def nvmlDeviceGetMaxClockInfo(h: _Handle, clock: int) -> int:
        check(h, "nvmlDeviceGetMaxClockInfo")
        if h.gpu.max_sm_clock_mhz is None:
            raise FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)
        return h.gpu.max_sm_clock_mhz

    def nvmlDeviceGetComputeRunningProcesses(h: _Handle) -> list[types.SimpleNamespace]:
        check(h, "nvmlDeviceGetComputeRunningProcesses")
        procs = h.mig.processes if h.mig else h.gpu.processes
        return [_proc(pid, used) for pid, used in procs]

    def nvmlDeviceGetGraphicsRunningProcesses(h: _Handle) -> list[types.SimpleNamespace]:
        check(h, "nvmlDeviceGetGraphicsRunningProcesses")
        return [] if h.mig else [_proc(pid, used) for pid, used in h.gpu.graphics_processes]

    def nvmlDeviceGetMigMode(h: _Handle) -> list[int]:
        check(h, "nvmlDeviceGetMigMode")
        return [1, 1] if h.gpu.mig else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(h: _Handle) -> int:
        check(h, "nvmlDeviceGetMaxMigDeviceCount")
        return 7 if h.gpu.mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(h: _Handle, slot: int) -> _Handle:
        if slot >= len(h.gpu.mig):
            raise FakeNVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle(h.gpu, h.gpu.mig[slot])

    def nvmlDeviceGetGpuInstanceId(h: _Handle) -> int:
        assert h.mig is not None
        return h.mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(h: _Handle) -> int:
        assert h.mig is not None
        return h.mig.compute_instance_id

    for fn in (nvmlInit, nvmlShutdown, nvmlSystemGetDriverVersion,
               nvmlSystemGetCudaDriverVersion_v2, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
               nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetMemoryInfo,
               nvmlDeviceGetPciInfo, nvmlDeviceGetCudaComputeCapability,
               nvmlDeviceGetUtilizationRates, nvmlDeviceGetNumGpuCores, nvmlDeviceGetMaxClockInfo,
               nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetGraphicsRunningProcesses,
               nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount,
               nvmlDeviceGetMigDeviceHandleByIndex, nvmlDeviceGetGpuInstanceId,
               nvmlDeviceGetComputeInstanceId):
        setattr(mod, fn.__name__, fn)
    for position, name in enumerate(("nvmlDeviceGetCurrPcieLinkGeneration",
                                     "nvmlDeviceGetCurrPcieLinkWidth",
                                     "nvmlDeviceGetMaxPcieLinkGeneration",
                                     "nvmlDeviceGetMaxPcieLinkWidth")):
        setattr(mod, name, _pcie(position, name))
    return mod


def install_fake_nvml(monkeypatch: pytest.MonkeyPatch, gpus: Sequence[FakeGpu],
                      **kwargs: Any) -> types.ModuleType:
    """Make ``import pynvml`` return a fake backed by ``gpus`` (see :func:`build_fake_pynvml`)."""
    mod = build_fake_pynvml(gpus, **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return mod


def install_missing_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import pynvml`` raise ImportError (nvidia-ml-py not installed)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


class FakeCuUuid:
    """Like torch's ``_CUuuid``: ``bytes`` is a list of 16 ints, ``str()`` is dashed hex."""

    def __init__(self, nvml_uuid: str) -> None:
        digits = nvml_uuid[4:].replace("-", "")
        self.bytes = list(bytes.fromhex(digits))

    def __str__(self) -> str:
        h = bytes(self.bytes).hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def fake_device_properties(gpu: FakeGpu | FakeMig, parent: FakeGpu | None = None
                           ) -> types.SimpleNamespace:
    """What ``torch.cuda.get_device_properties`` would return for ``gpu`` (or a MIG instance)."""
    base = parent if isinstance(gpu, FakeMig) else gpu
    assert isinstance(base, FakeGpu), "a FakeMig needs its parent FakeGpu"
    sm_count = gpu.sm_count
    props = {
        "name": gpu.name,
        "major": base.compute_capability[0],
        "minor": base.compute_capability[1],
        "total_memory": gpu.memory_total,
        "multi_processor_count": sm_count,
        "max_threads_per_block": base.max_threads_per_block,
        "shared_memory_per_block": base.shared_memory_per_block,
        "shared_memory_per_block_optin": base.shared_memory_per_block_optin,
        "L2_cache_size": base.l2_cache_size,
        "warp_size": base.warp_size,
        "is_integrated": base.unified_memory,
        "uuid": FakeCuUuid(gpu.uuid),
    }
    for name in base.torch_missing_attrs:
        props.pop(name, None)
    return types.SimpleNamespace(**props)


def install_fake_torch_cuda(monkeypatch: pytest.MonkeyPatch,
                            visible: Sequence[FakeGpu | tuple[FakeMig, FakeGpu]], *,
                            cuda_version: str = "12.6") -> None:
    """Make ``torch.cuda`` report ``visible`` as cuda:0, cuda:1, ... (in that order).

    Entries are fake GPUs, or ``(mig, parent)`` pairs for MIG instances.
    """
    import torch

    props = [fake_device_properties(v[0], v[1]) if isinstance(v, tuple)
             else fake_device_properties(v) for v in visible]

    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        index = _ordinal(device)
        if not 0 <= index < len(props):
            raise AssertionError(f"invalid device ordinal {index}")
        return props[index]

    def _ordinal(device: Any) -> int:
        if device is None:
            return 0
        if isinstance(device, torch.device):
            return device.index or 0
        if isinstance(device, str):
            return torch.device(device).index or 0
        return int(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(props))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (get_device_properties(device).major,
                                             get_device_properties(device).minor))
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: get_device_properties(device).name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)


def forbid_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way of initializing CUDA (or reading its properties) raise."""
    import torch

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("CUDA was initialized or queried")

    for name in ("_lazy_init", "init", "get_device_properties", "get_device_capability",
                 "current_device", "is_available", "device_count"):
        monkeypatch.setattr(torch.cuda, name, refuse)


@dataclass
class FakeJaxDevice:
    """A JAX GPU device: ``id``, ``local_hardware_id`` and optionally ``pci_bus_id``."""

    id: int
    local_hardware_id: int
    pci_bus_id: str | None = None
    platform: str = "gpu"


def install_fake_jax(monkeypatch: pytest.MonkeyPatch, devices: Sequence[FakeJaxDevice],
                     *, gpu_backend: bool = True) -> types.ModuleType:
    """Make ``import jax`` return a fake whose ``devices("gpu")`` lists ``devices``."""
    mod = types.ModuleType("jax")

    def jax_devices(backend: str | None = None) -> list[FakeJaxDevice]:
        if not gpu_backend:
            raise RuntimeError("Unknown backend: 'gpu' requested, but no platforms are gpu")
        return list(devices)

    mod.devices = jax_devices  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jax", mod)
    return mod
