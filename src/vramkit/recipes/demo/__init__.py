"""``vramkit demo``: LoRA-train a diffusion transformer larger than a memory budget under block
swapping and checkpointing, planned and applied with :func:`vramkit.fit`, and compare it with the
same model fully resident.

* :mod:`.config`: :class:`DemoConfig` (what to run) and the defaults chosen for the device.
* :mod:`.plan`: :func:`plan_demo`, the configuration resolved for this machine and planned with
  :func:`vramkit.plan` (:class:`DemoPlan`).
* :mod:`.run`: :func:`run_demo`, the job (build, fit, train, baseline) and its
  :class:`DemoResult`.
* :mod:`.harness`: the timing harness (training runs stepped one at a time, paired alternating
  rounds, the CUDA memory cap, the profiler), shared with :mod:`vramkit.recipes.demo_ddp`.

The LoRA layer the demo trains (:mod:`vramkit.recipes.lora`) is re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".run": ("run_demo", "DemoResult", "build_model"),
    ".plan": ("plan_demo", "DemoPlan", "block_names"),
    ".config": ("DemoConfig", "DEFAULT_REPORT", "CPU_PLAN_HARDWARE"),
    ".harness": ("DemoProgress", "ProgressCallback", "TrainingRun", "alternate", "fixed_batch",
                 "make_profiler", "median_step_seconds", "memory_cap", "RatioSpread",
                 "ratio_spread", "WIDE_SPREAD", "MIN_ROUNDS"),
    "vramkit.recipes.lora": ("LoRALinear", "add_lora_adapters", "LORA_TARGETS"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.recipes.demo.config import *  # noqa: F403
    from vramkit.recipes.demo.harness import *  # noqa: F403
    from vramkit.recipes.demo.plan import *  # noqa: F403
    from vramkit.recipes.demo.run import *  # noqa: F403
    from vramkit.recipes.lora import *  # noqa: F403
