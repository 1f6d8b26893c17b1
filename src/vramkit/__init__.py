"""vramkit: train and run models that are bigger than the GPU in front of you.

The public API is re-exported here, grouped by area. Names are resolved lazily (PEP 562), so
``import vramkit`` imports no submodule until a name is used: it initializes no CUDA context,
imports no JAX and calls no NVML (``tests/test_import.py`` proves it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vramkit._lazy import install_moved_modules

__version__ = "0.1.0"

# name -> submodule that defines it. Grouped by area; __all__ is derived from it.
_EXPORTS: dict[str, str] = {}


def _export(module: str, *names: str) -> None:
    for name in names:
        _EXPORTS[name] = module


# errors and units
_export("vramkit.errors", "VramkitError", "ConfigError", "DeviceError", "DeviceMismatchError",
        "NvmlError", "JaxUnavailableError", "TooLateError", "PoolExhaustedError",
        "InvalidBlockError", "OffloadError", "QuantizationError", "SafetensorsFormatError",
        "KernelError", "RecoveryError")
_export("vramkit.units", "parse_size", "format_size")

# devices: what hardware there is
_export("vramkit.devices.nvml", "query_nvml", "NvmlSnapshot", "NvmlDevice", "NvmlProcess")
_export("vramkit.devices.info", "DeviceInfo", "DeviceCapabilities", "DeviceType",
        "DeviceDetector", "detect_devices", "resolve_visible_devices")
_export("vramkit.devices.selection", "is_cuda_available", "list_cuda_devices", "select_device",
        "select_devices", "select_precision", "PrecisionChoice")
# devices: how it is configured
_export("vramkit.devices.manager", "DeviceManager", "DeviceConfiguration", "MemoryStrategy",
        "get_device_manager", "has_gpu", "get_default_device", "print_device_info",
        "configure_for_generative_models")
_export("vramkit.devices.jax_backend", "JAXDeviceManager")
_export("vramkit.devices.torch_backend", "Device", "can_access_peer", "to_device",
        "ensure_same_device", "distribute_batch")
_export("vramkit.devices.env", "setup_cuda_memory_management", "get_gpu_memory_info",
        "log_memory_usage", "clear_cuda_cache", "GpuMemoryInfo", "allocator_settings")

# memory: where the bytes are
_export("vramkit.memory.pool", "MemoryPool", "PoolConfig", "PoolStats", "Block")
_export("vramkit.memory.stats", "allocator_stats", "AllocatorStats", "CudaAllocator")
_export("vramkit.memory.profiler", "MemoryProfiler", "MemorySnapshot", "MemoryReport",
        "MemoryStats", "with_memory_tracking", "LeakDetector")

# offload: moving weights, activations and optimizer state
_export("vramkit.offload.swap", "BlockSwapper", "SwapConfig", "SwapStats", "BlockScheduleEntry")
_export("vramkit.offload.cpu", "CPUOffloadManager", "CPUOffloadConfig", "CPUOffloadStats",
        "LoadHandle")
_export("vramkit.offload.activations", "ActivationOffloader", "ActivationOffloadConfig",
        "ActivationOffloadStats", "offload_activations")
_export("vramkit.offload.optimizer", "CPUOffloadOptimizer", "OptimizerOffloadStats")
_export("vramkit.offload.checkpointing", "enable_gradient_checkpointing",
        "disable_gradient_checkpointing", "is_checkpointed", "unwrapped_forward", "checkpoint",
        "checkpoint_with_pool", "GradientCheckpointer", "SDXLGradientCheckpoint")

# quantization and low-memory optimizers
_export("vramkit.quant.formats", "QuantFormat", "Int8Config", "Int4Config", "NF4Config",
        "FP8Config", "QuantizedTensor", "quantize_tensor", "dequantize_tensor", "format_config")
_export("vramkit.quant.linear", "QuantizedLinear", "QuantizedConv2d")
_export("vramkit.quant.model", "QuantizationConfig", "QuantoConfig", "quantize_model")
_export("vramkit.quant.report", "quantization_report", "QuantizationReport")
_export("vramkit.quant.serialization", "save_quantized", "load_quantized",
        "load_quantized_model")
_export("vramkit.optim.adamw8bit", "AdamW8bit")
_export("vramkit.optim.config", "Int8TrainingConfig", "Int8Training", "setup_int8_training")

# loading checkpoints, tiling, presets, OOM recovery
_export("vramkit.io.lazy", "LazySafetensors")
_export("vramkit.io.loader", "MemoryEfficientLoader", "LoadStats", "load_into", "stream_weights")
_export("vramkit.tiling.vae", "VAETiling", "TilingHandle", "SeamReport", "seam_error")
_export("vramkit.recipes.presets", "SDXLMemoryConfig", "FluxTrainingConfig", "optimize_sdxl_memory",
        "optimize_flux_memory", "MemoryOptimization")
_export("vramkit.memory.recovery", "is_oom_error", "classify_oom", "OomDiagnosis",
        "MemoryRecovery", "train_with_memory_recovery", "find_executable_batch_size")

# runtime-compiled kernels, launch configuration, statistics
_export("vramkit.kernels.manager", "KernelManager", "CompiledKernel")
_export("vramkit.kernels.launch", "LaunchConfig", "calculate_optimal_launch_params")
_export("vramkit.kernels.stats", "memory_stats", "PerformanceStats", "performance_stats")
_export("vramkit.memory.layout", "analyze_access_pattern", "calculate_alignment")
_export("vramkit.kernels.batch", "batch_matmul")
_export("vramkit.devices.cuda_errors", "explain_cuda_error", "CudaErrorExplanation")

# models and the demo
_export("vramkit.recipes.dit", "DiT", "DiTConfig")
_export("vramkit.recipes.demo", "run_demo", "DemoConfig", "DemoResult")

__all__ = ["__version__", *_EXPORTS]

install_moved_modules()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vramkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.devices.cuda_errors import *  # noqa: F403
    from vramkit.devices.env import *  # noqa: F403
    from vramkit.devices.info import *  # noqa: F403
    from vramkit.devices.jax_backend import *  # noqa: F403
    from vramkit.devices.manager import *  # noqa: F403
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
    from vramkit.quant.formats import *  # noqa: F403
    from vramkit.quant.linear import *  # noqa: F403
    from vramkit.quant.model import *  # noqa: F403
    from vramkit.quant.report import *  # noqa: F403
    from vramkit.quant.serialization import *  # noqa: F403
    from vramkit.recipes.demo import *  # noqa: F403
    from vramkit.recipes.dit import *  # noqa: F403
    from vramkit.recipes.presets import *  # noqa: F403
    from vramkit.tiling.vae import *  # noqa: F403
    from vramkit.units import *  # noqa: F403
