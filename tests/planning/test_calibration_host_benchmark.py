"""benchmarks/calibration_host.py on the CPU with the small demo DiT: its recorder finds every
kind's clocks (as built and checkpointed, forward and backward) in every calibration, and the
resident step is timed, so the GPU run does not fail on a typo. Its times mean nothing here."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests._benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("calibration_host")


@pytest.mark.parametrize("checkpointed", ["all", "none"])
def test_every_kind_is_summarized_in_every_calibration(bench: ModuleType, tmp_path: Path,
                                                       checkpointed: str) -> None:
    code = bench.main(["--device", "cpu", "--tiny", "--repeats", "2", "--timed", "1",
                       "--checkpointed", checkpointed, "--step", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "calibration_host.json").read_text())
    variant = "checkpointed" if checkpointed == "all" else "full"
    for how in bench.SUMMARIES:
        assert len(result["sums_ms"][how]) == 2
        kinds = result["kinds_ms"][how]
        # the small DiT: the first double block, the other double blocks, the single blocks
        assert len(kinds) == 3 * 2
        assert all(key.split()[1] == variant for key in kinds)
        assert {key.split()[2] for key in kinds} == {"forward", "backward"}
        assert all(len(values) == 2 for values in kinds.values())
    assert all(result["step_ms"][phase] > 0 for phase in ("forward", "backward", "optimizer"))


def test_the_summaries_differ_only_where_the_samples_spread(bench: ModuleType) -> None:
    steady = [2.0] * 6
    assert bench._summary(steady, "median") == bench._summary(steady, "lower-quartile") == 2.0
    burst = [2.0, 2.0, 2.0, 3.0, 3.0, 3.0]
    assert bench._summary(burst, "median") == 2.5
    assert bench._summary(burst, "lower-quartile") == 2.0
    assert bench._summary([], "median") == 0.0
    assert bench._summary([4.0], "lower-quartile") == 4.0
