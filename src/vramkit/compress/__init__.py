"""Lossless compression of weights, decoded on the GPU.

Weights in bfloat16 spend 8 bits on an exponent that takes a few dozen values (2.6-3 bits of
entropy in trained weights). Coding the exponents (canonical Huffman, codes of at most 12 bits)
and keeping sign and mantissa as they are gives about 0.67-0.70x the bytes, bit for bit; int8 and
fp8 storage has its whole byte coded. Copies that are bound by the host link then move fewer
bytes, and a GPU kernel decodes them into place (``vramkit.offload.swap``, ``SwapConfig.compress``).

``format`` holds the layout (:class:`Compressed`, :class:`Region`, the header and checks),
``huffman`` the codes, ``encoder`` the encoder (torch, on any device), ``decoder`` the reference
decoder and the dispatch to the Triton kernel (``_triton``, imported only on a CUDA decode).
Every public name is re-exported here lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".format": ("FORMAT_VERSION", "LANES", "STEPS", "Compressed", "Header", "Region",
                "check_crc", "payload_crc"),
    ".huffman": ("MAX_CODE_BITS", "canonical_codes", "code_lengths", "coded_bits",
                 "decode_table", "entropy_bits", "kraft_sum", "single_symbol_table"),
    ".encoder": ("Allocator", "byte_kind", "encode", "encode_tensor", "fill_regions",
                "symbol_histogram"),
    ".decoder": ("check_flag", "decode", "decode_into", "decode_reference", "new_flag",
                "triton_decoder_available"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.compress.decoder import *  # noqa: F403
    from vramkit.compress.encoder import *  # noqa: F403
    from vramkit.compress.format import *  # noqa: F403
    from vramkit.compress.huffman import *  # noqa: F403
