"""vramkit.planning.activations: activation bytes of a step by block, on the meta device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError
from vramkit.planning.activations import ActivationEstimate, estimate_activations

TOKENS, DIM, HEADS = 256, 64, 4


class Attention(nn.Module):
    def __init__(self, keywords: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.keywords = keywords

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if self.keywords:  # as diffusers' attention dispatcher calls it
            y = F.scaled_dot_product_attention(query=q, key=k, value=v)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(b, n, DIM))


def _model(keywords: bool = False) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(Attention(keywords) for _ in range(3)))


def _estimate(model: nn.Module, batch: int = 1) -> ActivationEstimate:
    x = torch.empty(batch, TOKENS, DIM, device="meta", requires_grad=True)
    return estimate_activations(model, lambda: model(x).sum(), ["0", "1", "2"])


def test_blocks_inputs_and_attention_are_counted() -> None:
    found = _estimate(_model())
    assert set(found.per_block) == {"0", "1", "2"}
    # Each block's input is a [1, 256, 64] float32 tensor; block 0's is the leaf x.
    assert found.inputs == {"0": TOKENS * DIM * 4, "1": TOKENS * DIM * 4, "2": TOKENS * DIM * 4}
    # Fused attention saves q, k, v, the output and a log-sum-exp, never the L x L matrix.
    assert 0 < found.per_block["0"] < HEADS * TOKENS * TOKENS * 4
    assert found.per_block["0"] == found.per_block["1"] == found.per_block["2"]
    assert found.full == found.outside + sum(found.per_block.values()) + found.largest_block
    # Every block checkpointed: the peak is at the last block's recomputation, with the
    # inputs of the blocks before it kept.
    assert found.checkpointed == (found.outside + found.inputs["0"] + found.inputs["1"]
                                  + found.per_block["2"] + found.largest_block)
    assert found.checkpointed < found.full


def test_any_set_of_checkpointed_blocks() -> None:
    found = _estimate(_model())
    assert found.bytes_with(()) == found.full
    assert found.bytes_with(["0", "1", "2"]) == found.checkpointed
    one = found.bytes_with(["1"])
    assert found.checkpointed < one < found.full
    assert one == (found.outside + found.per_block["0"] + found.inputs["1"]
                   + found.per_block["2"] + found.largest_block)
    # More checkpointing never raises the estimate.
    assert found.bytes_with(["0", "1"]) <= found.bytes_with(["1"]) <= found.bytes_with([])
    with pytest.raises(ConfigError, match="not blocks"):
        found.bytes_with(["7"])


def test_batch_scales_activations() -> None:
    one, two = _estimate(_model(), 1), _estimate(_model(), 2)
    assert two.full == pytest.approx(2 * one.full, rel=0.01)


def test_attention_called_with_keywords_is_counted_like_positional() -> None:
    assert _estimate(_model(keywords=True)) == _estimate(_model(keywords=False))


def test_unknown_block_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no block"):
        estimate_activations(_model(), lambda: None, ["9"])


def test_the_tail_after_the_last_block_is_counted() -> None:
    """A language model's logits and their float32 copy are alive when the forward turns into
    the backward, and autograd saves neither: the estimate holds them as its tail."""
    vocab = 4096
    with torch.device("meta"):
        model = nn.Sequential(*(Attention(False) for _ in range(3)), nn.Linear(DIM, vocab))
    x = torch.empty(1, TOKENS, DIM, device="meta", requires_grad=True)
    estimate = estimate_activations(model, lambda: model(x).float().mean(), ["0", "1", "2"])
    logits = TOKENS * vocab * 4  # float32 linear output (nothing casts it here)
    assert estimate.tail >= logits  # the logits (.float() of float32 returns them as they are)
    assert estimate.tail < 2 * logits
    everything = estimate.bytes_with(["0", "1", "2"])
    kept = sum(estimate.inputs.values())
    assert everything >= estimate.outside + kept + estimate.tail
    without_tail = ActivationEstimate(estimate.per_block, estimate.inputs, estimate.outside)
    assert without_tail.bytes_with(["0", "1", "2"]) < everything
