"""Memory layout helpers: access-pattern analysis and alignment of flat buffers.

Pure functions (no torch, no CUDA), property-tested. vramkit lays out several tensors in one flat
buffer (a swapped block's pinned master, staging buffers, swap slots); :func:`aligned_offsets`
places each tensor at an offset aligned by :func:`calculate_alignment` so that views of the buffer
keep the alignment vectorized loads and coalesced 128-byte transactions need.
:func:`analyze_access_pattern` tells a sequence of element indices apart as sequential, strided
or random (BitNet ``MemoryLayoutOptimizer``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from vramkit._validate import check_int
from vramkit.errors import ConfigError

__all__ = [
    "AccessPattern",
    "Random",
    "Sequential",
    "Strided",
    "align_up",
    "aligned_offsets",
    "analyze_access_pattern",
    "calculate_alignment",
    "is_dense",
]

# 16 bytes: the widest vectorized load (float4 / int4) a kernel may issue on a tensor view.
MIN_ALIGNMENT = 16
# 256 bytes: what cudaMalloc and PyTorch's caching allocator guarantee, a multiple of the 128-byte
# L2 transaction; a buffer aligned this way behaves like a separately allocated tensor.
MAX_ALIGNMENT = 256


@dataclass(frozen=True)
class Sequential:
    """Consecutive indices ``a, a+1, a+2, ...`` (ideal for coalescing). Also the pattern of
    fewer than two indices."""


@dataclass(frozen=True)
class Strided:
    """Indices in arithmetic progression with a constant ``stride`` other than 1.

    Args:
        stride: the difference between consecutive indices (may be 0 or negative).
    """

    stride: int


@dataclass(frozen=True)
class Random:
    """Indices with no constant step between them."""


AccessPattern: TypeAlias = "Sequential | Strided | Random"


def analyze_access_pattern(indices: Iterable[int]) -> Sequential | Strided | Random:
    """Classify a sequence of element indices.

    Args:
        indices: element indices in access order (ints >= 0; a list, a range, a 1-D numpy array
            or a CPU tensor's ``tolist()``).

    Returns:
        :class:`Sequential` when every step is +1 (or there are fewer than two indices),
        :class:`Strided` (stride) when every step is the same other value, else
        :class:`Random`.

    Raises:
        ConfigError: an index is negative or not an integer.
    """
    values = indices if isinstance(indices, (range, Sequence)) else list(indices)
    if isinstance(values, range):
        _check_index(values.start)
        if len(values) > 1:
            _check_index(values[-1])
        if len(values) < 2 or values.step == 1:
            return Sequential()
        return Strided(values.step)
    step: int | None = None
    previous: int | None = None
    constant = True
    for raw in values:
        index = _check_index(raw)
        if previous is not None:
            difference = index - previous
            if step is None:
                step = difference
            elif difference != step:
                constant = False  # keep going: every index is still validated
        previous = index
    if step is None or (constant and step == 1):
        return Sequential()
    return Strided(step) if constant else Random()


def _as_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; integer types other than ``int`` (numpy's) count."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            value = operator.index(value)  # type: ignore[arg-type]
    return check_int(name, value, minimum=minimum)  # type: ignore[no-any-return]


def _check_index(raw: object) -> int:
    return _as_int("access index", raw, 0)


def calculate_alignment(nbytes: int) -> int:
    """The alignment (bytes) for a buffer of ``nbytes`` inside a flat allocation.

    Small buffers are aligned to their size rounded up to a power of two (a 4-byte scalar does
    not need 256), with at least 16 bytes so float4/int4 loads stay legal; buffers of 256 bytes
    or more get 256 bytes, the alignment of a separate ``cudaMalloc`` (and a multiple of the
    128-byte transaction, so coalescing is as good as for a separate tensor).

    Args:
        nbytes: the buffer size in bytes (>= 0).

    Returns:
        A power of two in [16, 256], non-decreasing in ``nbytes``.

    Raises:
        ConfigError: ``nbytes`` is negative or not an int.
    """
    check_int("calculate_alignment nbytes", nbytes, minimum=0)
    power = 1 << max(0, (nbytes - 1).bit_length()) if nbytes > 1 else 1
    return min(MAX_ALIGNMENT, max(MIN_ALIGNMENT, power))


def align_up(offset: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``offset``.

    Args:
        offset: a byte offset (>= 0).
        alignment: a power of two (>= 1).

    Returns:
        The aligned offset.

    Raises:
        ConfigError: ``offset < 0`` or ``alignment`` is not a power of two.
    """
    offset = _as_int("align_up offset", offset, 0)
    alignment = _as_int("align_up alignment", alignment, 1)
    if alignment & (alignment - 1):
        raise ConfigError(f"align_up: alignment must be a power of two, got {alignment}",
                          hint="Use a power-of-two alignment such as 256 or 512.")
    return (offset + alignment - 1) & ~(alignment - 1)


def aligned_offsets(sizes: Iterable[int]) -> tuple[tuple[int, ...], int]:
    """Lay out buffers of the given sizes one after another in a flat allocation.

    Each buffer starts at an offset aligned to :func:`calculate_alignment` of its size; the
    order is kept (so offsets can be matched back to tensors).

    Args:
        sizes: buffer sizes in bytes (each >= 0).

    Returns:
        ``(offsets, total_bytes)``: each buffer's start offset and the allocation size needed
        (rounded up to 256 bytes so the next allocation starts aligned too).

    Raises:
        ConfigError: a size is negative.
    """
    offsets: list[int] = []
    cursor = 0
    for size in sizes:
        cursor = align_up(cursor, calculate_alignment(size))
        offsets.append(cursor)
        cursor += size
    return tuple(offsets), align_up(cursor, MAX_ALIGNMENT)


def is_dense(tensor: object) -> bool:
    """Whether a tensor's elements cover its memory exactly once, in any dimension order.

    Dense tensors (contiguous, channels-last, transposed) can be copied as one flat run of
    ``numel * element_size`` bytes and viewed back with their strides; expanded or overlapping
    views and views with gaps cannot.

    Args:
        tensor: anything with ``shape`` and ``stride()`` (a ``torch.Tensor``, meta included).
    """
    expected = 1
    dims = zip(tensor.shape, tensor.stride(), strict=True)  # type: ignore[attr-defined]
    for size, stride in sorted(((s, st) for s, st in dims if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True

