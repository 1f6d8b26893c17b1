# ruff: noqa: F401  (the TYPE_CHECKING imports at the end are the lazy names, for type checkers)
"""vramkit: train and run models that are bigger than the GPU in front of you.

The public face: the verbs (``plan``, ``fit``), the block swapper, devices, pools and the
profiler, loaders, quantization, offloaders and the errors, grouped by floor
(docs/architecture.md), bottom to top. Everything else is importable from its subpackage
(``from vramkit.devices import select_precision``). Names resolve lazily (PEP 562):
``import vramkit`` imports no submodule until a name is used, so it initializes no CUDA context,
imports no JAX and calls no NVML (``tests/test_import.py``). ``__all__`` is locked by a test and
``dir(vramkit)`` shows exactly it.
"""


from typing import TYPE_CHECKING as _TYPE_CHECKING

from vramkit._lazy import lazy_exports as _lazy_exports

__version__ = "0.1.0"

__all__, __getattr__, _dir = _lazy_exports(__name__, {
    # -- floor 0: errors and sizes ------------------------------------------------------------
    "vramkit.errors": (
        "VramkitError", "ConfigError", "DeviceError", "TooLateError", "PoolExhaustedError",
        "OffloadError", "PlanError", "QuantizationError", "SafetensorsFormatError",
        "KernelError", "RecoveryError", "VramkitWarning"),
    "vramkit.units": ("parse_size", "format_size"),
    # -- floor 1: devices: what hardware there is and how it is configured ---------------------
    "vramkit.devices.info": ("detect_devices",),
    "vramkit.devices.selection": ("select_device",),
    "vramkit.devices.manager": ("DeviceManager", "DeviceConfiguration", "MemoryStrategy"),
    "vramkit.devices.shared_manager": ("get_device_manager",),
    "vramkit.devices.env": ("setup_cuda_memory_management",),
    "vramkit.devices.memory_info": ("MemoryInfo", "read_memory_info"),
    # -- floor 2: planned memory, quantized storage, optimizers -------------------------------
    "vramkit.memory.pool": ("MemoryPool", "PoolConfig"),
    "vramkit.quant.linear": ("QuantizedLinear",),
    "vramkit.quant.model": ("QuantizationConfig", "quantize_model"),
    "vramkit.quant.serialization": ("save_quantized", "load_quantized_model"),
    "vramkit.optim.adamw8bit": ("AdamW8bit",),
    # -- floor 3: loading checkpoints; moving weights, activations, optimizer state; observing -
    "vramkit.io.lazy": ("LazySafetensors",),
    "vramkit.io.loader": ("MemoryEfficientLoader", "load_into"),
    "vramkit.offload.swap": ("BlockSwapper", "SwapConfig", "SwapStats"),
    "vramkit.offload.cpu": ("CPUOffloadManager",),
    "vramkit.offload.activations": ("offload_activations",),
    "vramkit.offload.optimizer": ("CPUOffloadOptimizer",),
    "vramkit.offload.checkpointing": ("enable_gradient_checkpointing",),
    "vramkit.observe.profiler": ("MemoryProfiler",),
    "vramkit.observe.oom": ("classify_oom",),
    "vramkit.observe.recovery": ("train_with_memory_recovery",),
    # -- floor 4: planning and tiling ---------------------------------------------------------
    "vramkit.planning.api": ("plan",),
    "vramkit.planning.fitting": ("fit", "Fitted", "FitReport"),
    "vramkit.planning.record": ("Plan",),
    "vramkit.tiling.vae": ("VAETiling",),
    # -- floor 5: recipes built from the floors below -----------------------------------------
    "vramkit.recipes.presets": ("optimize_flux_memory", "optimize_sdxl_memory"),
})


def __dir__() -> list[str]:
    return sorted(__all__)


if _TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.devices.env import setup_cuda_memory_management
    from vramkit.devices.info import detect_devices
    from vramkit.devices.manager import DeviceConfiguration, DeviceManager, MemoryStrategy
    from vramkit.devices.memory_info import MemoryInfo, read_memory_info
    from vramkit.devices.selection import select_device
    from vramkit.devices.shared_manager import get_device_manager
    from vramkit.errors import (
        ConfigError,
        DeviceError,
        KernelError,
        OffloadError,
        PlanError,
        PoolExhaustedError,
        QuantizationError,
        RecoveryError,
        SafetensorsFormatError,
        TooLateError,
        VramkitError,
        VramkitWarning,
    )
    from vramkit.io.lazy import LazySafetensors
    from vramkit.io.loader import MemoryEfficientLoader, load_into
    from vramkit.memory.pool import MemoryPool, PoolConfig
    from vramkit.observe.oom import classify_oom
    from vramkit.observe.profiler import MemoryProfiler
    from vramkit.observe.recovery import train_with_memory_recovery
    from vramkit.offload.activations import offload_activations
    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.offload.cpu import CPUOffloadManager
    from vramkit.offload.optimizer import CPUOffloadOptimizer
    from vramkit.offload.swap import BlockSwapper, SwapConfig, SwapStats
    from vramkit.optim.adamw8bit import AdamW8bit
    from vramkit.planning.api import plan
    from vramkit.planning.fitting import FitReport, Fitted, fit
    from vramkit.planning.record import Plan
    from vramkit.quant.linear import QuantizedLinear
    from vramkit.quant.model import QuantizationConfig, quantize_model
    from vramkit.quant.serialization import load_quantized_model, save_quantized
    from vramkit.recipes.presets import optimize_flux_memory, optimize_sdxl_memory
    from vramkit.tiling.vae import VAETiling
    from vramkit.units import format_size, parse_size
