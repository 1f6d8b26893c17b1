"""What ``vramkit demo`` runs: :class:`DemoConfig`, its checks, and the defaults chosen for the
device (the budget, the model, steps and batch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vramkit._validate import check_bool, check_device, check_int, check_number, check_size
from vramkit.errors import ConfigError
from vramkit.recipes.dit import DiTConfig

__all__ = ["CPU_PLAN_HARDWARE", "DEFAULT_REPORT", "DemoConfig"]

#: Where the profile report goes unless ``DemoConfig.report`` says otherwise.
DEFAULT_REPORT = "vramkit-demo-report.html"
GPU_DEFAULT_BUDGET = 4 * 2**30
GPU_MODEL_FACTOR = 1.5  # the default GPU model is this many times the budget
GPU_IMAGE_SIZE = 64  # latent side of the default GPU model: 1024 image tokens (Flux at 512 px)
CPU_PRESET = "small"
CPU_BUDGET_FACTOR = 0.85  # the simulated CPU budget is at least this fraction of the weights
#: The GPU whose figures lay out a CPU run's simulated budget (its times are not shown).
CPU_PLAN_HARDWARE = "rtx4090"
DEFAULT_STEPS = {"cuda": 20, "cpu": 10}
DEFAULT_BATCH = 2
# Margin of the budget kept free (the planner's headroom): allocator fragmentation,
# cuBLAS/attention workspaces and temporaries the activation estimate does not see; on a GPU
# the planner's default (8 % + 256 MiB). The CUDA context lies outside the budget.
HEADROOM: dict[str, float | None] = {"cuda": None, "cpu": 0.05}


@dataclass(frozen=True)
class DemoConfig:
    """What ``vramkit demo`` runs; ``None`` fields are chosen for the device.

    Args:
        budget: device memory the training may use (bytes or a string such as ``"4GiB"``).
            Default: 4 GiB on a GPU (at most half its free memory); on a CPU, simulated: 85% of
            the weights, or more when the plan needs it to keep a few blocks resident.
        model_size: a :class:`DiTConfig` preset name (``tiny`` ... ``xl``) or a weight size
            (``"6GiB"``) for :meth:`DiTConfig.for_bytes`. Default: 1.5 x the budget in bfloat16
            on a GPU, the ``small`` preset (float32) on a CPU.
        steps: training steps (>= 1). Default 20 on a GPU, 10 on a CPU.
        batch_size: samples per step (>= 1). Default 2.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (stored as a ``torch.device``; whether
            it is present is checked when the demo is planned). Default: CUDA when available.
        baseline: also time the model fully resident (default ``True``).
        report: path of the profile report (``.html``, ``.json`` or ``.png``); ``None`` or ``""``
            writes none. Default ``vramkit-demo-report.html``.
        lora_rank: rank of the LoRA adapters (default 16).
        learning_rate: AdamW learning rate of the adapters (default 3e-3).
        num_slots: the swapper's GPU slot ring (default 2).
        seed: seed of the weights, adapters and data (default 0).
        compile: ``torch.compile`` each block beneath checkpointing and swapping, planned with
            its blocks timed compiled (``vramkit.fit(..., compile=True)``); the resident
            baseline stays eager (default ``False``).

    Raises:
        ConfigError: for any value out of range.
    """

    budget: int | str | None = None
    model_size: str | int | None = None
    steps: int | None = None
    batch_size: int | None = None
    device: str | torch.device | None = None
    baseline: bool = True
    report: str | Path | None = DEFAULT_REPORT
    lora_rank: int = 16
    learning_rate: float = 3e-3
    num_slots: int = 2
    seed: int = 0
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_size(
            "DemoConfig.budget", self.budget, minimum=1, allow_none=True,
            hint="Give a size such as 4GiB, 1500MB or 2G."))
        if self.model_size is not None:
            object.__setattr__(self, "model_size", _check_model_size(self.model_size))
        check_int("DemoConfig.steps", self.steps, minimum=1, allow_none=True)
        check_int("DemoConfig.batch_size", self.batch_size, minimum=1, allow_none=True)
        object.__setattr__(self, "device", check_device("DemoConfig.device", self.device,
                                                        allow_none=True))
        check_bool("DemoConfig.baseline", self.baseline)
        check_bool("DemoConfig.compile", self.compile)
        if self.report is not None:
            if not isinstance(self.report, (str, Path)):
                raise ConfigError(f"report must be a path or None, got {self.report!r}",
                                  hint="Give report as a path such as 'profile.html' (or a "
                                       "pathlib.Path), or None for no report.")
            if str(self.report) == "":
                object.__setattr__(self, "report", None)
            elif Path(self.report).suffix.lower() not in (".html", ".htm", ".json", ".png"):
                raise ConfigError(f"cannot write a profile report as {str(self.report)!r}",
                                  hint="Use a path ending in .html, .json or .png, or '' for "
                                       "no report.")
        check_int("DemoConfig.lora_rank", self.lora_rank, minimum=1)
        check_int("DemoConfig.num_slots", self.num_slots, minimum=1)
        check_int("DemoConfig.seed", self.seed, minimum=0)
        object.__setattr__(self, "learning_rate", check_number(
            "DemoConfig.learning_rate", self.learning_rate, minimum=0, low_open=True))


def _check_model_size(value: object) -> str | int:
    """A preset name as is, else the weight size in bytes (> 0)."""
    if isinstance(value, str) and value in DiTConfig.preset_names():
        return value
    return check_size("DemoConfig.model_size", value, minimum=1,
                      hint=f"Use a preset ({', '.join(DiTConfig.preset_names())}) or a "
                           "weight size such as 6GiB.")
