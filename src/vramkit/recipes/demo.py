"""The ``vramkit demo`` job: fine-tune a diffusion transformer that is larger than a memory budget.

What it does, in order:

1. **Choose a configuration.** On a GPU (default when one is visible) the budget is 4 GiB (at
   most half of the free memory) and the model is a bfloat16 :class:`~vramkit.recipes.dit.DiT`
   of about 1.5x the budget, trained at 1024 image tokens. On a CPU the model is the ``small``
   preset in float32 and the budget is *simulated*: nothing enforces it, the planned device
   bytes are compared against it.
2. **Plan** with :func:`vramkit.plan` (on the meta device, before any weight exists): the
   planner traces one training step of the model (FLOPs, activation bytes by block, the bytes
   each block moves when swapped by the swapper's own rule) and chooses the swapped blocks and
   the checkpointed blocks (any subset) with the best predicted step time whose predicted peak
   fits the budget minus its headroom. On a GPU it measures the copy bandwidth and times one
   block of each kind there; on the CPU (budget simulated) it plans the layout as for
   :data:`CPU_PLAN_HARDWARE` and predicts no time. The ring holds ``num_slots`` slots (the
   planner is held to that number); activation offload and packed storage stay off.
3. **Train** ``steps`` steps of LoRA fine-tuning (rank-``lora_rank`` adapters of
   :mod:`vramkit.recipes.lora` on the attention projections of every block, float32, AdamW; the
   base weights are frozen, as in a real LoRA fine-tune, so they travel host->device only) on
   one fixed synthetic flow-matching batch (a few-image fine-tune, so the loss visibly falls),
   under the :class:`~vramkit.memory.profiler.MemoryProfiler`. On CUDA the budget is enforced with
   ``torch.cuda.set_per_process_memory_fraction`` (restored afterwards).
4. **Baseline**: the same model, fully resident, same checkpointing, same adapters and data, when
   it fits on the device; its median step time gives the swapping overhead, its losses the check
   that swapping computes the same thing.

**One step-time statistic.** Every figure of speed is the *median step time with the first step
left out* (the first learns the block order and starts the libraries):
``DemoResult.median_step_seconds`` and ``baseline_median_step_seconds``; their ratio is
``slowdown``. :class:`DemoProgress` carries the running value of the same statistic, so a
progress bar and the summary agree.

**Timing.** On the CPU the swapped and the resident run are measured in *paired, alternating
rounds* (``timing == "paired"``), as the benchmarks do: a second copy of the model (same
weights, adapters, data and checkpointing, its own optimizer) is built, and round ``r`` runs one
step of each, the swapped one first in even rounds and second in odd ones, so drift of a shared
machine (other processes, clocks) falls on both alike. The losses of the two runs are still
compared step by step. On CUDA the runs are sequential (``timing == "sequential"``): a fully
resident copy next to the swapped model would not fit the enforced budget (the cap is a
per-process fraction of the device) and would mix into the measured peak; GPU time from CUDA
events also drifts far less than a shared CPU. Step times come from CUDA events around each step
(or the host clock on the CPU); the host stays at most one step ahead of the GPU (a step's loss
is read while the next step is already queued), so the swapper's copy stream is not drained by
the demo itself.

**Profile.** The swapped and the resident run are profiled as two workloads
(:meth:`MemoryProfiler.workload <vramkit.memory.profiler.MemoryProfiler.workload>`): the leak
verdict judges each run's own steps, never the switch from one run to the other. After each
phase of a swapped step the demo records the swapper's new block loads as ``"block loads"``
events (a lane of ticks under the report's timeline). On CUDA the budget is drawn as a line above
what the process held before; on the CPU the budget is simulated and the timeline shows host RSS,
which it does not bound, so no budget line is drawn. On the CPU the leak verdict reads live
tensor bytes (a :class:`~vramkit.memory.leaks.LeakDetector`), not host RSS, which also grows while
the C allocator's arenas settle in the first steps.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_device, check_int, check_number, check_size
from vramkit.errors import ConfigError, OffloadError
from vramkit.observe.oom import is_oom_error
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
from vramkit.recipes.lora import LORA_TARGETS, LoRALinear, add_lora_adapters
from vramkit.units import format_size

__all__ = [
    "DEFAULT_REPORT",
    "LORA_TARGETS",
    "DemoConfig",
    "DemoPlan",
    "DemoProgress",
    "DemoResult",
    "LoRALinear",
    "add_lora_adapters",
    "plan_demo",
    "run_demo",
]

logger = logging.getLogger(__name__)

#: Where the profile report goes unless ``DemoConfig.report`` says otherwise.
DEFAULT_REPORT = "vramkit-demo-report.html"
GPU_DEFAULT_BUDGET = 4 * 2**30
GPU_MODEL_FACTOR = 1.5  # the default GPU model is this many times the budget
GPU_IMAGE_SIZE = 64  # latent side of the default GPU model: 1024 image tokens (Flux at 512 px)
CPU_PRESET = "small"
_CPU_BUDGET_FACTOR = 0.85  # the simulated CPU budget is at least this fraction of the weights
#: The GPU whose figures lay out a CPU run's simulated budget (its times are not shown).
CPU_PLAN_HARDWARE = "rtx4090"
_DEFAULT_STEPS = {"cuda": 20, "cpu": 10}
_DEFAULT_BATCH = 2
# Margin of the budget kept free (the planner's headroom): allocator fragmentation,
# cuBLAS/attention workspaces and temporaries the activation estimate does not see; on a GPU
# the planner's default (8 % + 256 MiB). The CUDA context lies outside the budget.
_HEADROOM: dict[str, float | None] = {"cuda": None, "cpu": 0.05}
_CUDA_LIBRARY_BYTES = 256 * 2**20  # cuBLAS and attention workspaces of a resident baseline
_ADAMW_STATE_FACTOR = 3  # a gradient plus exp_avg and exp_avg_sq per trainable parameter


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


# -- planning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoPlan:
    """The resolved configuration and memory plan (computed on the meta device).

    Attributes:
        device: where training runs (``"cpu"``, ``"cuda:0"`` ...).
        device_name: the GPU's name, or ``"cpu"``.
        gpu_found: whether a CUDA GPU was visible.
        simulated: the budget is not enforced, only planned against (CPU runs).
        model_name: the preset name, or ``"for_bytes(<size>)"``.
        model_config: the :class:`DiTConfig` as a dict.
        steps / batch_size / lora_rank / learning_rate / num_slots / seed: training settings.
        model_bytes: bytes of the base weights.
        num_blocks: blocks found (double and single stream).
        block_bytes: swappable bytes of all blocks (frozen tensors >= 64 KiB, 512-aligned).
        largest_block_bytes: swappable bytes of the largest block.
        outside_block_bytes: parameters outside the blocks (embedders, final layer).
        block_resident_bytes: small and trainable tensors of blocks (never swapped).
        trainable_params / trainable_bytes: LoRA adapter parameters and their bytes.
        optimizer_bytes: their gradients plus AdamW states.
        activation_bytes_full / activation_bytes_checkpointed: estimated activation bytes
            (saved tensors plus one block of backward temporaries) without / with checkpointing.
        budget_bytes / margin_bytes: the budget and the part of it kept free (the planner's
            headroom).
        minimum_budget_bytes: the smallest budget a plan fits (:class:`~vramkit.errors.
            PlanError`'s ``minimum_budget``).
        checkpointing / checkpointing_reason: whether any block is checkpointed, and why.
        max_gpu_bytes: GPU bytes the plan gives the blocks (resident blocks plus slots).
        planned_swapped_blocks: blocks the plan swaps.
        swapped_block_names: their names; the run swaps exactly these
            (``SwapConfig.swapped_blocks``).
        checkpointed_block_names: the blocks the plan checkpoints.
        activation_bytes_planned: the activations of that choice of checkpointed blocks.
        predicted_peak_bytes: the planner's predicted peak.
        predicted_step_seconds: its predicted step time (``None`` on the CPU: simulated).
        plan_explanation: :meth:`vramkit.planning.Plan.explain`.
        host_bound_phases: the phases the plan predicts host-bound (``"forward"``,
            ``"backward"``; only where the prediction stands on measured times, on a GPU).
    """

    device: str
    device_name: str
    gpu_found: bool
    simulated: bool
    model_name: str
    model_config: dict[str, Any]
    steps: int
    batch_size: int
    lora_rank: int
    learning_rate: float
    num_slots: int
    seed: int
    model_bytes: int
    num_blocks: int
    block_bytes: int
    largest_block_bytes: int
    outside_block_bytes: int
    block_resident_bytes: int
    trainable_params: int
    trainable_bytes: int
    optimizer_bytes: int
    activation_bytes_full: int
    activation_bytes_checkpointed: int
    budget_bytes: int
    margin_bytes: int
    minimum_budget_bytes: int
    checkpointing: bool
    checkpointing_reason: str
    max_gpu_bytes: int
    planned_swapped_blocks: int
    swapped_block_names: list[str] = field(default_factory=list)
    checkpointed_block_names: list[str] = field(default_factory=list)
    activation_bytes_planned: int = 0
    predicted_peak_bytes: int = 0
    predicted_step_seconds: float | None = None
    plan_explanation: str = ""
    host_bound_phases: tuple[str, ...] = ()

    @property
    def dit_config(self) -> DiTConfig:
        """``model_config`` as a :class:`DiTConfig`."""
        return DiTConfig.from_dict(self.model_config)


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


def _model_config(config: DemoConfig, device: torch.device, budget: int | None) -> tuple[DiTConfig, str]:
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


def _block_names(model: nn.Module) -> list[str]:
    from vramkit.offload.blocks import find_blocks

    return [name for name, _ in find_blocks(model)]


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def estimate_activations(model: nn.Module, config: DiTConfig, batch_size: int,
                         block_names: list[str]) -> tuple[int, int]:
    """Activation bytes of one demo training step, without and with block checkpointing.

    The demo's step (:func:`~vramkit.recipes.dit.flow_matching_loss` on a synthetic batch)
    measured by :func:`vramkit.planning.activations.estimate_activations` on the meta device.

    Args:
        model: the model on the meta device (adapters included).
        config: its config.
        batch_size: samples per step.
        block_names: the blocks (as the swapper finds them).

    Returns:
        ``(full, checkpointed)`` in bytes.
    """
    from vramkit.planning.activations import estimate_activations as estimate

    batch = synthetic_batch(config, batch_size, device="meta")
    found = estimate(model, lambda: flow_matching_loss(model, batch), block_names)
    return found.full, found.checkpointed


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
    from vramkit.errors import PlanError
    from vramkit.planning.analysis import analyze
    from vramkit.planning.api import plan as make_plan
    from vramkit.planning.calibration import calibrate_blocks
    from vramkit.planning.machine import measure_machine

    config = config or DemoConfig()
    device, device_name, gpu_found = _resolve_device(config.device)
    kind = device.type
    cuda = kind == "cuda"
    budget = _choose_budget(config, device)
    dit_config, model_name = _model_config(config, device, budget)
    steps = config.steps or _DEFAULT_STEPS[kind]
    batch_size = config.batch_size or _DEFAULT_BATCH

    meta = DiT(dit_config, device="meta")
    names = _block_names(meta)
    adapters = add_lora_adapters(meta, names, config.lora_rank)
    trainable_params = sum(p.numel() for p in adapters)
    trainable_bytes = sum(_tensor_bytes(p) for p in adapters)
    optimizer_bytes = _ADAMW_STATE_FACTOR * trainable_bytes
    batch = synthetic_batch(dit_config, batch_size, device="meta")
    cost = analyze(meta, batch, step=flow_matching_loss, blocks=names, autocast=None)
    block_bytes = [b.swapped["bf16"] for b in cost.blocks]
    block_resident = sum(b.kept["bf16"] + b.adapters for b in cost.blocks)
    largest = max(block_bytes, default=0)
    check_bool("data_parallel", data_parallel)
    buckets = 0
    if data_parallel:
        from vramkit.distributed.planning import ddp_bucket_bytes

        buckets = ddp_bucket_bytes(meta)
    options: dict[str, Any] = dict(
        step=flow_matching_loss, blocks=names, headroom=_HEADROOM[kind],
        num_slots=(config.num_slots,), activation_offload=False, autocast=None, cost=cost,
        reserved_bytes=buckets)
    if cuda:  # measured once, for the probe of the minimum and for the plan
        options["hardware"] = measure_machine(device)
        options["block_times"] = calibrate_blocks(meta, batch, step=flow_matching_loss,
                                                  blocks=names, autocast=None, device=device)
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
        budget = max(int(_CPU_BUDGET_FACTOR * dit_config.weight_bytes()),
                     minimum + math.ceil(rest / 4 / (1 - (_HEADROOM["cpu"] or 0))))
        budget = -(-budget // 2**20) * 2**20
    if budget < minimum:
        raise ConfigError(
            f"a budget of {format_size(budget)} cannot train this model: it needs at least "
            f"{format_size(minimum)} (every block swapped through {config.num_slots} slot(s) "
            f"of the largest block, {format_size(largest)}; every block checkpointed; the "
            "adapters, their optimizer state and the planner's headroom)",
            hint=f"Raise --budget to {format_size(minimum)} or more, or pick a smaller "
                 "--model-size or --batch-size.")
    result = make_plan(meta, batch, budget, **options)
    act_full = cost.activations.full
    act_planned = result.peak_breakdown["activations"]
    checkpointed = list(result.checkpointed)
    if checkpointed:
        reason = (f"{len(checkpointed)} of {len(names)} blocks recompute in backward: "
                  f"activations ~{format_size(act_planned)} instead of ~{format_size(act_full)}")
    else:
        reason = (f"activations without checkpointing (~{format_size(act_full)}) fit beside "
                  "the weights the plan keeps on the device")
    room = (result.peak_breakdown["resident_weights"] - cost.outside_bytes
            + result.peak_breakdown["swap_slots"])
    logger.debug("demo plan: %s model, %s budget, %s for blocks, %d checkpointed (%s)",
                 format_size(dit_config.weight_bytes()), format_size(budget), format_size(room),
                 len(checkpointed), reason)
    return DemoPlan(
        device=str(device), device_name=device_name, gpu_found=gpu_found,
        simulated=not cuda, model_name=model_name, model_config=dit_config.to_dict(),
        steps=steps, batch_size=batch_size, lora_rank=config.lora_rank,
        learning_rate=config.learning_rate, num_slots=config.num_slots, seed=config.seed,
        model_bytes=dit_config.weight_bytes(), num_blocks=len(names),
        block_bytes=sum(block_bytes), largest_block_bytes=largest,
        outside_block_bytes=cost.outside_bytes, block_resident_bytes=block_resident,
        trainable_params=trainable_params, trainable_bytes=trainable_bytes,
        optimizer_bytes=optimizer_bytes, activation_bytes_full=act_full,
        activation_bytes_checkpointed=cost.activations.checkpointed, budget_bytes=budget,
        margin_bytes=result.headroom_bytes, minimum_budget_bytes=minimum,
        checkpointing=bool(checkpointed), checkpointing_reason=reason, max_gpu_bytes=room,
        planned_swapped_blocks=len(result.swapped), swapped_block_names=list(result.swapped),
        checkpointed_block_names=checkpointed, activation_bytes_planned=act_planned,
        predicted_peak_bytes=result.predicted_peak_bytes,
        predicted_step_seconds=result.predicted_step_seconds if cuda else None,
        plan_explanation=result.explain(),
        host_bound_phases=result.host_bound_phases if cuda else ())


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoProgress:
    """One progress report of :func:`run_demo`.

    Attributes:
        stage: ``"build"`` (making the model), ``"train"`` (under swapping) or ``"baseline"``
            (fully resident).
        step: steps finished in this stage (0: the stage starts).
        total: steps of this stage (0 for ``"build"``).
        loss: loss of the step just finished, else ``None``.
        step_seconds: its duration, else ``None``.
        median_step_seconds: the stage's median step time so far, the first step left out once
            there are two (the statistic ``DemoResult`` reports), else ``None``.
    """

    stage: str
    step: int
    total: int
    loss: float | None = None
    step_seconds: float | None = None
    median_step_seconds: float | None = None


ProgressCallback = Callable[[DemoProgress], None]


@dataclass(frozen=True)
class DemoResult:
    """Everything ``vramkit demo`` reports (``--json`` prints :meth:`to_dict`).

    Attributes:
        plan: the :class:`DemoPlan` it ran.
        swapped_blocks / total_blocks / swapped_names: what the swapper swapped.
        swapped_bytes / slot_bytes / pinned_bytes / resident_block_bytes: its sizes
            (:class:`vramkit.offload.swap.SwapStats`).
        checkpointed_blocks: blocks run under gradient checkpointing.
        transfers: the swapper's counters (loads, prefetched, on_demand, hits, h2d_bytes, ...).
        peak_bytes: peak device memory of the swapped run: measured
            (``torch.cuda.max_memory_allocated`` above what the process held before) on CUDA;
            planned on the CPU (weights kept on the device + slots + optimizer + estimated
            activations), since nothing measures a simulated device.
        peak_source: ``"measured"`` or ``"planned (simulated)"``.
        peak_reserved_bytes: the allocator's reserved peak above what the process held before
            (CUDA only).
        peak_breakdown: the planned parts of the peak, in bytes.
        under_budget: ``peak_bytes <= budget``.
        losses / step_seconds: per step of the swapped run.
        median_step_seconds: **the** step-time statistic: the median step time of the swapped
            run, the first step left out when there are two or more (it learns the block order
            and starts the libraries). Progress reports carry its running value.
        baseline_median_step_seconds: the same for the fully resident model, or ``None``.
        baseline_skipped: why there is no baseline, or ``None``.
        slowdown: ``median_step_seconds / baseline_median_step_seconds``, or ``None``.
        baseline_losses / baseline_step_seconds: the resident run's losses and step times.
        baseline_max_loss_diff: the largest difference between the two runs' losses (same
            adapters, same data).
        timing: ``"paired"`` (CPU: the runs alternate step by step, see the module docstring),
            ``"sequential"`` (CUDA: the resident run follows the swapped one) or ``"swapped
            only"`` (no baseline).
        timing_rounds: for ``"paired"``, one entry per round: ``{"round", "first"`` (the
            workload that ran first: ``"swapped"`` or ``"resident"``), ``"swapped_seconds",
            "resident_seconds"}``.
        report_path: the profile report written, or ``None``; ``report_skipped`` says why not.
        build_seconds / wall_seconds: model construction time and the whole run's time.
    """

    plan: DemoPlan
    swapped_blocks: int
    total_blocks: int
    swapped_names: list[str]
    swapped_bytes: int
    slot_bytes: int
    pinned_bytes: int
    resident_block_bytes: int
    checkpointed_blocks: list[str]
    transfers: dict[str, Any]
    peak_bytes: int
    peak_source: str
    peak_reserved_bytes: int | None
    peak_breakdown: dict[str, int]
    under_budget: bool
    losses: list[float]
    step_seconds: list[float]
    median_step_seconds: float
    baseline_median_step_seconds: float | None
    baseline_skipped: str | None
    slowdown: float | None
    baseline_losses: list[float] = field(default_factory=list)
    baseline_max_loss_diff: float | None = None
    baseline_step_seconds: list[float] = field(default_factory=list)
    timing: str = "sequential"
    timing_rounds: list[dict[str, Any]] = field(default_factory=list)
    report_path: str | None = None
    report_skipped: str | None = None
    build_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def loss_first(self) -> float:
        """Loss of the first step."""
        return self.losses[0]

    @property
    def loss_last(self) -> float:
        """Loss of the last step."""
        return self.losses[-1]

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (the plan nested under ``"plan"``)."""
        data = asdict(self)
        data["loss_first"] = self.loss_first
        data["loss_last"] = self.loss_last
        return data


