"""The planner: choose swapping, slots, checkpointing, storage formats and activation offload for
a model, its inputs and a memory budget, before anything is allocated; apply the plan.

* :func:`vramkit.plan` (:mod:`.api`): the plan for a budget, at the best predicted step time.
* :func:`vramkit.fit` (:mod:`.fitting`): plan and apply, then check the prediction after the first
  steps; :meth:`Fitted.detach` gives the model back exactly.
* :mod:`.analysis`: a model's costs by block on the meta device (FLOPs, activation bytes,
  weight bytes per storage format by the swapper's own rule).
* :mod:`.record`: the :class:`Plan` record, what it shows (``explain``, ``to_dict``) and how it is
  saved and loaded (``save``, ``load``, ``from_dict``) for :func:`vramkit.fit` to apply again.
* :mod:`.planner`: the search; :mod:`.pricing`: what a candidate costs (per-block prices as
  built, checkpointed and packed, a candidate's phases and memory); :mod:`.simulation`: one
  phase simulated block by block over the host, the compute stream and the copy engine.
* :mod:`.neighbourhood`: the hand plans one change away from a plan, priced alike (what
  ``benchmarks/regret.py`` measures the plan against).
* :mod:`.machine` / :mod:`.hardware`: the machine, measured or from sourced GPU profiles.
* :mod:`.calibration`: the compute time of one block of each kind, measured on the device.
* :mod:`.activations`: activation bytes of a step by block, with and without checkpointing.

The shipped model presets the CLI plans for (FLUX.1-dev, SDXL, ...) are recipes, a floor above:
:mod:`vramkit.recipes.targets`.

The package is ``vramkit.planning``; its verbs are ``vramkit.plan`` and ``vramkit.fit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".api": ("plan", "DEFAULT_HEADROOM", "DEFAULT_OFFLINE_HARDWARE", "resolve_headroom",
             "DEFAULT_SLOTS", "SWAP_TRAINABLE_SLOTS", "TRAINABLE_MODES"),
    ".fitting": ("fit", "Fitted", "FitReport"),
    ".record": ("Plan", "PhaseTime", "CHECKPOINTING"),
    ".planner": ("search", "Choice", "SWAP_SETS", "SWAP_STATE_SLOWDOWN",
                   "swap_state_factor"),
    ".neighbourhood": ("Neighbour", "choice_of", "fits", "neighbours", "price_choice"),
    ".pricing": ("BlockPrices", "Candidate", "Priced", "StepPricer", "staged_copy_rate",
                 "w8a8_change"),
    ".simulation": ("simulate_phase",),
    ".analysis": ("analyze", "ModelCost", "BlockCost", "Work", "FORMATS", "default_step",
                  "meta_copy", "to_meta"),
    ".calibration": ("BlockTimes", "CallTimes", "calibrate_blocks"),
    ".machine": ("Machine", "machine_for", "measure_machine", "ACHIEVED_FRACTION", "COPY_SLOWDOWN"),
    ".hardware": ("HardwareProfile", "PAGEABLE_MEMCPY_BYTES_PER_S", "PAGEABLE_MEMCPY_SOURCE",
                  "PROFILES", "hardware_profile"),
    ".activations": ("ActivationEstimate", "estimate_activations", "activation_accounting"),
    ".w8a8": ("W8A8_FORMATS", "W8A8_OUTPUT_ERROR", "W8A8_TRAINING_DEVIATION", "LinearCall",
              "accuracy_note", "is_w8a8", "storage_config", "unavailable_on_device",
              "unavailable_on_machine"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.planning.activations import *  # noqa: F403
    from vramkit.planning.analysis import *  # noqa: F403
    from vramkit.planning.api import *  # noqa: F403
    from vramkit.planning.calibration import *  # noqa: F403
    from vramkit.planning.fitting import *  # noqa: F403
    from vramkit.planning.hardware import *  # noqa: F403
    from vramkit.planning.machine import *  # noqa: F403
    from vramkit.planning.neighbourhood import *  # noqa: F403
    from vramkit.planning.planner import *  # noqa: F403
    from vramkit.planning.pricing import *  # noqa: F403
    from vramkit.planning.record import *  # noqa: F403
    from vramkit.planning.simulation import *  # noqa: F403
    from vramkit.planning.w8a8 import *  # noqa: F403
