"""Offline plans for full-size models built on the meta device (FLUX.1-dev, SDXL, Llama-3.1-8B)
for named GPUs and budgets: the properties a user relies on."""

from __future__ import annotations

import itertools
import json
import time

import pytest

import vramkit
from vramkit.errors import PlanError
from vramkit.planning import analyze
from vramkit.planning.hardware import hardware_profile
from vramkit.recipes.targets import build_target

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")

GiB = 1 << 30
BUDGETS = (80, 24, 16, 12, 8)
HARDWARE = ("rtx4090", "h100-pcie", "rtx3090")


@pytest.fixture(scope="module", params=["flux-dev", "sdxl", "llama-3.1-8b"])
def target_and_cost(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    target = build_target(request.param, lora_rank=16)
    cost = analyze(target.model, target.inputs, step=target.step, autocast=None,
                   formats=("bf16", "fp8", "nf4"))
    seconds = time.perf_counter() - started
    return target, cost, seconds


def _plan(target, cost, budget_gib: float, **kw):  # type: ignore[no-untyped-def]
    """Plan for ``budget_gib``, or the card's whole memory where that is less (a budget above
    the card is refused)."""
    from vramkit.planning.machine import machine_for

    kw.setdefault("hardware", "rtx4090")
    budget = min(int(budget_gib * GiB), machine_for(kw["hardware"]).memory_bytes)
    return vramkit.plan(target.model, target.inputs, budget, cost=cost, **kw)


def test_planning_takes_seconds_not_minutes(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, seconds = target_and_cost
    assert seconds < 30, f"building and analyzing {target.name} took {seconds:.1f} s"
    started = time.perf_counter()
    _plan(target, cost, 12, allow_formats=("fp8",))
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("hardware", HARDWARE)
def test_more_budget_never_swaps_more_or_predicts_slower(target_and_cost,  # type: ignore[no-untyped-def]
                                                         hardware: str) -> None:
    target, cost, _ = target_and_cost
    plans = []
    card = hardware_profile(hardware).memory_bytes
    for budget in BUDGETS:
        if budget * GiB > card + GiB:  # more than the card has: refused
            continue
        try:
            plans.append(_plan(target, cost, budget, hardware=hardware))
        except PlanError:
            break  # smaller budgets cannot fit either
    assert plans, f"{target.name} fits no budget on {hardware}"
    for bigger, smaller in itertools.pairwise(plans):
        assert bigger.predicted_step_seconds <= smaller.predicted_step_seconds * (1 + 1e-9)
        # More budget swaps no more blocks, except to buy back recomputation: one more swapped
        # block can free just the memory that spares checkpointing one more block, a faster
        # step where the copies hide behind compute (the planner minimizes time).
        if len(bigger.swapped) > len(smaller.swapped):
            assert len(bigger.checkpointed) < len(smaller.checkpointed)
    for plan in plans:
        assert plan.predicted_peak_bytes <= plan.budget_bytes - plan.headroom_bytes
        assert set(plan.formats.values()) == {"bf16"}  # nothing allowed, nothing packed


def test_nothing_swapped_when_everything_fits(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, _ = target_and_cost
    plan = _plan(target, cost, 140, hardware="h200")
    assert plan.swapped == () and plan.checkpointed == ()
    assert plan.forward.copy_bytes == 0


def test_packed_formats_only_when_allowed_and_they_help(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, _ = target_and_cost
    tight = 6 if target.name.startswith(("sdxl", "SDXL")) else 8
    bf16 = None
    try:
        bf16 = _plan(target, cost, tight)
        assert set(bf16.formats.values()) == {"bf16"}
    except PlanError:
        pass
    packed = _plan(target, cost, tight, allow_formats=("fp8",))
    assert set(packed.formats.values()) <= {"bf16", "fp8"}
    if bf16 is not None:
        assert packed.predicted_step_seconds <= bf16.predicted_step_seconds * (1 + 1e-9)


def test_an_impossible_budget_names_the_minimum_that_works(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, _ = target_and_cost
    with pytest.raises(PlanError) as info:
        _plan(target, cost, 1)
    minimum = info.value.minimum_budget
    assert minimum is not None and minimum > GiB
    assert "allow_formats" in info.value.hint
    plan = vramkit.plan(target.model, target.inputs, minimum, cost=cost, hardware="rtx4090")
    assert plan.predicted_peak_bytes <= plan.budget_bytes - plan.headroom_bytes
    with pytest.raises(PlanError):
        vramkit.plan(target.model, target.inputs, minimum - (64 << 20), cost=cost,
                     hardware="rtx4090")


def test_flux_on_a_12gb_card_explains_its_bounds(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, _ = target_and_cost
    if not target.name.lower().startswith("flux"):
        pytest.skip("the Flux figures")
    plan = _plan(target, cost, 12)
    assert 0 < len(plan.swapped) < len(cost.blocks) + 1
    assert plan.checkpointed
    text = plan.explain()
    assert "Forward" in text and "Backward" in text and "ms" in text
    # Swapping tens of GB through a PCIe 4.0 link: the forward cannot hide it.
    assert plan.forward.copy_bytes > 5 * GiB


def test_flux_compresses_the_masters_whose_copies_bound_the_step(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from vramkit.planning.machine import machine_for
    from vramkit.planning.record import Plan

    target, cost, _ = target_and_cost
    if not target.name.lower().startswith("flux"):
        pytest.skip("the Flux figures")
    # On an H200's 55 GB/s the backward hides its copies and each decode costs compute: raw
    # masters at 11.5 and 7.5 GiB (measured there: compressing half / all of a FLUX-sized
    # stack's swapped masters at 7.5 GiB stepped 1.003x / 1.045x raw).
    h200 = machine_for("h200")
    for budget in (11.5, 7.5):
        plan = _plan(target, cost, budget, hardware=h200)
        assert not plan.compress_masters and not plan.compressed_blocks
    # The same GPU behind a PCIe x8 link (12.5 GB/s, as benchmarks/compress_swap.py paces it;
    # measured there 0.715x raw at 11.5 GiB): the copies are the step, so they are compressed.
    x8 = dataclasses.replace(h200, name="h200 at PCIe x8", h2d_bytes_per_s=12.5e9,
                             d2h_bytes_per_s=12.5e9)
    for budget in (11.5, 7.5):
        slow = _plan(target, cost, budget, hardware=x8)
        raw = _plan(target, cost, budget, hardware=x8, compress="off")
        assert slow.compress_masters
        assert set(slow.compressed_blocks) <= set(slow.swapped)
        assert slow.predicted_step_seconds <= raw.predicted_step_seconds * 0.9
        assert Plan.from_dict(json.loads(slow.to_json())) == slow


def test_checkpointing_as_asked(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, _ = target_and_cost
    names = [b.name for b in cost.blocks]
    for budget in (24, 12):
        auto = _plan(target, cost, budget)
        every = _plan(target, cost, budget, checkpointing="all")
        assert every.checkpointed == tuple(names) and every.checkpointing == "all"
        assert "as asked (checkpointing='all')" in every.explain()
        assert every.predicted_peak_bytes <= every.budget_bytes - every.headroom_bytes
        # the planner's own choice is never predicted slower than one it was handed
        assert auto.predicted_step_seconds <= every.predicted_step_seconds * (1 + 1e-9)
        try:
            bare = _plan(target, cost, budget, checkpointing="none")
        except PlanError as err:
            assert "no block checkpointed, as asked" in str(err)
            assert "checkpointing='auto'" in str(err)
            assert err.minimum_budget is not None and err.minimum_budget > budget * GiB
        else:
            assert bare.checkpointed == () and not bare.activation_offload
            assert auto.predicted_step_seconds <= bare.predicted_step_seconds * (1 + 1e-9)
    with pytest.raises(vramkit.ConfigError, match="applies to training"):
        _plan(target, cost, 24, mode="infer", checkpointing="all")
    with pytest.raises(vramkit.ConfigError, match="checkpointing"):
        _plan(target, cost, 24, checkpointing="some")


def test_offloaded_activations_hide_behind_the_backward(target_and_cost) -> None:  # type: ignore[no-untyped-def]
    target, cost, _ = target_and_cost
    if not target.name.lower().startswith("llama"):
        pytest.skip("the Llama figures")
    # Llama-3.1-8B at 7.5 GiB on an H200 swaps 31 of 32 blocks and offloads activations; the
    # fitted step measured 604 ms there, its backward hiding the copies behind compute. The
    # restores come back a block ahead of use, not queued behind the next weight copy (which
    # predicted the backward as copies plus compute: 831 ms).
    plan = _plan(target, cost, 7.5, hardware="h200")
    assert plan.activation_offload
    assert not plan.backward.transfer_bound
    assert plan.backward.seconds < plan.backward.compute_seconds + 0.25 * plan.backward.copy_seconds
