"""The block swapper: a model's blocks streamed between host memory and a ring of GPU slots.

One door: ``from vramkit.offload.swap import BlockSwapper, SwapConfig, SwapStats``. The parts,
bottom to top (a module imports only modules above it in this list, never below):

* :mod:`~vramkit.offload.swap.config`: :class:`SwapConfig`, :class:`SwapStats`, ``GradientHook``.
* :mod:`~vramkit.offload.swap.records`: the swapped blocks' records, their flat master layout
  and the swappable rule (:func:`~vramkit.offload.swap.records.is_swappable`).
* :mod:`~vramkit.offload.swap.disk`, :mod:`~vramkit.offload.swap.source`,
  :mod:`~vramkit.offload.swap.fill`, :mod:`~vramkit.offload.swap.packed`,
  :mod:`~vramkit.offload.swap.host`: where the masters live (pinned pool, shared memory, disk
  tier, compressed) and how they are filled from a checkpoint.
* :mod:`~vramkit.offload.swap.stepper`, :mod:`~vramkit.offload.swap.optimizer`: full
  fine-tuning, each swapped block's optimizer stepped on the GPU inside backward.
* :mod:`~vramkit.offload.swap.ring`: the ring of GPU slots, acquisition, prefetch, slot reuse.
* :mod:`~vramkit.offload.swap.function`, :mod:`~vramkit.offload.swap.graph`: the two autograd
  paths of a training call; :mod:`~vramkit.offload.swap.calls` chooses between them.
* :mod:`~vramkit.offload.swap.state_dict`, :mod:`~vramkit.offload.swap.attach`,
  :mod:`~vramkit.offload.swap.stats`: the model's ``state_dict`` through the masters; attaching
  to and restoring the model; the parts' counters added up into :class:`SwapStats`.
* :mod:`~vramkit.offload.swap.swapper`: :class:`BlockSwapper`, the public face.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".swapper": ("BlockSwapper",),
    ".config": ("SwapConfig", "SwapStats", "GradientHook"),
    ".records": ("BlockFootprint",),
    ".host": ("MasterMemory", "DiskSplit"),
    ".ring": ("BlockLoader",),
    "vramkit.offload.blocks": ("BlockScheduleEntry",),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.offload.blocks import BlockScheduleEntry as BlockScheduleEntry
    from vramkit.offload.swap.config import *  # noqa: F403
    from vramkit.offload.swap.host import DiskSplit as DiskSplit
    from vramkit.offload.swap.host import MasterMemory as MasterMemory
    from vramkit.offload.swap.records import BlockFootprint as BlockFootprint
    from vramkit.offload.swap.ring import BlockLoader as BlockLoader
    from vramkit.offload.swap.swapper import *  # noqa: F403
