"""Memory: pools (device arena, pinned host pool), allocator statistics, the memory profiler."""
