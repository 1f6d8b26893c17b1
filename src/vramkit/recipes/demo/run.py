"""The ``vramkit demo`` job: fine-tune a diffusion transformer that is larger than a memory budget.

What it does, in order:

1. **Choose a configuration.** On a GPU (default when one is visible) the budget is 4 GiB (at
   most half of the free memory) and the model is a bfloat16 :class:`~vramkit.recipes.dit.DiT`
   of about 1.5x the budget, trained at 1024 image tokens. On a CPU the model is the ``small``
   preset in float32 and the budget is *simulated*: nothing enforces it, the planned device
   bytes are compared against it.
2. **Plan** with :func:`vramkit.plan` on the meta device (:func:`~vramkit.recipes.demo.plan.
   plan_demo`).
3. **Apply and train.** :func:`vramkit.fit` applies the plan to the built model (the block
   swapper with exactly the planned blocks and slots; the planned blocks are checkpointed by the
   demo itself, since the resident baseline shares them). Then ``steps`` steps of LoRA
   fine-tuning (rank-``lora_rank`` adapters of :mod:`vramkit.recipes.lora` on the attention
   projections of every block, float32, AdamW; the base weights are frozen, as in a real LoRA
   fine-tune, so they travel host->device only) on one fixed synthetic flow-matching batch (a
   few-image fine-tune, so the loss visibly falls), under the memory profiler. On CUDA the
   budget is enforced with ``torch.cuda.set_per_process_memory_fraction`` (restored
   afterwards), and the :class:`~vramkit.FitReport` gives the measured peak next to the
   prediction.
4. **Baseline**: the same model, fully resident, same checkpointing, same adapters and data, when
   it fits on the device; its median step time gives the swapping overhead, its losses the check
   that swapping computes the same thing.

**Timing** (:mod:`~vramkit.recipes.demo.harness`). On the CPU the swapped and the resident run
are measured in *paired, alternating rounds* (``timing == "paired"``), as the benchmarks do: a
second copy of the model (same weights, adapters, data and checkpointing, its own optimizer) is
built, and each round runs one step of each. The losses of the two runs are still compared step
by step. On CUDA the runs are sequential (``timing == "sequential"``): a fully resident copy next
to the swapped model would not fit the enforced budget (the cap is a per-process fraction of the
device) and would mix into the measured peak; GPU time from CUDA events also drifts far less than
a shared CPU.

**Profile.** The swapped and the resident run are profiled as two workloads. On CUDA the budget
is drawn as a line above what the process held before; on the CPU the budget is simulated and the
timeline shows host RSS, which it does not bound, so no budget line is drawn. On the CPU the leak
verdict reads live tensor bytes, not host RSS, which also grows while the C allocator's arenas
settle in the first steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from vramkit.errors import OffloadError
from vramkit.observe.oom import is_oom_error
from vramkit.planning import FitReport, fit
from vramkit.recipes.demo.config import DemoConfig
from vramkit.recipes.demo.harness import (
    DemoProgress,
    ProgressCallback,
    RatioSpread,
    TrainingRun,
    alternate,
    fixed_batch,
    make_profiler,
    median_step_seconds,
    memory_cap,
    ratio_spread,
)
from vramkit.recipes.demo.plan import DemoPlan, block_names, plan_demo
from vramkit.recipes.dit import DiT
from vramkit.recipes.lora import add_lora_adapters
from vramkit.units import format_size

__all__ = ["DemoResult", "build_model", "run_demo"]

_CUDA_LIBRARY_BYTES = 256 * 2**20  # cuBLAS and attention workspaces of a resident baseline
#: The swapper's counters a result keeps.
_TRANSFERS = ("loads", "prefetched", "on_demand", "hits", "h2d_bytes", "d2h_bytes",
              "acquisitions", "enqueue_seconds")


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
        slowdown_spread: for ``"paired"`` timing, how the rounds' own ratios scatter
            (:class:`~vramkit.recipes.demo.harness.RatioSpread`: min, quartiles, max, and
            ``wide`` when the ratio means little by its stated rule); ``None`` otherwise.
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
        prediction: on CUDA, the planner's prediction next to the swapped run
            (:meth:`vramkit.Fitted.report`: the measured peak), its step time the median above;
            ``None`` on the CPU, where the budget is simulated and no time is predicted.
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
    prediction: FitReport | None = None
    slowdown_spread: RatioSpread | None = None

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
        data["plan"] = self.plan.to_dict()
        data["loss_first"] = self.loss_first
        data["loss_last"] = self.loss_last
        return data


def build_model(plan: DemoPlan) -> tuple[DiT, list[nn.Parameter], list[str]]:
    """The plan's DiT on the CPU with its LoRA adapters: ``(model, adapters, block names)``."""
    model = DiT(plan.dit_config, seed=plan.seed, device="cpu")
    names = block_names(model)
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
              progress: ProgressCallback | None) -> tuple[TrainingRun | None, str | None]:
    """The same training fully resident, after the swapped run (CUDA): (the run or None, why
    skipped or None)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        need = (plan.model_bytes + plan.trainable_bytes + plan.optimizer_bytes
                + plan.activation_bytes_planned + _CUDA_LIBRARY_BYTES)
        if need > free:
            return None, (f"the model does not fit on {device} fully resident (needs about "
                          f"{format_size(need)}, {format_size(free)} free)")
    with torch.no_grad():
        for param, value in zip(adapters, initial, strict=True):
            param.copy_(value)
    try:
        model.to(device)
        run = _training_run("baseline", model, adapters, plan, device, profiler, progress)
        run.run()
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        return None, f"out of memory on {device} with the model fully resident"
    return run, None


def _training_run(stage: str, model: nn.Module, adapters: list[nn.Parameter], plan: DemoPlan,
                  device: torch.device, profiler: Any, progress: ProgressCallback | None,
                  loads: Any = None) -> TrainingRun:
    return TrainingRun(stage, model, adapters, steps=plan.steps,
                       learning_rate=plan.learning_rate,
                       batch=fixed_batch(plan.dit_config, plan.batch_size, plan.seed, device),
                       device=device, profiler=profiler, progress=progress, loads=loads)


def _transfers(stats: Any) -> dict[str, Any]:
    if stats is None:  # nothing swapped: the plan keeps every block on the device
        return dict.fromkeys(_TRANSFERS, 0)
    return {k: v for k, v in stats.as_dict().items() if k in _TRANSFERS}


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

    config = config or DemoConfig()
    plan = plan or plan_demo(config)
    device = torch.device(plan.device)
    cuda = device.type == "cuda"
    paired = config.baseline and not cuda  # see the module docstring ("Timing")
    started = time.perf_counter()
    model, adapters, names = build_model(plan)
    initial_adapters = [p.detach().clone() for p in adapters]
    twin, twin_adapters = _twin(model, adapters) if paired else (None, [])
    build_seconds = time.perf_counter() - started
    if progress is not None:
        progress(DemoProgress("build", 0, 0))
    # Both runs checkpoint the planned blocks: the demo turns it on for the model and its twin,
    # and fit leaves blocks already checkpointed as they are (detach keeps them so, for the
    # baseline that follows on CUDA).
    # Compiled blocks are checkpointed by fit, above the compiled forward (checkpointing a block
    # first would have dynamo trace the checkpoint's own machinery).
    chosen = plan.checkpointed_block_names
    if plan.compile:
        checkpointed = list(chosen)
    else:
        checkpointed = enable_gradient_checkpointing(model, blocks=chosen) if chosen else []
    if twin is not None and chosen:
        enable_gradient_checkpointing(twin, blocks=chosen)
    profiler, report_skipped = make_profiler(plan.device, config.report)
    peak_reserved: int | None = None
    prediction: FitReport | None = None
    swapped: TrainingRun | None = None
    resident: TrainingRun | None = None
    rounds: list[dict[str, Any]] = []
    skipped: str | None = "not asked for (--no-baseline)"
    if profiler is not None:
        profiler.start()
    try:
        with contextlib.ExitStack() as stack:
            allocated_before, reserved_before = stack.enter_context(
                memory_cap(device, plan.budget_bytes)) if cuda else (0, 0)
            if profiler is not None and cuda:
                held = (f" above the {format_size(allocated_before)} held before"
                        if allocated_before else "")
                profiler.set_budget(allocated_before + plan.budget_bytes,
                                    f"budget {format_size(plan.budget_bytes)}{held}")
            try:
                # The plan is made: fit reads no example inputs. It observes every step of the
                # swapped run, so its report's peak is the whole run's.
                with fit(model, (), plan.budget_bytes, device=device, plan=plan.planned,
                         observe_steps=plan.steps, compile=plan.compile) as fitted:
                    swapper = fitted.swapper
                    swapped = _training_run(
                        "train", model, adapters, plan, device, profiler, progress,
                        loads=None if swapper is None else lambda: swapper.stats().loads)
                    if twin is not None:
                        resident = _training_run("baseline", twin, twin_adapters, plan, device,
                                                 profiler, progress)
                        rounds = alternate(swapped, resident)
                        skipped = None
                    else:
                        swapped.run()
                    stats = swapper.stats() if swapper is not None else None
                    swapped_names = list(swapper.swapped_names) if swapper is not None else []
                    if cuda:
                        prediction = dataclasses.replace(
                            fitted.report(), steps=len(swapped.seconds),
                            measured_step_seconds=median_step_seconds(swapped.seconds))
                        peak_reserved = torch.cuda.max_memory_reserved(device) - reserved_before
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                raise OffloadError(
                    f"out of memory under the {format_size(plan.budget_bytes)} budget: {exc}",
                    hint="Raise --budget, lower --batch-size, or report the plan (vramkit "
                         "demo --json) if the budget should have been enough.") from None
        if config.baseline and twin is None:
            if plan.compile and chosen:  # fit's checkpointing left with its detach
                enable_gradient_checkpointing(model, blocks=chosen)
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
    resident_block_bytes = stats.resident_block_bytes if stats is not None else 0
    slot_bytes = stats.slot_bytes if stats is not None else 0
    breakdown = {
        "weights_on_device": plan.outside_block_bytes + resident_block_bytes,
        "slots": slot_bytes,
        "optimizer": plan.optimizer_bytes,
        "activations_estimate": plan.activation_bytes_planned,
    }
    if prediction is not None and prediction.measured_peak_bytes is not None:
        peak = prediction.measured_peak_bytes
    else:  # simulated: nothing measures the device, the plan's parts stand for it
        peak = sum(breakdown.values())
    losses = [float(v) for v in swapped.losses]
    median = median_step_seconds(swapped.seconds)
    baseline_losses = [float(v) for v in resident.losses] if resident is not None else []
    baseline_median = median_step_seconds(resident.seconds) if resident is not None else None
    diff = (max(abs(a - b) for a, b in zip(losses, baseline_losses, strict=True))
            if baseline_losses else None)
    del model, twin
    if cuda:
        torch.cuda.empty_cache()
    return DemoResult(
        plan=plan, swapped_blocks=stats.swapped_blocks if stats is not None else 0,
        total_blocks=stats.blocks if stats is not None else len(names),
        swapped_names=swapped_names,
        swapped_bytes=stats.swapped_bytes if stats is not None else 0, slot_bytes=slot_bytes,
        pinned_bytes=stats.pinned_bytes if stats is not None else 0,
        resident_block_bytes=resident_block_bytes, checkpointed_blocks=checkpointed,
        transfers=_transfers(stats),
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
        build_seconds=build_seconds, wall_seconds=time.perf_counter() - started,
        prediction=prediction, slowdown_spread=ratio_spread(rounds))
