"""Plan the demo for this machine: resolve :class:`~vramkit.recipes.demo.DemoConfig` (device,
budget, model, steps) and plan it with :func:`vramkit.plan` on the meta device, before any
weight exists.

The planner traces one training step of the model (FLOPs, activation bytes by block, the bytes
each block moves when swapped by the swapper's own rule) and chooses the swapped blocks and the
checkpointed blocks (any subset) with the best predicted step time whose predicted peak fits the
budget minus its headroom. On a GPU it measures the copy bandwidth and times one block of each
kind there; on the CPU (budget simulated) it plans the layout as for
:data:`~vramkit.recipes.demo.config.CPU_PLAN_HARDWARE` and the demo claims no time. The ring holds
``num_slots`` slots (the planner is held to that number); activation offload and packed storage
stay off. :class:`DemoPlan` is that :class:`~vramkit.planning.Plan` with what the demo adds: the
resolved settings, the model, and the smallest budget that trains it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool
from vramkit.errors import ConfigError, PlanError
from vramkit.planning import Plan
from vramkit.recipes.demo.config import (
    CPU_BUDGET_FACTOR,
    CPU_PLAN_HARDWARE,
    CPU_PRESET,
    DEFAULT_BATCH,
    DEFAULT_STEPS,
    GPU_DEFAULT_BUDGET,
    GPU_IMAGE_SIZE,
    GPU_MODEL_FACTOR,
    HEADROOM,
    DemoConfig,
)
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
from vramkit.recipes.lora import add_lora_adapters
from vramkit.units import format_size

__all__ = ["DemoPlan", "block_names", "plan_demo"]

logger = logging.getLogger(__name__)

_ADAMW_STATE_FACTOR = 3  # a gradient plus exp_avg and exp_avg_sq per trainable parameter


@dataclass(frozen=True)
class DemoPlan:
    """The demo's settings resolved for this machine, and the planner's plan for them.

    What the swapper and checkpointing do, the predicted peak and its parts come from
    ``planned`` (the :class:`~vramkit.planning.Plan` of :func:`vramkit.plan`); the properties
    below read them from there under the names ``vramkit demo`` prints and ``--json`` writes.

    Attributes:
        device: where training runs (``"cpu"``, ``"cuda:0"`` ...).
        device_name: the GPU's name, or ``"cpu"``.
        gpu_found: whether a CUDA GPU was visible.
        model_name: the preset name, or ``"for_bytes(<size>)"``.
        model_config: the :class:`DiTConfig` as a dict.
        steps / batch_size / lora_rank / learning_rate / num_slots / seed: training settings
            (``num_slots``: the swapper's ring, which the planner is held to).
        compile: the blocks run ``torch.compile``d (planned with their times compiled).
        planned: the planner's :class:`~vramkit.planning.Plan` (on the CPU, laid out as for
            :data:`~vramkit.recipes.demo.config.CPU_PLAN_HARDWARE`).
        minimum_budget_bytes: the smallest budget a plan fits (:class:`~vramkit.errors.
            PlanError`'s ``minimum_budget``).
        trainable_params / trainable_bytes: LoRA adapter parameters and their bytes.
        largest_block_bytes: swappable bytes of the largest block (a slot's size).
        outside_block_bytes: parameters outside the blocks (embedders, final layer).
        activation_bytes_full: estimated activation bytes without checkpointing.
    """

    device: str
    device_name: str
    gpu_found: bool
    model_name: str
    model_config: dict[str, Any]
    steps: int
    batch_size: int
    lora_rank: int
    learning_rate: float
    num_slots: int
    seed: int
    planned: Plan
    minimum_budget_bytes: int
    trainable_params: int
    trainable_bytes: int
    largest_block_bytes: int
    outside_block_bytes: int
    activation_bytes_full: int
    compile: bool = False

    @property
    def dit_config(self) -> DiTConfig:
        """``model_config`` as a :class:`DiTConfig`."""
        return DiTConfig.from_dict(self.model_config)

    @property
    def simulated(self) -> bool:
        """The budget is not enforced, only planned against (CPU runs)."""
        return not self.device.startswith("cuda")

    @property
    def model_bytes(self) -> int:
        """Bytes of the base weights."""
        return self.dit_config.weight_bytes()

    @property
    def num_blocks(self) -> int:
        """Blocks found (double and single stream)."""
        return len(self.planned.swapped) + len(self.planned.resident)

    @property
    def budget_bytes(self) -> int:
        return self.planned.budget_bytes

    @property
    def margin_bytes(self) -> int:
        """The part of the budget kept free (the planner's headroom)."""
        return self.planned.headroom_bytes

    @property
    def swapped_block_names(self) -> list[str]:
        """The blocks the plan swaps; the run swaps exactly these."""
        return list(self.planned.swapped)

    @property
    def planned_swapped_blocks(self) -> int:
        return len(self.planned.swapped)

    @property
    def checkpointed_block_names(self) -> list[str]:
        """The blocks the plan checkpoints."""
        return list(self.planned.checkpointed)

    @property
    def checkpointing(self) -> bool:
        return bool(self.planned.checkpointed)

    @property
    def optimizer_bytes(self) -> int:
        """The adapters' gradients plus AdamW states."""
        return _ADAMW_STATE_FACTOR * self.trainable_bytes

    @property
    def activation_bytes_planned(self) -> int:
        """The activations of the plan's choice of checkpointed blocks."""
        return self.planned.peak_breakdown["activations"]

    @property
    def max_gpu_bytes(self) -> int:
        """Device bytes the plan gives the blocks (resident blocks plus slots)."""
        parts = self.planned.peak_breakdown
        return parts["resident_weights"] - self.outside_block_bytes + parts["swap_slots"]

    @property
    def predicted_peak_bytes(self) -> int:
        return self.planned.predicted_peak_bytes

    @property
    def predicted_step_seconds(self) -> float | None:
        """The planner's predicted step time; ``None`` on the CPU (simulated: no time is
        claimed)."""
        return None if self.simulated else self.planned.predicted_step_seconds

    @property
    def host_bound_phases(self) -> tuple[str, ...]:
        """The phases the plan predicts host-bound (``"forward"``, ``"backward"``; only where the
        prediction stands on measured times, on a GPU)."""
        return () if self.simulated else self.planned.host_bound_phases

    @property
    def plan_explanation(self) -> str:
        """:meth:`vramkit.planning.Plan.explain`."""
        return self.planned.explain()

    @property
    def checkpointing_reason(self) -> str:
        """Why the plan checkpoints (or not), in words."""
        full, planned = self.activation_bytes_full, self.activation_bytes_planned
        if self.checkpointing:
            return (f"{len(self.planned.checkpointed)} of {self.num_blocks} blocks recompute in "
                    f"backward: activations ~{format_size(planned)} instead of "
                    f"~{format_size(full)}")
        return (f"activations without checkpointing (~{format_size(full)}) fit beside the "
                "weights the plan keeps on the device")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: the fields, the figures read from the planner's plan, and that plan
        under ``"planned"``."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "planned"}
        data["model_config"] = dict(self.model_config)
        for name in _DERIVED:
            data[name] = getattr(self, name)
        data["planned"] = self.planned.to_dict()
        return data


#: The properties ``to_dict`` writes next to the fields (``vramkit demo --json``'s plan).
_DERIVED = ("simulated", "model_bytes", "num_blocks", "budget_bytes", "margin_bytes",
            "swapped_block_names", "planned_swapped_blocks", "checkpointed_block_names",
            "checkpointing", "checkpointing_reason", "optimizer_bytes",
            "activation_bytes_planned", "max_gpu_bytes", "predicted_peak_bytes",
            "predicted_step_seconds", "host_bound_phases", "plan_explanation")


def _resolve_device(requested: str | torch.device | None) -> tuple[torch.device, str, bool]:
    from vramkit.devices._runtime import is_cuda_available
    from vramkit.devices.resolve import cuda_ordinal

    gpu = is_cuda_available()
    if requested is None:
        requested = "cuda" if gpu else "cpu"
    device = torch.device(requested)
    if device.type == "cpu":
        return device, "cpu", gpu
    if not gpu:
        raise ConfigError("--device cuda was asked for, but PyTorch sees no CUDA GPU",
                          hint="Run `vramkit info` to see why, or use --device cpu.")
    index = cuda_ordinal(device, owner="vramkit demo")
    return torch.device("cuda", index), torch.cuda.get_device_name(index), gpu


def _model_config(config: DemoConfig, device: torch.device,
                  budget: int | None) -> tuple[DiTConfig, str]:
    size = config.model_size
    on_gpu = device.type == "cuda"
    if isinstance(size, str):
        return DiTConfig.preset(size), size
    dtype = "bfloat16" if on_gpu else "float32"
    overrides = {"image_size": GPU_IMAGE_SIZE} if on_gpu else {}
    if size is None:
        if not on_gpu:
            return DiTConfig.preset(CPU_PRESET), CPU_PRESET
        assert budget is not None  # the GPU budget is chosen before the model
        size = int(budget * GPU_MODEL_FACTOR)
    return DiTConfig.for_bytes(size, dtype, **overrides), f"for_bytes({format_size(size)})"


def block_names(model: nn.Module) -> list[str]:
    """The blocks of ``model`` as the swapper finds them."""
    from vramkit.offload.blocks import find_blocks

    return [name for name, _ in find_blocks(model)]


def _choose_budget(config: DemoConfig, device: torch.device) -> int | None:
    """The GPU budget (given or default); ``None`` on the CPU until the model is known."""
    if device.type != "cuda":
        return config.budget  # type: ignore[return-value]
    free, total = torch.cuda.mem_get_info(device)
    if config.budget is None:
        return min(GPU_DEFAULT_BUDGET, free // 2)
    budget = int(config.budget)  # type: ignore[arg-type]
    if budget > free:
        raise ConfigError(
            f"--budget {format_size(budget)} is more than the free memory of {device} "
            f"({format_size(free)} of {format_size(total)})",
            hint="Lower --budget, or free the GPU (see `vramkit info`).")
    return budget


def _check_host_memory(dit_config: DiTConfig, model_name: str, kind: str) -> None:
    """Refuse, before anything is built, a model the host cannot hold: the demo builds its
    weights on the host, and on the CPU a second copy (the resident twin) beside them."""
    from vramkit.devices.host import read_host_memory

    copies = 1 if kind == "cuda" else 2
    need = copies * dit_config.weight_bytes()
    room = read_host_memory().headroom
    if room is not None and need > room:
        raise ConfigError(
            f"the DiT {model_name} needs {format_size(need)} of host memory "
            f"({copies} {'copies' if copies > 1 else 'copy'} of "
            f"{format_size(dit_config.weight_bytes())} "
            f"of weights) and this host has {format_size(room)} left",
            hint="Pick a smaller --model-size (a preset: tiny, small, base, large, xl), or free "
                 "host memory.")


def plan_demo(config: DemoConfig | None = None, *, data_parallel: bool = False) -> DemoPlan:
    """Resolve ``config`` for this machine and plan the memory with :func:`vramkit.plan`,
    without building weights.

    Args:
        config: the demo settings (default :class:`DemoConfig()`).
        data_parallel: plan one rank of a DDP job (``torchrun ... vramkit demo``): DDP's
            gradient buckets (one copy of the adapters' gradients) are kept free as well
            (:func:`vramkit.distributed.ddp_bucket_bytes`).

    Returns:
        The :class:`DemoPlan`.

    Raises:
        ConfigError: for a device that is not there, a budget larger than the free GPU memory,
            or a budget below the plan's minimum (the message gives the minimum).
    """
    from vramkit.planning import analyze, calibrate_blocks, measure_machine
    from vramkit.planning import plan as make_plan

    config = config or DemoConfig()
    check_bool("data_parallel", data_parallel)
    device, device_name, gpu_found = _resolve_device(config.device)
    kind = device.type
    budget = _choose_budget(config, device)
    dit_config, model_name = _model_config(config, device, budget)
    _check_host_memory(dit_config, model_name, kind)

    meta = DiT(dit_config, device="meta")
    names = block_names(meta)
    adapters = add_lora_adapters(meta, names, config.lora_rank)
    batch = synthetic_batch(dit_config, config.batch_size or DEFAULT_BATCH, device="meta")
    cost = analyze(meta, batch, step=flow_matching_loss, blocks=names, autocast=None)
    block_bytes = [b.swapped["bf16"] for b in cost.blocks]
    largest = max(block_bytes, default=0)
    buckets = 0
    if data_parallel:
        from vramkit.distributed.planning import ddp_bucket_bytes

        buckets = ddp_bucket_bytes(meta)
    options: dict[str, Any] = dict(
        step=flow_matching_loss, blocks=names, headroom=HEADROOM[kind],
        num_slots=(config.num_slots,), activation_offload=False, autocast=None, cost=cost,
        reserved_bytes=buckets, compile="default" if config.compile else None)
    if kind == "cuda":  # measured once, for the probe of the minimum and for the plan
        options["hardware"] = measure_machine(device)
        options["block_times"] = calibrate_blocks(meta, batch, step=flow_matching_loss,
                                                  blocks=names, autocast=None, device=device,
                                                  compile=options["compile"])
    else:
        options["hardware"] = CPU_PLAN_HARDWARE
    try:
        minimum: int | None = make_plan(meta, batch, 1, **options).budget_bytes
    except PlanError as err:  # as expected: the error names the smallest budget that works
        minimum = err.minimum_budget
    if minimum is None:
        raise ConfigError(f"the DiT {model_name} has no block that can be swapped",
                          hint="Pick a larger --model-size.")
    if budget is None:
        # Simulated CPU budget: below the weights (as on a GPU, the model must not fit), and
        # above the minimum by a quarter of the other blocks' bytes, so that some blocks stay
        # resident and some are swapped. Rounded up to whole MiB.
        rest = max(sum(block_bytes) - config.num_slots * largest, 0)
        budget = max(int(CPU_BUDGET_FACTOR * dit_config.weight_bytes()),
                     minimum + math.ceil(rest / 4 / (1 - (HEADROOM["cpu"] or 0))))
        budget = -(-budget // 2**20) * 2**20
    if budget < minimum:
        raise ConfigError(
            f"a budget of {format_size(budget)} cannot train this model: it needs at least "
            f"{format_size(minimum)} (every block swapped through {config.num_slots} slot(s) "
            f"of the largest block, {format_size(largest)}; every block checkpointed; the "
            "adapters, their optimizer state and the planner's headroom)",
            hint=f"Raise --budget to {format_size(minimum)} or more, or pick a smaller "
                 "--model-size or --batch-size.")
    result = DemoPlan(
        device=str(device), device_name=device_name, gpu_found=gpu_found,
        model_name=model_name, model_config=dit_config.to_dict(),
        steps=config.steps or DEFAULT_STEPS[kind], batch_size=config.batch_size or DEFAULT_BATCH,
        lora_rank=config.lora_rank, learning_rate=config.learning_rate,
        num_slots=config.num_slots, seed=config.seed,
        planned=make_plan(meta, batch, budget, **options), minimum_budget_bytes=minimum,
        trainable_params=sum(p.numel() for p in adapters),
        trainable_bytes=sum(p.numel() * p.element_size() for p in adapters),
        largest_block_bytes=largest, outside_block_bytes=cost.outside_bytes,
        activation_bytes_full=cost.activations.full, compile=config.compile)
    logger.debug("demo plan: %s model, %s budget, %s for blocks, %d checkpointed (%s)",
                 format_size(result.model_bytes), format_size(budget),
                 format_size(result.max_gpu_bytes), len(result.checkpointed_block_names),
                 result.checkpointing_reason)
    return result
