"""A plan's neighbours: the hand plans one change away from it, priced the way the search
prices its own candidates.

Someone tuning by hand starts from a plan and turns one knob: one block more or fewer swapped,
one more or fewer checkpointed, a slot more or fewer, activation offload on or off.
:func:`neighbours` makes each of those plans from a :class:`~vramkit.planning.record.Plan` and
its analysis, and prices it with :func:`~vramkit.planning.planner.search` restricted to that
one candidate (``only=``), so its predicted step and peak come from the same simulation as the
plan's. A neighbour may not fit the budget: its ``predicted_peak_bytes`` says, and
:func:`fits` tells. ``benchmarks/regret.py`` runs a plan and its neighbours on the GPU and
prints the regret (the plan's measured step over the best measured one); the tests check that
no neighbour that fits is predicted faster than the plan (the search saw it too).

Which block a swap neighbour adds or takes back: the one whose plan is predicted fastest among
all blocks one could add or take (the strongest hand plan of that kind).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramkit.errors import ConfigError, PlanError
from vramkit.planning.analysis import ModelCost
from vramkit.planning.calibration import BlockTimes
from vramkit.planning.machine import Machine
from vramkit.planning.planner import Choice, _checkpoint_order, search
from vramkit.planning.record import ADAMW_STATE_BYTES, Plan

__all__ = ["Neighbour", "choice_of", "fits", "neighbours", "price_choice"]


@dataclass(frozen=True)
class Neighbour:
    """A plan one change away from another.

    Attributes:
        label: the change, in words (``"swap +1 (blocks.7)"``, ``"slots -1"``, ``"offload
            on"``).
        plan: the neighbour, priced (:attr:`Plan.predicted_step_seconds`,
            :attr:`Plan.predicted_peak_bytes`).
        choice: its choices.
    """

    label: str
    plan: Plan
    choice: Choice


def _order(cost: ModelCost, checkpointing: str) -> list[str]:
    order = _checkpoint_order(cost) if cost.mode == "train" else []
    if cost.mode == "train" and checkpointing == "all":
        order += [b.name for b in cost.blocks if b.name not in set(order)]
    return order


def choice_of(plan: Plan, cost: ModelCost) -> Choice:
    """The :class:`Choice` that ``plan`` made over ``cost``'s blocks.

    Raises:
        ConfigError: when the plan names blocks the analysis does not have, or checkpoints
            blocks that are not the first of the search's checkpoint order.
    """
    index = {b.name: i for i, b in enumerate(cost.blocks)}
    missing = [n for n in (*plan.swapped, *plan.checkpointed) if n not in index]
    if missing:
        raise ConfigError(f"the plan names blocks its analysis does not have: {missing[:3]}",
                          hint="Pass the ModelCost the plan was made from (plan(cost=...)).")
    order = _order(cost, plan.checkpointing)
    m = len(plan.checkpointed)
    if set(order[:m]) != set(plan.checkpointed):
        raise ConfigError("the plan's checkpointed blocks are not the first of the search's "
                          "checkpoint order", hint="Price plans the search made.")
    return Choice(chosen=tuple(sorted(index[n] for n in plan.swapped)),
                  num_slots=plan.num_slots, checkpoints=m, offload=plan.activation_offload,
                  swapped_format=plan.swapped_format, resident_format=plan.resident_format,
                  together=plan.dequantize_together)


def price_choice(choice: Choice, cost: ModelCost, machine: Machine, budget: int,
                 headroom: int, *, times: BlockTimes | None = None,
                 host_budget: int | None = None, disk_bytes_per_s: float | None = None,
                 checkpointing: str = "auto", trainable: str = "resident",
                 optimizer_state_bytes: float = ADAMW_STATE_BYTES) -> Plan:
    """``choice`` priced as the search prices its candidates (fitting the budget or not;
    ``trainable``: ``"swap"`` for full fine-tuning with swapped optimizer state, of
    ``optimizer_state_bytes`` per parameter).

    Raises:
        PlanError: when its masters cannot be split between host and disk under
            ``host_budget``.
    """
    formats = tuple(f for f in (choice.swapped_format, choice.resident_format) if f != "bf16")
    return search(cost, machine, budget, headroom, allow_formats=formats,
                  num_slots=(max(choice.num_slots, 1),), activation_offload=choice.offload,
                  host_budget=host_budget, times=times, disk_bytes_per_s=disk_bytes_per_s,
                  checkpointing=checkpointing, only=choice, trainable_mode=trainable,
                  optimizer_state_bytes=optimizer_state_bytes)


def fits(plan: Plan) -> bool:
    """Whether ``plan``'s predicted peak fits its budget less its headroom."""
    return plan.predicted_peak_bytes <= plan.budget_bytes - plan.headroom_bytes


def neighbours(plan: Plan, cost: ModelCost, machine: Machine, *,
               times: BlockTimes | None = None, host_budget: int | None = None,
               disk_bytes_per_s: float | None = None) -> list[Neighbour]:
    """The plans one change away from ``plan`` (module docstring), each priced; those whose
    change does not exist (no slot below one, no block left to swap) are left out.

    Args:
        plan: a plan of ``cost`` (:func:`vramkit.plan` with ``cost=``).
        cost / machine / times: what the plan was made from (the same ``block_times`` for a
            calibrated plan).
        host_budget / disk_bytes_per_s: as the plan was made with.
    """
    base = choice_of(plan, cost)
    n = len(cost.blocks)
    train = cost.mode == "train"
    order_len = len(_order(cost, plan.checkpointing))

    def priced(choice: Choice) -> Plan | None:
        try:
            found = price_choice(choice, cost, machine, plan.budget_bytes,
                                 plan.headroom_bytes, times=times, host_budget=host_budget,
                                 disk_bytes_per_s=disk_bytes_per_s,
                                 checkpointing=plan.checkpointing, trainable=plan.trainable,
                                 optimizer_state_bytes=plan.optimizer_state_bytes)
            # what the search does not choose travels with the plan (cost was made with it)
            return replace(found, ffn_chunks=plan.ffn_chunks,
                           subblock_checkpoint=plan.subblock_checkpoint)
        except PlanError:
            return None

    out: list[Neighbour] = []

    def add(label: str, choice: Choice) -> None:
        found = priced(choice)
        if found is not None:
            out.append(Neighbour(label, found, choice))

    def best_swap(options: list[tuple[int, Choice]], sign: str) -> None:
        best: tuple[float, int, Choice, Plan] | None = None
        for i, choice in options:
            found = priced(choice)
            if found is None:
                continue
            key = (not fits(found), found.predicted_step_seconds)
            if best is None or key < (not fits(best[3]), best[0]):
                best = (found.predicted_step_seconds, i, choice, found)
        if best is not None:
            out.append(Neighbour(f"swap {sign}1 ({cost.blocks[best[1]].name})", best[3],
                                 best[2]))

    swapped = set(base.chosen)
    more = [(i, replace(base, chosen=tuple(sorted((*base.chosen, i))),
                        num_slots=max(base.num_slots, 1)))
            for i in range(n) if i not in swapped and cost.blocks[i].swapped[base.swapped_format]]
    best_swap(more, "+")
    least = 2 if plan.trainable == "swap" else 1
    fewer = [(i, replace(base, chosen=tuple(j for j in base.chosen if j != i),
                         num_slots=min(base.num_slots, len(base.chosen) - 1)))
             for i in base.chosen
             if len(base.chosen) == 1 or len(base.chosen) - 1 >= least]
    best_swap(fewer, "-")
    if train and not base.offload and plan.checkpointing == "auto":
        if base.checkpoints < order_len:
            add("checkpoint +1", replace(base, checkpoints=base.checkpoints + 1))
        if base.checkpoints > 0:
            add("checkpoint -1", replace(base, checkpoints=base.checkpoints - 1))
    if base.chosen:
        if base.num_slots < len(base.chosen):
            add("slots +1", replace(base, num_slots=base.num_slots + 1))
        if base.num_slots > (2 if plan.trainable == "swap" else 1):  # swap: 2 state slots
            add("slots -1", replace(base, num_slots=base.num_slots - 1))
    if train and plan.checkpointing != "none":
        if base.offload:
            add("offload off", replace(base, offload=False))
        else:
            add("offload on", replace(base, offload=True, checkpoints=order_len))
    return out