#: The host clock CPU step times are read from (a module attribute, so tests can drive it).
_clock = time.perf_counter


def _median_step(step_seconds: list[float]) -> float:
    """The demo's step-time statistic: the median, the first step left out when there are two
    or more."""
    timed = step_seconds[1:] if len(step_seconds) >= 2 else step_seconds
    return statistics.median(timed)


class _Run:
    """One training run: its model, adapters' AdamW, the fixed batch, and per-step results.

    Each :meth:`step` is one AdamW step under the profiler's workload (``"swapped"`` for stage
    ``"train"``, ``"resident"`` for ``"baseline"``), with phase marks and, when ``loads`` is
    given, the swapper's new block loads recorded as profiler events after each phase.
    """

    def __init__(self, stage: str, model: nn.Module, params: list[nn.Parameter],
                 plan: DemoPlan, device: torch.device, profiler: Any,
                 progress: ProgressCallback | None, loads: Callable[[], int] | None = None
                 ) -> None:
        self.stage = stage
        self.workload = "swapped" if stage == "train" else "resident"
        self.model = model
        self.total = plan.steps
        self.optimizer = torch.optim.AdamW(params, lr=plan.learning_rate, weight_decay=0.0)
        # One fixed batch, as in a few-image (DreamBooth-style) LoRA fine-tune: the loss falls
        # visibly within a few steps, and both runs see the same data.
        generator = torch.Generator(device=device).manual_seed(plan.seed)
        self.batch = synthetic_batch(plan.dit_config, plan.batch_size, generator=generator,
                                     device=device)
        self.cuda = device.type == "cuda"
        self.profiler = profiler
        self.progress = progress
        self.loads = loads
        self.loads_seen = loads() if loads is not None else 0
        self.losses: list[torch.Tensor] = []
        self.seconds: list[float] = []
        self.pending: list[tuple[Any, Any]] = []  # CUDA events of steps not read yet

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return _clock()

    def _mark(self, phase: str | None) -> None:
        if self.profiler is not None:
            self.profiler.mark(None if phase is None else f"{self.workload} {phase}")

    def _note_loads(self, phase: str) -> None:
        if self.loads is None or self.profiler is None:
            return
        loads = self.loads()
        if loads > self.loads_seen:
            count = loads - self.loads_seen
            self.profiler.event("block loads", f"{count} block loads in {self.workload} "
                                               f"{phase}, step {len(self.losses) + 1}", count)
        self.loads_seen = loads

    def step(self) -> None:
        """One training step; reports it (on CUDA: the previous one, still on the GPU now)."""
        if not self.losses and self.progress is not None:
            self.progress(DemoProgress(self.stage, 0, self.total))
        workload = (self.profiler.workload(self.workload) if self.profiler is not None
                    else contextlib.nullcontext())
        with workload:
            start = self._now()
            self._mark("forward")
            loss = flow_matching_loss(self.model, self.batch)
            self._note_loads("forward")
            self._mark("backward")
            loss.backward()
            self._note_loads("backward")
            self._mark("optimizer")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            end = self._now()
            self._mark(None)
            if self.profiler is not None:
                self.profiler.step()
        # a 0-d copy: the loss tensor itself keeps a larger storage alive (2 KiB on the CPU)
        self.losses.append(loss.detach().clone())
        if self.cuda:
            self.pending.append((start, end))
            if len(self.pending) > 1:  # the host stays one step ahead of the device
                self._report(*self.pending.pop(0))
        else:
            self._report(start, end)

    def finish(self) -> None:
        """Report the steps still on the device."""
        while self.pending:
            self._report(*self.pending.pop(0))

    def _report(self, start: Any, end: Any) -> None:
        if self.cuda:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
        else:
            seconds = end - start
        self.seconds.append(seconds)
        index = len(self.seconds) - 1
        if self.progress is not None:
            self.progress(DemoProgress(self.stage, index + 1, self.total,
                                       float(self.losses[index]), seconds,
                                       _median_step(self.seconds)))

    def run(self) -> None:
        for _ in range(self.total):
            self.step()
        self.finish()


