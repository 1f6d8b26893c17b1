"""Block calibration (vramkit.planning.calibration): one block of each kind timed for real, the
times shared within a kind and used by the planner in place of FLOP counts. Timed on the CPU
here (the host clock); tests/planning/test_calibration_gpu.py times on a GPU."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import vramkit
from tests.planning import _models
from vramkit.errors import ConfigError, DeviceError, PlanError
from vramkit.planning import (
    BlockTimes,
    CallTimes,
    Machine,
    analyze,
    calibrate_blocks,
    measure_machine,
)

SLEEP = 0.02


class Slow(_models.Block):
    """A block whose forward waits: its time cannot come from its FLOPs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP)
        return super().forward(x)


class Indexed(nn.Module):
    """A block that cannot run on random inputs: its index input must be 1 or more."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(_models.DIM, _models.DIM)
        self.table = nn.Parameter(torch.zeros(4, _models.DIM), requires_grad=False)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.table[index - 1 + 8]  # an index of 0 is out of range


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_models.Block(), Slow(), _models.Block(), Slow()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _machine(copies: float, flops: float) -> Machine:
    """A machine copying ``copies`` bytes/s each way at ``flops`` FLOP/s (1 TB/s memory)."""
    return Machine(name="test", memory_bytes=None, h2d_bytes_per_s=copies,
                   d2h_bytes_per_s=copies, flops_per_s=flops, fp8_flops_per_s=None,
                   memory_bandwidth_bytes_per_s=1e12)


def _steady(times: BlockTimes) -> BlockTimes:
    """``times`` with every block's full call set to 1 ms forward and 2 ms backward (device
    and host) and its checkpointed call to one more forward in backward. CPU samples swing by
    tens of ms under load (a loaded CI host timed these blocks at 36 ms instead of 0.8 ms, and
    the copies then hid behind compute), and the packed-format tests below are about what a
    format's measured extra does to the plan, not about the host's speed."""
    import dataclasses

    full = {n: CallTimes(1e-3, 2e-3, 1e-3, 2e-3) for n in times.calls["full"]}
    checkpointed = {n: CallTimes(1e-3, 3e-3, 1e-3, 3e-3) for n in times.calls["full"]}
    return dataclasses.replace(times, calls={**times.calls, "full": full,
                                             "checkpointed": checkpointed})


def _slower(times: BlockTimes, extra: float) -> dict[str, CallTimes]:
    """Every block's full-precision call, ``extra`` seconds longer on each side."""
    return {name: CallTimes(c.forward + extra, c.backward + extra, c.host_forward + extra,
                            c.host_backward + extra) for name, c in times.calls["full"].items()}


def _frozen(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def test_one_block_of_each_kind_is_timed_and_its_times_shared() -> None:
    model = _frozen(Mixed())
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    times = calibrate_blocks(model, _models.inputs(), device="cpu", autocast=None, repeats=2)
    # the first block is a kind of its own: its input (the step's) does not require grad, so
    # no input gradient is timed for it, as in the step
    assert times.kinds == 3 and times.device == "cpu" and not times.fallbacks
    names = [f"blocks.{i}" for i in range(4)]
    assert set(times.forward) == set(names) == set(times.backward)
    assert times.calls["full"]["blocks.0"] is not times.calls["full"]["blocks.2"]
    assert times.forward["blocks.1"] == times.forward["blocks.3"] >= SLEEP
    # the other kinds have measurements of their own, not the sleeping kind's (compared as
    # values, not against a time limit: a loaded host takes tens of ms for the tiny blocks)
    assert times.calls["full"]["blocks.0"] is not times.calls["full"]["blocks.1"]
    assert times.calls["full"]["blocks.2"] is not times.calls["full"]["blocks.1"]
    assert times.calls["full"]["blocks.1"] is times.calls["full"]["blocks.3"]
    assert all(times.backward[n] > 0 for n in names)  # input and adapter gradients
    # Only the structure was used: the model's own weights are as they were.
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_inference_times_forward_only() -> None:
    model = _frozen(Mixed())
    times = calibrate_blocks(model, _models.inputs(), mode="infer", device="cpu",
                             autocast=None, repeats=1)
    assert all(t == 0 for t in times.backward.values())
    assert times.forward["blocks.1"] >= SLEEP


def test_a_block_that_cannot_run_on_random_inputs_falls_back_to_flops(
        caplog: pytest.LogCaptureFixture) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Indexed(), Indexed()])

        def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, index)
            return x

    model = Model()
    inputs = (_models.inputs()[0], torch.ones(2, _models.TOKENS, dtype=torch.long))
    with caplog.at_level("WARNING"):
        times = calibrate_blocks(model, inputs, mode="infer", device="cpu", autocast=None,
                                 repeats=1)
    assert times.fallbacks == ("blocks.0", "blocks.1")
    assert "FLOP-based" in caplog.text
    cost = analyze(model, inputs, mode="infer", autocast=None)
    plan = vramkit.plan(model, inputs, "1GiB", mode="infer", hardware="l4", cost=cost,
                        block_times=times, autocast=None)
    assert plan.forward.compute_seconds > 0  # the FLOP-based times, not the zeros


