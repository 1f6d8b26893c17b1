"""load_into on a meta-built model: non-persistent buffers (never in checkpoints) are recomputed
where the model offers a way (transformers' ``_init_weights``), loaded weights are never
overwritten while that runs, and whatever stays on meta is named in a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model
from torch import nn

from vramkit.io._buffers import recompute_meta_buffers
from vramkit.io.loader import MemoryEfficientLoader, load_into

transformers = pytest.importorskip("transformers")


def tiny_llama_config(tie: bool) -> object:
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_llama_load_into_matches_the_normal_model(tmp_path: Path, tie: bool) -> None:
    config = tiny_llama_config(tie)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path / "model.safetensors"
    if tie:
        save_model(reference, str(path))  # drops the tied duplicate
    else:
        save_file(reference.state_dict(), path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    result = load_into(model, path)
    rotary = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert result.still_meta == []
    assert set(result.initialized_buffers) == rotary
    for name, buffer in model.named_buffers():
        assert not buffer.is_meta, name
        assert buffer.device == torch.device("cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference(ids).logits)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_recomputing_buffers_never_overwrites_loaded_weights(tmp_path: Path) -> None:
    # An initializer like remote code's: it writes every tensor of the module in place, with
    # no regard for what was loaded. The loaded weight must survive; the buffer gets its value.
    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(4.0) * 3, persistent=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.owner = Owner()

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, Owner):
                module.proj.weight.data.fill_(-1.0)
                module.proj.bias.data.zero_()
                module.table.copy_(torch.arange(4.0) * 3)

    torch.manual_seed(0)
    reference = Model()
    save_file(reference.state_dict(), tmp_path / "m.safetensors")
    model = Model().to("meta")
    result = load_into(model, tmp_path / "m.safetensors")
    assert result.initialized_buffers == ["owner.table"] and result.still_meta == []
    assert torch.equal(model.owner.proj.weight, reference.owner.proj.weight)
    assert torch.equal(model.owner.proj.bias, reference.owner.proj.bias)
    assert torch.equal(model.owner.table, torch.arange(4.0) * 3)


def test_an_initializer_that_writes_nothing_or_fails_leaves_meta(tmp_path: Path) -> None:
    class Model(nn.Module):
        def __init__(self, fail: bool) -> None:
            super().__init__()
            self.fail = fail
            self.lin = nn.Linear(2, 2)
            self.register_buffer("half_set", torch.zeros(4), persistent=False)

        def _init_weights(self, module: nn.Module) -> None:
            if self.fail:
                raise RuntimeError("cannot")
            if module is self:
                self.half_set[:2] = 1.0  # leaves part of the buffer unset

    for fail in (False, True):
        save_file(Model(fail).state_dict(), tmp_path / "m.safetensors")
        model = Model(fail).to("meta")
        result = load_into(model, tmp_path / "m.safetensors")
        assert result.initialized_buffers == [] and result.still_meta == ["half_set"]
        assert model.half_set.is_meta and not model.lin.weight.is_meta


class Plain(nn.Module):
    """No way to recompute its buffers: they stay on meta and are reported."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.extra = nn.Linear(3, 1)
        self.register_buffer("freqs", torch.ones(3), persistent=False)
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool), persistent=False)


def test_what_stays_on_meta_is_named_in_the_warning(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    reference = Plain()
    state = {k: v for k, v in reference.state_dict().items() if not k.startswith("extra.")}
    save_file(state, tmp_path / "m.safetensors")
    model = Plain().to("meta")
    with caplog.at_level(logging.WARNING, logger="vramkit.io.loader"):
        result = MemoryEfficientLoader("cpu").load_into(model, tmp_path / "m.safetensors",
                                                        strict=False)
    assert set(result.still_meta) == {"extra.weight", "extra.bias", "freqs", "mask"}
    assert result.initialized_buffers == []
    text = caplog.text
    for name in result.still_meta:  # every tensor named, not only the first
        assert name in text, name
    assert "2 missing from the checkpoint: extra.weight, extra.bias" in text
    assert "non-persistent buffer(s)" in text and "freqs, mask" in text
    assert "register_buffer" in text


def test_nothing_to_do_for_a_model_without_meta_buffers() -> None:
    assert recompute_meta_buffers(nn.Linear(2, 2), torch.device("cpu")) == []


@pytest.mark.gpu
def test_meta_llama_buffers_land_on_the_gpu(tmp_path: Path) -> None:
    config = tiny_llama_config(False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    save_file(reference.state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    result = load_into(model, tmp_path / "model.safetensors", device="cuda")
    assert result.still_meta == []
    assert model.model.rotary_emb.inv_freq.device.type == "cuda"
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        expected = reference.cuda()(ids.cuda()).logits
        assert torch.allclose(model.eval()(ids.cuda()).logits, expected)
