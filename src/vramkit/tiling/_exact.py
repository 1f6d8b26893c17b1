"""Exact tiled VAE decode/encode: GroupNorm statistics over the whole image, merged across tiles.

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
parallel merge, in float64). Strips have no overlap, so every output pixel is computed once and
the statistics come from each pixel exactly once.

The mid block's self-attention is global too: its keys and values for every latent pixel are
computed strip by strip and kept on the device (the only global state), then each strip's queries
attend to all of them (memory-efficient SDPA or query-chunked math, :func:`chunked_attention`).
So the whole decoder (and encoder) is one program of steps, and every full-size intermediate is a
plane under the same budget.

Planes are stored ``(H, W, C)`` contiguous, so a full-width strip is one contiguous range: on the
device while they fit the budget, otherwise in pinned host memory (reused across runs). Uploads
and downloads run on two copy streams (both PCIe directions at once), ordered by CUDA events; the
upload of a strip is enqueued before the compute stream needs it (prefetch), its output is
downloaded while the next strip computes, and the CPU is kept at most ``_MAX_STRIPS_AHEAD`` strips
ahead of the GPU so strip buffers stay bounded. :class:`ExactRunStats` records the bytes moved per
step and, on CUDA, how long the compute stream waited for uploads.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
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
    "StepRecord",
    "chunked_attention",
    "exact_decode",
    "exact_encode",
    "group_stats",
    "merge_group_stats",
    "release_host_buffers",
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
# Run statistics
# --------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one step of an exact run did (one entry of :attr:`ExactRunStats.step_records`).

    Args:
        name: the layer, e.g. ``"up_blocks.3.resnets.0.conv2"``.
        out_shape: ``(C, H, W)`` of the step's output plane.
        out_on_host: whether that plane lives in pinned host memory.
        strips: strips computed (an attention step counts its key/value and query passes).
        h2d_bytes: bytes this step uploaded (strips read from host planes).
        d2h_bytes: bytes this step downloaded (strips written to a host plane).
    """

    name: str
    out_shape: tuple[int, int, int]
    out_on_host: bool = False
    strips: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


@dataclass
class ExactRunStats:
    """What one exact run did (reported by ``VAETiling.last_exact_stats``).

    ``steps``, ``strips``, ``h2d_bytes`` and ``d2h_bytes`` are the sums over ``step_records``.

    Args:
        steps: steps run (convolutions, attention blocks).
        strips: strips computed, over all steps.
        device_plane_bytes_peak: peak bytes of intermediates (planes and the attention's keys
            and values) held on the compute device.
        host_plane_bytes_peak: peak bytes of planes held in pinned host memory.
        attention_kv_bytes: bytes of the largest attention step's keys + values (on the device).
        h2d_bytes: bytes copied host -> device.
        d2h_bytes: bytes copied device -> host.
        host_bytes_newly_pinned: pinned host bytes this run had to allocate (0 once a previous
            run of the same shapes left its buffers in the cache).
        seam_rows: strip boundaries of every step, in pixels of the image.
        step_records: one :class:`StepRecord` per step, in order.
    """

    steps: int = 0
    strips: int = 0
    device_plane_bytes_peak: int = 0
    host_plane_bytes_peak: int = 0
    attention_kv_bytes: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    host_bytes_newly_pinned: int = 0
    seam_rows: list[int] = field(default_factory=list)
    step_records: list[StepRecord] = field(default_factory=list)
    _step_events: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    _wait_events: list[tuple[Any, Any]] = field(default_factory=list, repr=False)

    def timings(self) -> dict[str, Any] | None:
        """Where the compute stream's time went (CUDA runs only; ``None`` on the CPU).

        Waits for the run to finish (a host synchronisation: call it after the run, not in a
        loop).

        Returns:
            ``{"steps_ms": total, "copy_wait_ms": time the compute stream stalled waiting for
            uploads, "step_ms": [per step]}``.
        """
        if not self._step_events:
            return None
        self._step_events[-1][1].synchronize()
        step_ms = [start.elapsed_time(end) for start, end in self._step_events]
        wait_ms = sum(start.elapsed_time(end) for start, end in self._wait_events)
        return {"steps_ms": sum(step_ms), "copy_wait_ms": wait_ms, "step_ms": step_ms}


# --------------------------------------------------------------------------------------------
# Pinned host buffers, reused across runs
# --------------------------------------------------------------------------------------------

# Pinned buffers not in use, reused best-fit. Kept across runs on purpose: pinning gigabytes
# (cudaHostRegister) costs ~1 s per 5 GB, far more than a decode's copies, and the pool's own
# free path cannot help here: it only reuses a block once an event recorded at free time has
# completed, which is never the case while the CPU runs ahead of the GPU, so every run grew it.
_HOST_FREE: list[torch.Tensor] = []
_HOST_LOCK = threading.Lock()
_PINNED_POOL: Any = None


