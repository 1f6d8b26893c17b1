"""The W8A8 Triton kernels (:mod:`vramkit.quant._w8a8_triton`) on the CPU, through Triton's
interpreter (``TRITON_INTERPRET=1``), against the aten code of ``w8a8.py``.

Skipped without triton, and on a machine with CUDA (there ``test_w8a8_gpu.py`` runs the compiled
kernels; an interpreted copy of the module must not be what later tests import). Sizes stay small:
the interpreter runs each program in numpy.

The interpreter's own casts are not the GPU's: fp32 -> fp8 e4m3 rounds ties up and drops the
carry into the exponent (124.5 -> 64 instead of 128), and fp32 -> bf16 truncates. So here the
fp8 codes are checked to be the reference's or one of those two misroundings, and bf16 outputs
within one bf16 step; the GPU tests check both bit for bit.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from vramkit.quant import w8a8

_MODULE = "vramkit.quant._w8a8_triton"


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: test_w8a8_gpu.py runs the compiled kernels")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, at import
    try:
        sys.modules.pop(_MODULE, None)
        module = importlib.import_module(_MODULE)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    yield module
    sys.modules.pop(_MODULE, None)
    package = sys.modules["vramkit.quant"]
    if hasattr(package, "_w8a8_triton"):
        delattr(package, "_w8a8_triton")
    w8a8._TRITON_KERNELS.clear()


def _inputs(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    torch.manual_seed(rows * 1000 + cols)
    x = (torch.randn(rows, cols) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    x[0] = 0.0  # an all-zero row: zero codes, the floor scale, no NaN
    return x


def _assert_fp8_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or the interpreter's fp8 cast: a tie rounded to the other neighbour (codes one
    step apart), or the carry into the exponent lost (half the value)."""
    got_bits = got.view(torch.uint8).to(torch.int32)
    want_bits = want.view(torch.uint8).to(torch.int32)
    off = got_bits != want_bits
    same_sign = (got_bits[off] & 0x80) == (want_bits[off] & 0x80)
    neighbour = (got_bits[off] - want_bits[off]).abs() == 1
    halved = got.float()[off] * 2 == want.float()[off]
    assert (same_sign & (neighbour | halved)).all()
    assert off.float().mean() < 0.1


def _check_rows(kernels: ModuleType, kind: str, x: torch.Tensor, *, zero_row: bool = True,
                **tile: int) -> None:
    codes, scales = kernels.RowQuantizer(kind, x.shape[1], **tile)(x)
    want_codes, want_scales = w8a8.quantize_rows(x, kind)
    assert codes.dtype == want_codes.dtype and codes.shape == x.shape
    assert scales.shape == (x.shape[0], 1) and scales.dtype == torch.float32
    assert torch.equal(scales, want_scales)
    if kind == "int8":
        assert torch.equal(codes, want_codes)
    else:
        _assert_fp8_codes(codes, want_codes)
    if zero_row:
        assert (codes[0].float() == 0).all()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("cols", [48, 100, 256])
def test_rows_match_the_aten_quantizer(kernels: ModuleType, kind: str, cols: int) -> None:
    # 100: a row shorter than its power-of-two tile; 48 and 100: several rows per program
    _check_rows(kernels, kind, _inputs(13, cols))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_rows_longer_than_the_block_take_two_passes(kernels: ModuleType, kind: str) -> None:
    # block_k under the row length reads each row twice, the last block partly masked
    _check_rows(kernels, kind, _inputs(5, 300), block_k=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_of_other_dtypes(kernels: ModuleType, dtype: torch.dtype) -> None:
    _check_rows(kernels, "int8", _inputs(6, 64, dtype))


def test_rows_with_a_row_stride_and_without_unit_column_stride(kernels: ModuleType) -> None:
    wide = _inputs(7, 96)
    _check_rows(kernels, "int8", wide[:, :64])  # row stride 96
    _check_rows(kernels, "int8", _inputs(64, 7).t(), zero_row=False)  # copied to unit column stride


def test_int8_rounds_half_to_even_as_torch_round(kernels: ModuleType) -> None:
    quantizer = kernels.RowQuantizer("int8", 8)
    scale = torch.add(torch.tensor(1e-30), torch.tensor([[127.0]]), alpha=1 / 127)
    halves = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5]])
    x = halves * scale  # exact: the products are the ties themselves
    assert torch.equal(x / scale, halves)
    codes, _ = quantizer(x)
    assert codes.tolist() == [[127, 0, 2, 2, -2, 0, 126, -4]]
    assert torch.equal(codes, w8a8.quantize_rows(x, "int8")[0])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_col_scaled_rows_are_the_product_quantized(kernels: ModuleType, kind: str) -> None:
    g = _inputs(9, 80)
    col_scale = torch.rand(80) * 1e-2 + 1e-4
    codes, scales = kernels.RowQuantizer(kind, 80, col_scaled=True)(g, col_scale)
    want_codes, want_scales = w8a8.quantize_rows(g * col_scale, kind)
    assert torch.equal(scales, want_scales)
    if kind == "int8":
        assert torch.equal(codes, want_codes)
    else:
        _assert_fp8_codes(codes, want_codes)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_a_nan_makes_its_row_scale_nan_as_vector_norm_does(kernels: ModuleType) -> None:
    x = _inputs(4, 32, torch.float32)
    x[2, 5] = float("nan")
    _, scales = kernels.RowQuantizer("int8", 32)(x)
    assert torch.isnan(scales[2]).all() and torch.isfinite(scales[[0, 1, 3]]).all()


