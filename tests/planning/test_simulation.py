"""vramkit.planning.simulation: one phase simulated block by block over the host, the compute
stream and the copy engine."""

from __future__ import annotations

import pytest

from vramkit.planning.record import PhaseTime
from vramkit.planning.simulation import _simulate, _simulate_calls, simulate_phase


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


def test_a_compressed_block_decodes_beside_the_compute_or_before_it_starts() -> None:
    # Three swapped blocks, 2 ms compute, 1 ms (compressed) copy, 0.5 ms decode, two slots:
    # blocks 0 and 1 are in their slots; block 0's end (2) queues block 2's copy, which lands
    # at 3, during block 1 (2-4): its decode takes the SMs block 1 runs on -> block 1 ends at
    # 4.5, block 2 runs 4.5-6.5.
    args = ([2.0] * 3, [1.0] * 3, [True] * 3)
    decodes = [0.5] * 3
    assert simulate_phase(*args, slots=2, decodes=decodes) == pytest.approx(6.5)
    # One slot: block 1's copy starts when block 0 ends (2), lands at 3 with nothing running:
    # decoded before block 1 starts (3.5-5.5); likewise block 2 (5.5-6.5 copy, 7-9): 9.
    assert simulate_phase(*args, slots=1, decodes=decodes) == pytest.approx(9.0)
    assert simulate_phase(*args, slots=1) == pytest.approx(8.0)  # raw: no decodes
    # blocks in their slots at the start were decoded before the phase: nothing to charge
    assert simulate_phase([2.0] * 2, [1.0] * 2, [True] * 2, slots=2,
                          decodes=[0.5] * 2) == pytest.approx(4.0)
    # back-to-back inference calls decode every copied block once a call
    once, _ = _simulate_calls([2.0] * 3, [1.0] * 3, [True] * 3, 2, None, 0.0, decodes)
    raw, _ = _simulate_calls([2.0] * 3, [1.0] * 3, [True] * 3, 2, None, 0.0)
    assert once == pytest.approx(raw + 3 * 0.5)


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
