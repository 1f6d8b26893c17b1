"""Runtime-compiled CUDA kernels, launch configuration and transfer/kernel statistics.

* :mod:`vramkit.kernels.manager`: :class:`KernelManager` compiles CUDA C at run time through
  NVRTC (NVIDIA's optional ``cuda-core``/``cuda-bindings`` packages, ``pip install
  'vramkit[kernels]'``), caches the binary on disk and launches on PyTorch's current stream.
* :mod:`vramkit.kernels.launch`: :class:`LaunchConfig`, device limits,
  :func:`calculate_optimal_launch_params` for tiled matrix kernels.
* :mod:`vramkit.kernels.stats`: :func:`memory_stats` and the process-wide
  :class:`PerformanceStats` (kernel launches, GPU time, bytes moved host<->device).
* :mod:`vramkit.memory.layout`: access-pattern analysis and alignment for flat buffers.
* :mod:`vramkit.kernels.batch`: :func:`batch_matmul`, one batched matmul per shape group.
* :mod:`vramkit.kernels.examples`: example CUDA C sources (an element-wise ReLU and the tiled
  matmul that :func:`calculate_optimal_launch_params` sizes).

The public names are re-exported from :mod:`vramkit` and, lazily, from this package: importing
it imports no submodule (no CUDA, no ``cuda.core``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".manager": ("CompiledKernel", "KernelCacheStats", "KernelManager", "KernelScalar",
                 "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                 "is_available", "uint8", "uint16", "uint32", "uint64"),
    ".launch": ("DeviceLimits", "LaunchConfig", "OccupancyQuery",
                "calculate_optimal_launch_params", "device_limits", "occupancy_fraction"),
    ".stats": ("MemoryAvailability", "PerformanceSnapshot", "PerformanceStats", "TimingEvent",
               "memory_stats", "performance_stats", "record_transfer"),
    ".batch": ("batch_matmul",),
    ".examples": ("RELU_SOURCE", "TILED_MATMUL_SOURCE"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.kernels.batch import *  # noqa: F403
    from vramkit.kernels.examples import *  # noqa: F403
    from vramkit.kernels.launch import *  # noqa: F403
    from vramkit.kernels.manager import *  # noqa: F403
    from vramkit.kernels.stats import *  # noqa: F403
