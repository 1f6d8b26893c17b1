"""Devices: what hardware there is (NVML, PyTorch, JAX, joined by UUID) and how it is configured.

* :mod:`vramkit.devices.nvml`: NVML snapshots (devices, processes), without CUDA.
* :mod:`vramkit.devices.ids`: UUIDs and PCI bus ids in the canonical form devices are joined by.
* :mod:`vramkit.devices.info`: the joined NVML + PyTorch device records and
  ``CUDA_VISIBLE_DEVICES`` resolution.
* :mod:`vramkit.devices.selection`: choosing GPUs (from NVML) and a compute precision.
* :mod:`vramkit.devices.resolve`: the one device resolver (form and presence).
* :mod:`vramkit.devices.torch_backend`: :class:`Device` handles, streams, non-blocking placement.
* :mod:`vramkit.devices.memory_info`: :class:`MemoryInfo`, the one record of a device's memory.
* :mod:`vramkit.devices.host`: :class:`HostMemory`, host RAM as this process meets it (its
  cgroup, ``RLIMIT_MEMLOCK``, WSL) and the cap on pinned memory in effect.
* :mod:`vramkit.devices.env`: CUDA allocator settings, TF32, memory read-outs, cache clearing.
* :mod:`vramkit.devices.manager` / :mod:`vramkit.devices.jax_backend`: device configuration
  applied to PyTorch and JAX; :mod:`vramkit.devices.shared_manager`: the process-wide manager and
  the queries answered through it (:func:`has_gpu`, :func:`get_default_device`).
* :mod:`vramkit.devices.cuda_errors`: what a CUDA error means and what to try.

Names are re-exported lazily: importing this package imports no submodule (no CUDA, no JAX, no
NVML).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".nvml": ("NvmlDevice", "NvmlProcess", "NvmlSnapshot", "nvlink_connected", "nvml_session",
              "process_memory", "query_nvml"),
    ".ids": ("is_full_uuid", "normalize_pci_bus_id", "normalize_uuid"),
    ".info": ("DeviceCapabilities", "DeviceDetector", "DeviceInfo", "DeviceType",
              "SystemDetector", "VisibleDevice", "detect_devices", "resolve_visible_devices",
              "summarize_capabilities"),
    ".selection": ("SELECTION_POLICIES", "DeviceChoice", "DeviceSelection", "PrecisionChoice",
                   "is_cuda_available", "list_cuda_devices", "select_device", "select_devices",
                   "select_precision"),
    ".resolve": ("cuda_ordinal", "resolve_device"),
    ".torch_backend": ("CpuStream", "Device", "DeviceLike", "can_access_peer",
                       "distribute_batch", "enable_peer_access", "ensure_same_device",
                       "to_device"),
    ".memory_info": ("MemoryInfo", "read_memory_info"),
    ".host": ("HOST_MEMORY_MODES", "HostMemory", "HostMemoryChoice", "choose_host_memory",
              "read_host_memory", "filesystem_room", "process_pss_bytes"),
    ".env": ("ALLOC_CONF_VAR", "LEGACY_ALLOC_CONF_VAR", "CudaMemorySettings", "GpuMemoryInfo",
             "allocator_env_var", "allocator_settings", "clear_cuda_cache",
             "get_gpu_memory_info", "log_memory_usage", "prefer_expandable_segments",
             "setup_cuda_memory_management"),
    ".manager": ("KNOWN_PLATFORMS", "DeviceConfiguration", "DeviceManager", "MemoryStrategy",
                 "configure_for_generative_models"),
    ".shared_manager": ("get_default_device", "get_device_manager", "has_gpu",
                        "print_device_info"),
    ".jax_backend": ("JAX_DEFAULT_MEMORY_FRACTION", "JAX_DISABLE_JIT_ENV", "JAX_ENABLE_X64_ENV",
                     "JAX_MEM_FRACTION_ENV", "JAX_PREALLOCATE_ENV",
                     "LEGACY_JAX_MEM_FRACTION_ENV", "JAXDeviceManager", "apply_jax_flags",
                     "apply_jax_memory_settings", "installed_jax_version",
                     "jax_backend_initialized", "jax_backend_platforms", "jax_imported",
                     "jax_installed", "jax_memory_conflicts", "memory_fraction_env_name"),
    ".cuda_errors": ("C10_CUDA_CHECK_OOM_LINE", "CUDA_ERROR_MEMORY_ALLOCATION",
                     "CudaErrorExplanation", "CudaErrorKind",
                     "cuda_error_code", "explain_cuda_error", "is_cuda_out_of_memory"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.devices.cuda_errors import *  # noqa: F403
    from vramkit.devices.env import *  # noqa: F403
    from vramkit.devices.host import *  # noqa: F403
    from vramkit.devices.ids import *  # noqa: F403
    from vramkit.devices.info import *  # noqa: F403
    from vramkit.devices.jax_backend import *  # noqa: F403
    from vramkit.devices.manager import *  # noqa: F403
    from vramkit.devices.memory_info import *  # noqa: F403
    from vramkit.devices.nvml import *  # noqa: F403
    from vramkit.devices.resolve import *  # noqa: F403
    from vramkit.devices.selection import *  # noqa: F403
    from vramkit.devices.shared_manager import *  # noqa: F403
    from vramkit.devices.torch_backend import *  # noqa: F403
