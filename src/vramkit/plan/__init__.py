"""Planning memory before anything is allocated: estimates on the meta device.

* :mod:`vramkit.plan.activations`: :func:`estimate_activations`, the activation bytes of a
  training step by block, with and without checkpointing.
* :mod:`vramkit.plan.hardware`: :class:`HardwareProfile` of common GPUs (memory, host link,
  bf16/fp8 throughput), each number with its source.

Weight bytes come from the swapper's own rule (:meth:`vramkit.offload.swap.BlockSwapper.footprint`),
never from a copy of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".activations": ("ActivationEstimate", "estimate_activations"),
    ".hardware": ("HardwareProfile", "PROFILES", "hardware_profile"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.plan.activations import *  # noqa: F403
    from vramkit.plan.hardware import *  # noqa: F403
