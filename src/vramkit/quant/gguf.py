"""GGUF (llama.cpp) quantized weights kept packed: block dequantization in torch and
:class:`GGUFLinear`, a frozen linear whose master is the file's quantized bytes.

A GGUF tensor of type Q8_0, Q4_K, ... is a sequence of fixed-size blocks along each row (the
innermost dimension, ``in_features`` of a Linear weight ``[out, in]``): ``block_size``
elements stored in ``type_size`` bytes. A row is a whole number of blocks, so a weight is held
as a ``uint8`` tensor ``[rows, row_bytes]`` and row slices of it (FLUX's fused qkv split into
q, k, v) are exact.

:func:`dequantize_gguf` turns such bytes into floats with vectorized torch ops (CPU or GPU, no
host sync); every type matches ``gguf.quants.dequantize`` (the reference implementation of the
``gguf`` package) bit for bit in float32, which ``tests/quant/test_gguf.py`` checks on random
blocks. Nothing here imports the ``gguf`` package: the type table below is the file format's.

:class:`GGUFLinear` registers the packed bytes as a module buffer, so ``.to()``, ``state_dict``
and the :class:`~vramkit.offload.swap.BlockSwapper` move them as raw bytes (a Q8_0 FLUX block
crosses PCIe at 53 % of its bf16 size) and the weight is dequantized on the device at each call;
backward dequantizes the saved packed bytes again, so LoRA trains on a GGUF base without a
full-precision copy ever being kept.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit._gguf_types import GGUF_QUANT_TYPES, GGUFQuantType, gguf_quant_type
from vramkit.errors import QuantizationError
from vramkit.quant.formats import apply_device_only
from vramkit.quant.kernels import triton_available

__all__ = ["GGUF_QUANT_TYPES", "GGUFLinear", "GGUFQuantType", "GGUFWeight", "dequantize_gguf",
           "gguf_quant_type"]

_QK_K = 256  # elements of a "K-quant" super-block


# -- block decoders: blocks [n, type_size] uint8 -> [n, block_size] in the asked dtype ----------
#
# Each decoder computes in float32 in the reference's order of operations, and its last op
# writes the asked dtype directly (``out=``): one rounding, as decoding to float32 and casting
# would give, without the float32 copy of the weight (on a GPU a Q8_0 weight is decoded by one
# kernel reading 1.06 bytes and writing 2 per element, then the matmul).


@functools.cache
def _shifts(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built once per device: a torch.tensor(...) per call would copy from pageable memory.
    return torch.tensor(values, dtype=dtype).to(device)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields ``[n, 2k]`` -> float32 ``[n, k]``. A column slice of the
    blocks is viewed in place where its strides allow (every block's size is even): one
    kernel, the conversion, instead of a copy and a conversion."""
    if (raw.stride(-1) != 1 or any(st % 2 for st in raw.stride()[:-1])
            or raw.storage_offset() % 2):
        raw = raw.clone(memory_format=torch.contiguous_format)  # (at offset 0: even)
    return raw.view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` bytes -> ``[n, 2m]``: all low nibbles, then all high nibbles (GGML's order
    within a 32-element group)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(word: torch.Tensor, count: int) -> torch.Tensor:
    """Bit j of each little-endian int32 ``word [n, 1]``, for j < count: ``[n, count]``."""
    return (word >> _shifts(tuple(range(count)), torch.int32, word.device)) & 1


def _unpack_shifts(raw: torch.Tensor, shifts: tuple[int, ...], mask: int, width: int
                   ) -> torch.Tensor:
    """``raw [n, g*width]`` -> ``[n, g, len(shifts), width]``: each byte shifted and masked."""
    n = raw.shape[0]
    s = _shifts(shifts, torch.uint8, raw.device).reshape(1, 1, -1, 1)
    return (raw.reshape(n, -1, 1, width) >> s) & mask


def _out(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device=like.device)


def _mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a * b`` computed in float32 (one of them is), written as ``dtype``."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    return torch.mul(a, b, out=torch.empty(shape, dtype=dtype, device=a.device))


def _q8_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = _half(b[:, :2])
    return _mul(b[:, 2:].view(torch.int8), d, dtype)  # int8 codes promoted inside the kernel


def _q4_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = _half(b[:, :2])
    return _mul(_nibbles(b[:, 2:]).to(torch.int8) - 8, d, dtype)


def _q4_1(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d, m = _half(b[:, :2]), _half(b[:, 2:4])
    scaled = d * _nibbles(b[:, 4:])
    return torch.add(scaled, m, out=_out(scaled, dtype))


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    high = _bits(qh.contiguous().view(torch.int32), 32).to(torch.uint8)
    return _nibbles(qs) | (high << 4)


def _q5_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = _half(b[:, :2])
    q = _five_bit(b[:, 2:6], b[:, 6:])
    return _mul(q.to(torch.int8) - 16, d, dtype)


def _q5_1(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d, m = _half(b[:, :2]), _half(b[:, 2:4])
    scaled = d * _five_bit(b[:, 4:8], b[:, 8:])
    return torch.add(scaled, m, out=_out(scaled, dtype))


def _q2_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _half(b[:, 80:82]), _half(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _unpack_shifts(qs, (0, 2, 4, 6), 3, 32).reshape(n, 16, 16)
    scaled = dl * q
    return torch.sub(scaled, ml, out=_out(scaled, dtype)).reshape(n, _QK_K)


def _q3_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _half(b[:, 108:110])
    # 16 6-bit scales: low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11.
    low = _unpack_shifts(packed[:, :8], (0, 4), 0x0F, 8).reshape(n, 16)
    high = _unpack_shifts(packed[:, 8:], (0, 2, 4, 6), 0x03, 4).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 16, 1)
    ql = _unpack_shifts(qs, (0, 2, 4, 6), 3, 32).reshape(n, 16, 16)
    qh = _unpack_shifts(hmask, tuple(range(8)), 1, 32).reshape(n, 16, 16) ^ 1
    q = ql.to(torch.int8) - (qh << 2).to(torch.int8)
    return _mul(dl, q, dtype).reshape(n, _QK_K)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 6-bit scales and 8 6-bit mins from 12 bytes: ``([n, 8], [n, 8])``."""
    n = packed.shape[0]
    p = packed.reshape(n, 3, 4)
    d, m, md = p[:, 0], p[:, 1], p[:, 2]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    minimum = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scale, minimum


def _k_affine(b: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q4_K/Q5_K: ``d * scale * q - dmin * min`` per 32-element sub-block."""
    n = b.shape[0]
    d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    scaled = scale * q
    return torch.sub(scaled, offset, out=_out(scaled, dtype)).reshape(n, _QK_K)


def _q4_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = _unpack_shifts(b[:, 16:], (0, 4), 0x0F, 32).reshape(b.shape[0], 8, 32)
    return _k_affine(b, q, dtype)


def _q5_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    ql = _unpack_shifts(b[:, 48:], (0, 4), 0x0F, 32).reshape(n, 8, 32)
    qh = _unpack_shifts(b[:, 16:48], tuple(range(8)), 1, 32).reshape(n, 8, 32)
    return _k_affine(b, ql | (qh << 4), dtype)


def _q6_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _half(b[:, 208:210])
    scale = (d * scales.contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = _unpack_shifts(ql, (0, 4), 0x0F, 64).reshape(n, 4, 64).reshape(n, -1, 32)
    high = _unpack_shifts(qh, (0, 2, 4, 6), 0x03, 32).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    return _mul(scale, q, dtype).reshape(n, _QK_K)


_DECODERS: dict[str, Any] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize_gguf(raw: torch.Tensor, kind: int | str | GGUFQuantType,
                    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """Decode GGUF quantized bytes into a float tensor of ``shape``, on ``raw``'s device.

    Args:
        raw: the tensor's bytes, ``uint8`` of any shape holding ``numel(shape) / block_size``
            whole blocks (``[rows, row_bytes]`` as :class:`GGUFLinear` keeps them).
        kind: the GGML type (id, name or :class:`GGUFQuantType`).
        shape: the decoded tensor's shape (torch order: the last dimension is the blocked one).
        dtype: output dtype (decoding runs in float32, then casts; default float32).

    Returns:
        The tensor, ``shape``, ``dtype``.

    Raises:
        QuantizationError: unknown or undecoded type, a byte count that does not match
            ``shape``, or a last dimension that is not a whole number of blocks.
    """
    qtype = gguf_quant_type(kind)
    if raw.dtype != torch.uint8:
        raise QuantizationError(f"GGUF bytes must be a uint8 tensor, got {raw.dtype}",
                                hint="Pass the tensor's raw bytes (tensor.view(torch.uint8)).")
    cols = shape[-1] if len(shape) else 1
    numel = math.prod(shape)
    if cols % qtype.block_size:
        raise QuantizationError(f"a {qtype.name} tensor's rows must be whole blocks of "
                                f"{qtype.block_size}, got shape {list(shape)}",
                                hint="The shape does not belong to these bytes; read it from "
                                     "the GGUF tensor record.")
    blocks = numel // qtype.block_size
    if raw.numel() != blocks * qtype.type_size:
        raise QuantizationError(f"{qtype.name} shape {list(shape)} needs {blocks * qtype.type_size}"
                                f" bytes, got {raw.numel()}",
                                hint="The bytes are truncated or belong to another tensor.")
    return _decode(raw, qtype, shape, dtype)


def _decode(raw: torch.Tensor, qtype: GGUFQuantType, shape: torch.Size | tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_gguf` without its checks: for callers whose bytes were checked once
    (:class:`GGUFLinear` at construction: a swapper repoints the buffer, never reshapes it),
    so a layer's call costs the decoder's few launches and little Python around them."""
    blocks = raw.numel() // qtype.type_size
    if qtype.name == "Q8_0" and raw.is_cuda and _triton_decodes(raw.device):
        from vramkit.quant._gguf_triton import decode_q8_0  # imports triton: CUDA only

        decoded = decode_q8_0(raw, dtype)
        if decoded is not None:
            return decoded.reshape(shape)
    return _DECODERS[qtype.name](raw.reshape(blocks, qtype.type_size), dtype).reshape(shape)


def _triton_decodes(device: torch.device) -> bool:
    """Whether Q8_0 takes the Triton decoder here: CUDA with triton, outside torch.compile
    (compiled graphs trace the torch decoder, which inductor fuses on its own)."""
    return not torch.compiler.is_compiling() and triton_available(device)


# -- the layer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFWeight:
    """A :class:`GGUFLinear`'s weight as a record over its current packed bytes (what adapter
    wrappers read as ``base.weight``: ``device``, ``dtype``, ``shape``)."""

    packed: torch.Tensor
    qtype: GGUFQuantType
    shape: torch.Size
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        """Where the packed bytes are."""
        return self.packed.device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision weight (a new tensor on :attr:`device`)."""
        return dequantize_gguf(self.packed, self.qtype, self.shape,
                               self.dtype if dtype is None else dtype)


