"""The Triton decoder of GGUF Q8_0 weights on CUDA (imported only when a Q8_0 weight is first
decoded on a CUDA device with triton installed; every other case keeps the torch decoders of
:mod:`vramkit.quant.gguf`).

A Q8_0 block is 34 bytes: a little-endian fp16 scale ``d`` and 32 int8 codes ``q``; the weight is
``q * d`` computed in fp32 and rounded once to the output dtype, the torch decoder's arithmetic,
so both give the same bits. The torch decoder is two kernels over strided bytes (the scales to
fp32, then the codes times them, one byte per load); this one reads each block as 17 aligned
half-words (34 = 2 x 17: the scale, then 16 pairs of codes), splits each pair by sign-extending
shifts and writes the block's 32 outputs contiguously, in one launch
(``benchmarks/gguf_decode.py`` times both and diffusers' torch decoder on the same weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vramkit._gguf_types import gguf_quant_type
from vramkit.quant._triton import _Replay

__all__ = ["decode_q8_0"]

_Q8_0 = gguf_quant_type("Q8_0")  # the file format's table: 32 codes in 34 bytes
_WORDS = _Q8_0.type_size // 2  # half-words per block: the scale and 16 code pairs
# Blocks per program (64 blocks = 2,048 outputs) and warps.
_BLOCK_B = 64
_WARPS = 4


@triton.jit
def _q8_0_kernel(words_ptr, out_ptr, n_blocks, BLOCK_B: tl.constexpr, WORDS: tl.constexpr):
    blocks = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    ok = blocks < n_blocks
    first = blocks * WORDS
    scale = tl.load(words_ptr + first, mask=ok, other=0).to(tl.float16, bitcast=True)
    pairs = tl.arange(0, 16)
    w = tl.load(words_ptr + first[:, None] + 1 + pairs[None, :], mask=ok[:, None], other=0)
    low = ((w << 8) >> 8).to(tl.float32)  # arithmetic shifts of int16: the signed low byte
    high = (w >> 8).to(tl.float32)  # the signed high byte
    codes = tl.reshape(tl.join(low, high), (BLOCK_B, 32))  # byte 2k, then 2k + 1
    values = codes * scale.to(tl.float32)[:, None]
    cols = tl.arange(0, 32)
    tl.store(out_ptr + blocks[:, None] * 32 + cols[None, :],
             values.to(out_ptr.dtype.element_ty), mask=ok[:, None])


_LAUNCH = _Replay(_q8_0_kernel, _WARPS)


def decode_q8_0(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Q8_0 bytes on a CUDA device -> ``[blocks, 32]`` in ``dtype``, or None where the bytes
    cannot be read as half-words in place (not contiguous, or at an odd address): the caller
    then decodes with torch.

    Args:
        raw: ``uint8`` bytes of whole blocks (any shape).
        dtype: the output's floating dtype.
    """
    if not raw.is_contiguous() or raw.data_ptr() % 2:
        return None
    blocks = raw.numel() // _Q8_0.type_size
    words = raw.reshape(-1).view(torch.int16)
    out = torch.empty((blocks, _Q8_0.block_size), dtype=dtype, device=raw.device)
    if blocks == 0:
        return out
    grid = (triton.cdiv(blocks, _BLOCK_B), 1, 1)
    # What Triton specializes on besides the constants: the device, the output dtype, the
    # integer argument (== 1, % 16) and each pointer's 16-byte alignment.
    key = (raw.device.index, dtype, blocks == 1, blocks % 16 == 0, words.data_ptr() % 16 == 0)
    _LAUNCH(grid, key, {"words_ptr": words, "out_ptr": out, "n_blocks": blocks,
                        "BLOCK_B": _BLOCK_B, "WORDS": _WORDS})
    return out
