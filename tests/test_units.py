from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramkit.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("24 GiB", 24 * 1024**3),
        ("24G", 24 * 1024**3),
        ("1.5 GB", 1_500_000_000),
        ("512MiB", 512 * 1024**2),
        ("4096", 4096),
        ("4096B", 4096),
        ("1kB", 1000),
        ("1KiB", 1024),
        ("0.5KiB", 512),
        ("2TiB", 2 * 1024**4),
        ("  8 mib ", 8 * 1024**2),
        (4096, 4096),
        (0, 0),
        (1024.0, 1024),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    ["", "GiB", "12 parsecs", "-1GiB", "1.2.3G", "1e400GB", "0.3B", "nan", "inf GB", -5, 1.5,
     True, None, [1]],
)
def test_parse_size_rejects_bad_input(bad: object) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)  # type: ignore[arg-type]


def test_large_integer_sizes_are_exact() -> None:
    assert parse_size("123456789012345678901") == 123456789012345678901


def test_format_size() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(24 * 1024**3) == "24.0 GiB"
    assert format_size(1_500_000_000, binary=False) == "1.5 GB"
    assert format_size(-2048) == "-2.0 KiB"
    assert format_size(3 * 1024**6) == "3072.0 PiB"
    with pytest.raises(ValueError):
        format_size(float("nan"))
    with pytest.raises(ValueError):
        format_size("12")  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=2**60))
def test_format_then_parse_is_close(n: int) -> None:
    parsed = parse_size(format_size(n, precision=6))
    assert abs(parsed - n) <= max(1, n * 1e-6)


def test_fractions_of_scaled_units_round_to_bytes() -> None:
    assert parse_size("1.3 GiB") == round(1.3 * 1024**3)
