"""Exact tiled VAE decode/encode: GroupNorm statistics over the whole image, merged across tiles.

Private implementation of ``VAETiling(exact_groupnorm=True)`` (public names live in
:mod:`vramkit.tiling`).

Why layer by layer: every GroupNorm needs the mean and variance of its whole input, so it is a
global barrier. In a diffusers ``Decoder``/``Encoder`` there is exactly one convolution between
two consecutive GroupNorms (``GN -> SiLU -> conv3x3``, plus the residual add, the nearest-x2
upsample or the stride-2 downsample), so the network is run as a *program of conv steps*. Each
step streams its output plane in full-width row strips: it fetches the strip of its input plane
with the halo its convolution needs, applies the GroupNorm with the merged global statistics,
the activation and the convolution, adds the residual, writes the strip into a full-size output
plane, and accumulates the per-group count/mean/M2 of the strip for the next GroupNorm (Chan's
parallel merge, in float64). Strips have no overlap, so every output pixel is computed once and
the statistics come from each pixel exactly once.

The parts that are global for another reason -- the mid block's self-attention over every latent
pixel -- run untiled at latent resolution, with query-chunked attention
(:class:`ChunkedAttnProcessor`) so a 512x512 latent (262k tokens, head dim 512) fits.

Planes are stored ``(H, W, C)`` contiguous, so a full-width strip is one contiguous range: on the
device when they fit the budget, otherwise in pinned host memory (one copy stream moves strips
host<->device asynchronously, ordered by CUDA events; no host synchronisation in the loop).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError

__all__ = [
    "ChunkedAttnProcessor",
    "ExactRunStats",
    "GroupStats",
    "chunked_attention",
    "exact_decode",
    "exact_encode",
    "group_stats",
    "merge_group_stats",
    "use_chunked_attention",
]

logger = logging.getLogger(__name__)

# Pointwise activations are the only ones that commute with tiling (and with nearest upsampling).
_POINTWISE_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.SiLU, nn.ReLU, nn.GELU, nn.Mish, nn.Identity, nn.LeakyReLU, nn.Tanh, nn.Sigmoid)

# Elements (output pixels x channels) of one strip per tile pixel: tile_size=512 gives strips of
# 64M elements (32 rows of a 4096-wide, 512-channel plane): large enough that kernel launches
# stay hidden behind GPU work, small enough that a strip's temporaries stay well under 1 GB.
_STRIP_ELEMENTS_PER_TILE_PIXEL = 256


# --------------------------------------------------------------------------------------------
# GroupNorm statistics (Chan et al. parallel merge)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupStats:
    """Per-(sample, group) element count, mean and M2 (sum of squared deviations), float64.

    Args:
        count: number of elements, shape ``(B, G)``.
        mean: mean, shape ``(B, G)``.
        m2: sum of squared deviations from ``mean``, shape ``(B, G)``.
    """

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    def variance(self) -> torch.Tensor:
        """The biased variance ``m2 / count`` (what GroupNorm normalises with)."""
        return self.m2 / self.count


def group_stats(x: torch.Tensor, num_groups: int) -> GroupStats:
    """Count, mean and M2 of each group of channels of ``x`` (one tile).

    Per-channel moments are reduced in float32 over the spatial dims (Welford, in whatever
    memory layout ``x`` has: no reshaping copy of a channels-last strip), then the channels of
    a group are merged exactly in float64.

    Args:
        x: a ``(B, C, H, W)`` tensor (any layout).
        num_groups: the GroupNorm's number of groups; must divide ``C``.

    Returns:
        The tile's :class:`GroupStats`.
    """
    batch, channels = x.shape[0], x.shape[1]
    if channels % num_groups:
        raise ConfigError(f"{channels} channels do not split into {num_groups} groups")
    per_channel = x.shape[2] * x.shape[3]
    var_c, mean_c = torch.var_mean(x.float(), dim=(2, 3), correction=0)  # (B, C)
    mean_c = mean_c.double().view(batch, num_groups, -1)
    m2_c = var_c.double().view(batch, num_groups, -1) * per_channel
    mean = mean_c.mean(dim=-1)
    # Equal counts per channel: M2 of the group = sum of channel M2 + n * sum of squared offsets.
    m2 = m2_c.sum(dim=-1) + per_channel * ((mean_c - mean[..., None]) ** 2).sum(dim=-1)
    count = torch.full_like(mean, float(per_channel * (channels // num_groups)))
    return GroupStats(count, mean, m2)


def merge_group_stats(a: GroupStats | None, b: GroupStats) -> GroupStats:
    """Chan's merge of two disjoint sets' statistics (``a`` may be ``None``: returns ``b``).

    Args:
        a: statistics gathered so far, or ``None``.
        b: the statistics of a new, disjoint set of elements.

    Returns:
        The statistics of the union, exactly those of the concatenated elements (up to rounding).
    """
    if a is None:
        return b
    count = a.count + b.count
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.count / count)
    m2 = a.m2 + b.m2 + delta * delta * (a.count * b.count / count)
    return GroupStats(count, mean, m2)


def _norm_scale_shift(norm: nn.GroupNorm, stats: GroupStats) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(sample, channel) ``scale, shift`` with ``norm(x) == x * scale + shift``, float32."""
    rstd = torch.rsqrt(stats.variance() + norm.eps)  # (B, G), float64
    per_group = norm.num_channels // norm.num_groups
    rstd_c = rstd.repeat_interleave(per_group, dim=1)
    mean_c = stats.mean.repeat_interleave(per_group, dim=1)
    if norm.affine:
        gamma = norm.weight.detach().double()[None]
        beta = norm.bias.detach().double()[None]
        scale = rstd_c * gamma
        shift = beta - mean_c * scale
    else:
        scale = rstd_c
        shift = -mean_c * rstd_c
    return scale.float()[:, :, None, None], shift.float()[:, :, None, None]


