"""Block-wise quantization of optimizer states with non-linear code books.

A state tensor is flattened, padded to whole blocks of ``block_size`` elements and stored as one
code per element (a ``uint8``; two 4-bit codes per byte for ``bits=4``) plus one fp32 *absmax* per
block. A code indexes a sorted table of levels in ``[-1, 1]`` (:class:`CodeBook`); the value is
``level[code] * absmax[block]``. Scaling per block keeps one outlier from flattening a whole
tensor's resolution, and the non-linear levels keep small values alive:

* **First moment** (signed, zero allowed): a *dynamic decade* book. Each decade
  ``(10^-(j+1), 10^-j]`` below the block's absmax gets half as many levels as the one above it
  (8 bits: 64, 32, ..., 1 levels over 7 decades), so the relative error stays bounded across six
  orders of magnitude instead of flushing everything below ``absmax / 127`` to zero as a linear
  int8 code would. With 4 bits there are too few levels for decades: linear levels ``k / 7``.
* **Second moment**: the optimizer stores ``r = sqrt(v)``, which halves the dynamic range in
  log space, with an *unsigned book without zero*: a positive ``v`` is never rounded to 0, which
  would turn ``m / (sqrt(v) + eps)`` into ``m / eps``. Rounding a tiny ``r`` up to the book's
  smallest level can only shrink that element's update. 8 bits: the decade rule over 8 decades plus
  ``1e-8``; 4 bits: the linear levels ``k / 16`` (``v`` down to ``absmax^2 / 256``), as
  recommended for 4-bit second moments by Li et al., "Memory Efficient Optimizers with 4-bit
  States" (2023).

Rounding is to the nearest level (``torch.bucketize`` on the midpoints between levels), all in
vectorised torch ops that run unchanged on the CPU and on CUDA. Books are built once per
``(kind, bits, device)`` and cached, so a step copies no table to the GPU.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

__all__ = [
    "CodeBook",
    "codebook",
    "dequantize_blockwise",
    "pack_nibbles",
    "padded_numel",
    "quantize_blockwise",
    "unpack_nibbles",
]

logger = logging.getLogger(__name__)

SIGNED = "signed"  # first moment
UNSIGNED_NONZERO = "unsigned_nonzero"  # square root of the second moment
_KINDS = (SIGNED, UNSIGNED_NONZERO)
_SUPPORTED_BITS = (4, 8)
# Guards the division by a block's absmax: an all-zero block quantizes to the zero code (signed)
# or to the smallest level times 0 (unsigned), and dequantizes to exact zeros either way.
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class CodeBook:
    """A sorted table of quantization levels and the midpoints used to round to them.

    Attributes:
        kind: ``"signed"`` (levels in [-1, 1], zero included) or ``"unsigned_nonzero"`` (levels in
            (0, 1], zero excluded).
        bits: bits per code (4 or 8); ``len(levels) <= 2**bits``.
        levels: float32, sorted ascending, on ``levels.device``; the largest magnitude is 1.
        midpoints: float32, ``(levels[i] + levels[i+1]) / 2``; ``bucketize`` against them gives
            the index of the nearest level.
    """

    kind: str
    bits: int
    levels: torch.Tensor
    midpoints: torch.Tensor


def _decade_levels(decades: int, top_count: int) -> list[float]:
    """Positive levels: decade j (0 = top) holds ``top_count >> j`` evenly spaced levels ending at
    ``10^-j`` (so every decade's top is exact and consecutive decades join without a gap)."""
    levels: list[float] = []
    for j in range(decades):
        count = top_count >> j
        if count == 0:
            break
        scale = 10.0 ** (-j)
        levels.extend(scale * (0.1 + 0.9 * k / count) for k in range(1, count + 1))
    return levels


def _build_levels(kind: str, bits: int) -> list[float]:
    if kind == SIGNED:
        if bits == 8:
            positive = _decade_levels(7, 64)  # 127 levels from 1e-6 to 1
        else:
            # With 7 magnitudes, linear levels gave the lowest final loss in our trials (quadratic
            # and decade spreads leave m stuck on coarse levels near the top of a block).
            positive = [k / 7.0 for k in range(1, 8)]
        return sorted([-x for x in positive] + [0.0] + positive)
    if kind == UNSIGNED_NONZERO:
        if bits == 8:
            return sorted([*_decade_levels(8, 128), 1e-8])  # 256 levels from 1e-8 to 1
        return [k / 16.0 for k in range(1, 17)]
    raise ValueError(f"unknown code book kind {kind!r}; expected one of {_KINDS}")


_CACHE: dict[tuple[str, int, str], CodeBook] = {}
_CACHE_LOCK = threading.Lock()  # the offload optimizer steps on a worker thread


def codebook(kind: str, bits: int, device: torch.device | str = "cpu") -> CodeBook:
    """The code book of ``kind`` with ``bits`` bits, on ``device`` (built once, then cached).

    Args:
        kind: ``"signed"`` (first moment) or ``"unsigned_nonzero"`` (square root of the second).
        bits: 4 or 8.
        device: where the tables live (default CPU).

    Returns:
        The :class:`CodeBook`.

    Raises:
        ValueError: for an unknown kind or an unsupported bit width.
    """
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {_SUPPORTED_BITS}, got {bits!r}")
    device = torch.device(device)
    key = (kind, bits, str(device))
    book = _CACHE.get(key)
    if book is not None:
        return book
    with _CACHE_LOCK:
        book = _CACHE.get(key)
        if book is None:
            levels = torch.tensor(_build_levels(kind, bits), dtype=torch.float32)
            midpoints = (levels[1:] + levels[:-1]) / 2
            book = CodeBook(kind, bits, levels.to(device), midpoints.to(device))
            _CACHE[key] = book
    return book


def padded_numel(numel: int, block_size: int) -> int:
    """``numel`` rounded up to whole blocks of ``block_size``."""
    return -(-numel // block_size) * block_size


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high one.

    Args:
        codes: ``uint8`` codes < 16, an even number of them.

    Returns:
        A ``uint8`` tensor of half the length.
    """
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: a ``uint8`` tensor of twice the length."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(-1)


def quantize_blockwise(values: torch.Tensor, book: CodeBook, codes_out: torch.Tensor,
                       absmax_out: torch.Tensor) -> None:
    """Quantize ``values`` block by block into ``codes_out`` and ``absmax_out`` (in place).

    Args:
        values: float32, shape ``[blocks, block_size]`` (padding included); not modified.
        book: the code book (on ``values.device``).
        codes_out: ``uint8``, ``blocks * block_size`` codes (half that for 4 bits), written.
        absmax_out: float32, ``[blocks]``, written with each block's largest magnitude.
    """
    absmax = values.abs().amax(dim=1)
    absmax_out.copy_(absmax)
    normalized = values / absmax.clamp_min(_TINY).unsqueeze(1)
    # Nearest level; out_int32 halves the temporary index's bytes.
    codes = torch.bucketize(normalized, book.midpoints, out_int32=True).to(torch.uint8)
    codes = codes.view(-1)
    codes_out.copy_(pack_nibbles(codes) if book.bits == 4 else codes)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, book: CodeBook,
                         block_size: int) -> torch.Tensor:
    """Float32 values ``[blocks, block_size]`` from codes and per-block absmax.

    Args:
        codes: ``uint8`` codes as written by :func:`quantize_blockwise`.
        absmax: float32 ``[blocks]``.
        book: the code book they were quantized with (on ``codes.device``).
        block_size: elements per block.

    Returns:
        A new float32 tensor of shape ``[blocks, block_size]``.
    """
    if book.bits == 4:
        codes = unpack_nibbles(codes)
    # uint8 would index as a boolean mask: widen to int32 (the cheapest integer index).
    levels = book.levels[codes.to(torch.int32)]
    return levels.view(-1, block_size).mul_(absmax.unsqueeze(1))
