"""QuantizedLinear / QuantizedConv2d: forward, gradients, storage, dtype moves, compile, LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import QuantizationError
from vramkit.quant.formats import QuantizedTensor, quantize_tensor
from vramkit.quant.linear import QuantizedConv2d, QuantizedLinear, register_peft_lora

FORMATS = ["int8", "int4", "nf4", "fp8"]


def _linear(in_features: int = 70, out_features: int = 33, bias: bool = True,
            seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


def _reference_weight(layer: QuantizedLinear | QuantizedConv2d) -> torch.Tensor:
    return layer.quantized_weight.dequantize(torch.float32).reshape(layer.quantized_weight.shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_and_gradients_match_the_dequantized_reference(fmt: str) -> None:
    layer = QuantizedLinear.from_linear(_linear(), fmt)
    weight = _reference_weight(layer)
    x = torch.randn(2, 5, 70, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    bias_ref = layer.bias.detach().clone().requires_grad_(True)
    out = layer(x)
    ref = F.linear(x_ref, weight, bias_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, bias_ref.grad, rtol=1e-5, atol=1e-5)


def test_weight_is_packed_buffers_only_and_gets_no_gradient() -> None:
    layer = QuantizedLinear.from_linear(_linear(bias=False), "int8")
    assert list(layer.parameters()) == []
    buffers = dict(layer.named_buffers())
    assert "weight_data" in buffers and "weight_scales" in buffers
    assert all(not b.requires_grad for b in buffers.values())
    assert layer.weight_nbytes == layer.quantized_weight.nbytes
    x = torch.randn(4, 70, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None
    assert all(b.grad is None for b in layer.buffers())


def test_backward_saves_packed_bytes_not_a_full_precision_weight() -> None:
    layer = QuantizedLinear.from_linear(_linear(in_features=128, out_features=64), "nf4")
    packed = {b.data_ptr() for b in layer.buffers()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(8, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    assert saved, "backward needs the packed weight"
    assert all(t.data_ptr() in packed for t in saved)
    assert not any(t.shape == (64, 128) and t.is_floating_point() for t in saved)
    out.sum().backward()
    torch.testing.assert_close(x.grad, _reference_weight(layer).sum(0).expand(8, 128))


def test_frozen_bias_gets_no_gradient_but_input_does() -> None:
    linear = _linear()
    linear.bias.requires_grad_(False)
    layer = QuantizedLinear.from_linear(linear, "int8")
    x = torch.randn(3, 70, requires_grad=True)
    layer(x).sum().backward()
    assert layer.bias.grad is None and x.grad is not None


def test_from_linear_releases_the_original_weight_unless_asked_not_to() -> None:
    linear = _linear()
    bias = linear.bias
    layer = QuantizedLinear.from_linear(linear, "int4")
    assert linear.weight.numel() == 0  # storage gone even though `linear` is still referenced
    assert layer.bias is bias  # the same Parameter: optimizers keep working
    kept = _linear()
    QuantizedLinear.from_linear(kept, "int4", release_weight=False)
    assert kept.weight.shape == (33, 70)


def test_group_size_override_changes_the_layout() -> None:
    small = QuantizedLinear.from_linear(_linear(in_features=128), "int8", group_size=16,
                                        release_weight=False)
    large = QuantizedLinear.from_linear(_linear(in_features=128), "int8", group_size=64)
    assert small.quant_config.block_size == 16 and large.quant_config.block_size == 64
    assert small.weight_nbytes > large.weight_nbytes


def test_quantizing_twice_and_bad_inputs_raise() -> None:
    layer = QuantizedLinear.from_linear(_linear(), "int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        QuantizedLinear.from_linear(layer, "int8")  # type: ignore[arg-type]
    with pytest.raises(QuantizationError):
        QuantizedLinear.from_linear(nn.Conv2d(3, 4, 3), "int8")  # type: ignore[arg-type]
    meta = nn.Linear(8, 8, device="meta")
    with pytest.raises(QuantizationError, match="meta"):
        QuantizedLinear.from_linear(meta, "int8")
    with pytest.raises(QuantizationError):
        QuantizedLinear.from_linear(_linear().double(), "int8")
    with pytest.raises(QuantizationError, match="floating"):
        layer(torch.ones(2, 70, dtype=torch.long))
    with pytest.raises(QuantizationError, match="2-D"):
        QuantizedLinear(quantize_tensor(torch.randn(4, 3, 2), "int8"))


def test_activation_fp8_needs_fp8_channel_weights_and_a_capable_gpu() -> None:
    with pytest.raises(QuantizationError, match="fp8"):
        QuantizedLinear.from_linear(_linear(), "int8", activation_fp8=True)
    with pytest.raises(QuantizationError, match="fp8"):
        QuantizedLinear.from_linear(_linear(in_features=128), "fp8", group_size=64,
                                    activation_fp8=True)
    layer = QuantizedLinear.from_linear(_linear(), "fp8", activation_fp8=True)
    assert layer.activation_fp8
    with pytest.raises(QuantizationError):  # the fp8 GEMM does not exist on a CPU
        layer(torch.randn(2, 70))
    layer.activation_fp8 = False  # the knob decides the path
    assert layer(torch.randn(2, 70)).shape == (2, 33)


def test_to_dtype_keeps_the_packed_storage_and_casts_the_bias() -> None:
    layer = QuantizedLinear.from_linear(_linear(), "fp8")
    dtypes = {name: b.dtype for name, b in layer.named_buffers()}
    packed = {name: b.clone() for name, b in layer.named_buffers()}
    layer.to(torch.bfloat16)
    assert {name: b.dtype for name, b in layer.named_buffers()} == dtypes
    for name, b in layer.named_buffers():
        assert torch.equal(b.view(torch.uint8), packed[name].view(torch.uint8)), name
    assert layer.bias.dtype == torch.bfloat16
    assert layer.quantized_weight.dtype == torch.bfloat16
    assert layer.dequantized_weight().dtype == torch.bfloat16
    out = layer(torch.randn(3, 70, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_state_dict_round_trip_into_a_fresh_layer() -> None:
    layer = QuantizedLinear.from_linear(_linear(), "int4")
    other = QuantizedLinear.from_linear(_linear(seed=1), "int4")
    other.load_state_dict(layer.state_dict())
    x = torch.randn(4, 70)
    assert torch.equal(layer(x), other(x))


def test_autocast_runs_in_the_autocast_dtype() -> None:
    layer = QuantizedLinear.from_linear(_linear(), "int8")
    x = torch.randn(4, 70)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    ref = F.linear(x.bfloat16(), _reference_weight(layer).bfloat16(), layer.bias.bfloat16())
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert layer(x).dtype == torch.float32  # outside autocast: the input's dtype


def test_torch_compile_matches_eager() -> None:
    torch._dynamo.reset()
    layer = QuantizedLinear.from_linear(_linear(), "nf4")
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(2, 3, 70, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = compiled(x)
    ref = layer(x_ref)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    grad_compiled = x.grad.clone()
    ref.sum().backward()
    torch.testing.assert_close(grad_compiled, x_ref.grad)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(stride=2, padding=1),
    dict(padding="same", padding_mode="reflect"),
    dict(groups=2, dilation=2, padding=2, bias=False),
])
def test_conv2d_forward_and_gradients_match(kwargs: dict) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, **kwargs)
    reference_conv = copy.deepcopy(conv)
    layer = QuantizedConv2d.from_conv2d(conv, "int8")
    assert conv.weight.numel() == 0
    with torch.no_grad():
        reference_conv.weight.copy_(_reference_weight(layer))
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = layer(x), reference_conv(x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    if conv.bias is not None:
        torch.testing.assert_close(layer.bias.grad, reference_conv.bias.grad, rtol=1e-5,
                                   atol=1e-5)


def test_conv2d_errors() -> None:
    layer = QuantizedConv2d.from_conv2d(nn.Conv2d(2, 2, 3), "int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        QuantizedConv2d.from_conv2d(layer, "int8")  # type: ignore[arg-type]
    with pytest.raises(QuantizationError, match="4-D"):
        QuantizedConv2d(quantize_tensor(torch.randn(4, 4), "int8"))


class _TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    return x, torch.randn(64, 8, generator=g)


def _train(model: nn.Module, params: list[torch.Tensor], steps: int = 20) -> list[float]:
    x, y = _regression_data()
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_vramkit_lora_trains_on_a_quantized_base() -> None:
    from vramkit.recipes.demo import LoRALinear

    torch.manual_seed(0)
    model = _TinyRegressor()
    model.fc1 = QuantizedLinear.from_linear(model.fc1, "nf4")
    model.fc2 = QuantizedLinear.from_linear(model.fc2, "int8")
    model.fc1 = LoRALinear(model.fc1, rank=4)  # type: ignore[arg-type]
    model.fc2 = LoRALinear(model.fc2, rank=4)  # type: ignore[arg-type]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 4  # down/up of each adapter; the biases were frozen
    before = {name: b.clone() for name, b in model.named_buffers()}
    losses = _train(model, trainable)
    assert losses[-1] < 0.8 * losses[0]
    for name, b in model.named_buffers():  # the quantized base never changed
        assert torch.equal(b, before[name]), name


def test_peft_lora_trains_on_a_quantized_base() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = _TinyRegressor()
    model.fc1 = QuantizedLinear.from_linear(model.fc1, "int4")
    model.fc2 = QuantizedLinear.from_linear(model.fc2, "fp8")
    config = register_peft_lora(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"]))
    peft_model = peft.get_peft_model(model, config)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in names)
    losses = _train(peft_model, trainable)
    assert losses[-1] < 0.8 * losses[0]
    lora_layer = peft_model.base_model.model.fc1
    assert isinstance(lora_layer.base_layer, QuantizedLinear)
    with pytest.raises(QuantizationError, match="merge"):
        lora_layer.merge()


def test_quantized_tensor_weight_alias() -> None:
    layer = QuantizedLinear.from_linear(_linear(), "int8")
    assert isinstance(layer.weight, QuantizedTensor)
    assert layer.weight.device == torch.device("cpu")
    assert layer.weight_format.value == "int8"
    assert "int8" in repr(layer) or "Int8" in repr(layer)


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_forward_and_backward_match_the_cpu_reference(fmt: str) -> None:
    linear = _linear(in_features=256, out_features=384, dtype=torch.bfloat16)
    layer = QuantizedLinear.from_linear(linear, fmt).cuda()
    weight = _reference_weight(layer).bfloat16()
    x = torch.randn(4, 37, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = layer(x)
    ref = F.linear(x_ref, weight, layer.bias.detach())
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_gpu_torch_compile_with_triton() -> None:
    torch._dynamo.reset()
    layer = QuantizedLinear.from_linear(_linear(in_features=256, out_features=512,
                                                dtype=torch.bfloat16), "int4").cuda()
    compiled = torch.compile(layer)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = compiled(x), layer(x_ref)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    ref.float().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_fp8_activations_use_the_fp8_gemm() -> None:
    from vramkit.quant import kernels

    if not kernels.has_fp8_gemm(torch.device("cuda")):
        pytest.skip("this GPU/torch has no row-wise fp8 GEMM")
    linear = _linear(in_features=512, out_features=256, dtype=torch.bfloat16)
    layer = QuantizedLinear.from_linear(linear, "fp8", activation_fp8=True).cuda()
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    ref = F.linear(x.detach(), _reference_weight(layer).bfloat16(), layer.bias.detach())
    error = (out.float() - ref.float()).norm() / ref.float().norm()
    assert error < 5e-2
    layer.activation_fp8 = False
    weight_only = layer(x.detach())
    assert not torch.equal(out.detach(), weight_only)  # the knob switched the GEMM
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
