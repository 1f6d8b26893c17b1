"""Planning one rank of a data-parallel job.

Each rank runs the whole model on its own GPU with its own share of the batch, so a rank's plan
is the single-GPU plan for that GPU with two differences, both counted here:

* **DDP's gradient buckets** hold a second copy of the gradients DDP reduces (the trainable
  parameters that are not swapped) unless ``gradient_as_bucket_view=True``: that many bytes of
  the budget are kept free on top of the headroom.
* **Host memory is per node**: with :func:`vramkit.distributed.shared_swapper` the frozen
  masters are pinned once per node, so ``host_budget`` is the node's budget for them, not a
  share of it per rank.

Calibration (``hardware=None``) times this rank's own GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_size
from vramkit.planning.api import plan
from vramkit.planning.planner import Plan

__all__ = ["ddp_bucket_bytes", "plan_for_rank"]


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
        The rank's :class:`~vramkit.planning.planner.Plan`.
    """
    check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
    extra = 0 if gradient_as_bucket_view else ddp_bucket_bytes(model)
    extra += check_size("reserved_bytes", plan_options.pop("reserved_bytes", 0))
    if device is None and plan_options.get("hardware") is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return plan(model, example_inputs, budget, device=device, reserved_bytes=extra,
                **plan_options)