def _pinned_pool() -> Any:
    global _PINNED_POOL
    if _PINNED_POOL is None:
        from vramkit.memory.pool import MemoryPool, PoolConfig
        _PINNED_POOL = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    return _PINNED_POOL


def _take_host_buffer(nbytes: int, pinned: bool) -> tuple[torch.Tensor, int]:
    """A ``uint8`` host buffer of at least ``nbytes`` and the bytes newly allocated for it."""
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8), nbytes
    with _HOST_LOCK:
        fits = [i for i, buf in enumerate(_HOST_FREE) if buf.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda i: _HOST_FREE[i].numel())
            return _HOST_FREE.pop(best), 0
    return _pinned_pool().tensor((nbytes,), torch.uint8), nbytes


def _return_host_buffer(buffer: torch.Tensor, pinned: bool) -> None:
    if pinned:
        with _HOST_LOCK:
            _HOST_FREE.append(buffer)


def release_host_buffers() -> int:
    """Give the pinned host buffers that exact runs keep for reuse back to the pinned pool.

    Call it between runs (never during one) to return the host memory.

    Returns:
        The number of bytes released.
    """
    with _HOST_LOCK:
        released = sum(buf.numel() for buf in _HOST_FREE)
        _HOST_FREE.clear()
    if _PINNED_POOL is not None:
        _PINNED_POOL.trim()
    return released


# --------------------------------------------------------------------------------------------
# Planes: full-size intermediates on the device or in pinned host memory
# --------------------------------------------------------------------------------------------


