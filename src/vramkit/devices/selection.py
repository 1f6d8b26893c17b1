"""Choosing devices and precision: BitNet's device listing plus nvitop-style selection.

:func:`select_device` and :func:`select_devices` work from NVML only (physical devices) and never
initialize CUDA, so a launcher can pick GPUs and export ``CUDA_VISIBLE_DEVICES`` for its children
before any CUDA work. They choose among the devices this process may see (the current
``CUDA_VISIBLE_DEVICES`` is respected, see :func:`~vramkit.devices.info.resolve_visible_devices`).

:func:`list_cuda_devices` and :func:`select_precision` use PyTorch's view (they may initialize
CUDA).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from vramkit._validate import check_choice, check_device, check_int, check_number, check_size
from vramkit.devices._runtime import is_cuda_available
from vramkit.devices.info import (
    DeviceInfo,
    VisibleDevice,
    detect_devices,
    resolve_visible_devices,
)
from vramkit.devices.resolve import cuda_ordinal
from vramkit.errors import DeviceError
from vramkit.units import format_size

if TYPE_CHECKING:
    import torch

    from vramkit.devices.nvml import NvmlDevice, NvmlSnapshot

__all__ = [
    "SELECTION_POLICIES",
    "DeviceChoice",
    "DeviceSelection",
    "PrecisionChoice",
    "is_cuda_available",
    "list_cuda_devices",
    "select_device",
    "select_devices",
    "select_precision",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# listing


def list_cuda_devices(*, include_jax: bool = False) -> list[DeviceInfo]:
    """The CUDA devices this process can use, in CUDA ordinal order (BitNet ``list_cuda_devices``).

    Args:
        include_jax: also fill ``jax_id`` (imports JAX; default ``False``).

    Returns:
        :class:`~vramkit.devices.info.DeviceInfo` records (empty without CUDA). See
        :func:`~vramkit.devices.info.detect_devices`, which this calls.
    """
    return detect_devices(include_jax=include_jax)


# ----------------------------------------------------------------------------------------------
# selection from NVML


def _free_key(dev: NvmlDevice) -> tuple[int, int]:
    # Unknown free memory (unified-memory GPUs) ranks below any known figure.
    return (1, dev.memory_free) if dev.memory_free is not None else (0, 0)


def _total_key(dev: NvmlDevice) -> tuple[int, int]:
    return (1, dev.memory_total) if dev.memory_total is not None else (0, 0)


def _fastest_key(dev: NvmlDevice) -> tuple[int, int, int, int]:
    cc = dev.compute_capability or (0, 0)
    cores = dev.cuda_cores or 0
    clock = dev.max_sm_clock_mhz or 0
    # Peak throughput scales with cores x clock within an architecture; architecture first.
    return (cc[0], cc[1], cores * clock, dev.memory_total or 0)


SELECTION_POLICIES: Mapping[str, Callable[[NvmlDevice], tuple[int, ...]]] = {
    "most_free_memory": _free_key,
    "largest_memory": _total_key,
    "fastest": _fastest_key,
}


def _check_policy(policy: str) -> Callable[[NvmlDevice], tuple[int, ...]]:
    check_choice("policy", policy, SELECTION_POLICIES,
                 hint=f"{policy!r} is an unknown device selection policy; use one of: "
                      f"{', '.join(SELECTION_POLICIES)}.")
    return SELECTION_POLICIES[policy]


def _candidates(snapshot: NvmlSnapshot | None,
                env: Mapping[str, str] | None) -> tuple[VisibleDevice, ...]:
    if snapshot is None:
        from vramkit.devices.nvml import query_nvml

        snapshot = query_nvml(include_processes=False)
    if not snapshot.available:
        raise DeviceError(f"no NVIDIA GPU visible: {snapshot.reason}",
                          "Install the NVIDIA driver (and nvidia-ml-py), or run on the CPU; "
                          "`vramkit info` shows what this process can see.")
    visible = resolve_visible_devices(snapshot, env)
    if not visible:
        raise DeviceError(
            f"no GPU is visible to this process (NVML sees {len(snapshot.devices)}, "
            "CUDA_VISIBLE_DEVICES hides them all)" if snapshot.devices
            else "NVML reports no NVIDIA GPU on this machine",
            "Unset or widen CUDA_VISIBLE_DEVICES, or run on the CPU.")
    return visible


def _rank(candidates: Sequence[VisibleDevice],
          key: Callable[[NvmlDevice], tuple[int, ...]]) -> list[VisibleDevice]:
    # Stable sort on the policy key, ties going to the lower CUDA ordinal.
    return sorted(candidates, key=lambda v: (tuple(-k for k in key(v.device)), v.cuda_ordinal))


class DeviceChoice(NamedTuple):
    """The device :func:`select_device` picked.

    Attributes:
        cuda_ordinal: the index to use in this process (``torch.device("cuda", cuda_ordinal)``).
        device: the NVML record.
        policy: the policy that ranked it first.
        reason: one line on why (for logs and ``vramkit select``).
    """

    cuda_ordinal: int
    device: NvmlDevice
    policy: str
    reason: str

    @property
    def torch_device(self) -> torch.device:
        """``torch.device("cuda", cuda_ordinal)`` (creating it does not initialize CUDA)."""
        import torch

        return torch.device("cuda", self.cuda_ordinal)


def _describe(dev: NvmlDevice, policy: str) -> str:
    if policy == "most_free_memory":
        free = "unknown" if dev.memory_free is None else format_size(dev.memory_free)
        return f"{free} free"
    if policy == "largest_memory":
        total = "unknown" if dev.memory_total is None else format_size(dev.memory_total)
        return f"{total} total"
    cc = dev.compute_capability
    return f"compute capability {cc[0]}.{cc[1]}" if cc else "compute capability unknown"


def select_device(policy: str = "most_free_memory", *, snapshot: NvmlSnapshot | None = None,
                  env: Mapping[str, str] | None = None) -> DeviceChoice:
    """Pick one GPU by policy, from NVML (no CUDA initialization).

    Args:
        policy: ``"most_free_memory"`` (default; unified-memory GPUs, whose free memory NVML
            cannot tell, rank last), ``"largest_memory"`` (total memory) or ``"fastest"``
            (compute capability, then CUDA cores x max SM clock, then total memory). Ties go to
            the lower CUDA ordinal.
        snapshot: NVML snapshot to choose from (default: a fresh ``query_nvml()``).
        env: environment for ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` (default
            ``os.environ``).

    Returns:
        A :class:`DeviceChoice`.

    Raises:
        vramkit.errors.ConfigError: unknown policy, or a malformed ``CUDA_VISIBLE_DEVICES``.
        vramkit.errors.DeviceError: no GPU visible.
    """
    key = _check_policy(policy)
    best = _rank(_candidates(snapshot, env), key)[0]
    reason = (f"{policy}: {best.device.name} (NVML {best.device.index}), "
              f"{_describe(best.device, policy)}")
    logger.debug("select_device -> cuda:%d (%s)", best.cuda_ordinal, reason)
    return DeviceChoice(best.cuda_ordinal, best.device, policy, reason)


class DeviceSelection(NamedTuple):
    """The devices :func:`select_devices` picked.

    Attributes:
        devices: the NVML records, best first.
        cuda_ordinals: their CUDA ordinals in *this* process.
        cuda_visible_devices: a ``CUDA_VISIBLE_DEVICES`` value for a child process: the devices'
            UUIDs (``GPU-...`` or ``MIG-...``), best first. UUIDs, unlike indices, do not depend
            on ``CUDA_DEVICE_ORDER`` or on the parent's own ``CUDA_VISIBLE_DEVICES``.
    """

    devices: tuple[NvmlDevice, ...]
    cuda_ordinals: tuple[int, ...]
    cuda_visible_devices: str


def _rejection(dev: NvmlDevice, min_free: int | None, max_util: float | None) -> str | None:
    if min_free is not None:
        if dev.memory_free is None:
            return "free memory unknown (unified memory)"
        if dev.memory_free < min_free:
            return f"{format_size(dev.memory_free)} free < {format_size(min_free)}"
    if max_util is not None:
        if dev.utilization_gpu is None:
            return "utilization unknown"
        if dev.utilization_gpu > max_util:
            return f"utilization {dev.utilization_gpu}% > {max_util:g}%"
    return None


def select_devices(count: int, *, min_free_memory: int | str | None = None,
                   max_utilization: float | None = None, policy: str = "most_free_memory",
                   snapshot: NvmlSnapshot | None = None,
                   env: Mapping[str, str] | None = None) -> DeviceSelection:
    """Pick ``count`` GPUs that meet the filters, from NVML (no CUDA initialization).

    Args:
        count: how many devices (>= 1).
        min_free_memory: skip GPUs with less free memory (bytes, or a size string like
            ``"20GiB"``; default ``None``: no filter). GPUs whose free memory NVML cannot tell
            are skipped when this is set.
        max_utilization: skip GPUs whose utilization is above this percentage (0-100; default
            ``None``: no filter). GPUs without a utilization figure are skipped when set.
        policy: how to rank the qualifying GPUs (see :func:`select_device`).
        snapshot: NVML snapshot to choose from (default: a fresh ``query_nvml()``).
        env: environment for ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` (default
            ``os.environ``).

    Returns:
        A :class:`DeviceSelection`, best device first.

    Raises:
        vramkit.errors.ConfigError: bad ``count``, size string, utilization or policy.
        vramkit.errors.DeviceError: no GPU, or fewer than ``count`` qualify (the message says
            how many did and why each other one was rejected).
    """
    check_int("count", count, minimum=1, hint="Ask for at least one device (a positive integer).")
    min_free = check_size("min_free_memory", min_free_memory, allow_none=True,
                          hint="Give bytes as an int or a size string like '20GiB'.")
    max_util = check_number("max_utilization", max_utilization, minimum=0, maximum=100,
                            allow_none=True,
                            hint="Pass a percentage in [0, 100], e.g. max_utilization=10 to skip "
                                 "GPUs busier than 10%.")
    key = _check_policy(policy)
    ranked = _rank(_candidates(snapshot, env), key)
    qualified: list[VisibleDevice] = []
    rejected: list[str] = []
    for visible in ranked:
        why = _rejection(visible.device, min_free, max_util)
        if why is None:
            qualified.append(visible)
        else:
            rejected.append(f"cuda:{visible.cuda_ordinal} ({visible.device.name}): {why}")
    if len(qualified) < count:
        details = "; ".join(rejected) if rejected else "no other device is visible"
        raise DeviceError(
            f"asked for {count} device(s) but only {len(qualified)} of {len(ranked)} qualify; "
            f"rejected: {details}",
            "Lower min_free_memory or max_utilization, ask for fewer devices, or free memory "
            "on the busy GPUs (`vramkit info` lists their processes).")
    chosen = qualified[:count]
    return DeviceSelection(
        devices=tuple(v.device for v in chosen),
        cuda_ordinals=tuple(v.cuda_ordinal for v in chosen),
        cuda_visible_devices=",".join(v.uuid for v in chosen),
    )


# ----------------------------------------------------------------------------------------------
# precision


class PrecisionChoice(NamedTuple):
    """The compute dtype :func:`select_precision` recommends.

    Attributes:
        dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        name: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        reason: why, naming the device and its capability.
    """

    dtype: torch.dtype
    name: str
    reason: str


def _cuda_capability(ordinal: int) -> tuple[tuple[int, int], str]:
    import torch

    major, minor = torch.cuda.get_device_capability(ordinal)
    return (int(major), int(minor)), str(torch.cuda.get_device_name(ordinal))


def _cpu_precision() -> PrecisionChoice:
    import torch

    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private oneDNN probe; absent in some builds
        native_bf16 = False
    if native_bf16:
        return PrecisionChoice(torch.bfloat16, "bf16",
                               "CPU: oneDNN reports native bf16 support (AVX512-BF16/AMX)")
    return PrecisionChoice(torch.float32, "fp32",
                           "CPU: no native bf16 (oneDNN); emulated bf16/fp16 would be slower "
                           "than fp32")


def _gpu_precision(cc: tuple[int, int], label: str) -> PrecisionChoice:
    import torch

    where = f"{label} (compute capability {cc[0]}.{cc[1]})"
    if cc >= (8, 0):
        return PrecisionChoice(torch.bfloat16, "bf16",
                               f"{where}: bf16 tensor cores, fp32 range without loss scaling")
    if cc >= (7, 0):
        return PrecisionChoice(torch.float16, "fp16",
                               f"{where}: fp16 tensor cores, no bf16; use a GradScaler to train")
    if cc >= (6, 0):
        note = " (fp16 arithmetic is slow on 6.1, but storage halves)" if cc == (6, 1) else ""
        return PrecisionChoice(torch.float16, "fp16",
                               f"{where}: fp16 without tensor cores{note}; use a GradScaler")
    return PrecisionChoice(torch.float32, "fp32", f"{where}: no fast half precision before 6.0")


def select_precision(device: int | str | torch.device | DeviceInfo | None = None
                     ) -> PrecisionChoice:
    """Recommend a compute dtype for a device (BitNet's mixed-precision selection).

    Rules: CUDA compute capability >= 8.0 -> bf16; >= 7.0 -> fp16 (tensor cores); >= 6.0 ->
    fp16 without tensor cores; older -> fp32. CPU -> bf16 when oneDNN reports native bf16
    support (AVX512-BF16 or AMX), else fp32, because emulated half precision is slower on CPU
    than fp32.

    Args:
        device: an int CUDA ordinal, ``"cuda"``/``"cuda:0"``/``"cpu"``, a ``torch.device``, or a
            :class:`~vramkit.devices.info.DeviceInfo` (no CUDA query needed). ``None`` or
            ``"cuda"`` without index means the current CUDA device.

    Returns:
        A :class:`PrecisionChoice`.

    Raises:
        vramkit.errors.InvalidDeviceError: (a ``ConfigError``) an unparseable device or an
            unsupported device type.
        vramkit.errors.DeviceError: a CUDA device that does not exist or CUDA unavailable.
    """
    if isinstance(device, DeviceInfo):
        return _gpu_precision(device.compute_capability, f"cuda:{device.device_id} {device.name}")
    parsed = check_device("select_precision", "cuda" if device is None else device)
    if parsed.type == "cpu":
        return _cpu_precision()
    ordinal = cuda_ordinal(parsed, owner="select_precision")
    cc, name = _cuda_capability(ordinal)
    return _gpu_precision(cc, f"cuda:{ordinal} {name}")
