"""The autograd boundary of swapped blocks (``vramkit.offload.swap.graph``) on the CPU.

Where a swapped block's only differentiable input comes from one output node of the swapped
block called just before it (``x = block(x)``), the two share one boundary: the earlier block's
pre-hook on that node releases the later block, then re-acquires its own slot. These tests pin
when that chain is used, and that it stays correct where it must fall back or where backward
reaches the node late, early or not at all.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import Stack, assert_same_grads, grads_of
from tests.offload.swap.test_swapper import (
    MIN,
    D,
    MLPBlock,
    X,
    _frozen_blocks,
    _net,
)
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig


def _swap(model: nn.Module, **config: Any) -> BlockSwapper:
    config.setdefault("min_param_bytes", MIN)
    return BlockSwapper(model, config=SwapConfig(**config), device="cpu")


def _node_names(root: Any) -> list[str]:
    """Type names of every node reachable from ``root`` (each node once)."""
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def _unlocked(swapper: BlockSwapper) -> bool:
    return all(not s.locked for s in swapper._ring.slots)


def _compare_steps(ref: nn.Module, steps: int, **config: Any) -> None:
    """Swap a copy of ``ref``; each step's gradients must equal the unswapped model's (with the
    same checkpointing: the lean checkpoint sums a gradient read inside and outside a block in
    another order than no checkpointing), with every slot released after each backward."""
    model = copy.deepcopy(ref)
    swapper = _swap(model, **config)
    if config.get("checkpointing"):
        enable_gradient_checkpointing(ref)
    for _ in range(steps):
        for m in (model, ref):
            m.zero_grad()
            m(X).square().mean().backward()
        assert_same_grads(grads_of(model), grads_of(ref))
        assert _unlocked(swapper)
    swapper.detach()


def test_a_chain_of_swapped_blocks_has_one_entry() -> None:
    # inp's output enters block 0 (an entry Function); blocks 1-3 take the previous block's
    # output node only, so they chain to its hook instead.
    model = _frozen_blocks(_net())
    swapper = _swap(model)
    names = _node_names(model(X).square().mean().grad_fn)
    assert names.count("BlockEntryBackward") == 1
    assert "BlockExitBackward" not in names
    swapper.detach()


def _skip_net() -> Stack:
    """Chained swapped blocks whose first output is also used again after the last block."""
    return Stack(MLPBlock, 4, inp=(D, D), out=(D, D), seed=0, skip=True)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("slots", [1, 2])
def test_chain_with_a_skip_connection_matches(checkpointing: bool, slots: int) -> None:
    # Block 1 is released by block 0's output hook, which runs only after the skip's gradient
    # arrived too: later than needed, never earlier.
    _compare_steps(_frozen_blocks(_skip_net()), 2, checkpointing=checkpointing, num_slots=slots)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_chain_matches_with_any_number_of_slots(checkpointing: bool, slots: int) -> None:
    _compare_steps(_frozen_blocks(_net(n=5)), 3, checkpointing=checkpointing, num_slots=slots)


def test_backward_that_stops_inside_the_chain_releases_every_slot() -> None:
    # Differentiating w.r.t. block 1's output never reaches blocks 0-1 nor the node whose hook
    # would release block 2: the end-of-backward callback releases it.
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    held: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        held["mid"] = out

    handle = model.blocks[1].register_forward_hook(keep)
    loss = model(X).square().mean()
    (grad,) = torch.autograd.grad(loss, held["mid"])
    handle.remove()
    assert grad.shape == held["mid"].shape and _unlocked(swapper)
    for m in (model, ref):  # a full step afterwards is still exact
        m(X).square().mean().backward()
    assert_same_grads(grads_of(model), grads_of(ref))
    assert _unlocked(swapper)
    swapper.detach()


class SkippableBlock(MLPBlock):
    """Returns its input unchanged while ``skip`` is set."""

    skip = False

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return x if self.skip else super().forward(x, scale)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chained_block_that_passes_its_input_through(checkpointing: bool) -> None:
    # Block 2 returns block 1's output as-is: its output node is the node it chained to, so it
    # cannot hook it (the hook would re-acquire it after releasing it) and wraps the output
    # in BlockExit instead.
    ref = _net()
    ref.blocks = nn.ModuleList(SkippableBlock() for _ in range(4))
    _frozen_blocks(ref)
    ref.blocks[2].skip = True
    _compare_steps(ref, 2, checkpointing=checkpointing)
    model = copy.deepcopy(ref)
    swapper = _swap(model, checkpointing=checkpointing)
    assert "BlockExitBackward" in _node_names(model(X).grad_fn)
    swapper.detach()


def test_chain_is_not_made_across_a_resident_block() -> None:
    # Block 2 stays resident: block 3's input comes from it, not from a swapped call.
    model = _frozen_blocks(_net())
    swapper = _swap(model, max_gpu_blocks=1)
    assert swapper.swapped_names == ["blocks.0", "blocks.1", "blocks.3"]
    names = _node_names(model(X).square().mean().grad_fn)
    assert names.count("BlockEntryBackward") == 2  # blocks 0 and 3; block 1 chains to 0
    swapper.detach()


@pytest.mark.parametrize("method", ["lean", "pytorch"])
def test_swapped_blocks_checkpoint_with_the_blocks_method(method: str) -> None:
    # A block checkpointed by enable_gradient_checkpointing keeps its method under the swapper
    # (the config alone asks for lean); after the first step (the lean check) a lean block's
    # call is one node whose pre-hook holds the slot while backward recomputes it.
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model, method=method)
    enable_gradient_checkpointing(ref, method=method)
    swapper = _swap(model, num_slots=1)
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad()
            m(X).square().mean().backward()
        assert_same_grads(grads_of(model), grads_of(ref))
        assert _unlocked(swapper)
    names = _node_names(model(X).square().mean().grad_fn)
    assert names.count("_LeanFunctionBackward") == (4 if method == "lean" else 0)
    swapper.detach()
