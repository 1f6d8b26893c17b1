"""W8A8 compute for frozen weights: both matmuls that touch the weight run in 8 bits.

:class:`W8A8Linear` stores a frozen ``nn.Linear`` weight once, in 8 bits with one fp32 scale per
output channel, and runs its forward *and* the backward's input gradient as 8-bit GEMMs:

* ``"fp8"``: float8 e4m3 codes, ``torch._scaled_mm`` with row-wise scales (CUDA capability
  >= 8.9: Ada, Hopper; torch's CPU kernel elsewhere on CPU);
* ``"int8"``: symmetric int8 codes in [-127, 127], ``torch._int_mm`` with the scales applied in
  the epilogue (CUDA capability >= 8.0; torch's CPU kernel on CPU).

Made for adapters over a frozen base (LoRA training and inference): the weight never gets a
gradient. Odd shapes (features that the GEMMs cannot take, see :func:`w8a8_fits`) run a
dequantized matmul for *that* layer, said once when the layer is built (``logging``) and
readable as ``layer.kernel == "dequantize"``.

The math. ``W ≈ s_w[:, None] * Q_w`` with ``s_w[n] = max_k |W[n, k]| / QMAX`` (QMAX = 448 for
e4m3, 127 for int8; an all-zero row has ``s_w = 0`` and zero codes).

Forward, ``y = x W^T + b`` for ``x [M, K]`` (any leading shape is flattened to ``M``): each
token is quantized dynamically, ``s_x[m] = max_k |x[m, k]| / QMAX`` (one abs-max reduction,
``vector_norm(ord=inf)``, then one divide that casts as it stores), ``Q_x = x / s_x``, and

    ``y[m, n] = s_x[m] * s_w[n] * sum_k Q_x[m, k] Q_w[n, k] + b[n]``.

fp8 hands both scales and the bias to ``_scaled_mm`` (``Q_w`` row-major ``[N, K]`` is exactly the
column-major ``[K, N]`` second operand it wants: no copy). int8 gets the int32 sums from
``_int_mm`` and scales them in two elementwise passes (``acc * s_w``, then ``* s_x + b`` stored
in the output dtype).

Backward, ``grad_x = g W`` for ``g [M, N]``: the contraction runs over ``n``, the axis the weight's
scales live on, so they cannot be pulled out of the sum; they go into ``g`` first:

    ``grad_x[m, k] = sum_n g[m, n] s_w[n] Q_w[n, k] = sum_n h[m, n] Q_w[n, k]``,
    ``h = g * s_w[None, :]``,

and ``h`` is quantized per row like ``x`` (``s_h``, ``Q_h``): ``grad_x[m, k] ≈ s_h[m] * sum_n
Q_h[m, n] Q_w[n, k]``. The 8-bit GEMMs want both operands contiguous along the contraction
(cuBLASLt's "TN" layout); ``Q_w`` is contiguous along ``k``, not ``n``, so one transposed 8-bit
copy of ``Q_w`` is made per backward call (``N*K`` bytes, half of what a bf16 dequantize writes).
Neither ``grad_y @ W`` nor its transpose ``W^T grad_y^T`` avoids it; keeping a second, transposed
copy of the weight would double the bytes the swapper moves.

On CUDA with triton installed, the per-row quantization runs as ONE Triton launch
(:mod:`vramkit.quant._w8a8_triton`: amax, scale and codes; in the backward ``h = g * s_w`` too)
instead of four aten calls, with the same codes bit for bit, and int8's epilogue is one pass
(``acc * s_w * s_x + b`` stored in the output dtype). The CPU, and CUDA without triton, run the
aten code.

Host time: one ``torch.autograd.Function`` (skipped when nothing needs a gradient) calls one of
the kernel objects, chosen at the first call on a device (again after a move); per call there are
no config lookups or format checks.

While ``torch.compile`` traces (``compile_blocks``, ``fit(..., compile=True)``) the layer runs the
same math as stateless aten code instead (:mod:`vramkit.quant._w8a8_ops`): dynamo never meets the
Triton launchers or the per-device kernel choice, so a compiled block has no graph break and no
guard on the layer's state (blocks compile once per calling context, as float blocks do), and
inductor generates the quantization and epilogue kernels itself, fused with their neighbours. The buffers ``weight`` (codes ``[out, in]``) and
``weight_scale`` (fp32 ``[out]``) are read at every call, so a block swapper may repoint them.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import QuantizationError
from vramkit.quant import _w8a8_ops
from vramkit.quant._w8a8_ops import CPU_ROWWISE_FP8, column_major, int_mm
from vramkit.quant.formats import (
    FP8Config,
    Int8Config,
    QuantizedTensor,
    apply_device_only,
    quantize_tensor,
)
from vramkit.quant.kernels import triton_available

__all__ = ["W8A8_CAPABILITY", "W8A8Kind", "W8A8Linear", "check_w8a8_device", "quantize_rows",
           "w8a8_fits", "w8a8_weight_format"]

logger = logging.getLogger(__name__)

W8A8Kind = Literal["fp8", "int8"]

# The least CUDA compute capability of each kind's GEMM.
W8A8_CAPABILITY: dict[str, tuple[int, int]] = {"fp8": (8, 9), "int8": (8, 0)}
# Feature multiples each GEMM takes (in and out features: the backward swaps their roles).
_MULTIPLE: dict[str, int] = {"fp8": 16, "int8": 8}
_QMAX: dict[str, float] = {"fp8": 448.0, "int8": 127.0}
_CODE_DTYPE: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}

_INF = float("inf")
# Added to every token's scale: an all-zero row gets codes 0 / FLOOR = 0, never 0 / 0. A CPU
# 0-dim tensor, which torch takes as a scalar next to a CUDA tensor (no copy, one kernel).
_FLOOR = torch.tensor(1e-30, dtype=torch.float32)
_FP8 = torch.float8_e4m3fn


def w8a8_fits(kind: str, in_features: int, out_features: int) -> bool:
    """Whether ``kind``'s GEMMs take a Linear of this shape (forward and backward).

    Args:
        kind: ``"fp8"`` (features multiples of 16) or ``"int8"`` (multiples of 8).
        in_features, out_features: the layer's features.

    Returns:
        True when both features are multiples of the kind's GEMM multiple; other layers run a
        dequantized matmul (:attr:`W8A8Linear.kernel` ``== "dequantize"``).
    """
    multiple = _MULTIPLE[kind]
    return in_features % multiple == 0 and out_features % multiple == 0


def w8a8_weight_format(kind: str, cols: int) -> FP8Config | Int8Config:
    """The stored format of a W8A8 weight with ``cols`` input features: one fp32 scale per
    output channel (fp8 channel granularity; int8 with one block spanning the row)."""
    if kind == "fp8":
        return FP8Config(granularity="channel")
    return Int8Config(block_size=max(int(cols), 1), compact_scales=False)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_w8a8_device(kind: str, device: torch.device | str) -> None:
    """Raise unless ``kind``'s 8-bit GEMMs run on ``device``.

    CPU runs both kinds through torch's CPU kernels. CUDA needs capability >= 8.9 for fp8 and
    >= 8.0 for int8: there is no silent full-precision fallback.

    Raises:
        QuantizationError: naming the device's capability and what to use instead.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise QuantizationError(f"W8A8 {kind} runs on CUDA GPUs and the CPU, not on {device}",
                                hint="Move the layer to a CUDA device, or use weight-only "
                                     "storage (QuantizationConfig without w8a8).")
    have = _device_capability(device)
    need = W8A8_CAPABILITY[kind]
    if tuple(have) < need:
        other = ("int8 (capability >= 8.0)" if kind == "fp8" and tuple(have) >= (8, 0)
                 else "weight-only storage (QuantizationConfig(weights_dtype=...) without w8a8)")
        raise QuantizationError(
            f"W8A8 {kind} needs a CUDA GPU of compute capability >= {need[0]}.{need[1]}; "
            f"{device} has {have[0]}.{have[1]}",
            hint=f"Use {other} on this GPU.")