def test_the_planner_uses_measured_times_instead_of_flops() -> None:
    model = _frozen(Mixed())
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None)
    times = calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=1)
    machine = _machine(copies=10e9, flops=1e15)
    by_flops = vramkit.plan(model, inputs, "1GiB", hardware=machine, cost=cost, autocast=None)
    measured = vramkit.plan(model, inputs, "1GiB", hardware=machine, cost=cost,
                            block_times=times, autocast=None)
    # At 1 PFLOP/s the FLOP model predicts microseconds; the two slow blocks take 40 ms.
    assert by_flops.forward.compute_seconds < 1e-3
    # The device's side of each call (the host's is timed apart: on a loaded CPU the two
    # differ, and the phase's compute is the device's work).
    blocks = sum(times.call(name).forward for name in times.forward)  # type: ignore[union-attr]
    assert measured.forward.compute_seconds == pytest.approx(
        blocks + cost.outside_forward_flops / times.flops_per_s(cost))
    assert measured.forward.compute_seconds >= 2 * SLEEP
    assert any("Block times measured on cpu" in note for note in measured.notes)


def test_block_times_must_cover_the_models_blocks() -> None:
    model = _frozen(Mixed())
    other = _models.stack(n=3)
    times = calibrate_blocks(other, _models.inputs(), device="cpu", autocast=None, repeats=1)
    with pytest.raises(ConfigError, match=r"no time for 1 block.*blocks\.3"):
        vramkit.plan(model, _models.inputs(), "1GiB", hardware="l4", block_times=times,
                     autocast=None)


def test_measuring_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = _frozen(Mixed())
    with pytest.raises(DeviceError, match="measures this machine's GPU") as info:
        measure_machine()
    assert "hardware=" in info.value.hint
    # plan() itself plans offline for the CLI's GPU then, and says so (tests/planning/test_api.py)
    with pytest.raises(ConfigError, match="device"):
        vramkit.plan(model, _models.inputs(), "1GiB", autocast=None, device="cpu")
    with pytest.raises(ConfigError, match="repeats"):
        calibrate_blocks(model, _models.inputs(), device="cpu", repeats=0)


def test_packed_formats_are_timed_on_a_quantized_copy_of_each_kind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.planning import calibration
    from vramkit.quant.linear import QuantizedLinear

    timed: list[bool] = []
    real = calibration._time_block

    def spy(block: nn.Module, *args: object, **kwargs: object) -> CallTimes:
        timed.append(any(isinstance(m, QuantizedLinear) for m in block.modules()))
        return real(block, *args, **kwargs)

    monkeypatch.setattr(calibration, "_time_block", spy)
    model = _frozen(Mixed())
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    times = calibrate_blocks(model, _models.inputs(), device="cpu", autocast=None, repeats=1,
                             formats=("int8",))
    # per kind: full precision (alone, checkpointed), then packed (each layer at its call;
    # the block's together)
    assert timed == [False, False, True, True] * 3  # the first block, the others, Slow
    names = [f"blocks.{i}" for i in range(4)]
    for variant in ("int8", "int8+together"):
        assert set(times.calls[variant]) == set(names)
        assert times.calls[variant]["blocks.1"].forward >= SLEEP
    for name in names:
        for together in (False, True):
            extra = times.packed_extra("int8", name, together=together)
            assert extra is not None and min(extra) >= 0
    assert times.packed_extra("fp8", "blocks.0") is None  # not asked for
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    with pytest.raises(ConfigError, match="formats"):
        calibrate_blocks(model, _models.inputs(), device="cpu", autocast=None, formats=("bf16",))


