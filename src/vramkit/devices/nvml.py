"""Context-free NVML layer: what NVIDIA GPUs the driver sees, without touching CUDA.

Everything here goes through ``pynvml`` (the ``nvidia-ml-py`` distribution), imported lazily inside
functions so that ``import vramkit`` reads no NVML. NVML never creates a CUDA context, so these
functions are safe before ``fork``, before ``CUDA_VISIBLE_DEVICES`` is final, and in processes
that must not own a GPU (a launcher picking devices for its children).

Rules:

* Records are frozen dataclasses. A value NVML cannot give is ``None``, never a sentinel.
* NVML missing (no library, no driver, ``nvmlInit`` failing) is not an error: :func:`query_nvml`
  returns an empty snapshot with ``available=False`` and the reason in ``NvmlSnapshot.reason``.
* An optional field that raises ``NVMLError`` (typically ``NOT_SUPPORTED`` or ``NO_PERMISSION``)
  becomes ``None`` for that field only.
* Unified-memory GPUs (GH200, Jetson: ``nvmlDeviceGetMemoryInfo`` raises ``NOT_SUPPORTED``) are
  reported with ``unified_memory=True`` and ``None`` memory fields.
* MIG instances of a MIG-enabled GPU are listed in ``NvmlDevice.mig_devices`` (one level deep).

The equivalent ``nvidia-smi`` query of :func:`query_nvml` is::

    nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.free,memory.used,\\
        compute_cap,driver_version,pcie.link.gen.current,pcie.link.width.current,\\
        pcie.link.gen.max,pcie.link.width.max,utilization.gpu,utilization.memory --format=csv
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vramkit.devices.ids import normalize_pci_bus_id, normalize_uuid

__all__ = [
    "NvmlDevice",
    "NvmlProcess",
    "NvmlSnapshot",
    "normalize_pci_bus_id",
    "nvlink_connected",
    "nvml_session",
    "process_memory",
    "query_nvml",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# NVML return codes we treat specially (values from nvml.h; stable across releases).
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NOT_FOUND = 6
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NVML_DEVICE_MIG_ENABLE = 1
_NVML_CLOCK_SM = 1


@dataclass(frozen=True)
class NvmlProcess:
    """A process holding memory on one GPU, as NVML reports it.

    Attributes:
        pid: process id *in the host PID namespace* (inside a container it may not match
            ``os.getpid()``).
        used_memory: bytes of GPU memory, or ``None`` where NVML cannot tell (Windows WDDM,
            missing permission).
        kind: ``"C"`` (compute), ``"G"`` (graphics) or ``"C+G"`` (both lists), as ``nvidia-smi``.
    """

    pid: int
    used_memory: int | None
    kind: str = "C"


@dataclass(frozen=True)
class NvmlDevice:
    """One physical GPU (or one MIG instance) as NVML sees it.

    ``index`` is NVML's index (PCI bus order, what ``nvidia-smi`` shows), which is not
    necessarily the CUDA ordinal: see :func:`vramkit.devices.info.resolve_visible_devices`.
    A MIG instance carries its parent's ``index`` and its own ``mig_index``.

    Equivalent: ``nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total --format=csv``.
    """

    index: int
    uuid: str
    name: str
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    unified_memory: bool = False
    compute_capability: tuple[int, int] | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    pcie_max_generation: int | None = None
    pcie_max_width: int | None = None
    utilization_gpu: int | None = None
    utilization_memory: int | None = None
    cuda_cores: int | None = None
    max_sm_clock_mhz: int | None = None
    processes: tuple[NvmlProcess, ...] = ()
    mig_enabled: bool | None = None
    mig_devices: tuple[NvmlDevice, ...] = ()
    mig_index: int | None = None
    parent_uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def is_mig(self) -> bool:
        """Whether this record is a MIG instance (not a whole GPU)."""
        return self.parent_uuid is not None

    def process_memory(self, pid: int) -> int | None:
        """Bytes of this device's memory used by ``pid`` (0 if absent, ``None`` if unknown)."""
        for proc in self.processes:
            if proc.pid == pid:
                return proc.used_memory
        return 0


