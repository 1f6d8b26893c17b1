"""The SDXL / Flux presets' memory estimates (``config.estimate()``, a breakdown by stored block
profiles): where their numbers come from and that every setting moves them. Which settings each
card tier gets, and configs that do not fit refusing to be built, are the planner's:
tests/recipes/test_preset_plans.py.

The stored model profiles are measured again here on the meta device from the published configs
(diffusers + peft, no weights); the measured peaks on a GPU come from benchmarks/presets.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.planning._meta import MetaAutocast
from vramkit.recipes import presets
from vramkit.recipes.presets import FluxTrainingConfig, SDXLMemoryConfig

# -- where the numbers come from ------------------------------------------------------------------


def test_published_configs_build_the_published_models() -> None:
    diffusers = pytest.importorskip("diffusers")
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**presets.SDXL_UNET_CONFIG)
        flux = diffusers.FluxTransformer2DModel(**presets.FLUX_DEV_TRANSFORMER_CONFIG)
    # The parameter counts of the released checkpoints (stabilityai SDXL base 1.0, FLUX.1-dev).
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    assert sum(p.numel() for p in flux.parameters()) == 11_901_408_320


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sdxl", "flux"])
def test_stored_profiles_are_what_the_meta_models_measure(model: str) -> None:
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    measured = presets.measure_model_profile(model)
    assert measured == presets.PROFILES[model]
    # The stored blocks are the ones the verbs checkpoint and swap, in the swapper's order.
    assert len(measured.block_rows()) == (28 if model == "sdxl" else 57)


def test_meta_autocast_follows_cuda_autocasts_rules() -> None:
    x = torch.empty(2, 8, device="meta")  # fp32
    w = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    with MetaAutocast():
        assert F.linear(x, w).dtype == torch.bfloat16
        assert F.layer_norm(F.linear(x, w), (4,)).dtype == torch.float32
        q = torch.empty(1, 2, 16, 8, device="meta")
        # diffusers' dispatcher calls attention with keywords; they are passed on positionally
        out = F.scaled_dot_product_attention(query=q, key=q, value=q)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_activation_estimate_sees_keyword_attention_under_meta_autocast() -> None:
    from vramkit.planning.activations import estimate_activations

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(h).view(1, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(query=q, key=k, value=v)
            return out.transpose(1, 2).reshape(1, 64, 32)

    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
    x = torch.empty(1, 64, 32, device="meta", requires_grad=True)

    def step() -> torch.Tensor:
        with MetaAutocast():
            return model(x).float().square().mean()

    saved = estimate_activations(model, step, ["0", "1"])
    # q, k, v and the output, each 1x2x64x16 in bf16, are counted (the call had keywords)
    assert saved.per_block["0"] >= 4 * 2 * 64 * 16 * 2


# -- every setting moves the estimate -----------------------------------------------------------


def test_flux_estimate_follows_every_setting() -> None:
    base = FluxTrainingConfig(quantize_base_model=True)
    e = base.estimate()
    assert e.swap_slots == 0 and e.swapped_blocks == 0 and e.blocks == 57
    swapped = dataclasses.replace(base, blocks_to_swap=30).estimate()
    assert swapped.swapped_blocks == 30 and swapped.resident_weights < e.resident_weights
    double = presets.PROFILES["flux"].blocks[0].swapped["int8"]
    assert swapped.swap_slots == 2 * double  # R slots of the largest swapped block
    formats = {f: dataclasses.replace(base, base_model_format=f).estimate().resident_weights
               for f in ("int8", "int4", "nf4", "fp8")}
    bf16 = FluxTrainingConfig().estimate().resident_weights
    assert formats["nf4"] < formats["int8"] < bf16 and formats["int4"] < formats["fp8"] < bf16
    assert bf16 > 22 * 2**30  # 11.9 B parameters in bf16
    no_ckpt = dataclasses.replace(base, gradient_checkpointing=False).estimate()
    assert no_ckpt.activations > 5 * e.activations and not no_ckpt.checkpointing
    assert dataclasses.replace(base, batch_size=2).estimate().activations == 2 * e.activations
    adamw = e.optimizer
    assert dataclasses.replace(base, use_8bit_adam=True).estimate().optimizer < adamw / 3
    assert dataclasses.replace(base, cpu_offload_optimizer=True).estimate().optimizer == 0
    assert e.adapters == 8 * presets.PROFILES["flux"].adapter_params  # fp32 weights + grads
    assert e.needed == (e.resident_weights + e.swap_slots + e.adapters + e.optimizer
                        + e.activations)


def test_sdxl_estimate_follows_every_setting() -> None:
    base = SDXLMemoryConfig()
    e = base.estimate()
    assert e.blocks == 28 and e.swapped_blocks == 0 and not e.checkpointing
    ckpt = dataclasses.replace(base, enable_gradient_checkpointing=True).estimate()
    assert ckpt.activations < e.activations / 3
    offload = dataclasses.replace(base, enable_cpu_offload=True, offload_resident_blocks=0)
    all_swapped = offload.estimate()
    assert all_swapped.swapped_blocks == 28 and all_swapped.resident_weights < 100 << 20
    largest = max(r.swapped["bf16"] for r in presets.PROFILES["sdxl"].blocks)
    assert all_swapped.swap_slots == 2 * largest
    some = dataclasses.replace(offload, offload_resident_blocks=20).estimate()
    assert some.swapped_blocks == 8
    assert all_swapped.resident_weights < some.resident_weights < e.resident_weights
    assert 4.7 * 2**30 < e.resident_weights < 4.9 * 2**30  # 2.57 B parameters in bf16
    assert e.to_dict()["needed"] == e.needed