# -- per-row quantization ----------------------------------------------------------------------

# Whether `torch.div(..., out=<fp8 tensor>)` works on this build: the divide then casts as it
# stores (one pass). Turned off, with a log line, the first time a device refuses it.
_DIV_INTO_FP8 = [True]


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = torch.linalg.vector_norm(x, _INF, -1, True, dtype=torch.float32)
    scale = torch.add(_FLOOR, amax, alpha=1.0 / 448.0)
    if _DIV_INTO_FP8[0]:
        codes = torch.empty(x.shape, dtype=_FP8, device=x.device)
        try:
            torch.div(x, scale, out=codes)
            return codes, scale
        except RuntimeError as exc:  # a build without casting stores into fp8
            _DIV_INTO_FP8[0] = False
            logger.info("W8A8: torch.div cannot store into float8 here (%s); quantizing "
                        "activations in two passes", exc)
    return torch.div(x, scale).to(_FP8), scale


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = torch.linalg.vector_norm(x, _INF, -1, True, dtype=torch.float32)
    scale = torch.add(_FLOOR, amax, alpha=1.0 / 127.0)
    # The cast truncates: round to nearest first (|x / scale| <= 127, so no clamp).
    return torch.div(x, scale).round_().to(torch.int8), scale


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor per row, as the layer quantizes activations and gradients.

    Args:
        x: ``[M, K]``, floating point.
        kind: ``"fp8"`` or ``"int8"``.

    Returns:
        ``(codes [M, K], scales [M, 1] fp32)`` with ``x ≈ codes * scales``; an all-zero row
        gets zero codes and a tiny positive scale (no NaN).
    """
    return _fp8_rows(x) if kind == "fp8" else _int8_rows(x)


# -- the three kernels -------------------------------------------------------------------------

_ONES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _unit_scales(cols: int, device: torch.device) -> torch.Tensor:
    """``ones [1, cols]`` fp32: the backward's row-wise ``scale_b`` (made once per shape)."""
    key = (cols, device)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones(1, cols, dtype=torch.float32, device=device)
    return ones


