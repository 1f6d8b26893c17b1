"""Triton kernels of the W8A8 layer on CUDA: per-row quantization and the int8 epilogue.

Imported only when a :class:`vramkit.quant.w8a8.W8A8Linear` first runs on a CUDA device with
triton installed; the CPU (and CUDA without triton) keeps the aten code of ``w8a8.py``.

* :class:`RowQuantizer`: ``[M, K]`` rows to 8-bit codes and fp32 row scales in ONE launch (aten
  needs four: ``vector_norm``, ``add``, ``empty``, ``div``), optionally multiplying each column by
  a vector first (the backward's ``h = g * s_w[None, :]``, one more aten pass saved). The math is
  the aten path's, operation for operation, so the codes are the same bit for bit:
  ``amax`` in fp32 (NaN propagates, as ``vector_norm`` does), ``scale = amax * fp32(1 / QMAX) +
  1e-30`` (``torch.add(FLOOR, amax, alpha=1 / QMAX)``), ``codes = x / scale`` with an IEEE
  division (``div_rn``: Triton's ``/`` is an approximate division), then fp8 e4m3 by
  round-to-nearest-even, or int8 by round-half-to-even (``torch.round``) and saturation to
  [-127, 127].
* :class:`Int8Epilogue`: ``out = acc * s_w[n] * s_x[m] (+ b[n])`` from ``_int_mm``'s int32 sums in
  one pass, stored in the output dtype (aten: two or three passes through fp32 tensors).

Launches are lean: each object fixes its kernel's constants when the layer is built; the first
launch of a specialization goes through Triton's JIT and keeps the compiled kernel, later ones call
it directly (``CompiledKernel[grid]``), skipping the JIT's binding of the arguments (see
:class:`vramkit.quant._triton.Dequantizer`). Launches use the current CUDA device and stream, as
every Triton launch does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["Int8Epilogue", "RowQuantizer", "int8_epilogue", "row_quantizer"]

logger = logging.getLogger(__name__)

_QMAX = {"fp8": 448.0, "int8": 127.0}
_CODE_DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _fp32(value: float) -> float:
    """``value`` rounded to fp32, so that Triton's fp32 constant is exactly torch's."""
    return float(torch.tensor(value, dtype=torch.float32))


# torch.add(FLOOR, amax, alpha=1/QMAX) computes FLOOR + fp32(1/QMAX) * amax in fp32.
_FLOOR = _fp32(1e-30)
_INV_QMAX = {kind: _fp32(1.0 / qmax) for kind, qmax in _QMAX.items()}

# Rows held whole in registers up to this many columns (FLUX's 12288 and Llama's 14336 fit);
# longer rows are read twice, BLOCK_K at a time (the second read mostly from L2).
_ONE_PASS_MAX_COLS = 16384
_TWO_PASS_BLOCK_K = 4096
# Elements per program for short rows (several rows per program), and per thread.
_MIN_TILE = 2048
_ELEMENTS_PER_THREAD = 16
_EPILOGUE_BLOCK_M = 32
_EPILOGUE_BLOCK_N = 128
_EPILOGUE_WARPS = 4


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _to_codes(h, scale, QMAX: tl.constexpr, INT8: tl.constexpr):
    q = tl.math.div_rn(h, scale)
    if INT8:
        # Round half to even, as torch.round: adding 1.5 * 2**23 leaves no fraction bits, and
        # the fp32 add rounds to nearest even (|q| <= 127.x, far inside 2**22).
        q = (q + 12582912.0) - 12582912.0
    # Saturate (x / scale can exceed QMAX by an ulp of the scale's rounding); NaN stays NaN.
    return tl.minimum(tl.maximum(q, -QMAX, propagate_nan=tl.PropagateNan.ALL), QMAX,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_kernel(x_ptr, col_scale_ptr, codes_ptr, scales_ptr, n_rows, x_stride,
                          N_COLS: tl.constexpr, QMAX: tl.constexpr, INV_QMAX: tl.constexpr,
                          FLOOR: tl.constexpr, INT8: tl.constexpr, COL_SCALE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    code_rows = codes_ptr + rows.to(tl.int64)[:, None] * N_COLS
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_K)[None, :]
        mask = row_ok[:, None] & (cols < N_COLS)
        h = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if COL_SCALE:
            h = h * tl.load(col_scale_ptr + cols, mask=cols < N_COLS, other=0.0)
        amax = tl.reduce(tl.abs(h), 1, _max_keeping_nan)
        scale = tl.fma(amax, INV_QMAX, FLOOR)
        codes = _to_codes(h, scale[:, None], QMAX, INT8)
        tl.store(code_rows + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    else:
        running = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)
        for k0 in range(0, N_COLS, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)[None, :]
            mask = row_ok[:, None] & (cols < N_COLS)
            h = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            if COL_SCALE:
                h = h * tl.load(col_scale_ptr + cols, mask=cols < N_COLS, other=0.0)
            running = tl.maximum(running, tl.abs(h), propagate_nan=tl.PropagateNan.ALL)
        amax = tl.reduce(running, 1, _max_keeping_nan)
        scale = tl.fma(amax, INV_QMAX, FLOOR)
        for k0 in range(0, N_COLS, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)[None, :]
            mask = row_ok[:, None] & (cols < N_COLS)
            h = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            if COL_SCALE:
                h = h * tl.load(col_scale_ptr + cols, mask=cols < N_COLS, other=0.0)
            codes = _to_codes(h, scale[:, None], QMAX, INT8)
            tl.store(code_rows + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows"])
def _int8_epilogue_kernel(acc_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, n_rows,
                          acc_stride, N_COLS: tl.constexpr, COL_SCALE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < N_COLS
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    y = tl.load(acc_ptr + rows64 * acc_stride + cols[None, :], mask=mask, other=0).to(tl.float32)
    # The aten order: (acc * s_w) first, then * s_x, then + b.
    if COL_SCALE:
        y = y * tl.load(col_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    y = y * tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64 * N_COLS + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# Whether CompiledKernel[grid](*args) launches (Triton 3.3+: every argument, constants included,
# in signature order); cleared for good the first time it refuses them.
_FAST_LAUNCH = [True]


class _Launch:
    """One kernel with fixed constants, launched through the compiled kernel after the first call
    of each specialization.

    Args:
        kernel: the ``@triton.jit`` function; its constants come last in its signature.
        constants: the values of those constants, by name.
        num_warps: its warps.
    """

    def __init__(self, kernel: Any, constants: dict[str, Any], num_warps: int) -> None:
        self.kernel, self.constants, self.num_warps = kernel, constants, num_warps
        last = kernel.arg_names[len(kernel.arg_names) - len(constants):]
        if set(last) != set(constants):
            raise ValueError(f"{kernel.arg_names}: the constants {sorted(constants)} must "
                             f"come last")
        self._constant_values = tuple(constants[name] for name in last)
        self._compiled: dict[tuple[object, ...], Any] = {}

    def __call__(self, grid: tuple[int, int, int], key: tuple[object, ...],
                 args: tuple[Any, ...]) -> None:
        """Launch on ``grid``; ``args``: the non-constant arguments in signature order;
        ``key``: what Triton specializes them on (dtypes, pointer alignment, integer values
        that are not ``do_not_specialize``)."""
        compiled = self._compiled.get(key)
        if compiled is not None and _FAST_LAUNCH[0]:
            try:
                compiled[grid](*args, *self._constant_values)
                return
            except (TypeError, ValueError, IndexError) as exc:  # another Triton's convention
                _FAST_LAUNCH[0] = False
                logger.debug("Triton's compiled-kernel launch refused the arguments (%s); "
                             "launching through the JIT from now on", exc)
        compiled = self.kernel[grid](*args, **self.constants, num_warps=self.num_warps)
        if compiled is not None and hasattr(compiled, "run"):
            self._compiled[key] = compiled

    def jit(self, grid: tuple[int, int, int], args: tuple[Any, ...]) -> None:
        """Launch through Triton's JIT only (for measuring what the direct launch saves)."""
        self.kernel[grid](*args, **self.constants, num_warps=self.num_warps)


