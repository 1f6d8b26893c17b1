"""Tests of vramkit.recipes.presets: each SDXL/Flux option takes effect on tiny diffusers models (CPU).

Models are built from reduced configs with random weights (no downloads). diffusers and peft are
test extras: the module is skipped without them. Options that need modules written elsewhere
(vramkit.tiling, vramkit.quant, vramkit.optim) skip when those are missing.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.offload.checkpointing import is_checkpointed
from vramkit.recipes.presets import (
    FluxTrainingConfig,
    SDXLMemoryConfig,
    optimize_flux_memory,
    optimize_sdxl_memory,
)

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

TXT, SIDE = 8, 4


# -- configs and presets ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"enable_cpu_offload": 1},
    {"attention_slice_size": 2},  # without enable_attention_slicing
    {"enable_attention_slicing": True, "attention_slice_size": 0},
    {"enable_attention_slicing": True, "attention_slice_size": "half"},
    {"vae_tile_size": 500},
    {"vae_tile_size": 64, "vae_tile_overlap": 64},
    {"offload_resident_blocks": -1},
])
def test_sdxl_config_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SDXLMemoryConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"batch_size": 0}, {"mixed_precision": "fp16"}, {"base_model_format": "int2"},
    {"blocks_to_swap": -1}, {"swap_min_tensor_bytes": -1}, {"learning_rate": 0}, {"use_8bit_adam": "yes"},
])
def test_flux_config_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        FluxTrainingConfig(**kwargs)



def test_flux_swap_threshold_is_the_swappers_default() -> None:
    from vramkit.offload.swap import SwapConfig

    assert FluxTrainingConfig().swap_min_tensor_bytes == SwapConfig().min_param_bytes


def test_presets_by_vram() -> None:
    assert SDXLMemoryConfig.for_vram("24GB") == SDXLMemoryConfig.preset_24gb()
    assert SDXLMemoryConfig.for_vram("23.5GiB") == SDXLMemoryConfig.preset_24gb()
    assert SDXLMemoryConfig.for_vram("16GB") == SDXLMemoryConfig.preset_16gb()
    assert SDXLMemoryConfig.for_vram(80 << 30) == SDXLMemoryConfig.preset_24gb()
    assert FluxTrainingConfig.for_vram("24 GB") == FluxTrainingConfig.preset_24gb()
    assert FluxTrainingConfig.for_vram("16GiB") == FluxTrainingConfig.preset_16gb()
    # 8 GB cards have presets now (the point of the tiers); below the 8 GB preset's minimum it raises.
    assert FluxTrainingConfig.for_vram("8GB") == FluxTrainingConfig.preset_8gb()
    with pytest.raises(ConfigError, match="preset_8gb"):
        FluxTrainingConfig.for_vram("6GB")
    p16, p24 = FluxTrainingConfig.preset_16gb(), FluxTrainingConfig.preset_24gb()
    assert p16.blocks_to_swap > p24.blocks_to_swap and p24.quantize_base_model
    # the planner's choices (tests/recipes/test_preset_plans.py): SDXL swaps on the 12 GB card
    # and recomputes on the 8 GB one
    assert SDXLMemoryConfig.preset_12gb().enable_cpu_offload
    assert SDXLMemoryConfig.preset_8gb().enable_gradient_checkpointing
    assert not SDXLMemoryConfig.preset_24gb().enable_cpu_offload
    assert p24.to_dict()["base_model_format"] == "int8"


# -- SDXL ----------------------------------------------------------------------------------------


def _unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        attention_head_dim=(2, 4), norm_num_groups=8, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8)


def _vae() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
        latent_channels=4, norm_num_groups=4, sample_size=64)


def _unet_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([10]),
            "encoder_hidden_states": torch.randn(1, 5, 32, generator=g),
            "added_cond_kwargs": {"text_embeds": torch.randn(1, 32, generator=g),
                                  "time_ids": torch.randn(1, 6, generator=g)}}


def _saved_bytes(model: torch.nn.Module, inputs: dict) -> tuple[int, torch.Tensor]:
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs).sample
    return total[0], out


@pytest.fixture(scope="module")
def unet_reference() -> tuple[torch.nn.Module, torch.Tensor]:
    unet = _unet()
    with torch.no_grad():
        return unet, unet(**_unet_inputs()).sample


def test_sdxl_gradient_checkpointing(unet_reference: tuple) -> None:
    unet = copy.deepcopy(unet_reference[0])
    before, out_ref = _saved_bytes(unet, _unet_inputs())
    handle = optimize_sdxl_memory(SDXLMemoryConfig(enable_gradient_checkpointing=True),
                                  {"unet": unet}, device="cpu")
    assert "gradient_checkpointing" in handle.applied
    assert is_checkpointed(unet.down_blocks[1].attentions[0])
    assert is_checkpointed(unet.up_blocks[1].resnets[0]) and is_checkpointed(unet.mid_block.resnets[0])
    after, out = _saved_bytes(unet, _unet_inputs())
    assert after < 0.7 * before  # activations of checkpointed blocks are not kept
    torch.testing.assert_close(out, out_ref)
    out.square().mean().backward()  # recomputation works
    handle.undo()
    assert not is_checkpointed(unet.down_blocks[1].attentions[0])
    assert _saved_bytes(unet, _unet_inputs())[0] == before


def test_sdxl_attention_slicing(unet_reference: tuple) -> None:
    unet = copy.deepcopy(unet_reference[0])
    config = SDXLMemoryConfig(enable_attention_slicing=True, attention_slice_size=1)
    handle = optimize_sdxl_memory(config, types.SimpleNamespace(unet=unet, vae=None),
                                  device="cpu")
    processors = unet.attn_processors.values()
    assert all(type(p).__name__ == "SlicedAttnProcessor" and p.slice_size == 1
               for p in processors)
    with torch.no_grad():
        torch.testing.assert_close(unet(**_unet_inputs()).sample, unet_reference[1],
                                   rtol=1e-4, atol=1e-5)
    handle.undo()
    assert all(type(p).__name__ != "SlicedAttnProcessor" for p in unet.attn_processors.values())


def test_sdxl_cpu_offload_swaps_unet_blocks(unet_reference: tuple) -> None:
    unet = copy.deepcopy(unet_reference[0]).requires_grad_(False)  # frozen weights are swapped
    config = SDXLMemoryConfig(enable_cpu_offload=True, offload_resident_blocks=2)
    handle = optimize_sdxl_memory(config, unet, device="cpu")
    swapper = handle.swapper
    assert swapper is not None and len(swapper.swapped_names) >= 3
    assert all(".resnets." in n or ".attentions." in n for n in swapper.swapped_names)
    with torch.no_grad():
        out = unet(**_unet_inputs()).sample
    torch.testing.assert_close(out, unet_reference[1])
    assert swapper.stats().loads > 0  # blocks were streamed from their host masters
    handle.undo()
    assert "cpu_offload" not in handle.applied


def test_sdxl_vae_tiling() -> None:
    pytest.importorskip("vramkit.tiling")
    vae = _vae()
    latents = torch.randn(1, 4, 12, 12, generator=torch.Generator().manual_seed(2))
    calls = []
    vae.decoder.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        reference = vae.decode(latents).sample
    assert len(calls) == 1
    calls.clear()
    config = SDXLMemoryConfig(vae_tiling=True, vae_tile_size=64, vae_tile_overlap=16)
    handle = optimize_sdxl_memory(config, {"vae": vae}, device="cpu")
    assert handle.vae_tiling is not None
    with torch.no_grad():
        tiled = vae.decode(latents).sample
    assert tiled.shape == reference.shape == (1, 3, 96, 96)
    assert len(calls) > 1  # the decoder ran tile by tile
    handle.undo()
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(vae.decode(latents).sample, reference)


def test_sdxl_missing_component() -> None:
    with pytest.raises(ConfigError, match="VAE"):
        optimize_sdxl_memory(SDXLMemoryConfig(vae_tiling=True), {"unet": _unet()}, device="cpu")


# -- Flux ----------------------------------------------------------------------------------------


def _flux(lora: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    model.requires_grad_(False)
    if lora:
        model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                          target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


def _flux_batch(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"hidden_states": torch.randn(rows, SIDE * SIDE, 16, generator=g),
            "encoder_hidden_states": torch.randn(rows, TXT, 32, generator=g),
            "pooled_projections": torch.randn(rows, 16, generator=g),
            "timestep": torch.rand(rows, generator=g)}


def _flux_step(model: torch.nn.Module) -> object:
    img_ids = torch.zeros(SIDE * SIDE, 3)
    img_ids[:, 1] = torch.arange(SIDE).repeat_interleave(SIDE)
    img_ids[:, 2] = torch.arange(SIDE).repeat(SIDE)
    rows: list[int] = []

    def step(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        rows.append(micro["hidden_states"].shape[0])
        out = model(**micro, img_ids=img_ids, txt_ids=torch.zeros(TXT, 3), return_dict=False)[0]
        return out.float().square().mean()

    step.rows = rows  # type: ignore[attr-defined]
    return step


def _lora_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _plain(**kw: object) -> FluxTrainingConfig:
    base = {"gradient_checkpointing": False, "mixed_precision": "no"}
    base.update(kw)
    return FluxTrainingConfig(**base)


def test_flux_batch_size_and_training_step() -> None:
    model = _flux()
    handle = optimize_flux_memory(_plain(batch_size=2), model, device="cpu")
    assert isinstance(handle.optimizer, torch.optim.AdamW)
    before = [p.detach().clone() for p in _lora_params(model)]
    step = _flux_step(model)
    result = handle.train_step(step, _flux_batch(4))
    assert step.rows == [2, 2] and result.accumulation_steps == 2
    assert any(not torch.equal(b, p) for b, p in zip(before, _lora_params(model), strict=True))
    assert all(p.grad is None for p in _lora_params(model))  # zeroed after the step


def test_flux_mixed_precision() -> None:
    model = _flux()
    handle = optimize_flux_memory(_plain(mixed_precision="bf16"), model, device="cpu")
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in _lora_params(model))  # fp32 trainable weights
    assert handle.autocast_dtype == torch.bfloat16
    with handle.autocast():
        assert torch.is_autocast_enabled("cpu")
    result = handle.train_step(_flux_step(model), _flux_batch(1))
    assert torch.isfinite(result.loss)


def test_flux_gradient_checkpointing() -> None:
    model = _flux()
    handle = optimize_flux_memory(_plain(gradient_checkpointing=True), model, device="cpu")
    assert is_checkpointed(model.transformer_blocks[0])
    assert is_checkpointed(model.single_transformer_blocks[1])
    handle.train_step(_flux_step(model), _flux_batch(1))
    handle.undo()
    assert not is_checkpointed(model.transformer_blocks[0])


def test_flux_blocks_to_swap() -> None:
    model = _flux()
    # The tiny model's tensors are all below the default 64 KiB threshold: nothing would move.
    default = optimize_flux_memory(_plain(blocks_to_swap=3), _flux(), device="cpu")
    assert default.swapper.swapped_names == []
    default.undo()
    handle = optimize_flux_memory(_plain(blocks_to_swap=3, swap_min_tensor_bytes=0), model,
                                  device="cpu")
    assert len(handle.swapper.swapped_names) == 3
    handle.train_step(_flux_step(model), _flux_batch(1))
    assert handle.swapper.stats().loads > 0
    handle.undo()
    with pytest.raises(ConfigError, match="blocks_to_swap"):
        optimize_flux_memory(_plain(blocks_to_swap=5), _flux(), device="cpu")


def test_flux_cpu_offload_optimizer() -> None:
    from vramkit.offload.optimizer import CPUOffloadOptimizer

    model = _flux()
    handle = optimize_flux_memory(_plain(cpu_offload_optimizer=True, batch_size=1), model,
                                  device="cpu")
    assert isinstance(handle.optimizer, CPUOffloadOptimizer)
    assert isinstance(handle.optimizer.inner, torch.optim.AdamW)
    before = [p.detach().clone() for p in _lora_params(model)]
    handle.train_step(_flux_step(model), _flux_batch(2))  # two accumulated micro-batches
    assert any(not torch.equal(b, p) for b, p in zip(before, _lora_params(model), strict=True))
    handle.undo()


def test_flux_8bit_adam() -> None:
    adamw8bit = pytest.importorskip("vramkit.optim.adamw8bit")
    model = _flux()
    handle = optimize_flux_memory(_plain(use_8bit_adam=True), model, device="cpu")
    assert isinstance(handle.optimizer, adamw8bit.AdamW8bit)
    handle.train_step(_flux_step(model), _flux_batch(1))


def test_flux_quantized_base_keeps_lora() -> None:
    quant_model = pytest.importorskip("vramkit.quant.model")
    linear = pytest.importorskip("vramkit.quant.linear")
    model = _flux()
    optimize_flux_memory(_plain(quantize_base_model=True), model, device="cpu")
    quantized = [n for n, m in model.named_modules() if isinstance(m, linear.QuantizedLinear)]
    assert quantized and not any("lora_" in n for n in quantized)
    assert any(n.endswith("to_q.base_layer") for n in quantized)
    assert all(p.dtype == torch.float32 for p in _lora_params(model))
    assert quant_model is not None


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_flux_base_format_and_optimizer_hyperparameters_take_effect(fmt: str) -> None:
    linear = pytest.importorskip("vramkit.quant.linear")
    model = _flux()
    handle = optimize_flux_memory(_plain(quantize_base_model=True, base_model_format=fmt,
                                         learning_rate=3e-3, weight_decay=0.05), model,
                                  device="cpu")
    formats = {m.quantized_weight.format.value for m in model.modules()
               if isinstance(m, linear.QuantizedLinear)}
    assert formats == {fmt}
    group = handle.optimizer.param_groups[0]
    assert group["lr"] == 3e-3 and group["weight_decay"] == 0.05


@pytest.mark.parametrize(("size", "expected"), [("max", 1), ("auto", None)])
def test_sdxl_attention_slice_size_keywords(unet_reference: tuple, size: str,
                                            expected: int | None) -> None:
    unet = copy.deepcopy(unet_reference[0])
    config = SDXLMemoryConfig(enable_attention_slicing=True, attention_slice_size=size)
    optimize_sdxl_memory(config, types.SimpleNamespace(unet=unet, vae=None), device="cpu")
    sizes = {p.slice_size for p in unet.attn_processors.values()}
    if expected is not None:
        assert sizes == {expected}  # "max": one head per slice
    else:
        assert all(s >= 1 for s in sizes) and sizes != {1}  # "auto": half the heads per slice


def test_flux_needs_trainable_params_for_optimizer_options() -> None:
    with pytest.raises(ConfigError, match="trainable"):
        optimize_flux_memory(_plain(use_8bit_adam=True), _flux(lora=False), device="cpu")
    handle = optimize_flux_memory(_plain(), _flux(lora=False), device="cpu")
    assert handle.optimizer is None
    with pytest.raises(ConfigError):
        handle.train_step(lambda m: torch.zeros(()), torch.zeros(1))


def _prequantized_flux(blocks_only: bool = False) -> torch.nn.Module:
    """A LoRA'd Flux whose frozen Linear layers were quantized (int8) before the verb runs, as a
    load-and-quantize (io.loader's ``quantization=``) leaves them."""
    from vramkit.quant.model import QuantizationConfig, quantize_model

    model = _flux()
    for target in ([model.transformer_blocks, model.single_transformer_blocks] if blocks_only
                   else [model]):
        adapters = [n for n, m in target.named_modules()
                    if n and any(p.requires_grad for p in m.parameters(recurse=False))]
        quantize_model(target, QuantizationConfig(weights_dtype="int8",
                                                  modules_to_not_quantize=tuple(adapters)))
    return model


def _storage_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    linear = pytest.importorskip("vramkit.quant.linear")
    return {f"{n}.{b}": t.dtype for n, m in model.named_modules()
            if isinstance(m, linear.QuantizedLinear) for b, t in m.named_buffers(recurse=False)}


def test_flux_bf16_cast_keeps_prequantized_storage() -> None:
    pytest.importorskip("vramkit.quant.model")
    model = _prequantized_flux()
    before = _storage_dtypes(model)
    assert torch.float32 in before.values()  # the int8 layout's per-row scales
    handle = optimize_flux_memory(_plain(mixed_precision="bf16"), model, device="cpu")
    assert _storage_dtypes(model) == before  # scales were cast to bf16 before the fix
    result = handle.train_step(_flux_step(model), _flux_batch(1))
    assert torch.isfinite(result.loss)


def test_flux_quantize_base_accepts_prequantized_layers() -> None:
    linear = pytest.importorskip("vramkit.quant.linear")
    model = _prequantized_flux(blocks_only=True)  # blocks quantized, embedders still float
    layer = model.transformer_blocks[0].attn.to_q.base_layer
    assert isinstance(layer, linear.QuantizedLinear)
    handle = optimize_flux_memory(_plain(quantize_base_model=True), model, device="cpu")
    assert model.transformer_blocks[0].attn.to_q.base_layer is layer  # kept, not redone
    assert isinstance(model.context_embedder, linear.QuantizedLinear)  # the rest quantized
    assert "quantized before kept" in handle.applied["quantize_base_model"]
    handle.train_step(_flux_step(model), _flux_batch(1))
