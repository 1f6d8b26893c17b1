"""W8A8Linear on the CPU: torch's CPU ``_int_mm`` and ``_scaled_mm`` run the same code as CUDA, so
the numerics are checked against a float reference of the math (per-token activation scales,
per-channel weight scales) and the 8-bit backward against autograd on the dequantized weight."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant import w8a8
from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.quant.w8a8 import W8A8Linear, check_w8a8_device, quantize_rows, w8a8_fits

KINDS = ["int8", "fp8"]
QMAX = {"int8": 127.0, "fp8": 448.0}
CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Relative error of y (and grad_x) against the unquantized float layer, bf16 activations.
REL_ERROR = {"int8": 0.02, "fp8": 0.07}


def _reference_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantization in float64: scale = amax / QMAX, codes rounded to the format."""
    x64 = x.double()
    scale = x64.abs().amax(-1, keepdim=True) / QMAX[kind]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    ratio = (x64 / safe).clamp(-QMAX[kind], QMAX[kind])
    codes = ratio.round() if kind == "int8" else ratio.float().to(CODES[kind]).double()
    return codes, scale


def _reference_forward(x: torch.Tensor, layer: W8A8Linear) -> torch.Tensor:
    """y = s_x s_w sum_k Q_x Q_w + b, in float64 from the layer's stored codes."""
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale = _reference_rows(x2, layer.kind)
    w = layer.weight.double() * layer.weight_scale.double()[:, None]
    y = (codes * scale) @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], -1)


def _layer(kind: str, n_in: int = 64, n_out: int = 48, bias: bool = True,
           seed: int = 0) -> tuple[W8A8Linear, nn.Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(n_in, n_out, bias=bias)
    reference = nn.Linear(n_in, n_out, bias=bias)
    reference.load_state_dict(linear.state_dict())
    return W8A8Linear.from_linear(linear, kind), reference


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm()
                 / want.detach().double().norm())


# -- per-row quantization ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_scales_per_row_and_reaches_the_format_max(kind: str) -> None:
    x = torch.randn(8, 64, dtype=torch.bfloat16) * torch.logspace(-3, 3, 8)[:, None]
    codes, scale = quantize_rows(x, kind)
    assert codes.dtype == CODES[kind] and scale.shape == (8, 1)
    assert scale.dtype == torch.float32
    ref_codes, ref_scale = _reference_rows(x, kind)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    # every row uses the whole range: its largest element lands on +-QMAX
    assert torch.equal(codes.float().abs().amax(-1), torch.full((8,), QMAX[kind]))
    # float32 vs float64 division: at most one step of the format apart (at a rounding tie)
    assert (codes.double() - ref_codes).abs().max() <= (1 if kind == "int8" else 32)
    assert _rel(codes.double() * scale.double(), x) < (0.01 if kind == "int8" else 0.04)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_saturates_and_zero_rows_stay_finite(kind: str) -> None:
    x = torch.randn(4, 32)
    x[0] = 0.0  # scale would be 0: codes must be 0, not 0/0
    x[1, 3] = 3.0e38  # an outlier near float32's max
    x[2, 5] = -1e-38
    codes, scale = quantize_rows(x, kind)
    assert torch.isfinite(codes.float()).all() and torch.isfinite(scale).all()
    assert codes.float().abs().max() <= QMAX[kind]
    assert torch.equal(codes[0].float(), torch.zeros(32)) and scale[0, 0] > 0
    assert codes[1, 3].float() == QMAX[kind]


