"""Code books and block-wise quantization of optimizer states (CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vramkit.optim._blockwise import (
    SIGNED,
    UNSIGNED_NONZERO,
    codebook,
    dequantize_blockwise,
    pack_nibbles,
    padded_numel,
    quantize_blockwise,
    unpack_nibbles,
)


def roundtrip(values: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    book = codebook(kind, bits)
    blocks, block_size = values.shape
    codes = torch.empty(blocks * block_size * bits // 8, dtype=torch.uint8)
    absmax = torch.empty(blocks)
    quantize_blockwise(values, book, codes, absmax)
    return dequantize_blockwise(codes, absmax, book, block_size)


@pytest.mark.parametrize(("kind", "bits", "count"), [(SIGNED, 8, 255), (SIGNED, 4, 15),
                                                     (UNSIGNED_NONZERO, 8, 256),
                                                     (UNSIGNED_NONZERO, 4, 16)])
def test_books_are_sorted_fit_their_bits_and_end_at_one(kind: str, bits: int, count: int) -> None:
    levels = codebook(kind, bits).levels
    assert levels.numel() == count <= 2**bits
    assert torch.all(levels[1:] > levels[:-1])
    assert levels[-1] == 1.0
    if kind == SIGNED:
        assert levels[0] == -1.0 and 0.0 in levels.tolist()
    else:
        assert levels[0] > 0  # a positive second moment never rounds to zero


def test_signed_8bit_book_resolves_six_decades() -> None:
    # Relative error stays bounded far below absmax / 127, where linear int8 would give zero.
    x = torch.tensor([[1.0, 3e-3, -2e-4, 5e-5, -7e-6] + [0.0] * 11])
    y = roundtrip(x, SIGNED, 8)
    rel = ((y - x).abs() / x.abs().clamp_min(1e-30))[0, :5]
    assert torch.all(rel < 0.3), rel
    linear = torch.round(x * 127) / 127
    assert torch.all(linear[0, 2:5] == 0)  # what a linear code loses


def test_gaussian_error_bounds() -> None:
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    err8 = (roundtrip(x, SIGNED, 8) - x).norm() / x.norm()
    err4 = (roundtrip(x, SIGNED, 4) - x).norm() / x.norm()
    assert err8 < 0.015 and err4 < 0.15
    r = x.abs()
    err8 = (roundtrip(r, UNSIGNED_NONZERO, 8) - r).norm() / r.norm()
    assert err8 < 0.01


def test_unsigned_book_never_rounds_positive_to_zero() -> None:
    r = torch.tensor([[1.0, 1e-9, 1e-12, 3e-5]])
    assert torch.all(roundtrip(r, UNSIGNED_NONZERO, 8) > 0)
    assert torch.all(roundtrip(r, UNSIGNED_NONZERO, 4) > 0)


def test_zero_block_roundtrips_to_exact_zeros() -> None:
    zeros = torch.zeros(2, 8)
    for kind in (SIGNED, UNSIGNED_NONZERO):
        for bits in (4, 8):
            assert torch.equal(roundtrip(zeros, kind, bits), zeros)


def test_blocks_are_scaled_independently() -> None:
    # An outlier only coarsens its own block.
    x = torch.full((2, 4), 1e-3)
    x[0, 0] = 1e3
    y = roundtrip(x, SIGNED, 8)
    torch.testing.assert_close(y[1], x[1], rtol=1e-6, atol=0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300).map(lambda k: 2 * k))
def test_nibble_packing_roundtrips(n: int) -> None:
    codes = torch.randint(0, 16, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(n))
    packed = pack_nibbles(codes)
    assert packed.numel() == n // 2
    assert torch.equal(unpack_nibbles(packed), codes)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 5000), block_size=st.sampled_from([2, 6, 64, 256]))
def test_padded_numel(numel: int, block_size: int) -> None:
    padded = padded_numel(numel, block_size)
    assert padded % block_size == 0 and numel <= padded < numel + block_size


def test_bad_book_requests() -> None:
    with pytest.raises(ValueError):
        codebook(SIGNED, 3)
    with pytest.raises(ValueError):
        codebook("linear", 8)
