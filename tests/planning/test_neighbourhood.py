"""A plan's neighbours: the hand plans one change away, priced as the search prices its own."""

from __future__ import annotations

import pytest

from tests.planning._models import plan_stack, stack_cost
from vramkit.errors import ConfigError
from vramkit.planning.machine import machine_for
from vramkit.planning.neighbourhood import choice_of, fits, neighbours, price_choice

MiB = 1 << 20


@pytest.fixture(scope="module")
def cost():  # type: ignore[no-untyped-def]
    return stack_cost()


@pytest.mark.parametrize("budget", [6 * MiB, 7 * MiB, 8 * MiB, 10 * MiB])
def test_no_neighbour_that_fits_is_predicted_faster(cost, budget: int) -> None:  # type: ignore[no-untyped-def]
    plan = plan_stack(cost, budget)
    found = neighbours(plan, cost, machine_for("rtx4090"))
    assert len(found) >= 3
    for n in found:
        if fits(n.plan):
            assert n.plan.predicted_step_seconds >= plan.predicted_step_seconds * (1 - 1e-9), \
                n.label


def test_the_plan_priced_alone_is_the_plan(cost) -> None:  # type: ignore[no-untyped-def]
    plan = plan_stack(cost, 7 * MiB)
    again = price_choice(choice_of(plan, cost), cost, machine_for("rtx4090"), plan.budget_bytes,
                         plan.headroom_bytes)
    assert again.predicted_step_seconds == plan.predicted_step_seconds
    assert again.peak_breakdown == plan.peak_breakdown
    assert (again.swapped, again.checkpointed, again.num_slots) == (
        plan.swapped, plan.checkpointed, plan.num_slots)


def test_each_change_is_the_one_its_label_says(cost) -> None:  # type: ignore[no-untyped-def]
    plan = plan_stack(cost, 6 * MiB)
    assert plan.swapped and plan.num_slots >= 1
    by = {n.label.split(" (")[0]: n.plan for n in neighbours(plan, cost, machine_for("rtx4090"))}
    slot = max(cost.blocks[i].swapped["bf16"] for i in choice_of(plan, cost).chosen)
    if "slots +1" in by:  # one more slot of the largest swapped block, nothing else
        assert by["slots +1"].num_slots == plan.num_slots + 1
        assert (by["slots +1"].peak_breakdown["swap_slots"]
                == plan.peak_breakdown["swap_slots"] + slot)
        assert by["slots +1"].swapped == plan.swapped
    if "swap -1" in by:
        assert len(by["swap -1"].swapped) == len(plan.swapped) - 1
    if "checkpoint +1" in by:
        assert len(by["checkpoint +1"].checkpointed) == len(plan.checkpointed) + 1
        assert (by["checkpoint +1"].peak_breakdown["activations"]
                <= plan.peak_breakdown["activations"])
    assert ("offload on" in by) != plan.activation_offload
    if "offload on" in by:
        assert by["offload on"].activation_offload
        assert len(by["offload on"].checkpointed) == len(cost.blocks)


def test_a_plan_of_another_model_is_refused(cost) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    plan = replace(plan_stack(cost, 7 * MiB), swapped=("blocks.99",))
    with pytest.raises(ConfigError):
        choice_of(plan, cost)


def test_neighbours_keep_what_the_search_does_not_choose() -> None:
    # sub-block checkpointing (and FFN chunks) shaped the cost: every neighbour keeps them
    import vramkit
    from tests.planning._models import video_inputs, video_parts_model
    from vramkit.offload.subblock import checkpoint_block_parts
    from vramkit.planning import analyze

    meta = video_parts_model()
    checkpoint_block_parts(meta, [f"blocks.{i}" for i in range(4)])
    xs = video_inputs(6, 24, 40, device="meta")
    parts_cost = analyze(meta, xs, autocast=None)
    plan = vramkit.plan(video_parts_model(), xs, 64 * MiB, hardware="rtx4090", headroom=0,
                        autocast=None, cost=parts_cost, subblock_checkpoint=True)
    found = neighbours(plan, parts_cost, machine_for("rtx4090"))
    assert plan.subblock_checkpoint and found
    assert all(n.plan.subblock_checkpoint for n in found)
