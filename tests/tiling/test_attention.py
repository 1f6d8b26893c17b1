"""Query-chunked attention and the diffusers processor built on it."""

from __future__ import annotations

import pytest
import torch

from tests.tiling._models import one_torch_thread, tiny_vae
from vramkit.errors import ConfigError
from vramkit.tiling import ChunkedAttnProcessor, chunked_attention, use_chunked_attention

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.mark.parametrize("chunk", [None, 1, 7, 100])
def test_chunked_attention_is_exact(chunk: int | None) -> None:
    q, k, v = (torch.randn(2, 3, 50, 16) for _ in range(3))
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # a tiny score budget forces many blocks on the default (math) path
    got = chunked_attention(q, k, v, query_chunk=chunk, max_score_bytes=2 * 50 * 4 * 6)
    torch.testing.assert_close(got, expect)


def test_chunked_processor_matches_diffusers_attention() -> None:
    vae = tiny_vae()
    attn = vae.decoder.mid_block.attentions[0]
    h = torch.randn(1, 32, 9, 11)
    with torch.no_grad():
        expect = attn(h)
        with use_chunked_attention(vae.decoder) as switched:
            assert switched == 1 and isinstance(attn.processor, ChunkedAttnProcessor)
            got = attn(h)
        assert not isinstance(attn.processor, ChunkedAttnProcessor)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError):
        ChunkedAttnProcessor(query_chunk=0)
