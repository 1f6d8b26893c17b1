"""Triton kernels for the quantized formats (imported only when a CUDA tensor is seen).

One ``@triton.jit`` helper, :func:`_dequant_tile`, turns a ``[BLOCK_R, BLOCK_C]`` tile of any
format back into fp32 exactly as :func:`vramkit.quant._reference.dequantize_rows` does (the same
tables, the same order of fp32 multiplies), so the dequantize kernel matches the torch fallback bit
for bit. The fused decode kernel reuses the helper to multiply the dequantized tile with a row of
activations without writing the weight to memory.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import triton
import triton.language as tl

from vramkit.quant import _reference

__all__ = ["FORMAT_CODES", "Dequantizer", "dequantize", "dequantize_fp8_rows_many",
           "dequantizer", "fp8_rowwise", "fused_linear"]

logger = logging.getLogger(__name__)

FORMAT_CODES = {"int8": 0, "int4": 1, "nf4": 2, "fp8": 3}

# Tile shapes, chosen for the bandwidth-bound shapes of Linear weights on Hopper: wide column
# tiles so each program streams long contiguous rows.
_DEQUANT_BLOCK_R = 8
_DEQUANT_BLOCK_C = 256
# The grouped dequantize kernel: elements per program, and the smallest power-of-two sub-group
# worth it (odd group sizes such as 24 or 6 take the per-element kernel).
_GROUP_TILE_ELEMENTS = 4096
_MIN_SUB = 16
_MAX_SUB = 256
_GEMV_BLOCK_N = 16
_GEMV_BLOCK_K = 256
_ROWWISE_BLOCK_K = 1024


@triton.jit
def _dequant_tile(rows, cols, mask, data_ptr, scales_ptr, zeros_ptr, aux_ptr, log_table_ptr,
                  nf4_ptr, data_stride, scale_stride, zero_stride, GROUP: tl.constexpr,
                  DQ_BLOCK: tl.constexpr, FMT: tl.constexpr, COMPACT: tl.constexpr):
    group = cols // GROUP
    scale_index = rows * scale_stride + group
    if COMPACT:
        code = tl.load(scales_ptr + scale_index, mask=mask, other=0).to(tl.int32)
        step = tl.load(log_table_ptr + code)
        if FMT == 2:
            reference = tl.load(aux_ptr + scale_index // DQ_BLOCK, mask=mask, other=1.0)
        else:
            reference = tl.load(aux_ptr + rows, mask=mask, other=1.0)
        scale = reference * step
    else:
        scale = tl.load(scales_ptr + scale_index, mask=mask, other=0.0)
    if FMT == 0:
        codes8 = tl.load(data_ptr + rows * data_stride + cols, mask=mask, other=0)
        values = codes8.to(tl.float32) * scale
    elif FMT == 3:
        # fp8 arrives as uint8 bits: a masked load then needs no fp8 "other" constant
        bits = tl.load(data_ptr + rows * data_stride + cols, mask=mask, other=0)
        values = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    else:
        byte = tl.load(data_ptr + rows * data_stride + cols // 2, mask=mask, other=0).to(tl.int32)
        nibble = (byte >> ((cols % 2) * 4).to(tl.int32)) & 15
        if FMT == 1:
            if COMPACT:
                zbyte = tl.load(zeros_ptr + rows * zero_stride + group // 2, mask=mask,
                                other=0).to(tl.int32)
                zero = (zbyte >> ((group % 2) * 4).to(tl.int32)) & 15
            else:
                zero = tl.load(zeros_ptr + rows * zero_stride + group, mask=mask,
                               other=0).to(tl.int32)
            values = (nibble - zero).to(tl.float32) * scale
        else:
            values = tl.load(nf4_ptr + nibble) * scale
    return values


@triton.jit
def _dequant_kernel(out_ptr, data_ptr, scales_ptr, zeros_ptr, aux_ptr, log_table_ptr, nf4_ptr,
                    n_rows, n_cols, data_stride, scale_stride, zero_stride,
                    GROUP: tl.constexpr, DQ_BLOCK: tl.constexpr, FMT: tl.constexpr,
                    COMPACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    values = _dequant_tile(rows, cols, mask, data_ptr, scales_ptr, zeros_ptr, aux_ptr,
                           log_table_ptr, nf4_ptr, data_stride, scale_stride, zero_stride,
                           GROUP, DQ_BLOCK, FMT, COMPACT)
    tl.store(out_ptr + rows * n_cols + cols, values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_groups_kernel(out_ptr, data_ptr, scales_ptr, zeros_ptr, aux_ptr, log_table_ptr,
                           nf4_ptr, n_sub, subs_per_row, n_cols, data_stride, scale_stride,
                           zero_stride, SUB: tl.constexpr, SUBS_PER_GROUP: tl.constexpr,
                           DQ_BLOCK: tl.constexpr, FMT: tl.constexpr, COMPACT: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    # Tiles of BLOCK_S sub-groups x SUB elements (SUB: a power of two dividing the group), so
    # every per-group quantity (scale code, row scale, zero point) is loaded once per sub-group
    # and broadcast along it, instead of gathered once per element as _dequant_kernel does.
    # The arithmetic is _dequant_tile's, in the same order: results are bit-identical.
    sub = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    sub_ok = sub < n_sub
    row = sub // subs_per_row
    in_row = sub % subs_per_row
    group = in_row // SUBS_PER_GROUP
    scale_index = row * scale_stride + group
    if COMPACT:
        code = tl.load(scales_ptr + scale_index, mask=sub_ok, other=0).to(tl.int32)
        step = tl.load(log_table_ptr + code)
        if FMT == 2:
            reference = tl.load(aux_ptr + scale_index // DQ_BLOCK, mask=sub_ok, other=1.0)
        else:
            reference = tl.load(aux_ptr + row, mask=sub_ok, other=1.0)
        scale = reference * step
    else:
        scale = tl.load(scales_ptr + scale_index, mask=sub_ok, other=0.0)
    cols = in_row[:, None] * SUB + tl.arange(0, SUB)[None, :]
    mask = sub_ok[:, None] & (cols < n_cols)
    rows = row[:, None].to(tl.int64)
    if FMT == 0:
        codes8 = tl.load(data_ptr + rows * data_stride + cols, mask=mask, other=0)
        values = codes8.to(tl.float32) * scale[:, None]
    elif FMT == 3:
        bits = tl.load(data_ptr + rows * data_stride + cols, mask=mask, other=0)
        values = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    else:
        byte = tl.load(data_ptr + rows * data_stride + cols // 2, mask=mask, other=0).to(tl.int32)
        nibble = (byte >> ((cols % 2) * 4)) & 15
        if FMT == 1:
            if COMPACT:
                zbyte = tl.load(zeros_ptr + row * zero_stride + group // 2, mask=sub_ok,
                                other=0).to(tl.int32)
                zero = (zbyte >> ((group % 2) * 4)) & 15
            else:
                zero = tl.load(zeros_ptr + row * zero_stride + group, mask=sub_ok,
                               other=0).to(tl.int32)
            values = (nibble - zero[:, None]).to(tl.float32) * scale[:, None]
        else:
            values = tl.load(nf4_ptr + nibble) * scale[:, None]
    tl.store(out_ptr + rows * n_cols + cols, values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(y_ptr, x_ptr, bias_ptr, data_ptr, scales_ptr, zeros_ptr, aux_ptr,
                 log_table_ptr, nf4_ptr, n_out, n_in, x_stride, data_stride, scale_stride,
                 zero_stride, GROUP: tl.constexpr, DQ_BLOCK: tl.constexpr, FMT: tl.constexpr,
                 COMPACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    out_idx = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = out_idx[:, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        cols = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)[None, :]
        mask = (rows < n_out) & (cols < n_in)
        weight = _dequant_tile(rows, cols, mask, data_ptr, scales_ptr, zeros_ptr, aux_ptr,
                               log_table_ptr, nf4_ptr, data_stride, scale_stride, zero_stride,
                               GROUP, DQ_BLOCK, FMT, COMPACT)
        x = tl.load(x_ptr + token * x_stride + cols, mask=cols < n_in, other=0.0)
        acc += tl.sum(weight * x.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + out_idx, mask=out_idx < n_out, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * n_out + out_idx, acc.to(y_ptr.dtype.element_ty), mask=out_idx < n_out)


@triton.jit
def _fp8_rowwise_kernel(x_ptr, q_ptr, scale_ptr, n_cols, x_stride, FP8_MAX: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    for k0 in range(0, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(scale_ptr + row, scale)


def _sub_group(group: int) -> int:
    """The largest power of two dividing ``group``, capped at ``_MAX_SUB``."""
    sub = group & -group
    return min(sub, _MAX_SUB)


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cached = _TABLE_CACHE.get(device)
    if cached is None:
        cached = (_reference.log_scale_table(_reference.INT8_LOG_STEPS, device),
                  _reference.log_scale_table(_reference.LOG4_STEPS, device),
                  _reference.nf4_table(device))
        _TABLE_CACHE[device] = cached
    return cached


_TABLE_CACHE: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _format_args(fmt: str, data: torch.Tensor, scales: torch.Tensor,
                 zero_points: torch.Tensor | None, aux: torch.Tensor | None,
                 compact: bool) -> tuple[list[object], dict[str, object]]:
    int8_table, log4_table, nf4 = _tables(data.device)
    if fmt == "fp8":
        data = data.view(torch.uint8)
    log_table = int8_table if fmt == "int8" else log4_table
    pointers: list[object] = [data, scales, zero_points, aux, log_table, nf4]
    strides = {"data_stride": data.stride(0), "scale_stride": scales.stride(0),
               "zero_stride": zero_points.stride(0) if zero_points is not None else 0}
    return pointers, {**strides, "FMT": FORMAT_CODES[fmt], "COMPACT": compact}


def dequantize(fmt: str, data: torch.Tensor, scales: torch.Tensor,
               zero_points: torch.Tensor | None, aux: torch.Tensor | None, *, group: int,
               dq_block: int, compact: bool, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize packed parts to a new ``[rows, cols]`` tensor of ``dtype``.

    Args:
        fmt: format name.
        data, scales, zero_points: the record's tensors (contiguous rows).
        aux: ``row_scales`` (int8/int4 compact) or ``scale_scales`` (nf4 double quant), else None.
        group: elements per scale along a row (the padded row length for fp8 channel).
        dq_block: nf4 double-quantization block (1 otherwise).
        compact: whether scales are uint8 log-step codes.
        cols: real row length.
        dtype: output dtype.

    Returns:
        The dequantized ``[rows, cols]`` tensor.
    """
    return dequantizer(fmt, group=group, dq_block=dq_block, compact=compact,
                       rows=data.shape[0], cols=cols)(data, scales, zero_points, aux, dtype)


