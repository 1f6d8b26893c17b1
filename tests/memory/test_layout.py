"""Access-pattern analysis and alignment: examples and hypothesis properties."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vramkit.errors import ConfigError
from vramkit.memory.layout import (
    Random,
    Sequential,
    Strided,
    align_up,
    aligned_offsets,
    analyze_access_pattern,
    calculate_alignment,
)

indices = st.lists(st.integers(min_value=0, max_value=10**9), max_size=60)


# ---------------------------------------------------------------------------- access patterns


@pytest.mark.parametrize("values, expected", [
    ([], Sequential()), ([7], Sequential()), ([0, 1, 2, 3, 4], Sequential()),
    ([5, 6], Sequential()), ([0, 4, 8, 12], Strided(4)), ([9, 6, 3, 0], Strided(-3)),
    ([2, 2, 2], Strided(0)), ([0, 1, 3], Random()), ([3, 1, 4, 1, 5], Random()),
    (range(10, 20), Sequential()), (range(0, 100, 8), Strided(8)), (range(3), Sequential()),
    (range(5, 6, 4), Sequential()),
])
def test_examples(values: list[int], expected: object) -> None:
    assert analyze_access_pattern(values) == expected


def test_numpy_arrays_and_generators() -> None:
    assert analyze_access_pattern(np.arange(0, 64, 2)) == Strided(2)
    assert analyze_access_pattern(i * i for i in range(5)) == Random()


@pytest.mark.parametrize("values", [[0, -1], [1.5, 2.5], [True, False], ["a"], range(-4, 4)])
def test_invalid_indices_are_config_errors(values: object) -> None:
    with pytest.raises(ConfigError):
        analyze_access_pattern(values)  # type: ignore[arg-type]


def test_a_late_invalid_index_is_still_found() -> None:
    with pytest.raises(ConfigError):
        analyze_access_pattern([0, 5, 1, -2])


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 10**6), step=st.integers(-50, 50), count=st.integers(2, 60))
def test_arithmetic_progressions_are_sequential_or_strided(start: int, step: int,
                                                           count: int) -> None:
    assume(start + step * (count - 1) >= 0)
    values = [start + step * i for i in range(count)]
    expected = Sequential() if step == 1 else Strided(step)
    assert analyze_access_pattern(values) == expected
    assert analyze_access_pattern(range(start, start + step * count, step) if step else
                                  values) == expected


@settings(max_examples=300, deadline=None)
@given(values=indices)
def test_classification_matches_the_definition(values: list[int]) -> None:
    steps = {b - a for a, b in itertools.pairwise(values)}
    pattern = analyze_access_pattern(values)
    if len(values) < 2 or steps == {1}:
        assert pattern == Sequential()
    elif len(steps) == 1:
        assert pattern == Strided(steps.pop())
    else:
        assert pattern == Random()


@settings(max_examples=200, deadline=None)
@given(values=indices, shift=st.integers(0, 10**6))
def test_translation_does_not_change_the_pattern(values: list[int], shift: int) -> None:
    assert analyze_access_pattern(values) == analyze_access_pattern([v + shift for v in values])


# ---------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("nbytes, expected", [
    (0, 16), (1, 16), (4, 16), (16, 16), (17, 32), (100, 128), (128, 128), (129, 256),
    (1024, 256), (64 * 1024, 256), (1 << 40, 256),
])
def test_alignment_examples(nbytes: int, expected: int) -> None:
    assert calculate_alignment(nbytes) == expected


@pytest.mark.parametrize("nbytes", [-1, 1.0, True, "4"])
def test_alignment_rejects_bad_sizes(nbytes: object) -> None:
    with pytest.raises(ConfigError):
        calculate_alignment(nbytes)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(a=st.integers(0, 1 << 42), b=st.integers(0, 1 << 42))
def test_alignment_properties(a: int, b: int) -> None:
    align = calculate_alignment(a)
    assert align & (align - 1) == 0  # a power of two
    assert 16 <= align <= 256
    assert align <= max(16, 1 << max(0, (a - 1).bit_length()))  # no more than the size needs
    if a >= 256:
        assert align == 256
    low, high = sorted((a, b))
    assert calculate_alignment(low) <= calculate_alignment(high)  # monotone


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(0, 1 << 40), power=st.integers(0, 12))
def test_align_up_properties(offset: int, power: int) -> None:
    alignment = 1 << power
    aligned = align_up(offset, alignment)
    assert aligned % alignment == 0
    assert offset <= aligned < offset + alignment


@pytest.mark.parametrize("offset, alignment", [(-1, 16), (0, 0), (0, 24)])
def test_align_up_rejects_bad_arguments(offset: int, alignment: int) -> None:
    with pytest.raises(ConfigError):
        align_up(offset, alignment)


def test_aligned_offsets_example() -> None:
    offsets, total = aligned_offsets([4, 1000, 3, 300])
    assert offsets == (0, 256, 1264, 1280)
    assert total == 1792


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 1 << 20), max_size=30))
def test_aligned_offsets_properties(sizes: list[int]) -> None:
    offsets, total = aligned_offsets(sizes)
    assert len(offsets) == len(sizes)
    end = 0
    for offset, size in zip(offsets, sizes, strict=True):
        assert offset % calculate_alignment(size) == 0
        assert offset >= end  # in order, no overlap
        end = offset + size
    assert total >= end and total % 256 == 0
    # The padding per buffer is less than its alignment: the layout is tight.
    assert end <= sum(sizes) + sum(calculate_alignment(s) - 1 for s in sizes)
