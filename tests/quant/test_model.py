"""QuantizationConfig and quantize_model: selection, patterns, memory, state dicts, errors."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant.formats import FP8Config, NF4Config, QuantFormat, QuantizedTensor
from vramkit.quant.linear import QuantizedConv2d, QuantizedLinear
from vramkit.quant.model import (
    QuantizationConfig,
    QuantoConfig,
    model_bytes,
    quantizable_layers,
    quantize_model,
    quantize_weight,
    quantized_layer,
    sqnr_db,
)

# Weight bytes vs bf16 (the targets), scales included.
TARGET_RATIO = {"int8": 0.52, "fp8": 0.52, "int4": 0.28, "nf4": 0.27}


class _Block(nn.Module):
    def __init__(self, dim: int = 64, bias: bool = True) -> None:
        super().__init__()
        self.attn = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(3 * dim, dim, bias=bias)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.attn(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, dim: int = 64, bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=bias)
        self.embed = nn.Linear(8, dim, bias=bias)
        self.blocks = nn.ModuleList(_Block(dim, bias) for _ in range(2))
        self.head = nn.Linear(dim, 4, bias=bias)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.conv(image).mean((2, 3))
        x = self.embed(x)[:, None, :]
        for block in self.blocks:
            x = block(x)
        return self.head(x)[:, 0]


def _net(seed: int = 0, **kwargs: Any) -> _Net:
    torch.manual_seed(seed)
    return _Net(**kwargs)


# -- config ----------------------------------------------------------------------------------


def test_config_resolves_formats_and_group_size() -> None:
    assert QuantizationConfig("int8").weight_format().format is QuantFormat.INT8
    assert QuantizationConfig(QuantFormat.NF4, group_size=64).weight_format().block_size == 64
    custom = NF4Config(double_quant=False)
    assert QuantizationConfig(custom).weight_format() is custom
    assert QuantoConfig is QuantizationConfig


@pytest.mark.parametrize("kwargs", [
    dict(weights_dtype="int3"),
    dict(weights_dtype="int8", group_size=0),
    dict(weights_dtype="int4", group_size=-2),
    dict(weights_dtype="int8", group_size=True),
    dict(weights_dtype="int8", activations_dtype="fp8"),
    dict(weights_dtype="nf4", activations_dtype="fp8"),
    dict(weights_dtype="fp8", group_size=64, activations_dtype="fp8"),  # block scales
    dict(weights_dtype="fp8", activations_dtype="int8"),
    dict(weights_dtype="int8", modules_to_not_quantize=[1]),
    dict(weights_dtype="int8", min_sqnr_db=float("nan")),
    dict(weights_dtype="int8", min_sqnr_db="20"),
    dict(weights_dtype="int8", quantize_conv="yes"),
])
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        QuantizationConfig(**kwargs)


def test_config_activations_fp8_with_fp8_channel_weights() -> None:
    config = QuantizationConfig("fp8", activations_dtype=QuantFormat.FP8)
    assert config.activations_dtype == "fp8" and config.activation_fp8
    assert isinstance(config.weight_format(), FP8Config)


def test_config_patterns_are_tuples_and_a_string_is_one_pattern() -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize="head")
    assert config.modules_to_not_quantize == ("head",)
    config = QuantizationConfig("int8", modules_to_not_quantize=["a", "b.*"])
    assert config.modules_to_not_quantize == ("a", "b.*")


def test_config_round_trips_through_a_dict() -> None:
    for config in (QuantizationConfig("int4", modules_to_not_quantize=["head"], group_size=32,
                                      min_sqnr_db=12.5, quantize_conv=False),
                   QuantizationConfig(NF4Config(double_quant=False)),
                   QuantizationConfig("fp8", activations_dtype="fp8")):
        data = json.loads(json.dumps(config.to_dict()))
        assert QuantizationConfig.from_dict(data) == config
    with pytest.raises(ConfigError):
        QuantizationConfig.from_dict({"weights_dtype": "int8", "bits": 8})


def test_is_excluded_matches_names_and_ancestors() -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize=["blocks.0", "*.proj"])
    assert config.is_excluded("blocks.0")
    assert config.is_excluded("blocks.0.attn")  # an ancestor matches
    assert config.is_excluded("blocks.1.proj")
    assert not config.is_excluded("blocks.1.attn")
    assert not config.is_excluded("blocks.10.attn")  # "blocks.0" is not a prefix pattern
    assert not config.is_excluded("")


# -- modules_to_not_quantize: names as bitsandbytes / Hugging Face users write them ------------


def test_a_name_matches_whole_path_components_anywhere() -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize=["proj_out"])
    assert config.is_excluded("proj_out")
    assert config.is_excluded("transformer.proj_out")  # a suffix: the model was wrapped
    assert config.is_excluded("pipe.transformer.proj_out.lora_A")  # inside it
    assert not config.is_excluded("proj_out_extra")
    assert not config.is_excluded("transformer.proj_out_extra")
    assert not config.is_excluded("transformer.my_proj_out")
    attn = QuantizationConfig("int8", modules_to_not_quantize=["attn"])
    assert attn.is_excluded("blocks.0.attn.to_q")  # a path component in the middle
    assert attn.is_excluded("blocks.0.attn")
    assert not attn.is_excluded("blocks.0.attn2.to_q")
    assert not attn.is_excluded("blocks.0.self_attn.to_q")
    dotted = QuantizationConfig("int8", modules_to_not_quantize=["attn.to_q", "blocks.0"])
    assert dotted.is_excluded("transformer.blocks.3.attn.to_q")
    assert not dotted.is_excluded("transformer.blocks.3.attn.to_k")
    assert dotted.is_excluded("transformer.blocks.0.ff")
    assert not dotted.is_excluded("transformer.blocks.01.ff")
    assert not dotted.is_excluded("transformer.blocks.10.ff")


def test_shell_patterns_match_runs_of_components() -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize=["*norm*", "final_layer*",
                                                                 "*.proj", "to_?"])
    assert config.is_excluded("blocks.0.norm1.linear")
    assert config.is_excluded("transformer.norm_out.linear")
    assert config.is_excluded("final_layer.linear")
    assert config.is_excluded("transformer.final_layer_2.adaLN")
    assert config.is_excluded("blocks.1.proj")
    assert not config.is_excluded("proj")  # "*.proj" wants a component before it
    assert config.is_excluded("blocks.0.attn.to_q")
    assert not config.is_excluded("blocks.0.attn.to_out")
    assert not config.is_excluded("blocks.0.attn.qkv")


@settings(max_examples=300, deadline=None)
@given(name=st.lists(st.sampled_from(["a", "b", "ab", "0", "1", "10"]), min_size=1, max_size=6),
       pattern=st.lists(st.sampled_from(["a", "b", "ab", "0", "1", "10"]), min_size=1,
                        max_size=3))
def test_a_plain_name_matches_exactly_when_it_is_a_dotted_substring_of_components(
        name: list[str], pattern: list[str]) -> None:
    qualified, wanted = ".".join(name), ".".join(pattern)
    config = QuantizationConfig("int8", modules_to_not_quantize=[wanted])
    assert config.is_excluded(qualified) == (f".{wanted}." in f".{qualified}.")


def test_quantize_model_keeps_a_named_layer_of_a_wrapped_model() -> None:
    torch.manual_seed(0)
    transformer = nn.Module()
    transformer.blocks = nn.ModuleList(_Block(32) for _ in range(2))
    transformer.proj_out = nn.Linear(32, 16)
    transformer.proj_out_extra = nn.Linear(32, 16)
    pipeline = nn.Module()
    pipeline.transformer = transformer  # named as in a pipeline: "transformer.proj_out"
    config = QuantizationConfig("int8", modules_to_not_quantize=["proj_out", "attn"])
    names = [name for name, _ in quantizable_layers(pipeline, config)]
    assert names == ["transformer.blocks.0.proj", "transformer.blocks.1.proj",
                     "transformer.proj_out_extra"]
    quantize_model(pipeline, config)
    assert type(transformer.proj_out) is nn.Linear
    assert type(transformer.blocks[0].attn) is nn.Linear
    assert type(transformer.blocks[1].attn) is nn.Linear
    assert isinstance(transformer.proj_out_extra, QuantizedLinear)
    assert isinstance(transformer.blocks[0].proj, QuantizedLinear)
    state = {"transformer.proj_out.weight": torch.randn(16, 32),
             "transformer.proj_out_extra.weight": torch.randn(16, 32)}
    out = quantize_model(state, config)
    assert out["transformer.proj_out.weight"] is state["transformer.proj_out.weight"]
    assert isinstance(out["transformer.proj_out_extra.weight"], QuantizedTensor)


def test_modules_to_not_quantize_on_a_diffusers_flux_transformer() -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    pipeline = nn.Module()
    pipeline.transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6))
    config = QuantizationConfig("nf4", modules_to_not_quantize=["proj_out", "norm_out", "to_q"])
    quantize_model(pipeline, config)
    flux = pipeline.transformer
    assert type(flux.proj_out) is nn.Linear
    assert type(flux.norm_out.linear) is nn.Linear
    assert type(flux.transformer_blocks[0].attn.to_q) is nn.Linear
    assert type(flux.single_transformer_blocks[0].attn.to_q) is nn.Linear
    assert isinstance(flux.transformer_blocks[0].attn.to_k, QuantizedLinear)
    assert type(flux.single_transformer_blocks[0].proj_out) is nn.Linear  # "proj_out" too
    assert isinstance(flux.x_embedder, QuantizedLinear)


@pytest.mark.parametrize("bad", ["", ".proj_out", "proj_out.", "blocks..attn"])
def test_a_name_that_can_match_no_module_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="can match no module"):
        QuantizationConfig("int8", modules_to_not_quantize=["head", bad])


def test_quantize_model_warns_about_a_name_that_matches_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize=["head", "haed", "*nrom*"])
    with caplog.at_level(logging.WARNING, logger="vramkit.quant.model"):
        model = quantize_model(_net(), config)
    assert type(model.head) is nn.Linear
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert "'*nrom*' matches no module" in warned[0]
    assert "'haed' matches no module" in warned[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vramkit.quant.model"):
        quantize_model(_net().state_dict(), config)
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vramkit.quant.model"):
        quantize_model(_net(), QuantizationConfig("int8", modules_to_not_quantize=["head"]))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_should_quantize_selects_linear_and_conv() -> None:
    config = QuantizationConfig("int8")
    assert config.should_quantize("x", nn.Linear(4, 4))
    assert config.should_quantize("x", nn.Conv2d(4, 4, 3))
    assert not config.should_quantize("x", nn.LayerNorm(4))
    assert not QuantizationConfig("int8", quantize_conv=False).should_quantize(
        "x", nn.Conv2d(4, 4, 3))
    mha = nn.MultiheadAttention(8, 2)
    assert not config.should_quantize("attn.out_proj", mha.out_proj)


# -- quantize_model on modules -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4", "fp8"])
def test_model_outputs_stay_close(fmt: str) -> None:
    model = _net()
    image = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = model(image)
    quantize_model(model, QuantizationConfig(fmt))
    with torch.no_grad():
        out = model(image)
    error = float((out - ref).norm() / ref.norm())
    assert error < {"int8": 0.03, "fp8": 0.1}.get(fmt, 0.2), error


def test_layers_are_replaced_in_place() -> None:
    model = _net()
    bias = model.embed.bias
    assert quantize_model(model, QuantizationConfig("int8")) is model
    assert isinstance(model.conv, QuantizedConv2d)
    assert isinstance(model.embed, QuantizedLinear) and model.embed.bias is bias
    assert isinstance(model.blocks[1].proj, QuantizedLinear)
    assert isinstance(model.blocks[0].norm, nn.LayerNorm)


def test_quantize_conv_false_keeps_convolutions() -> None:
    model = quantize_model(_net(), QuantizationConfig("int8", quantize_conv=False))
    assert type(model.conv) is nn.Conv2d
    assert isinstance(model.embed, QuantizedLinear)


def test_modules_to_not_quantize_is_honoured() -> None:
    config = QuantizationConfig("int4", modules_to_not_quantize=["head", "blocks.1", "*.attn"])
    model = quantize_model(_net(), config)
    assert type(model.head) is nn.Linear
    assert type(model.blocks[1].proj) is nn.Linear and type(model.blocks[1].attn) is nn.Linear
    assert type(model.blocks[0].attn) is nn.Linear
    assert isinstance(model.blocks[0].proj, QuantizedLinear)
    assert isinstance(model.embed, QuantizedLinear)


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4", "fp8"])
def test_model_bytes_drop_to_the_target_ratio(fmt: str) -> None:
    torch.manual_seed(0)
    # Long rows, as in real models: the per-row scale is then a negligible overhead.
    model = nn.Sequential(nn.Linear(1024, 128, bias=False), nn.GELU(),
                          nn.Linear(128, 1024, bias=False)).to(torch.bfloat16)
    model[2] = nn.Linear(1024, 128, bias=False).to(torch.bfloat16)
    weights = [model[0].weight, model[2].weight]
    before = model_bytes(model)
    quantize_model(model, QuantizationConfig(fmt))
    after = model_bytes(model)
    assert after / before <= TARGET_RATIO[fmt], after / before
    assert all(w.numel() == 0 for w in weights)  # the float storage was released


def test_quantizing_an_already_quantized_model_raises() -> None:
    model = quantize_model(_net(), QuantizationConfig("int8", modules_to_not_quantize=["head"]))
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(model, QuantizationConfig("int4"))
    # The float layers left over can be quantized by excluding the quantized ones.
    rest = QuantizationConfig("int4", modules_to_not_quantize=["conv", "embed", "blocks"])
    quantize_model(model, rest)
    assert isinstance(model.head, QuantizedLinear)
    assert model.head.weight_format.value == "int4"
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(model.head, QuantizationConfig("int8"))


def test_a_bare_linear_returns_its_quantized_replacement() -> None:
    layer = quantize_model(nn.Linear(16, 8), QuantizationConfig("nf4"))
    assert isinstance(layer, QuantizedLinear)


def test_meta_models_raise() -> None:
    with torch.device("meta"):
        model = _Net()
    with pytest.raises(QuantizationError, match="meta"):
        quantize_model(model, QuantizationConfig("int8"))


def test_tied_weights_stay_in_full_precision() -> None:
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False),
                          nn.Linear(16, 4))
    model[1].weight = model[0].weight
    quantize_model(model, QuantizationConfig("int8"))
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear
    assert model[0].weight.shape == (16, 16)
    assert isinstance(model[2], QuantizedLinear)


def test_a_module_registered_twice_is_replaced_at_both_places() -> None:
    shared = nn.Linear(16, 16)
    model = nn.Module()
    model.a = shared
    model.b = shared
    quantize_model(model, QuantizationConfig("int8"))
    assert isinstance(model.a, QuantizedLinear) and model.a is model.b


def test_multihead_attention_keeps_working() -> None:
    model = nn.Sequential(nn.MultiheadAttention(16, 2, batch_first=True))
    quantize_model(model, QuantizationConfig("int8"))
    x = torch.randn(2, 5, 16)
    out, _ = model[0](x, x, x)
    assert out.shape == (2, 5, 16)


def test_activations_fp8_config_marks_the_layers() -> None:
    model = quantize_model(_net(), QuantizationConfig("fp8", activations_dtype="fp8",
                                                      quantize_conv=False))
    assert model.blocks[0].attn.activation_fp8 and model.blocks[1].proj.activation_fp8
    # 8 -> 64 and 64 -> 4: the fp8 GEMM needs multiples of 16, these run weight-only.
    assert not model.embed.activation_fp8 and not model.head.activation_fp8
    plain = quantize_model(_net(), QuantizationConfig("fp8", quantize_conv=False))
    assert not plain.blocks[0].attn.activation_fp8


def _outlier_weight(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=g)
    weight[:, ::32] *= 40.0  # one large value per block: the others lose their resolution
    # (int8 SQNR ~38 dB against ~45 dB for a Gaussian weight)
    return weight


def test_min_sqnr_db_keeps_outlier_layers_in_full_precision() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(256, 64))
    with torch.no_grad():
        model[1].weight.copy_(_outlier_weight())
    quantize_model(model, QuantizationConfig("int8", min_sqnr_db=42.0))
    assert isinstance(model[0], QuantizedLinear)
    assert type(model[1]) is nn.Linear and model[1].weight.shape == (64, 256)
    # Without the threshold the outlier layer is quantized.
    plain = nn.Sequential(nn.Linear(256, 64))
    with torch.no_grad():
        plain[0].weight.copy_(_outlier_weight())
    quantize_model(plain, QuantizationConfig("int8"))
    assert isinstance(plain[0], QuantizedLinear)


def test_sqnr_db() -> None:
    x = torch.randn(1000)
    assert sqnr_db(x, x) == float("inf")
    assert sqnr_db(x, x * 0.9) == pytest.approx(20.0, rel=1e-5)
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == float("-inf")


# -- the walk's parts: quantizable_layers, quantize_weight, quantized_layer --------------------


def test_quantizable_layers_is_what_quantize_model_replaces() -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize=["blocks.1"])
    names = [name for name, _ in quantizable_layers(_net(), config)]
    assert names == ["conv", "embed", "blocks.0.attn", "blocks.0.proj", "head"]
    model = quantize_model(_net(), config)
    replaced = [name for name, m in model.named_modules() if isinstance(
        m, (QuantizedLinear, QuantizedConv2d))]
    assert replaced == names
    no_conv = QuantizationConfig("int8", quantize_conv=False)
    assert "conv" not in [name for name, _ in quantizable_layers(_net(), no_conv)]


def test_quantizable_layers_skips_tied_quantized_and_root_layers_and_reads_nothing() -> None:
    with torch.device("meta"):
        tied = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False),
                             nn.Linear(16, 4))
    tied[1].weight = tied[0].weight
    assert [name for name, _ in quantizable_layers(tied, QuantizationConfig("int8"))] == ["2"]
    assert quantizable_layers(nn.Linear(4, 4), QuantizationConfig("int8")) == []
    shared = nn.Linear(16, 16)
    twice = nn.Module()
    twice.a = shared
    twice.b = shared
    assert quantizable_layers(twice, QuantizationConfig("int8")) == [("a", shared)]
    partly = quantize_model(_net(), QuantizationConfig("int8", modules_to_not_quantize=["head"]))
    # the quantized layers are not selected again (quantize_model refuses them before walking)
    assert [name for name, _ in quantizable_layers(partly, QuantizationConfig("int8"))] == [
        "head"]


def test_quantize_weight_and_quantized_layer_rebuild_quantize_model() -> None:
    config = QuantizationConfig("fp8", activations_dtype="fp8")
    reference = quantize_model(_net(), config)
    model = _net()
    model.eval()
    for name, layer in quantizable_layers(model, config):
        q = quantize_weight(layer.weight, config, name=f"{name}.weight")
        assert q is not None
        new = quantized_layer(layer, q, layer.bias, config, name=name)
        want = reference.get_submodule(name)
        assert type(new) is type(want) and not new.training
        assert new.bias is layer.bias
        for key, tensor in new.quantized_weight.tensors().items():
            other = want.quantized_weight.tensors()[key]
            assert torch.equal(tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor,
                               other.view(torch.uint8) if other.dtype.itemsize == 1 else other)
        if isinstance(new, QuantizedLinear):
            # the fp8 GEMM takes 64 -> 192 and 192 -> 64, not 8 -> 64 nor 64 -> 4
            assert new.activation_fp8 is want.activation_fp8
            assert new.activation_fp8 is (name.startswith("blocks"))


def test_quantize_weight_honours_min_sqnr_db_and_refuses_meta() -> None:
    config = QuantizationConfig("int8", min_sqnr_db=42.0)
    assert quantize_weight(_outlier_weight(), config) is None
    assert isinstance(quantize_weight(torch.randn(64, 256), config), QuantizedTensor)
    with pytest.raises(QuantizationError, match="meta"):
        quantize_weight(torch.empty(4, 4, device="meta"), config, name="x.weight")
    with pytest.raises(QuantizationError):
        quantized_layer(nn.LayerNorm(4), quantize_weight(torch.randn(4, 4), config), None,
                        config)


# -- quantize_model on state dicts -------------------------------------------------------------


def test_state_dict_quantizes_float_matrices_and_passes_the_rest() -> None:
    state = _net().state_dict()
    original = {k: v.clone() for k, v in state.items()}
    out = quantize_model(state, QuantizationConfig("nf4", modules_to_not_quantize=["head"]))
    assert isinstance(out["embed.weight"], QuantizedTensor)
    assert isinstance(out["conv.weight"], QuantizedTensor)  # 4-D with quantize_conv
    assert out["conv.weight"].shape == (8, 3, 3, 3)
    assert out["embed.bias"] is state["embed.bias"]
    assert out["blocks.0.norm.weight"] is state["blocks.0.norm.weight"]  # 1-D
    assert out["head.weight"] is state["head.weight"]  # excluded
    for key, value in state.items():  # the input is untouched
        assert torch.equal(value, original[key])
    recovered = out["embed.weight"].dequantize(torch.float32)
    assert sqnr_db(state["embed.weight"], recovered) > 15


def test_state_dict_respects_quantize_conv_and_rejects_quantized_entries() -> None:
    state = _net().state_dict()
    out = quantize_model(state, QuantizationConfig("int8", quantize_conv=False))
    assert isinstance(out["conv.weight"], torch.Tensor)
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(out, QuantizationConfig("int8"))
    with pytest.raises(ConfigError):
        quantize_model([1, 2], QuantizationConfig("int8"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        quantize_model(_net(), "int8")  # type: ignore[arg-type]


def test_state_dict_min_sqnr_db_keeps_outliers() -> None:
    state = {"a.weight": torch.randn(64, 256), "b.weight": _outlier_weight()}
    out = quantize_model(state, QuantizationConfig("int8", min_sqnr_db=42.0))
    assert isinstance(out["a.weight"], QuantizedTensor)
    assert out["b.weight"] is state["b.weight"]


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_gpu_memory_allocated_drops(fmt: str) -> None:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)]).to(
        device="cuda", dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated() - start
    quantize_model(model, QuantizationConfig(fmt))
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - start
    assert after <= (TARGET_RATIO[fmt] + 0.01) * before, (after, before)
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    assert model(x).shape == (8, 2048)