def _fp8_mm(codes: torch.Tensor, second: torch.Tensor, scale_a: torch.Tensor,
            scale_b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``_scaled_mm`` into bf16 with row-wise scales, or its fp32 emulation on an old CPU."""
    if codes.device.type != "cpu" or CPU_ROWWISE_FP8[0]:
        try:
            return torch._scaled_mm(codes, second, scale_a=scale_a, scale_b=scale_b, bias=bias,
                                    out_dtype=torch.bfloat16)
        except RuntimeError as exc:
            if codes.device.type != "cpu":
                raise
            CPU_ROWWISE_FP8[0] = False
            logger.info("W8A8: this torch's CPU _scaled_mm takes no row-wise scales (%s); the "
                        "CPU computes fp8 products in fp32 from the same codes", exc)
    y = (codes.float() @ second.float()) * scale_a * scale_b
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def _fp8_matmul(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                scale: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    # Row-wise scaled_mm writes bf16 only; other dtypes are cast after.
    if dtype is torch.bfloat16:
        return _fp8_mm(codes, weight.t(), x_scale, scale.view(1, -1), bias)
    y = _fp8_mm(codes, weight.t(), x_scale, scale.view(1, -1), None).to(dtype)
    return y if bias is None else y.add_(bias)


def _fp8_grad_matmul(codes: torch.Tensor, g_scale: torch.Tensor, weight: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    y = _fp8_mm(codes, column_major(weight), g_scale,
                _unit_scales(weight.shape[1], codes.device), None)
    return y if dtype is torch.bfloat16 else y.to(dtype)


class _Fp8Kernel:
    name = "fp8"
    quantizer = "aten"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        codes, x_scale = _fp8_rows(x)
        return _fp8_matmul(codes, x_scale, weight, scale, bias, x.dtype)

    @staticmethod
    def grad_input(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        codes, g_scale = _fp8_rows(grad * scale)  # h = g * s_w, quantized per row
        return _fp8_grad_matmul(codes, g_scale, weight, dtype)


class _Int8Kernel:
    name = "int8"
    quantizer = "aten"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        codes, x_scale = _int8_rows(x)
        acc = torch.mul(int_mm(codes, weight.t()), scale)  # int32 * fp32 -> fp32
        out = torch.empty(acc.shape, dtype=x.dtype, device=x.device)
        if bias is None:
            return torch.mul(acc, x_scale, out=out)
        return torch.addcmul(bias, acc, x_scale, out=out)

    @staticmethod
    def grad_input(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        codes, g_scale = _int8_rows(grad * scale)
        acc = int_mm(codes, column_major(weight))
        return torch.mul(acc, g_scale, out=torch.empty(acc.shape, dtype=dtype,
                                                        device=acc.device))


class _DequantizeKernel:
    """For shapes the 8-bit GEMMs cannot take: the weight dequantized at each call."""

    name = "dequantize"
    quantizer = "none"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, _dequantized(weight, scale, x.dtype), bias)

    @staticmethod
    def grad_input(grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        return grad.to(dtype) @ _dequantized(weight, scale, dtype)


class _TritonFp8Kernel:
    """fp8 on CUDA with triton: one Triton launch quantizes the rows (forward: ``x``; backward:
    ``g * s_w``), then the same ``_scaled_mm`` as :class:`_Fp8Kernel`."""

    name = "fp8"
    quantizer = "triton"

    def __init__(self, in_features: int, out_features: int) -> None:
        from vramkit.quant import _w8a8_triton  # imports triton: CUDA only

        self._rows = _w8a8_triton.row_quantizer("fp8", in_features)
        self._grad_rows = _w8a8_triton.row_quantizer("fp8", out_features, col_scaled=True)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        codes, x_scale = self._rows(x)
        return _fp8_matmul(codes, x_scale, weight, scale, bias, x.dtype)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        codes, g_scale = self._grad_rows(grad, scale)
        return _fp8_grad_matmul(codes, g_scale, weight, dtype)


class _TritonInt8Kernel:
    """int8 on CUDA with triton: one Triton launch quantizes the rows, ``_int_mm``, then one
    Triton pass scales the int32 sums into the output dtype (bias added there too)."""

    name = "int8"
    quantizer = "triton"

    def __init__(self, in_features: int, out_features: int) -> None:
        from vramkit.quant import _w8a8_triton  # imports triton: CUDA only

        self._rows = _w8a8_triton.row_quantizer("int8", in_features)
        self._grad_rows = _w8a8_triton.row_quantizer("int8", out_features, col_scaled=True)
        self._epilogue = _w8a8_triton.int8_epilogue(out_features, col_scaled=True)
        self._grad_epilogue = _w8a8_triton.int8_epilogue(in_features, col_scaled=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        codes, x_scale = self._rows(x)
        return self._epilogue(int_mm(codes, weight.t()), x_scale, scale, bias, x.dtype)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        codes, g_scale = self._grad_rows(grad, scale)
        return self._grad_epilogue(int_mm(codes, column_major(weight)), g_scale, None, None,
                                   dtype)


_Kernel = (type[_Fp8Kernel] | type[_Int8Kernel] | type[_DequantizeKernel] | _TritonFp8Kernel
           | _TritonInt8Kernel)
_KERNELS: dict[str, _Kernel] = {"fp8": _Fp8Kernel, "int8": _Int8Kernel,
                                "dequantize": _DequantizeKernel}
_TRITON_KERNELS: dict[tuple[str, int, int], _Kernel] = {}


def _device_kernel(name: str, in_features: int, out_features: int,
                   device: torch.device) -> _Kernel:
    """The kernel object of ``name`` (``"fp8"``, ``"int8"`` or ``"dequantize"``) for inputs on
    ``device``: the Triton-quantizing one on CUDA with triton installed, else the aten one."""
    if name == "dequantize" or not triton_available(device):
        return _KERNELS[name]
    key = (name, in_features, out_features)
    kernel = _TRITON_KERNELS.get(key)
    if kernel is None:
        kind = _TritonFp8Kernel if name == "fp8" else _TritonInt8Kernel
        kernel = _TRITON_KERNELS[key] = kind(in_features, out_features)
    return kernel


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


class _W8A8Function(torch.autograd.Function):
    """``y = x W^T + b`` in 8 bits; backward: ``grad_x`` in 8 bits, ``grad_b``, never ``grad_W``.

    Saves only the weight's codes and scales (module buffers: inside a block swapper its
    saved-tensor hooks turn them into handles re-read in backward), never ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, kernel: _Kernel) -> torch.Tensor:
        shape = x.shape
        ctx.call = (kernel, shape, x.dtype)  # one attribute: ctx's setattr is not free
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(weight, scale)
        if len(shape) == 2:
            return kernel.forward(x, weight, scale, bias)
        y = kernel.forward(x.reshape(-1, shape[-1]), weight, scale, bias)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kernel, x_shape, x_dtype = ctx.call
        flat = grad_out.dim() != 2
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1]) if flat else grad_out
        grad_x = grad_bias = None
        needs = ctx.needs_input_grad
        if needs[0]:
            weight, scale = ctx.saved_tensors
            grad_x = kernel.grad_input(grad_2d, weight, scale, x_dtype)
            if flat:
                grad_x = grad_x.view(x_shape)
        if needs[3]:
            grad_bias = grad_2d.sum(0)
        return grad_x, None, None, grad_bias, None


