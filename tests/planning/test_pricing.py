"""vramkit.planning.pricing: what the planner prices a block and a candidate at."""

from __future__ import annotations

import pytest

from tests.planning._models import inputs, stack
from vramkit.planning.analysis import ModelCost, analyze
from vramkit.planning.calibration import CallTimes
from vramkit.planning.machine import machine_for
from vramkit.planning.pricing import BlockPrices, Candidate, StepPricer


def test_offloaded_activations_count_the_window_only_where_it_is_held() -> None:
    # With activation offload the device holds: at the turn of the step the tail (logits)
    # beside the forward's last tensors still held (nothing prefetched yet); at the start of
    # backward those held tensors, the prefetched ones, the last block recomputed and one
    # block's temporaries; later in backward only the prefetched ones beside the block
    # recomputed and its temporaries (the held tensors were the first blocks' of backward).
    from vramkit.planning.activations import ActivationEstimate
    from vramkit.planning.pricing import (
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


def test_offloaded_activations_take_the_followed_recomputation_where_there_is_one() -> None:
    # A long-sequence block (Wan at 32k tokens: saves 7.4 GiB, holds 10.9 GiB while it is
    # recomputed) is priced by what the meta step followed, not by twice its saved bytes.
    from vramkit.planning.activations import ActivationEstimate
    from vramkit.planning.pricing import (
        OFFLOAD_INFLIGHT_BYTES,
        OFFLOAD_PREFETCH_BYTES,
        OFFLOAD_WINDOW_BYTES,
        _offloaded,
        recompute_peak,
    )

    MiB = 1 << 20
    found = ActivationEstimate(
        per_block={"a": 700 * MiB, "b": 700 * MiB, "c": 300 * MiB},
        inputs={"a": 30 * MiB, "b": 30 * MiB, "c": 30 * MiB}, outside=5 * MiB, tail=0,
        transient={"a": 1000 * MiB, "b": 800 * MiB, "c": 100 * MiB},
        backward_peak={"a": 900 * MiB, "b": 950 * MiB})
    assert recompute_peak(found, "a") == 1030 * MiB  # its recomputed forward: inputs + made
    assert recompute_peak(found, "b") == 950 * MiB  # its backward
    assert recompute_peak(found, "c") == 600 * MiB  # not followed: twice what it saves
    assert _offloaded(found, True) == 5 * MiB + max(
        OFFLOAD_PREFETCH_BYTES + 1030 * MiB, OFFLOAD_WINDOW_BYTES + 600 * MiB,
        OFFLOAD_INFLIGHT_BYTES)


@pytest.fixture(scope="module")
def cost() -> ModelCost:
    return analyze(stack(device="meta"), inputs(device="meta"), mode="train", autocast=None)


def test_a_checkpointed_block_is_priced_with_its_forward_again_in_backward(
        cost: ModelCost) -> None:
    # Offline (no measured times): a checkpointed block's call is the call as built with one
    # more forward in backward, on the device and on the host.
    machine = machine_for("rtx4090")
    prices = BlockPrices.of(cost, machine, None, ["bf16"])
    assert len(prices.full) == len(prices.as_checkpointed) == len(cost.blocks)
    for full, checkpointed in zip(prices.full, prices.as_checkpointed, strict=True):
        assert checkpointed == CallTimes(full.forward, full.backward + full.forward,
                                         full.host_forward,
                                         full.host_backward + full.host_forward)
    assert prices.measured == frozenset() and prices.ways == [False]
    assert prices.slow_forward == [machine.copy_slowdown[0]] * len(cost.blocks)
    assert all(d == CallTimes(0.0, 0.0, 0.0, 0.0) for d in prices.dequant[False]["bf16"])


def _candidate(cost: ModelCost, checkpoints: int) -> Candidate:
    n = len(cost.blocks)
    nothing = [CallTimes(0.0, 0.0, 0.0, 0.0)] * n
    return Candidate(chosen=[], flags=[False] * n, num_slots=1,
                     sizes=[b.swapped["bf16"] for b in cost.blocks], copy_seconds=[0.0] * n,
                     master_bytes=0, weights=1000, slot_bytes=0, scratch=0, dequant=nothing,
                     per_layer=nothing, swapped_format="bf16", resident_format="bf16",
                     together=False, checkpoints=checkpoints, offload=False)


def test_a_resident_candidate_costs_its_compute_and_its_recomputation(cost: ModelCost) -> None:
    machine = machine_for("rtx4090")
    prices = BlockPrices.of(cost, machine, None, ["bf16"])
    names = [b.name for b in cost.blocks]
    act_choices = [cost.activations.bytes_with(names[:m]) for m in range(len(names) + 1)]
    pricer = StepPricer(cost=cost, machine=machine, prices=prices, order=names,
                        act_choices=act_choices, trainable=7, formats=["bf16"],
                        host_budget=None, disk_bytes_per_s=1e9)
    plain = pricer.price(_candidate(cost, 0))
    every = pricer.price(_candidate(cost, len(names)))
    assert plain is not None and every is not None
    assert plain.forward.copy_bytes == 0 and plain.backward.copy_bytes == 0
    assert plain.seconds == pytest.approx(plain.forward.seconds + plain.backward.seconds
                                          + prices.optimizer)
    assert plain.breakdown == {"resident_weights": 1000, "swap_slots": 0,
                               "trainable_and_optimizer": 7, "activations": act_choices[0]}
    assert every.checkpointed == names and every.breakdown["activations"] == act_choices[-1]
    # checkpointing every block adds each block's forward to backward's compute
    recomputed = sum(c.forward for c in prices.full)
    assert every.backward.compute_seconds == pytest.approx(
        plain.backward.compute_seconds + recomputed)
    assert every.forward == plain.forward
