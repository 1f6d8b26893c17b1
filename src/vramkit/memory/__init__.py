"""Memory: pools, transfer streams and alignment -- what offloading and loading stand on.

* :mod:`vramkit.memory.pool`: :class:`MemoryPool`, an arena for planned memory on a CUDA device,
  in pinned host memory or in host memory, and its config, records and block handles.
* :mod:`vramkit.memory.transfer`: the shared host<->device copy streams of each device.
* :mod:`vramkit.memory.layout`: access-pattern analysis and alignment for flat buffers.

Watching memory (the profiler, its reports, leak detection, allocator statistics, OOM diagnosis
and recovery) is one floor up, in :mod:`vramkit.observe`.

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
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.memory.layout import *  # noqa: F403
    from vramkit.memory.pool import *  # noqa: F403
    from vramkit.memory.transfer import *  # noqa: F403