class Dequantizer:
    """The dequantize launch of one weight layout, derived once and replayed per call.

    Triton's ``JITFunction.run`` binds and specializes all ~20 arguments again at every call,
    and a block of quantized layers is host-bound on a fast GPU. Here the kernel, its grid and
    its constant arguments are fixed for the layout; the first launch of each specialization
    (device, dtype, strides, pointer alignment, absent tensors) goes through Triton's JIT and
    keeps the compiled kernel it returns; later launches call that kernel directly
    (``CompiledKernel[grid]``, Triton's ahead-of-time launch), skipping the binding: 25 vs 39 us
    of host per call on an H100 (``benchmarks/quant_host.py``). Should that launch not accept
    the arguments (another Triton's calling convention), the JIT path is used from then on.
    The results are the same bit for bit.

    Args:
        fmt, group, dq_block, compact: as for :func:`dequantize`.
        rows: rows of the dequantized weight.
        cols: its real row length.
    """

    def __init__(self, fmt: str, *, group: int, dq_block: int, compact: bool, rows: int,
                 cols: int) -> None:
        self.fmt, self.rows, self.cols = fmt, rows, cols
        sub = _sub_group(group)
        codes = {"FMT": FORMAT_CODES[fmt], "COMPACT": compact, "DQ_BLOCK": dq_block}
        if sub >= _MIN_SUB and rows * cols < 2**31:
            subs_per_row = -(-cols // group) * group // sub
            n_sub = rows * subs_per_row
            block_s = max(1, _GROUP_TILE_ELEMENTS // sub)
            self.kernel: Any = _dequant_groups_kernel
            # three entries: CompiledKernel[grid] reads grid[0..2]
            self.grid: tuple[int, int, int] = (triton.cdiv(n_sub, block_s), 1, 1)
            self.sizes: dict[str, int] = {"n_sub": n_sub, "subs_per_row": subs_per_row,
                                          "n_cols": cols}
            self.constants: dict[str, object] = {"SUB": sub, "SUBS_PER_GROUP": group // sub,
                                                 **codes, "BLOCK_S": block_s}
            self.num_warps = 8
        else:
            self.kernel = _dequant_kernel
            self.grid = (triton.cdiv(rows, _DEQUANT_BLOCK_R), triton.cdiv(cols, _DEQUANT_BLOCK_C),
                         1)
            self.sizes = {"n_rows": rows, "n_cols": cols}
            self.constants = {"GROUP": group, **codes, "BLOCK_R": _DEQUANT_BLOCK_R,
                              "BLOCK_C": _DEQUANT_BLOCK_C}
            self.num_warps = 4
        self._launch = _Replay(self.kernel, self.num_warps)

    def __call__(self, data: torch.Tensor, scales: torch.Tensor,
                 zero_points: torch.Tensor | None, aux: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        """The dequantized ``[rows, cols]`` weight in ``dtype`` (a new tensor)."""
        device = data.device
        out = torch.empty((self.rows, self.cols), dtype=dtype, device=device)
        if self.fmt == "fp8":
            data = data.view(torch.uint8)
        int8_table, log4_table, nf4 = _tables(device)
        values = {"out_ptr": out, "data_ptr": data, "scales_ptr": scales,
                  "zeros_ptr": zero_points, "aux_ptr": aux,
                  "log_table_ptr": int8_table if self.fmt == "int8" else log4_table,
                  "nf4_ptr": nf4, **self.sizes, "data_stride": data.stride(0),
                  "scale_stride": scales.stride(0),
                  "zero_stride": zero_points.stride(0) if zero_points is not None else 0,
                  **self.constants}
        # What Triton specializes a compiled kernel on, besides the constants: the device,
        # the output dtype, every integer argument (== 1, % 16) and whether each pointer is
        # 16-byte aligned or absent.
        key = (device.index, dtype, values["data_stride"], values["scale_stride"],
               values["zero_stride"],
               *(None if t is None else t.data_ptr() % 16 == 0
                 for t in (data, scales, zero_points, aux)))
        self._launch(self.grid, key, values)
        return out


class _Replay:
    """Launches of one Triton kernel, replayed: the first launch of each specialization goes
    through Triton's JIT and keeps the compiled kernel it returns; later ones with the same
    ``key`` call it directly (``CompiledKernel[grid](*args)``, every argument in signature
    order), skipping the JIT's binding of the arguments. Should that launch refuse them
    (another Triton's calling convention), the JIT is used from then on, for every kernel.

    Args:
        kernel: the ``@triton.jit`` function.
        num_warps: its warps.
    """

    def __init__(self, kernel: Any, num_warps: int) -> None:
        self.kernel, self.num_warps = kernel, num_warps
        self._compiled: dict[tuple[object, ...], Any] = {}

    def __call__(self, grid: tuple[int, int, int], key: tuple[object, ...],
                 values: dict[str, Any]) -> None:
        """Launch on ``grid`` with ``values`` (every argument by name, constants included);
        ``key``: what the compiled kernel is specialized on besides the constants and the grid
        (device, dtypes, integer arguments, pointer alignment)."""
        key = (*key, *grid)
        launch = self._compiled.get(key)
        if launch is not None and _FAST_LAUNCH[0]:
            try:
                launch(*[values[name] for name in self.kernel.arg_names])
                return
            except (TypeError, ValueError, IndexError) as exc:  # another Triton's convention
                _FAST_LAUNCH[0] = False
                logger.debug("Triton's compiled-kernel launch refused the arguments (%s); "
                             "launching through the JIT from now on", exc)
        compiled = self.kernel[grid](**values, num_warps=self.num_warps)
        if launch is None and compiled is not None and hasattr(compiled, "run"):
            self._compiled[key] = compiled[grid]


@triton.jit
def _fp8_rows_many_kernel(table_ptr, out_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One launch for several fp8 weights with one fp32 scale per row. Each table row is
    # (data address, scale address, element offset in out, rows, cols); program (t, l) turns
    # rows [t * BLOCK_R, (t + 1) * BLOCK_R) of weight l into out's dtype, walking the columns
    # BLOCK_C at a time (no division per element), as _dequant_tile does (fp8 -> fp32, times
    # the row's scale, rounded once): bit-identical to the per-layer kernel.
    entry = table_ptr + tl.program_id(1) * 5
    n_rows = tl.load(entry + 3)
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    if r0 < n_rows:
        data_ptr = tl.load(entry).to(tl.pointer_type(tl.uint8))
        scale_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.float32))
        offset = tl.load(entry + 2)
        n_cols = tl.load(entry + 4)
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        row_ok = rows < n_rows
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        base = rows[:, None] * n_cols
        for c0 in range(0, n_cols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
            mask = row_ok[:, None] & (cols < n_cols)
            bits = tl.load(data_ptr + base + cols, mask=mask, other=0)
            values = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
            tl.store(out_ptr + offset + base + cols, values.to(out_ptr.dtype.element_ty),
                     mask=mask)


# Tile shape and warps of the batched launch: the fastest of 32 shapes on one FLUX double block
# on an H200 (0.334 ms, ~3.0 TB/s of packed reads and bf16 writes, against 0.374 ms for 8 x 512
# with 4 warps; every shape bit-identical), in a one-off sweep that is not kept;
# benchmarks/plan_phases.py times the batched dequantize inside a FLUX step.
_MANY_BLOCK_R = 2
_MANY_BLOCK_C = 512
_MANY_WARPS = 2


def dequantize_fp8_rows_many(table: torch.Tensor, out: torch.Tensor, most_rows: int) -> None:
    """Dequantize several fp8 channel-scaled weights into ``out`` in one launch (replayed after
    the first of its kind: see :class:`Dequantizer`).

    Args:
        table: ``[n, 5]`` int64 on the device: per weight its codes' address (contiguous
            ``[rows, cols]``), its fp32 row scales' address (contiguous), its element offset in
            ``out``, its rows and its row length.
        out: the destination (its dtype is the output dtype).
        most_rows: the most rows of any weight in the table.
    """
    grid = (triton.cdiv(most_rows, _MANY_BLOCK_R), table.shape[0], 1)
    key = (out.device.index, out.dtype, table.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
    _MANY_LAUNCH(grid, key, {"table_ptr": table, "out_ptr": out, "BLOCK_R": _MANY_BLOCK_R,
                             "BLOCK_C": _MANY_BLOCK_C})


_MANY_LAUNCH = _Replay(_fp8_rows_many_kernel, _MANY_WARPS)


@functools.lru_cache(maxsize=1024)
def dequantizer(fmt: str, *, group: int, dq_block: int, compact: bool, rows: int,
                cols: int) -> Dequantizer:
    """The (shared) :class:`Dequantizer` of a layout."""
    return Dequantizer(fmt, group=group, dq_block=dq_block, compact=compact, rows=rows,
                       cols=cols)


# Whether CompiledKernel[grid](*args) launches (Triton 3.3+: every argument, constants
# included, in signature order); cleared for good the first time it refuses them.
_FAST_LAUNCH = [True]


def fused_linear(x: torch.Tensor, fmt: str, data: torch.Tensor, scales: torch.Tensor,
                 zero_points: torch.Tensor | None, aux: torch.Tensor | None,
                 bias: torch.Tensor | None, *, group: int, dq_block: int, compact: bool,
                 n_out: int) -> torch.Tensor:
    """``x @ W.T + bias`` for few tokens, dequantizing W tile by tile in registers.

    Args:
        x: ``[tokens, in]`` activations with unit stride along ``in``.
        fmt, data, scales, zero_points, aux, group, dq_block, compact: as for :func:`dequantize`.
        bias: ``[out]`` or None.
        n_out: output features (rows of W).

    Returns:
        ``[tokens, out]`` in ``x.dtype`` (fp32 accumulation).
    """
    tokens, n_in = x.shape
    y = torch.empty((tokens, n_out), dtype=x.dtype, device=x.device)
    pointers, kwargs = _format_args(fmt, data, scales, zero_points, aux, compact)
    grid = (triton.cdiv(n_out, _GEMV_BLOCK_N), tokens, 1)
    values: dict[str, Any] = {
        "y_ptr": y, "x_ptr": x, "bias_ptr": bias, **dict(zip(_GEMV_POINTERS, pointers,
                                                              strict=True)),
        "n_out": n_out, "n_in": n_in, "x_stride": x.stride(0), **kwargs, "GROUP": group,
        "DQ_BLOCK": dq_block, "HAS_BIAS": bias is not None, "BLOCK_N": _GEMV_BLOCK_N,
        "BLOCK_K": _GEMV_BLOCK_K}
    # The launch's specialization: the device, every dtype, constant and integer argument,
    # and each pointer's 16-byte alignment (or absence).
    key = (x.device.index, x.dtype, fmt, group, dq_block, compact, n_out, n_in, x.stride(0),
           kwargs["data_stride"], kwargs["scale_stride"], kwargs["zero_stride"],
           None if bias is None else (bias.dtype, bias.data_ptr() % 16 == 0),
           *(None if t is None else (t.dtype, t.data_ptr() % 16 == 0)
             for t in (x, *pointers[:4])))
    _GEMV_LAUNCH(grid, key, values)
    return y


_GEMV_POINTERS = ("data_ptr", "scales_ptr", "zeros_ptr", "aux_ptr", "log_table_ptr", "nf4_ptr")
_GEMV_LAUNCH = _Replay(_gemv_kernel, 4)


def fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[tokens, in]`` activations per token to float8 e4m3 in one kernel.

    Args:
        x: 2-D activations with unit stride along the last dim.

    Returns:
        ``(codes [tokens, in] float8_e4m3fn, scales [tokens, 1] float32)`` with
        ``x ~= codes * scales``.
    """
    tokens, n_in = x.shape
    codes = torch.empty((tokens, n_in), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((tokens, 1), dtype=torch.float32, device=x.device)
    _fp8_rowwise_kernel[(tokens,)](x, codes, scales, n_in, x.stride(0),
                                   FP8_MAX=_reference.FP8_MAX, BLOCK_K=_ROWWISE_BLOCK_K,
                                   num_warps=4)
    return codes, scales