def test_a_format_is_chosen_only_where_its_measured_cost_pays() -> None:
    import dataclasses

    model = _models.stack(n=6)
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None, formats=("bf16", "int8"))
    times = _steady(calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=1))
    slow_copies = _machine(copies=1e8, flops=1e12)

    def plan_with(extra: float) -> vramkit.Plan:
        packed = dataclasses.replace(times, calls={**times.calls, "int8": _slower(times, extra)})
        return vramkit.plan(model, inputs, "8MiB", hardware=slow_copies, cost=cost,
                            block_times=packed, autocast=None, allow_formats=("int8",),
                            headroom=0)

    cheap, dear = plan_with(0.0), plan_with(1.0)
    # Dequantizing for free: every block packed (a quarter of the bytes to keep or copy).
    assert set(cheap.formats.values()) == {"int8"}
    # A second per call: the planner swaps full-precision blocks instead.
    assert set(dear.formats.values()) == {"bf16"} and dear.swapped
    assert dear.predicted_step_seconds < 6 * 2 * 1.0  # cheaper than dequantizing every call
    assert any(note.startswith("int8 storage timed on cpu (each layer dequantized at its "
                               "call): dequantizing adds 6000.0 ms") for note in dear.notes)


def test_the_copies_slowdown_is_priced_where_copies_run_beside_compute() -> None:
    import dataclasses

    model = _models.stack(n=6)
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None)
    times = _steady(calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=1))
    assert "beside-copies" not in times.calls  # no copy engine to time beside on the CPU
    assert times.copy_slowdown("blocks.0") == (0.0, 0.0)
    beside = {n: CallTimes(c.forward * 1.25, c.backward * 1.5, c.host_forward, c.host_backward)
              for n, c in times.calls["full"].items()}
    slowed = dataclasses.replace(times, calls={**times.calls, "beside-copies": beside})
    assert slowed.copy_slowdown("blocks.0") == (pytest.approx(0.25), pytest.approx(0.5))
    faster = {n: CallTimes(c.forward / 2, c.backward / 2, 0.0, 0.0)
              for n, c in times.calls["full"].items()}
    assert dataclasses.replace(times, calls={**times.calls, "beside-copies": faster}
                               ).copy_slowdown("blocks.0") == (0.0, 0.0)  # never negative
    machine = _machine(copies=4e9, flops=1e12)

    def plans(budget: str) -> tuple[vramkit.Plan, vramkit.Plan]:
        return tuple(vramkit.plan(model, inputs, budget, hardware=machine, cost=cost,  # type: ignore[return-value]
                                  block_times=t, autocast=None, headroom=0, num_slots=(2,))
                     for t in (times, slowed))

    alone, beside_copies = plans("8MiB")
    assert alone.swapped == beside_copies.swapped and alone.swapped
    assert beside_copies.predicted_step_seconds > alone.predicted_step_seconds
    lost = beside_copies.forward.slowed_seconds + beside_copies.backward.slowed_seconds
    assert lost > 0 and alone.forward.slowed_seconds == alone.backward.slowed_seconds == 0
    # what the compute lost is compute, not waiting for copies
    assert beside_copies.forward.transfer_bound == alone.forward.transfer_bound
    assert "ms slower" in beside_copies.explain() and "ms slower" not in alone.explain()
    assert beside_copies.to_dict()["forward"]["slowed_seconds"] > 0
    assert any("Copies slow the compute beside them" in n and "forward +25.0 %" in n
               and "backward +50.0 %" in n for n in beside_copies.notes)
    assert not any("Copies slow" in n for n in alone.notes)
    # everything resident: no copies, no slowdown, no note
    roomy, roomy_slowed = plans("1GiB")
    assert not roomy_slowed.swapped
    assert roomy_slowed.predicted_step_seconds == pytest.approx(roomy.predicted_step_seconds)
    assert not any("Copies slow" in n for n in roomy_slowed.notes)


