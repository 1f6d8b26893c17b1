"""The torch reference quantizer and dequantizer for every format (runs on any device).

Everything works on the 2-D view ``[rows, cols]`` of a tensor, with each row zero-padded to a
multiple of the group size. The Triton kernels in :mod:`vramkit.quant._triton` reproduce
:func:`dequantize_rows` bit for bit: both compute a scale as ``row_or_block_scale * table[code]``
in fp32 and then one fp32 multiply per element, with the same table, so no step depends on the
device's ``exp2``.

Compact scales (int8/int4 ``compact_scales``, nf4 ``double_quant``) are uint8 codes ``c`` on a
logarithmic grid: ``scale = reference * 2**(-c / steps)``, with ``reference`` the largest scale
of the row (int8/int4) or of the second-level block (nf4). The code is rounded so the scale never
gets smaller than the one the group needs: compaction never clips, it only coarsens by at most
one grid step (2.2% for int8, 4.4% for the 4-bit formats).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from vramkit.quant._configs import FP8Config, Int4Config, Int8Config, NF4Config, QuantConfigT

__all__ = [
    "FP8_MAX",
    "INT8_LOG_STEPS",
    "LOG4_STEPS",
    "NF4_CODES",
    "QuantParts",
    "dequantize_rows",
    "log_scale_table",
    "nf4_table",
    "pack_nibbles",
    "padded_cols",
    "quantize_rows",
    "rows_cols",
    "unpack_nibbles",
]

logger = logging.getLogger(__name__)

# Grid steps per octave of the uint8 log-coded scales: int8 has no clipping search, so a finer
# grid (256 codes = 8 octaves below the row maximum); the 4-bit formats search the grid, and 16
# steps span 16 octaves.
INT8_LOG_STEPS = 32
LOG4_STEPS = 16
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# The 16 NormalFloat-4 levels (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) scaled to [-1, 1]
# with an exact zero.
NF4_CODES: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

# data, scales, zero_points, extras
QuantParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]


@functools.lru_cache(maxsize=16)
def _log_table_cpu(steps: int) -> torch.Tensor:
    # computed in float64 once, so every device sees the same fp32 values
    exponents = torch.arange(256, dtype=torch.float64) / -steps
    return torch.pow(2.0, exponents).to(torch.float32)


def log_scale_table(steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 fp32 multipliers ``2**(-c/steps)`` of the log-coded scales.

    Args:
        steps: grid steps per octave.
        device: where the table should live (default CPU).

    Returns:
        A float32 tensor of 256 entries.
    """
    return _log_table_cpu(steps).to(device)


def nf4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 NF4 levels as a float32 tensor on ``device`` (default CPU)."""
    return torch.tensor(NF4_CODES, dtype=torch.float32, device=device)


def rows_cols(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The ``(rows, cols)`` of the 2-D view a weight of ``shape`` is quantized as (one row per
    output channel; 0-D and 1-D tensors are one row).

    Args:
        shape: the original shape.

    Returns:
        ``(rows, cols)``.
    """
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    # A list, not a generator: torch.compile (dynamo) cannot trace generator arguments.
    return int(shape[0]), math.prod([int(s) for s in shape[1:]])


