"""``torchrun --nproc_per_node N -m vramkit demo``: the demo as a data-parallel job.

Every rank plans its own GPU (:func:`vramkit.recipes.demo.plan_demo` with
``data_parallel=True``: DDP's gradient buckets are kept free; on the CPU the budget is
simulated as in the one-process demo), builds the same DiT with the same LoRA adapters, attaches
a swapper whose frozen masters are shared by the node's ranks
(:func:`vramkit.distributed.shared_swapper`), wraps the model in DDP
(:func:`vramkit.distributed.wrap_ddp`) and trains on its own share of the data: each rank draws
its own synthetic batch, so the job sees ``N x batch_size`` samples per step. Rank 0 reports:

* the plan, the swapped blocks, each rank's peak against the budget;
* host memory: the swapped bytes, the bytes of shared masters (one copy per node) and the sum of
  the local ranks' proportional set sizes;
* the step time (the slowest rank's, median with the first step left out), samples per second
  over the job, and the loss averaged over the ranks;
* that the replicas stayed equal: the largest difference between any rank's adapters and rank
  0's after training (DDP averages the gradients, so it must be 0).

No fully resident baseline runs here (each rank would need a second copy of the model): compare
with a one-process ``vramkit demo`` for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vramkit.errors import OffloadError
from vramkit.observe.oom import is_oom_error
from vramkit.recipes.demo.config import DemoConfig
from vramkit.recipes.demo.harness import (
    DemoProgress,
    TrainingRun,
    fixed_batch,
    median_step_seconds,
    memory_cap,
)
from vramkit.recipes.demo.plan import DemoPlan, plan_demo
from vramkit.units import format_size

__all__ = ["DistributedDemoResult", "agree_on_demo_plan", "run_distributed_demo"]


@dataclass(frozen=True)
class DistributedDemoResult:
    """What a ``torchrun ... vramkit demo`` job reports (rank 0 prints it).

    Attributes:
        plan: rank 0's :class:`~vramkit.recipes.demo.DemoPlan` (every rank plans its own GPU;
            ``plans_agree`` says whether they chose the same blocks).
        world_size / backend / devices: the job (``devices[r]`` is rank ``r``'s device).
        swapped_blocks / total_blocks / swapped_bytes: what each rank's swapper swapped.
        shared_bytes: masters in node-shared memory (one copy per node; 0 when not shared).
        pinned_bytes: per rank, the swapper's host bytes (shared masters counted in each).
        pss_bytes: per rank, the process's proportional set size after training (a shared page
            counts 1/N in each of N ranks), or ``None`` where ``/proc`` does not give it.
        peak_bytes: per rank, peak device memory (measured on CUDA, planned on the CPU).
        under_budget: every rank's peak within the budget.
        losses: per step, the loss averaged over the ranks.
        step_seconds: per step, the slowest rank's step time.
        median_step_seconds: the median of ``step_seconds`` with the first step left out.
        samples_per_second: ``world_size * batch_size / median_step_seconds``.
        replicas_max_diff: the largest difference between a rank's adapters and rank 0's after
            training (0 when DDP kept the replicas equal).
        plans_agree: every rank planned the same swapped and checkpointed blocks and slots
            (when not, every rank ran the plan predicting the slowest step).
        uploads: how each rank filled its slots: ``"sharded"`` (each GPU copied its share of
            a block from the host and the node's GPUs all-gathered the rest over NVLink) or
            ``"whole"``.
        h2d_bytes / gathered_bytes: per rank, weight bytes copied from the host and received
            from the other GPUs.
    """

    plan: DemoPlan
    world_size: int
    backend: str
    devices: list[str]
    swapped_blocks: int
    total_blocks: int
    swapped_bytes: int
    shared_bytes: int
    pinned_bytes: list[int]
    pss_bytes: list[int | None]
    peak_bytes: list[int]
    peak_source: str
    under_budget: bool
    losses: list[float]
    step_seconds: list[float]
    median_step_seconds: float
    samples_per_second: float
    replicas_max_diff: float
    plans_agree: bool
    wall_seconds: float
    uploads: str = "whole"
    h2d_bytes: list[int] = dataclasses.field(default_factory=list)
    gathered_bytes: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (the plan nested under ``"plan"``)."""
        data = asdict(self)
        data["plan"] = self.plan.to_dict()
        return data


def agree_on_demo_plan(plans: list[DemoPlan], mine: DemoPlan) -> tuple[DemoPlan, bool]:
    """The plan this rank runs, given every rank's: its own when all chose the same blocks,
    checkpointing and slots, else the one predicting the slowest step (the most swapped blocks
    on a tie), on this rank's device. Returns it and whether the ranks agreed."""
    choices = [(p.swapped_block_names, p.checkpointed_block_names, p.num_slots) for p in plans]
    if all(c == choices[0] for c in choices):
        return mine, True
    slowest = max(plans, key=lambda p: (p.predicted_step_seconds or 0.0,
                                        p.planned_swapped_blocks))
    return dataclasses.replace(slowest, device=mine.device, device_name=mine.device_name), False


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def run_distributed_demo(config: DemoConfig, info: Any, *,
                         progress: Callable[[DemoProgress], None] | None = None
                         ) -> DistributedDemoResult:
    """Run the demo as one rank of a DDP job (module docstring); collective.

    Args:
        config: the demo settings (``device`` defaults to this rank's device; ``report`` and
            ``baseline`` are not used: the CLI refuses ``--report`` under torchrun).
        info: this rank's :class:`vramkit.distributed.RankInfo`.
        progress: called on rank 0 after each step (``stage="train"``).

    Returns:
        The job's :class:`DistributedDemoResult` (the same on every rank).
    """
    from vramkit.distributed import process_pss_bytes, shared_swapper, wrap_ddp
    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.offload.swap import SwapConfig
    from vramkit.recipes.demo.run import build_model

    started = time.perf_counter()
    if config.device is None:
        config = DemoConfig(**{**config.__dict__, "device": info.device.type})
    plan = plan_demo(config, data_parallel=True)
    device = torch.device(plan.device)
    if device.type == "cuda" and device.index is None:
        device = info.device
    cuda = device.type == "cuda"
    # The node's ranks share one copy of the masters, so they must swap the same blocks: where
    # their plans differ (calibration noise), every rank takes the one predicting the slowest
    # step (as vramkit.distributed.agree_on_plan does), on its own device.
    plan, agree = agree_on_demo_plan(_gather(plan), plan)
    model, adapters, _ = build_model(plan)
    chosen = plan.checkpointed_block_names
    if chosen:
        enable_gradient_checkpointing(model, blocks=chosen)
    swap_config = SwapConfig(swapped_blocks=plan.swapped_block_names, num_slots=plan.num_slots)
    with contextlib.ExitStack() as stack:
        allocated_before, _ = (stack.enter_context(memory_cap(device, plan.budget_bytes))
                               if cuda else (0, 0))
        swapper = stack.enter_context(shared_swapper(model, config=swap_config, device=device))
        ddp = wrap_ddp(model, swapper)
        # The one-process demo's run (AdamW on the adapters, step times from CUDA events with
        # the host one step ahead), on this rank's own data: its seed differs per rank.
        batch = fixed_batch(plan.dit_config, plan.batch_size, plan.seed + 1000 * info.rank,
                            device)
        run = TrainingRun("train", ddp, adapters, steps=plan.steps,
                          learning_rate=plan.learning_rate, batch=batch, device=device,
                          progress=progress if info.rank == 0 else None)
        try:
            run.run()
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            raise OffloadError(
                f"rank {info.rank}: out of memory under the {format_size(plan.budget_bytes)} "
                f"budget: {exc}",
                hint="Raise --budget, or lower --batch-size.") from None
        stats = swapper.stats()
        peak = (torch.cuda.max_memory_allocated(device) - allocated_before if cuda
                else plan.predicted_peak_bytes)
        pss = process_pss_bytes()
        losses, seconds = run.losses, run.seconds
        del ddp, run  # DDP's reducer goes now, not at interpreter exit
    # Losses averaged over ranks; step time of the slowest rank.
    stacked = torch.stack([v.float() for v in losses]).to(device)
    torch.distributed.all_reduce(stacked)
    mean_losses = (stacked / info.world_size).cpu().tolist()
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    step_seconds = times.cpu().tolist()
    # Replicas: every rank's adapters against rank 0's.
    flat = torch.cat([p.detach().reshape(-1).float() for p in adapters]).to(device)
    reference = flat.clone()
    torch.distributed.broadcast(reference, 0)
    diff = (flat - reference).abs().max().reshape(1)
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
    ranks = _gather((str(device), stats.pinned_bytes, pss, int(peak), stats.h2d_bytes,
                     stats.gathered_bytes))
    uploads = "sharded" if swapper.block_loader is not None else "whole"
    median = median_step_seconds(step_seconds)
    return DistributedDemoResult(
        plan=plan, world_size=info.world_size, backend=str(info.backend),
        devices=[r[0] for r in ranks], swapped_blocks=stats.swapped_blocks,
        total_blocks=stats.blocks, swapped_bytes=stats.swapped_bytes,
        shared_bytes=stats.shared_bytes, pinned_bytes=[r[1] for r in ranks],
        pss_bytes=[r[2] for r in ranks], peak_bytes=[r[3] for r in ranks],
        peak_source="measured" if cuda else "planned (simulated)",
        under_budget=all(r[3] <= plan.budget_bytes for r in ranks), losses=mean_losses,
        step_seconds=step_seconds, median_step_seconds=median,
        samples_per_second=info.world_size * plan.batch_size / median,
        replicas_max_diff=float(diff.item()), plans_agree=agree,
        wall_seconds=time.perf_counter() - started, uploads=uploads,
        h2d_bytes=[r[4] for r in ranks], gathered_bytes=[r[5] for r in ranks])
