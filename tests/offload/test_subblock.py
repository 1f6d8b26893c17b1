"""Sub-block checkpointing: a block's parts checkpointed on their own, inside the block's own
checkpoint, give the gradients of the block checkpointed whole, bit for bit (the tiny video
model of the planner tests; a tiny diffusers Wan with peft LoRA), compose with the swapper and
with token-chunked feed-forward layers, and come off exactly."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.planning._models import video_inputs, video_model
from vramkit.errors import ConfigError
from vramkit.offload.checkpointing import (
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
)
from vramkit.offload.chunked import chunk_feed_forwards, is_chunked
from vramkit.offload.subblock import (
    checkpoint_block_parts,
    checkpoint_parts,
    is_part_checkpointed,
    parts_of,
    uncheckpoint_parts,
)
from vramkit.offload.swap import BlockSwapper, SwapConfig

BLOCKS = [f"blocks.{i}" for i in range(4)]


def _grads(model: nn.Module, xs: Any, **kw: Any) -> list[torch.Tensor]:
    with sdpa_kernel(SDPBackend.MATH):
        out = model(*xs, **kw) if isinstance(xs, tuple) else model(**xs, return_dict=False)[0]
        out.float().square().mean().backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


class _Saves:
    """The bytes autograd saves during a forward (what the parts' checkpoints keep instead)."""

    def __init__(self) -> None:
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["lean", "pytorch"])
def test_video_model_grads_equal_the_block_checkpointed_whole(dtype: torch.dtype,
                                                              method: str) -> None:
    xs = tuple(x.to(dtype) for x in video_inputs(4, 8, 12))
    ref, model = video_model().to(dtype), video_model().to(dtype)
    enable_gradient_checkpointing(ref, BLOCKS, method=method)
    enable_gradient_checkpointing(model, BLOCKS, method=method)
    assert checkpoint_block_parts(model, BLOCKS) == [f"{b}.ffn" for b in BLOCKS]
    for step in range(2):  # a lean block's first call runs PyTorch's checkpoint, then lean
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        for a, b in zip(_grads(model, xs), _grads(ref, xs), strict=True):
            assert torch.equal(a, b), step


def test_parts_keep_only_their_inputs_in_an_unchecked_block() -> None:
    xs = video_inputs(4, 8, 12)
    sizes = []
    for parts in (False, True):
        model = video_model()
        if parts:
            checkpoint_block_parts(model, BLOCKS)
        saves = _Saves()
        with torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t):
            model(*xs).square().mean().backward()
        sizes.append(saves.bytes)
    assert sizes[1] < sizes[0]  # the FFN's wide hidden layer is no longer kept


def test_apply_and_undo_restore_the_forwards_exactly() -> None:
    model = video_model()
    before = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    enable_gradient_checkpointing(model, BLOCKS)
    checkpoint_block_parts(model, BLOCKS)
    assert all(is_part_checkpointed(model.get_submodule(f"{b}.ffn")) for b in BLOCKS)
    assert checkpoint_parts(model.blocks[0]) == ["ffn"]  # again: one wrapper, not two
    assert len([w for w in model.blocks[0].ffn.__dict__["_vramkit_wrappers"]]) == 1
    assert sorted(uncheckpoint_parts(model)) == [f"{b}.ffn" for b in BLOCKS]
    disable_gradient_checkpointing(model)
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == before
    assert not any(is_part_checkpointed(m) for m in model.modules())


def test_parts_are_named_children_with_weights_and_bad_names_are_refused() -> None:
    block = video_model().blocks[0]
    assert [n for n, _ in parts_of(block)] == ["ffn"]
    assert [n for n, _ in parts_of(block, ["norm1", "ffn", "nothing"])] == ["norm1", "ffn"]
    with pytest.raises(ConfigError):
        checkpoint_parts(block, "ffn")
    with pytest.raises(ConfigError):
        checkpoint_block_parts(video_model(), ["blocks.9"])


