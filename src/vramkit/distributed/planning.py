"""Planning one rank of a data-parallel job.

Each rank runs the whole model on its own GPU with its own share of the batch, so a rank's plan
is the single-GPU plan for that GPU with two differences, both counted here:

* **DDP's gradient buckets** hold a second copy of the gradients DDP reduces (the trainable
  parameters that are not swapped) unless ``gradient_as_bucket_view=True``: that many bytes of
  the budget are kept free on top of the headroom.
* **Host memory is per node**: with :func:`vramkit.distributed.shared_swapper` the frozen
  masters are pinned once per node, so ``host_budget`` is the node's budget for them, not a
  share of it per rank. Where the plan keeps blocks on disk (a disk tier), each rank reads them
  through its own staging buffers: the node then holds the shared masters plus one set of
  staging buffers per rank (``Plan.host_bytes`` counts one).

* **Copies share the node.** Every rank of a node copies swapped blocks from the same host
  memory: with N ranks copying at once, each gets ``min(h2d, node / N)`` (:class:`NodeCopies`:
  the node's host-memory limit on copies; 4x H100 SXM: 55.2 GB/s alone, 41.3 each with four,
  165 in all). With sharded uploads (:mod:`vramkit.distributed.uploads`) a rank copies 1/N of
  a block and the ranks all-gather the rest over NVLink, a block taking
  ``(w/N) / min(h2d, node/N) + (w (N-1)/N) / allgather`` (:func:`rank_copy_bytes_per_s`);
  the rank's plan is made with that copy rate.

Calibration (``hardware=None``) times this rank's own GPU. :func:`fit_rank` then makes the ranks
agree on one plan (:func:`agree_on_plan`), because the local ranks of a node share one copy of
the swapped masters and must therefore swap the same blocks, and applies it with node-shared
masters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_choice, check_int, check_number, check_size
from vramkit.errors import ConfigError
from vramkit.planning.api import plan
from vramkit.planning.fitting import Fitted, fit
from vramkit.planning.record import Plan

__all__ = ["NODE_COPIES", "NodeCopies", "agree_on_plan", "ddp_bucket_bytes", "fit_rank",
           "node_copies_for", "plan_for_rank", "rank_copy_bytes_per_s"]


@dataclass(frozen=True)
class NodeCopies:
    """How a node's GPUs share host->device copies.

    Attributes:
        host_bytes_per_s: the most the node's host memory delivers to all its GPUs copying at
            once (pinned host->device, bytes/s): each of N gets ``min(h2d, this / N)``.
        allgather_bytes_per_s: the rate at which a GPU receives the other ranks' pieces in an
            all-gather over the node's GPU links (NCCL's bus bandwidth), bytes/s.
        source: where the figures come from.
    """

    host_bytes_per_s: float
    allgather_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        check_number("host_bytes_per_s", self.host_bytes_per_s, minimum=0, low_open=True)
        check_number("allgather_bytes_per_s", self.allgather_bytes_per_s, minimum=0,
                     low_open=True)


#: Measured nodes, by the GPU profile's name (:data:`vramkit.planning.PROFILES`).
NODE_COPIES: dict[str, NodeCopies] = {
    # benchmarks/host_copy_scaling.py, 512 MiB block, 4x H100 SXM of one host (NVLink):
    # whole copies 55.2 GB/s alone, 53.4 each with two at once, 41.3 each with four (165.2 in
    # all); copying 1/4 and all-gathering delivered 121.1 GB/s per GPU, the gather's share
    # (0.75 of the block in 8.26 - 6.05 ms) 339 GB/s. Two ranks: 87.5 GB/s measured, 95
    # predicted (+8.6 %: the smaller gather runs below the four-rank rate).
    "h100-sxm": NodeCopies(host_bytes_per_s=165.2e9, allgather_bytes_per_s=339e9,
                           source="benchmarks/host_copy_scaling.py on 4x H100 SXM "
                                  "(docs/benchmarks.md)"),
}


def node_copies_for(machine_name: str) -> NodeCopies | None:
    """The measured node of a machine's GPU (a profile's name, or ``"measured: <GPU>"``), or
    ``None``: none measured."""
    from vramkit.errors import VramkitError
    from vramkit.planning.hardware import hardware_profile

    name = machine_name.removeprefix("measured: ")
    try:
        return NODE_COPIES.get(hardware_profile(name).name)
    except VramkitError:
        return None


def rank_copy_bytes_per_s(h2d_bytes_per_s: float, local_ranks: int, uploads: str,
                          node: NodeCopies | None) -> float:
    """The rate at which one rank of a node receives a swapped block, all the node's ranks
    loading it together (module docstring).

    Args:
        h2d_bytes_per_s: one GPU's pinned host->device rate, alone.
        local_ranks: the node's ranks (GPUs) loading together.
        uploads: ``"whole"`` (each rank copies the block) or ``"sharded"`` (1/N each, then an
            all-gather).
        node: the node's copy figures (``None``: not measured, copies taken as independent;
            refused for ``"sharded"``, whose gather has no rate then).

    Raises:
        ConfigError: ``"sharded"`` without ``node``.
    """
    n = check_int("local_ranks", local_ranks, minimum=1)
    check_choice("uploads", uploads, ("whole", "sharded"))
    each = h2d_bytes_per_s if node is None else min(h2d_bytes_per_s, node.host_bytes_per_s / n)
    if uploads == "whole" or n == 1:
        return each
    if node is None:
        raise ConfigError("sharded uploads need the node's all-gather rate to be planned",
                          hint="Pass node=NodeCopies(...) (vramkit.distributed.NODE_COPIES "
                               "holds the measured nodes), or plan whole uploads.")
    return 1.0 / ((1 / n) / each + ((n - 1) / n) / node.allgather_bytes_per_s)


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets for ``model``: one copy of every trainable parameter's
    gradient (meta tensors count by their shape)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def plan_for_rank(model: nn.Module, example_inputs: Any, budget: int | str, *,
                  gradient_as_bucket_view: bool = False,
                  device: str | torch.device | None = None, local_ranks: int = 1,
                  uploads: str = "whole", node: NodeCopies | None = None,
                  **plan_options: Any) -> Plan:
    """:func:`vramkit.plan` for one rank of a DDP job (module docstring).

    Args:
        model / example_inputs: this rank's model and its per-rank batch.
        budget: this rank's GPU budget.
        gradient_as_bucket_view: as DDP's option of that name (``True``: the buckets are the
            gradients, nothing extra).
        device: the GPU to calibrate on (default: the current CUDA device, this rank's).
        local_ranks: the ranks of this node, all loading the swapped blocks together (default
            1: the copy rate of one GPU alone).
        uploads: ``"whole"`` (default) or ``"sharded"`` (:class:`ShardedUploads
            <vramkit.distributed.uploads.ShardedUploads>`): how the node's ranks fill their
            slots; the plan is made with the copy rate that gives
            (:func:`rank_copy_bytes_per_s`), said in its notes.
        node: the node's copy figures (default: the measured node of this GPU's kind,
            :data:`NODE_COPIES`, if any).
        **plan_options: the other options of :func:`vramkit.plan` (``headroom``...);
            ``reserved_bytes`` adds to DDP's buckets.

    Returns:
        The rank's :class:`~vramkit.planning.record.Plan`.
    """
    from vramkit.planning.calibration import calibrate_blocks
    from vramkit.planning.machine import machine_for

    check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
    check_int("local_ranks", local_ranks, minimum=1)
    check_choice("uploads", uploads, ("whole", "sharded"))
    extra = 0 if gradient_as_bucket_view else ddp_bucket_bytes(model)
    extra += check_size("reserved_bytes", plan_options.pop("reserved_bytes", 0))
    if device is None and plan_options.get("hardware") is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if local_ranks == 1:
        return plan(model, example_inputs, budget, device=device, reserved_bytes=extra,
                    **plan_options)
    hardware = plan_options.pop("hardware", None)
    if hardware is None and not torch.cuda.is_available():
        from vramkit.planning.api import DEFAULT_OFFLINE_HARDWARE

        hardware = DEFAULT_OFFLINE_HARDWARE
    machine = machine_for(hardware, None if device is None else torch.device(device))
    if hardware is None and plan_options.get("block_times") is None:
        # the machine is measured here (to change its copy rate): its blocks too, as plan()
        # would
        keys = ("mode", "step", "autocast", "blocks")
        plan_options["block_times"] = calibrate_blocks(
            model, example_inputs, device=device,
            formats=tuple(plan_options.get("allow_formats", ())),
            **{k: plan_options[k] for k in keys if k in plan_options})
    node = node if node is not None else node_copies_for(machine.name)
    rate = rank_copy_bytes_per_s(machine.h2d_bytes_per_s, local_ranks, uploads, node)
    shared = replace(machine, h2d_bytes_per_s=rate)
    result = plan(model, example_inputs, budget, hardware=shared, reserved_bytes=extra,
                  **plan_options)
    how = (f"{uploads} uploads by {local_ranks} ranks of the node: a swapped block arrives at "
           f"{rate / 1e9:.1f} GB/s per rank against {machine.h2d_bytes_per_s / 1e9:.1f} alone"
           + (f" ({node.source})" if node is not None else
              " (no measured node for this GPU: copies taken as independent)"))
    return replace(result, notes=(how, *result.notes))


def agree_on_plan(own: Plan, group: Any = None) -> Plan:
    """Collective: one plan for every rank. When the ranks' own plans (each calibrated on its
    GPU) differ -- timing noise, or GPUs of different speeds -- the one predicting the slowest
    step wins: it is the plan of the rank that sets the pace, and it fits every budget it was
    checked against (the ranks share the budget).

    Args:
        own: this rank's plan.
        group: the process group (default: the whole job).

    Returns:
        The plan every rank applies.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return own
    plans: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, own, group=group)
    return max(plans, key=lambda p: (p.predicted_step_seconds, len(p.swapped)))


