"""benchmarks/faster_than_resident.py on the CPU with a tiny FLUX: the training row with W8A8
blocks and the accuracy row run end to end, so the GPU run does not fail on a typo. The times
it prints on the CPU mean nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests._benchmarks import load_benchmark

pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("faster_than_resident")


def test_a_w8a8_training_row_runs_paired_against_resident(bench: ModuleType,
                                                          tmp_path: Path) -> None:
    code = bench.main(["--device", "cpu", "--tiny", "--mode", "int8", "--rounds", "1",
                       "--warmup", "1", "--out", str(tmp_path)])
    assert code == 0
    row = json.loads((tmp_path / "faster_than_resident_int8.json").read_text())["row"]
    assert row["w8a8_layers"] > 0 and row["rounds"] == 1
    assert row["ratio"] > 0 and row["predicted_step_s"] > 0
    assert "| int8 |" in (tmp_path / "faster_than_resident_int8.md").read_text()


def test_bad_arguments_are_usage_errors(bench: ModuleType) -> None:
    for argv in (["--mode", "fp4"], ["--infer", "--accuracy"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as info:
            bench.main(["--device", "cpu", "--tiny", *argv])
        assert info.value.code == 2
