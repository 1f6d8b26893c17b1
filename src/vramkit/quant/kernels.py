"""GPU paths for quantized weights, with the torch fallback used on CPU and without Triton.

- :func:`dequantize`: Triton on CUDA for every format; torch elsewhere (bit-identical results).
- :func:`quantized_matmul`: ``x @ W.T + bias`` for a quantized Linear weight. Weight-only path:
  Triton dequantize + cuBLAS, or for a few tokens (decode) a fused Triton dequantize-matmul that
  never writes the weight out. ``activation_fp8=True``: the fp8 GEMM (``torch._scaled_mm`` with
  row-wise scales) on fp8 weights, activations quantized per token.

Each GPU entry point is a PyTorch custom op (``vramkit_quant::*``) with a fake implementation,
so ``torch.compile`` treats it as one opaque node instead of tracing into Triton launches.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations of
# the op functions at runtime to build their schemas.

import functools
import importlib.util
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vramkit.errors import QuantizationError
from vramkit.quant import _reference
from vramkit.quant._configs import (
    FP8Config,
    Int4Config,
    Int8Config,
    NF4Config,
    QuantConfigT,
    config_from_dict,
)

if TYPE_CHECKING:  # formats imports this module: annotations only
    from vramkit.quant.formats import QuantizedTensor

# DequantPlan is the quantized layers' own machinery, not exported.
__all__ = ["FP8_GEMM_MULTIPLE", "FUSED_MAX_TOKENS", "dequantize", "fp8_gemm_fits", "has_fp8_gemm",
           "quantized_matmul", "triton_available"]

logger = logging.getLogger(__name__)

# At most this many tokens take the fused dequantize-matmul: it re-reads the weight once per
# token, so beyond a few tokens dequantize + cuBLAS wins (benchmarks/quant.py measures both).
FUSED_MAX_TOKENS = 2

# torch._scaled_mm (the fp8 GEMM) takes in/out features that are multiples of this.
FP8_GEMM_MULTIPLE = 16


_TRITON_INSTALLED: list[bool] = []  # filled on first use


@torch.compiler.assume_constant_result
def _triton_installed() -> bool:
    # assume_constant_result: under torch.compile dynamo calls this once and bakes the answer
    # into the graph instead of tracing importlib (which it refuses to trace).
    if not _TRITON_INSTALLED:
        _TRITON_INSTALLED.append(importlib.util.find_spec("triton") is not None)
    return _TRITON_INSTALLED[0]


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device`` (a CUDA device with triton installed).

    Args:
        device: a device or device string.

    Returns:
        True for CUDA devices when CUDA is usable and ``triton`` is importable.
    """
    dev = device if isinstance(device, torch.device) else torch.device(device)
    return dev.type == "cuda" and _triton_installed() and torch.cuda.is_available()


