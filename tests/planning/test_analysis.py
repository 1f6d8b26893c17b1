"""The meta analysis of a step whose blocks checkpoint their parts (sub-block checkpointing):
what the parts recompute in the backward dies as it would on a device, and its work is priced
in the block's backward."""

from __future__ import annotations

import torch

from tests.planning._models import video_inputs, video_parts_model
from vramkit.offload.subblock import checkpoint_block_parts
from vramkit.planning import analyze

NAMES = [f"blocks.{i}" for i in range(4)]


def _cost(parts: bool):  # type: ignore[no-untyped-def]
    model = video_parts_model()
    if parts:
        checkpoint_block_parts(model, NAMES)
    return analyze(model, video_inputs(4, 16, 24, device="meta"), autocast=None)


def test_each_recomputed_part_dies_in_its_blocks_backward() -> None:
    # The FLOP counter's module hooks kept each recomputed part alive until the step's end:
    # every block's backward then read more than the one after it had.
    peaks = _cost(True).activations.backward_peak
    assert peaks["blocks.1"] == peaks["blocks.2"] == peaks["blocks.3"]


def test_the_parts_forward_again_is_priced_in_the_backward() -> None:
    plain, parts = _cost(False), _cost(True)
    tokens, heads, head_dim = 4 * 8 * 12, 2, 16
    attention = 4 * heads * tokens * tokens * head_dim  # attn1's q @ k^T and p @ v, forward
    for a, b in zip(plain.blocks, parts.blocks, strict=True):
        assert b.forward_flops == a.forward_flops
        # attn1's attention runs again (counted by the stand-in), and so do the linears of
        # attn1 and ffn (by the FLOP counter)
        assert b.backward_flops - a.backward_flops > attention
    assert parts.activations.per_block["blocks.1"] < plain.activations.per_block["blocks.1"]


def test_planning_a_model_on_meta_leaves_no_gradient_on_it() -> None:
    # The step is traced on the model itself when it is on meta: its backward's .grad must
    # go (materialized with the weights, it would be uninitialized memory added to), and a
    # gradient the model had before stays as it was.
    from tests.planning._models import inputs, stack
    from vramkit.planning.api import plan

    model = stack(device="meta")
    trainable = [p for p in model.parameters() if p.requires_grad]
    kept = torch.empty_like(trainable[0])
    trainable[0].grad = kept
    plan(model, inputs(device="meta"), 1 << 30, hardware="rtx4090", autocast=None)
    assert trainable[0].grad is kept
    assert all(p.grad is None for p in trainable[1:])
