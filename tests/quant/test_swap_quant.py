"""Quantized blocks under BlockSwapper: the packed bytes are what is swapped, and a quantized DiT
with LoRA adapters trains identically swapped and unswapped (CPU swapper; GPU version below)."""

from __future__ import annotations

import pytest
import torch

from vramkit.offload.swap import BlockSwapper, SwapConfig, SwapStats
from vramkit.quant.formats import Int4Config, NF4Config, QuantConfigT
from vramkit.quant.linear import QuantizedLinear
from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.recipes.demo import add_lora_adapters
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch


def _config(hidden: int = 128, dtype: str = "float32") -> DiTConfig:
    return DiTConfig(hidden_size=hidden, num_heads=2, num_double_blocks=1, num_single_blocks=2,
                     in_channels=4, image_size=8, text_dim=32, text_tokens=8, dtype=dtype)


def _block_names(config: DiTConfig) -> list[str]:
    return ([f"double_blocks.{i}" for i in range(config.num_double_blocks)]
            + [f"single_blocks.{i}" for i in range(config.num_single_blocks)])


# The 4-bit formats without their clipping search: the same layout and bytes, quantized faster.
FAST = {"int8": "int8", "fp8": "fp8", "int4": Int4Config(clip_search=1),
        "nf4": NF4Config(clip_search=1)}


def _quantized_lora_dit(fmt: str | QuantConfigT, device: str = "cpu") -> tuple[DiT, list[torch.nn.Parameter]]:
    config = _config()
    model = DiT(config, seed=0, device=device)
    params = add_lora_adapters(model, _block_names(config), rank=4, seed=0)
    # LoRALinear keeps its adapters as parameters, so quantizing afterwards replaces exactly
    # the frozen base layers (and the embedders), never the adapters.
    quantize_model(model, QuantizationConfig(fmt))
    with torch.no_grad():
        for p in params[1::2]:  # "up" starts at zero; give the adapters a non-trivial start
            p.normal_(0.0, 0.02, generator=torch.Generator(device=p.device).manual_seed(1))
    return model, params


BLOCKS = ["double_blocks", "single_blocks"]  # one double block: "auto" wants two of a kind


def _train(fmt: str | QuantConfigT, swap: bool, device: str = "cpu", steps: int = 2
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], SwapStats | None]:
    model, params = _quantized_lora_dit(fmt, device)
    assert isinstance(model.double_blocks[0].img_attn.qkv.base, QuantizedLinear)
    swapper = None
    if swap:
        swapper = BlockSwapper(model, BLOCKS, config=SwapConfig(min_param_bytes=1024),
                               device=device)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    generator = torch.Generator(device=device).manual_seed(0)
    batch = synthetic_batch(model.config, 2, generator=generator)
    losses = []
    for _ in range(steps):
        loss = flow_matching_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    stats = None
    if swapper is not None:
        stats = swapper.stats()
        swapper.detach()
    return losses, [p.detach().clone() for p in params], stats


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_lora_dit_trains_identically_swapped(fmt: str) -> None:
    ref_losses, ref_params, _ = _train(FAST[fmt], swap=False)
    losses, params, stats = _train(FAST[fmt], swap=True)
    assert stats is not None and stats.swapped_blocks == 3 and stats.loads > 0
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(params, ref_params, strict=True):
        assert torch.equal(got, want)
    assert ref_losses[-1] < ref_losses[0]  # it does train


def _swapped_bytes(model: DiT) -> tuple[int, set[str]]:
    model.requires_grad_(False)
    swapper = BlockSwapper(model, BLOCKS, config=SwapConfig(min_param_bytes=0), device="cpu")
    try:
        names = {e.attr for b in swapper.blocks for e in b.entries}
        return swapper.stats().swapped_bytes, names
    finally:
        swapper.detach()


@pytest.mark.parametrize(("fmt", "ratio"), [("int8", 0.53), ("fp8", 0.53), ("nf4", 0.28),
                                             ("int4", 0.29)])
def test_swapped_bytes_are_the_packed_bytes(fmt: str, ratio: float) -> None:
    config = _config(hidden=256, dtype="bfloat16")
    bf16_bytes, bf16_names = _swapped_bytes(DiT(config, seed=0))
    model = quantize_model(DiT(config, seed=0), QuantizationConfig(FAST[fmt]))
    quant_bytes, names = _swapped_bytes(model)
    assert "weight" in bf16_names and "weight_data" in names and "weight_scales" in names
    assert quant_bytes <= ratio * bf16_bytes, quant_bytes / bf16_bytes
    assert quant_bytes >= (ratio - 0.06) * bf16_bytes  # the packed bytes, not nothing


def test_default_threshold_swaps_the_large_packed_buffers() -> None:
    config = _config(hidden=256, dtype="bfloat16")
    model = quantize_model(DiT(config, seed=0), QuantizationConfig("int8"))
    model.requires_grad_(False)
    with BlockSwapper(model, BLOCKS, device="cpu") as swapper:  # min_param_bytes = 64 KiB
        entries = {(type(e.owner).__name__, e.attr) for b in swapper.blocks for e in b.entries}
        assert ("QuantizedLinear", "weight_data") in entries
        x = torch.randn(1, config.num_tokens, 256, dtype=torch.bfloat16)
        vec = torch.randn(1, 256, dtype=torch.bfloat16)
        from vramkit.recipes.dit import rotary_embedding

        rope = rotary_embedding(config.text_tokens, 4, config.head_dim)
        with torch.no_grad():
            swapped = model.single_blocks[0](x, vec, rope)
    with torch.no_grad():
        assert torch.equal(model.single_blocks[0](x, vec, rope), swapped)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8"])
def test_gpu_quantized_lora_dit_trains_identically_swapped(fmt: str) -> None:
    ref_losses, ref_params, _ = _train(fmt, swap=False, device="cuda")
    losses, params, stats = _train(fmt, swap=True, device="cuda")
    assert stats is not None and stats.swapped_blocks == 3 and stats.h2d_bytes > 0
    for got, want in zip(losses, ref_losses, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_h2d_bytes_are_the_packed_bytes() -> None:
    config = _config(hidden=256, dtype="bfloat16")
    results = {}
    for fmt in (None, "int8", "nf4"):
        model = DiT(config, seed=0, device="cuda")
        if fmt is not None:
            quantize_model(model, QuantizationConfig(fmt))
        model.requires_grad_(False)
        batch = synthetic_batch(config, 1, generator=torch.Generator("cuda").manual_seed(0))
        with BlockSwapper(model, BLOCKS, config=SwapConfig(min_param_bytes=0),
                          device="cuda") as swapper:
            with torch.no_grad():
                model(batch["latents"], batch["timesteps"], batch["text"])
            torch.cuda.synchronize()
            results[fmt] = swapper.stats().h2d_bytes
    assert results["int8"] <= 0.55 * results[None]
    assert results["nf4"] <= 0.30 * results[None]
