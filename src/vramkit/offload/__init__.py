"""Moving weights, activations and optimizer state between the GPU and pinned host memory.

:mod:`vramkit.offload.swap` (BlockSwapper), :mod:`vramkit.offload.cpu` (CPUOffloadManager),
:mod:`vramkit.offload.activations` (activation offload) and :mod:`vramkit.offload.optimizer`
(CPU-offloaded optimizer) share one host->device and one device->host copy stream per GPU
(:mod:`vramkit.memory.transfer`).
"""