class _Plane:
    """One full-size ``(C, H, W)`` intermediate of one sample, stored ``(H, W, C)``."""

    def __init__(self, data: torch.Tensor, on_host: bool, runner: _Runner,
                 buffer: torch.Tensor | None = None, counted: bool = False) -> None:
        self.data = data  # (H, W, C) or a strided (H, W, C) view of an NCHW tensor
        self.on_host = on_host
        self.runner = runner
        self.buffer = buffer  # the host buffer behind ``data`` (returned on release)
        self.counted = counted  # a device plane counted against the budget
        self.height, self.width, self.channels = data.shape
        self.nbytes = data.numel() * data.element_size()

    def read(self, y0: int, y1: int) -> torch.Tensor:
        """Rows ``[y0, y1)`` as a ``(1, C, rows, W)`` (channels-last) tensor on the device."""
        rows = self.data[y0:y1]
        runner = self.runner
        if self.on_host:
            runner.count_copy(rows.numel() * rows.element_size(), upload=True)
            if runner.cuda:
                # Enqueued on the upload stream as soon as the CPU gets here, up to
                # _MAX_STRIPS_AHEAD strips before the compute stream needs it (prefetch).
                with torch.cuda.stream(runner.h2d_stream):
                    rows = rows.to(runner.device, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(runner.h2d_stream)
                runner.wait_upload(ready)
                rows.record_stream(runner.compute_stream)  # allocated on the copy stream
            else:
                rows = rows.to(runner.device)
        return rows.permute(2, 0, 1).unsqueeze(0)

    def write(self, y0: int, strip: torch.Tensor) -> None:
        """Store a ``(1, C, rows, W)`` strip at rows ``[y0, y0 + rows)``."""
        rows = strip[0].permute(1, 2, 0)
        dest = self.data[y0:y0 + rows.shape[0]]
        runner = self.runner
        if self.on_host:
            runner.count_copy(rows.numel() * rows.element_size(), upload=False)
        if self.on_host and runner.cuda:
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


# The CPU may enqueue at most this many strips before the GPU finishes them. Enough to keep the
# copy streams a strip or two ahead of the compute stream; a bound because the caching allocator
# can only reuse a strip's buffers once the GPU is done with them, so an unbounded lead (a few
# hundred microseconds of Python per strip against milliseconds of GPU work) would hold one set
# of strip buffers per strip enqueued and break the device budget.
_MAX_STRIPS_AHEAD = 3


class _Runner:
    """Allocates planes (device while under budget, else pinned host), moves strips, keeps the
    run's statistics. Two copy streams (upload, download) so both PCIe directions run at once."""

    def __init__(self, device: torch.device, dtype: torch.dtype, storage: str,
                 device_budget: int | None, strip_elements: int) -> None:
        self.device = device
        self.dtype = dtype
        self.storage = storage
        self.strip_elements = strip_elements
        self.stats = ExactRunStats()
        self.device_live = 0
        self.host_live = 0
        self.record: StepRecord | None = None
        self.cuda = device.type == "cuda"
        self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        self._step_start: Any = None
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            # Host buffers come from earlier runs: their copies (ordered before the compute
            # stream by finish()) must be done before this run's copies touch them.
            self.h2d_stream.wait_stream(self.compute_stream)
            self.d2h_stream.wait_stream(self.compute_stream)
        if device_budget is None:
            if self.cuda:
                free, _total = torch.cuda.mem_get_info(device)
                device_budget = free // 2  # the other half is for strips, weights, the caller
            else:
                device_budget = 1 << 62  # "device" memory is host memory here
        self.device_budget = device_budget

    # -- memory ------------------------------------------------------------------------------

    def new_plane(self, channels: int, height: int, width: int) -> _Plane:
        nbytes = channels * height * width * self.dtype.itemsize
        on_host = self.storage == "host" or (
            self.storage == "auto" and self.device_live + nbytes > self.device_budget)
        if not on_host:
            data = torch.empty((height, width, channels), dtype=self.dtype, device=self.device)
            self._device_delta(nbytes)
            return _Plane(data, False, self, counted=True)
        buffer, new = _take_host_buffer(nbytes, pinned=self.cuda)
        self.stats.host_bytes_newly_pinned += new if self.cuda else 0
        data = buffer[:nbytes].view(self.dtype).view(height, width, channels)
        self.host_live += nbytes
        self.stats.host_plane_bytes_peak = max(self.stats.host_plane_bytes_peak, self.host_live)
        return _Plane(data, True, self, buffer)

    def device_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A device tensor counted as an intermediate (attention keys/values): it always lives
        on the device, and planes created while it is alive see that much less budget."""
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._device_delta(tensor.numel() * tensor.element_size())
        return tensor

    def free_device(self, tensor: torch.Tensor) -> None:
        self._device_delta(-tensor.numel() * tensor.element_size())

    def _device_delta(self, nbytes: int) -> None:
        self.device_live += nbytes
        self.stats.device_plane_bytes_peak = max(self.stats.device_plane_bytes_peak,
                                                 self.device_live)

    def release(self, plane: _Plane) -> None:
        """Forget a plane. Device memory returns to the caching allocator (stream-ordered). A
        host buffer is reusable at once: it is released after the last step reading it has
        ended, and :meth:`end_step` ordered every later download (the only writes) after
        every upload enqueued so far."""
        if plane.on_host:
            self.host_live -= plane.nbytes
            if plane.buffer is not None:
                _return_host_buffer(plane.buffer, pinned=self.cuda)
        elif plane.counted:
            self._device_delta(-plane.nbytes)
        plane.data = plane.buffer = None  # type: ignore[assignment]

    # -- copies, strips and steps -----------------------------------------------------------

    def count_copy(self, nbytes: int, upload: bool) -> None:
        if upload:
            self.stats.h2d_bytes += nbytes
        else:
            self.stats.d2h_bytes += nbytes
        if self.record is not None:
            if upload:
                self.record.h2d_bytes += nbytes
            else:
                self.record.d2h_bytes += nbytes

    def wait_upload(self, ready: Any) -> None:
        """Make the compute stream wait for an upload, timing the stall with two events."""
        before = torch.cuda.Event(enable_timing=True)
        before.record(self.compute_stream)
        self.compute_stream.wait_event(ready)
        after = torch.cuda.Event(enable_timing=True)
        after.record(self.compute_stream)
        self.stats._wait_events.append((before, after))

    def begin_step(self, name: str, out: _Plane | None, shape: tuple[int, int, int]) -> None:
        self.record = StepRecord(name, shape, out_on_host=bool(out is not None and out.on_host))
        self.stats.step_records.append(self.record)
        self.stats.steps += 1
        if self.cuda:
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record(self.compute_stream)

    def end_strip(self) -> None:
        """Count a strip and bound how far the CPU runs ahead of the GPU (see
        ``_MAX_STRIPS_AHEAD``): waits, on the host, for the strip that many strips back."""
        self.stats.strips += 1
        if self.record is not None:
            self.record.strips += 1
        if not self.cuda:
            return
        computed, downloaded = torch.cuda.Event(), torch.cuda.Event()
        computed.record(self.compute_stream)
        downloaded.record(self.d2h_stream)
        self._in_flight.append((computed, downloaded))
        if len(self._in_flight) > _MAX_STRIPS_AHEAD:
            for event in self._in_flight.popleft():
                event.synchronize()

    def end_step(self) -> None:
        """Order the copy streams after each other: every later upload sees this step's
        downloads, and a reused host buffer is only overwritten (on the download stream)
        after every upload from it."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.compute_stream)
            self.stats._step_events.append((self._step_start, end))
            self.h2d_stream.wait_stream(self.d2h_stream)
            self.d2h_stream.wait_stream(self.h2d_stream)
        self.record = None

    def finish(self) -> None:
        """Make the compute stream wait for every copy (no host synchronisation)."""
        if self.cuda:
            self.compute_stream.wait_stream(self.h2d_stream)
            self.compute_stream.wait_stream(self.d2h_stream)
        self._in_flight.clear()

    def strip_rows(self, width: int, channels: int) -> int:
        return max(1, self.strip_elements // max(1, width * channels))


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


def _run_conv_step(runner: _Runner, step: _ConvStep, planes: dict[int, _Plane],
                   stats: dict[int, GroupStats], out_plane: _Plane | None,
                   stats_groups: int | None, row_scale: int) -> tuple[_Plane, GroupStats | None]:
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


def _run_attn_step(runner: _Runner, step: _AttnStep, planes: dict[int, _Plane],
                   stats: dict[int, GroupStats], stats_groups: int | None, row_scale: int
                   ) -> tuple[_Plane, GroupStats | None]:
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
    scale_shift = _norm_scale_shift(attn.group_norm, stats[step.source])
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
        values[:, :, y0 * width:y1 * width] = \
            attn.to_v(h).view(1, n, heads, value_dim).transpose(1, 2)
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
                          f"{type(mid).__name__}")
    steps: list[_Step] = _resnet_steps(mid.resnets[0], f"{name}.resnets.0", source, first_index)
    current = first_index + len(steps)
    processor = attention or ChunkedAttnProcessor()
    for index, (attn, resnet) in enumerate(zip(mid.attentions, mid.resnets[1:], strict=True)):
        if attn is not None:
            if not isinstance(getattr(attn, "group_norm", None), nn.GroupNorm) or \
                    getattr(attn, "spatial_norm", None) is not None or \
                    getattr(attn, "norm_q", None) is not None or \
                    getattr(attn, "norm_k", None) is not None or \
                    getattr(attn, "is_cross_attention", False):
                raise ConfigError("exact tiling supports VAE self-attention with a GroupNorm only")
            steps.append(_AttnStep(f"{name}.attentions.{index}", current, attn,
                                   processor.query_chunk, processor.max_score_bytes))
            current = first_index + len(steps)
        steps += _resnet_steps(resnet, f"{name}.resnets.{index + 1}", current, current)
        current = first_index + len(steps)
    return steps


def _run_program(runner: _Runner, steps: list[_Step], planes: dict[int, _Plane],
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


def _device_plane(tensor: torch.Tensor, runner: _Runner) -> _Plane:
    """Wrap one sample ``(1, C, H, W)`` device tensor as a plane (a view, no copy)."""
    return _Plane(tensor[0].permute(1, 2, 0), False, runner)


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
                          "supported)")
    remaining = sum(1 for b in decoder.up_blocks if getattr(b, "upsamplers", None))
    steps: list[_Step] = [_ConvStep("conv_in", 0, _check_conv(decoder.conv_in, "conv_in"))]
    steps += _mid_block_steps(decoder.mid_block, "mid_block", 1, 1, attention)
    scales = [2 ** remaining] * len(steps)
    current = len(steps)
    for block_index, block in enumerate(decoder.up_blocks):
        if getattr(block, "attentions", None):
            raise ConfigError("exact tiling cannot tile attention inside up blocks")
        for resnet_index, resnet in enumerate(block.resnets):
            steps += _resnet_steps(resnet, f"up_blocks.{block_index}.resnets.{resnet_index}",
                                   current, len(steps))
            scales += [2 ** remaining] * 2
            current = len(steps)
        for upsampler in getattr(block, "upsamplers", None) or []:
            if getattr(upsampler, "use_conv_transpose", False) or \
                    getattr(upsampler, "norm", None) is not None or \
                    not getattr(upsampler, "interpolate", True) or not upsampler.use_conv:
                raise ConfigError("exact tiling supports nearest-x2 + conv upsamplers only")
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
        raise ConfigError("exact tiling needs GroupNorm in the encoder")
    steps: list[_Step] = [_ConvStep("conv_in", 0, _check_conv(encoder.conv_in, "conv_in"))]
    scales = [1]
    current, down = 1, 1
    for block_index, block in enumerate(encoder.down_blocks):
        if getattr(block, "attentions", None):
            raise ConfigError("exact tiling cannot tile attention inside down blocks")
        for resnet_index, resnet in enumerate(block.resnets):
            steps += _resnet_steps(resnet, f"down_blocks.{block_index}.resnets.{resnet_index}",
                                   current, len(steps))
            scales += [down] * 2
            current = len(steps)
        for down_sampler in getattr(block, "downsamplers", None) or []:
            conv = getattr(down_sampler, "conv", None)
            if getattr(down_sampler, "norm", None) is not None or \
                    not getattr(down_sampler, "use_conv", False):
                raise ConfigError("exact tiling supports conv downsamplers only")
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
    runner = _Runner(device, dtype, storage, device_budget,
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
