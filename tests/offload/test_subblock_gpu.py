"""Sub-block checkpointing on CUDA: the tiny video model whose self-attention is a child
(``attn1``, beside ``ffn``) gets, with each block's parts checkpointed inside the block's
checkpoint, the gradients of the block checkpointed whole, bit for bit, and its backward holds
less at its peak.

The shapes make the feed-forward's temporaries the backward's peak, as in Wan (1024 tokens, an
FFN 8192 wide): with the block checkpointed whole, the self-attention's saved tensors (its
score matrices, under the math kernel the bit-for-bit check needs) are still held while the
FFN's backward runs; with its parts checkpointed they are not built yet. At 3072 tokens and a
256-wide FFN the math kernel's score matrices set the peak in either case, and the peaks were
equal."""

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
    model = video_parts_model(device="cuda", hidden=8192).to(torch.bfloat16)  # attn1, ffn
    xs = tuple(x.cuda().to(torch.bfloat16) for x in video_inputs(4, 32, 32))  # 1024 tokens
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