def test_no_rows(kernels: ModuleType) -> None:
    codes, scales = kernels.RowQuantizer("fp8", 32)(torch.empty(0, 32))
    assert codes.shape == (0, 32) and scales.shape == (0, 1)
    out = kernels.Int8Epilogue(16, col_scaled=True)(
        torch.empty(0, 16, dtype=torch.int32), scales, torch.ones(16), None, torch.float32)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_epilogue_matches_the_aten_passes(kernels: ModuleType, dtype: torch.dtype,
                                               with_bias: bool) -> None:
    torch.manual_seed(1)
    rows, cols = 45, 200  # neither a multiple of the 32 x 128 tile
    acc = torch.randint(-2**20, 2**20, (rows, cols), dtype=torch.int32)
    row_scale = torch.rand(rows, 1) * 1e-3
    col_scale = torch.rand(cols) * 1e-3
    bias = torch.randn(cols).to(dtype) if with_bias else None
    got = kernels.Int8Epilogue(cols, col_scaled=True)(acc, row_scale, col_scale, bias, dtype)
    scaled = torch.mul(acc, col_scale) * row_scale
    want = (scaled if bias is None else scaled + bias.float()).to(dtype)
    assert got.dtype == dtype and got.shape == (rows, cols)
    # one step of the output dtype: an fma, or the interpreter's truncating bf16 cast
    torch.testing.assert_close(got, want, rtol=2.0 ** -7 if dtype is torch.bfloat16 else 1e-6,
                               atol=1e-6)
    no_col = kernels.Int8Epilogue(cols, col_scaled=False)(acc, row_scale, None, None,
                                                          torch.float32)
    assert torch.equal(no_col, torch.mul(acc, row_scale))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@torch.no_grad()
def test_layer_kernels_match_the_aten_ones(kernels: ModuleType, kind: str) -> None:
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 48)
    layer = w8a8.W8A8Linear.from_linear(linear, kind)
    triton_kernel = (w8a8._TritonFp8Kernel if kind == "fp8" else w8a8._TritonInt8Kernel)(64, 48)
    assert triton_kernel.quantizer == "triton" and triton_kernel.name == kind
    aten = w8a8._KERNELS[kind]
    x = torch.randn(20, 64)  # 20 rows: over int8's 17-row padding
    g = torch.randn(20, 48)
    args = (layer.weight, layer.weight_scale)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        if kind == "int8":  # the same codes: the same sums, scaled in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the interpreter's fp8 cast moves a few codes (see the module docstring)
            assert float((got - want).norm() / want.norm()) < 0.05

    check(triton_kernel.forward(x, *args, layer.bias), aten.forward(x, *args, layer.bias))
    check(triton_kernel.grad_input(g, *args, torch.float32),
          aten.grad_input(g, *args, torch.float32))
    small = torch.randn(3, 64)  # int8: padded to 17 rows for _int_mm
    check(triton_kernel.forward(small, *args, None), aten.forward(small, *args, None))


def test_the_cpu_keeps_the_aten_kernels(kernels: ModuleType) -> None:
    layer = w8a8.W8A8Linear.from_linear(torch.nn.Linear(32, 16), "int8")
    layer(torch.randn(4, 32))
    assert layer._kernel is w8a8._Int8Kernel and layer._kernel.quantizer == "aten"