# -- forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_the_reference_math(kind: str) -> None:
    layer, reference = _layer(kind)
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)  # 3-D input, 21 tokens
    y = layer(x)
    assert y.shape == (3, 7, 48) and y.dtype == torch.bfloat16
    emulated = _reference_forward(x, layer)
    assert _rel(y, emulated) < 0.01  # bf16 output rounding only
    assert _rel(y, reference(x.float())) < REL_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_other_input_dtypes(kind: str, dtype: torch.dtype) -> None:
    layer, reference = _layer(kind)
    x = torch.randn(20, 64, dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    assert _rel(y, reference(x.float())) < REL_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_zero_rows_in_x_and_in_w(kind: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[5] = 0.0
    bias = linear.bias.detach().clone()
    layer = W8A8Linear.from_linear(linear, kind)
    assert torch.equal(layer.weight[5].float(), torch.zeros(64))
    x = torch.randn(20, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        x[3] = 0.0
    y = layer(x)
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y[3].float(), bias.to(torch.bfloat16).float())
    torch.testing.assert_close(y[:, 5].float(), bias[5].expand(20).to(torch.bfloat16).float())
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("kind", KINDS)
def test_few_tokens_and_no_bias(kind: str) -> None:
    layer, reference = _layer(kind, bias=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)  # fewer rows than _int_mm takes on CUDA
    assert _rel(layer(x), reference(x.float())) < REL_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_odd_shapes_dequantize_that_layer_and_say_so(kind: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vramkit.quant.w8a8"):
        layer, reference = _layer(kind, n_in=36, n_out=20)
    assert layer.kernel == "dequantize"
    assert sum("dequantized matmul" in r.getMessage() for r in caplog.records) == 1
    x = torch.randn(2, 5, 36, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.dequantized_weight(), layer.bias))
    assert _rel(y, reference(x)) < REL_ERROR[kind]
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_fits_follows_each_gemm_multiple() -> None:
    assert w8a8_fits("fp8", 64, 48) and not w8a8_fits("fp8", 40, 48)
    assert w8a8_fits("int8", 40, 24) and not w8a8_fits("int8", 36, 24)
    assert _layer("int8", n_in=40, n_out=24)[0].kernel == "int8"


def test_autocast_casts_the_input() -> None:
    layer, _ = _layer("int8")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(20, 64))
    assert y.dtype == torch.bfloat16


def test_wrong_features_and_integer_inputs_raise() -> None:
    layer, _ = _layer("int8")
    with pytest.raises(QuantizationError, match="features"):
        layer(torch.randn(4, 32))
    with pytest.raises(QuantizationError, match="floating-point"):
        layer(torch.ones(4, 64, dtype=torch.int64))


# -- backward ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_backward_in_8_bits_matches_autograd_on_the_dequantized_weight(kind: str) -> None:
    layer, _ = _layer(kind, n_in=128, n_out=96)
    x = torch.randn(4, 9, 128, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn(4, 9, 96)
    (layer(x).float() - target).square().sum().backward()
    x_ref = x.detach().float().requires_grad_()
    bias_ref = layer.bias.detach().clone().requires_grad_()
    (F.linear(x_ref, layer.dequantized_weight(), bias_ref) - target).square().sum().backward()
    cosine = F.cosine_similarity(x.grad.double().flatten(), x_ref.grad.double().flatten(), dim=0)
    assert cosine >= 0.99
    assert _rel(x.grad, x_ref.grad) < 2 * REL_ERROR[kind]
    assert _rel(layer.bias.grad, bias_ref.grad) < 2 * REL_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_grad_input_math_matches_the_reference(kind: str) -> None:
    """grad_x = s_h Q_h Q_w with h = g * s_w: the scales go into g before it is quantized."""
    layer, _ = _layer(kind, n_in=64, n_out=48)
    g = torch.randn(20, 48)
    got = layer._kernel.grad_input(g, layer.weight, layer.weight_scale, torch.float32)
    codes, scale = _reference_rows(g * layer.weight_scale, kind)
    want = (codes * scale) @ layer.weight.double()
    # fp8: float32 vs float64 rounding puts a few codes one fp8 step apart
    assert _rel(got, want) < (1e-5 if kind == "int8" else 1e-2)


def test_weight_never_requires_grad_and_bias_keeps_its_own() -> None:
    layer, _ = _layer("fp8")
    assert not layer.weight.requires_grad and not layer.weight_scale.requires_grad
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    layer.requires_grad_(True)
    assert not layer.weight.requires_grad
    layer.bias.requires_grad_(False)
    x = torch.randn(20, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.bias.grad is None


def test_no_grad_path_equals_the_autograd_path() -> None:
    layer, _ = _layer("int8")
    x = torch.randn(20, 64)
    with torch.no_grad():
        plain = layer(x)
    assert torch.equal(plain, layer(x.requires_grad_()))


# -- storage -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_and_dtype_moves_keep_codes(kind: str) -> None:
    layer, _ = _layer(kind)
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale", "bias"}
    assert state["weight"].dtype == CODES[kind]
    fresh = W8A8Linear(torch.zeros(48, 64, dtype=CODES[kind]), torch.zeros(48),
                       torch.zeros(48))
    fresh.load_state_dict(state)
    x = torch.randn(20, 64)
    assert torch.equal(fresh(x), layer(x))
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == CODES[kind] and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16
    assert layer.weight_nbytes == 48 * 64 + 48 * 4


def test_bad_codes_and_kinds_raise() -> None:
    with pytest.raises(QuantizationError, match="float8_e4m3fn or int8"):
        W8A8Linear(torch.zeros(4, 16), torch.ones(4))
    with pytest.raises(QuantizationError, match="weight_scale"):
        W8A8Linear(torch.zeros(4, 16, dtype=torch.int8), torch.ones(5))
    with pytest.raises(QuantizationError, match="'fp8' or 'int8'"):
        W8A8Linear.from_linear(nn.Linear(16, 16), "nf4")  # type: ignore[arg-type]


# -- device capability ---------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "capability", "message"), [
    ("fp8", (8, 0), "fp8 needs a CUDA GPU of compute capability >= 8.9; cuda:0 has 8.0"),
    ("int8", (7, 5), "int8 needs a CUDA GPU of compute capability >= 8.0; cuda:0 has 7.5"),
])
def test_unsupported_capability_raises_with_a_hint(monkeypatch: pytest.MonkeyPatch, kind: str,
                                                   capability: tuple[int, int],
                                                   message: str) -> None:
    monkeypatch.setattr(w8a8, "_device_capability", lambda device: capability)
    with pytest.raises(QuantizationError, match=message) as info:
        check_w8a8_device(kind, "cuda:0")
    assert info.value.hint and ("int8" in info.value.hint or "weight-only" in info.value.hint)


def test_supported_capability_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(w8a8, "_device_capability", lambda device: (9, 0))
    check_w8a8_device("fp8", "cuda:0")
    check_w8a8_device("int8", torch.device("cuda", 0))
    check_w8a8_device("fp8", "cpu")


# -- the model walk ------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(64, 64)
        self.odd = nn.Linear(64, 36)
        self.trained = nn.Linear(36, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_model_w8a8_replaces_frozen_layers_only(kind: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    model = _Net()
    model.frozen.requires_grad_(False)
    model.odd.requires_grad_(False)
    with caplog.at_level(logging.INFO):
        quantize_model(model, QuantizationConfig(kind, w8a8=True))
    assert isinstance(model.frozen, W8A8Linear) and model.frozen.kernel == kind
    assert isinstance(model.odd, W8A8Linear) and model.odd.kernel == "dequantize"
    assert type(model.trained) is nn.Linear
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "odd" in messages and "trainable" in messages
    y = model.trained(model.odd(model.frozen(torch.randn(20, 64))))
    assert y.shape == (20, 32)


def test_quantize_model_w8a8_warns_when_everything_is_trainable(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _Net()
    with caplog.at_level(logging.WARNING):
        quantize_model(model, QuantizationConfig("int8", w8a8=True))
    assert type(model.frozen) is nn.Linear
    assert any("requires_grad_(False)" in r.getMessage() for r in caplog.records)


def test_w8a8_config_validation_and_round_trip() -> None:
    config = QuantizationConfig("fp8", w8a8=True, modules_to_not_quantize=["odd"])
    assert config.w8a8_kind == "fp8"
    assert QuantizationConfig.from_dict(config.to_dict()) == config
    assert QuantizationConfig("int8", w8a8=True).w8a8_kind == "int8"
    assert QuantizationConfig("int8").w8a8_kind is None
    for bad in (dict(weights_dtype="nf4"), dict(weights_dtype="int8", group_size=64),
                dict(weights_dtype="fp8", activations_dtype="fp8")):
        with pytest.raises(ConfigError, match="w8a8"):
            QuantizationConfig(**bad, w8a8=True)  # type: ignore[arg-type]


def test_peft_base_layer_is_replaced_and_adapters_kept() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["0", "2"],
                                                       init_lora_weights=False))
    quantize_model(model, QuantizationConfig("int8", w8a8=True))
    replaced = [n for n, m in model.named_modules() if isinstance(m, W8A8Linear)]
    assert sorted(replaced) == ["base_model.model.0.base_layer", "base_model.model.2.base_layer"]
    adapters = [n for n, m in model.named_modules() if "lora_" in n and type(m) is nn.Linear]
    assert len(adapters) == 4
    x = torch.randn(20, 64, requires_grad=True)
    model(x).square().sum().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    assert x.grad is not None


def test_fp8_on_a_cpu_without_row_wise_scaled_mm_matches_the_kernel(monkeypatch) -> None:
    """torch < 2.13 on the CPU takes per-tensor scales only: the fp32 emulation gives what the
    row-wise kernel gives (the same codes and scales)."""
    from vramkit.quant import w8a8

    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    layer = W8A8Linear.from_linear(lin, "fp8", release_weight=False)
    x = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(5, 32, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(g)
    grad = x.grad.clone()
    x.grad = None

    def refuse(*args, **kwargs):
        raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")

    flag = w8a8.CPU_ROWWISE_FP8  # one list, shared with the traced path
    saved, flag[0] = flag[0], True
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    try:
        y_emulated = layer(x)
        y_emulated.backward(g)
        assert not flag[0]
    finally:
        flag[0] = saved
    torch.testing.assert_close(y_emulated, y, rtol=2.0 ** -7, atol=1e-2)
    torch.testing.assert_close(x.grad, grad, rtol=2.0 ** -7, atol=1e-2)


# Aten calls of one eager layer call on the CPU (the aten kernels; CUDA with triton runs fewer):
# a regression guard on the host's per-call work. Forward of a 2-D input, then its backward
# (the input and bias gradients; autograd's own accumulation calls included).
ATEN_CALLS = {"fp8": (7, 11), "int8": (10, 14)}


@pytest.mark.parametrize("kind", KINDS)
def test_eager_call_makes_no_more_aten_calls_than_it_did(kind: str) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = _layer(kind)[0].to(torch.bfloat16)  # the bias in the input's dtype: no cast
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(32, 48, dtype=torch.bfloat16)
    layer(x).backward(g)  # first call: device check, kernel choice, cached unit scales
    with Count() as forward:
        y = layer(x)
    with Count() as backward:
        y.backward(g)
    most_forward, most_backward = ATEN_CALLS[kind]
    assert len(forward.calls) <= most_forward, forward.calls
    assert len(backward.calls) <= most_backward, backward.calls


def test_a_meta_input_gives_the_output_shape_for_a_planner_pass() -> None:
    # A model already holding W8A8 layers is planned on the meta device (under autocast).
    layer = _layer("int8")[0].to("meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.empty(2, 5, 64, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 5, 48)
