"""CPU tests of vramkit.compress.huffman: length limits, prefix codes, tables."""

from __future__ import annotations

import torch

from vramkit.compress.huffman import (
    MAX_CODE_BITS,
    canonical_codes,
    code_lengths,
    decode_table,
    entropy_bits,
    kraft_sum,
    single_symbol_table,
)


def test_lengths_follow_frequencies_and_form_a_prefix_code() -> None:
    counts = [0] * 256
    for s, c in enumerate([1000, 500, 250, 125, 60, 30, 20, 10]):
        counts[s + 100] = c
    lengths = code_lengths(counts)
    assert kraft_sum(lengths) <= 1.0
    assert lengths[100] == 1 and lengths[101] == 2
    assert all(lengths[s] == 0 for s in range(256) if counts[s] == 0)


def test_a_skewed_histogram_is_cut_to_the_length_limit() -> None:
    # Fibonacci counts make plain Huffman codes as long as there are symbols
    counts = [0] * 256
    a, b = 1, 1
    for s in range(30):
        counts[s] = a
        a, b = b, a + b
    lengths = code_lengths(counts)
    assert max(lengths) == MAX_CODE_BITS
    assert kraft_sum(lengths) <= 1.0
    assert all(lengths[s] > 0 for s in range(30))


def test_one_symbol_costs_no_bits_and_its_table_decodes_it_everywhere() -> None:
    counts = [0] * 256
    counts[127] = 99
    assert code_lengths(counts) == [0] * 256
    table = single_symbol_table(127)
    assert torch.all(table == 127)  # symbol 127, length 0


def test_table_entries_decode_each_code() -> None:
    counts = [0] * 256
    counts[3], counts[7], counts[9] = 5, 3, 2
    lengths = code_lengths(counts)
    codes = canonical_codes(lengths)
    table = decode_table(lengths)
    for s in (3, 7, 9):
        n = lengths[s]
        entry = int(table[codes[s] << (MAX_CODE_BITS - n)])
        assert entry & 0xFF == s and entry >> 8 == n


def test_entropy() -> None:
    assert entropy_bits(torch.tensor([5, 5, 0, 0])) == 1.0
    assert entropy_bits(torch.tensor([7])) == 0.0
    assert entropy_bits(torch.zeros(4, dtype=torch.int64)) == 0.0
