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

The public names are re-exported from :mod:`vramkit`; this package imports nothing at import
time (no CUDA, no ``cuda.core``).
"""