def _alternate(swapped: _Run, resident: _Run) -> list[dict[str, Any]]:
    """Paired rounds: one step of each run per round, the swapped one first in even rounds and
    second in odd ones (ABBA), so drift of the machine falls on both alike."""
    rounds = []
    for index in range(swapped.total):
        order = (swapped, resident) if index % 2 == 0 else (resident, swapped)
        for run in order:
            run.step()
        rounds.append({"round": index, "first": order[0].workload,
                       "swapped_seconds": swapped.seconds[index],
                       "resident_seconds": resident.seconds[index]})
    return rounds


@contextlib.contextmanager
def _memory_cap(device: torch.device, budget: int) -> Iterator[tuple[int, int]]:
    """Cap this process's CUDA allocator at what it holds now plus ``budget``; yields the bytes
    (allocated, reserved) before, and restores the previous fraction on exit.

    Garbage is collected first: device tensors of earlier work that only the collector would
    free (reference cycles) would count in "before" and, freed during the run, take the run's
    own peak below it (a second demo in one process read a peak of 0 bytes)."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = get_fraction(device) if get_fraction is not None else 1.0  # torch < 2.9: no getter
    held = torch.cuda.memory_reserved(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, (held + budget) / total), device)
    try:
        torch.cuda.reset_peak_memory_stats(device)
        yield torch.cuda.memory_allocated(device), held
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def _make_profiler(plan: DemoPlan, report: str | Path | None) -> tuple[Any, str | None]:
    if report is None:
        return None, "no report asked for"
    try:
        from vramkit.observe.leaks import LeakDetector
        from vramkit.observe.profiler import MemoryProfiler
    except ImportError as exc:  # the profiler is optional for the demo
        return None, f"memory profiler unavailable: {exc}"
    # On the CPU the leak verdict counts live tensor bytes: host RSS, the timeline's figure
    # there, also grows while the C allocator's arenas settle in the first steps. On CUDA the
    # profiler's allocated bytes are exact already.
    detector = (LeakDetector("cpu", record_stacks=False) if plan.device == "cpu" else False)
    # The demo reads the CUDA peak itself, so the profiler must not reset it.
    return MemoryProfiler(device=plan.device, sample_interval=0.02, reset_peak=False,
                          detect_leaks=detector), None


def _build_model(plan: DemoPlan) -> tuple[DiT, list[nn.Parameter], list[str]]:
    model = DiT(plan.dit_config, seed=plan.seed, device="cpu")
    names = _block_names(model)
    adapters = add_lora_adapters(model, names, plan.lora_rank, seed=plan.seed)
    return model, adapters, names


def _twin(model: nn.Module, adapters: list[nn.Parameter]) -> tuple[nn.Module, list[nn.Parameter]]:
    """A deep copy of ``model`` and its parameters matching ``adapters``, in order."""
    twin = copy.deepcopy(model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    params = dict(twin.named_parameters())
    return twin, [params[name_of[id(p)]] for p in adapters]


def _baseline(model: nn.Module, adapters: list[nn.Parameter], initial: list[torch.Tensor],
              plan: DemoPlan, device: torch.device, profiler: Any,
              progress: ProgressCallback | None) -> tuple[_Run | None, str | None]:
    """The same training fully resident, after the swapped run (CUDA): (the run or None, why
    skipped or None)."""
    activations = plan.activation_bytes_planned
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        need = (plan.model_bytes + plan.trainable_bytes + plan.optimizer_bytes + activations
                + _CUDA_LIBRARY_BYTES)
        if need > free:
            return None, (f"the model does not fit on {device} fully resident (needs about "
                          f"{format_size(need)}, {format_size(free)} free)")
    with torch.no_grad():
        for param, value in zip(adapters, initial, strict=True):
            param.copy_(value)
    try:
        model.to(device)
        run = _Run("baseline", model, adapters, plan, device, profiler, progress)
        run.run()
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        return None, f"out of memory on {device} with the model fully resident"
    return run, None


def run_demo(config: DemoConfig | None = None, *, plan: DemoPlan | None = None,
             progress: ProgressCallback | None = None) -> DemoResult:
    """Train a DiT larger than the budget under block swapping; see the module docstring.

    Args:
        config: the demo settings (default :class:`DemoConfig()`). When ``plan`` is given only
            its ``report`` and ``baseline`` are read.
        plan: a plan from :func:`plan_demo` (default: planned here from ``config``).
        progress: called after the model is built, when a training stage starts and after
            every step.

    Returns:
        The :class:`DemoResult`.

    Raises:
        ConfigError: see :func:`plan_demo`.
        OffloadError: when the swapped run runs out of memory under the budget.
    """
    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.offload.swap import BlockSwapper, SwapConfig

    config = config or DemoConfig()
    plan = plan or plan_demo(config)
    device = torch.device(plan.device)
    cuda = device.type == "cuda"
    paired = config.baseline and not cuda  # see the module docstring ("Timing")
    started = time.perf_counter()
    model, adapters, _ = _build_model(plan)
    initial_adapters = [p.detach().clone() for p in adapters]
    twin, twin_adapters = _twin(model, adapters) if paired else (None, [])
    build_seconds = time.perf_counter() - started
    if progress is not None:
        progress(DemoProgress("build", 0, 0))
    chosen = plan.checkpointed_block_names
    checkpointed = enable_gradient_checkpointing(model, blocks=chosen) if chosen else []
    if twin is not None and chosen:
        enable_gradient_checkpointing(twin, blocks=chosen)
    profiler, report_skipped = _make_profiler(plan, config.report)
    peak_reserved: int | None = None
    swap_config = SwapConfig(swapped_blocks=plan.swapped_block_names, num_slots=plan.num_slots)
    swapped: _Run | None = None
    resident: _Run | None = None
    rounds: list[dict[str, Any]] = []
    skipped: str | None = "not asked for (--no-baseline)"
    if profiler is not None:
        profiler.start()
    try:
        with contextlib.ExitStack() as stack:
            allocated_before, reserved_before = stack.enter_context(
                _memory_cap(device, plan.budget_bytes)) if cuda else (0, 0)
            if profiler is not None and cuda:
                held = (f" above the {format_size(allocated_before)} held before"
                        if allocated_before else "")
                profiler.set_budget(allocated_before + plan.budget_bytes,
                                    f"budget {format_size(plan.budget_bytes)}{held}")
            try:
                with BlockSwapper(model, config=swap_config, device=device) as swapper:
                    swapped = _Run("train", model, adapters, plan, device, profiler, progress,
                                   loads=lambda: swapper.stats().loads)
                    if twin is not None:
                        resident = _Run("baseline", twin, twin_adapters, plan, device, profiler,
                                        progress)
                        rounds = _alternate(swapped, resident)
                        skipped = None
                    else:
                        swapped.run()
                    stats = swapper.stats()
                    swapped_names = swapper.swapped_names
                    if cuda:
                        peak = torch.cuda.max_memory_allocated(device) - allocated_before
                        peak_reserved = torch.cuda.max_memory_reserved(device) - reserved_before
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                raise OffloadError(
                    f"out of memory under the {format_size(plan.budget_bytes)} budget: {exc}",
                    hint="Raise --budget, lower --batch-size, or report the plan (vramkit "
                         "demo --json) if the budget should have been enough.") from None
        if config.baseline and twin is None:
            resident, skipped = _baseline(model, adapters, initial_adapters, plan, device,
                                          profiler, progress)
    finally:
        report_path = None
        if profiler is not None:
            memory_report = profiler.stop()
        if profiler is not None and config.report is not None:
            try:
                report_path = str(memory_report.save(config.report))
            except ImportError as exc:  # .png without matplotlib: the run still stands
                report_skipped = f"could not write {config.report}: {exc}"
    assert swapped is not None  # the swapped run either ran or raised
    breakdown = {
        "weights_on_device": plan.outside_block_bytes + stats.resident_block_bytes,
        "slots": stats.slot_bytes,
        "optimizer": plan.optimizer_bytes,
        "activations_estimate": plan.activation_bytes_planned,
    }
    if not cuda:
        peak = sum(breakdown.values())
    losses = [float(v) for v in swapped.losses]
    median = _median_step(swapped.seconds)
    baseline_losses = [float(v) for v in resident.losses] if resident is not None else []
    baseline_median = _median_step(resident.seconds) if resident is not None else None
    diff = (max(abs(a - b) for a, b in zip(losses, baseline_losses, strict=True))
            if baseline_losses else None)
    del model, twin
    if cuda:
        torch.cuda.empty_cache()
    return DemoResult(
        plan=plan, swapped_blocks=stats.swapped_blocks, total_blocks=stats.blocks,
        swapped_names=swapped_names,
        swapped_bytes=stats.swapped_bytes, slot_bytes=stats.slot_bytes,
        pinned_bytes=stats.pinned_bytes, resident_block_bytes=stats.resident_block_bytes,
        checkpointed_blocks=checkpointed,
        transfers={k: v for k, v in stats.as_dict().items()
                   if k in ("loads", "prefetched", "on_demand", "hits", "h2d_bytes",
                            "d2h_bytes", "acquisitions", "enqueue_seconds")},
        peak_bytes=int(peak), peak_source="measured" if cuda else "planned (simulated)",
        peak_reserved_bytes=peak_reserved, peak_breakdown=breakdown,
        under_budget=peak <= plan.budget_bytes, losses=losses, step_seconds=swapped.seconds,
        median_step_seconds=median, baseline_median_step_seconds=baseline_median,
        baseline_skipped=skipped,
        slowdown=None if baseline_median is None else median / baseline_median,
        baseline_losses=baseline_losses, baseline_max_loss_diff=diff,
        baseline_step_seconds=resident.seconds if resident is not None else [],
        timing="paired" if rounds else ("sequential" if resident is not None
                                        else "swapped only"),
        timing_rounds=rounds, report_path=report_path, report_skipped=report_skipped,
        build_seconds=build_seconds, wall_seconds=time.perf_counter() - started)