def test_an_offline_plan_prices_the_profiles_copy_slowdown_and_says_whence() -> None:
    import dataclasses

    from vramkit.planning.hardware import hardware_profile
    from vramkit.planning.machine import COPY_SLOWDOWN

    model = _models.stack(n=6)
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None)
    # an H200's profile, slowed so that the tiny stack's blocks are bound by the device and
    # their copies run beside their compute
    h200 = dataclasses.replace(Machine.from_profile(hardware_profile("h200")),
                               h2d_bytes_per_s=2e8, d2h_bytes_per_s=2e8, peak_flops_per_s=1e10)
    assert h200.copy_slowdown == COPY_SLOWDOWN and all(0 < s < 0.1 for s in COPY_SLOWDOWN)
    none = dataclasses.replace(h200, copy_slowdown=(0.0, 0.0))

    def plans(budget: str) -> tuple[vramkit.Plan, vramkit.Plan]:
        return tuple(vramkit.plan(model, inputs, budget, hardware=m, cost=cost,  # type: ignore[return-value]
                                  autocast=None, headroom=0, num_slots=(2,))
                     for m in (h200, none))

    priced, unpriced = plans("8MiB")
    assert priced.swapped == unpriced.swapped and priced.swapped
    assert priced.predicted_step_seconds > unpriced.predicted_step_seconds
    assert priced.forward.slowed_seconds > 0 and priced.backward.slowed_seconds > 0
    assert unpriced.forward.slowed_seconds == unpriced.backward.slowed_seconds == 0
    # every block of the stack is one kind: the shares are the profile's
    import re

    said = [n for n in priced.notes if "Copies slow the compute beside them" in n]
    assert len(said) == 1 and "on an H200" in said[0]
    shares = re.search(r"forward \+([\d.]+) %, backward \+([\d.]+) %", said[0])
    assert shares is not None
    assert float(shares[1]) == pytest.approx(100 * COPY_SLOWDOWN[0], abs=0.06)
    assert float(shares[2]) == pytest.approx(100 * COPY_SLOWDOWN[1], abs=0.06)
    assert not any("Copies slow" in n for n in unpriced.notes)
    roomy, roomy_unpriced = plans("1GiB")  # nothing swapped: nothing to slow
    assert not roomy.swapped and not any("Copies slow" in n for n in roomy.notes)
    assert roomy.predicted_step_seconds == pytest.approx(roomy_unpriced.predicted_step_seconds)
    # a measured machine prices none of its own: its calibration times it
    assert _machine(copies=1e9, flops=1e12).copy_slowdown == (0.0, 0.0)


@pytest.mark.parametrize("bad", [(0.1,), (-0.01, 0.0), (0.0, 1.0), [0.01, 0.01],
                                 (0.01, "x"), 0.03])
def test_a_machines_copy_slowdown_is_a_pair_of_shares(bad: object) -> None:
    from vramkit.errors import ConfigError

    with pytest.raises(ConfigError, match="copy_slowdown"):
        Machine(name="test", memory_bytes=None, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
                flops_per_s=1e12, fp8_flops_per_s=None, memory_bandwidth_bytes_per_s=1e12,
                copy_slowdown=bad)  # type: ignore[arg-type]


