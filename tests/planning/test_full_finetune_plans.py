"""Full fine-tuning planned with ``trainable="swap"``: swapped blocks' weights train in their
masters, their AdamW state lives in pinned host memory and comes to R state slots in backward;
the plan counts both, weighs the slots against the write-backs, and fit applies it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.planning._models import inputs, stack
from vramkit.errors import ConfigError, PlanError
from vramkit.offload.swap import SwapConfig
from vramkit.planning.analysis import analyze
from vramkit.planning.api import SWAP_TRAINABLE_SLOTS, plan
from vramkit.planning.machine import DUPLEX_SHARE, machine_for
from vramkit.planning.planner import swap_state_factor

MiB = 1 << 20


def full_stack(device: str = "meta"):  # type: ignore[no-untyped-def]
    model = stack(device=device)
    model.requires_grad_(True)  # every weight trains
    return model


@pytest.fixture(scope="module")
def cost():  # type: ignore[no-untyped-def]
    return analyze(full_stack(), inputs(device="meta"), mode="train", autocast=None,
                   swap_config=SwapConfig(trainable="swap"))


def _plan(cost, budget: int, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("hardware", "rtx4090")
    return plan(full_stack(), inputs(device="meta"), budget, cost=cost, headroom=0,
                trainable="swap", autocast=None, **kw)


def test_the_slot_factor_goes_through_the_measured_points() -> None:
    assert swap_state_factor(2) == pytest.approx(1.60)
    assert swap_state_factor(6) == pytest.approx(1.22)
    assert swap_state_factor(8) == pytest.approx(1.06)
    assert swap_state_factor(4) == pytest.approx((1.60 + 1.22) / 2)  # linear between points
    assert swap_state_factor(10) == swap_state_factor(12) == 1.0
    assert swap_state_factor(1) == swap_state_factor(2)
    assert swap_state_factor(2) > swap_state_factor(3) > swap_state_factor(4) > 1
    assert 8 in SWAP_TRAINABLE_SLOTS and min(SWAP_TRAINABLE_SLOTS) == 2


def test_swapped_blocks_take_their_state_to_the_host_and_bring_slots(cost) -> None:  # type: ignore[no-untyped-def]
    p = _plan(cost, 24 * MiB)
    assert p.trainable == "swap" and p.swapped and p.num_slots >= 2
    blocks = {b.name: b for b in cost.blocks}
    # fp32 weights: 4 bytes a parameter, AdamW's two fp32 moments 8: the state is twice the
    # trainable bytes each swapped block moves (its up and down matrices, 2 MiB)
    moved = [min(blocks[n].adapters, blocks[n].swapped["bf16"]) for n in p.swapped]
    assert all(m == 2 * 256 * 1024 * 4 for m in moved)
    assert p.host_breakdown["optimizer_state"] == 2 * sum(moved)
    assert p.host_breakdown["masters"] == sum(blocks[n].swapped["bf16"] for n in p.swapped)
    # on the device: every trainable byte (weights, gradients, AdamW) but the swapped ones,
    # plus R state slots and the gradients of the one block stepping
    everything = 2 * cost.trainable_bytes + 8 * cost.trainable_params
    on_device = (everything - 2 * sum(moved) - 2 * sum(moved) + p.num_slots * 2 * moved[0]
                 + moved[0])
    assert p.peak_breakdown["trainable_and_optimizer"] == on_device
    # backward copies: weights + state of the (k - R) blocks reloaded, paced by the slots, at
    # the share of the bandwidth an upload keeps while the write-backs run the other way
    k, r = len(p.swapped), p.num_slots
    machine = machine_for("rtx4090")
    bw = machine.h2d_bytes_per_s
    assert machine.duplex_share == DUPLEX_SHARE
    per_block = (swap_state_factor(r) * (blocks[p.swapped[0]].swapped["bf16"] + 2 * moved[0])
                 / (bw * DUPLEX_SHARE))
    assert p.backward.copy_seconds == pytest.approx((k - r) / k * k * per_block)
    # the updated weights and state of every swapped block go back each step on the other
    # engine: the backward takes at least their time (here the host's pace sets it), and the
    # last block's write-back follows its own step
    d2h = machine.d2h_bytes_per_s * DUPLEX_SHARE
    assert p.backward.seconds >= (swap_state_factor(r) * k + 1) * 3 * moved[0] / d2h
    slow = dataclasses.replace(machine, d2h_bytes_per_s=1e8, duplex_share=0.5)  # 50 MB/s back
    paced = _plan(cost, 24 * MiB, hardware=slow, num_slots=(p.num_slots,))
    writeback = (swap_state_factor(paced.num_slots) * len(paced.swapped) + 1) * 3 * moved[0] / 5e7
    assert paced.backward.seconds == pytest.approx(writeback, rel=1e-3)  # + outside blocks
    assert paced.backward.seconds > 10 * p.backward.seconds
    assert p.forward.copy_seconds == pytest.approx(
        (k - r) / k * sum(blocks[n].swapped["bf16"] for n in p.swapped) / bw)
    assert "Full fine-tuning with swapped optimizer state" in p.explain()
    assert "optimizer state" in p.host_verdict()


def test_full_finetuning_fits_budgets_only_swapping_the_state_reaches(cost) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError):  # everything resident: trainable weights cannot swap
        plan(full_stack(), inputs(device="meta"), 24 * MiB, hardware="rtx4090", headroom=0,
             autocast=None)
    assert _plan(cost, 24 * MiB).swapped


def test_more_slots_cost_memory_and_buy_back_the_write_backs(cost) -> None:  # type: ignore[no-untyped-def]
    two = _plan(cost, 24 * MiB, num_slots=(2,))
    more = _plan(cost, 36 * MiB, num_slots=(2, 3, 4))
    assert two.num_slots == 2
    if more.swapped and more.num_slots > 2:
        assert (more.peak_breakdown["swap_slots"] // more.num_slots
                == two.peak_breakdown["swap_slots"] // 2)
    with pytest.raises(ConfigError, match="training only"):
        plan(full_stack(), inputs(device="meta"), 24 * MiB, hardware="rtx4090",
             mode="infer", trainable="swap")


def test_fit_applies_a_swapped_full_finetuning_plan(cost) -> None:  # type: ignore[no-untyped-def]
    import vramkit

    p = _plan(cost, 24 * MiB)
    model, xs = full_stack("cpu"), inputs()
    with pytest.raises(ConfigError, match="optimizer"):
        vramkit.fit(model, xs, 24 * MiB, plan=p, device="cpu")
    fitted = vramkit.fit(model, xs, 24 * MiB, plan=p, device="cpu",
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    try:
        assert fitted.swapper is not None
        assert fitted.swapper.config.trainable == "swap"
        assert list(fitted.swapper.swapped_names) == list(p.swapped)
        key = f"{p.swapped[0]}.up.weight"
        before = model.state_dict()[key].clone()  # from the host master
        model(*xs).square().mean().backward()
        assert fitted.swapper.stats().optimizer_steps == len(p.swapped)
        assert not torch.equal(model.state_dict()[key], before)  # stepped in backward
    finally:
        fitted.detach()


def test_a_full_finetuning_plans_neighbours_are_priced_as_full_finetuning(cost) -> None:  # type: ignore[no-untyped-def]
    from vramkit.planning.neighbourhood import fits, neighbours

    p = _plan(cost, 24 * MiB)
    found = neighbours(p, cost, machine_for("rtx4090"))
    assert found
    for n in found:
        if n.plan.swapped:
            assert n.plan.trainable == "swap" and n.plan.num_slots >= 2, n.label
            assert n.plan.host_breakdown.get("optimizer_state", 0) > 0, n.label
        if fits(n.plan):
            assert n.plan.predicted_step_seconds >= p.predicted_step_seconds * (1 - 1e-9), \
                n.label


def test_the_swapped_state_is_priced_at_the_optimizers_bytes(cost) -> None:  # type: ignore[no-untyped-def]
    adamw = _plan(cost, 24 * MiB)
    eight_bit = _plan(cost, 24 * MiB, optimizer_state_bytes=2)
    assert adamw.optimizer_state_bytes == 8 and eight_bit.optimizer_state_bytes == 2
    per_block = 2 * 256 * 1024  # parameters of a block's fp32 up and down matrices
    assert adamw.host_breakdown["optimizer_state"] == 8 * per_block * len(adamw.swapped)
    assert eight_bit.host_breakdown["optimizer_state"] == 2 * per_block * len(eight_bit.swapped)
    # a quarter of the bytes to move back and forth: never slower at the same budget
    assert eight_bit.predicted_step_seconds <= adamw.predicted_step_seconds * (1 + 1e-9)
    with pytest.raises(ConfigError, match="optimizer_state_bytes"):
        _plan(cost, 24 * MiB, optimizer_state_bytes=-1)


def test_a_plans_neighbours_keep_its_optimizers_state_bytes(cost) -> None:  # type: ignore[no-untyped-def]
    from vramkit.planning.neighbourhood import neighbours

    p = _plan(cost, 24 * MiB, optimizer_state_bytes=2)
    for n in neighbours(p, cost, machine_for("rtx4090")):
        if n.plan.swapped:
            assert n.plan.optimizer_state_bytes == 2, n.label
            assert n.plan.host_breakdown["optimizer_state"] == \
                2 * 2 * 256 * 1024 * len(n.plan.swapped), n.label


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float32, 8.0), (torch.bfloat16, 4.0)])
def test_fit_measures_the_state_its_optimizer_keeps(dtype: torch.dtype, expected: float) -> None:
    from vramkit.planning.fitting import STATE_PROBE_ELEMENTS, optimizer_state_bytes

    model = full_stack("cpu").to(dtype)
    per_param = optimizer_state_bytes(lambda ps: torch.optim.AdamW(ps, lr=1e-3), model,
                                      torch.device("cpu"))
    # exp_avg and exp_avg_sq in the parameter's dtype, plus AdamW's step counter
    assert per_param == pytest.approx(expected + 4 / STATE_PROBE_ELEMENTS)
    assert optimizer_state_bytes(lambda ps: torch.optim.SGD(ps, lr=1e-3), model,
                                 torch.device("cpu")) == 0

    def broken(params):  # type: ignore[no-untyped-def]
        raise TypeError("wants more than parameters")

    assert optimizer_state_bytes(broken, model, torch.device("cpu")) is None


def test_fit_plans_full_finetuning_at_its_optimizers_state(cost) -> None:  # type: ignore[no-untyped-def]
    import vramkit
    from vramkit.optim import AdamW8bit

    model, xs = full_stack("cpu"), inputs()
    fitted = vramkit.fit(model, xs, 24 * MiB, device="cpu", hardware="rtx4090",
                         trainable="swap", autocast=None,
                         optimizer=lambda params: AdamW8bit(params, lr=1e-3))
    try:
        p = fitted.plan
        assert p.trainable == "swap" and p.swapped
        assert 2.0 <= p.optimizer_state_bytes < 2.2  # 8-bit moments and their scales
        moved = 2 * 256 * 1024 * len(p.swapped)
        assert p.host_breakdown["optimizer_state"] == pytest.approx(
            p.optimizer_state_bytes * moved, rel=1e-6)
    finally:
        fitted.detach()


def test_a_duplex_share_outside_zero_to_one_is_refused() -> None:
    machine = machine_for("rtx4090")
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="duplex_share"):
            dataclasses.replace(machine, duplex_share=bad)
    assert dataclasses.replace(machine, duplex_share=1.0).duplex_share == 1.0


def test_a_resident_blocks_trainable_weights_are_counted_once(cost) -> None:  # type: ignore[no-untyped-def]
    # in "trainable and optimizer" (weights, gradients, state), not as frozen weights too
    blocks = {b.name: b for b in cost.blocks}
    for budget in (28, 32, 36, 40, 48):
        p = _plan(cost, budget * MiB, num_slots=(2,))
        if p.swapped and len(p.swapped) < len(cost.blocks):
            break
    else:
        pytest.fail("no budget left some blocks resident and swapped others")
    resident = [b for n, b in blocks.items() if n not in p.swapped]
    assert all(b.adapters for b in resident)
    assert p.peak_breakdown["resident_weights"] == cost.outside_bytes + sum(
        b.resident_bytes("bf16") - min(b.adapters, b.swapped["bf16"]) for b in resident)