def fit_rank(model: nn.Module, example_inputs: Any, budget: int | str, *,
             device: str | int | torch.device | None = None, group: Any = None,
             gradient_as_bucket_view: bool = False, shared: bool = True,
             uploads: str = "auto", **options: Any) -> Fitted:
    """:func:`vramkit.fit` for one rank of a DDP job (collective): plan this rank
    (:func:`plan_for_rank`), agree on one plan with the other ranks (:func:`agree_on_plan`), and
    apply it with the frozen masters shared by the node's ranks. Wrap the model next:
    ``vramkit.distributed.wrap_ddp(model, fitted.swapper)`` (when the plan swaps anything).

    Args:
        model / example_inputs / budget: as for :func:`vramkit.fit` (this rank's batch and
            GPU budget).
        device: this rank's device (default: the current CUDA device).
        group: the process group (default: the whole job).
        gradient_as_bucket_view: as for :func:`plan_for_rank`.
        shared: keep the frozen masters in node-shared memory (default ``True``).
        uploads: how the node's GPUs fill their slots, as for
            :func:`vramkit.distributed.shared_swapper` (``"auto"``: sharded over NVLink; whole
            blocks when the plan keeps some on disk).
        **options: the other options of :func:`vramkit.fit` and :func:`vramkit.plan`.

    Returns:
        The :class:`~vramkit.planning.fitting.Fitted` model.
    """
    from vramkit.devices.resolve import resolve_device
    from vramkit.distributed.shared import NodeSharedMasters
    from vramkit.distributed.uploads import UPLOAD_MODES, node_uploads

    check_bool("shared", shared)
    check_choice("uploads", uploads, UPLOAD_MODES)
    fit_keys = ("observe_steps", "checkpoint", "prefix", "strict")
    fit_options = {k: options.pop(k) for k in fit_keys if k in options}
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if options.get("hardware") is None and torch.device(device or "cpu").type == "cuda":
        options["device"] = device
    local = _local_ranks()
    planned_uploads = "whole" if uploads == "whole" or local < 2 else "sharded"
    if planned_uploads == "sharded" and uploads == "auto" and not _node_nvlinked(local):
        planned_uploads = "whole"
    if planned_uploads == "sharded" and options.get("host_budget") is not None:
        planned_uploads = "whole"  # a disk tier loads whole blocks (node_uploads)
    if planned_uploads == "sharded" and node_copies_for(_machine_name(options, device)) is None:
        planned_uploads = "whole"  # no measured gather rate: planned as whole copies
    if shared:  # node-shared masters stay raw: a plan must not price them compressed
        options.setdefault("compress", "off")
    own = plan_for_rank(model, example_inputs, budget, local_ranks=local,
                        uploads=planned_uploads,
                        gradient_as_bucket_view=gradient_as_bucket_view, **options)
    chosen = agree_on_plan(own, group)
    memory = NodeSharedMasters(group) if shared and chosen.swapped else None
    loader = None
    if chosen.swapped:  # collective: every rank has the same plan
        loader = node_uploads(resolve_device(device or "cpu", owner="fit_rank"), uploads, group,
                              disk_tier=chosen.swap_host_budget is not None)
    return fit(model, example_inputs, budget, device=device, plan=chosen,
               master_memory=memory, block_loader=loader, **fit_options)


def _local_ranks() -> int:
    """This node's ranks, as torchrun says (``LOCAL_WORLD_SIZE``; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _node_nvlinked(local: int) -> bool:
    """Whether this node's first ``local`` visible GPUs all see each other over NVLink."""
    from vramkit.devices.nvml import nvlink_connected

    if not torch.cuda.is_available() or torch.cuda.device_count() < local:
        return False
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(local)]
    return nvlink_connected(uuids) is True


def _machine_name(options: dict[str, Any], device: Any) -> str:
    hardware = options.get("hardware")
    if hardware is None:
        if torch.cuda.is_available():
            index = torch.device(device or "cuda").index
            return torch.cuda.get_device_name(index if index is not None else 0)
        return ""
    return hardware if isinstance(hardware, str) else getattr(hardware, "name", "")