def has_fp8_gemm(device: torch.device | str) -> bool:
    """Whether the fp8 GEMM path can run on ``device``.

    Args:
        device: a device or device string.

    Returns:
        True for a CUDA device of compute capability >= 8.9 with ``torch._scaled_mm``.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 9)


def fp8_gemm_fits(in_features: int, out_features: int) -> bool:
    """Whether the fp8 GEMM takes a Linear of this shape (both features multiples of
    :data:`FP8_GEMM_MULTIPLE`); other layers of an fp8-activation config run weight-only.

    Args:
        in_features: the layer's input features.
        out_features: the layer's output features.

    Returns:
        True when both are multiples of :data:`FP8_GEMM_MULTIPLE`.
    """
    return not (in_features % FP8_GEMM_MULTIPLE or out_features % FP8_GEMM_MULTIPLE)


# ------------------------------------------------------------------------- layout plumbing

def _kernel_params(config: QuantConfigT, cols: int) -> tuple[str, int, int, bool]:
    """(format name, group, double-quant block, compact) as the kernels take them."""
    if isinstance(config, FP8Config):
        group = (_reference.padded_cols(config, cols) if config.granularity == "channel"
                 else config.block_size)
        return "fp8", group, 1, False
    if isinstance(config, Int8Config):
        return "int8", config.block_size, 1, config.compact_scales
    if isinstance(config, Int4Config):
        return "int4", config.group_size, 1, config.compact_scales
    assert isinstance(config, NF4Config)
    return "nf4", config.block_size, config.double_quant_block_size, config.double_quant


def _aux(q: "QuantizedTensor") -> torch.Tensor | None:
    return q.extras.get("row_scales", q.extras.get("scale_scales"))


def _config_key(config: QuantConfigT) -> str:
    # Precomputed in the config's __post_init__: a plain attribute read traces under compile.
    return config._key  # type: ignore[union-attr]


@functools.lru_cache(maxsize=64)
def _config_from_key(key: str) -> QuantConfigT:
    fields = json.loads(key)
    return config_from_dict(fields.pop("format"), fields)


def _extras_for(config: QuantConfigT, aux: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if aux is None:
        return {}
    return {"scale_scales" if isinstance(config, NF4Config) else "row_scales": aux}


# ------------------------------------------------------------------------------ custom ops

# Each GPU entry point is a plain function (called directly in eager mode: the custom-op
# dispatcher costs tens of microseconds of host time per call, and the quantized layers are
# host-bound at small block sizes) wrapped as a torch custom op (used under torch.compile).

def _dequantize_impl(data: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                     aux: torch.Tensor | None, config_key: str, cols: int,
                     dtype: torch.dtype) -> torch.Tensor:
    config = _config_from_key(config_key)
    if triton_available(data.device):
        from vramkit.quant import _triton

        fmt, group, dq_block, compact = _kernel_params(config, cols)
        return _triton.dequantize(fmt, data, scales, zero_points, aux, group=group,
                                  dq_block=dq_block, compact=compact, cols=cols, dtype=dtype)
    return _reference.dequantize_rows(config, data, scales, zero_points,
                                      _extras_for(config, aux), cols, dtype)


@torch.library.custom_op("vramkit_quant::dequantize", mutates_args=())
def _dequantize_op(data: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                   aux: torch.Tensor | None, config_key: str, cols: int,
                   dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_impl(data, scales, zero_points, aux, config_key, cols, dtype)


@_dequantize_op.register_fake
def _(data: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
      aux: torch.Tensor | None, config_key: str, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return data.new_empty((data.shape[0], cols), dtype=dtype)


def _fused_linear_impl(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                       zero_points: torch.Tensor | None, aux: torch.Tensor | None,
                       bias: torch.Tensor | None, config_key: str, cols: int) -> torch.Tensor:
    config = _config_from_key(config_key)
    if triton_available(x.device):
        from vramkit.quant import _triton

        fmt, group, dq_block, compact = _kernel_params(config, cols)
        return _triton.fused_linear(x.contiguous(), fmt, data, scales, zero_points, aux, bias,
                                    group=group, dq_block=dq_block, compact=compact,
                                    n_out=data.shape[0])
    weight = _reference.dequantize_rows(config, data, scales, zero_points,
                                        _extras_for(config, aux), cols, x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


@torch.library.custom_op("vramkit_quant::fused_linear", mutates_args=())
def _fused_linear_op(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                     zero_points: torch.Tensor | None, aux: torch.Tensor | None,
                     bias: torch.Tensor | None, config_key: str, cols: int) -> torch.Tensor:
    return _fused_linear_impl(x, data, scales, zero_points, aux, bias, config_key, cols)


@_fused_linear_op.register_fake
def _(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
      zero_points: torch.Tensor | None, aux: torch.Tensor | None,
      bias: torch.Tensor | None, config_key: str, cols: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], data.shape[0]))


def _fp8_rowwise_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_available(x.device):
        from vramkit.quant import _triton

        return _triton.fp8_rowwise(x.contiguous())
    return fp8_rowwise_reference(x)


@torch.library.custom_op("vramkit_quant::fp8_rowwise", mutates_args=())
def _fp8_rowwise_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_rowwise_impl(x)


def _op(op: Any, impl: Any) -> Any:
    """The custom op while torch.compile traces, the plain function otherwise."""
    return op if torch.compiler.is_compiling() else impl


@_fp8_rowwise_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def fp8_rowwise_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float8 e4m3 quantization of ``[tokens, in]`` activations in torch ops.

    Args:
        x: 2-D floating activations.

    Returns:
        ``(codes float8_e4m3fn [tokens, in], scales float32 [tokens, 1])``.
    """
    x32 = x.to(torch.float32)
    scales = x32.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / _reference.FP8_MAX
    codes = (x32 / scales).clamp_(-_reference.FP8_MAX, _reference.FP8_MAX)
    return codes.to(torch.float8_e4m3fn), scales


# ------------------------------------------------------------------------------ public API

