"""Recipes built from the floors below: the demo job, memory presets, and the demo model.

* :mod:`vramkit.recipes.demo`: what ``vramkit demo`` runs (plan with :func:`vramkit.plan`, apply
  with :func:`vramkit.fit`, LoRA-train a DiT larger than a budget under swapping and
  checkpointing, compare with the resident model); its timing harness is
  :mod:`vramkit.recipes.demo.harness`.
* :mod:`vramkit.recipes.demo_ddp`: the demo as a data-parallel job
  (``torchrun --nproc_per_node N -m vramkit demo``).
* :mod:`vramkit.recipes.lora`: the demo's LoRA layer (``LoRALinear``, ``add_lora_adapters``).
* :mod:`vramkit.recipes.presets`: SDXL and Flux memory presets and the verbs that apply them.
* :mod:`vramkit.recipes.targets`: the published models ``vramkit plan`` and the benchmarks plan
  for (FLUX.1-dev, SDXL, SD3.5-large, Qwen-Image, Wan2.1-14B, Llama-3.1-8B; ``build_target``,
  ``MODEL_PRESETS``), built on the meta device, and local model folders.
* :mod:`vramkit.recipes.dit`: a Flux-style diffusion transformer with random weights, for the demo
  and the benchmarks (no downloads). It is not re-exported from :mod:`vramkit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".demo": ("run_demo", "plan_demo", "DemoConfig", "DemoPlan", "DemoResult", "DemoProgress",
              "DEFAULT_REPORT"),
    ".demo_ddp": ("run_distributed_demo", "DistributedDemoResult", "agree_on_demo_plan"),
    ".presets": ("SDXLMemoryConfig", "FluxTrainingConfig", "optimize_sdxl_memory",
                 "optimize_flux_memory", "MemoryOptimization", "MemoryEstimate", "ModelProfile",
                 "BlockRow", "measure_model_profile", "unet_blocks", "SDXL_UNET_CONFIG",
                 "FLUX_DEV_TRANSFORMER_CONFIG"),
    ".dit": ("DiT", "DiTConfig", "DoubleStreamBlock", "SingleStreamBlock", "synthetic_batch",
             "flow_matching_loss", "rotary_embedding", "timestep_features"),
    ".lora": ("LoRALinear", "add_lora_adapters", "LORA_TARGETS"),
    ".targets": ("build_target", "PlanTarget", "ModelPreset", "MODEL_PRESETS",
                 "LORA_TARGETS_BY_FAMILY", "list_presets", "TARGET_KINDS", "target_options",
                 "check_inputs"),
    ".target_kinds": ("INPUT_OPTIONS", "TargetKind", "TargetOptions"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.recipes.demo import *  # noqa: F403
    from vramkit.recipes.demo_ddp import *  # noqa: F403
    from vramkit.recipes.dit import *  # noqa: F403
    from vramkit.recipes.lora import *  # noqa: F403
    from vramkit.recipes.presets import *  # noqa: F403
    from vramkit.recipes.targets import *  # noqa: F403
