"""The records of :class:`~vramkit.offload.optimizer.CPUOffloadOptimizer`: its statistics, the
host side of one parameter (:class:`ParamSlot`), and the sizes and dtypes of its host copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vramkit.memory.transfer import Streams

__all__ = ["ALIGN", "OptimizerOffloadStats", "ParamSlot", "aligned_size", "host_master_dtype"]

ALIGN = 64  # bytes between views in a group's flat block: cache lines, and every dtype's alignment


@dataclass(frozen=True)
class OptimizerOffloadStats:
    """What a :class:`CPUOffloadOptimizer` holds and has moved (sizes in bytes).

    Attributes:
        device_params: parameters on an accelerator (fp32 master on the host).
        host_params: host parameters stepped in place (their own master).
        staged_host_params: 16-bit host parameters with an fp32 master copy.
        pinned_bytes: pool bytes holding masters and staging buffers.
        host_grad_bytes: fp32 host gradient buffers (besides the pinned staging buffers).
        state_bytes: bytes of optimizer state tensors (all on the host).
        gpu_state_bytes_saved: state bytes belonging to accelerator parameters, i.e. what the same
            optimizer would keep on the GPU.
        gpu_grad_bytes_saved: gradient bytes no longer kept on the GPU between backward and step
            (``offload_gradients=True``), else 0.
        grads_transferred: gradient copies device->host (staged host parameters included).
        d2h_bytes: bytes of those copies.
        h2d_bytes: bytes copied back to the parameters.
        steps: ``step()`` calls.
        cpu_step_seconds: time spent in the inner optimizer's steps (worker and main thread).
        step_wait_seconds: time ``step()`` waited for outstanding transfers and CPU steps, the part
            of the CPU work that backward did not hide.
    """

    device_params: int
    host_params: int
    staged_host_params: int
    pinned_bytes: int
    host_grad_bytes: int
    state_bytes: int
    gpu_state_bytes_saved: int
    gpu_grad_bytes_saved: int
    grads_transferred: int
    d2h_bytes: int
    h2d_bytes: int
    steps: int
    cpu_step_seconds: float
    step_wait_seconds: float

    @property
    def gpu_bytes_saved(self) -> int:
        """State plus gradient bytes kept off the GPU."""
        return self.gpu_state_bytes_saved + self.gpu_grad_bytes_saved


@dataclass(eq=False)
class ParamSlot:
    """One parameter and its host side. ``master`` is the param itself when stepped in place."""

    index: int
    group: int
    name: str
    param: torch.Tensor
    master: torch.Tensor
    in_place: bool
    streams: Streams | None = None
    staging: torch.Tensor | None = None  # pinned, param dtype: where the gradient lands
    grad: torch.Tensor | None = None  # fp32 gradient given to the inner optimizer
    upload: torch.Tensor | None = None  # host source of the copy back to the param
    ready: Any = None  # event on the producing stream, waited on by the d2h copy
    done: Any = None  # event after the d2h copy, waited on by the worker
    sub: torch.optim.Optimizer | None = None  # single-param view of the inner optimizer (overlap)
    grad_count: int = 0  # backward passes accumulated into ``grad``
    received: bool = False  # a gradient arrived since the last step
    in_flight: bool = False  # queued for the worker, not processed yet
    stepped: bool = False  # updated by the worker since the last step
    hook: Any = field(default=None, repr=False)


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def host_master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's host master copy."""
    # 16-bit parameters are updated through an fp32 master; wider ones are their own precision.
    return torch.float32 if dtype.itemsize < 4 else dtype
