"""Query-chunked exact attention, for the VAE mid block's self-attention over every pixel.

:func:`chunked_attention` computes softmax attention a block of queries at a time (memory-efficient
SDPA on CUDA, score-bounded math blocks elsewhere); :class:`ChunkedAttnProcessor` is a diffusers
attention processor built on it, and :func:`use_chunked_attention` installs it for a while.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit._validate import check_int
from vramkit.errors import ConfigError

__all__ = ["ChunkedAttnProcessor", "chunked_attention", "use_chunked_attention"]

logger = logging.getLogger(__name__)


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float | None = None, query_chunk: int | None = None,
                      max_score_bytes: int = 256 << 20) -> torch.Tensor:
    """Exact softmax attention computed a block of queries at a time.

    On CUDA the memory-efficient SDPA kernel (which takes head dim 512, unlike flash) is tried
    first on blocks of 16384 queries: it never materialises the score matrix. Where it is not
    available (CPU, odd head dims) the blocks are sized so one block's scores fit
    ``max_score_bytes``.

    Args:
        query: ``(B, heads, Nq, D)``.
        key: ``(B, heads, Nk, D)``.
        value: ``(B, heads, Nk, Dv)``.
        scale: softmax scale (default ``1/sqrt(D)``).
        query_chunk: queries per block; ``None`` (default) chooses as above.
        max_score_bytes: bound on one block's float32 score matrix when the math kernel runs
            (default 256 MiB).

    Returns:
        ``(B, heads, Nq, Dv)``, equal to ``softmax(q k^T * scale) v``.
    """
    batch, heads, n_query = query.shape[0], query.shape[1], query.shape[2]
    n_key = key.shape[2]
    out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=query.dtype, device=query.device)
    math_chunk = max(1, max_score_bytes // max(1, batch * heads * n_key * 4))
    if query.device.type == "cuda" and query_chunk is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                for start in range(0, n_query, 16384):
                    stop = min(start + 16384, n_query)
                    out[:, :, start:stop] = F.scaled_dot_product_attention(
                        query[:, :, start:stop], key, value, scale=scale)
            return out
        except RuntimeError as exc:  # no fused kernel for these shapes/dtypes
            logger.debug("memory-efficient SDPA unavailable (%s); using chunked math", exc)
    chunk = query_chunk if query_chunk is not None else math_chunk
    for start in range(0, n_query, chunk):
        stop = min(start + chunk, n_query)
        out[:, :, start:stop] = F.scaled_dot_product_attention(
            query[:, :, start:stop], key, value, scale=scale)
    return out


class ChunkedAttnProcessor:
    """A diffusers attention processor computing self-attention with :func:`chunked_attention`.

    Same result as diffusers' ``AttnProcessor2_0`` (spatial inputs, group norm, residual,
    rescale), without materialising the full score matrix, so the VAE mid block runs on a
    512x512 latent. Attention masks are not supported (VAEs use none).

    Args:
        query_chunk: queries per block (default ``None``: see :func:`chunked_attention`).
        max_score_bytes: bound on one block's score matrix on the math path (default 256 MiB).

    Raises:
        ConfigError: when ``query_chunk`` is neither ``None`` nor an int >= 1.
    """

    def __init__(self, query_chunk: int | None = None, max_score_bytes: int = 256 << 20) -> None:
        self.query_chunk = check_int("ChunkedAttnProcessor.query_chunk", query_chunk, minimum=1,
                                     allow_none=True)
        self.max_score_bytes = max_score_bytes

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        if attention_mask is not None:
            raise ConfigError("ChunkedAttnProcessor does not support attention masks",
                              hint="Use it on VAE mid blocks (self-attention without a mask).")
        residual = hidden_states
        if getattr(attn, "spatial_norm", None) is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        spatial = hidden_states.ndim == 4
        if spatial:
            batch, channels, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        batch = hidden_states.shape[0]
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.to_q(hidden_states)
        key = attn.to_k(context)
        value = attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        if getattr(attn, "norm_q", None) is not None:
            query = attn.norm_q(query)
        if getattr(attn, "norm_k", None) is not None:
            key = attn.norm_k(key)
        out = chunked_attention(query, key, value, scale=attn.scale,
                                query_chunk=self.query_chunk, max_score_bytes=self.max_score_bytes)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        if spatial:
            out = out.transpose(-1, -2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


@contextlib.contextmanager
def use_chunked_attention(module: nn.Module, processor: ChunkedAttnProcessor | None = None
                          ) -> Iterator[int]:
    """Temporarily give every diffusers ``Attention`` inside ``module`` a chunked processor.

    Args:
        module: a model (a VAE, a decoder, a mid block).
        processor: the processor to install (default ``ChunkedAttnProcessor()``).

    Yields:
        The number of attention modules switched; the previous processors come back on exit.
    """
    processor = processor or ChunkedAttnProcessor()
    saved: list[tuple[nn.Module, Any]] = []
    for sub in module.modules():
        if hasattr(sub, "processor") and hasattr(sub, "to_q"):
            saved.append((sub, sub.processor))
            sub.processor = processor
    try:
        yield len(saved)
    finally:
        for sub, previous in saved:
            sub.processor = previous