def test_dequantizing_together_is_chosen_where_it_pays_and_fits() -> None:
    import dataclasses

    model = _models.stack(n=6)
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None, formats=("bf16", "int8"))
    assert all(b.dense["int8"] > 0 and not b.dense.get("bf16") for b in cost.blocks)
    times = _steady(calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=1))
    slow_copies = _machine(copies=1e7, flops=1e12)

    # each layer at its call: 100 ms more per block call; together: 10 ms (the copies of an
    # int8 block take ~50 ms here: per layer cannot hide behind them, together can)
    packed = dataclasses.replace(times, calls={**times.calls, "int8": _slower(times, 0.1),
                                               "int8+together": _slower(times, 0.01)})

    def plan_for(budget: str) -> vramkit.Plan:
        return vramkit.plan(model, inputs, budget, hardware=slow_copies, cost=cost,
                            block_times=packed, autocast=None, allow_formats=("int8",),
                            headroom=0)

    roomy = plan_for("8MiB")
    assert set(roomy.formats.values()) == {"int8"} and roomy.dequantize_together
    scratch = roomy.peak_breakdown["dequantized_weights"]
    assert scratch == max(b.dense["int8"] for b in cost.blocks)
    assert roomy.predicted_peak_bytes == sum(roomy.peak_breakdown.values())
    assert "Dequantize each packed block's layers together" in roomy.explain()
    assert '"dequantize_together": true' in roomy.to_json()
    # An un-checkpointed block's backward finds the buffer holding another block: it is priced
    # as each layer dequantizing at its call (100 ms), a checkpointed one's as together (10 ms).
    cheap_backward = dataclasses.replace(packed, calls={
        **packed.calls, "int8": {n: dataclasses.replace(c, backward=c.backward - 0.09)
                                 for n, c in packed.calls["int8"].items()}})
    twin = vramkit.plan(model, inputs, "8MiB", hardware=slow_copies, cost=cost,
                        block_times=cheap_backward, autocast=None, allow_formats=("int8",),
                        headroom=0)
    assert (twin.swapped, twin.checkpointed, twin.dequantize_together) == (
        roomy.swapped, roomy.checkpointed, True)
    kept = len(cost.blocks) - len(roomy.checkpointed)
    assert kept
    assert roomy.backward.compute_seconds - twin.backward.compute_seconds == pytest.approx(
        0.09 * kept)
    # Where the buffer does not fit beside the rest, each layer dequantizes at its call.
    packed_alone = plan_for("5MiB")
    assert "int8" in packed_alone.formats.values()
    assert not packed_alone.dequantize_together
    assert "dequantized_weights" not in packed_alone.peak_breakdown
    # Offline (nothing timed) the two ways cost the same: never together.
    offline = vramkit.plan(model, inputs, "8MiB", hardware="rtx4090", cost=cost,
                           autocast=None, allow_formats=("int8",), headroom=0)
    assert not offline.dequantize_together


def test_dequantizing_together_is_timed_filling_the_buffer_every_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.planning.calibration import _WARMUP_ROUNDS
    from vramkit.quant.dense import DenseGroup

    fills = [0]
    expand = DenseGroup._expand

    def counting(self: DenseGroup, *args: object) -> None:
        fills[0] += 1
        expand(self, *args)

    monkeypatch.setattr(DenseGroup, "_expand", counting)
    model = _frozen(Mixed())
    times = calibrate_blocks(model, _models.inputs(), device="cpu", autocast=None, repeats=2,
                             formats=("int8",))
    # in a step the buffer holds other blocks between a block's calls: every round's forward
    # fills it (3 kinds), and backward reuses it (as after a checkpointed recomputation)
    assert fills[0] == 3 * (2 + _WARMUP_ROUNDS)
    assert times.kinds == 3


