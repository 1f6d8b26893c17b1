"""The GGML tensor types of GGUF files: ids, names and block geometry (no torch).

On the bottom floor, beside the errors: :mod:`vramkit.quant.gguf` (the torch decoders) and
:mod:`vramkit.io` (reading GGUF headers, ``vramkit inspect``, which imports neither torch nor
``vramkit.quant``) both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramkit.errors import QuantizationError

__all__ = ["GGUF_FLOAT_TYPES", "GGUF_QUANT_TYPES", "GGUFQuantType", "gguf_quant_type"]

_QK_K = 256  # elements of a "K-quant" super-block

#: The unquantized GGML types: id -> (name, bytes per element, safetensors dtype code).
GGUF_FLOAT_TYPES: dict[int, tuple[str, int, str]] = {
    0: ("F32", 4, "F32"), 1: ("F16", 2, "F16"), 30: ("BF16", 2, "BF16"),
    24: ("I8", 1, "I8"), 25: ("I16", 2, "I16"), 26: ("I32", 4, "I32"), 27: ("I64", 8, "I64"),
    28: ("F64", 8, "F64"),
}


@dataclass(frozen=True)
class GGUFQuantType:
    """One GGML tensor type: its id in the file, name and block geometry.

    Args:
        type_id: the ``ggml_type`` value stored in a GGUF tensor record.
        name: ``"Q8_0"``, ``"Q4_K"``, ...
        block_size: elements per block.
        type_size: bytes per block.
        supported: whether :func:`dequantize_gguf` can decode it.
    """

    type_id: int
    name: str
    block_size: int
    type_size: int
    supported: bool = True

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` elements (``cols`` a multiple of ``block_size``)."""
        return cols // self.block_size * self.type_size

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per element, scales included."""
        return self.type_size * 8 / self.block_size


def _q(type_id: int, name: str, block: int, size: int, supported: bool = True) -> GGUFQuantType:
    return GGUFQuantType(type_id, name, block, size, supported)


#: The quantized GGML types by id (float types F32/F16/BF16 are plain tensors, not listed).
#: ``supported=False`` types are recognised (named in errors, shown by ``vramkit inspect``) but
#: not decoded.
GGUF_QUANT_TYPES: dict[int, GGUFQuantType] = {t.type_id: t for t in (
    _q(2, "Q4_0", 32, 18), _q(3, "Q4_1", 32, 20), _q(6, "Q5_0", 32, 22), _q(7, "Q5_1", 32, 24),
    _q(8, "Q8_0", 32, 34), _q(9, "Q8_1", 32, 40, False),
    _q(10, "Q2_K", _QK_K, 84), _q(11, "Q3_K", _QK_K, 110), _q(12, "Q4_K", _QK_K, 144),
    _q(13, "Q5_K", _QK_K, 176), _q(14, "Q6_K", _QK_K, 210), _q(15, "Q8_K", _QK_K, 292, False),
    _q(16, "IQ2_XXS", _QK_K, 66, False), _q(17, "IQ2_XS", _QK_K, 74, False),
    _q(18, "IQ3_XXS", _QK_K, 98, False), _q(19, "IQ1_S", _QK_K, 50, False),
    _q(20, "IQ4_NL", 32, 18, False), _q(21, "IQ3_S", _QK_K, 110, False),
    _q(22, "IQ2_S", _QK_K, 82, False), _q(23, "IQ4_XS", _QK_K, 136, False),
    _q(29, "IQ1_M", _QK_K, 56, False), _q(34, "TQ1_0", _QK_K, 54, False),
    _q(35, "TQ2_0", _QK_K, 66, False),
)}
_BY_NAME = {t.name: t for t in GGUF_QUANT_TYPES.values()}


def gguf_quant_type(kind: int | str | GGUFQuantType) -> GGUFQuantType:
    """The :class:`GGUFQuantType` for a type id, a name (``"Q4_K"``) or a type.

    Raises:
        QuantizationError: for an unknown type, or one recognised but not decoded here.
    """
    if isinstance(kind, GGUFQuantType):
        found: GGUFQuantType | None = kind
    elif isinstance(kind, str):
        found = _BY_NAME.get(kind.upper())
    else:
        found = GGUF_QUANT_TYPES.get(int(kind))
    if found is not None and found.supported:
        return found
    supported = ", ".join(t.name for t in GGUF_QUANT_TYPES.values() if t.supported)
    if found is None:
        raise QuantizationError(f"unknown GGUF quantization type {kind!r}",
                                hint=f"Decoded here: {supported} (and F32, F16, BF16); convert "
                                     "the file to one of them.")
    if not found.supported:
        raise QuantizationError(f"GGUF quantization type {found.name} is not decoded by vramkit",
                                hint=f"Decoded here: {supported} (and F32, F16, BF16); "
                                     "re-quantize the file to one of them (e.g. Q8_0, Q4_K).")
    return found
