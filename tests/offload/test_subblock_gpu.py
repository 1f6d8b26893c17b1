"""Sub-block checkpointing on CUDA: the tiny video model whose self-attention is a child
(``attn1``, beside ``ffn``) gets, with each block's parts checkpointed inside the block's
checkpoint, the gradients of the block checkpointed whole, bit for bit, and its backward holds
less at its peak."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.planning._models import video_inputs, video_parts_model
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.subblock import checkpoint_block_parts

pytestmark = pytest.mark.gpu

BLOCKS = [f"blocks.{i}" for i in range(4)]


def _step(parts: bool) -> tuple[list[torch.Tensor], int]:
    model = video_parts_model(device="cuda").to(torch.bfloat16)  # parts: attn1, ffn
    xs = tuple(x.cuda().to(torch.bfloat16) for x in video_inputs(8, 32, 48))
    enable_gradient_checkpointing(model, BLOCKS)
    if parts:
        checkpoint_block_parts(model, BLOCKS)
    for _ in range(2):  # a lean block's first call runs PyTorch's checkpoint; the second lean
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with sdpa_kernel(SDPBackend.MATH):
            model(*xs).float().square().mean().backward()
        torch.cuda.synchronize()
    return ([p.grad for p in model.parameters() if p.requires_grad],
            torch.cuda.max_memory_allocated() - base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parts_give_the_block_checkpoints_grads_and_a_lower_peak() -> None:
    whole, whole_peak = _step(False)
    parts, parts_peak = _step(True)
    for a, b in zip(parts, whole, strict=True):
        assert torch.equal(a, b)
    assert parts_peak < whole_peak