def padded_cols(config: QuantConfigT, cols: int) -> int:
    """Row length after zero-padding to a whole number of groups.

    Args:
        config: the format config.
        cols: the real row length.

    Returns:
        The padded row length (``cols`` itself for fp8 channel granularity).
    """
    if isinstance(config, FP8Config) and config.granularity == "channel":
        return cols
    group = config.block_size if isinstance(config, FP8Config) else config.group
    return -(-cols // group) * group


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (values 0..15, even last dim): element 2j -> low nibble of byte j.

    Args:
        codes: integer tensor ``[..., 2n]``.

    Returns:
        uint8 tensor ``[..., n]``.
    """
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., n]`` -> uint8 codes ``[..., 2n]``."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _grouped(x: torch.Tensor, group: int, cols_padded: int) -> torch.Tensor:
    rows, cols = x.shape
    if cols_padded != cols:
        x = torch.nn.functional.pad(x, (0, cols_padded - cols))
    return x.reshape(rows, cols_padded // group, group)


def _encode_log(needed: torch.Tensor, reference: torch.Tensor, table: torch.Tensor,
                steps: int) -> torch.Tensor:
    """uint8-range codes (int64) whose scale ``reference * table[c]`` is >= ``needed``."""
    ratio = reference / needed  # needed == 0 -> inf -> the smallest scale, code 255
    codes = torch.floor(steps * torch.log2(ratio)).nan_to_num(255.0).clamp(0, 255).long()
    # log2 rounding may land one step too small: step back so the scale covers `needed`
    too_small = reference * table[codes] < needed
    return torch.where(too_small, codes - 1, codes).clamp_min(0)


def _safe_reference(reference: torch.Tensor) -> torch.Tensor:
    # an all-zero row/block: any positive scale dequantizes its zero codes to exactly 0
    return torch.where(reference > 0, reference, torch.ones_like(reference))


# ---------------------------------------------------------------------------------------- int8

def _quantize_int8(x: torch.Tensor, config: Int8Config) -> QuantParts:
    rows, cols = x.shape
    grouped = _grouped(x, config.block_size, padded_cols(config, cols))
    needed = grouped.abs().amax(dim=-1) / 127.0  # [rows, blocks]
    extras: dict[str, torch.Tensor] = {}
    if config.compact_scales:
        table = log_scale_table(INT8_LOG_STEPS, x.device)
        row_scales = _safe_reference(needed.amax(dim=-1))  # [rows]
        codes = _encode_log(needed, row_scales[:, None], table, INT8_LOG_STEPS)
        scale = row_scales[:, None] * table[codes]
        scales = codes.to(torch.uint8)
        extras["row_scales"] = row_scales
    else:
        scale = _safe_reference(needed)
        scales = scale
    data = torch.round(grouped / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return data.reshape(rows, -1), scales, None, extras


# ---------------------------------------------------------------------------------------- int4

def _int4_zero(scale: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
               zero_rule: int) -> torch.Tensor:
    if zero_rule == 0:    # align the grid's low end with the group minimum
        zero = torch.round(-lo / scale)
    elif zero_rule == 1:  # align the high end with the group maximum
        zero = torch.round(15.0 - hi / scale)
    else:                 # centre the grid on the group's range
        zero = torch.round(7.5 - (lo + hi) / (2.0 * scale))
    return zero.clamp_(0, 15)


def _quantize_int4(x: torch.Tensor, config: Int4Config) -> QuantParts:
    rows, cols = x.shape
    grouped = _grouped(x, config.group_size, padded_cols(config, cols))
    # the integer zero point makes 0 exactly representable, so the grid must span 0
    lo = grouped.amin(dim=-1).clamp(max=0.0)
    hi = grouped.amax(dim=-1).clamp(min=0.0)
    needed = (hi - lo) / 15.0  # [rows, groups]
    table = log_scale_table(LOG4_STEPS, x.device)
    if config.compact_scales:
        row_scales = _safe_reference(needed.amax(dim=-1))
        reference = row_scales[:, None].expand_as(needed)
        base = _encode_log(needed, reference, table, LOG4_STEPS)
    else:
        row_scales = None
        reference = _safe_reference(needed)
        base = torch.zeros_like(needed, dtype=torch.long)
    # Search keeps only the per-group error and choice; the codes are computed once at the end.
    best_err = best_code = best_zero = None
    for step in range(config.clip_search):
        code = (base + step).clamp_(max=255)
        scale = reference * table[code]
        rounded = torch.round(grouped / scale[..., None])
        for zero_rule in range(3):
            zero = _int4_zero(scale, lo, hi, zero_rule)
            centred = torch.clamp(rounded, min=-zero[..., None], max=15.0 - zero[..., None])
            err = (centred * scale[..., None] - grouped).square_().sum(dim=-1)
            if best_err is None:
                best_err, best_code, best_zero = err, code, zero
                continue
            # strict < keeps the earliest (least clipped) candidate on ties: deterministic
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_code = torch.where(better, code, best_code)
            best_zero = torch.where(better, zero, best_zero)
    assert best_code is not None and best_zero is not None  # clip_search >= 1 (validated)
    scale = reference * table[best_code]
    codes = (torch.round(grouped / scale[..., None]) + best_zero[..., None]).clamp_(0, 15)
    data = pack_nibbles(codes.reshape(rows, -1))
    extras: dict[str, torch.Tensor] = {}
    if row_scales is not None:
        scales = best_code.to(torch.uint8)
        zeros = best_zero.to(torch.uint8)
        if zeros.shape[1] % 2:
            zeros = torch.nn.functional.pad(zeros, (0, 1))
        zero_points = pack_nibbles(zeros)
        extras["row_scales"] = row_scales
    else:
        scales = scale
        zero_points = best_zero.to(torch.uint8)
    return data, scales, zero_points, extras


# ----------------------------------------------------------------------------------------- nf4

def _nf4_codes(grouped: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    table = nf4_table(grouped.device)
    boundaries = (table[1:] + table[:-1]) / 2.0
    normalized = (grouped / scale[..., None]).clamp_(-1.0, 1.0)
    return torch.bucketize(normalized, boundaries)


def _quantize_nf4(x: torch.Tensor, config: NF4Config) -> QuantParts:
    rows, cols = x.shape
    grouped = _grouped(x, config.block_size, padded_cols(config, cols))
    needed = grouped.abs().amax(dim=-1)  # [rows, blocks]
    levels = nf4_table(x.device)
    table = log_scale_table(LOG4_STEPS, x.device)
    extras: dict[str, torch.Tensor] = {}
    if config.double_quant:
        flat = needed.reshape(-1)
        dq = config.double_quant_block_size
        dq_blocks = -(-flat.numel() // dq)
        padded = torch.nn.functional.pad(flat, (0, dq_blocks * dq - flat.numel()))
        scale_scales = _safe_reference(padded.reshape(dq_blocks, dq).amax(dim=-1))
        reference = scale_scales.repeat_interleave(dq)[: flat.numel()].reshape(needed.shape)
        base = _encode_log(needed, reference, table, LOG4_STEPS)
        extras["scale_scales"] = scale_scales
    else:
        reference = _safe_reference(needed)
        base = torch.zeros_like(needed, dtype=torch.long)
    best_err = best_step = None
    for step in range(config.clip_search):
        code = (base + step).clamp_(max=255) if config.double_quant else base + step
        scale = reference * table[code]
        codes = _nf4_codes(grouped, scale)
        err = (levels[codes] * scale[..., None] - grouped).square_().sum(dim=-1)
        if best_err is None:
            best_err, best_step = err, code
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_step = torch.where(better, code, best_step)
    assert best_step is not None  # clip_search >= 1 (validated)
    best_scale = reference * table[best_step]
    best_codes = _nf4_codes(grouped, best_scale)
    data = pack_nibbles(best_codes.reshape(rows, -1))
    scales = best_step.to(torch.uint8) if config.double_quant else best_scale
    return data, scales, None, extras


# ----------------------------------------------------------------------------------------- fp8

def _quantize_fp8(x: torch.Tensor, config: FP8Config) -> QuantParts:
    rows, cols = x.shape
    group = cols if config.granularity == "channel" else config.block_size
    grouped = _grouped(x, group, padded_cols(config, cols))
    scale = _safe_reference(grouped.abs().amax(dim=-1) / FP8_MAX)  # [rows, blocks]
    # .to(float8) does not saturate (448.5 -> nan): clamp first
    data = (grouped / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data.reshape(rows, -1), scale, None, {}


def quantize_rows(x: torch.Tensor, config: QuantConfigT) -> QuantParts:
    """Quantize a 2-D float32 tensor ``[rows, cols]`` row by row.

    Args:
        x: float32, 2-D, finite.
        config: the format config.

    Returns:
        ``(data, scales, zero_points, extras)`` on ``x``'s device, in the layout of
        ``docs/quantization.md``.
    """
    if isinstance(config, Int8Config):
        return _quantize_int8(x, config)
    if isinstance(config, Int4Config):
        return _quantize_int4(x, config)
    if isinstance(config, NF4Config):
        return _quantize_nf4(x, config)
    return _quantize_fp8(x, config)


def _expand(per_group: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    return per_group.reshape(rows, groups, 1)


def dequantize_rows(config: QuantConfigT, data: torch.Tensor, scales: torch.Tensor,
                    zero_points: torch.Tensor | None, extras: dict[str, torch.Tensor],
                    cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize packed parts back to ``[rows, cols]`` (padding dropped).

    Args:
        config: the format config.
        data, scales, zero_points, extras: the parts from :func:`quantize_rows`.
        cols: the real row length.
        dtype: output dtype.

    Returns:
        A ``[rows, cols]`` tensor of ``dtype`` on the parts' device.
    """
    rows = data.shape[0]
    device = data.device
    if isinstance(config, FP8Config):
        groups = scales.shape[1]
        values = data.to(torch.float32).reshape(rows, groups, -1) * _expand(scales, rows, groups)
    elif isinstance(config, Int8Config):
        groups = scales.shape[1]
        if config.compact_scales:
            table = log_scale_table(INT8_LOG_STEPS, device)
            scale = extras["row_scales"][:, None] * table[scales.long()]
        else:
            scale = scales
        values = data.to(torch.float32).reshape(rows, groups, -1) * _expand(scale, rows, groups)
    elif isinstance(config, Int4Config):
        groups = scales.shape[1]
        codes = unpack_nibbles(data).reshape(rows, groups, -1)
        assert zero_points is not None  # int4 always has zero points (layout checked on load)
        if config.compact_scales:
            table = log_scale_table(LOG4_STEPS, device)
            scale = extras["row_scales"][:, None] * table[scales.long()]
            zero = unpack_nibbles(zero_points)[:, :groups]
        else:
            scale = scales
            zero = zero_points
        # integer subtraction first (exact), then one fp32 multiply, as the Triton kernel does
        centred = (codes.to(torch.int32) - zero.to(torch.int32)[..., None]).to(torch.float32)
        values = centred * _expand(scale, rows, groups)
    else:
        groups = scales.shape[1]
        codes = unpack_nibbles(data).reshape(rows, groups, -1)
        if config.double_quant:
            table = log_scale_table(LOG4_STEPS, device)
            flat = torch.arange(rows * groups, device=device) // config.double_quant_block_size
            reference = extras["scale_scales"][flat].reshape(rows, groups)
            scale = reference * table[scales.long()]
        else:
            scale = scales
        values = nf4_table(device)[codes.long()] * _expand(scale, rows, groups)
    return values.reshape(rows, -1)[:, :cols].to(dtype)
