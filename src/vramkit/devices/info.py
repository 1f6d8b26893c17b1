"""Device records and detectors: NVML, PyTorch and JAX views of the same GPUs, joined by UUID.

This module holds the records other modules share (:class:`DeviceInfo`,
:class:`DeviceCapabilities`, :class:`DeviceType`) and the :class:`DeviceDetector` protocol that
:class:`~vramkit.devices.manager.DeviceManager` accepts for tests and exotic hardware.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "DeviceCapabilities",
    "DeviceDetector",
    "DeviceInfo",
    "DeviceType",
]


class DeviceType(str, enum.Enum):
    """The kind of compute device (Artifex ``DeviceType``)."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


@dataclass(frozen=True)
class DeviceInfo:
    """One CUDA device as this process sees it (BitNet ``CudaDeviceInfo`` plus join keys).

    ``device_id`` is the CUDA ordinal (``torch.device("cuda", device_id)``), which depends on
    ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``; ``nvml_index`` is the physical index NVML
    uses; ``uuid`` joins the two (and JAX's view).
    """

    device_id: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessor_count: int
    max_threads_per_block: int
    max_shared_memory_per_block: int
    supports_fp16: bool
    supports_bf16: bool
    uuid: str | None = None
    pci_bus_id: str | None = None
    nvml_index: int | None = None
    max_shared_memory_per_block_optin: int | None = None
    l2_cache_size: int | None = None
    warp_size: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    unified_memory: bool = False
    jax_id: int | None = None


@dataclass(frozen=True)
class DeviceCapabilities:
    """Summary of the compute devices of this process (Artifex ``DeviceCapabilities``).

    ``compute_capability`` is a string like ``"9.0"`` (the lowest among visible GPUs) and
    ``total_memory_mb`` the sum over visible GPUs, both ``None`` without a GPU.
    """

    device_type: DeviceType
    device_count: int
    total_memory_mb: int | None = None
    compute_capability: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    supports_mixed_precision: bool = False
    supports_distributed: bool = False


@runtime_checkable
class DeviceDetector(Protocol):
    """What :class:`~vramkit.devices.manager.DeviceManager` needs from a detector.

    A detector may also define ``list_devices() -> Sequence[DeviceInfo]``; the manager uses it
    when present (for ``DeviceManager.devices``) and falls back to an empty list otherwise.
    """

    def detect_capabilities(self) -> DeviceCapabilities: ...