def test_a_checkpointed_block_is_timed_with_its_recomputation() -> None:
    from vramkit.planning.calibration import _WARMUP_ROUNDS

    class Counted(Slow):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.device.type != "meta":
                Counted.calls += 1
            return super().forward(x)

    model = _frozen(Mixed())
    model.blocks = nn.ModuleList([Counted(), Counted()])
    _frozen(model)
    inputs = _models.inputs()
    times = calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=2)
    # two kinds (the first block's input requires no grad), each timed as built (a forward a
    # round) and checkpointed (a forward, and again in the backward, a round)
    assert times.kinds == 2
    assert Counted.calls == 2 * 3 * (2 + _WARMUP_ROUNDS)
    checkpointed = times.call("blocks.1", "checkpointed")
    assert checkpointed is not None
    assert checkpointed.backward >= SLEEP  # the recomputation's wait is inside the backward
    assert times.extra("checkpointed", "blocks.1") is not None
    Counted.calls = 0
    assert "checkpointed" not in calibrate_blocks(model, inputs, mode="infer", device="cpu",
                                                  autocast=None, repeats=1).calls
    # inference: nothing requires grad, one kind; the forward alone
    assert Counted.calls == 1 + _WARMUP_ROUNDS


def _plans_at_the_least_budget(model: nn.Module, inputs: Any, cost: Any, machine: Machine,
                               first: BlockTimes, second: BlockTimes) -> list[vramkit.Plan]:
    """Plans from ``first`` and ``second`` at the smallest budget that fits with ``first``'s
    times (the plan checkpoints as much as it can there); both checkpoint the same blocks."""
    with pytest.raises(PlanError) as info:
        vramkit.plan(model, inputs, 1, hardware=machine, cost=cost, block_times=first,
                     autocast=None, headroom=0, activation_offload=False)
    least = info.value.minimum_budget
    assert least is not None
    plans = [vramkit.plan(model, inputs, least, hardware=machine, cost=cost, block_times=t,
                          autocast=None, headroom=0, activation_offload=False)
             for t in (first, second)]
    assert plans[0].checkpointed == plans[1].checkpointed and plans[0].checkpointed
    return plans


def test_the_planner_prices_checkpointing_by_its_measured_cost() -> None:
    import dataclasses

    model = _frozen(Mixed())
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None)
    measured = calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=1)
    machine = _machine(copies=1e12, flops=1e12)
    # a free checkpoint (the variant as the full call: nothing clamped at 0 from timing noise)
    # against one that costs a second more per call (both phases, both sides)
    times = dataclasses.replace(measured, calls={**measured.calls,
                                                 "checkpointed": measured.calls["full"]})
    dear = dataclasses.replace(measured, calls={**measured.calls,
                                                "checkpointed": _slower(measured, 1.0)})
    plans = _plans_at_the_least_budget(model, inputs, cost, machine, times, dear)
    extra = plans[1].backward.compute_seconds - plans[0].backward.compute_seconds
    assert extra == pytest.approx(1.0 * len(plans[0].checkpointed))
    # and the checkpointed forward's measured cost too: a second per checkpointed block
    assert plans[1].forward.compute_seconds - plans[0].forward.compute_seconds == pytest.approx(
        1.0 * len(plans[0].checkpointed))


def test_a_checkpointed_forward_cheaper_than_the_call_as_built_is_priced_so() -> None:
    # The lean checkpoint's forward records no graph: its host side can cost less than the
    # block as built, and the plan's checkpointed blocks are priced at what was measured (not
    # at the call as built plus a gain clamped at 0).
    import dataclasses

    model = _frozen(Mixed())
    inputs = _models.inputs()
    cost = analyze(model, inputs, autocast=None)
    measured = _steady(calibrate_blocks(model, inputs, device="cpu", autocast=None, repeats=1))
    machine = _machine(copies=1e12, flops=1e12)
    lighter = {n: dataclasses.replace(c, host_forward=0.25e-3)
               for n, c in measured.calls["checkpointed"].items()}
    cheap = dataclasses.replace(measured, calls={**measured.calls, "checkpointed": lighter})
    plans = _plans_at_the_least_budget(model, inputs, cost, machine, measured, cheap)
    saved = plans[0].forward.host_seconds - plans[1].forward.host_seconds
    assert saved == pytest.approx(0.75e-3 * len(plans[0].checkpointed))
    assert plans[1].forward.compute_seconds == plans[0].forward.compute_seconds


