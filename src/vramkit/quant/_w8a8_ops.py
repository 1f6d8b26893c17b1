"""The W8A8 layer as two custom ops, for ``torch.compile``: one graph node per matmul.

Eager calls of :class:`vramkit.quant.w8a8.W8A8Linear` go straight to its kernel objects (no
dispatcher round trip: host time matters there). While ``torch.compile`` traces, the layer calls
these ops instead, so that dynamo never steps into what it cannot trace (the Triton launchers,
the per-device kernel choice, the capability check: Python state that changes on the first call
would become guards that fail, and each graph break splits a block into more frames):

* ``vramkit_w8a8::linear(x [M, K], weight, scale, bias, kernel) -> y [M, N]``, with its autograd
  (the input gradient through the second op, the bias gradient as a sum, never the weight's);
* ``vramkit_w8a8::grad_input(grad [M, N], weight, scale, kernel, dtype) -> grad_x [M, K]``.

Both run the very kernels an eager call runs (Triton-quantizing on CUDA with triton, aten
elsewhere; the dequantizing one for odd shapes), chosen per device at run time, so a compiled
block's layer outputs equal the eager layer's bit for bit. The autograd saves the same two tensors
as the eager ``autograd.Function`` (the weight's codes and scales), whatever the calling context:
a checkpoint's recomputation sees the same saved tensors as its forward.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations of the
# op functions at run time to build their schemas.

from collections.abc import Callable
from typing import Any

import torch

__all__: list[str] = []

# The layer module's kernel lookup, ``(kernel name, weight, device) -> kernel object`` (it checks
# the device's capability once): set by vramkit.quant.w8a8 when it is imported, which is the only
# way these ops are reached (this module imports nothing of it: no import cycle).
_LOOKUP: list[Callable[[str, torch.Tensor, torch.device], Any]] = []


def set_kernel_lookup(lookup: Callable[[str, torch.Tensor, torch.device], Any]) -> None:
    """Install the layer module's kernel lookup (called once, by vramkit.quant.w8a8)."""
    _LOOKUP[:] = [lookup]


def _kernel(name: str, weight: torch.Tensor, device: torch.device) -> Any:
    return _LOOKUP[0](name, weight, device)


@torch.library.custom_op("vramkit_w8a8::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """``x [M, K] -> x W^T + b [M, N]`` in ``x``'s dtype, by the layer's ``kernel``
    (``"fp8"``, ``"int8"`` or ``"dequantize"``)."""
    return _kernel(kernel, weight, x.device).forward(x, weight, scale, bias)


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
      kernel: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("vramkit_w8a8::grad_input", mutates_args=())
def grad_input(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kernel: str,
               dtype: torch.dtype) -> torch.Tensor:
    """``grad [M, N] -> grad W [M, K]`` in ``dtype``, in 8 bits (see the layer's math)."""
    return _kernel(kernel, weight, grad.device).grad_input(grad, weight, scale, dtype)


@grad_input.register_fake
def _(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kernel: str,
      dtype: torch.dtype) -> torch.Tensor:
    return grad.new_empty((grad.shape[0], weight.shape[1]), dtype=dtype)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, scale, _bias, kernel = inputs
    # Saved whatever needs a gradient: the same two tensors in every calling context.
    ctx.save_for_backward(weight, scale)
    ctx.call = (kernel, x.dtype)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    kernel, dtype = ctx.call
    needs = ctx.needs_input_grad
    grad_x = grad_bias = None
    if needs[0]:
        weight, scale = ctx.saved_tensors
        grad_x = grad_input(grad, weight, scale, kernel, dtype)
    if needs[3]:
        grad_bias = grad.sum(0)
    return grad_x, None, None, grad_bias, None


linear.register_autograd(_backward, setup_context=_setup_context)


def traced_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None, kernel: str, out_features: int) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through :func:`linear` (the layer's path while tracing)."""
    shape = x.shape
    if len(shape) == 2:
        return linear(x, weight, scale, bias, kernel)
    y = linear(x.reshape(-1, shape[-1]), weight, scale, bias, kernel)
    return y.view(*shape[:-1], out_features)