class W8A8Linear(nn.Module):
    """A frozen ``nn.Linear`` stored in 8 bits whose forward and input gradient run in 8 bits.

    See the module docstring for the math. The weight lives in two buffers, ``weight``
    (codes ``[out, in]``, float8 e4m3 or int8) and ``weight_scale`` (fp32 ``[out]``), so
    ``.to()``, ``state_dict`` and a block swapper move them as bytes (half of bf16), and
    ``requires_grad_()`` never turns them trainable; ``bias`` is an ordinary ``Parameter`` (kept
    as the same object from the source layer, trainable or not). ``.to(dtype)`` leaves the
    codes and scales as they are.

    Build it with :meth:`from_linear` or :meth:`from_quantized`, or for a whole model with
    ``quantize_model(model, QuantizationConfig("fp8", w8a8=True))``.

    Args:
        weight: the codes ``[out, in]`` (``torch.float8_e4m3fn`` or ``torch.int8``).
        weight_scale: fp32 scales ``[out]`` (``W ≈ weight_scale[:, None] * weight``).
        bias: optional ``[out]`` bias; a ``Parameter`` is kept as is.
        name: the layer's name, for the one log line of a dequantizing layer.

    Raises:
        QuantizationError: for codes of another dtype, mismatched shapes, or (weights already
            on a CUDA device) a GPU that cannot run the kind (:func:`check_w8a8_device`).
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, *, name: str = "W8A8Linear") -> None:
        super().__init__()
        kinds = {dtype: kind for kind, dtype in _CODE_DTYPE.items()}
        if weight.dim() != 2 or weight.dtype not in kinds:
            raise QuantizationError(f"W8A8Linear needs 2-D float8_e4m3fn or int8 codes, got "
                                    f"{weight.dtype} of shape {list(weight.shape)}",
                                    hint="Build it with W8A8Linear.from_linear(linear, 'fp8').")
        out_features, in_features = (int(n) for n in weight.shape)
        if tuple(weight_scale.shape) not in ((out_features,), (out_features, 1)):
            raise QuantizationError(f"weight_scale shape {list(weight_scale.shape)} does not "
                                    f"match the {out_features} outputs of the weight",
                                    hint="Give one fp32 scale per output channel.")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise QuantizationError(f"bias shape {list(bias.shape)} does not match the "
                                    f"{out_features} outputs of the weight",
                                    hint="Pass a bias of shape [out_features], or None.")
        self.kind: str = kinds[weight.dtype]
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", weight.detach())
        self.register_buffer("weight_scale",
                             weight_scale.detach().reshape(out_features).to(torch.float32))
        if isinstance(bias, nn.Parameter):
            self.bias: nn.Parameter | None = bias
        elif bias is not None:
            self.bias = nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
        else:
            self.register_parameter("bias", None)
        fits = w8a8_fits(self.kind, in_features, out_features)
        self._kernel: _Kernel = _KERNELS[self.kind if fits else "dequantize"]
        # The kernel's name, fixed for the layer's life: what a traced call reads (the kernel
        # object above is replaced on the first eager call on a device; reading it while
        # torch.compile traces would guard on it and compile again after that call).
        self._kernel_name: str = self._kernel.name
        if not fits:
            logger.info("%s (%d -> %d) runs a dequantized matmul: %s GEMMs need features "
                        "divisible by %d", name, in_features, out_features, self.kind,
                        _MULTIPLE[self.kind])
        # The device the last call's input was checked on (the check runs once per device).
        self._checked_device: torch.device | None = None
        if weight.is_cuda:
            check_w8a8_device(self.kind, weight.device)

    @property
    def kernel(self) -> str:
        """``"fp8"``, ``"int8"``, or ``"dequantize"`` for a shape the 8-bit GEMMs cannot take."""
        return self._kernel.name

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the stored weight (codes and scales)."""
        return (self.weight.numel() * self.weight.element_size()
                + self.weight_scale.numel() * self.weight_scale.element_size())

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: W8A8Kind = "fp8", *,
                    release_weight: bool = True, name: str = "W8A8Linear") -> W8A8Linear:
        """Quantize an ``nn.Linear`` per output channel.

        Args:
            linear: the layer (a real floating-point weight, not meta).
            kind: ``"fp8"`` (default) or ``"int8"``.
            release_weight: free the original weight's storage (default True); pass False
                when something else still uses it.
            name: the layer's name, for messages.

        Returns:
            The new layer on the weight's device; the bias ``Parameter`` is reused.

        Raises:
            QuantizationError: for a layer that is not an ``nn.Linear``, a meta or
                non-floating weight, or an unknown kind.
        """
        if not isinstance(linear, nn.Linear):
            raise QuantizationError(f"from_linear needs an nn.Linear, got "
                                    f"{type(linear).__name__}",
                                    hint="Pass an nn.Linear (the float layer).")
        if kind not in _CODE_DTYPE:
            raise QuantizationError(f"W8A8 kind must be 'fp8' or 'int8', got {kind!r}",
                                    hint="Use 'fp8' on capability >= 8.9, 'int8' on >= 8.0.")
        weight = linear.weight
        if weight.device.type == "meta":
            raise QuantizationError(f"cannot quantize {name}: its weight is on the meta device",
                                    hint="Load the real weights first.")
        q = quantize_tensor(weight.detach(), w8a8_weight_format(kind, weight.shape[1]))
        layer = cls.from_quantized(q, linear.bias, name=name)
        if release_weight:
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        return layer

    @classmethod
    def from_quantized(cls, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                       name: str = "W8A8Linear") -> W8A8Linear:
        """Wrap a per-channel quantized weight: fp8 with channel granularity, or int8 with
        fp32 scales and one block per row (:func:`w8a8_weight_format`).

        Raises:
            QuantizationError: for any other layout.
        """
        config = q.config
        rows, cols = (int(n) for n in q.data.shape) if q.data.dim() == 2 else (0, 0)
        per_channel = ((isinstance(config, FP8Config) and config.granularity == "channel")
                       or (isinstance(config, Int8Config) and not config.compact_scales
                           and config.block_size >= cols))
        if not per_channel or len(q.shape) != 2 or (rows, cols) != tuple(q.shape):
            raise QuantizationError(f"W8A8Linear needs a 2-D weight with one scale per output "
                                    f"channel, got {config!r} of shape {list(q.shape)}",
                                    hint="Quantize with w8a8_weight_format(kind, in_features).")
        return cls(q.data, q.scales.reshape(-1), bias, name=name)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A full-precision copy of the weight (``weight_scale[:, None] * weight``)."""
        return _dequantized(self.weight, self.weight_scale, dtype)

    def _verify_device(self, x: torch.Tensor) -> None:
        """Check ``x``'s device once and pick the kernel object for it (Triton-quantizing on
        CUDA with triton installed)."""
        if x.device.type == "cuda":
            check_w8a8_device(self.kind, x.device)
        self._kernel = _device_kernel(self._kernel.name, self.in_features, self.out_features,
                                      x.device)
        self._checked_device = x.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype (autocast's
        inside ``torch.autocast``)."""
        buffers = self._buffers
        weight, scale = buffers["weight"], buffers["weight_scale"]
        device = x.device
        if device.type == "meta":  # a planner's shape pass: no kernel, no device check
            return x.new_empty((*x.shape[:-1], self.out_features))
        tracing = torch.compiler.is_compiling()
        # Traced, nothing here may read or change Python state that the first call sets (it
        # would become a guard that fails): no device check (a GPU without the GEMM fails in
        # the GEMM itself), no kernel choice (the traced path is aten code for every device).
        if not tracing and device != self._checked_device:
            self._verify_device(x)
        if not x.is_floating_point():
            raise QuantizationError(f"W8A8Linear needs a floating-point input, got {x.dtype}",
                                    hint="Cast the input first, e.g. x.to(torch.bfloat16).")
        if x.shape[-1] != self.in_features:
            raise QuantizationError(f"activations end in {x.shape[-1]} features, the layer "
                                    f"takes {self.in_features}",
                                    hint="Give x a last dimension of in_features.")
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
            if x.dtype != dtype:
                x = x.to(dtype)
        bias = self._parameters["bias"]
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if tracing:
            return _w8a8_ops.traced_linear(x, weight, scale, bias, self._kernel_name,
                                           self.out_features)
        if torch.is_grad_enabled() and (x.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _W8A8Function.apply(x, weight, scale, bias, self._kernel)
        shape = x.shape
        if len(shape) == 2:
            return self._kernel.forward(x, weight, scale, bias)
        y = self._kernel.forward(x.reshape(-1, shape[-1]), weight, scale, bias)
        return y.view(*shape[:-1], self.out_features)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # nn.Module.to(dtype) casts floating buffers: fp8 codes and fp32 scales follow device
        # moves only.
        apply = super()._apply
        apply_device_only(self, ("weight", "weight_scale"), fn, lambda: apply(fn, recurse))
        self._checked_device = None
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kind={self.kind}, kernel={self.kernel}")