# --------------------------------------------------------------------------------------------
# Query-chunked attention (the mid block, untiled)
# --------------------------------------------------------------------------------------------


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
    """

    def __init__(self, query_chunk: int | None = None, max_score_bytes: int = 256 << 20) -> None:
        if query_chunk is not None and query_chunk < 1:
            raise ConfigError(f"query_chunk must be >= 1, got {query_chunk}")
        self.query_chunk = query_chunk
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


# --------------------------------------------------------------------------------------------
# Planes: full-size intermediates on the device or in pinned host memory
# --------------------------------------------------------------------------------------------


@dataclass
class ExactRunStats:
    """What one exact run did (reported by ``VAETiling.last_exact_stats``).

    Args:
        steps: conv steps run tiled.
        strips: strips computed, over all steps.
        device_plane_bytes_peak: peak bytes of intermediates held on the compute device.
        host_plane_bytes_peak: peak bytes of intermediates held in (pinned) host memory.
        seam_rows: strip boundaries of every step, in output pixels of the final image.
    """

    steps: int = 0
    strips: int = 0
    device_plane_bytes_peak: int = 0
    host_plane_bytes_peak: int = 0
    seam_rows: list[int] = field(default_factory=list)


_PINNED_POOL: Any = None


def _pinned_pool() -> Any:
    """The process-wide pinned pool for host planes (created on first use, kept for reuse:
    pinning gigabytes costs far more than one decode's copies)."""
    global _PINNED_POOL
    if _PINNED_POOL is None:
        from vramkit.memory.pool import MemoryPool, PoolConfig
        _PINNED_POOL = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    return _PINNED_POOL


class _Plane:
    """One full-size ``(C, H, W)`` intermediate of one sample, stored ``(H, W, C)``."""

    def __init__(self, data: torch.Tensor, on_host: bool, runner: _Runner) -> None:
        self.data = data  # (H, W, C) or a strided (H, W, C) view of an NCHW tensor
        self.on_host = on_host
        self.runner = runner
        self.height, self.width, self.channels = data.shape
        self.nbytes = data.numel() * data.element_size()

    def read(self, y0: int, y1: int) -> torch.Tensor:
        """Rows ``[y0, y1)`` as a ``(1, C, rows, W)`` tensor on the compute device."""
        rows = self.data[y0:y1]
        runner = self.runner
        if self.on_host and runner.h2d_stream is not None:
            with torch.cuda.stream(runner.h2d_stream):
                rows = rows.to(runner.device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(runner.h2d_stream)
            runner.compute_stream.wait_event(ready)
            rows.record_stream(runner.compute_stream)  # allocated on the copy stream
        elif self.on_host:
            rows = rows.to(runner.device)
        return rows.permute(2, 0, 1).unsqueeze(0)

    def write(self, y0: int, strip: torch.Tensor) -> None:
        """Store a ``(1, C, rows, W)`` strip at rows ``[y0, y0 + rows)``."""
        rows = strip[0].permute(1, 2, 0)
        dest = self.data[y0:y0 + rows.shape[0]]
        runner = self.runner
        if self.on_host and runner.d2h_stream is not None:
            done = torch.cuda.Event()
            done.record(runner.compute_stream)
            runner.d2h_stream.wait_event(done)
            with torch.cuda.stream(runner.d2h_stream):
                dest.copy_(rows, non_blocking=True)
            rows.record_stream(runner.d2h_stream)
        else:
            dest.copy_(rows)

    def full(self) -> torch.Tensor:
        """The whole plane as a ``(1, C, H, W)`` tensor on the compute device."""
        return self.read(0, self.height)


class _Runner:
    """Allocates planes (device while under budget, else pinned host) and runs conv steps."""

    def __init__(self, device: torch.device, dtype: torch.dtype, storage: str,
                 device_budget: int | None, strip_elements: int) -> None:
        self.device = device
        self.dtype = dtype
        self.storage = storage
        self.strip_elements = strip_elements
        self.stats = ExactRunStats()
        self.device_live = 0
        self.host_live = 0
        self.retired_host_planes: list[_Plane] = []  # released, copies may still be in flight
        cuda = device.type == "cuda"
        # Two copy streams so the next strip's upload overlaps the previous strip's download.
        self.h2d_stream = torch.cuda.Stream(device) if cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if cuda else None
        self.compute_stream = torch.cuda.current_stream(device) if cuda else None
        if device_budget is None:
            if cuda:
                free, _total = torch.cuda.mem_get_info(device)
                device_budget = free // 2  # the other half is for strips, weights, the caller
            else:
                device_budget = 1 << 62  # "device" memory is host memory here
        self.device_budget = device_budget

    def new_plane(self, channels: int, height: int, width: int) -> _Plane:
        nbytes = channels * height * width * self.dtype.itemsize
        on_host = self.storage == "host" or (
            self.storage == "auto" and self.device_live + nbytes > self.device_budget)
        if on_host:
            if self.device.type == "cuda":
                data = _pinned_pool().tensor((height, width, channels), self.dtype)
            else:
                data = torch.empty((height, width, channels), dtype=self.dtype)
            self.host_live += nbytes
            self.stats.host_plane_bytes_peak = max(self.stats.host_plane_bytes_peak,
                                                   self.host_live)
        else:
            data = torch.empty((height, width, channels), dtype=self.dtype, device=self.device)
            self.device_live += nbytes
            self.stats.device_plane_bytes_peak = max(self.stats.device_plane_bytes_peak,
                                                     self.device_live)
        return _Plane(data, on_host, self)

    def release(self, plane: _Plane) -> None:
        """Forget a plane. Device memory returns to the caching allocator (stream-ordered); a
        host plane is kept until the next :meth:`end_step` barrier, because copies enqueued on
        the copy streams may still read it."""
        if plane.on_host:
            self.host_live -= plane.nbytes
            self.retired_host_planes.append(plane)
        else:
            self.device_live -= plane.nbytes

    def end_step(self) -> None:
        """Order the copy streams after each other, then let retired host planes go back to
        the pinned pool: every later upload sees this step's downloads, and a reused host
        buffer is only overwritten (on the download stream) after every upload from it."""
        if self.h2d_stream is not None:
            self.h2d_stream.wait_stream(self.d2h_stream)
            self.d2h_stream.wait_stream(self.h2d_stream)
        self.retired_host_planes.clear()

    def finish(self) -> None:
        """Make the compute stream wait for every copy (no host synchronisation)."""
        if self.h2d_stream is not None:
            self.compute_stream.wait_stream(self.h2d_stream)
            self.compute_stream.wait_stream(self.d2h_stream)
        self.retired_host_planes.clear()

    def strip_rows(self, width: int, channels: int) -> int:
        return max(1, self.strip_elements // max(1, width * channels))


@dataclass
class _ConvStep:
    """``out = (shortcut(residual) + conv(resample(act(norm(x))))) / scale`` over one plane.

    ``source``/``residual`` index the program's planes (0 is the program input); the step
    writes plane ``index + 1``.
    """

    source: int
    conv: nn.Conv2d
    norm: nn.GroupNorm | None = None
    act: nn.Module | None = None
    upsample: bool = False
    extra_pad: tuple[int, int, int, int] = (0, 0, 0, 0)  # (left, right, top, bottom)
    residual: int | None = None
    shortcut: nn.Conv2d | None = None
    output_scale: float = 1.0


def _check_conv(conv: Any, what: str) -> nn.Conv2d:
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros" \
            or conv.dilation != (1, 1) or isinstance(conv.padding, str):
        raise ConfigError(f"exact tiling cannot handle {what} ({type(conv).__name__})",
                          hint="exact_groupnorm=True supports diffusers AutoencoderKL-style "
                               "encoders/decoders; use exact_groupnorm=False for other models.")
    return conv


def _check_act(act: Any, what: str) -> nn.Module:
    if not isinstance(act, _POINTWISE_ACTIVATIONS):
        raise ConfigError(f"exact tiling needs a pointwise activation for {what}, got "
                          f"{type(act).__name__}")
    return act


def _run_step(runner: _Runner, step: _ConvStep, planes: dict[int, _Plane],
              stats: dict[int, GroupStats], out_plane: _Plane | None, stats_groups: int | None,
              row_scale: int) -> tuple[_Plane, GroupStats | None]:
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
    scale_shift = None
    if step.norm is not None:
        scale_shift = _norm_scale_shift(step.norm, stats[step.source])
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
        x = src.read(src_lo, src_hi)
        if scale_shift is not None:
            x = (x.float() * scale_shift[0] + scale_shift[1]).to(x.dtype)
        if step.act is not None:
            x = step.act(x)
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
            if step.output_scale != 1.0:
                out = out / step.output_scale
        if stats_groups is not None:
            merged = merge_group_stats(merged, group_stats(out, stats_groups))
        out_plane.write(y0, out)
        runner.stats.strips += 1
    runner.stats.steps += 1
    return out_plane, merged


def _resnet_steps(resnet: nn.Module, source: int, first_index: int) -> list[_ConvStep]:
    """The two conv steps of a diffusers ``ResnetBlock2D`` (checked for what tiling supports)."""
    if getattr(resnet, "upsample", None) is not None or \
            getattr(resnet, "downsample", None) is not None or \
            getattr(resnet, "time_emb_proj", None) is not None or \
            not isinstance(resnet.norm1, nn.GroupNorm) or not isinstance(resnet.norm2, nn.GroupNorm):
        raise ConfigError(f"exact tiling cannot handle this resnet block ({type(resnet).__name__})",
                          hint="exact_groupnorm=True supports AutoencoderKL-style VAEs only.")
    act = _check_act(resnet.nonlinearity, "a resnet block")
    shortcut = resnet.conv_shortcut
    if shortcut is not None:
        shortcut = _check_conv(shortcut, "a resnet shortcut")
        if shortcut.kernel_size != (1, 1) or shortcut.stride != (1, 1):
            raise ConfigError("exact tiling needs 1x1 resnet shortcuts")
    return [
        _ConvStep(source, _check_conv(resnet.conv1, "conv1"), resnet.norm1, act),
        _ConvStep(first_index + 1, _check_conv(resnet.conv2, "conv2"), resnet.norm2, act,
                  residual=source, shortcut=shortcut,
                  output_scale=float(resnet.output_scale_factor)),
    ]


def _run_program(runner: _Runner, steps: list[_ConvStep], planes: dict[int, _Plane],
                 stats: dict[int, GroupStats], final_plane: _Plane | None,
                 row_scales: list[int]) -> _Plane:
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
        out_final = final_plane if index == len(steps) - 1 else None
        planes[target], new_stats = _run_step(runner, step, planes, stats, out_final,
                                              groups_of.get(target), row_scales[index])
        if new_stats is not None:
            stats[target] = new_stats
        runner.end_step()
        for plane_index, last in last_use.items():
            if last == index and plane_index in planes:
                runner.release(planes.pop(plane_index))
                stats.pop(plane_index, None)
    return planes[len(steps)]


def _device_plane(tensor: torch.Tensor, runner: _Runner) -> _Plane:
    """Wrap one sample ``(1, C, H, W)`` device tensor as a plane (a view, no copy)."""
    return _Plane(tensor[0].permute(1, 2, 0), False, runner)


# --------------------------------------------------------------------------------------------
# Decoder / encoder programs
# --------------------------------------------------------------------------------------------


def _decoder_program(decoder: nn.Module) -> tuple[list[_ConvStep], list[int]]:
    """Conv steps of a diffusers ``Decoder`` after its mid block, and each step's output upscale
    to final pixels (for seam positions)."""
    for name in ("conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out"):
        if not hasattr(decoder, name):
            raise ConfigError(f"exact tiling needs a diffusers-style Decoder (no {name!r})",
                              hint="Pass an AutoencoderKL or its .decoder, or use "
                                   "exact_groupnorm=False.")
    if not isinstance(decoder.conv_norm_out, nn.GroupNorm):
        raise ConfigError("exact tiling needs GroupNorm in the decoder (SpatialNorm is not "
                          "supported)")
    steps: list[_ConvStep] = []
    scales: list[int] = []
    current = 0
    remaining = sum(1 for b in decoder.up_blocks if getattr(b, "upsamplers", None))
    for block in decoder.up_blocks:
        if getattr(block, "attentions", None):
            raise ConfigError("exact tiling cannot tile attention inside up blocks")
        for resnet in block.resnets:
            pair = _resnet_steps(resnet, current, len(steps))
            steps += pair
            scales += [2 ** remaining] * 2
            current = len(steps)
        for upsampler in getattr(block, "upsamplers", None) or []:
            if getattr(upsampler, "use_conv_transpose", False) or \
                    getattr(upsampler, "norm", None) is not None or \
                    not getattr(upsampler, "interpolate", True) or not upsampler.use_conv:
                raise ConfigError("exact tiling supports nearest-x2 + conv upsamplers only")
            remaining -= 1
            steps.append(_ConvStep(current, _check_conv(upsampler.conv, "an upsampler"),
                                   upsample=True))
            scales.append(2 ** remaining)
            current = len(steps)
    steps.append(_ConvStep(current, _check_conv(decoder.conv_out, "conv_out"),
                           decoder.conv_norm_out, _check_act(decoder.conv_act, "conv_act")))
    scales.append(1)
    return steps, scales


def _encoder_program(encoder: nn.Module) -> tuple[list[_ConvStep], list[int]]:
    """Conv steps of a diffusers ``Encoder`` before its mid block; scales are output downscale
    factors of each step relative to the input image (used as negative seam scales: unused)."""
    for name in ("conv_in", "down_blocks", "mid_block", "conv_norm_out", "conv_act", "conv_out"):
        if not hasattr(encoder, name):
            raise ConfigError(f"exact tiling needs a diffusers-style Encoder (no {name!r})",
                              hint="Pass an AutoencoderKL or its .encoder, or use "
                                   "exact_groupnorm=False.")
    steps: list[_ConvStep] = [_ConvStep(0, _check_conv(encoder.conv_in, "conv_in"))]
    current = 1
    for block in encoder.down_blocks:
        if getattr(block, "attentions", None):
            raise ConfigError("exact tiling cannot tile attention inside down blocks")
        for resnet in block.resnets:
            steps += _resnet_steps(resnet, current, len(steps))
            current = len(steps)
        for down in getattr(block, "downsamplers", None) or []:
            conv = getattr(down, "conv", None)
            if getattr(down, "norm", None) is not None or not getattr(down, "use_conv", False):
                raise ConfigError("exact tiling supports conv downsamplers only")
            extra = (0, 1, 0, 1) if down.padding == 0 else (0, 0, 0, 0)
            steps.append(_ConvStep(current, _check_conv(conv, "a downsampler"), extra_pad=extra))
            current = len(steps)
    return steps, [1] * len(steps)


def exact_decode(decoder: nn.Module, post_quant_conv: nn.Module | None, latents: torch.Tensor,
                 *, storage: str, device_budget: int | None, tile_size: int,
                 attention: ChunkedAttnProcessor | None = None) -> tuple[torch.Tensor, ExactRunStats]:
    """Decode with GroupNorm statistics over the whole image (see the module docstring).

    Args:
        decoder: a diffusers ``Decoder``.
        post_quant_conv: the VAE's ``post_quant_conv`` (``None`` when it has none).
        latents: ``(B, C, h, w)`` on the decoder's device.
        storage: ``"auto"``, ``"device"`` or ``"host"`` for intermediates.
        device_budget: bytes of intermediates allowed on the device in ``"auto"`` (``None``: half
            the free device memory).
        tile_size: strips hold about ``tile_size**2 * 256`` elements.
        attention: the processor for the mid block (default ``ChunkedAttnProcessor()``).

    Returns:
        ``(image, stats)``: the image ``(B, C_out, H, W)`` and what the run did.
    """
    steps, scales = _decoder_program(decoder)
    weight = decoder.conv_out.weight
    device, dtype = weight.device, weight.dtype
    runner = _Runner(device, dtype, storage, device_budget,
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
            z = decoder.conv_in(z)
            with use_chunked_attention(decoder.mid_block, attention):
                z = decoder.mid_block(z, None)
            norm = steps[0].norm
            stats = {0: group_stats(z, norm.num_groups)} if norm is not None else {}
            planes = {0: _device_plane(z, runner)}
            del z
            _run_program(runner, steps, planes, stats, _device_plane(out[index:index + 1], runner),
                         scales)
        runner.finish()
    runner.stats.seam_rows = sorted(set(runner.stats.seam_rows))
    return out, runner.stats


def exact_encode(encoder: nn.Module, quant_conv: nn.Module | None, image: torch.Tensor, *,
                 storage: str, device_budget: int | None, tile_size: int,
                 attention: ChunkedAttnProcessor | None = None) -> tuple[torch.Tensor, ExactRunStats]:
    """Encode with GroupNorm statistics over the whole image; the latent-resolution tail (mid
    block, output norm and conv, ``quant_conv``) runs untiled.

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
    steps, scales = _encoder_program(encoder)
    weight = encoder.conv_in.weight
    device, dtype = weight.device, weight.dtype
    runner = _Runner(device, dtype, storage, device_budget,
                     tile_size * tile_size * _STRIP_ELEMENTS_PER_TILE_PIXEL)
    image = image.to(device=device, dtype=dtype)
    results: list[torch.Tensor] = []
    with torch.no_grad():
        for index in range(image.shape[0]):
            planes = {0: _device_plane(image[index:index + 1], runner)}
            last = _run_program(runner, steps, planes, {}, None, scales)
            h = last.full()
            runner.release(last)
            with use_chunked_attention(encoder.mid_block, attention):
                h = encoder.mid_block(h)
            h = encoder.conv_out(encoder.conv_act(encoder.conv_norm_out(h)))
            if quant_conv is not None:
                h = quant_conv(h)
            results.append(h.contiguous())
        runner.finish()
    runner.stats.seam_rows = sorted(set(runner.stats.seam_rows))
    return torch.cat(results), runner.stats


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


def math_isclose_int(value: float) -> int | None:
    """``value`` as an int when it is one (to 1e-9), else ``None``."""
    rounded = round(value)
    return int(rounded) if math.isclose(value, rounded, abs_tol=1e-9) and rounded > 0 else None
