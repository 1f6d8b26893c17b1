"""Devices: what hardware there is (NVML, PyTorch, JAX, joined by UUID) and how it is configured."""
