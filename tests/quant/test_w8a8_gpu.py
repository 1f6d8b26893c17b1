"""W8A8Linear on a CUDA GPU: the fp8 (capability >= 8.9) and int8 (>= 8.0) GEMMs against the float
reference of the math, the 8-bit backward, a FLUX-shaped layer, and the host time per call
(printed, not asserted: run with -s to see it)."""

from __future__ import annotations

import time

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