def test_the_host_sample_is_the_median_of_the_warm_up_rounds_after_the_first() -> None:
    from vramkit.planning.calibration import _WARMUP_ROUNDS, _Clock

    clock = _Clock(torch.device("cpu"))
    assert clock.host_s == 0.0
    clock.host_samples = [5.0]
    assert clock.host_s == 5.0  # one round: the first is all there is
    clock.host_samples = [9.0, 1.0, 3.0, 2.0]  # the first round pays compilation
    assert clock.host_s == 2.0
    assert _WARMUP_ROUNDS >= 3  # a median of at least two later rounds
    # a plan's enqueue time: the later warm-up rounds (device idle) and the timed rounds
    # (device busy) together
    assert clock.enqueue_s == 2.0  # no timed rounds yet
    clock.busy_samples = [4.0, 5.0, 6.0]
    assert clock.enqueue_s == 3.5  # median of 1, 3, 2, 4, 5, 6


# -- compiled blocks ---------------------------------------------------------------------------

@pytest.fixture
def _aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile through dynamo and AOTAutograd without inductor's code generation (a CPU
    inductor compile takes seconds): what is timed is still the compiled block's call."""
    dynamo = pytest.importorskip("torch._dynamo")
    dynamo.reset()
    dynamo.utils.counters.clear()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **options: compile_(fn, backend="aot_eager", **options))


@pytest.mark.usefixtures("_aot_eager")
def test_compiled_calibration_times_the_blocks_compiled() -> None:
    import torch._dynamo as dynamo

    times = calibrate_blocks(_models.stack(device="meta"), _models.inputs(), device="cpu",
                             repeats=1, autocast=None, compile="default")
    assert times.compiled == "default"
    assert dynamo.utils.counters["frames"]["ok"] > 0  # the blocks' own forwards, compiled
    names = {f"blocks.{i}" for i in range(6)}
    assert set(times.calls["full"]) == set(times.calls["checkpointed"]) == names
    eager = calibrate_blocks(_models.stack(device="meta"), _models.inputs(), device="cpu",
                             repeats=1, autocast=None)
    assert eager.compiled is None
    with pytest.raises(ConfigError, match="compile"):
        calibrate_blocks(_models.stack(device="meta"), _models.inputs(), device="cpu",
                         compile="reduce-overhead")


def test_an_offline_plan_prices_compiled_blocks_as_eager_and_says_so() -> None:
    model, budget = _models.stack(device="meta"), 64 << 20
    eager = vramkit.plan(model, _models.inputs(), budget, hardware="rtx4090", headroom=0)
    compiled = vramkit.plan(model, _models.inputs(), budget, hardware="rtx4090", headroom=0,
                            compile="default")
    assert compiled.predicted_step_seconds == eager.predicted_step_seconds
    assert "priced as eager: offline profiles state no compiled speedup" in compiled.explain()
    assert "compiled" not in " ".join(eager.notes)


@pytest.mark.usefixtures("_aot_eager")
def test_a_plan_from_compiled_times_says_they_were_measured_compiled() -> None:
    model = _models.stack(device="meta")
    times = calibrate_blocks(model, _models.inputs(), device="cpu", repeats=1, autocast=None,
                             compile="default")
    made = vramkit.plan(model, _models.inputs(), 64 << 20, hardware="rtx4090", headroom=0,
                        block_times=times, compile="default")
    assert "their times were measured compiled" in made.explain()
    stale = vramkit.plan(model, _models.inputs(), 64 << 20, hardware="rtx4090", headroom=0,
                         block_times=times, compile="max-autotune-no-cudagraphs")
    assert "measured compiled in another mode" in stale.explain()


def test_fit_plans_for_the_compile_it_applies() -> None:
    fitted = vramkit.fit(_models.stack(), _models.inputs(), 6 << 20, compile=True,
                         hardware="rtx4090", headroom=0, autocast=None, device="cpu")
    try:
        assert "Blocks run compiled (torch.compile mode='default'), priced as eager" in (
            fitted.plan.explain())
    finally:
        fitted.detach()
