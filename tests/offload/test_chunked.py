"""Token-chunked feed-forward layers: equal to the unchunked layer (bit for bit where the
matmuls' reduction is unchanged), smaller saved activations, restored exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.planning._models import VideoFeedForward, video_inputs, video_model
from vramkit.errors import ConfigError
from vramkit.offload import enable_gradient_checkpointing
from vramkit.offload.chunked import (
    chunk_feed_forwards,
    chunk_tokens,
    is_chunked,
    token_chunks,
    unchunk_feed_forwards,
)


def _saved_bytes(fn):  # type: ignore[no-untyped-def]
    """Bytes of the distinct storages autograd saves while ``fn()`` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_frozen_ffn_chunked_equals_unchunked_bit_for_bit(dtype: torch.dtype,
                                                         checkpoint: bool) -> None:
    torch.manual_seed(0)
    ffn = VideoFeedForward(32, 256).to(dtype).requires_grad_(False)
    x = torch.randn(2, 301, 32, dtype=dtype)  # 301 tokens: slices of unequal length
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = ffn(x1)
    want.backward(torch.ones_like(want))
    chunk_tokens(ffn, 4, checkpoint=checkpoint)
    got = ffn(x2)
    got.backward(torch.ones_like(got))
    assert torch.equal(got, want)
    assert torch.equal(x2.grad, x1.grad)
    with torch.no_grad():  # the preallocated-output path
        assert torch.equal(ffn(x), want.detach())


def test_trainable_ffn_weights_get_equal_gradients_to_rounding() -> None:
    torch.manual_seed(0)
    ffn = VideoFeedForward(32, 256)
    ref = copy.deepcopy(ffn)
    x = torch.randn(1, 300, 32)
    ref(x).square().sum().backward()
    chunk_tokens(ffn, 3)
    ffn(x).square().sum().backward()
    for p, q in zip(ffn.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_checkpointed_chunks_save_only_the_input() -> None:
    torch.manual_seed(0)
    ffn = VideoFeedForward(32, 512).requires_grad_(False)
    x = torch.randn(1, 400, 32, requires_grad=True)
    _, whole = _saved_bytes(lambda: ffn(x))
    chunk_tokens(ffn, 8)
    _, chunked = _saved_bytes(lambda: ffn(x))
    assert chunked == x.untyped_storage().nbytes()  # the slices are views of x
    assert whole >= 400 * 512 * 4  # the up-projection (GELU's input) of every token


def test_a_video_model_with_chunked_ffns_trains_exactly_as_built() -> None:
    """Chunked FFNs inside checkpointed blocks (recomputation inside recomputation): the loss
    and the adapters' gradients as without chunking."""
    inputs = video_inputs()
    ref, model = video_model(), video_model()
    for m in (ref, model):
        enable_gradient_checkpointing(m)
    names = chunk_feed_forwards(model, [f"blocks.{i}" for i in range(4)], 5)
    assert names == [f"blocks.{i}.ffn" for i in range(4)]
    with _math_attention():
        ref(*inputs).square().mean().backward()
        model(*inputs).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


def _math_attention():  # type: ignore[no-untyped-def]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def test_unchunk_restores_the_forward_and_settings_update_in_place() -> None:
    ffn = VideoFeedForward(8, 16)
    before = ffn.forward
    chunk_tokens(ffn, 2)
    chunk_tokens(ffn, 3)  # updates, never wraps twice
    assert is_chunked(ffn) and token_chunks(ffn) == 3
    model = nn.Sequential(ffn)
    assert unchunk_feed_forwards(model) == ["0"]
    assert ffn.forward == before and not is_chunked(ffn)
    chunk_tokens(ffn, 1)
    assert not is_chunked(ffn)  # one slice: the layer as built


def test_refusals() -> None:
    with pytest.raises(ConfigError):
        chunk_tokens(VideoFeedForward(8, 16), 0)
    with pytest.raises(ConfigError):
        chunk_feed_forwards(video_model(n=1), ["blocks.7"], 2)
    reducing = nn.Linear(8, 8)
    reducing.forward = lambda x: x.sum(dim=-2)  # not token-wise: no tokens in the output
    chunk_tokens(reducing, 2)
    with torch.no_grad(), pytest.raises(ConfigError):
        reducing(torch.randn(1, 4, 8))
