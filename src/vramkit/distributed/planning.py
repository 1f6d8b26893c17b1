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

Calibration (``hardware=None``) times this rank's own GPU. :func:`fit_rank` then makes the ranks
agree on one plan (:func:`agree_on_plan`), because the local ranks of a node share one copy of
the swapped masters and must therefore swap the same blocks, and applies it with node-shared
masters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_choice, check_size
from vramkit.planning.api import plan
from vramkit.planning.fitting import Fitted, fit
from vramkit.planning.record import Plan

__all__ = ["agree_on_plan", "ddp_bucket_bytes", "fit_rank", "plan_for_rank"]


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
                  device: str | torch.device | None = None, **plan_options: Any) -> Plan:
    """:func:`vramkit.plan` for one rank of a DDP job (module docstring).

    Args:
        model / example_inputs: this rank's model and its per-rank batch.
        budget: this rank's GPU budget.
        gradient_as_bucket_view: as DDP's option of that name (``True``: the buckets are the
            gradients, nothing extra).
        device: the GPU to calibrate on (default: the current CUDA device, this rank's).
        **plan_options: the other options of :func:`vramkit.plan` (``headroom``...);
            ``reserved_bytes`` adds to DDP's buckets.

    Returns:
        The rank's :class:`~vramkit.planning.record.Plan`.
    """
    check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
    extra = 0 if gradient_as_bucket_view else ddp_bucket_bytes(model)
    extra += check_size("reserved_bytes", plan_options.pop("reserved_bytes", 0))
    if device is None and plan_options.get("hardware") is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return plan(model, example_inputs, budget, device=device, reserved_bytes=extra,
                **plan_options)


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
    own = plan_for_rank(model, example_inputs, budget,
                        gradient_as_bucket_view=gradient_as_bucket_view, **options)
    chosen = agree_on_plan(own, group)
    memory = NodeSharedMasters(group) if shared and chosen.swapped else None
    loader = None
    if chosen.swapped:  # collective: every rank has the same plan
        loader = node_uploads(resolve_device(device or "cpu", owner="fit_rank"), uploads, group,
                              disk_tier=chosen.swap_host_budget is not None)
    return fit(model, example_inputs, budget, device=device, plan=chosen,
               master_memory=memory, block_loader=loader, **fit_options)
