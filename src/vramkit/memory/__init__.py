"""Memory: pools, transfer streams, alignment, allocator statistics, profiling, leaks, recovery.

* :mod:`vramkit.memory.pool`: :class:`MemoryPool`, an arena for planned memory on a CUDA device,
  in pinned host memory or in host memory, and its config, records and block handles.
* :mod:`vramkit.memory.transfer`: the shared host<->device copy streams of each device.
* :mod:`vramkit.memory.layout`: access-pattern analysis and alignment for flat buffers.
* :mod:`vramkit.memory.stats`: PyTorch's caching-allocator counters, NVML and host RSS.
* :mod:`vramkit.memory.profiler` / :mod:`vramkit.memory.report`: the sampling profiler and its
  reports (JSON, HTML, PNG).
* :mod:`vramkit.memory.leaks`: leak detection across training steps.
* :mod:`vramkit.memory.oom`: recognizing an out-of-memory error and saying which kind it is.
* :mod:`vramkit.memory.recovery`: retrying a step smaller on OOM, the batch-size search.

Names are re-exported lazily: importing this package imports no submodule (no CUDA, no NVML).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".pool": ("AllocationTracker", "Block", "DefragmentResult", "LiveBlock", "MemoryPool",
              "PoolConfig", "PoolStats", "live_pools"),
    ".transfer": ("CudaStreams", "HostStreams", "StreamOp", "Streams", "resolve_offload_device",
                  "transfer_streams"),
    ".layout": ("AccessPattern", "Random", "Sequential", "Strided", "align_up",
                "aligned_offsets", "analyze_access_pattern", "calculate_alignment", "is_dense"),
    ".stats": ("AllocatorStats", "CudaAllocator", "MemoryStats", "allocator_stats",
               "with_memory_tracking"),
    ".report": ("MemoryReport", "MemorySnapshot", "ModuleMemory", "PeakPoint", "PhasePeak",
                "ProfileEvent", "TimelineAxis", "load_report", "render_html", "save_report",
                "timeline_axis", "timeline_svg"),
    ".profiler": ("MemoryProfiler", "trace_unsupported_reason"),
    ".leaks": ("GrowthTracker", "LeakDetector", "LeakSuspect", "LeakVerdict", "assess_growth",
               "combine_verdicts"),
    ".oom": ("DeviceMemoryReading", "OomDiagnosis", "classify_oom", "diagnose_memory",
             "is_oom_error", "read_device_memory"),
    ".recovery": ("MemoryRecovery", "OomEvent", "RecoveryResult", "batch_size_of",
                  "find_executable_batch_size", "split_batch", "train_with_memory_recovery"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.memory.layout import *  # noqa: F403
    from vramkit.memory.leaks import *  # noqa: F403
    from vramkit.memory.oom import *  # noqa: F403
    from vramkit.memory.pool import *  # noqa: F403
    from vramkit.memory.profiler import *  # noqa: F403
    from vramkit.memory.recovery import *  # noqa: F403
    from vramkit.memory.report import *  # noqa: F403
    from vramkit.memory.stats import *  # noqa: F403
    from vramkit.memory.transfer import *  # noqa: F403