class _GGUFLinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` with W decoded from packed bytes; backward decodes them again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, qtype: GGUFQuantType,
                shape: torch.Size, packed: torch.Tensor) -> torch.Tensor:
        weight = _decode(packed, qtype, shape, x.dtype)
        ctx.qtype, ctx.shape = qtype, shape
        if ctx.needs_input_grad[0]:
            # The packed bytes, never the decoded weight: inside a BlockSwapper they lie in a
            # slot, and its saved-tensor hooks turn them into handles re-read in backward.
            ctx.save_for_backward(packed)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            (packed,) = ctx.saved_tensors
            grad_x = grad_out @ _decode(packed, ctx.qtype, ctx.shape, grad_out.dtype)
        if ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, ctx.shape[0]).sum(0)
        return grad_x, grad_bias, None, None, None


class GGUFLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight stays in its GGUF quantized bytes.

    The bytes are a buffer (``weight_packed``, ``uint8 [out_features, row_bytes]``): they are
    what ``.to()``, ``state_dict`` and a :class:`~vramkit.offload.swap.BlockSwapper` move, and
    the weight is decoded on their device at every call (:func:`dequantize_gguf`). Backward
    gives the input gradient from the saved packed bytes (and the bias gradient when the bias
    requires grad); the weight gets none, so LoRA adapters (vramkit's ``LoRALinear``, peft)
    train on top of it.

    Args:
        packed: the weight's bytes, ``uint8`` ``[out_features, row_bytes]`` (or flat).
        kind: the GGML type (id, name or :class:`GGUFQuantType`).
        in_features: input features (a multiple of the type's block size).
        out_features: output features.
        bias: optional bias ``[out_features]`` (a ``Parameter`` is kept as is).
        dtype: the dtype the weight is decoded to outside autocast when the input has none of
            its own; follows ``.to(dtype)`` (default bfloat16). The input's dtype (or
            autocast's) decides the matmul's.

    Raises:
        QuantizationError: unknown type, or bytes that do not match the features.
    """

    def __init__(self, packed: torch.Tensor, kind: int | str | GGUFQuantType, in_features: int,
                 out_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.qtype = gguf_quant_type(kind)
        self.in_features, self.out_features = int(in_features), int(out_features)
        shape = torch.Size((self.out_features, self.in_features))
        if in_features % self.qtype.block_size:
            raise QuantizationError(f"in_features {in_features} is not a whole number of "
                                    f"{self.qtype.name} blocks of {self.qtype.block_size}",
                                    hint="GGUF blocks run along the input dimension.")
        row_bytes = self.qtype.row_bytes(self.in_features)
        if packed.dtype != torch.uint8 or packed.numel() != self.out_features * row_bytes:
            raise QuantizationError(f"{self.qtype.name} weight [{out_features}, {in_features}] "
                                    f"needs {self.out_features * row_bytes} uint8 bytes, got "
                                    f"{packed.numel()} {packed.dtype}",
                                    hint="Pass the tensor's bytes as read from the GGUF file.")
        self._shape = shape
        self._dtype = dtype
        self.register_buffer("weight_packed", packed.detach().reshape(self.out_features,
                                                                      row_bytes))
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise QuantizationError(f"bias shape {list(bias.shape)} does not match the "
                                    f"{out_features} outputs",
                                    hint="Pass a bias of shape [out_features], or None.")
        if bias is None or isinstance(bias, nn.Parameter):
            self.bias: nn.Parameter | None = bias
        else:
            self.bias = nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)

    @property
    def weight(self) -> GGUFWeight:
        """The packed weight as a :class:`GGUFWeight` (cheap: nothing is copied)."""
        return GGUFWeight(self._buffers["weight_packed"], self.qtype,  # type: ignore[arg-type]
                          self._shape, self._dtype)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the packed weight."""
        return self._buffers["weight_packed"].numel()  # type: ignore[union-attr]

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A full-precision copy of the weight (default dtype: the layer's)."""
        return self.weight.dequantize(dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # .to(dtype) must not cast the packed bytes; the recorded dtype follows the cast.
        apply = super()._apply
        apply_device_only(self, ("weight_packed",), fn, lambda: apply(fn, recurse))
        probe = fn(torch.empty(0, dtype=self._dtype))
        if probe.dtype != self._dtype and probe.dtype.is_floating_point:
            self._dtype = probe.dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]``."""
        if not x.is_floating_point():
            raise QuantizationError(f"GGUFLinear needs a floating-point input, got {x.dtype}",
                                    hint="Cast the input to a floating dtype first.")
        if x.shape[-1] != self.in_features:
            raise QuantizationError(f"activations end in {x.shape[-1]} features, the weight "
                                    f"takes {self.in_features}",
                                    hint="Give x a last dimension of the layer's in_features.")
        kind = x.device.type
        if kind != "meta" and torch.is_autocast_enabled(kind):  # (meta: no autocast state)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        # Read at every call: a BlockSwapper repoints the buffer between slots.
        return _GGUFLinearFunction.apply(x, bias, self.qtype, self._shape,
                                         self._buffers["weight_packed"])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, type={self.qtype.name}")