class DequantPlan:
    """How to dequantize one packed weight layout, worked out once for a layer's lifetime.

    The quantized layers call it at every forward and backward: on CUDA it goes straight to the
    layout's Triton launch (:class:`vramkit.quant._triton.Dequantizer`), with nothing derived
    per call but the tensors' addresses; elsewhere to the torch reference. Under
    ``torch.compile`` it uses the ``vramkit_quant::dequantize`` custom op. The result equals
    :func:`dequantize` of the same record bit for bit.

    Args:
        config: the format config.
        shape: the original weight shape.
        names: the stored tensors' names in the order ``packed`` is given (keys of
            :meth:`~vramkit.quant.formats.QuantizedTensor.tensors`).
    """

    __slots__ = (
        "_aux",
        "_data",
        "_kernel",
        "_key",
        "_scales",
        "_triton",
        "_zeros",
        "cols",
        "config",
        "rows",
        "shape",
    )

    def __init__(self, config: QuantConfigT, shape: torch.Size, names: tuple[str, ...]) -> None:
        self.config, self.shape = config, torch.Size(shape)
        self.rows, self.cols = _reference.rows_cols(shape)
        self._data, self._scales = names.index("data"), names.index("scales")
        self._zeros = names.index("zero_points") if "zero_points" in names else None
        aux = [i for i, name in enumerate(names) if name in ("extra.row_scales",
                                                              "extra.scale_scales")]
        self._aux = aux[0] if aux else None
        self._key = _config_key(config)
        self._kernel = _kernel_params(config, self.cols)
        self._triton: Any = None

    def __call__(self, packed: "Sequence[torch.Tensor]", dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` and its original shape.

        Args:
            packed: the stored tensors, in the ``names`` order.
            dtype: the output dtype.

        Returns:
            A new tensor on the packed tensors' device.
        """
        data, scales = packed[self._data], packed[self._scales]
        zeros = None if self._zeros is None else packed[self._zeros]
        aux = None if self._aux is None else packed[self._aux]
        if torch.compiler.is_compiling():
            flat = _dequantize_op(data, scales, zeros, aux, self._key, self.cols, dtype)
        elif data.is_cuda and _triton_installed():
            if self._triton is None:
                from vramkit.quant import _triton

                fmt, group, dq_block, compact = self._kernel
                self._triton = _triton.dequantizer(fmt, group=group, dq_block=dq_block,
                                                   compact=compact, rows=self.rows,
                                                   cols=self.cols)
            flat = self._triton(data, scales, zeros, aux, dtype)
        else:
            extras = {} if aux is None else _extras_for(self.config, aux)
            flat = _reference.dequantize_rows(self.config, data, scales, zeros, extras,
                                              self.cols, dtype)
        return flat.view(self.shape)

    def few_tokens(self, x: torch.Tensor, packed: "Sequence[torch.Tensor]",
                   bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` of a 2-D weight for at most ``FUSED_MAX_TOKENS`` tokens: the
        fused dequantize-matmul (:func:`quantized_matmul` with ``fused=True``), with the
        layout's launch parameters derived once.

        Args:
            x: ``[..., cols]`` floating activations on the packed tensors' device.
            packed: the stored tensors, in the ``names`` order.
            bias: optional ``[rows]``.

        Returns:
            ``[..., rows]`` in ``x.dtype``.
        """
        data, scales = packed[self._data], packed[self._scales]
        zeros = None if self._zeros is None else packed[self._zeros]
        aux = None if self._aux is None else packed[self._aux]
        x2d = x.reshape(-1, self.cols)
        if not torch.compiler.is_compiling() and data.is_cuda and _triton_installed():
            from vramkit.quant import _triton

            fmt, group, dq_block, compact = self._kernel
            y = _triton.fused_linear(x2d.contiguous(), fmt, data, scales, zeros, aux, bias,
                                     group=group, dq_block=dq_block, compact=compact,
                                     n_out=self.rows)
        else:
            y = _op(_fused_linear_op, _fused_linear_impl)(x2d, data, scales, zeros, aux, bias,
                                                          self._key, self.cols)
        return y.reshape(*x.shape[:-1], self.rows)


def dequantize(q: "QuantizedTensor", dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize ``q`` to its original shape (Triton on CUDA, torch elsewhere).

    Args:
        q: the quantized record.
        dtype: output dtype (default None: ``q.dtype``).

    Returns:
        A tensor of ``q.shape`` and ``dtype`` on ``q.device``.
    """
    out_dtype = q.dtype if dtype is None else dtype
    if triton_available(q.device):
        flat = _op(_dequantize_op, _dequantize_impl)(q.data, q.scales, q.zero_points, _aux(q),
                                                     _config_key(q.config), q.cols, out_dtype)
    else:
        flat = _reference.dequantize_rows(q.config, q.data, q.scales, q.zero_points, q.extras,
                                          q.cols, out_dtype)
    return flat.reshape(q.shape)


def _check_fp8_gemm(x: torch.Tensor, q: "QuantizedTensor") -> None:
    config = q.config
    if not isinstance(config, FP8Config) or config.granularity != "channel":
        raise QuantizationError(f"activation_fp8 needs fp8 weights with channel granularity, got "
                                f"{config}", hint="Quantize the weight with "
                                "FP8Config(granularity='channel') (the 'fp8' default).")
    if not has_fp8_gemm(x.device):
        raise QuantizationError(f"the fp8 GEMM is unavailable on {x.device}: it needs a CUDA GPU "
                                "of compute capability >= 8.9 and torch._scaled_mm",
                                hint="Use activation_fp8=False (weight-only dequantize + matmul).")
    n_out, n_in = q.rows, q.cols
    if not fp8_gemm_fits(n_in, n_out):
        raise QuantizationError(f"the fp8 GEMM needs in/out features divisible by "
                                f"{FP8_GEMM_MULTIPLE}, got {n_in} -> {n_out}",
                                hint="Use activation_fp8=False for this layer.")


def _fp8_matmul(x2d: torch.Tensor, q: "QuantizedTensor", bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    codes, x_scales = _op(_fp8_rowwise_op, _fp8_rowwise_impl)(x2d)
    # row-wise scaled_mm takes weight scales as [1, out] and the weight column-major: W.t()
    y = torch._scaled_mm(codes, q.data.t(), scale_a=x_scales, scale_b=q.scales.reshape(1, -1),
                         out_dtype=torch.bfloat16, use_fast_accum=True)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)


def quantized_matmul(x: torch.Tensor, q: "QuantizedTensor", bias: torch.Tensor | None = None, *,
                     activation_fp8: bool = False, fused: bool | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a Linear weight ``W [out, in]`` held as ``q``.

    Args:
        x: activations ``[..., in]`` (floating).
        q: the quantized weight (2-D shape ``[out, in]``), on ``x``'s device.
        bias: optional ``[out]`` bias (default None).
        activation_fp8: quantize ``x`` per token to float8 e4m3 and run the fp8 GEMM (default
            False). Needs fp8 channel-granularity weights, a GPU of capability >= 8.9 and in/out
            features divisible by 16.
        fused: weight-only path choice on CUDA: True forces the fused Triton dequantize-matmul,
            False dequantize + cuBLAS, None (default) fuses for at most ``FUSED_MAX_TOKENS``
            tokens. Ignored on CPU and with ``activation_fp8``.

    Returns:
        ``[..., out]`` in ``x.dtype``.

    Raises:
        QuantizationError: shape mismatch, non-floating ``x``, or an unavailable fp8 GEMM.
    """
    if len(q.shape) != 2:
        raise QuantizationError(f"quantized_matmul needs a 2-D Linear weight, got shape "
                                f"{tuple(q.shape)}",
                                hint="Quantize the weight of an nn.Linear ([out_features, "
                                     "in_features]); reshape other weights to 2-D first.")
    if not x.is_floating_point():
        raise QuantizationError(f"quantized_matmul needs floating activations, got {x.dtype}",
                                hint="Cast the input to a floating dtype first, e.g. "
                                     "x.to(torch.bfloat16).")
    n_out, n_in = q.rows, q.cols
    if x.shape[-1] != n_in:
        raise QuantizationError(f"activations end in {x.shape[-1]} features, the weight takes "
                                f"{n_in}",
                                hint="Give x a last dimension of the weight's in_features "
                                     "(x.shape[-1] == q.cols).")
    x2d = x.reshape(-1, n_in)
    if activation_fp8:
        _check_fp8_gemm(x, q)
        y = _fp8_matmul(x2d, q, bias, x.dtype)
    elif triton_available(x.device) and (
            fused if fused is not None else x2d.shape[0] <= FUSED_MAX_TOKENS):
        y = _op(_fused_linear_op, _fused_linear_impl)(x2d, q.data, q.scales, q.zero_points,
                                                      _aux(q), bias, _config_key(q.config), n_in)
    else:
        y = torch.nn.functional.linear(x2d, dequantize(q, x.dtype), bias)
    return y.reshape(*x.shape[:-1], n_out)
