"""VAE part discovery: which modules of a diffusers VAE (or a bare Encoder/Decoder) tiling runs.

:func:`vae_parts` finds ``(decoder, post_quant_conv)`` or ``(encoder, quant_conv)``;
:func:`module_callable` makes the plain (untiled) function of those parts and
:func:`upscale_of` reads their spatial factor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["module_callable", "upscale_of", "vae_parts"]


def vae_parts(model: Any, kind: str) -> tuple[nn.Module, nn.Module | None] | None:
    """``(encoder, quant_conv)`` or ``(decoder, post_quant_conv)`` of an AutoencoderKL-like model
    or a bare diffusers Encoder/Decoder; ``None`` for anything else."""
    if kind == "decode":
        if hasattr(model, "decoder") and hasattr(model, "post_quant_conv"):
            return model.decoder, model.post_quant_conv
        if hasattr(model, "up_blocks") and hasattr(model, "conv_out"):
            return model, None
        return None
    if hasattr(model, "encoder") and hasattr(model, "quant_conv"):
        return model.encoder, model.quant_conv
    if hasattr(model, "down_blocks") and hasattr(model, "conv_out"):
        return model, None
    return None


def module_callable(parts: tuple[nn.Module, nn.Module | None], kind: str
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plain (untiled) function of a VAE half: ``post_quant_conv`` then the decoder, or the
    encoder then ``quant_conv``."""
    body, conv = parts
    if kind == "decode":
        def decode(z: torch.Tensor) -> torch.Tensor:
            return body(conv(z) if conv is not None else z)
        return decode

    def encode(x: torch.Tensor) -> torch.Tensor:
        h = body(x)
        return conv(h) if conv is not None else h
    return encode


def upscale_of(parts: tuple[nn.Module, nn.Module | None], kind: str) -> int:
    """The spatial factor of a diffusers VAE half (2 ** number of resampling blocks)."""
    body = parts[0]
    blocks = body.up_blocks if kind == "decode" else body.down_blocks
    attr = "upsamplers" if kind == "decode" else "downsamplers"
    return 2 ** sum(1 for b in blocks if getattr(b, attr, None))
