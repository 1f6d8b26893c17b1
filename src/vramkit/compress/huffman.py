"""Length-limited canonical Huffman codes over byte symbols, and their decode tables.

A code is 256 code lengths (0: the symbol does not occur, or it is the only symbol, which then
costs no bits at all). Lengths are limited to :data:`MAX_CODE_BITS` so one lookup of the next
``MAX_CODE_BITS`` bits in a table of ``2 ** MAX_CODE_BITS`` entries decodes a symbol: the GPU
decoder's inner step is one gather, no bit-by-bit tree walk.
"""

from __future__ import annotations

import heapq
import math

import torch

__all__ = ["MAX_CODE_BITS", "canonical_codes", "code_lengths", "coded_bits", "decode_table",
           "entropy_bits", "kraft_sum", "single_symbol_table"]

#: Longest code. 12 bits keep the table at 4096 two-byte entries (8 KiB, in the GPU's L1) and
#: cost nothing measurable on weight exponents, whose rarest symbols are a few per million.
MAX_CODE_BITS = 12


def code_lengths(counts: list[int], max_bits: int = MAX_CODE_BITS) -> list[int]:
    """Huffman code lengths for 256 symbol ``counts``, none longer than ``max_bits``.

    Symbols that do not occur get 0; a lone symbol gets 0 too (decoding it reads no bits).
    Lengths over the limit are cut to it and the Kraft sum is repaired by lengthening the
    cheapest codes, then any slack is given back to the most frequent symbols.
    """
    present = [s for s in range(256) if counts[s] > 0]
    lengths = [0] * 256
    if len(present) <= 1:
        return lengths
    # Huffman by merging: each heap item is (count, tiebreak, symbols under it)
    heap: list[tuple[int, int, list[int]]] = [(counts[s], s, [s]) for s in present]
    heapq.heapify(heap)
    tiebreak = 256
    while len(heap) > 1:
        c1, _, s1 = heapq.heappop(heap)
        c2, _, s2 = heapq.heappop(heap)
        for s in s1:
            lengths[s] += 1
        for s in s2:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, tiebreak, s1 + s2))
        tiebreak += 1
    if max(lengths) <= max_bits:
        return lengths
    for s in present:
        lengths[s] = min(lengths[s], max_bits)
    full = 1 << max_bits
    kraft = sum(1 << (max_bits - lengths[s]) for s in present)
    # Too many short codes: lengthen, longest (below the limit) and rarest first, which frees
    # the least code space per bit added.
    while kraft > full:
        s = max((s for s in present if lengths[s] < max_bits),
                key=lambda s: (lengths[s], -counts[s]))
        kraft -= 1 << (max_bits - lengths[s] - 1)
        lengths[s] += 1
    # Slack left: shorten the most frequent codes that still fit.
    for s in sorted(present, key=lambda s: -counts[s]):
        while lengths[s] > 1 and kraft + (1 << (max_bits - lengths[s])) <= full:
            kraft += 1 << (max_bits - lengths[s])
            lengths[s] -= 1
    return lengths


def canonical_codes(lengths: list[int]) -> list[int]:
    """The canonical code of each symbol (ordered by length, then symbol), MSB first."""
    codes = [0] * 256
    code = 0
    previous = 0
    for length, symbol in sorted((n, s) for s, n in enumerate(lengths) if n > 0):
        code <<= length - previous
        codes[symbol] = code
        code += 1
        previous = length
    return codes


def decode_table(lengths: list[int], max_bits: int = MAX_CODE_BITS) -> torch.Tensor:
    """The ``2 ** max_bits`` int16 lookup table: entry ``w`` (the next ``max_bits`` bits of the
    stream) holds ``symbol | length << 8``. For a code of one symbol (every length 0) use
    :func:`single_symbol_table`."""
    table = torch.zeros(1 << max_bits, dtype=torch.int16)
    codes = canonical_codes(lengths)
    for s in range(256):
        n = lengths[s]
        if n:
            lo = codes[s] << (max_bits - n)
            table[lo:lo + (1 << (max_bits - n))] = s | (n << 8)
    return table


def single_symbol_table(symbol: int, max_bits: int = MAX_CODE_BITS) -> torch.Tensor:
    """The table of a code with one symbol: every entry decodes it, reading no bits."""
    return torch.full((1 << max_bits,), symbol, dtype=torch.int16)


def entropy_bits(counts: torch.Tensor) -> float:
    """Shannon entropy in bits per symbol of a histogram (0 for an empty one)."""
    total = float(counts.sum())
    if total == 0:
        return 0.0
    p = counts.double()[counts > 0] / total
    return float(-(p * torch.log2(p)).sum()) if p.numel() > 1 else 0.0


def coded_bits(counts: list[int], lengths: list[int]) -> int:
    """Bits the symbols of ``counts`` take under ``lengths``."""
    return sum(c * n for c, n in zip(counts, lengths, strict=True))


def kraft_sum(lengths: list[int]) -> float:
    """Sum of ``2 ** -length`` over the coded symbols: <= 1 for a prefix code."""
    return math.fsum(2.0 ** -n for n in lengths if n > 0)
