"""VAE tiling: encode and decode images larger than the GPU would hold, in tiles.

Two modes:

* **Blended** (``exact_groupnorm=False``, the classic scheme): the input is cut into overlapping
  tiles, each tile runs through the model on its own, and the outputs are blended with weights
  that ramp across the overlaps (``"linear"``, ``"cosine"``) or cut at the middle of each
  overlap (``"none"``). Weights are separable and normalised per axis, so the output accumulates
  in one buffer on the device with no weight buffer and no 0/0: at the image border a tile's
  weight is 1. Each tile normalises with its own GroupNorm statistics, so the result differs
  from the untiled one, most near seams (:meth:`VAETiling.seam_report` measures it).
* **Exact** (``exact_groupnorm=True``): GroupNorm layers use the statistics of the whole image,
  merged across tiles with Chan's formula, so the result equals the untiled decode up to
  rounding. Needs a diffusers ``AutoencoderKL``-style model (see :mod:`vramkit.tiling._program`).

Sizes: ``tile_size`` and ``overlap`` are in OUTPUT pixels for decode (image pixels) and in INPUT
pixels for encode (image pixels too), so one config means the same image-space tiles both ways.

Example:
    >>> tiling = VAETiling(tile_size=512, overlap=64)          # doctest: +SKIP
    >>> image = tiling.decode_tiled(vae, latents)               # doctest: +SKIP
    >>> handle = tiling.attach(vae)   # vae.decode / vae.encode now tile  # doctest: +SKIP
    >>> handle.detach()                                         # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from vramkit._validate import check_bool, check_choice, check_int, check_number, check_size
from vramkit.errors import ConfigError, VramkitError
from vramkit.offload import _patch
from vramkit.offload._patch import MethodWrapper
from vramkit.tiling._attention import (
    ChunkedAttnProcessor,
    chunked_attention,
    use_chunked_attention,
)
from vramkit.tiling._groupnorm import GroupStats, group_stats, merge_group_stats
from vramkit.tiling._parts import module_callable, upscale_of, vae_parts
from vramkit.tiling._program import exact_decode, exact_encode
from vramkit.tiling._strips import ExactRunStats, StepRecord, release_host_buffers

__all__ = [
    "ChunkedAttnProcessor",
    "ExactRunStats",
    "GroupStats",
    "SeamReport",
    "StepRecord",
    "TileSpan",
    "TilingHandle",
    "VAETiling",
    "blend_weights_1d",
    "chunked_attention",
    "group_stats",
    "merge_group_stats",
    "plan_tiles",
    "release_host_buffers",
    "seam_error",
    "use_chunked_attention",
]

logger = logging.getLogger(__name__)

_BLENDS = ("linear", "cosine", "none")
_STORAGES = ("auto", "device", "host")
_PROBE_DECODE, _PROBE_ENCODE = 8, 64  # input sizes used to probe a callable's scale factor


# --------------------------------------------------------------------------------------------
# Tile planning and blend weights (pure functions, property-testable)
# --------------------------------------------------------------------------------------------


class TileSpan(NamedTuple):
    """One tile along one axis, in coarse units (the lower-resolution side's pixels).

    Attributes:
        start: first coarse pixel.
        stop: one past the last coarse pixel.
        overlap_before: coarse pixels shared with the previous tile (0 for the first).
        overlap_after: coarse pixels shared with the next tile (0 for the last).
    """

    start: int
    stop: int
    overlap_before: int
    overlap_after: int


def plan_tiles(length: int, tile: int, overlap: int) -> list[TileSpan]:
    """Tiles of length ``tile`` covering ``[0, length)`` with at least ``overlap`` shared pixels.

    The fewest tiles that give every neighbour pair ``>= overlap`` are spread evenly from 0 to
    ``length - tile`` (so no tile is a sliver and the overlaps differ by at most one pixel). A
    tile larger than the axis becomes one tile of the whole axis.

    Args:
        length: axis length (coarse pixels), >= 1.
        tile: tile length, >= 1.
        overlap: minimum overlap, ``0 <= overlap < tile``.

    Returns:
        The spans, in order.
    """
    if length < 1 or tile < 1 or not 0 <= overlap < tile:
        raise ConfigError(f"cannot plan tiles of {tile} with overlap {overlap} over {length}",
                          hint="Give length >= 1, tile >= 1 and 0 <= overlap < tile, e.g. "
                               "plan_tiles(128, 64, 8).")
    if tile >= length:
        return [TileSpan(0, length, 0, 0)]
    count = math.ceil((length - overlap) / (tile - overlap))
    count = max(count, 2)
    travel = length - tile
    starts = [(travel * index) // (count - 1) for index in range(count)]
    spans = []
    for index, start in enumerate(starts):
        before = starts[index - 1] + tile - start if index else 0
        after = start + tile - starts[index + 1] if index + 1 < len(starts) else 0
        spans.append(TileSpan(start, start + tile, before, after))
    return spans


def _ramp(n: int, blend: str, dtype: torch.dtype) -> torch.Tensor:
    """Weights rising over ``n`` pixels; ``ramp[i] + ramp[n-1-i] == 1`` (pixel centres)."""
    t = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    if blend == "cosine":
        t = 0.5 - 0.5 * torch.cos(math.pi * t)
    return t.to(dtype)


def blend_weights_1d(spans: list[TileSpan], scale: int, blend: str,
                     dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-tile weights along one axis, in fine pixels, normalised to sum to 1 at every pixel.

    Args:
        spans: the tiles from :func:`plan_tiles` (coarse units).
        scale: fine pixels per coarse pixel.
        blend: ``"linear"``/``"cosine"`` ramps over each overlap; ``"none"``: each pixel
            belongs to one tile, cut at the middle of each overlap.
        dtype: weight dtype (default float32).

    Returns:
        One 1-D tensor per span, of length ``(stop - start) * scale``, all ones on sides at
        the image border.
    """
    if blend == "none":
        # Tile i owns [cut_i, cut_{i+1}), cuts at the middle of each overlap: one tile per pixel.
        cuts = ([0] + [(b.start + a.stop) * scale // 2 for a, b in itertools.pairwise(spans)]
                + [spans[-1].stop * scale])
        owned = []
        for index, span in enumerate(spans):
            w = torch.zeros((span.stop - span.start) * scale, dtype=dtype)
            w[cuts[index] - span.start * scale:cuts[index + 1] - span.start * scale] = 1.0
            owned.append(w)
        return owned
    weights = []
    for span in spans:
        n = (span.stop - span.start) * scale
        w = torch.ones(n, dtype=torch.float64)
        for side, overlap in (("before", span.overlap_before), ("after", span.overlap_after)):
            fine = overlap * scale
            if not fine:
                continue
            ramp = _ramp(fine, blend, torch.float64)
            if side == "before":
                w[:fine] *= ramp
            else:
                w[n - fine:] *= ramp.flip(0)
        weights.append(w)
    # Normalise so weights sum to exactly 1 per pixel even where three tiles meet.
    total = torch.zeros(spans[-1].stop * scale, dtype=torch.float64)
    for span, w in zip(spans, weights, strict=True):
        total[span.start * scale:span.stop * scale] += w
    return [(w / total[s.start * scale:s.stop * scale]).to(dtype) for s, w in zip(spans, weights, strict=True)]


# --------------------------------------------------------------------------------------------
# Seam error
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeamReport:
    """Error of a tiled result against a reference, over the image and near seams.

    Errors are in units of the output's value range (``abs error / value_range``: a VAE image in
    [-1, 1] with ``value_range=2`` gives errors on the usual [0, 1] scale, 2/255 = 0.0078).

    Attributes:
        max_abs_error: max over the whole image.
        psnr_db: PSNR over the whole image (peak 1 after scaling; ``inf`` if identical).
        seam_max_abs_error: max within ``band_px`` of a seam (``None`` when there is no seam).
        seam_psnr_db: PSNR within ``band_px`` of a seam (``None`` when there is no seam).
        band_px: the band half-width used.
        seams_y: seam rows (output pixels).
        seams_x: seam columns (output pixels).
    """

    max_abs_error: float
    psnr_db: float
    seam_max_abs_error: float | None
    seam_psnr_db: float | None
    band_px: int
    seams_y: tuple[int, ...]
    seams_x: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the report."""
        return asdict(self)


def _psnr(mse: float) -> float:
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def seam_error(output: torch.Tensor, reference: torch.Tensor, seams_y: list[int] | tuple[int, ...],
               seams_x: list[int] | tuple[int, ...] = (), band_px: int = 32,
               value_range: float = 2.0) -> SeamReport:
    """Compare ``output`` with ``reference`` over the image and within ``band_px`` of seams.

    This synchronises with the device (it returns Python floats): a reporting tool, not for hot
    loops.

    Args:
        output: the tiled result ``(..., H, W)``.
        reference: the untiled result, same shape.
        seams_y: seam rows; a band covers rows ``[s - band_px, s + band_px)``.
        seams_x: seam columns (default none).
        band_px: band half-width in pixels (default 32).
        value_range: the output's value range (default 2.0, a [-1, 1] image).

    Returns:
        A :class:`SeamReport`.
    """
    if output.shape != reference.shape:
        raise ConfigError(f"output {tuple(output.shape)} and reference {tuple(reference.shape)} "
                          "differ in shape",
                          hint="Compare outputs of the same input: the tiled and untiled runs must "
                               "return the same shape.")
    value_range = check_number("value_range", value_range, minimum=0, low_open=True)
    diff = (output.float() - reference.float()).abs_() / value_range
    height, width = diff.shape[-2], diff.shape[-1]
    rows = torch.zeros(height, dtype=torch.bool, device=diff.device)
    cols = torch.zeros(width, dtype=torch.bool, device=diff.device)
    for s in seams_y:
        rows[max(0, s - band_px):min(height, s + band_px)] = True
    for s in seams_x:
        cols[max(0, s - band_px):min(width, s + band_px)] = True
    mask = rows[:, None] | cols[None, :]
    seam_max = seam_psnr = None
    if bool(mask.any()):
        near = diff[..., mask]
        seam_max = float(near.max())
        seam_psnr = _psnr(float((near.double() ** 2).mean()))
    return SeamReport(float(diff.max()), _psnr(float((diff.double() ** 2).mean())), seam_max,
                      seam_psnr, band_px, tuple(seams_y), tuple(seams_x))


# --------------------------------------------------------------------------------------------
# The config and its verbs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VAETiling:
    """Tiled VAE encode/decode (see the module docstring for the two modes).

    Args:
        tile_size: tile side in image pixels (OUTPUT pixels for decode, INPUT pixels for encode),
            a multiple of the VAE's scale factor (default 512). In exact mode it sets the work
            size instead: full-width strips of about ``tile_size**2 * 256`` elements.
        overlap: pixels shared by neighbouring tiles, ``0 <= overlap < tile_size`` and a
            multiple of the scale factor (default 64). Unused in exact mode, which needs no
            overlap (and then is not bounded by ``tile_size``).
        blend: ``"linear"`` (default), ``"cosine"`` or ``"none"`` (hard cut at mid-overlap).
        exact_groupnorm: use whole-image GroupNorm statistics (default ``False``). Inference
            only (runs under ``torch.no_grad``); needs an AutoencoderKL-style model.
        scale_factor: the VAE's spatial factor (8 for SD/SDXL); ``None`` (default) reads it from
            a diffusers model or probes a callable with a small input.
        exact_storage: where exact mode keeps its full-size intermediates: ``"device"``,
            ``"host"`` (pinned host memory, async copies) or ``"auto"`` (default: on the device
            while they fit ``exact_device_budget``, the rest on the host).
        exact_device_budget: bytes (int or ``"2GiB"``) of intermediates ``"auto"`` may keep on
            the device: full-size planes, and the mid block's attention keys and values, which
            are always on the device and count first. ``None`` (default) means half the free
            device memory at call time. Peak device memory is about weights + this budget +
            a working set of a few strips (see docs/tiling.md).

    Raises:
        ConfigError: on an invalid value.
    """

    tile_size: int = 512
    overlap: int = 64
    blend: str = "linear"
    exact_groupnorm: bool = False
    scale_factor: int | None = None
    exact_storage: str = "auto"
    exact_device_budget: int | str | None = None
    _last_exact: list[ExactRunStats] = field(default_factory=list, init=False, repr=False,
                                             compare=False)

    def __post_init__(self) -> None:
        check_int("VAETiling.tile_size", self.tile_size, minimum=1)
        check_bool("VAETiling.exact_groupnorm", self.exact_groupnorm)
        # Exact mode has no overlap (strips are exact), so only blended mode bounds it.
        check_int("VAETiling.overlap", self.overlap, minimum=0,
                  maximum=None if self.exact_groupnorm else self.tile_size - 1,
                  hint="Blended tiling needs 0 <= overlap < tile_size; a typical choice is "
                       "tile_size // 8 (64 for 512).")
        check_choice("VAETiling.blend", self.blend, _BLENDS)
        check_int("VAETiling.scale_factor", self.scale_factor, minimum=1, allow_none=True)
        check_choice("VAETiling.exact_storage", self.exact_storage, _STORAGES)
        object.__setattr__(self, "exact_device_budget", check_size(
            "VAETiling.exact_device_budget", self.exact_device_budget, allow_none=True))

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serialisable dict (round-trips through ``VAETiling(**d)``)."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @property
    def last_exact_stats(self) -> ExactRunStats | None:
        """What the last exact-mode call through this config did (``None`` before any)."""
        return self._last_exact[-1] if self._last_exact else None

    # -- verbs -------------------------------------------------------------------------------

    def decode_tiled(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """Decode ``latents`` tile by tile.

        Args:
            decoder: a diffusers ``AutoencoderKL`` (``post_quant_conv`` then ``decoder`` run per
                tile), a diffusers ``Decoder``, or any callable mapping ``(B, C, h, w)`` to
                ``(B, C', h*s, w*s)``.
            latents: ``(B, C, h, w)``, already scaled back (``z / vae.config.scaling_factor``).

        Returns:
            The decoded image ``(B, C', h*s, w*s)`` (the tensor, not a ``DecoderOutput``).
        """
        return self._decode(decoder, latents)[0]

    def encode_tiled(self, encoder: Any, image: torch.Tensor) -> torch.Tensor:
        """Encode ``image`` tile by tile.

        Args:
            encoder: a diffusers ``AutoencoderKL`` (``encoder`` then ``quant_conv`` per tile), a
                diffusers ``Encoder``, or any callable mapping ``(B, C, H, W)`` to
                ``(B, C', H/s, W/s)``.
            image: ``(B, C, H, W)`` with ``H`` and ``W`` multiples of the scale factor.

        Returns:
            For an AutoencoderKL: the latent distribution parameters ``(B, 2*latent_channels,
            H/s, W/s)`` (mean and log-variance; wrap them in diffusers'
            ``DiagonalGaussianDistribution``). Otherwise the callable's tiled output.
        """
        return self._encode(encoder, image)[0]

    def decode_with_seams(self, decoder: Any, latents: torch.Tensor
                          ) -> tuple[torch.Tensor, list[int], list[int]]:
        """:meth:`decode_tiled` that also returns where the seams are.

        Args:
            decoder: as for :meth:`decode_tiled`.
            latents: as for :meth:`decode_tiled`.

        Returns:
            ``(image, seams_y, seams_x)``: seam rows and columns in output pixels (tile edges in
            blended mode; strip edges of every layer, scaled to output pixels, in exact mode).
        """
        return self._decode(decoder, latents)

    def seam_report(self, model: Any, latents: torch.Tensor, reference: torch.Tensor | None = None,
                    band_px: int = 32, value_range: float = 2.0) -> SeamReport:
        """Decode tiled, compare with the untiled decode, and report the error near seams.

        Args:
            model: as for :meth:`decode_tiled`.
            latents: as for :meth:`decode_tiled`.
            reference: the untiled decode; ``None`` (default) computes it (diffusers models run
                their attention through :class:`ChunkedAttnProcessor` so large latents fit).
            band_px: half-width of the band around seams (default 32).
            value_range: the output's value range (default 2.0 for [-1, 1] images).

        Returns:
            A :class:`SeamReport`; seams are tile edges (blended mode) or strip edges (exact).
        """
        output, seams_y, seams_x = self._decode(model, latents)
        if reference is None:
            parts = vae_parts(model, "decode")
            with torch.no_grad():
                if parts is None:
                    reference = model(latents)
                else:
                    with use_chunked_attention(parts[0]):
                        reference = module_callable(parts, "decode")(latents)
        return seam_error(output, reference, seams_y, seams_x, band_px, value_range)

    def attach(self, vae: Any) -> TilingHandle:
        """Make ``vae.decode(z)`` and ``vae.encode(x)`` tiled until ``handle.detach()``.

        The replacements keep diffusers' signatures and return types (``DecoderOutput`` /
        ``AutoencoderKLOutput`` with a ``DiagonalGaussianDistribution``, or tuples with
        ``return_dict=False``), so a pipeline calling the VAE is unchanged.

        Args:
            vae: a diffusers ``AutoencoderKL`` (or a model with the same parts).

        Returns:
            A :class:`TilingHandle`.

        Raises:
            ConfigError: when ``vae`` lacks the AutoencoderKL parts or is already attached.
        """
        return TilingHandle(self, vae)

    # -- implementation ----------------------------------------------------------------------

    def _decode(self, model: Any, latents: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        _check_spatial(latents, "latents")
        parts = vae_parts(model, "decode")
        if self.exact_groupnorm:
            if parts is None:
                raise ConfigError("exact_groupnorm=True needs a diffusers AutoencoderKL or Decoder",
                                  hint="Use exact_groupnorm=False for other callables.")
            out, stats = exact_decode(
                parts[0], parts[1], latents, storage=self.exact_storage,
                device_budget=self.exact_device_budget, tile_size=self.tile_size)
            self._record(stats)
            return out, stats.seam_rows, []
        fn = _as_callable(model, parts, "decode")
        scale = self._scale(parts, "decode", fn, latents)
        return _tiled_apply(fn, latents, scale, up=True, tile=self._coarse(self.tile_size, scale),
                            overlap=self._coarse(self.overlap, scale), blend=self.blend)

    def _encode(self, model: Any, image: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        _check_spatial(image, "image")
        parts = vae_parts(model, "encode")
        if self.exact_groupnorm:
            if parts is None:
                raise ConfigError("exact_groupnorm=True needs a diffusers AutoencoderKL or Encoder",
                                  hint="Use exact_groupnorm=False for other callables.")
            scale = upscale_of(parts, "encode")
            _check_divisible(image, scale)
            out, stats = exact_encode(
                parts[0], parts[1], image, storage=self.exact_storage,
                device_budget=self.exact_device_budget, tile_size=self.tile_size)
            self._record(stats)
            return out, stats.seam_rows, []
        fn = _as_callable(model, parts, "encode")
        scale = self._scale(parts, "encode", fn, image)
        _check_divisible(image, scale)
        return _tiled_apply(fn, image, scale, up=False, tile=self._coarse(self.tile_size, scale),
                            overlap=self._coarse(self.overlap, scale), blend=self.blend)

    def _record(self, stats: ExactRunStats) -> None:
        self._last_exact[:] = [stats]

    def _coarse(self, pixels: int, scale: int) -> int:
        if pixels % scale:
            raise ConfigError(f"tile_size {self.tile_size} and overlap {self.overlap} must be "
                              f"multiples of the scale factor {scale}",
                              hint=f"Round them to multiples of {scale}.")
        return pixels // scale

    def _scale(self, parts: Any, kind: str, fn: Callable[[torch.Tensor], torch.Tensor],
               x: torch.Tensor) -> int:
        if self.scale_factor is not None:
            return self.scale_factor
        if parts is not None:
            return upscale_of(parts, kind)
        return _probe_scale(fn, x, kind)


def _check_spatial(x: Any, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        raise ConfigError(f"{what} must be a (B, C, H, W) tensor, got "
                          f"{getattr(x, 'shape', type(x).__name__)}",
                          hint="Pass a 4-D (batch, channels, height, width) tensor; add a batch "
                               "dimension with x.unsqueeze(0).")


def _check_divisible(image: torch.Tensor, scale: int) -> None:
    if image.shape[-1] % scale or image.shape[-2] % scale:
        raise ConfigError(f"image size {tuple(image.shape[-2:])} is not a multiple of the scale "
                          f"factor {scale}", hint="Crop or pad the image to a multiple of it.")


def _as_callable(model: Any, parts: Any, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if parts is not None:
        return module_callable(parts, kind)
    if not callable(model):
        raise ConfigError(f"cannot {kind} with a {type(model).__name__}: it is not callable",
                          hint="Pass the VAE itself (a diffusers AutoencoderKL or a callable "
                               "module), not its output or a config.")
    return model


def _probe_scale(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, kind: str) -> int:
    """The scale factor of ``fn``, from one run on a small zero input."""
    side = _PROBE_DECODE if kind == "decode" else _PROBE_ENCODE
    # Powers of two: any VAE-like downscale divides them.
    h = 1 << (min(side, x.shape[-2]).bit_length() - 1)
    w = 1 << (min(side, x.shape[-1]).bit_length() - 1)
    with torch.no_grad():
        out = fn(x.new_zeros(1, x.shape[1], h, w))
    ratios = ((out.shape[-2] / h, out.shape[-1] / w) if kind == "decode"
              else (h / out.shape[-2], w / out.shape[-1]))
    scale = _isclose_int(ratios[0])
    if scale is None or ratios[0] != ratios[1]:
        raise ConfigError(f"cannot detect a fixed integer scale factor: a {h}x{w} input gave "
                          f"{tuple(out.shape[-2:])}", hint="Pass VAETiling(scale_factor=...).")
    return scale


def _isclose_int(value: float) -> int | None:
    """``value`` as an int when it is one (to 1e-9), else ``None``."""
    rounded = round(value)
    return int(rounded) if math.isclose(value, rounded, abs_tol=1e-9) and rounded > 0 else None


def _tiled_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, scale: int, *,
                 up: bool, tile: int, overlap: int, blend: str
                 ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Blended tiling. Coarse units are latent pixels; fine ones image pixels."""
    coarse_h, coarse_w = ((x.shape[-2], x.shape[-1]) if up
                          else (x.shape[-2] // scale, x.shape[-1] // scale))
    in_scale, out_scale = (1, scale) if up else (scale, 1)
    ys = plan_tiles(coarse_h, tile, min(overlap, tile - 1))
    xs = plan_tiles(coarse_w, tile, min(overlap, tile - 1))
    wy = blend_weights_1d(ys, out_scale, blend)
    wx = blend_weights_1d(xs, out_scale, blend)
    out: torch.Tensor | None = None
    for span_y, weight_y in zip(ys, wy, strict=True):
        for span_x, weight_x in zip(xs, wx, strict=True):
            piece = fn(x[..., span_y.start * in_scale:span_y.stop * in_scale,
                         span_x.start * in_scale:span_x.stop * in_scale])
            expect = ((span_y.stop - span_y.start) * out_scale,
                      (span_x.stop - span_x.start) * out_scale)
            if tuple(piece.shape[-2:]) != expect:
                raise ConfigError(f"the model turned a tile into {tuple(piece.shape[-2:])}, "
                                  f"expected {expect} for scale factor {scale}",
                                  hint="Pass the right VAETiling(scale_factor=...).")
            if out is None:
                # float32 accumulation: blending in bf16 would round every overlap twice.
                acc_dtype = torch.promote_types(piece.dtype, torch.float32)
                out = torch.zeros(*piece.shape[:-2], coarse_h * out_scale, coarse_w * out_scale,
                                  dtype=acc_dtype, device=piece.device)
                result_dtype = piece.dtype
            weight = (weight_y.to(piece.device)[:, None] * weight_x.to(piece.device)[None, :])
            out[..., span_y.start * out_scale:span_y.stop * out_scale,
                span_x.start * out_scale:span_x.stop * out_scale] += piece * weight
            del piece
    if out is None:  # unreachable: plan_tiles never returns an empty plan
        raise ConfigError("nothing to tile",
                          hint="This is a vramkit bug (plan_tiles returned no tiles); please "
                               "report it with the input shape and the VAETiling settings.")
    seams_y = _seams(ys, out_scale)
    seams_x = _seams(xs, out_scale)
    return out.to(result_dtype), seams_y, seams_x


def _seams(spans: list[TileSpan], scale: int) -> list[int]:
    """Tile edges inside the image (where a tile's own content starts or ends)."""
    edges = {s.start * scale for s in spans[1:]} | {s.stop * scale for s in spans[:-1]}
    return sorted(edges)


# --------------------------------------------------------------------------------------------
# attach / detach
# --------------------------------------------------------------------------------------------


class _TiledMethod(MethodWrapper):
    """What :class:`TilingHandle` installs as a VAE's ``decode`` or ``encode``: a call runs the
    handle's tiled version, or, once switched off beneath a foreign replacement, the method it
    wrapped."""

    __slots__ = ("handle",)

    kind = "tiling"

    def __init__(self, handle: TilingHandle) -> None:
        super().__init__()
        self.handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.inner(*args, **kwargs)
        tiled = self.handle._decode if self.name == "decode" else self.handle._encode
        return tiled(*args, **kwargs)

    def __repr__(self) -> str:
        inner = getattr(self.inner, "__qualname__", type(self.inner).__name__)
        return f"<vramkit tiled {self.name} of {inner}>"


class TilingHandle:
    """Returned by :meth:`VAETiling.attach`; ``detach()`` restores ``vae.decode``/``vae.encode``.

    Both are replaced through :mod:`vramkit.offload._patch` (wrappers of kind ``"tiling"``), so
    ``detach()`` gives back exactly what was there before, even when other vramkit wrappers sit
    on the same methods.

    Args:
        tiling: the config to apply.
        vae: an AutoencoderKL-like model.
    """

    def __init__(self, tiling: VAETiling, vae: Any) -> None:
        if vae_parts(vae, "decode") is None or not hasattr(vae, "decode"):
            raise ConfigError(f"attach() needs a diffusers AutoencoderKL, got {type(vae).__name__}",
                              hint="Call tiling.decode_tiled(fn, latents) for other models.")
        if _patch.find(vae, _TiledMethod.kind, "decode") is not None:
            raise ConfigError("this VAE already has VAETiling attached",
                              hint="Call detach() on the existing handle first.")
        self.tiling = tiling
        self.vae = vae
        self._patched: list[_TiledMethod] = [_patch.install(vae, _TiledMethod(self), "decode")]
        if vae_parts(vae, "encode") is not None and hasattr(vae, "encode"):
            self._patched.append(_patch.install(vae, _TiledMethod(self), "encode"))
        logger.debug("attached %s to %s (%s)", tiling, type(vae).__name__,
                     [w.name for w in self._patched])

    @property
    def attached(self) -> bool:
        """Whether the handle still patches the VAE."""
        return bool(self._patched)

    def _decode(self, z: torch.Tensor, return_dict: bool = True, generator: Any = None) -> Any:
        image = self.tiling.decode_tiled(self.vae, z)
        if not return_dict:
            return (image,)
        try:
            from diffusers.models.autoencoders.vae import DecoderOutput
        except ImportError:  # a diffusers-like model without diffusers: plain tensors
            return image
        return DecoderOutput(sample=image)

    def _encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        moments = self.tiling.encode_tiled(self.vae, x)
        try:
            from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
            from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        except ImportError:
            return moments if return_dict else (moments,)
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def detach(self) -> None:
        """Restore the VAE's own ``decode``/``encode``.

        Raises:
            VramkitError: when called twice.
        """
        if not self._patched:
            raise VramkitError("this tiling handle is already detached",
                               hint="Each attach() is undone by exactly one detach().")
        for wrapper in reversed(self._patched):
            if not _patch.restore(self.vae, wrapper):
                logger.warning("vae.%s was replaced after attach(); leaving the replacement in "
                               "place with tiling turned off", wrapper.name)
        self._patched = []

    def __enter__(self) -> TilingHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._patched:
            self.detach()
