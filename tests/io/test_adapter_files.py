"""LoRA adapters saved in the layouts users load (vramkit.io.adapter_files), read back by the
real loaders installed here: peft's ``set_peft_model_state_dict``, diffusers' FLUX
``lora_state_dict`` (its kohya conversion included) and ``load_lora_adapter``, on diffusers'
``FluxTransformer2DModel`` at a tiny size; and a kohya-style network's weights converted to
peft and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._toys import KohyaLoRANetwork, Stack
from vramkit.errors import ConfigError
from vramkit.io.adapter_files import (
    LORA_LAYOUTS,
    adapter_state_dict,
    load_adapters,
    lora_factors,
    save_adapters,
)

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
RANK, ALPHA = 4, 8  # alpha / rank a power of two: diffusers' kohya conversion folds it exactly


def _flux() -> nn.Module:
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    return model.requires_grad_(False)


def _adapted(seed: int = 1) -> nn.Module:
    model = _flux()
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                 init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero: give the adapters something to carry
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    side, txt = 4, 3
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side).repeat_interleave(side)
    img_ids[:, 2] = torch.arange(side).repeat(side)
    return {"hidden_states": torch.randn(1, side * side, 16, generator=g),
            "encoder_hidden_states": torch.randn(1, txt, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "timestep": torch.rand(1, generator=g), "img_ids": img_ids,
            "txt_ids": torch.zeros(txt, 3)}


def _out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs(), return_dict=False)[0]


def test_peft_layout_loads_through_peft(tmp_path: Path) -> None:
    source = _adapted()
    path = save_adapters(source, tmp_path / "a.safetensors", layout="peft")
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    config = json.loads(meta["lora_config"])
    assert (config["r"], config["lora_alpha"], meta["vramkit.lora_layout"]) == (RANK, ALPHA,
                                                                                  "peft")
    state = load_file(str(path))
    assert state.keys() == get_peft_model_state_dict(source).keys()
    target = _flux()
    target.add_adapter(LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                                  target_modules=config["target_modules"]))
    set_peft_model_state_dict(target, state)
    assert torch.equal(_out(target), _out(source))
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed


@pytest.mark.parametrize("layout,prefix", [("diffusers", None),
                                           ("kohya", "lora_transformer")])
def test_diffusers_loads_the_diffusers_and_kohya_layouts(tmp_path: Path, layout: str,
                                                         prefix: str | None) -> None:
    source = _adapted()
    path = save_adapters(source, tmp_path / "a.safetensors", layout=layout, prefix=prefix)
    state, metadata = diffusers.FluxPipeline.lora_state_dict(str(path),
                                                             return_lora_metadata=True)
    assert all(k.startswith("transformer.") for k in state)
    target = _flux()
    target.load_lora_adapter(state, prefix="transformer", metadata=metadata)
    assert torch.equal(_out(target), _out(source))


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
@pytest.mark.parametrize("prefix", [None, "transformer."])
def test_every_layout_reads_back(tmp_path: Path, layout: str, prefix: str | None) -> None:
    if prefix is not None and layout in ("peft", "kohya"):
        prefix = "lora_transformer" if layout == "kohya" else "base_model.model."
    source = _adapted()
    factors = lora_factors(source)
    assert len(factors) == 4 + 3  # the double block's attention, the single block's (no to_out)
    path = save_adapters(source, tmp_path / "a.safetensors", layout=layout, prefix=prefix)
    back = load_adapters(path, prefix=prefix, model=source)
    assert back.keys() == factors.keys()
    for name, f in factors.items():
        assert torch.equal(back[name].down, f.down) and torch.equal(back[name].up, f.up)
        assert back[name].alpha == f.alpha == ALPHA


def test_comfyui_keys() -> None:
    state = adapter_state_dict(_adapted(), "comfyui")
    assert "diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight" in state
    assert float(state["diffusion_model.transformer_blocks.0.attn.to_q.alpha"]) == ALPHA
    state = adapter_state_dict(_adapted(), "comfyui", prefix="transformer.")
    assert "transformer.single_transformer_blocks.0.attn.to_k.lora_up.weight" in state


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.o = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(torch.tanh(self.q(x)))


def test_a_kohya_network_converts_to_peft_and_back() -> None:
    base = Stack(Block, 2, seed=0).requires_grad_(False)
    net = KohyaLoRANetwork(base, ["q", "o"], rank=4, alpha=2.0).apply_to()
    with torch.no_grad():
        for lora in net.loras:
            lora.lora_up.weight.normal_(std=0.1)
    x = torch.randn(3, 16)
    want = base(x)
    kohya = net.kohya_state_dict()
    mine = adapter_state_dict(base, "kohya")  # what the trainer itself saves
    assert mine.keys() == kohya.keys() and all(torch.equal(mine[k], v) for k, v in kohya.items())
    factors = load_adapters(kohya, model=base)  # kohya names back into module paths
    assert sorted(factors) == [f"blocks.{i}.{n}" for i in range(2) for n in ("o", "q")]
    fresh = Stack(Block, 2, seed=0).requires_grad_(False)
    model = peft.get_peft_model(fresh, LoraConfig(r=4, lora_alpha=2.0,
                                                  target_modules=["q", "o"]))
    # a PeftModel (get_peft_model) holds the model under base_model.model.
    state = adapter_state_dict(factors, "peft", prefix="base_model.model.")
    assert state.keys() == get_peft_model_state_dict(model).keys()
    set_peft_model_state_dict(model, state)
    assert torch.equal(model(x), want)
    again = adapter_state_dict(model, "kohya")
    assert again.keys() == kohya.keys()
    assert all(torch.equal(again[k], v) for k, v in kohya.items())


def test_lycoris_loha_is_refused_with_its_own_way_out() -> None:
    lycoris = pytest.importorskip("lycoris")
    base = Stack(Block, 2, seed=0).requires_grad_(False)
    net = lycoris.create_lycoris(base, 1.0, linear_dim=4, linear_alpha=4.0, algo="loha",
                                 warn_on_unmatched=False)
    net.apply_to()
    with pytest.raises(ConfigError, match=r"not LoRA factors.*LohaModule") as info:
        lora_factors(base)
    assert "save_weights" in (info.value.hint or "")


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="holds no LoRA layer"):
        lora_factors(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="no LoRA keys"):
        load_adapters({"w": torch.zeros(1)})
    with pytest.raises(ConfigError):
        adapter_state_dict({}, "safetensors")
