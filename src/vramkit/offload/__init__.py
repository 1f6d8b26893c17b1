"""Moving weights, activations and optimizer state between the GPU and host memory.

* :mod:`vramkit.offload.swap`: :class:`BlockSwapper` streams a model's blocks through a ring of
  GPU slots (a package: its ``__init__`` lists the parts).
* :mod:`vramkit.offload.checkpointing`: gradient checkpointing of blocks and functions.
* :mod:`vramkit.offload.cpu`: :class:`CPUOffloadManager`, weights in pinned host memory on request.
* :mod:`vramkit.offload.activations`: activation offload through saved-tensor hooks.
* :mod:`vramkit.offload.optimizer`: :class:`CPUOffloadOptimizer` (ZeRO-Offload style).
* :mod:`vramkit.offload.compiled`: ``torch.compile`` of each block's own forward, beneath
  checkpointing and swapping.
* :mod:`vramkit.offload.chunked`: a block's feed-forward layer over slices of its tokens.
* :mod:`vramkit.offload.subblock`: a block's parts (attentions, feed-forward) each checkpointed
  on their own, inside the block's checkpoint.
* :mod:`vramkit.offload.blocks`: finding a model's repeated blocks and scheduling them.

They share one host->device and one device->host copy stream per GPU
(:mod:`vramkit.memory.transfer`), and wrap forwards only through :mod:`vramkit.offload._patch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".swap.swapper": ("BlockSwapper",),
    ".swap.config": ("SwapConfig", "SwapStats", "GradientHook"),
    ".swap.records": ("BlockFootprint",),
    ".swap.host": ("MasterMemory", "DiskSplit"),
    ".swap.ring": ("BlockLoader",),
    ".blocks": ("BlockScheduleEntry", "BlockSpec", "find_blocks", "module_bytes",
                "as_block_specs", "block_named", "choose_swapped", "named_schedule",
                "natural_key",
                "split_blocks", "spread_evenly", "unet_blocks"),
    ".checkpointing": ("SDXL_CHECKPOINT_BLOCKS", "enable_gradient_checkpointing", "disable_gradient_checkpointing",
                       "is_checkpointed", "unwrapped_forward", "checkpoint",
                       "checkpoint_method", "CHECKPOINT_METHODS",
                       "checkpoint_with_pool", "GradientCheckpointer", "SDXLGradientCheckpoint"),
    ".cpu": ("CPUOffloadManager", "CPUOffloadConfig", "CPUOffloadStats", "LoadHandle"),
    ".activations": ("ActivationOffloader", "ActivationOffloadConfig", "ActivationOffloadStats",
                     "offload_activations"),
    ".optimizer": ("CPUOffloadOptimizer", "OptimizerOffloadStats"),
    ".compiled": ("COMPILE_MODES", "CUDA_GRAPH_MODES", "compile_blocks", "is_compiled",
                  "uncompile_blocks"),
    ".chunked": ("FEED_FORWARD_NAMES", "chunk_feed_forwards", "chunk_tokens", "feed_forward_of",
                 "is_chunked", "token_chunks", "unchunk_feed_forwards"),
    ".subblock": ("PART_NAMES", "REPLAY_ATTRIBUTE", "checkpoint_block_parts", "checkpoint_parts",
                  "is_part_checkpointed", "parts_of", "uncheckpoint_parts"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.offload.activations import *  # noqa: F403
    from vramkit.offload.blocks import *  # noqa: F403
    from vramkit.offload.checkpointing import *  # noqa: F403
    from vramkit.offload.chunked import *  # noqa: F403
    from vramkit.offload.compiled import *  # noqa: F403
    from vramkit.offload.cpu import *  # noqa: F403
    from vramkit.offload.optimizer import *  # noqa: F403
    from vramkit.offload.subblock import *  # noqa: F403
    from vramkit.offload.swap import *  # noqa: F403
