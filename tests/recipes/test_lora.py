"""`vramkit.recipes.lora`: the demo's LoRA adapters (re-exported by `vramkit.recipes.demo`)."""

from __future__ import annotations

import torch

from vramkit.recipes import demo, lora
from vramkit.recipes.dit import DiT, DiTConfig, synthetic_batch
from vramkit.recipes.lora import LoRALinear, add_lora_adapters


def test_lora_adapters_start_at_the_base_model_and_are_the_only_trainable_params() -> None:
    config = DiTConfig.preset("tiny")
    model = DiT(config, seed=0)
    batch = synthetic_batch(config, 2, generator=torch.Generator().manual_seed(0))
    args = (batch["latents"], batch["timesteps"], batch["text"])
    before = model(*args)
    names = ["double_blocks.0", "single_blocks.1"]
    adapters = add_lora_adapters(model, names, rank=4, seed=0)
    # qkv + proj of both streams in a double block, linear1 + linear2 in a single block
    assert len(adapters) == 2 * (4 + 2)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in adapters}
    assert isinstance(model.double_blocks[0].img_attn.qkv, LoRALinear)
    assert not isinstance(model.double_blocks[1].img_attn.qkv, LoRALinear)
    assert all(p.dtype == torch.float32 and p.shape[0 if p.shape[0] == 4 else 1] == 4
               for p in adapters)
    torch.testing.assert_close(model(*args), before, rtol=0, atol=0)  # up starts at zero
    with torch.no_grad():
        model.double_blocks[0].img_attn.qkv.up.fill_(0.1)
    assert not torch.equal(model(*args), before)


def test_the_demo_re_exports_the_lora_layer() -> None:
    assert demo.LoRALinear is lora.LoRALinear
    assert demo.add_lora_adapters is lora.add_lora_adapters
    assert demo.LORA_TARGETS is lora.LORA_TARGETS
