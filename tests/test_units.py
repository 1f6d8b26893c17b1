from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramkit.units import MAX_SIZE_BYTES, format_size, parse_size


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
    # 2**53 + 1 has no exact float: parsed as an integer, not through float.
    assert parse_size("9007199254740993") == 9007199254740993
    assert parse_size(str(MAX_SIZE_BYTES)) == 2**63 - 1


@pytest.mark.parametrize("absurd", ["1e99GiB", "123456789012345678901", "8192PiB", "9.3e18",
                                    2**63, 1e300, "10000000 TB"])
def test_sizes_beyond_any_memory_are_refused(absurd: object) -> None:
    # Above 2**63 - 1 bytes (the largest signed 64-bit size, more than any machine addresses).
    with pytest.raises(ValueError, match=r"invalid size .*larger than any memory") as info:
        parse_size(absurd)  # type: ignore[arg-type]
    assert len(str(info.value)) < 200  # no 90-digit figure


def test_a_negative_size_says_so() -> None:
    with pytest.raises(ValueError, match="sizes cannot be negative"):
        parse_size("-3GiB")
    with pytest.raises(ValueError, match="sizes cannot be negative"):
        parse_size("-0.5 GB")


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


def test_format_size_rounds_up_or_down_when_asked() -> None:
    from vramkit.units import format_sizes_apart

    assert format_size(int(2.97 * 2**30)) == "3.0 GiB"
    assert format_size(int(2.97 * 2**30), rounding="down") == "2.9 GiB"
    assert format_size(int(2.91 * 2**30), rounding="up") == "3.0 GiB"
    assert format_size(3 * 2**30, rounding="up") == "3.0 GiB"  # exact stays exact
    assert format_size(3 * 2**30, rounding="down") == "3.0 GiB"
    assert format_size(1023.5, rounding="up") == "1024 B"
    assert format_sizes_apart(int(2.97 * 2**30), int(2.99 * 2**30)) == ("2.97 GiB", "2.99 GiB")
    assert format_sizes_apart(2**30, 2**30 + 1) == (f"{2**30} B", f"{2**30 + 1} B")
    assert format_sizes_apart(2**30, 2**31) == ("1.0 GiB", "2.0 GiB")
    with pytest.raises(ValueError, match="rounding"):
        format_size(1, rounding="sideways")
