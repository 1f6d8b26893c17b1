"""The planner on a small stack: what it chooses, what it predicts, and its properties."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.planning._models import inputs, plan_stack, stack, stack_cost
from vramkit.errors import ConfigError, PlanError
from vramkit.planning.analysis import analyze
from vramkit.planning.api import plan, resolve_headroom
from vramkit.planning.machine import Machine
from vramkit.planning.planner import _paced_set, _swap_sets
from vramkit.planning.simulation import simulate_phase

MiB = 1 << 20


@pytest.fixture(scope="module")
def cost():  # type: ignore[no-untyped-def]
    return stack_cost()


_plan = plan_stack


def test_the_analysis_sees_blocks_flops_activations_and_formats(cost) -> None:  # type: ignore[no-untyped-def]
    assert [b.name for b in cost.blocks] == [f"blocks.{i}" for i in range(6)]
    block = cost.blocks[0]
    # Two frozen bf16? no: fp32 weights: up 256x1024 + down 1024x256, 4 bytes each.
    assert block.swapped["bf16"] == 2 * 256 * 1024 * 4
    assert block.swapped["fp8"] < block.swapped["bf16"] / 3  # packed: 1 byte + scales
    assert block.swapped["nf4"] < block.swapped["fp8"]
    assert block.adapters == 2 * 4 * 256 * 4  # lora_a, lora_b in fp32
    tokens = 2 * 64
    assert block.forward_flops == pytest.approx(2 * tokens * 2 * 256 * 1024, rel=0.05)
    assert 0 < block.backward_flops < 3 * block.forward_flops
    assert cost.activations.checkpointed < cost.activations.full
    assert cost.trainable_params == 6 * 2 * 4 * 256


def test_nothing_is_swapped_or_checkpointed_when_everything_fits(cost) -> None:  # type: ignore[no-untyped-def]
    p = _plan(cost, 1 << 30)
    assert p.swapped == () and p.checkpointed == () and not p.activation_offload
    assert p.forward.copy_bytes == 0 and p.predicted_peak_bytes <= 1 << 30
    assert set(p.formats.values()) == {"bf16"}


def test_more_budget_never_swaps_more_or_predicts_slower(cost) -> None:  # type: ignore[no-untyped-def]
    plans = [_plan(cost, b * MiB) for b in (6, 7, 8, 10, 12, 16, 32)]
    swapped = [len(p.swapped) for p in plans]
    steps = [p.predicted_step_seconds for p in plans]
    assert swapped == sorted(swapped, reverse=True)
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in itertools.pairwise(steps))
    assert swapped[0] > 0 and swapped[-1] == 0
    for b, p in zip((6, 7, 8, 10, 12, 16, 32), plans, strict=True):
        assert p.predicted_peak_bytes <= b * MiB


def test_checkpointing_is_chosen_per_block(cost) -> None:  # type: ignore[no-untyped-def]
    sizes = {len(_plan(cost, b).checkpointed) for b in range(6 * MiB, 16 * MiB, MiB // 4)}
    assert sizes - {0, 6}, f"only all-or-none checkpointing was chosen: {sorted(sizes)}"


def test_formats_only_when_allowed(cost) -> None:  # type: ignore[no-untyped-def]
    for budget in (6 * MiB, 8 * MiB, 16 * MiB):
        assert set(_plan(cost, budget).formats.values()) == {"bf16"}
    packed = _plan(cost, 4 * MiB, allow_formats=("fp8",))  # bf16 alone needs more
    assert set(packed.formats.values()) <= {"bf16", "fp8"} and "fp8" in packed.formats.values()
    assert set(_plan(cost, 4 * MiB, allow_formats=("nf4",)).formats.values()) <= {"bf16", "nf4"}


def test_an_impossible_budget_names_the_minimum(cost) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError) as info:
        _plan(cost, 2 * MiB)
    minimum = info.value.minimum_budget
    assert minimum is not None and minimum > 2 * MiB
    assert "allow_formats" in info.value.hint and "batch" in info.value.hint
    assert _plan(cost, minimum).predicted_peak_bytes <= minimum  # the minimum works
    with pytest.raises(PlanError):
        _plan(cost, minimum - 64 * 1024)
    # With packed storage allowed the same budget can work.
    assert _plan(cost, 4 * MiB, allow_formats=("nf4",)).swapped


def test_swap_candidates_include_the_cheapest_copies_first() -> None:
    # FLUX's shape: 3 large blocks that move 2.7x the bytes per ms of compute of the 6 small
    # ones after them. Spread by bytes, 4 picks take large blocks; cheapest-first takes small
    # ones only, spread over them, and large ones only once every small one is swapped.
    sizes = [680] * 3 + [283] * 6
    compute = [4.6] * 3 + [3.7] * 6
    spread, cheapest = _swap_sets(sizes, compute, 4)
    assert any(i < 3 for i in spread)
    assert cheapest == [3, 5, 6, 8]
    assert _swap_sets(sizes, compute, 7)[-1] == [1, 3, 4, 5, 6, 7, 8]
    assert _swap_sets(sizes, compute, 0) == [[]]
    # a block with nothing swappable is never a cheapest-first pick
    assert all(0 not in s for s in _swap_sets([0, 5, 5, 5], [1.0] * 4, 2)[1:])
    # one kind of block: the two rules agree and one candidate is simulated
    assert len(_swap_sets([5] * 6, [1.0] * 6, 3)) == 1


def test_a_paced_swap_set_keeps_the_copies_behind_compute() -> None:
    # FLUX's shape with every block checkpointed: 19 double blocks whose copy takes 3.3x their
    # forward compute, then 38 single blocks whose copy takes 1.5x. Cheapest-first swaps a run
    # of single blocks whose copies fall behind; the paced set swaps some double blocks too,
    # where the compute before them has room, and the simulated forward is faster.
    sizes = [680] * 19 + [283] * 38
    compute = [4.1] * 19 + [3.65] * 38
    rate = 50.0  # bytes per ms: a double block's copy 13.6 ms, a single one's 5.7 ms

    def forward(chosen: list[int]) -> float:
        flags = [i in chosen for i in range(len(sizes))]
        copies = [s / rate if f else 0.0 for s, f in zip(sizes, flags, strict=True)]
        return simulate_phase(compute, copies, flags, 3)

    for k in (29, 32, 35, 38):
        paced = _paced_set(sizes, compute, k, rate)
        assert paced is not None and len(paced) == k and paced in _swap_sets(sizes, compute, k,
                                                                             rate)
        assert any(i < 19 for i in paced)
        cheapest = _swap_sets(sizes, compute, k)[-1]
        assert all(i >= 19 for i in cheapest)
        assert forward(paced) < forward(cheapest) - 10
    # nothing unswappable is picked; more picks than swappable blocks: no paced set
    assert _paced_set([0, 5, 5, 5], [1.0] * 4, 2, 1.0) == [1, 3]
    assert _paced_set([0, 5, 5, 5], [1.0] * 4, 4, 1.0) is None


def test_the_machine_changes_the_prediction(cost) -> None:  # type: ignore[no-untyped-def]
    fast = _plan(cost, 6 * MiB, hardware="h100-sxm")
    slow = _plan(cost, 6 * MiB, hardware="rtx3090")
    assert fast.predicted_step_seconds < slow.predicted_step_seconds
    custom = Machine("custom", None, 1e9, 1e9, 1e12, None, 1e11)
    assert _plan(cost, 6 * MiB, hardware=custom).machine == "custom"


def test_host_budget_limits_what_is_swapped(cost) -> None:  # type: ignore[no-untyped-def]
    free = _plan(cost, 6 * MiB)
    assert free.host_bytes > 0
    with pytest.raises(PlanError, match="host budget"):
        _plan(cost, 6 * MiB, host_budget=free.host_bytes // 4)


def test_inference_plans_have_no_backward(cost) -> None:  # type: ignore[no-untyped-def]
    model, xs = stack(device="meta"), inputs(device="meta")
    infer = analyze(model, xs, mode="infer", autocast=None)
    p = plan(model, xs, 5 * MiB, mode="infer", hardware="rtx4090", headroom=0, cost=infer)
    assert p.backward.seconds == 0 and p.checkpointed == () and p.swapped
    assert p.peak_breakdown["activations"] < cost.activations.checkpointed


def test_an_inference_plan_copies_all_its_swapped_bytes_each_call() -> None:
    model, xs = stack(device="meta"), inputs(device="meta")
    infer = analyze(model, xs, mode="infer", autocast=None)
    slow = Machine("slow copies", None, 1e8, 1e8, 1e13, None, 1e12)
    with pytest.raises(PlanError, match=r"every block swapped, 2 slots\) needs") as info:
        plan(model, xs, 1 * MiB, mode="infer", hardware=slow, headroom=0, cost=infer,
             num_slots=(2,))
    assert "checkpointed" not in str(info.value)  # nothing to checkpoint without a backward
    p = plan(model, xs, 8 * MiB, mode="infer", hardware=slow, headroom=0, cost=infer,
             num_slots=(2,))
    assert len(p.swapped) > p.num_slots
    swapped = sum(b.swapped["bf16"] for b in infer.blocks if b.name in set(p.swapped))
    assert p.forward.copy_bytes == swapped
    # transfer-bound: the call lasts at least as long as copying every swapped block
    assert p.forward.seconds >= swapped / 1e8


def test_bad_arguments() -> None:
    model, xs = stack(device="meta"), inputs(device="meta")
    for kw in ({"mode": "fit"}, {"allow_formats": ("fp4",)}, {"num_slots": ()},
               {"num_slots": (0,)}, {"headroom": "lots"}, {"host_budget": -1}):
        with pytest.raises(ConfigError):
            plan(model, xs, "8MiB", hardware="rtx4090", **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="budget"):
        plan(model, xs, 0, hardware="rtx4090")
    with pytest.raises(ConfigError, match="leaves nothing"):
        plan(model, xs, "8MiB", hardware="rtx4090", headroom="8MiB")
    with pytest.raises(ConfigError, match="rtx9999"):
        plan(model, xs, "8MiB", hardware="rtx9999", headroom=0)


def test_default_headroom() -> None:
    assert resolve_headroom(10 << 30, None) == int(0.08 * (10 << 30)) + (256 << 20)
    assert resolve_headroom(1000, 0.1) == 100
    assert resolve_headroom(1000, "64") == 64


def test_a_real_model_is_planned_without_touching_its_weights() -> None:
    model = stack()
    before = [p.detach().clone() for p in model.parameters()]
    p = plan(model, inputs(), "6MiB", hardware="rtx4090", headroom=0, autocast=None)
    assert p.swapped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(t.device.type == "cpu" for t in model.parameters())


def test_a_budget_just_below_the_minimum_reads_below_it(cost) -> None:  # type: ignore[no-untyped-def]
    # "a budget of 3.0 GiB cannot hold ... needs a budget of 3.0 GiB": both rounded to the
    # nearest tenth. The budget rounds down, the minimum up, finely enough to tell them apart.
    import re

    from vramkit.units import parse_size

    with pytest.raises(PlanError) as info:
        _plan(cost, 2 * MiB)
    minimum = info.value.minimum_budget
    assert minimum is not None
    for below in (minimum - 1, minimum - 4096, int(minimum * 0.99)):
        with pytest.raises(PlanError) as info:
            _plan(cost, below)
        said = re.search(r"a budget of (.+?) cannot hold .* needs a budget of (.+?) \(",
                         info.value.message)
        assert said, info.value.message
        shown_budget, shown_minimum = (parse_size(s.replace(" ", "")) for s in said.groups())
        assert shown_budget <= below < minimum <= shown_minimum, info.value.message
        # the hint's figure is one to raise the budget to: never below the minimum
        raise_to = re.search(r"Raise the budget to (\S+ \S+) or more", info.value.hint or "")
        assert raise_to and parse_size(raise_to.group(1).replace(" ", "")) >= minimum


@pytest.mark.parametrize("headroom", [1.0, 2.0, 8.0, 1e9])
def test_a_headroom_float_of_one_or_more_is_ambiguous(headroom: float) -> None:
    # 2.0 read as two bytes: no fraction (those are below 1), no size anyone means.
    with pytest.raises(ConfigError, match="headroom") as err:
        resolve_headroom(10 << 30, headroom)
    assert "0.1" in (err.value.hint or "") and "GiB" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="headroom"):
        plan(stack(device="meta"), inputs(device="meta"), 10 << 30, hardware="rtx4090",
             headroom=headroom)
    assert resolve_headroom(10 << 30, int(headroom)) == int(headroom)  # an int is bytes



def test_optimizer_state_bytes_price_the_optimizers_state(cost) -> None:  # type: ignore[no-untyped-def]
    from vramkit.planning.machine import machine_for
    from vramkit.planning.planner import search

    machine = machine_for("rtx4090")
    adamw = search(cost, machine, 1 << 30, 0)
    eight_bit = search(cost, machine, 1 << 30, 0, optimizer_state_bytes=2 + 8 / 256)
    host = search(cost, machine, 1 << 30, 0, optimizer_state_bytes=0)
    params = cost.trainable_params
    part = "trainable_and_optimizer"
    assert adamw.peak_breakdown[part] == 2 * cost.trainable_bytes + 8 * params
    assert eight_bit.peak_breakdown[part] == 2 * cost.trainable_bytes + -(-params * 520 // 256)
    assert host.peak_breakdown[part] == 2 * cost.trainable_bytes
    with pytest.raises(ConfigError):
        search(cost, machine, 1 << 30, 0, optimizer_state_bytes=-1)
    # (swapped state at the optimizer's bytes: tests/planning/test_full_finetune_plans.py)


def test_spread_swap_sets_are_the_swappers_own_schedule(cost) -> None:  # type: ignore[no-untyped-def]
    from vramkit.offload.blocks import spread_evenly
    from vramkit.planning.machine import machine_for
    from vramkit.planning.planner import search

    machine = machine_for("rtx4090")
    sizes = [b.swapped["bf16"] for b in cost.blocks]
    names = [b.name for b in cost.blocks]
    counts = set()
    for budget in (10 * MiB, 12 * MiB, 14 * MiB):
        p = search(cost, machine, int(budget), 0, swap_sets="spread", num_slots=(2,))
        k = len(p.swapped)
        counts.add(k)
        assert p.swapped == tuple(names[i] for i in spread_evenly(sizes, k))
    assert len(counts - {0}) >= 2  # several counts, each the swapper's own set
    with pytest.raises(ConfigError):
        search(cost, machine, 8 * MiB, 0, swap_sets="cheapest")


def test_spread_swap_sets_ignore_the_searchs_other_candidates(
        cost, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from vramkit.planning import planner
    from vramkit.planning.machine import machine_for

    # The search's candidates for every count: the last blocks only (never the spread set).
    monkeypatch.setattr(planner, "_swap_sets",
                        lambda sizes, compute, k, bw=None: [list(range(len(sizes) - k,
                                                                       len(sizes)))])
    machine = machine_for("rtx4090")
    searched = planner.search(cost, machine, 12 * MiB, 0, num_slots=(2,))
    spread = planner.search(cost, machine, 12 * MiB, 0, num_slots=(2,), swap_sets="spread")
    assert len(searched.swapped) == len(spread.swapped) == 5
    assert searched.swapped == tuple(f"blocks.{i}" for i in range(1, 6))
    assert spread.swapped == ("blocks.0", "blocks.1", "blocks.2", "blocks.4", "blocks.5")