def test_a_chunked_feed_forward_is_left_to_its_slices_and_grads_still_match() -> None:
    xs = video_inputs(4, 8, 12)
    ref, model = video_model(), video_model()
    for m in (ref, model):
        enable_gradient_checkpointing(m, BLOCKS)
        chunk_feed_forwards(m, BLOCKS, 3)
    assert checkpoint_block_parts(model, BLOCKS, ["norm1", "ffn"]) == [
        f"{b}.norm1" for b in BLOCKS]
    assert all(is_chunked(model.get_submodule(f"{b}.ffn")) for b in BLOCKS)
    for a, b in zip(_grads(model, xs), _grads(ref, xs), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("blocks_checkpointed", [True, False])
def test_parts_compose_with_the_swapper_on_the_cpu(blocks_checkpointed: bool) -> None:
    # against the same swapped model without parts: the swapper's own graph sums a gradient
    # read inside and outside a block in its own order (equal to rounding to the plain model)
    xs = video_inputs(4, 8, 12)
    ref, model = video_model(), video_model()
    if blocks_checkpointed:  # else the parts are recomputed in the swapped blocks' backward
        enable_gradient_checkpointing(ref, BLOCKS)
        enable_gradient_checkpointing(model, BLOCKS)
    checkpoint_block_parts(model, BLOCKS)
    swappers = [BlockSwapper(m, config=SwapConfig(max_gpu_blocks=1, min_param_bytes=0),
                             device="cpu") for m in (model, ref)]
    try:
        assert swappers[0].swapped_names
        for step in range(2):  # the second step runs the order the first one learnt
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            for a, b in zip(_grads(model, xs), _grads(ref, xs), strict=True):
                assert torch.equal(a, b), step
    finally:
        for swapper in swappers:
            swapper.detach()
    assert all(is_part_checkpointed(model.get_submodule(f"{b}.ffn")) for b in BLOCKS)


# -- diffusers' Wan with peft LoRA ------------------------------------------------------------


def _wan(dtype: torch.dtype) -> nn.Module:
    diffusers = pytest.importorskip("diffusers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                      target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model.to(dtype)


def _wan_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 4, 3, 8, 8, generator=g).to(dtype),
            "timestep": torch.tensor([3.0]),
            "encoder_hidden_states": torch.randn(1, 5, 16, generator=g).to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wan_with_lora_grads_equal_the_block_checkpointed_whole(dtype: torch.dtype) -> None:
    ref = _wan(dtype)
    model = copy.deepcopy(ref)
    blocks = ["blocks.0", "blocks.1"]
    enable_gradient_checkpointing(ref, blocks)
    enable_gradient_checkpointing(model, blocks)
    assert checkpoint_block_parts(model, blocks) == [
        f"{b}.{p}" for b in blocks for p in ("attn1", "attn2", "ffn")]
    inputs = _wan_inputs(dtype)
    for step in range(2):  # PyTorch's checkpoint at a lean block's first call, then lean
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        grads, expected = _grads(model, inputs), _grads(ref, inputs)
        assert grads and all(g is not None for g in grads)
        for a, b in zip(grads, expected, strict=True):
            assert torch.equal(a, b), step


def test_parts_under_compiled_blocks_trace_and_give_the_same_gradients() -> None:
    # fit(compile=...) compiles each block's forward beneath its checkpoint; the parts'
    # checkpoints then run inside the traced forward. Traced with dynamo's eager backend (what
    # is checked is the tracing and the gradients, not inductor's code).
    from vramkit.offload import _patch
    from vramkit.offload.compiled import compile_blocks, uncompile_blocks

    dynamo = pytest.importorskip("torch._dynamo")
    dynamo.reset()
    xs = video_inputs(4, 8, 12)
    ref, model = video_model(), video_model()
    for m in (ref, model):
        compile_blocks(m, BLOCKS)
        for name in BLOCKS:
            _patch.find(m.get_submodule(name), "compile").options["backend"] = "eager"
        enable_gradient_checkpointing(m, BLOCKS)
    assert checkpoint_block_parts(model, BLOCKS)
    for step in range(2):
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        for a, b in zip(_grads(model, xs), _grads(ref, xs), strict=True):
            assert torch.equal(a, b), step
    assert uncheckpoint_parts(model) and uncompile_blocks(model) == BLOCKS
    dynamo.reset()
