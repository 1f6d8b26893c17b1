"""The planner on a small stack: what it chooses, what it predicts, and its properties."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from tests.planning._models import inputs, stack
from vramkit.errors import ConfigError, PlanError
from vramkit.planning.analysis import analyze
from vramkit.planning.api import plan, resolve_headroom
from vramkit.planning.machine import Machine
from vramkit.planning.planner import (
    PhaseTime,
    _by_stack,
    _paced_set,
    _simulate,
    _simulate_calls,
    _swap_sets,
    simulate_phase,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def cost():  # type: ignore[no-untyped-def]
    return analyze(stack(device="meta"), inputs(device="meta"), mode="train", autocast=None,
                   formats=("bf16", "fp8", "nf4"))


def _plan(cost, budget: int, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("hardware", "rtx4090")
    kw.setdefault("headroom", 0)
    return plan(stack(device="meta"), inputs(device="meta"), budget, cost=cost, **kw)


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


def test_the_plan_serializes_and_explains_itself(cost) -> None:  # type: ignore[no-untyped-def]
    p = _plan(cost, 7 * MiB)
    data = json.loads(p.to_json())
    assert data["swapped"] == list(p.swapped)
    assert data["predicted_step_seconds"] == pytest.approx(p.predicted_step_seconds)
    assert data["forward"]["transfer_bound"] == p.forward.transfer_bound
    text = p.explain()
    assert f"Swap {len(p.swapped)} of 6 blocks" in text and "Predicted step" in text
    assert "rtx4090" in text


def test_a_phase_waits_for_copies_and_for_slots() -> None:
    # Two blocks, both swapped, 1 ms compute and 2 ms copy each, one slot: the second copy
    # waits for the first block to finish (slot) -> 1 + 2 + 1.
    assert simulate_phase([1.0, 1.0], [2.0, 2.0], [True, True], slots=1) == pytest.approx(4.0)
    # Two slots: both are in place at the start of the phase.
    assert simulate_phase([1.0, 1.0], [2.0, 2.0], [True, True], slots=2) == pytest.approx(2.0)
    # A resident block between two swapped ones hides the copy (slot freed, engine free).
    assert simulate_phase([1.0, 3.0, 1.0], [2.0, 0.0, 2.0], [True, False, True],
                          slots=1) == pytest.approx(5.0)
    # Transfer-bound with one slot: each later block waits for the previous one to free the
    # slot, then for its own copy: 1 + 3 x (5 + 1).
    assert simulate_phase([1.0] * 4, [5.0] * 4, [True] * 4, slots=1) == pytest.approx(19.0)
    assert PhaseTime(2.0, 1.0, 2.0, 10).transfer_bound
    assert not PhaseTime(1.0, 1.0, 0.5, 10).transfer_bound


def test_offloaded_activations_come_back_one_block_ahead() -> None:
    # Resident blocks of 2 ms whose saved activations take 1 ms to come back: each block's
    # restore is queued as the block before it starts, so it hides behind that block.
    assert simulate_phase([2.0] * 3, [0.0] * 3, [False] * 3, slots=1,
                          restores=[0.0, 1.0, 1.0]) == pytest.approx(6.0)
    # The first block's restore has nothing before it to hide behind.
    assert simulate_phase([2.0] * 3, [0.0] * 3, [False] * 3, slots=1,
                          restores=[1.0, 0.0, 0.0]) == pytest.approx(7.0)
    # Swapped blocks, two slots, 1 ms copies: block 1's restore is queued when block 0 starts
    # (1-2), ahead of block 2's weights, which block 0's end queues (3-4); block 2's restore
    # follows them (4-5), so block 2 starts at 5: 7 ms. (Queued behind the weight copy that a
    # block's end starts, every block would wait for a copy and a restore in turn: 9 ms.)
    assert simulate_phase([2.0] * 3, [1.0] * 3, [True] * 3, slots=2,
                          restores=[1.0] * 3) == pytest.approx(7.0)


def test_compute_beside_the_copy_engine_runs_slower() -> None:
    # Three swapped blocks, 2 ms of compute and 1 ms of copy each, two slots: block 0 runs
    # alone (0-2), its end starts block 2's copy (2-3), which runs beside the first 1 ms of
    # block 1 (2-4): 50 % slower there, block 1 ends at 4.5; block 2 runs alone (4.5-6.5).
    args = ([2.0] * 3, [1.0] * 3, [True] * 3)
    assert simulate_phase(*args, slots=2) == pytest.approx(6.0)
    assert simulate_phase(*args, slots=2, slowdown=0.5) == pytest.approx(6.5)
    assert _simulate(*args, 2, None, None, 0.5) == (pytest.approx(6.5), pytest.approx(0.5))
    # per block: only block 1 has copies beside it
    assert simulate_phase(*args, slots=2, slowdown=[0.0, 0.5, 0.0]) == pytest.approx(6.5)
    assert simulate_phase(*args, slots=2, slowdown=[0.5, 0.0, 0.5]) == pytest.approx(6.0)
    # one slot: every copy waits for the block before to end, so nothing overlaps
    assert simulate_phase(*args, slots=1, slowdown=0.5) == simulate_phase(*args, slots=1)
    # nothing swapped: no copies, no slowdown
    assert simulate_phase([2.0] * 3, [0.0] * 3, [False] * 3, slots=2,
                          slowdown=0.5) == pytest.approx(6.0)


def test_the_host_runs_ahead_of_the_device() -> None:
    # Blocks alternately heavier on the host (3 ms to enqueue 1 ms of kernels) and on the
    # device (1 ms to enqueue 3 ms): the host runs ahead, so the phase takes less than each
    # block's longer side summed (12 ms), but more than either side's sum (8 ms): a block
    # starts once the host begins enqueueing it and ends no earlier than the host is done
    # (3, 6, 7, 10).
    compute, host = [1.0, 3.0, 1.0, 3.0], [3.0, 1.0, 3.0, 1.0]
    free = [0.0] * 4, [False] * 4
    assert simulate_phase(compute, *free, slots=1, host=host) == pytest.approx(10.0)
    assert simulate_phase(compute, *free, slots=1) == pytest.approx(8.0)
    # Host-bound throughout: the host's sum; device-bound throughout: the device's.
    assert simulate_phase([1.0] * 4, *free, slots=1, host=[2.0] * 4) == pytest.approx(8.0)
    assert simulate_phase([2.0] * 4, *free, slots=1, host=[1.0] * 4) == pytest.approx(8.0)
    # A copy still paces a swapped block whatever the host does.
    assert simulate_phase([1.0, 1.0], [2.0, 2.0], [True, True], slots=1,
                          host=[0.1, 0.1]) == pytest.approx(4.0)
    assert PhaseTime(8.0, 4.0, 0.0, 0, host_seconds=8.0).host_bound
    assert not PhaseTime(8.0, 4.0, 0.0, 0, host_seconds=8.0).transfer_bound
    assert not PhaseTime(8.0, 8.0, 0.0, 0, host_seconds=7.0).host_bound


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


def test_explain_says_how_much_of_each_stack_is_swapped() -> None:
    names = ["blocks.0", "blocks.1", "single.0", "single.1", "single.2", "head"]
    assert _by_stack(names, {"blocks.1", "single.0", "single.2"}) == {
        "blocks": (1, 2), "single": (2, 3), "head": (0, 1)}
    model = torch.nn.Module()
    model.a = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))
    model.b = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))
    model.forward = lambda x: model.b[2](model.b[1](model.b[0](  # type: ignore[method-assign]
        model.a[2](model.a[1](model.a[0](x))))))
    model.requires_grad_(False).to("meta")
    x = torch.empty(8, 512, device="meta")
    whole = plan(model, (x,), 1 << 40, hardware="rtx4090", headroom=0, mode="infer")
    tight = plan(model, (x,), whole.predicted_peak_bytes - 2 * 512 * 513 * 4,
                 hardware="rtx4090", headroom=0, mode="infer")
    assert tight.swapped
    line = next(li for li in tight.explain().splitlines() if li.startswith("Swapped per stack"))
    counts = _by_stack(tight.block_order, set(tight.swapped))
    assert line == "Swapped per stack: " + ", ".join(
        f"{stack} {k} of {n}" for stack, (k, n) in counts.items()) + "."
    assert "Swapped per stack" not in whole.explain()  # nothing swapped: no such line


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


def test_back_to_back_inference_calls_copy_every_swapped_block_once_a_call() -> None:
    # Four swapped blocks through two slots, copies twice as long as compute: a call alone
    # starts with the first two in place (6 s); back to back, the ring wraps and loads them
    # during the previous call's tail, so the copy engine paces every call at 4 copies (8 s).
    alone = _simulate([1.0] * 4, [2.0] * 4, [True] * 4, 2, None, None, 0.0)
    assert alone == (pytest.approx(6.0), 0.0)
    assert _simulate_calls([1.0] * 4, [2.0] * 4, [True] * 4, 2, None, 0.0) == (
        pytest.approx(8.0), 0.0)
    # copies that hide behind compute cost nothing either way
    assert _simulate_calls([1.0] * 4, [0.1] * 4, [True] * 4, 2, None, 0.0)[0] == (
        pytest.approx(4.0))
    # every swapped block has a slot: nothing is copied after the first call
    assert _simulate_calls([1.0] * 4, [2.0] * 4, [True, True, False, False], 2, None, 0.0)[0] == (
        pytest.approx(4.0))
    # what compute loses beside the copies is one call's too
    time, lost = _simulate_calls([1.0] * 4, [2.0] * 4, [True] * 4, 2, None, 0.1)
    assert time == pytest.approx(8.0) and lost == pytest.approx(0.4)


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


def test_offloaded_activations_count_the_window_only_where_it_is_held() -> None:
    # With activation offload the device holds: at the turn of the step the tail (logits)
    # beside the forward's last tensors still held (nothing prefetched yet); at the start of
    # backward those held tensors, the prefetched ones, the last block recomputed and one
    # block's temporaries; later in backward only the prefetched ones beside the block
    # recomputed and its temporaries (the held tensors were the first blocks' of backward).
    from vramkit.planning.activations import ActivationEstimate
    from vramkit.planning.planner import (
        OFFLOAD_INFLIGHT_BYTES,
        OFFLOAD_PREFETCH_BYTES,
        OFFLOAD_WINDOW_BYTES,
        _offloaded,
    )

    assert OFFLOAD_WINDOW_BYTES == OFFLOAD_INFLIGHT_BYTES + OFFLOAD_PREFETCH_BYTES
    MiB = 1 << 20

    def estimate(blocks: dict[str, int], tail: int) -> ActivationEstimate:
        return ActivationEstimate(per_block=blocks, inputs=dict.fromkeys(blocks, MiB),
                                  outside=5 * MiB, tail=tail)

    # the largest block first in forward: the held tensors are gone by its recomputation
    early = estimate({"a": 900 * MiB, "b": 100 * MiB}, tail=0)
    assert _offloaded(early, True) == 5 * MiB + OFFLOAD_PREFETCH_BYTES + 2 * 900 * MiB
    # the largest block last: backward starts with it, beside the held and prefetched tensors
    late = estimate({"a": 100 * MiB, "b": 300 * MiB}, tail=0)
    assert _offloaded(late, True) == 5 * MiB + OFFLOAD_WINDOW_BYTES + 2 * 300 * MiB
    # a smaller block last: the start of backward holds the window beside that block
    small_last = estimate({"a": 500 * MiB, "b": 300 * MiB}, tail=0)
    assert _offloaded(small_last, True) == 5 * MiB + max(
        OFFLOAD_PREFETCH_BYTES + 2 * 500 * MiB, OFFLOAD_WINDOW_BYTES + 2 * 300 * MiB)
    big_tail = estimate({"a": 100 * MiB, "b": 300 * MiB}, tail=3 << 30)
    assert _offloaded(big_tail, True) == 5 * MiB + OFFLOAD_INFLIGHT_BYTES + (3 << 30)
    assert _offloaded(big_tail, False) == 3 << 30
