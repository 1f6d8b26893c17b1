"""`vramkit.recipes.demo.harness`: paired alternating rounds and the CUDA memory cap."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.demo._helpers import tiny_config as _tiny
from vramkit.recipes.demo import DemoProgress, run_demo


def test_cpu_demo_times_the_runs_in_paired_alternating_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that slows down steadily: every step takes longer than the one before. Timed
    one run after the other, the resident run would look 3x slower than the swapped one; in
    paired, alternating rounds both see the same drift and the ratio stays 1."""
    from vramkit.recipes.demo import harness as demo_mod

    calls: list[float] = []

    def drifting_clock() -> float:  # step j (in global order) lasts 4j + 1 "seconds"
        calls.append(float(len(calls) ** 2))
        return calls[-1]

    monkeypatch.setattr(demo_mod, "_clock", drifting_clock)
    events: list[DemoProgress] = []
    result = run_demo(_tiny(steps=5), progress=events.append)
    assert result.timing == "paired"
    assert [r["first"] for r in result.timing_rounds] == [
        "swapped", "resident", "swapped", "resident", "swapped"]
    durations = [4 * j + 1 for j in range(10)]  # global order: A B | B A | A B | B A | A B
    assert result.step_seconds == [durations[i] for i in (0, 3, 4, 7, 8)]
    assert result.baseline_step_seconds == [durations[i] for i in (1, 2, 5, 6, 9)]
    for r in result.timing_rounds:
        assert r["swapped_seconds"] == result.step_seconds[r["round"]]
        assert r["resident_seconds"] == result.baseline_step_seconds[r["round"]]
    assert result.median_step_seconds == 23.0 and result.baseline_median_step_seconds == 23.0
    assert result.slowdown == 1.0
    # the losses of the two runs are still compared, step by step
    assert result.baseline_losses == result.losses and result.baseline_max_loss_diff == 0.0
    # progress reports carry the same statistic the result reports
    last = {e.stage: e for e in events if e.step_seconds is not None}
    assert last["train"].median_step_seconds == result.median_step_seconds
    assert last["baseline"].median_step_seconds == result.baseline_median_step_seconds


def test_the_memory_cap_collects_garbage_before_it_reads_what_the_process_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Device memory held by unreachable cycles of earlier work must not count as "held
    before" the run: freed during the run, it would take the run's peak below it."""
    import gc

    from vramkit.recipes.demo import harness

    state = {"allocated": 100}

    class Cycle:  # stands for tensors of an earlier run kept alive by a reference cycle
        def __init__(self) -> None:
            self.me = self
            state["allocated"] += 50

        def __del__(self) -> None:
            state["allocated"] -= 50

    fake = {"empty_cache": lambda: None, "set_per_process_memory_fraction": lambda *a: None,
            "reset_peak_memory_stats": lambda *a: None,
            "get_per_process_memory_fraction": lambda *a: 1.0,
            "memory_reserved": lambda *a: state["allocated"],
            "memory_allocated": lambda *a: state["allocated"],
            "get_device_properties": lambda *a: type("P", (), {"total_memory": 10**9})}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        Cycle()
        assert state["allocated"] == 150
        with harness.memory_cap(torch.device("cuda", 0), 10) as (allocated, reserved):
            assert (allocated, reserved) == (100, 100)
    finally:
        if was_enabled:
            gc.enable()


def _rounds(pairs: list[tuple[float, float]]) -> list[dict[str, object]]:
    return [{"round": i, "first": "swapped", "swapped_seconds": s, "resident_seconds": r}
            for i, (s, r) in enumerate(pairs)]


def test_the_ratio_comes_with_the_spread_of_its_rounds_and_a_rule_for_too_wide() -> None:
    # The same demo read 1.14x, 0.37x and 1.09x on a loaded CPU: a ratio alone hid that.
    from vramkit.recipes.demo.harness import MIN_ROUNDS, WIDE_SPREAD, ratio_spread

    steady = ratio_spread(_rounds([(9.0, 1.0)] + [(1.1 + 0.01 * i, 1.0) for i in range(8)]))
    assert steady is not None and steady.rounds == 8  # the first round left out
    assert steady.low == pytest.approx(1.10) and steady.high == pytest.approx(1.17)
    assert steady.q1 <= steady.median <= steady.q3 and not steady.wide
    assert steady.describe() == "rounds 1.10-1.17x (middle half 1.12-1.15x, 8 rounds)"
    loaded = ratio_spread(_rounds([(1.0, 1.0), (1.1, 1.0), (0.4, 1.0), (1.2, 1.0), (0.5, 1.0),
                                   (1.0, 0.9), (0.35, 1.0)]))
    assert loaded is not None and loaded.wide
    assert loaded.q3 - loaded.q1 > WIDE_SPREAD * loaded.median
    assert "too spread for the ratio to mean much" in loaded.describe()
    assert f"{WIDE_SPREAD:.0%}" in loaded.rule
    few = ratio_spread(_rounds([(1.0, 1.0)] * MIN_ROUNDS))  # MIN_ROUNDS - 1 counted
    assert few is not None and few.wide and few.q3 == few.q1
    assert ratio_spread([]) is None


def test_a_paired_demo_reports_the_spread_beside_the_ratio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The drifting clock of the test above: the medians agree (1.0x) while the rounds' own
    # ratios range from 17/21 to 13/9, too spread for the ratio to mean much.
    from vramkit.recipes.demo import harness as demo_mod

    calls: list[float] = []

    def drifting_clock() -> float:
        calls.append(float(len(calls) ** 2))
        return calls[-1]

    monkeypatch.setattr(demo_mod, "_clock", drifting_clock)
    result = run_demo(_tiny(steps=5))
    spread = result.slowdown_spread
    assert result.slowdown == 1.0 and spread is not None and spread.rounds == 4
    assert (spread.low, spread.high) == (pytest.approx(17 / 21), pytest.approx(13 / 9))
    assert spread.wide
    data = result.to_dict()["slowdown_spread"]
    assert data["wide"] is True and data["rounds"] == 4 and "median" in data["rule"]
