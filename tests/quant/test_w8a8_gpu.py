"""W8A8Linear on a CUDA GPU: the fp8 (capability >= 8.9) and int8 (>= 8.0) GEMMs against the float
reference of the math, the 8-bit backward, a FLUX-shaped layer, and the host time per call
(printed, not asserted: run with -s to see it)."""

from __future__ import annotations

import time
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.quant.w8a8 import W8A8_CAPABILITY, W8A8Linear, quantize_rows

pytestmark = pytest.mark.gpu

KINDS = ["int8", "fp8"]
QMAX = {"int8": 127.0, "fp8": 448.0}
REL_ERROR = {"int8": 0.02, "fp8": 0.07}


def _skip_unless_capable(kind: str) -> None:
    if torch.cuda.get_device_capability() < W8A8_CAPABILITY[kind]:
        pytest.skip(f"{kind} W8A8 needs capability >= {W8A8_CAPABILITY[kind]}")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm()
                 / want.detach().double().norm())


def _layer(kind: str, n_in: int, n_out: int) -> tuple[W8A8Linear, nn.Linear]:
    torch.manual_seed(0)
    linear = nn.Linear(n_in, n_out, device="cuda", dtype=torch.bfloat16)
    reference = nn.Linear(n_in, n_out, device="cuda", dtype=torch.bfloat16)
    reference.load_state_dict(linear.state_dict())
    return W8A8Linear.from_linear(linear, kind), reference


def _emulated(x: torch.Tensor, layer: W8A8Linear) -> torch.Tensor:
    """The layer's math in float32 from the same codes: s_x s_w sum_k Q_x Q_w + b."""
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_rows(x2, layer.kind)
    y = (codes.float() * scale) @ layer.dequantized_weight(torch.float32).t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_rows_saturate_without_nan(kind: str) -> None:
    _skip_unless_capable(kind)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x[0] = 0.0
    x[1, 7] = 3.0e38
    codes, scale = quantize_rows(x, kind)
    assert torch.isfinite(codes.float()).all() and torch.isfinite(scale).all()
    assert codes.float().abs().max() <= QMAX[kind]
    assert (codes[0].float() == 0).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [5, 333])