@dataclass(frozen=True)
class NvmlSnapshot:
    """Everything :func:`query_nvml` saw at one moment.

    Attributes:
        available: whether NVML could be initialized at all.
        devices: the GPUs in NVML index order (empty when ``available`` is false).
        driver_version: e.g. ``"560.35.03"``.
        cuda_driver_version: the CUDA version the driver supports, e.g. ``"12.6"``.
        reason: why NVML is unavailable (for ``vramkit info``), else ``None``.
        warnings: devices or fields that failed unexpectedly (a lost GPU, ...).
    """

    available: bool
    devices: tuple[NvmlDevice, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    reason: str | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def device_count(self) -> int:
        """Number of whole GPUs (MIG instances not counted)."""
        return len(self.devices)

    def all_devices(self) -> tuple[NvmlDevice, ...]:
        """Whole GPUs followed, each, by their MIG instances."""
        out: list[NvmlDevice] = []
        for dev in self.devices:
            out.append(dev)
            out.extend(dev.mig_devices)
        return tuple(out)

    def by_uuid(self, uuid: str) -> NvmlDevice | None:
        """The GPU or MIG instance whose UUID matches ``uuid`` (any form), else ``None``."""
        key = normalize_uuid(uuid)
        for dev in self.all_devices():
            if normalize_uuid(dev.uuid) == key:
                return dev
        return None




def _import_pynvml() -> Any:
    import pynvml  # lazily: importing vramkit must not load NVML

    return pynvml


def _nvml_error_value(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def _reason_from_error(err: BaseException) -> str:
    value = _nvml_error_value(err)
    if value == _NVML_ERROR_LIBRARY_NOT_FOUND:
        return "NVML library (libnvidia-ml.so) not found: no NVIDIA driver visible"
    if value == _NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded"
    return f"nvmlInit failed: {err}"


@contextlib.contextmanager
def nvml_session() -> Iterator[Any]:
    """Initialize NVML for the duration of a ``with`` block and shut it down after.

    NVML keeps a reference count, so nested sessions (and other libraries' sessions) are safe.

    Yields:
        The ``pynvml`` module, initialized.

    Raises:
        vramkit.errors.NvmlError: when ``pynvml`` is not installed or ``nvmlInit`` fails.
    """
    from vramkit.errors import NvmlError

    try:
        pynvml = _import_pynvml()
    except ImportError as err:
        raise NvmlError(f"nvidia-ml-py is not installed ({err})",
                        "pip install nvidia-ml-py") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlError(_reason_from_error(err)) from err
    except OSError as err:  # a broken libnvidia-ml.so can surface as OSError from ctypes
        raise NvmlError(f"nvmlInit failed: {err}") from err
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:  # shutdown failing must not mask the real result
            logger.debug("nvmlShutdown failed: %s", err)


def _as_str(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _optional(pynvml: Any, what: str, fn: Callable[..., _T], *args: Any) -> _T | None:
    """Call an NVML getter for an optional field: ``NVMLError`` -> ``None`` for that field."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        logger.debug("NVML %s unavailable: %s", what, err)
        return None


def _getter(pynvml: Any, name: str) -> Callable[..., Any] | None:
    # Older nvidia-ml-py releases lack some getters; a missing one is an unsupported field.
    return getattr(pynvml, name, None)


def _optional_call(pynvml: Any, name: str, *args: Any) -> Any:
    fn = _getter(pynvml, name)
    if fn is None:
        return None
    return _optional(pynvml, name, fn, *args)


def _read_processes(pynvml: Any, handle: Any) -> tuple[NvmlProcess, ...]:
    merged: dict[int, NvmlProcess] = {}
    for getter, kind in (("nvmlDeviceGetComputeRunningProcesses", "C"),
                         ("nvmlDeviceGetGraphicsRunningProcesses", "G")):
        procs = _optional_call(pynvml, getter, handle) or []
        for proc in procs:
            pid = int(proc.pid)
            used = getattr(proc, "usedGpuMemory", None)
            used = int(used) if used is not None else None
            seen = merged.get(pid)
            if seen is None:
                merged[pid] = NvmlProcess(pid=pid, used_memory=used, kind=kind)
            else:
                # One allocation listed in both the compute and the graphics list, not two.
                best = max((u for u in (seen.used_memory, used) if u is not None), default=None)
                merged[pid] = NvmlProcess(pid=pid, used_memory=best, kind="C+G")
    return tuple(merged[pid] for pid in sorted(merged))


def _read_memory(pynvml: Any, handle: Any) -> tuple[int | None, int | None, int | None, bool]:
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as err:
        if _nvml_error_value(err) == _NVML_ERROR_NOT_SUPPORTED:
            # Unified memory (GH200, Jetson): no separate framebuffer to report.
            return None, None, None, True
        logger.debug("NVML memory info unavailable: %s", err)
        return None, None, None, False
    return int(mem.total), int(mem.free), int(mem.used), False


def _read_device(pynvml: Any, handle: Any, index: int, *, include_processes: bool,
                 parent: NvmlDevice | None = None, mig_index: int | None = None) -> NvmlDevice:
    """Read one device; the UUID and name are required, everything else optional."""
    uuid = _as_str(pynvml.nvmlDeviceGetUUID(handle))
    name = _as_str(pynvml.nvmlDeviceGetName(handle))
    total, free, used, unified = _read_memory(pynvml, handle)
    pci = _optional_call(pynvml, "nvmlDeviceGetPciInfo", handle)
    pci_bus_id = normalize_pci_bus_id(getattr(pci, "busId", None)) if pci is not None else None
    cc = _optional_call(pynvml, "nvmlDeviceGetCudaComputeCapability", handle)
    util = _optional_call(pynvml, "nvmlDeviceGetUtilizationRates", handle)
    clock_fn = _getter(pynvml, "nvmlDeviceGetMaxClockInfo")
    max_clock = (_optional(pynvml, "max SM clock", clock_fn, handle, _NVML_CLOCK_SM)
                 if clock_fn is not None else None)
    if parent is not None:
        # A MIG instance shares its parent's PCI link and architecture.
        pci_bus_id = pci_bus_id or parent.pci_bus_id
        cc = cc or parent.compute_capability
    mig_enabled: bool | None = None
    if parent is None:
        mig_mode = _optional_call(pynvml, "nvmlDeviceGetMigMode", handle)
        mig_enabled = None if mig_mode is None else mig_mode[0] == _NVML_DEVICE_MIG_ENABLE
    record = NvmlDevice(
        index=index,
        uuid=uuid,
        name=name,
        pci_bus_id=pci_bus_id,
        memory_total=total,
        memory_free=free,
        memory_used=used,
        unified_memory=unified,
        compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
        pcie_generation=_optional_call(pynvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
        pcie_width=_optional_call(pynvml, "nvmlDeviceGetCurrPcieLinkWidth", handle),
        pcie_max_generation=_optional_call(pynvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle),
        pcie_max_width=_optional_call(pynvml, "nvmlDeviceGetMaxPcieLinkWidth", handle),
        utilization_gpu=int(util.gpu) if util is not None else None,
        utilization_memory=int(util.memory) if util is not None else None,
        cuda_cores=_optional_call(pynvml, "nvmlDeviceGetNumGpuCores", handle),
        max_sm_clock_mhz=int(max_clock) if max_clock is not None else None,
        processes=_read_processes(pynvml, handle) if include_processes else (),
        mig_enabled=mig_enabled,
        mig_index=mig_index,
        parent_uuid=parent.uuid if parent is not None else None,
        gpu_instance_id=(_optional_call(pynvml, "nvmlDeviceGetGpuInstanceId", handle)
                         if parent is not None else None),
        compute_instance_id=(_optional_call(pynvml, "nvmlDeviceGetComputeInstanceId", handle)
                             if parent is not None else None),
    )
    if mig_enabled:
        record = _with_mig_devices(pynvml, handle, record, include_processes=include_processes)
    return record


def _with_mig_devices(pynvml: Any, handle: Any, parent: NvmlDevice, *,
                      include_processes: bool) -> NvmlDevice:
    migs: list[NvmlDevice] = []
    for mig_handle in _mig_handles(pynvml, handle, parent.index):
        migs.append(_read_device(pynvml, mig_handle, parent.index, parent=parent,
                                 mig_index=len(migs), include_processes=include_processes))
    return dataclasses.replace(parent, mig_devices=tuple(migs))


def _cuda_version_string(version: int | None) -> str | None:
    if version is None:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def query_nvml(*, include_processes: bool = True) -> NvmlSnapshot:
    """Enumerate NVIDIA GPUs through NVML, without creating a CUDA context.

    Args:
        include_processes: also list running compute/graphics processes per device
            (default ``True``; ``False`` saves two NVML calls per GPU).

    Returns:
        An :class:`NvmlSnapshot`. When NVML is missing or fails to initialize, the snapshot has
        ``available=False``, no devices and the reason in ``reason``; this never raises for that.
    """
    from vramkit.errors import NvmlError

    try:
        with nvml_session() as pynvml:
            return _query(pynvml, include_processes=include_processes)
    except NvmlError as err:
        logger.debug("NVML unavailable: %s", err.message)
        return NvmlSnapshot(available=False, reason=err.message)


def _query(pynvml: Any, *, include_processes: bool) -> NvmlSnapshot:
    warnings: list[str] = []
    driver = _optional_call(pynvml, "nvmlSystemGetDriverVersion")
    # _v2 reports the version of the installed libcuda; old drivers lack it, so fall back.
    cuda = (_optional_call(pynvml, "nvmlSystemGetCudaDriverVersion_v2")
            or _optional_call(pynvml, "nvmlSystemGetCudaDriverVersion"))
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as err:
        return NvmlSnapshot(available=False, reason=f"nvmlDeviceGetCount failed: {err}",
                            driver_version=_as_str(driver) if driver is not None else None)
    devices: list[NvmlDevice] = []
    for index in range(count):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            devices.append(_read_device(pynvml, handle, index,
                                        include_processes=include_processes))
        except pynvml.NVMLError as err:
            # A lost or inaccessible GPU must not hide the others.
            warnings.append(f"GPU {index}: {err}")
            logger.warning("NVML could not read GPU %d: %s", index, err)
    return NvmlSnapshot(
        available=True,
        devices=tuple(devices),
        driver_version=_as_str(driver) if driver is not None else None,
        cuda_driver_version=_cuda_version_string(cuda),
        warnings=tuple(warnings),
    )


def process_memory(pid: int | Iterable[int] | None = None) -> int | None:
    """GPU memory used by one or more processes, summed over all GPUs (and MIG instances).

    Counts NVML's running compute and graphics processes; a process listed in both lists of one
    GPU counts once. On a GPU in MIG mode the instances are read (the parent's lists aggregate
    them, so reading both would count a process twice); the parent is read only when no
    instance handle is available. Inside a container without ``--pid=host`` NVML reports host
    PIDs, so this returns 0 for a PID it cannot see. All PIDs are read in one NVML session.

    Args:
        pid: a process id or several (default: this process, ``os.getpid()``).

    Returns:
        Bytes used; 0 when the processes hold no GPU memory; ``None`` when NVML is unavailable
        or lists one of them without a memory figure.
    """
    from vramkit.errors import NvmlError

    if pid is None:
        targets = {os.getpid()}
    elif isinstance(pid, int):
        targets = {pid}
    else:
        targets = {int(p) for p in pid}
    try:
        with nvml_session() as pynvml:
            try:
                return _sum_process_memory(pynvml, targets)
            except pynvml.NVMLError as err:
                logger.debug("process_memory: NVML query failed: %s", err)
                return None
    except NvmlError as err:
        logger.debug("process_memory: NVML unavailable: %s", err.message)
        return None


def _sum_process_memory(pynvml: Any, pids: set[int]) -> int | None:
    total = 0
    for index in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mode = _optional_call(pynvml, "nvmlDeviceGetMigMode", handle)
        mig = mode is not None and mode[0] == _NVML_DEVICE_MIG_ENABLE
        handles = (_mig_handles(pynvml, handle, index) if mig else []) or [handle]
        for one in handles:
            for proc in _read_processes(pynvml, one):
                if proc.pid in pids:
                    if proc.used_memory is None:
                        return None
                    total += proc.used_memory
    return total


def _mig_handles(pynvml: Any, handle: Any, gpu_index: int) -> list[Any]:
    """Handles of the MIG instances of a GPU in MIG mode, in slot order."""
    out = []
    count = _optional_call(pynvml, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
    for slot in range(int(count)):
        try:
            out.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
        except pynvml.NVMLError as err:
            # Empty slots answer NOT_FOUND: the GPU has fewer instances than its maximum.
            if _nvml_error_value(err) != _NVML_ERROR_NOT_FOUND:
                logger.debug("MIG slot %d of GPU %d unreadable: %s", slot, gpu_index, err)
    return out


def nvlink_connected(uuids: list[str]) -> bool | None:
    """Whether every pair of these GPUs can reach each other over NVLink (NVML's peer-to-peer
    status for the NVLink capability).

    Args:
        uuids: the GPUs' UUIDs, any form :func:`vramkit.devices.ids.normalize_uuid` reads.

    Returns:
        ``True`` or ``False``; ``None`` when NVML cannot say (no driver, a GPU it does not
        list, a getter this nvidia-ml-py lacks). One GPU is trivially connected.
    """
    from vramkit.devices.ids import normalize_uuid
    from vramkit.errors import NvmlError

    if len(uuids) < 2:
        return True
    try:
        with nvml_session() as pynvml:
            status = _getter(pynvml, "nvmlDeviceGetP2PStatus")
            index = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
            if status is None or index is None:
                return None
            ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
            try:
                handles = [pynvml.nvmlDeviceGetHandleByUUID("GPU-" + normalize_uuid(u))
                           for u in uuids]
                return all(status(a, b, index) == ok
                           for i, a in enumerate(handles) for b in handles[i + 1:])
            except pynvml.NVMLError as err:  # a GPU NVML does not list, an old driver
                logger.debug("NVLink status unavailable: %s", err)
                return None
    except NvmlError as err:
        logger.debug("NVLink status unavailable: %s", err)
        return None
