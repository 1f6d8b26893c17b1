"""Tiled VAE encode and decode: images larger than the GPU would hold, in tiles.

* :mod:`vramkit.tiling.vae`: :class:`VAETiling` (blended tiles, or exact GroupNorm across the
  whole image), ``attach``/``detach`` on a diffusers ``AutoencoderKL``, seam reports.
* The exact mode, layer by layer in full-width strips, with GroupNorm statistics merged across
  strips (Chan): :mod:`vramkit.tiling._program` (the network as a program of steps, run strip by
  strip), :mod:`vramkit.tiling._strips` (planes on the device or in pinned host memory, copy
  streams, run statistics), :mod:`vramkit.tiling._groupnorm` (the statistics) and
  :mod:`vramkit.tiling._attention` (the mid block's attention, a block of queries at a time).
* :mod:`vramkit.tiling._parts`: which modules of a VAE the tiling runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".vae": ("VAETiling", "TilingHandle", "SeamReport", "TileSpan", "seam_error",
             "plan_tiles", "blend_weights_1d"),
    "._attention": ("ChunkedAttnProcessor", "chunked_attention", "use_chunked_attention"),
    "._groupnorm": ("GroupStats", "group_stats", "merge_group_stats"),
    "._strips": ("ExactRunStats", "StepRecord", "release_host_buffers"),
})

if TYPE_CHECKING:  # static analysers see the real definitions (vae re-exports the rest)
    from vramkit.tiling.vae import *  # noqa: F403
