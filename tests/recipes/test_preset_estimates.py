"""The SDXL / Flux presets' memory estimates: where their numbers come from, which settings each
card tier gets, and configs that do not fit their card refusing to be built.

The stored model profiles are measured again here on the meta device from the published configs
(diffusers + peft, no weights); the measured peaks on a GPU come from benchmarks/presets.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError
from vramkit.planning._meta import MetaAutocast
from vramkit.recipes import presets
from vramkit.recipes.presets import FluxTrainingConfig, SDXLMemoryConfig
from vramkit.units import format_size, parse_size

TIERS = (8, 12, 16, 24)
CLASSES = (SDXLMemoryConfig, FluxTrainingConfig)


def _preset(cls: type, gigabytes: int) -> SDXLMemoryConfig | FluxTrainingConfig:
    return getattr(cls, f"preset_{gigabytes}gb")()


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


# -- the tiers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("gigabytes", TIERS)
def test_every_tier_has_a_preset_that_fits_its_card(cls: type, gigabytes: int) -> None:
    preset = _preset(cls, gigabytes)
    assert preset.vram == gigabytes * 10**9
    estimate = preset.estimate()
    # Fits both readings of the card's size ("8GB" = 7.45 GiB, "8GiB"), with the margin.
    assert estimate.fits(f"{gigabytes}GB") and estimate.fits(f"{gigabytes}GiB")
    assert estimate.needed <= presets.MemoryEstimate.usable(gigabytes * 10**9)
    assert estimate.minimum_vram <= gigabytes * 10**9


# The settings the estimates choose; docs/recovery_and_presets.md shows the same table.
EXPECTED_SDXL = {
    24: {"enable_gradient_checkpointing": False, "enable_cpu_offload": False},
    16: {"enable_gradient_checkpointing": False, "enable_cpu_offload": True,
         "offload_resident_blocks": 23},
    12: {"enable_gradient_checkpointing": True, "enable_cpu_offload": False},
    8: {"enable_gradient_checkpointing": True, "enable_cpu_offload": True,
        "offload_resident_blocks": 22},
}
EXPECTED_FLUX_SWAPPED = {24: 0, 16: 7, 12: 22, 8: 36}


@pytest.mark.parametrize("gigabytes", TIERS)
def test_presets_are_the_fastest_settings_that_fit(gigabytes: int) -> None:
    sdxl = _preset(SDXLMemoryConfig, gigabytes)
    assert {k: getattr(sdxl, k) for k in EXPECTED_SDXL[gigabytes]} == EXPECTED_SDXL[gigabytes]
    assert sdxl.vae_tiling
    flux = _preset(FluxTrainingConfig, gigabytes)
    assert (flux.quantize_base_model, flux.base_model_format) == (True, "int8")
    assert flux.blocks_to_swap == EXPECTED_FLUX_SWAPPED[gigabytes]
    assert flux.gradient_checkpointing and flux.use_8bit_adam and not flux.cpu_offload_optimizer
    card = gigabytes * 10**9
    # Minimal: one swapped block fewer (or no checkpointing) would not fit the card.
    if flux.blocks_to_swap:
        fewer = dataclasses.replace(flux, blocks_to_swap=flux.blocks_to_swap - 1, vram=None)
        assert not fewer.estimate().fits(card)
    if sdxl.enable_cpu_offload:
        fewer = dataclasses.replace(sdxl, offload_resident_blocks=sdxl.offload_resident_blocks + 1,
                                    vram=None)
        assert not fewer.estimate().fits(card)
    if sdxl.enable_gradient_checkpointing:
        for resident in range(29):
            no_ckpt = dataclasses.replace(sdxl, enable_gradient_checkpointing=False,
                                          enable_cpu_offload=resident < 28,
                                          offload_resident_blocks=resident % 28, vram=None)
            assert not no_ckpt.estimate().fits(card)


@pytest.mark.parametrize("cls", CLASSES)
def test_for_vram_picks_the_largest_preset_that_fits(cls: type) -> None:
    assert cls.for_vram("8GB") == _preset(cls, 8)
    assert cls.for_vram("12GB") == _preset(cls, 12)
    assert cls.for_vram("12GiB") in (_preset(cls, 12), _preset(cls, 16))
    tiers = sorted(TIERS, reverse=True)
    for tenths in range(80, 320, 5):  # 8.0 GB ... 31.5 GB
        vram = tenths * 10**8
        chosen = cls.for_vram(vram)
        assert chosen.estimate().fits(vram)
        larger = tiers[:tiers.index(chosen.vram // 10**9)]
        assert not any(_preset(cls, t).estimate().fits(vram) for t in larger)


def test_for_vram_between_tiers() -> None:
    # A 10 GB card: SDXL's 12 GB preset (6.9 GiB) fits it, Flux's (9.6 GiB) does not.
    assert SDXLMemoryConfig.for_vram("10GB") == SDXLMemoryConfig.preset_12gb()
    assert FluxTrainingConfig.for_vram("10GB") == FluxTrainingConfig.preset_8gb()
    assert FluxTrainingConfig.for_vram(80 << 30) == FluxTrainingConfig.preset_24gb()


@pytest.mark.parametrize("cls", CLASSES)
def test_for_vram_below_the_smallest_preset_names_the_minimum(cls: type) -> None:
    minimum = _preset(cls, 8).estimate().minimum_vram
    with pytest.raises(ConfigError) as info:
        cls.for_vram(minimum - (256 << 20))
    assert format_size(minimum) in str(info.value) and "preset_8gb" in str(info.value)
    assert cls.for_vram(minimum) == _preset(cls, 8)


# -- configs that cannot fit say so when they are made -------------------------------------------


def test_flux_settings_that_do_not_fit_raise_at_construction() -> None:
    with pytest.raises(ConfigError) as info:
        FluxTrainingConfig(vram="8GB")  # the default: bf16 base, nothing swapped
    message = str(info.value)
    assert "needs ~24.8 GiB" in message and "resident weights 22.2 GiB (bf16)" in message
    assert "activations 2.4 GiB (checkpointed)" in message and "6.3 GiB" in message
    swapped = int(re.search(r"blocks_to_swap=(\d+) fits", info.value.hint).group(1))
    # The hint's suggestion is real: it fits, one block fewer does not.
    FluxTrainingConfig(blocks_to_swap=swapped, vram="8GB")
    with pytest.raises(ConfigError):
        FluxTrainingConfig(blocks_to_swap=swapped - 1, vram="8GB")
    with pytest.raises(ConfigError, match="no checkpointing"):
        FluxTrainingConfig(gradient_checkpointing=False, quantize_base_model=True, vram="24GB")
    with pytest.raises(ConfigError, match=r"activations 9\.6 GiB"):  # 4 rows: 4x 2.4 GiB
        dataclasses.replace(FluxTrainingConfig.preset_8gb(), batch_size=4)
    with pytest.raises(ConfigError, match="mixed_precision"):
        FluxTrainingConfig(mixed_precision="no", vram="24GB")
    FluxTrainingConfig()  # without vram nothing is checked
    FluxTrainingConfig(mixed_precision="no")


def test_sdxl_settings_that_do_not_fit_raise_at_construction() -> None:
    with pytest.raises(ConfigError) as info:
        SDXLMemoryConfig(vram="8GB")
    assert "no checkpointing" in str(info.value) and "8.0 GB" in str(info.value)
    assert "SDXLMemoryConfig.for_vram('8.0 GB')" in info.value.hint
    with pytest.raises(ConfigError, match="No SDXL preset fits"):
        SDXLMemoryConfig(enable_gradient_checkpointing=True, vram="4GB")
    SDXLMemoryConfig(enable_gradient_checkpointing=True, vram="12GB")
    SDXLMemoryConfig()


@pytest.mark.parametrize("vram", ["lots", True, -1])
def test_vram_is_validated(vram: object) -> None:
    with pytest.raises(ConfigError):
        SDXLMemoryConfig(vram=vram)
    with pytest.raises(ConfigError):
        FluxTrainingConfig(vram=vram)


def test_vram_is_stored_in_bytes() -> None:
    assert FluxTrainingConfig(quantize_base_model=True, vram="24GB").vram == parse_size("24GB")
    assert SDXLMemoryConfig.preset_12gb().to_dict()["vram"] == 12 * 10**9


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
