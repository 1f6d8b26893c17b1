"""vramkit: train and run models that are bigger than the GPU in front of you.

The public API, re-exported here grouped by floor (docs/architecture.md), bottom to top. Names
are resolved lazily (PEP 562): ``import vramkit`` imports no submodule until a name is used, so
it initializes no CUDA context, imports no JAX and calls no NVML (``tests/test_import.py``).

Each package re-exports its own public names too (``from vramkit.offload import BlockSwapper``);
the demo and its model live in :mod:`vramkit.recipes`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from vramkit._lazy import install_moved_modules, lazy_exports

__version__ = "0.1.0"

__all__, _lazy_getattr, __dir__ = lazy_exports(__name__, {
    # -- floor 0: errors and sizes ------------------------------------------------------------
    "vramkit.errors": (
        "VramkitError", "ConfigError", "DeviceError", "DeviceMismatchError", "InvalidDeviceError",
        "NvmlError", "JaxUnavailableError", "TooLateError", "PoolExhaustedError",
        "InvalidBlockError", "OffloadError", "PlanError", "QuantizationError",
        "SafetensorsFormatError",
        "KernelError", "RecoveryError", "VramkitWarning"),
    "vramkit.units": ("parse_size", "format_size"),
    # -- floor 1: devices: what hardware there is and how it is configured ---------------------
    "vramkit.devices.nvml": ("query_nvml", "NvmlSnapshot", "NvmlDevice", "NvmlProcess"),
    "vramkit.devices.info": ("DeviceInfo", "DeviceCapabilities", "DeviceType", "DeviceDetector",
                             "detect_devices", "resolve_visible_devices"),
    "vramkit.devices.selection": ("is_cuda_available", "list_cuda_devices", "select_device",
                                  "select_devices", "select_precision", "PrecisionChoice"),
    "vramkit.devices.manager": ("DeviceManager", "DeviceConfiguration", "MemoryStrategy",
                                "get_device_manager", "has_gpu", "get_default_device",
                                "print_device_info", "configure_for_generative_models"),
    "vramkit.devices.jax_backend": ("JAXDeviceManager",),
    "vramkit.devices.torch_backend": ("Device", "can_access_peer", "to_device",
                                      "ensure_same_device", "distribute_batch"),
    "vramkit.devices.env": ("setup_cuda_memory_management", "get_gpu_memory_info",
                            "log_memory_usage", "clear_cuda_cache", "GpuMemoryInfo",
                            "allocator_settings"),
    "vramkit.devices.cuda_errors": ("explain_cuda_error", "CudaErrorExplanation"),
    "vramkit.devices.memory_info": ("MemoryInfo", "read_memory_info"),
    # -- floor 2: memory, kernels, quantized storage, optimizers ------------------------------
    "vramkit.memory.pool": ("MemoryPool", "PoolConfig", "PoolStats", "Block"),
    "vramkit.memory.stats": ("allocator_stats", "AllocatorStats", "CudaAllocator"),
    "vramkit.memory.profiler": ("MemoryProfiler", "MemorySnapshot", "MemoryReport", "MemoryStats",
                                "with_memory_tracking", "LeakDetector"),
    "vramkit.memory.oom": ("is_oom_error", "classify_oom", "OomDiagnosis"),
    "vramkit.memory.recovery": ("MemoryRecovery", "train_with_memory_recovery",
                                "find_executable_batch_size"),
    "vramkit.memory.layout": ("analyze_access_pattern", "calculate_alignment"),
    "vramkit.kernels.manager": ("KernelManager", "CompiledKernel"),
    "vramkit.kernels.launch": ("LaunchConfig", "calculate_optimal_launch_params"),
    "vramkit.kernels.stats": ("memory_stats", "PerformanceStats", "performance_stats"),
    "vramkit.kernels.batch": ("batch_matmul",),
    "vramkit.quant.formats": ("QuantFormat", "Int8Config", "Int4Config", "NF4Config", "FP8Config",
                              "QuantizedTensor", "quantize_tensor", "dequantize_tensor",
                              "format_config"),
    "vramkit.quant.linear": ("QuantizedLinear", "QuantizedConv2d"),
    "vramkit.quant.model": ("QuantizationConfig", "QuantoConfig", "quantize_model"),
    "vramkit.quant.report": ("quantization_report", "QuantizationReport"),
    "vramkit.quant.serialization": ("save_quantized", "load_quantized", "load_quantized_model"),
    "vramkit.optim.adamw8bit": ("AdamW8bit",),
    "vramkit.optim.config": ("Int8TrainingConfig", "Int8Training", "setup_int8_training"),
    # -- floor 3: loading checkpoints; moving weights, activations and optimizer state ---------
    "vramkit.io.lazy": ("LazySafetensors",),
    "vramkit.io.loader": ("MemoryEfficientLoader", "LoadStats", "load_into", "stream_weights"),
    "vramkit.offload.swap": ("BlockSwapper", "SwapConfig", "SwapStats", "BlockScheduleEntry",
                             "BlockFootprint"),
    "vramkit.offload.cpu": ("CPUOffloadManager", "CPUOffloadConfig", "CPUOffloadStats",
                            "LoadHandle"),
    "vramkit.offload.activations": ("ActivationOffloader", "ActivationOffloadConfig",
                                    "ActivationOffloadStats", "offload_activations"),
    "vramkit.offload.optimizer": ("CPUOffloadOptimizer", "OptimizerOffloadStats"),
    "vramkit.offload.checkpointing": ("enable_gradient_checkpointing",
                                      "disable_gradient_checkpointing", "is_checkpointed",
                                      "unwrapped_forward", "checkpoint", "checkpoint_with_pool",
                                      "GradientCheckpointer", "SDXLGradientCheckpoint"),
    # -- floor 4: planning and tiling ---------------------------------------------------------
    "vramkit.planning.api": ("plan",),
    "vramkit.planning.fitting": ("fit", "Fitted", "FitReport"),
    "vramkit.planning.record": ("Plan",),
    "vramkit.planning.hardware": ("hardware_profile",),
    "vramkit.planning.activations": ("ActivationEstimate", "estimate_activations"),
    "vramkit.tiling.vae": ("VAETiling", "TilingHandle", "SeamReport", "seam_error"),
    # -- floor 5: recipes built from the floors below -----------------------------------------
    "vramkit.recipes.presets": ("SDXLMemoryConfig", "FluxTrainingConfig", "optimize_sdxl_memory",
                                "optimize_flux_memory", "MemoryOptimization"),
})

#: Names exported here before the re-layout that now live in vramkit.recipes only: they still
#: resolve (with a DeprecationWarning) but are not part of the public API any more.
_MOVED_NAMES: dict[str, str] = {
    "DiT": "vramkit.recipes.dit",
    "DiTConfig": "vramkit.recipes.dit",
    "run_demo": "vramkit.recipes.demo",
    "DemoConfig": "vramkit.recipes.demo",
    "DemoResult": "vramkit.recipes.demo",
}


def __getattr__(name: str) -> Any:
    module = _MOVED_NAMES.get(name)
    if module is not None:
        warnings.warn(f"vramkit.{name} is not part of vramkit's API any more: import it from "
                      f"{module}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    return _lazy_getattr(name)


install_moved_modules()

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.devices.cuda_errors import *  # noqa: F403
    from vramkit.devices.env import *  # noqa: F403
    from vramkit.devices.info import *  # noqa: F403
    from vramkit.devices.jax_backend import *  # noqa: F403
    from vramkit.devices.manager import *  # noqa: F403
    from vramkit.devices.memory_info import *  # noqa: F403
    from vramkit.devices.nvml import *  # noqa: F403
    from vramkit.devices.selection import *  # noqa: F403
    from vramkit.devices.torch_backend import *  # noqa: F403
    from vramkit.errors import *  # noqa: F403
    from vramkit.io.lazy import *  # noqa: F403
    from vramkit.io.loader import *  # noqa: F403
    from vramkit.kernels.batch import *  # noqa: F403
    from vramkit.kernels.launch import *  # noqa: F403
    from vramkit.kernels.manager import *  # noqa: F403
    from vramkit.kernels.stats import *  # noqa: F403
    from vramkit.memory.layout import *  # noqa: F403
    from vramkit.memory.oom import *  # noqa: F403
    from vramkit.memory.pool import *  # noqa: F403
    from vramkit.memory.profiler import *  # noqa: F403
    from vramkit.memory.recovery import *  # noqa: F403
    from vramkit.memory.stats import *  # noqa: F403
    from vramkit.offload.activations import *  # noqa: F403
    from vramkit.offload.checkpointing import *  # noqa: F403
    from vramkit.offload.cpu import *  # noqa: F403
    from vramkit.offload.optimizer import *  # noqa: F403
    from vramkit.offload.swap import *  # noqa: F403
    from vramkit.optim.adamw8bit import *  # noqa: F403
    from vramkit.optim.config import *  # noqa: F403
    from vramkit.planning.activations import *  # noqa: F403
    from vramkit.planning.api import *  # noqa: F403
    from vramkit.planning.fitting import *  # noqa: F403
    from vramkit.planning.hardware import *  # noqa: F403
    from vramkit.planning.record import *  # noqa: F403
    from vramkit.quant.formats import *  # noqa: F403
    from vramkit.quant.linear import *  # noqa: F403
    from vramkit.quant.model import *  # noqa: F403
    from vramkit.quant.report import *  # noqa: F403
    from vramkit.quant.serialization import *  # noqa: F403
    from vramkit.recipes.presets import *  # noqa: F403
    from vramkit.tiling.vae import *  # noqa: F403