def test_gpu_forward_matches_the_reference(kind: str, tokens: int) -> None:
    _skip_unless_capable(kind)
    layer, reference = _layer(kind, 512, 768)
    x = torch.randn(3, tokens, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (3, tokens, 768) and y.dtype == torch.bfloat16
    assert _rel(y, _emulated(x, layer)) < 0.01
    assert _rel(y, reference(x)) < REL_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_backward_in_8_bits(kind: str) -> None:
    _skip_unless_capable(kind)
    layer, _ = _layer(kind, 512, 768)
    x = torch.randn(4, 100, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4, 100, 768, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(grad)
    x_ref = x.detach().float().requires_grad_()
    bias_ref = layer.bias.detach().float().requires_grad_()
    F.linear(x_ref, layer.dequantized_weight(), bias_ref).backward(grad.float())
    cosine = F.cosine_similarity(x.grad.double().flatten(), x_ref.grad.double().flatten(), dim=0)
    assert cosine >= 0.99
    assert _rel(x.grad, x_ref.grad) < 2 * REL_ERROR[kind]
    assert _rel(layer.bias.grad, bias_ref.grad) < 0.01


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_flux_shaped_layer(kind: str) -> None:
    _skip_unless_capable(kind)
    for n_in, n_out in ((3072, 3072), (3072, 12288)):
        layer, reference = _layer(kind, n_in, n_out)
        x = torch.randn(4096, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        assert _rel(y, reference(x)) < REL_ERROR[kind]
        y.backward(torch.randn_like(y))
        assert x.grad is not None and torch.isfinite(x.grad).all()
        assert layer.weight.element_size() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_host_time_per_call(kind: str) -> None:
    _skip_unless_capable(kind)
    layer, reference = _layer(kind, 3072, 3072)
    reference.requires_grad_(False)
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_()
    report = []
    for name, module, inp, grad_mode in (("bf16", reference, x, False),
                                         (f"w8a8 {kind} no_grad", layer, x, False),
                                         (f"w8a8 {kind} autograd", layer, x_grad, True)):
        with torch.set_grad_enabled(grad_mode):
            for _ in range(10):
                module(inp)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                module(inp)
            host = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
        report.append(f"{name}: {host:.1f} us host/call")
    print("\n" + "; ".join(report))


def test_gpu_quantize_model_w8a8_moves_half_the_bytes() -> None:
    kind = "fp8" if torch.cuda.get_device_capability() >= W8A8_CAPABILITY["fp8"] else "int8"
    _skip_unless_capable(kind)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).to(
        device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    quantize_model(model, QuantizationConfig(kind, w8a8=True))
    after = sum(t.numel() * t.element_size()
                for t in list(model.parameters()) + list(model.buffers()))
    assert after <= 0.51 * before
    y = model(torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16))
    assert torch.isfinite(y).all()


# -- the Triton kernels (vramkit.quant._w8a8_triton) against the aten code, bit for bit ---------

def _triton_kernels() -> ModuleType:
    """The kernels' module, imported only here (it imports triton)."""
    pytest.importorskip("triton")
    from vramkit.quant import _w8a8_triton

    return _w8a8_triton


def _gpu_rows(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    torch.manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device="cuda")
         * torch.logspace(-4, 3, rows, device="cuda")[:, None]).to(dtype)
    x[0] = 0.0
    return x


# (rows, cols): one row; FLUX widths; a row shorter than its power-of-two tile with several rows
# per program; rows over the one-pass limit (two passes, the last block partly masked)
ROW_SHAPES = [(1, 3072), (333, 3072), (4096, 3072), (64, 12288), (50, 100), (37, 20000)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_gpu_triton_rows_equal_the_aten_rows(kind: str, shape: tuple[int, int]) -> None:
    _skip_unless_capable(kind)
    kernels = _triton_kernels()
    x = _gpu_rows(*shape)
    codes, scales = kernels.RowQuantizer(kind, shape[1])(x)
    want_codes, want_scales = quantize_rows(x, kind)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert (codes[0].float() == 0).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_triton_rows_of_other_dtypes(kind: str, dtype: torch.dtype) -> None:
    _skip_unless_capable(kind)
    x = _gpu_rows(200, 1536, dtype)
    codes, scales = _triton_kernels().RowQuantizer(kind, 1536)(x)
    want_codes, want_scales = quantize_rows(x, kind)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [3072, 20000])
def test_gpu_triton_col_scaled_rows_equal_the_aten_product(kind: str, cols: int) -> None:
    _skip_unless_capable(kind)
    g = _gpu_rows(129, cols)
    col_scale = torch.rand(cols, device="cuda") * 1e-2 + 1e-5
    codes, scales = _triton_kernels().RowQuantizer(kind, cols, col_scaled=True)(g, col_scale)
    want_codes, want_scales = quantize_rows(g * col_scale, kind)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_gpu_triton_int8_rounds_half_to_even() -> None:
    _skip_unless_capable("int8")
    scale = torch.add(torch.tensor(1e-30), torch.tensor([[127.0]], device="cuda"), alpha=1 / 127)
    halves = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5]], device="cuda")
    x = halves * scale
    assert torch.equal(x / scale, halves)
    codes, _ = _triton_kernels().RowQuantizer("int8", 8)(x)
    assert codes.tolist() == [[127, 0, 2, 2, -2, 0, 126, -4]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_triton_int8_epilogue_matches_the_aten_passes(dtype: torch.dtype,
                                                          with_bias: bool) -> None:
    _skip_unless_capable("int8")
    torch.manual_seed(1)
    rows, cols = 333, 3080
    acc = torch.randint(-2**24, 2**24, (rows, cols), dtype=torch.int32, device="cuda")
    row_scale = torch.rand(rows, 1, device="cuda") * 1e-3
    col_scale = torch.rand(cols, device="cuda") * 1e-3
    bias = torch.randn(cols, device="cuda").to(dtype) if with_bias else None
    got = _triton_kernels().Int8Epilogue(cols, col_scaled=True)(acc, row_scale, col_scale, bias,
                                                                dtype)
    scaled = torch.mul(acc, col_scale)
    out = torch.empty(rows, cols, dtype=dtype, device="cuda")
    want = (torch.mul(scaled, row_scale, out=out) if bias is None
            else torch.addcmul(bias, scaled, row_scale, out=out))
    if bias is None:
        assert torch.equal(got, want)
    else:  # an fma or not: at most one step of the output dtype
        torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_layer_runs_the_triton_kernels_like_the_aten_ones(kind: str) -> None:
    _skip_unless_capable(kind)
    _triton_kernels()
    from vramkit.quant import w8a8

    layer, _ = _layer(kind, 3072, 1536)
    x = torch.randn(2, 300, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 300, 1536, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert layer._kernel.quantizer == "triton" and layer.kernel == kind
    y.backward(grad)
    grad_x, grad_b = x.grad.clone(), layer.bias.grad.clone()
    x.grad = layer.bias.grad = None
    layer._kernel = w8a8._KERNELS[kind]  # the aten kernel, kept: the device is already checked
    y_aten = layer(x)
    y_aten.backward(grad)
    if kind == "fp8":  # the same codes into the same _scaled_mm
        assert torch.equal(y, y_aten) and torch.equal(grad_x, x.grad)
    else:  # the same sums, scaled in one pass (an fma or not)
        torch.testing.assert_close(y, y_aten, rtol=2.0 ** -7, atol=1e-3)
        torch.testing.assert_close(grad_x, x.grad, rtol=2.0 ** -7, atol=1e-3)
    assert torch.equal(grad_b, layer.bias.grad)
    layer.cpu()
    layer(torch.randn(4, 3072, dtype=torch.bfloat16))
    assert layer._kernel.quantizer == "aten"
