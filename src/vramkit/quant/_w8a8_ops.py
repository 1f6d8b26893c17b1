"""The W8A8 layer's math as plain aten code for ``torch.compile`` to trace (the layer's path while
dynamo traces a compiled block).

Eager calls of :class:`vramkit.quant.w8a8.W8A8Linear` go to its kernel objects: Triton launchers
on CUDA, chosen per device on the first call. Those are what dynamo must not see: the launchers
graph-break (each break splits a block into more frames), and Python state that the first call
changes (the checked device, the chosen kernel) becomes guards that fail, so the block compiles
again and PyTorch's checkpoint recomputes through another graph than its forward ran. Traced,
the layer instead runs :func:`traced_linear`: an ``autograd.Function`` whose forward and backward
are stateless aten code (per-row abs-max, scale, codes; ``_scaled_mm`` / ``_int_mm``; the int8
epilogue as elementwise ops), with the kind a Python constant. Dynamo puts it in the block's graph
with no guard of its own, and inductor does what the hand-written kernels do eagerly, and more:
the activation quantization becomes one generated kernel, fused with whatever produced the
activation (a norm, a modulation), the int8 epilogue one more, both launched from generated code
without the dispatcher's per-call cost; the GEMMs are inductor's extern calls to the same aten
ops. It saves the same two tensors (the weight's codes and scales) in every calling context.

The numbers equal the eager layer's up to the rounding of the generated division (a code may
land one step away where the quotient sits on a rounding boundary).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__: list[str] = []

_QMAX = {"fp8": 448.0, "int8": 127.0}
_CODES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_FLOOR = 1e-30  # added to every row's scale: a zero row gets zero codes, never 0 / 0
# _int_mm on CUDA wants more than 16 rows in its first operand; fewer are padded with zeros.
INT_MM_MIN_ROWS = 17
# torch's CPU _scaled_mm takes row-wise scales from torch 2.13 on: cleared (by the eager layer,
# on the first refusal) where it does not, and the CPU then computes the fp8 product in fp32.
CPU_ROWWISE_FP8 = [True]


def column_major(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` row-major as the same matrix column-major (one transposed copy, two aten
    calls), the layout an 8-bit GEMM wants for a second operand contracted over ``N``."""
    rows, cols = codes.shape
    return torch.empty_strided((rows, cols), (1, rows), dtype=codes.dtype,
                               device=codes.device).copy_(codes)


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm`` with fewer than :data:`INT_MM_MIN_ROWS` rows padded."""
    rows = a.shape[0]
    if rows < INT_MM_MIN_ROWS:
        return torch._int_mm(F.pad(a, (0, 0, 0, INT_MM_MIN_ROWS - rows)), b)[:rows]
    return torch._int_mm(a, b)


def _rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    amax = torch.linalg.vector_norm(x, float("inf"), -1, True, dtype=torch.float32)
    scale = amax * (1.0 / _QMAX[kind]) + _FLOOR
    q = x / scale
    if kind == "int8":
        q = q.round()  # the cast truncates; |q| <= 127
    return q.to(_CODES[kind]), scale


def _fp8_mm(codes: torch.Tensor, second: torch.Tensor, scale_a: torch.Tensor,
            scale_b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if codes.device.type == "cpu" and not CPU_ROWWISE_FP8[0]:
        y = (codes.float() @ second.float()) * scale_a * scale_b
        return (y if bias is None else y + bias.float()).to(torch.bfloat16)
    return torch._scaled_mm(codes, second, scale_a=scale_a, scale_b=scale_b, bias=bias,
                            out_dtype=torch.bfloat16)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


def _forward(kernel: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    dtype = x.dtype
    if kernel == "dequantize":
        return F.linear(x, _dequantized(weight, scale, dtype), bias)
    codes, x_scale = _rows(x, kernel)
    if kernel == "fp8":
        if dtype is torch.bfloat16:
            return _fp8_mm(codes, weight.t(), x_scale, scale.view(1, -1), bias)
        y = _fp8_mm(codes, weight.t(), x_scale, scale.view(1, -1), None).to(dtype)
        return y if bias is None else y + bias
    y = int_mm(codes, weight.t()) * scale * x_scale  # int32 * fp32 -> fp32
    return (y if bias is None else y + bias).to(dtype)


def _grad_input(kernel: str, grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    if kernel == "dequantize":
        return grad.to(dtype) @ _dequantized(weight, scale, dtype)
    codes, g_scale = _rows(grad * scale, kernel)  # h = g * s_w, quantized per row
    if kernel == "fp8":
        ones = torch.ones(1, weight.shape[1], dtype=torch.float32, device=grad.device)
        return _fp8_mm(codes, column_major(weight), g_scale, ones, None).to(dtype)
    return (int_mm(codes, column_major(weight)) * g_scale).to(dtype)


class _TracedW8A8(torch.autograd.Function):
    """``y = x W^T + b`` in 8 bits; backward: ``grad_x`` in 8 bits, ``grad_b``, never
    ``grad_W``. Saves the weight's codes and scales, nothing else."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.kernel, ctx.dtype = kernel, x.dtype
        return _forward(kernel, x, weight, scale, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad
        grad_x = grad_bias = None
        if needs[0]:
            weight, scale = ctx.saved_tensors
            grad_x = _grad_input(ctx.kernel, grad, weight, scale, ctx.dtype)
        if needs[3]:
            grad_bias = grad.sum(0)
        return grad_x, None, None, grad_bias, None


def traced_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None, kernel: str, out_features: int) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` by ``kernel`` (``"fp8"``, ``"int8"`` or ``"dequantize"``),
    in code that dynamo traces whole."""
    shape = x.shape
    x2 = x if len(shape) == 2 else x.reshape(-1, shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None
                                                        and bias.requires_grad)):
        y = _TracedW8A8.apply(x2, weight, scale, bias, kernel)
    else:
        y = _forward(kernel, x2, weight, scale, bias)
    return y if len(shape) == 2 else y.view(*shape[:-1], out_features)