def _aligned(t: torch.Tensor | None) -> bool | None:
    return None if t is None else t.data_ptr() % 16 == 0


def _row_tile(cols: int) -> tuple[int, int, bool, int]:
    """``(BLOCK_M, BLOCK_K, ONE_PASS, num_warps)`` for rows of ``cols`` elements."""
    if cols > _ONE_PASS_MAX_COLS:
        return 1, _TWO_PASS_BLOCK_K, False, 8
    block_k = triton.next_power_of_2(max(cols, 1))
    block_m = max(1, _MIN_TILE // block_k)
    warps = min(16, max(1, block_m * block_k // (32 * _ELEMENTS_PER_THREAD)))
    return block_m, block_k, True, warps


class RowQuantizer:
    """Per-row quantization of ``[M, cols]`` tensors in one launch.

    Args:
        kind: ``"fp8"`` (float8 e4m3 codes) or ``"int8"`` (codes in [-127, 127]).
        cols: the row length ``K`` (a constant of the compiled kernel).
        col_scaled: multiply each row by a ``[cols]`` fp32 vector before quantizing (the
            backward's ``g * s_w``).
        block_m, block_k, num_warps: override the tile (benchmarks); ``block_k`` below ``cols``
            reads each row twice.
    """

    def __init__(self, kind: str, cols: int, *, col_scaled: bool = False,
                 block_m: int | None = None, block_k: int | None = None,
                 num_warps: int | None = None) -> None:
        tile_m, tile_k, _, warps = _row_tile(cols)
        block_m, block_k = block_m or tile_m, block_k or tile_k
        self.kind, self.cols, self.col_scaled = kind, cols, col_scaled
        self.code_dtype = _CODE_DTYPE[kind]
        self.block_m = block_m
        self.launch = _Launch(_quantize_rows_kernel, {
            "N_COLS": cols, "QMAX": _QMAX[kind], "INV_QMAX": _INV_QMAX[kind], "FLOOR": _FLOOR,
            "INT8": kind == "int8", "COL_SCALE": col_scaled, "BLOCK_M": block_m,
            "BLOCK_K": block_k, "ONE_PASS": block_k >= cols}, num_warps or warps)

    def prepare(self, x: torch.Tensor, col_scale: torch.Tensor | None = None
                ) -> tuple[tuple[int, int, int], tuple[object, ...], tuple[Any, ...],
                           torch.Tensor, torch.Tensor]:
        """The launch's grid, key and arguments, and the outputs it writes (benchmarks time the
        launch alone with these)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        device = x.device
        codes = torch.empty((rows, self.cols), dtype=self.code_dtype, device=device)
        scales = torch.empty((rows, 1), dtype=torch.float32, device=device)
        stride = x.stride(0)
        key = (device.index, x.dtype, stride, x.data_ptr() % 16 == 0, _aligned(col_scale))
        grid = ((rows + self.block_m - 1) // self.block_m, 1, 1)
        return grid, key, (x, col_scale, codes, scales, rows, stride), codes, scales

    def __call__(self, x: torch.Tensor, col_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x [M, cols]`` (unit stride along a row after ``contiguous`` if needed).

        Args:
            x: floating point, 2-D.
            col_scale: ``[cols]`` fp32, contiguous: required when built ``col_scaled``.

        Returns:
            ``(codes [M, cols], scales [M, 1] fp32)``, ``x (* col_scale) ≈ codes * scales``.
        """
        grid, key, args, codes, scales = self.prepare(x, col_scale)
        if grid[0]:
            self.launch(grid, key, args)
        return codes, scales


class Int8Epilogue:
    """``out[m, n] = acc[m, n] * col_scale[n] * row_scale[m] (+ bias[n])`` in one pass.

    Args:
        cols: ``N``, the sums' row length (a constant of the compiled kernel).
        col_scaled: whether a per-column scale multiplies first (the forward's ``s_w``; the
            backward has none).
    """

    def __init__(self, cols: int, *, col_scaled: bool) -> None:
        self.cols, self.col_scaled = cols, col_scaled
        self._launches = {has_bias: _Launch(_int8_epilogue_kernel, {
            "N_COLS": cols, "COL_SCALE": col_scaled, "HAS_BIAS": has_bias,
            "BLOCK_M": _EPILOGUE_BLOCK_M, "BLOCK_N": _EPILOGUE_BLOCK_N}, _EPILOGUE_WARPS)
            for has_bias in (False, True)}
        self._col_blocks = triton.cdiv(cols, _EPILOGUE_BLOCK_N)

    def __call__(self, acc: torch.Tensor, row_scale: torch.Tensor,
                 col_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        """The scaled ``[M, cols]`` output in ``dtype``.

        Args:
            acc: int32 sums ``[M, cols]``, unit stride along a row.
            row_scale: fp32 ``[M, 1]`` (or ``[M]``), contiguous.
            col_scale: fp32 ``[cols]``, contiguous (None when built without).
            bias: ``[cols]`` or None, contiguous.
            dtype: the output dtype.
        """
        rows = acc.shape[0]
        out = torch.empty((rows, self.cols), dtype=dtype, device=acc.device)
        if rows:
            stride = acc.stride(0)
            key = (acc.device.index, dtype, stride, acc.data_ptr() % 16 == 0,
                   row_scale.data_ptr() % 16 == 0, _aligned(col_scale),
                   None if bias is None else (bias.dtype, bias.data_ptr() % 16 == 0))
            grid = ((rows + _EPILOGUE_BLOCK_M - 1) // _EPILOGUE_BLOCK_M, self._col_blocks, 1)
            self._launches[bias is not None](grid, key, (acc, row_scale, col_scale, bias, out,
                                                         rows, stride))
        return out


_QUANTIZERS: dict[tuple[str, int, bool], RowQuantizer] = {}
_EPILOGUES: dict[tuple[int, bool], Int8Epilogue] = {}


def row_quantizer(kind: str, cols: int, *, col_scaled: bool = False) -> RowQuantizer:
    """The (shared) :class:`RowQuantizer` of a kind and row length."""
    key = (kind, cols, col_scaled)
    quantizer = _QUANTIZERS.get(key)
    if quantizer is None:
        quantizer = _QUANTIZERS[key] = RowQuantizer(kind, cols, col_scaled=col_scaled)
    return quantizer


def int8_epilogue(cols: int, *, col_scaled: bool) -> Int8Epilogue:
    """The (shared) :class:`Int8Epilogue` of a row length."""
    key = (cols, col_scaled)
    epilogue = _EPILOGUES.get(key)
    if epilogue is None:
        epilogue = _EPILOGUES[key] = Int8Epilogue(cols, col_scaled=col_scaled)
    return epilogue
