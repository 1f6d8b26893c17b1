"""Observe: watching memory -- profiling, reports, leaks, allocator statistics, OOM recovery.

One floor above :mod:`vramkit.memory` (whose pools it reads); only the CLI, the recipes and the
public API stand on it. Offloading and loading never import it.

* :mod:`vramkit.observe.stats`: PyTorch's caching-allocator counters, NVML and host RSS.
* :mod:`vramkit.observe.profiler`: the sampling profiler, :class:`MemoryProfiler`; its per-module
  hooks and figures live in the private :mod:`vramkit.observe._module_attribution`.
* :mod:`vramkit.observe.report`: the report it produces, and its files (JSON, HTML, PNG);
  :mod:`vramkit.observe.report_timeline` (the axis and palette both timelines share),
  :mod:`vramkit.observe.report_svg` (the HTML report's timeline and legend),
  :mod:`vramkit.observe.report_html` (the HTML page) and :mod:`vramkit.observe.report_png`
  (the PNG timeline).
* :mod:`vramkit.observe.leaks`: leak detection across training steps.
* :mod:`vramkit.observe.oom`: recognizing an out-of-memory error and saying which kind it is.
* :mod:`vramkit.observe.recovery`: retrying a step smaller on OOM, the batch-size search.

Names are re-exported lazily: importing this package imports no submodule (no CUDA, no NVML).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".stats": ("AllocatorStats", "CudaAllocator", "MemoryStats", "allocator_stats",
               "with_memory_tracking"),
    ".report": ("MemoryReport", "MemorySnapshot", "ModuleMemory", "PeakPoint", "PhasePeak",
                "ProfileEvent", "load_report", "save_report"),
    ".report_timeline": ("TimelineAxis", "timeline_axis"),
    ".report_svg": ("timeline_svg",),
    ".report_html": ("render_html",),
    ".profiler": ("MemoryProfiler", "trace_unsupported_reason"),
    ".leaks": ("GrowthTracker", "LeakDetector", "LeakSuspect", "LeakVerdict", "assess_growth",
               "combine_verdicts"),
    ".oom": ("DeviceMemoryReading", "OomDiagnosis", "classify_oom", "diagnose_memory",
             "is_oom_error", "read_device_memory"),
    ".recovery": ("MemoryRecovery", "OomEvent", "RecoveryResult", "batch_size_of",
                  "find_executable_batch_size", "split_batch", "train_with_memory_recovery"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.observe.leaks import *  # noqa: F403
    from vramkit.observe.oom import *  # noqa: F403
    from vramkit.observe.profiler import *  # noqa: F403
    from vramkit.observe.recovery import *  # noqa: F403
    from vramkit.observe.report import *  # noqa: F403
    from vramkit.observe.report_html import *  # noqa: F403
    from vramkit.observe.report_svg import *  # noqa: F403
    from vramkit.observe.report_timeline import *  # noqa: F403
    from vramkit.observe.stats import *  # noqa: F403
