"""Compiled blocks (vramkit.offload.compiled) alone, checkpointed and under block swapping, on
the CPU's inductor backend: the same numbers as the compiled resident model, and no frame
compiled again once two steps have met every calling context."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from tests._toys import ResidualMLP, Stack, grad_step
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload import _patch
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.compiled import (
    CUDA_GRAPH_MODES,
    compile_blocks,
    is_compiled,
    uncompile_blocks,
)
from vramkit.offload.swap import BlockSwapper, SwapConfig

dynamo = pytest.importorskip("torch._dynamo")


def _lora_stack() -> Stack:
    """Four pre-norm MLP blocks, each with a trainable adapter beside its frozen weights."""
    model = Stack(lambda: ResidualMLP(32, adapter=True), 4, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_("adapter" in name)
    return model


def _frames() -> int:
    return int(dynamo.utils.counters["frames"]["ok"])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    dynamo.reset()
    dynamo.utils.counters.clear()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_swapped_compiled_blocks_equal_the_compiled_resident_model_and_never_recompile(
        checkpointing: bool) -> None:
    resident, swapped = _lora_stack(), _lora_stack()
    for model in (resident, swapped):
        assert compile_blocks(model) == [f"blocks.{i}" for i in range(4)]
    BlockSwapper(swapped, "blocks", SwapConfig(max_gpu_blocks=1, checkpointing=checkpointing,
                                               min_param_bytes=0), device="cpu")
    if checkpointing:
        enable_gradient_checkpointing(resident, "blocks")
    frames_after_warmup = None
    for step in range(4):
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(step))
        out_r, grads_r = grad_step(resident, x)
        out_s, grads_s = grad_step(swapped, x)
        torch.testing.assert_close(out_s, out_r, rtol=0, atol=0)
        assert len(grads_s) == len(grads_r) == 4
        for a, b in zip(grads_s, grads_r, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if step == 1:
            # Two steps meet every calling context: the lean checkpoint's forward (no grad,
            # input with or without grad) and its recomputation in backward.
            frames_after_warmup = _frames()
    assert frames_after_warmup is not None and frames_after_warmup > 0
    assert _frames() == frames_after_warmup, "a block was compiled again after the warm-up"


def test_blocks_of_one_class_share_their_graphs() -> None:
    model = _lora_stack()
    compile_blocks(model)
    grad_step(model, torch.randn(6, 32, requires_grad=True))
    # Four blocks, one class, one calling context: one frame.
    assert _frames() == 1


class _Indexed(torch.nn.Module):
    """A block whose forward reads a per-instance constant, as a decoder layer's ``layer_idx``:
    dynamo guards on it, so each block compiles its own entry of the shared code object."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (self.index + 1)


def test_blocks_that_compile_one_entry_each_all_stay_compiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Past dynamo's default of 8 entries per code object the 9th and 10th blocks would run
    # eagerly without a word; compile_blocks raises the limits to the blocks' count.
    config = dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(config, name):
            monkeypatch.setattr(config, name, getattr(config, name))  # restored after
    config.recompile_limit = 8
    model = torch.nn.Sequential(*[_Indexed(i) for i in range(10)])
    model.blocks = torch.nn.ModuleList(list(model))  # the repeated blocks the swapper finds
    names = compile_blocks(model, "blocks")
    assert len(names) == 10
    for name in names:  # trace only (the eager backend): what is counted is dynamo's frames
        _patch.find(model.get_submodule(name), "compile").options["backend"] = "eager"
    x = torch.randn(2, 8)
    with torch.no_grad():
        for block in model.blocks:
            x = block(x)
    assert _frames() == 10, "a block ran eagerly past dynamo's recompile limit"
    assert config.recompile_limit >= 10


def test_uncompile_restores_the_forward_exactly() -> None:
    model = _lora_stack()
    before = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    compile_blocks(model)
    assert all(is_compiled(b) for b in model.blocks)
    assert compile_blocks(model) == []  # compiled already: left as it is
    assert uncompile_blocks(model) == [f"blocks.{i}" for i in range(4)]
    assert not any(is_compiled(b) for b in model.blocks)
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == before


def test_copies_and_pickles_compile_again_on_first_call() -> None:
    model = _lora_stack()
    compile_blocks(model)
    x = torch.randn(6, 32)
    expected = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        wrapper = _patch.find(clone.blocks[0], "compile")
        assert wrapper is not None and wrapper._compiled is None
        torch.testing.assert_close(clone(x), expected, rtol=0, atol=0)


def test_compiling_a_wrapped_block_is_refused() -> None:
    model = _lora_stack()
    enable_gradient_checkpointing(model, "blocks")
    with pytest.raises(OffloadError, match="wrapped already") as err:
        compile_blocks(model)
    assert "Compile the blocks first" in err.value.hint


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match="mode") as err:
        compile_blocks(_lora_stack(), mode="fast")
    assert "inference only" in err.value.hint


@pytest.mark.parametrize("mode", CUDA_GRAPH_MODES)
def test_cuda_graph_modes_run_inference_and_refuse_training(mode: str) -> None:
    model, eager = _lora_stack(), _lora_stack()
    compile_blocks(model, mode=mode)
    x = torch.randn(6, 32)
    with torch.no_grad():  # on the CPU inductor records no graph; the wrapper's path is the same
        for _ in range(2):
            torch.testing.assert_close(model(x), eager(x))
    with pytest.raises(OffloadError, match="inference only") as err:
        model(x)
    assert "torch.no_grad()" in err.value.hint and "default" in err.value.hint
