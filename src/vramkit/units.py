"""Byte sizes: ``"24GiB"`` <-> ``25769803776``.

Binary units (KiB, MiB, GiB, TiB, PiB) are powers of 1024; decimal units (kB, KB, MB, GB, TB, PB)
are powers of 1000, as the SI and IEC define them. ``"24G"`` (a bare letter, as in ``ulimit`` and
PyTorch's allocator settings) means GiB.

>>> parse_size("24GiB")
25769803776
>>> parse_size("1.5 GB")
1500000000
>>> format_size(25769803776)
'24.0 GiB'
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_SIZE_BYTES", "format_size", "format_sizes_apart", "parse_size"]

#: The largest size :func:`parse_size` accepts: the largest signed 64-bit byte count, which is
#: what PyTorch, CUDA and the OS use for sizes (``int64_t``, ``ssize_t``) and more memory than any
#: machine addresses. Anything above it is a typo (``1e99GiB``), not a budget.
MAX_SIZE_BYTES = 2**63 - 1

_UNITS: dict[str, int] = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
    "p": 1024**5, "pib": 1024**5, "pb": 1000**5,
}

_SIZE_RE = re.compile(r"^\s*([+-]?)([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Parse a byte size into an integer number of bytes.

    Args:
        value: an int (bytes), a float with no fractional byte, or a string such as ``"24GiB"``,
            ``"1.5 GB"``, ``"512 MiB"``, ``"4096"``, ``"8G"``.

    Returns:
        The size in bytes, from 0 to :data:`MAX_SIZE_BYTES`.

    Raises:
        ValueError: for negative sizes, sizes above :data:`MAX_SIZE_BYTES`, fractional bytes,
            NaN/inf, booleans, or strings that are not a number followed by a known unit.
    """
    return _within_bounds(_parse_size(value), value)


def _within_bounds(nbytes: int, original: object) -> int:
    if nbytes < 0:
        raise ValueError(f"invalid size {original!r}: sizes cannot be negative")
    if nbytes > MAX_SIZE_BYTES:
        shown = original if not isinstance(original, int) else f"{original:.3e}"
        raise ValueError(f"invalid size {shown!r}: larger than any memory (the limit is "
                         f"2**63 - 1 bytes, {format_size(MAX_SIZE_BYTES)})")
    return nbytes


def _parse_size(value: str | int | float) -> int:
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: a boolean is not a size")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return _whole_bytes(value, value)
    if not isinstance(value, str):
        raise ValueError(f"invalid size {value!r}: expected an int or a string like '24GiB'")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"invalid size {value!r}: expected a number and a unit, like '24GiB', '1.5 GB' or "
            "'4096' (units: B, KiB, MiB, GiB, TiB, kB, MB, GB, TB, or K/M/G/T for binary)")
    sign, number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"invalid size {value!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB, TiB, kB, MB, "
            "GB, TB, or K/M/G/T for binary)")
    if sign == "-" and float(number) != 0:
        raise ValueError(f"invalid size {value!r}: sizes cannot be negative")
    # Integers are parsed exactly (no float rounding for large byte counts).
    if re.fullmatch(r"[0-9]+", number):
        return int(number) * factor
    amount = float(number) * factor
    if not math.isfinite(amount):
        raise ValueError(f"invalid size {value!r}: not a finite number")
    if amount > 2 * MAX_SIZE_BYTES:
        return MAX_SIZE_BYTES + 1  # refused by the caller; no 90-digit integer made on the way
    if factor == 1:
        return _whole_bytes(amount, value)
    # A fraction of a scaled unit ("1.3 GiB") rounds to the nearest byte.
    return round(amount)


def _whole_bytes(amount: float, original: object) -> int:
    if not math.isfinite(amount):
        raise ValueError(f"invalid size {original!r}: not a finite number")
    if amount < 0:
        raise ValueError(f"invalid size {original!r}: sizes cannot be negative")
    rounded = round(amount)
    if abs(amount - rounded) > 1e-6 * max(1.0, amount):
        raise ValueError(f"invalid size {original!r}: not a whole number of bytes")
    return int(rounded)


def format_size(nbytes: int | float, *, binary: bool = True, precision: int = 1,
                rounding: str = "nearest") -> str:
    """Format a byte count for humans.

    Args:
        nbytes: the size in bytes (negative values are shown with a minus sign, for deltas).
        binary: powers of 1024 with IEC names (default) or powers of 1000 with SI names.
        precision: digits after the decimal point for scaled units.
        rounding: ``"nearest"`` (default), ``"up"`` or ``"down"`` (of the magnitude): a minimum
            shown rounded up is one the reader can use as it reads.

    >>> format_size(1536)
    '1.5 KiB'
    >>> format_size(1500000000, binary=False)
    '1.5 GB'
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)):
        raise ValueError(f"invalid byte count {nbytes!r}")
    if isinstance(nbytes, float) and not math.isfinite(nbytes):
        raise ValueError(f"invalid byte count {nbytes!r}")
    if rounding not in ("nearest", "up", "down"):
        raise ValueError(f"rounding must be 'nearest', 'up' or 'down', got {rounding!r}")
    sign = "-" if nbytes < 0 else ""
    amount = float(abs(nbytes))
    base = 1024.0 if binary else 1000.0
    names = ("KiB", "MiB", "GiB", "TiB", "PiB") if binary else ("kB", "MB", "GB", "TB", "PB")
    if amount < base:
        whole = math.ceil(amount) if rounding == "up" else int(amount)
        return f"{sign}{whole} B"
    for name in names:
        amount /= base
        if amount < base or name == names[-1]:
            if rounding != "nearest":
                scale = 10 ** precision
                step = math.ceil if rounding == "up" else math.floor
                # the division's float error must not round an exact figure one step away
                amount = step(round(amount * scale, 6)) / scale
            return f"{sign}{amount:.{precision}f} {name}"
    raise AssertionError("unreachable")


def format_sizes_apart(low: int, high: int, *, binary: bool = True) -> tuple[str, str]:
    """``low`` rounded down and ``high`` rounded up, with as many decimals (up to 3) as it takes
    to tell them apart: "a budget of 2.97 GiB ... needs 2.99 GiB", not "3.0 GiB ... 3.0 GiB".
    Exact byte counts when even 3 decimals do not.
    """
    for precision in (1, 2, 3):
        if (format_size(low, binary=binary, precision=precision)
                != format_size(high, binary=binary, precision=precision) or low == high):
            return (format_size(low, binary=binary, precision=precision, rounding="down"),
                    format_size(high, binary=binary, precision=precision, rounding="up"))
    return f"{low} B", f"{high} B"
