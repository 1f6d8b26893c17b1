"""GPU tests of token-chunked feed-forward layers: a Wan-sized FFN at 32k tokens holds less in
backward chunked than as built, and computes the same values (bit for bit where cuBLAS picks
the same kernel per row; to rounding otherwise)."""

from __future__ import annotations

import pytest
import torch

from tests.planning._models import VideoFeedForward
from vramkit.offload.chunked import chunk_tokens

pytestmark = pytest.mark.gpu


def _step(ffn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    x = x.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = ffn(x)
    y.float().square().mean().backward()
    torch.cuda.synchronize()
    return y.detach(), x.grad, torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wan_sized_ffn_at_32k_tokens_peaks_lower_chunked() -> None:
    torch.manual_seed(0)
    ffn = VideoFeedForward(5120, 13824).to("cuda", torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 32760, 5120, device="cuda", dtype=torch.bfloat16)
    want, want_grad, whole = _step(ffn, x)
    chunk_tokens(ffn, 8)
    got, got_grad, chunked = _step(ffn, x)
    # as built: the up-projection (0.9 GB) is saved and the backward makes its gradient;
    # chunked: one slice of them at a time
    assert chunked < whole - (600 << 20), (chunked, whole)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_grad, want_grad, rtol=2e-2, atol=2e-2)
