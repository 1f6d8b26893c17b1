"""Exact tiled VAE decode/encode: the network as a program of strip-wise steps.

Private implementation of ``VAETiling(exact_groupnorm=True)`` (public names live in
:mod:`vramkit.tiling.vae`).

Why layer by layer: every GroupNorm needs the mean and variance of its whole input, so it is a
global barrier. In a diffusers ``Decoder``/``Encoder`` there is exactly one convolution between
two consecutive GroupNorms (``GN -> SiLU -> conv3x3``, plus the residual add, the nearest-x2
upsample or the stride-2 downsample), so the network is run as a *program of conv steps*. Each
step streams its output plane in full-width row strips: it fetches the strip of its input plane
with the halo its convolution needs, applies the GroupNorm with the merged global statistics,
the activation and the convolution, adds the residual, writes the strip into a full-size output
plane, and accumulates the per-group count/mean/M2 of the strip for the next GroupNorm (Chan's
parallel merge, in float64: :mod:`vramkit.tiling._groupnorm`). Strips have no overlap, so every
output pixel is computed once and the statistics come from each pixel exactly once.

The mid block's self-attention is global too: its keys and values for every latent pixel are
computed strip by strip and kept on the device (the only global state), then each strip's queries
attend to all of them (memory-efficient SDPA or query-chunked math, :func:`chunked_attention`).
So the whole decoder (and encoder) is one program of steps, and every full-size intermediate is a
plane under the same budget.

Where planes live and how strips move between the device and pinned host memory is
:mod:`vramkit.tiling._strips`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError
from vramkit.tiling._attention import ChunkedAttnProcessor, chunked_attention
from vramkit.tiling._groupnorm import GroupStats, group_stats, merge_group_stats, norm_scale_shift
from vramkit.tiling._strips import ExactRunStats, Plane, StripRunner

__all__ = ["exact_decode", "exact_encode"]

# Pointwise activations are the only ones that commute with tiling (and with nearest upsampling).
_POINTWISE_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.SiLU, nn.ReLU, nn.GELU, nn.Mish, nn.Identity, nn.LeakyReLU, nn.Tanh, nn.Sigmoid)

# Elements (output pixels x channels) of one strip per tile pixel: tile_size=512 gives strips of
# 64M elements (32 rows of a 4096-wide, 512-channel plane): large enough that kernel launches
# stay hidden behind GPU work, small enough that a strip's temporaries stay well under 1 GB.
_STRIP_ELEMENTS_PER_TILE_PIXEL = 256


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


@dataclass
class _ConvStep:
    """``out = (shortcut(residual) + conv(resample(act(norm(x))))) / scale`` over one plane.

    ``source``/``residual`` index the program's planes (0 is the program input); the step
    writes plane ``index + 1``.
    """

    name: str
    source: int
    conv: nn.Conv2d
    norm: nn.GroupNorm | None = None
    act: nn.Module | None = None
    upsample: bool = False
    extra_pad: tuple[int, int, int, int] = (0, 0, 0, 0)  # (left, right, top, bottom)
    residual: int | None = None
    shortcut: nn.Conv2d | None = None
    output_scale: float = 1.0


@dataclass
class _AttnStep:
    """A diffusers ``Attention`` over every pixel of its input plane (the VAE mid block):
    keys and values of the whole plane on the device, queries a strip at a time."""

    name: str
    source: int
    attn: nn.Module
    query_chunk: int | None = None
    max_score_bytes: int = 256 << 20
    residual: int | None = None  # the attention's own residual is its source

    @property
    def norm(self) -> nn.GroupNorm:
        return self.attn.group_norm


_Step = _ConvStep | _AttnStep


def _check_conv(conv: Any, what: str) -> nn.Conv2d:
    if (not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros"
            or conv.dilation != (1, 1) or isinstance(conv.padding, str)):
        raise ConfigError(f"exact tiling cannot handle {what} ({type(conv).__name__})",
                          hint="exact_groupnorm=True supports diffusers AutoencoderKL-style "
                               "encoders/decoders; use exact_groupnorm=False for other models.")
    return conv


def _check_act(act: Any, what: str) -> nn.Module:
    if not isinstance(act, _POINTWISE_ACTIVATIONS):
        raise ConfigError(f"exact tiling needs a pointwise activation for {what}, got "
                          f"{type(act).__name__}",
                          hint="Exact tiling supports SiLU, ReLU, GELU, Mish, LeakyReLU, Tanh, "
                               "Sigmoid and Identity activations; use exact_groupnorm=False for "
                               "this model.")
    return act


def _normalise(x: torch.Tensor, scale_shift: tuple[torch.Tensor, torch.Tensor] | None,
               act: nn.Module | None, dtype: torch.dtype) -> torch.Tensor:
    """``act(x * scale + shift)`` in ``dtype``; the affine part in float32, on a private copy
    (``x`` may be a view of a device plane), in place to keep one float32 strip alive."""
    if scale_shift is not None:
        xf = x.to(torch.float32, copy=True)
        xf.mul_(scale_shift[0]).add_(scale_shift[1])
        x = xf.to(dtype)
        del xf
        if isinstance(act, nn.SiLU):  # x is our own tensor now
            return F.silu(x, inplace=True)
    return act(x) if act is not None else x


def _run_conv_step(runner: StripRunner, step: _ConvStep, planes: dict[int, Plane],
                   stats: dict[int, GroupStats], out_plane: Plane | None,
                   stats_groups: int | None, row_scale: int) -> tuple[Plane, GroupStats | None]:
    src = planes[step.source]
    conv = step.conv
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    pad_w = (conv.padding[1] + step.extra_pad[0], conv.padding[1] + step.extra_pad[1])
    pad_top = conv.padding[0] + step.extra_pad[2]
    pad_bottom = conv.padding[0] + step.extra_pad[3]
    up = 2 if step.upsample else 1
    in_h, in_w = src.height * up, src.width * up
    out_h = (in_h + pad_top + pad_bottom - kh) // sh + 1
    out_w = (in_w + pad_w[0] + pad_w[1] - kw) // sw + 1
    if out_plane is None:
        out_plane = runner.new_plane(conv.out_channels, out_h, out_w)
    runner.begin_step(step.name, out_plane, (conv.out_channels, out_h, out_w))
    scale_shift = None
    if step.norm is not None:
        scale_shift = norm_scale_shift(step.norm, stats[step.source])
    rows = runner.strip_rows(out_w, max(conv.in_channels, conv.out_channels))
    merged: GroupStats | None = None
    for y0 in range(0, out_h, rows):
        y1 = min(y0 + rows, out_h)
        if y0:
            runner.stats.seam_rows.append(y0 * row_scale)
        # Rows of the (upsampled) conv input this strip needs, clipped to the image; the part
        # cut off is the conv's zero padding, added back after the activation.
        first = y0 * sh - pad_top
        last = (y1 - 1) * sh - pad_top + kh
        lo, hi = max(first, 0), min(last, in_h)
        src_lo, src_hi = lo // up, (hi - 1) // up + 1
        x = _normalise(src.read(src_lo, src_hi), scale_shift, step.act, runner.dtype)
        if up > 1:
            x = F.interpolate(x, scale_factor=float(up), mode="nearest")
            x = x[:, :, lo - src_lo * up:hi - src_lo * up]
        x = F.pad(x, (pad_w[0], pad_w[1], lo - first, last - hi))
        out = F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, 1, conv.groups)
        del x
        if step.residual is not None:
            res = planes[step.residual].read(y0, y1)
            if step.shortcut is not None:
                res = step.shortcut(res)
            out = res + out
            del res
            if step.output_scale != 1.0:
                out = out / step.output_scale
        if stats_groups is not None:
            merged = merge_group_stats(merged, group_stats(out, stats_groups))
        out_plane.write(y0, out)
        del out
        runner.end_strip()
    runner.end_step()
    return out_plane, merged


def _run_attn_step(runner: StripRunner, step: _AttnStep, planes: dict[int, Plane],
                   stats: dict[int, GroupStats], stats_groups: int | None, row_scale: int
                   ) -> tuple[Plane, GroupStats | None]:
    """Self-attention over the whole plane: pass 1 projects every strip to keys and values
    (kept on the device: the only global state), pass 2 runs each strip's queries against all
    of them and adds the residual. Same arithmetic as ``ChunkedAttnProcessor``."""
    src = planes[step.source]
    attn = step.attn
    channels, height, width = src.channels, src.height, src.width
    heads = attn.heads
    key_dim = attn.to_k.out_features // heads
    value_dim = attn.to_v.out_features // heads
    tokens = height * width
    keys = runner.device_tensor((1, heads, tokens, key_dim))
    values = runner.device_tensor((1, heads, tokens, value_dim))
    runner.stats.attention_kv_bytes = max(runner.stats.attention_kv_bytes,
                                          (keys.numel() + values.numel()) * keys.element_size())
    out_channels = attn.to_out[0].out_features
    out_plane = runner.new_plane(out_channels, height, width)
    runner.begin_step(step.name, out_plane, (out_channels, height, width))
    scale_shift = norm_scale_shift(attn.group_norm, stats[step.source])
    rows = runner.strip_rows(width, max(channels, attn.to_k.out_features))

    def normalised_tokens(y0: int, y1: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = src.read(y0, y1)
        h = _normalise(x, scale_shift, None, runner.dtype)
        return x, h.permute(0, 2, 3, 1).reshape(1, (y1 - y0) * width, channels)

    for y0 in range(0, height, rows):
        y1 = min(y0 + rows, height)
        _, h = normalised_tokens(y0, y1)
        n = (y1 - y0) * width
        keys[:, :, y0 * width:y1 * width] = attn.to_k(h).view(1, n, heads, key_dim).transpose(1, 2)
        values[:, :, y0 * width:y1 * width] = (
            attn.to_v(h).view(1, n, heads, value_dim).transpose(1, 2))
        del h
        runner.end_strip()
    merged: GroupStats | None = None
    for y0 in range(0, height, rows):
        y1 = min(y0 + rows, height)
        if y0:
            runner.stats.seam_rows.append(y0 * row_scale)
        x, h = normalised_tokens(y0, y1)
        n = (y1 - y0) * width
        query = attn.to_q(h).view(1, n, heads, key_dim).transpose(1, 2)
        del h
        o = chunked_attention(query, keys, values, scale=attn.scale, query_chunk=step.query_chunk,
                              max_score_bytes=step.max_score_bytes)
        o = o.transpose(1, 2).reshape(1, n, heads * value_dim).to(query.dtype)
        o = attn.to_out[1](attn.to_out[0](o))
        o = o.view(1, y1 - y0, width, out_channels).permute(0, 3, 1, 2)
        if attn.residual_connection:
            o = o + x
        o = o / attn.rescale_output_factor
        del x
        if stats_groups is not None:
            merged = merge_group_stats(merged, group_stats(o, stats_groups))
        out_plane.write(y0, o)
        del o
        runner.end_strip()
    runner.end_step()
    runner.free_device(keys)
    runner.free_device(values)
    del keys, values
    return out_plane, merged


def _resnet_steps(resnet: nn.Module, name: str, source: int, first_index: int
                  ) -> list[_ConvStep]:
    """The two conv steps of a diffusers ``ResnetBlock2D`` (checked for what tiling supports)."""
    if (getattr(resnet, "upsample", None) is not None
            or getattr(resnet, "downsample", None) is not None
            or getattr(resnet, "time_emb_proj", None) is not None
            or not isinstance(resnet.norm1, nn.GroupNorm)
            or not isinstance(resnet.norm2, nn.GroupNorm)):
        raise ConfigError(f"exact tiling cannot handle this resnet block ({type(resnet).__name__})",
                          hint="exact_groupnorm=True supports AutoencoderKL-style VAEs only.")
    act = _check_act(resnet.nonlinearity, "a resnet block")
    shortcut = resnet.conv_shortcut
    if shortcut is not None:
        shortcut = _check_conv(shortcut, "a resnet shortcut")
        if shortcut.kernel_size != (1, 1) or shortcut.stride != (1, 1):
            raise ConfigError("exact tiling needs 1x1 resnet shortcuts",
                              hint="Exact tiling handles 1x1 stride-1 shortcut convs only; use "
                                   "exact_groupnorm=False for this model.")
    return [
        _ConvStep(f"{name}.conv1", source, _check_conv(resnet.conv1, "conv1"), resnet.norm1, act),
        _ConvStep(f"{name}.conv2", first_index + 1, _check_conv(resnet.conv2, "conv2"),
                  resnet.norm2, act, residual=source, shortcut=shortcut,
                  output_scale=float(resnet.output_scale_factor)),
    ]


def _mid_block_steps(mid: nn.Module, name: str, source: int, first_index: int,
                     attention: ChunkedAttnProcessor | None) -> list[_Step]:
    """Steps of a diffusers ``UNetMidBlock2D``: resnet, then (attention, resnet) pairs."""
    if not hasattr(mid, "resnets") or not hasattr(mid, "attentions"):
        raise ConfigError(f"exact tiling needs a diffusers UNetMidBlock2D, got "
                          f"{type(mid).__name__}",
                          hint="Pass a diffusers AutoencoderKL (whose mid block has .resnets and "
                               ".attentions), or use exact_groupnorm=False.")
    steps: list[_Step] = _resnet_steps(mid.resnets[0], f"{name}.resnets.0", source, first_index)
    current = first_index + len(steps)
    processor = attention or ChunkedAttnProcessor()
    for index, (attn, resnet) in enumerate(zip(mid.attentions, mid.resnets[1:], strict=True)):
        if attn is not None:
            if (not isinstance(getattr(attn, "group_norm", None), nn.GroupNorm)
                    or getattr(attn, "spatial_norm", None) is not None
                    or getattr(attn, "norm_q", None) is not None
                    or getattr(attn, "norm_k", None) is not None
                    or getattr(attn, "is_cross_attention", False)):
                raise ConfigError("exact tiling supports VAE self-attention with a GroupNorm only",
                                  hint="Exact tiling handles GroupNorm self-attention as in the "
                                       "SD/SDXL VAEs; use exact_groupnorm=False for this model.")
            steps.append(_AttnStep(f"{name}.attentions.{index}", current, attn,
                                   processor.query_chunk, processor.max_score_bytes))
            current = first_index + len(steps)
        steps += _resnet_steps(resnet, f"{name}.resnets.{index + 1}", current, current)
        current = first_index + len(steps)
    return steps


def _run_program(runner: StripRunner, steps: list[_Step], planes: dict[int, Plane],
                 stats: dict[int, GroupStats], final_plane: Plane | None,
                 row_scales: list[int]) -> Plane:
    """Run ``steps`` in order; plane ``i + 1`` is step ``i``'s output. Frees planes after their
    last use and gathers statistics only for planes a GroupNorm reads."""
    last_use: dict[int, int] = {}
    groups_of: dict[int, int] = {}
    for index, step in enumerate(steps):
        for plane in (step.source, step.residual):
            if plane is not None:
                last_use[plane] = index
        if step.norm is not None:
            groups_of[step.source] = step.norm.num_groups
    for index, step in enumerate(steps):
        target = index + 1
        if isinstance(step, _AttnStep):
            planes[target], new_stats = _run_attn_step(runner, step, planes, stats,
                                                       groups_of.get(target), row_scales[index])
        else:
            out_final = final_plane if index == len(steps) - 1 else None
            planes[target], new_stats = _run_conv_step(runner, step, planes, stats, out_final,
                                                       groups_of.get(target), row_scales[index])
        if new_stats is not None:
            stats[target] = new_stats
        for plane_index, last in last_use.items():
            if last == index and plane_index in planes:
                runner.release(planes.pop(plane_index))
                stats.pop(plane_index, None)
    return planes[len(steps)]


def _device_plane(tensor: torch.Tensor, runner: StripRunner) -> Plane:
    """Wrap one sample ``(1, C, H, W)`` device tensor as a plane (a view, no copy)."""
    return Plane(tensor[0].permute(1, 2, 0), False, runner)

# --------------------------------------------------------------------------------------------
# Decoder / encoder programs
# --------------------------------------------------------------------------------------------


def _decoder_program(decoder: nn.Module, attention: ChunkedAttnProcessor | None
                     ) -> tuple[list[_Step], list[int]]:
    """Steps of a diffusers ``Decoder`` after ``post_quant_conv``, and each step's output
    upscale to image pixels (for seam positions)."""
    for name in ("conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out"):
        if not hasattr(decoder, name):
            raise ConfigError(f"exact tiling needs a diffusers-style Decoder (no {name!r})",
                              hint="Pass an AutoencoderKL or its .decoder, or use "
                                   "exact_groupnorm=False.")
    if not isinstance(decoder.conv_norm_out, nn.GroupNorm):
        raise ConfigError("exact tiling needs GroupNorm in the decoder (SpatialNorm is not "
                          "supported)",
                          hint="Decoders with SpatialNorm (norm_type='spatial') are not supported "
                               "by exact tiling; use exact_groupnorm=False.")
    remaining = sum(1 for b in decoder.up_blocks if getattr(b, "upsamplers", None))
    steps: list[_Step] = [_ConvStep("conv_in", 0, _check_conv(decoder.conv_in, "conv_in"))]
    steps += _mid_block_steps(decoder.mid_block, "mid_block", 1, 1, attention)
    scales = [2 ** remaining] * len(steps)
    current = len(steps)
    for block_index, block in enumerate(decoder.up_blocks):
        if getattr(block, "attentions", None):
            raise ConfigError("exact tiling cannot tile attention inside up blocks",
                              hint="Exact tiling handles attention in the mid block only; use "
                                   "exact_groupnorm=False for decoders with attention in up "
                                   "blocks.")
        for resnet_index, resnet in enumerate(block.resnets):
            steps += _resnet_steps(resnet, f"up_blocks.{block_index}.resnets.{resnet_index}",
                                   current, len(steps))
            scales += [2 ** remaining] * 2
            current = len(steps)
        for upsampler in getattr(block, "upsamplers", None) or []:
            if (getattr(upsampler, "use_conv_transpose", False)
                    or getattr(upsampler, "norm", None) is not None
                    or not getattr(upsampler, "interpolate", True) or not upsampler.use_conv):
                raise ConfigError("exact tiling supports nearest-x2 + conv upsamplers only",
                                  hint="Exact tiling handles nearest-neighbour x2 upsampling "
                                       "followed by a conv (the SD/SDXL VAE); use "
                                       "exact_groupnorm=False for other upsamplers.")
            remaining -= 1
            steps.append(_ConvStep(f"up_blocks.{block_index}.upsamplers.0", current,
                                   _check_conv(upsampler.conv, "an upsampler"), upsample=True))
            scales.append(2 ** remaining)
            current = len(steps)
    steps.append(_ConvStep("conv_out", current, _check_conv(decoder.conv_out, "conv_out"),
                           decoder.conv_norm_out, _check_act(decoder.conv_act, "conv_act")))
    scales.append(1)
    return steps, scales


def _encoder_program(encoder: nn.Module, attention: ChunkedAttnProcessor | None
                     ) -> tuple[list[_Step], list[int]]:
    """Steps of a diffusers ``Encoder`` (before ``quant_conv``), and each step's output
    downscale from image pixels (for seam positions)."""
    for name in ("conv_in", "down_blocks", "mid_block", "conv_norm_out", "conv_act", "conv_out"):
        if not hasattr(encoder, name):
            raise ConfigError(f"exact tiling needs a diffusers-style Encoder (no {name!r})",
                              hint="Pass an AutoencoderKL or its .encoder, or use "
                                   "exact_groupnorm=False.")
    if not isinstance(encoder.conv_norm_out, nn.GroupNorm):
        raise ConfigError("exact tiling needs GroupNorm in the encoder",
                          hint="Exact tiling needs a GroupNorm before the encoder's conv_out; use "
                               "exact_groupnorm=False for this model.")
    steps: list[_Step] = [_ConvStep("conv_in", 0, _check_conv(encoder.conv_in, "conv_in"))]
    scales = [1]
    current, down = 1, 1
    for block_index, block in enumerate(encoder.down_blocks):
        if getattr(block, "attentions", None):
            raise ConfigError("exact tiling cannot tile attention inside down blocks",
                              hint="Exact tiling handles attention in the mid block only; use "
                                   "exact_groupnorm=False for encoders with attention in down "
                                   "blocks.")
        for resnet_index, resnet in enumerate(block.resnets):
            steps += _resnet_steps(resnet, f"down_blocks.{block_index}.resnets.{resnet_index}",
                                   current, len(steps))
            scales += [down] * 2
            current = len(steps)
        for down_sampler in getattr(block, "downsamplers", None) or []:
            conv = getattr(down_sampler, "conv", None)
            if (getattr(down_sampler, "norm", None) is not None
                    or not getattr(down_sampler, "use_conv", False)):
                raise ConfigError("exact tiling supports conv downsamplers only",
                                  hint="Exact tiling handles strided-conv downsamplers (the "
                                       "SD/SDXL VAE); use exact_groupnorm=False for other "
                                       "downsamplers.")
            extra = (0, 1, 0, 1) if down_sampler.padding == 0 else (0, 0, 0, 0)
            down *= 2
            steps.append(_ConvStep(f"down_blocks.{block_index}.downsamplers.0", current,
                                   _check_conv(conv, "a downsampler"), extra_pad=extra))
            scales.append(down)
            current = len(steps)
    mid = _mid_block_steps(encoder.mid_block, "mid_block", current, current, attention)
    steps += mid
    scales += [down] * len(mid)
    steps.append(_ConvStep("conv_out", len(steps), _check_conv(encoder.conv_out, "conv_out"),
                           encoder.conv_norm_out, _check_act(encoder.conv_act, "conv_act")))
    scales.append(down)
    return steps, scales


def exact_decode(decoder: nn.Module, post_quant_conv: nn.Module | None, latents: torch.Tensor,
                 *, storage: str, device_budget: int | None, tile_size: int,
                 attention: ChunkedAttnProcessor | None = None) -> tuple[torch.Tensor, ExactRunStats]:
    """Decode with GroupNorm statistics over the whole image (see the module docstring).

    Args:
        decoder: a diffusers ``Decoder``.
        post_quant_conv: the VAE's ``post_quant_conv`` (``None`` when it has none).
        latents: ``(B, C, h, w)`` on the decoder's device.
        storage: ``"auto"``, ``"device"`` or ``"host"`` for intermediates.
        device_budget: bytes of intermediates (planes, attention keys/values) allowed on the
            device in ``"auto"`` (``None``: half the free device memory).
        tile_size: strips hold about ``tile_size**2 * 256`` elements.
        attention: sets the mid block's query chunking (default ``ChunkedAttnProcessor()``).

    Returns:
        ``(image, stats)``: the image ``(B, C_out, H, W)`` and what the run did.
    """
    steps, scales = _decoder_program(decoder, attention)
    weight = decoder.conv_out.weight
    device, dtype = weight.device, weight.dtype
    runner = StripRunner(device, dtype, storage, device_budget,
                     tile_size * tile_size * _STRIP_ELEMENTS_PER_TILE_PIXEL)
    latents = latents.to(device=device, dtype=dtype)
    up = 2 ** sum(1 for b in decoder.up_blocks if getattr(b, "upsamplers", None))
    out = torch.empty(latents.shape[0], decoder.conv_out.out_channels,
                      latents.shape[2] * up, latents.shape[3] * up, dtype=dtype, device=device)
    with torch.no_grad():
        for index in range(latents.shape[0]):
            z = latents[index:index + 1]
            if post_quant_conv is not None:
                z = post_quant_conv(z)
            _run_program(runner, steps, {0: _device_plane(z, runner)}, {},
                         _device_plane(out[index:index + 1], runner), scales)
            del z
        runner.finish()
    runner.stats.seam_rows = sorted(set(runner.stats.seam_rows))
    return out, runner.stats


def exact_encode(encoder: nn.Module, quant_conv: nn.Module | None, image: torch.Tensor, *,
                 storage: str, device_budget: int | None, tile_size: int,
                 attention: ChunkedAttnProcessor | None = None) -> tuple[torch.Tensor, ExactRunStats]:
    """Encode with GroupNorm statistics over the whole image; only ``quant_conv`` (1x1, on the
    small latent) runs untiled.

    Args:
        encoder: a diffusers ``Encoder``.
        quant_conv: the VAE's ``quant_conv`` (``None`` when it has none).
        image: ``(B, C, H, W)``.
        storage: see :func:`exact_decode`.
        device_budget: see :func:`exact_decode`.
        tile_size: see :func:`exact_decode`.
        attention: see :func:`exact_decode`.

    Returns:
        ``(moments, stats)``: the latent distribution parameters ``(B, 2*latent_channels, h, w)``
        (or the encoder output when it is not doubled) and what the run did.
    """
    steps, scales = _encoder_program(encoder, attention)
    weight = encoder.conv_in.weight
    device, dtype = weight.device, weight.dtype
    runner = StripRunner(device, dtype, storage, device_budget,
                     tile_size * tile_size * _STRIP_ELEMENTS_PER_TILE_PIXEL)
    image = image.to(device=device, dtype=dtype)
    results: list[torch.Tensor] = []
    with torch.no_grad():
        for index in range(image.shape[0]):
            planes = {0: _device_plane(image[index:index + 1], runner)}
            last = _run_program(runner, steps, planes, {}, None, scales)
            h = last.full().contiguous()
            runner.release(last)
            if quant_conv is not None:
                h = quant_conv(h)
            results.append(h.contiguous())
        runner.finish()
    runner.stats.seam_rows = sorted(set(runner.stats.seam_rows))
    return torch.cat(results), runner.stats
