"""Tiled VAE encode and decode: images larger than the GPU would hold, in tiles.

* :mod:`vramkit.tiling.vae`: :class:`VAETiling` (blended tiles, or exact GroupNorm across the
  whole image), ``attach``/``detach`` on a diffusers ``AutoencoderKL``, seam reports.
* :mod:`vramkit.tiling._exact`: the exact mode, layer by layer in full-width strips, with
  GroupNorm statistics merged across strips (Chan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".vae": ("VAETiling", "TilingHandle", "SeamReport", "TileSpan", "seam_error",
             "plan_tiles", "blend_weights_1d"),
    "vramkit.tiling._exact": ("ChunkedAttnProcessor", "ExactRunStats", "GroupStats",
                              "StepRecord", "chunked_attention", "group_stats",
                              "merge_group_stats", "release_host_buffers",
                              "use_chunked_attention"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.tiling._exact import *  # noqa: F403
    from vramkit.tiling.vae import *  # noqa: F403
