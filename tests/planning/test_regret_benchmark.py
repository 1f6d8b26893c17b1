"""benchmarks/regret.py on the CPU with the tiny demo DiT: the plan and its neighbours are each
applied, stepped and detached, and the regret is printed, so the GPU run does not fail on a
typo. Its times mean nothing here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests._benchmarks import load_benchmark


def test_the_plan_and_its_neighbours_each_run_and_the_regret_is_their_ratio(
        tmp_path: Path) -> None:
    bench = load_benchmark("regret")
    assert bench.main(["--model", "demo", "--tiny", "--device", "cpu", "--out",
                       str(tmp_path)]) == 0
    result = json.loads((tmp_path / "regret_demo_tiny.json").read_text())
    plans = result["plans"]
    assert plans[0]["plan"] == "planner" and len(plans) >= 4
    assert {p["plan"].split(" (")[0] for p in plans[1:]} >= {"checkpoint +1", "offload on"}
    measured = [p["measured ms"] for p in plans]
    assert all(m > 0 for m in measured)
    assert math.isclose(result["regret"], measured[0] / min(measured), rel_tol=1e-9)
    kept = [p["measured ms"] for p in plans if p["fits (pred)"]]
    assert plans[0]["fits (pred)"]  # the planner's own plan keeps its headroom
    assert math.isclose(result["regret_within_headroom"], measured[0] / min(kept), rel_tol=1e-9)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_wan_inference_row_runs_both_arms(tmp_path: Path, compiled: bool) -> None:
    pytest.importorskip("diffusers")
    bench = load_benchmark("regret")
    assert bench.main(["--model", "wan", "--wan-infer", "--tiny", "--device", "cpu",
                       "--rounds", "1", "--steps", "1", "--out", str(tmp_path)]
                      + (["--compile"] if compiled else [])) == 0
    result = json.loads((tmp_path / "regret_wan_infer_tiny.json").read_text())
    assert len(result["fitted_s"]) == len(result["diffusers_s"]) == 1
    assert math.isclose(result["speed-up"], result["diffusers s"] / result["ours s"])
    assert ("compiled" in result["plan"]) == compiled
    assert ("Blocks run compiled" in result["explain"]) == compiled


def test_our_inference_budget_cannot_exceed_the_cards_cap() -> None:
    bench = load_benchmark("regret")
    with pytest.raises(SystemExit):
        bench.main(["--model", "wan", "--wan-infer", "--budget", "8", "--fit-budget", "9",
                    "--tiny", "--device", "cpu"])
    with pytest.raises(SystemExit):  # an option of the inference row only
        bench.main(["--model", "demo", "--fit-budget", "3", "--tiny", "--device", "cpu"])


def test_the_hunyuan_video_row_runs_both_arms(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    bench = load_benchmark("regret")
    assert bench.main(["--model", "hunyuan", "--video-row", "--tiny", "--device", "cpu",
                       "--rounds", "1", "--steps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "regret_hunyuan_row_tiny.json").read_text())
    assert result["row"].startswith("HunyuanVideo 13B LoRA")
    assert len(result["fitted_s"]) == len(result["resident_s"]) == 1
    with pytest.raises(SystemExit):  # HunyuanVideo has the video row only
        bench.main(["--model", "hunyuan", "--tiny", "--device", "cpu"])


def test_the_wan_training_row_runs_with_8bit_formats_allowed(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    bench = load_benchmark("regret")
    assert bench.main(["--model", "wan", "--wan-row", "--tiny", "--device", "cpu", "--rounds",
                       "1", "--steps", "1", "--allow", "int8-w8a8", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "regret_wan_row_tiny.json").read_text())
    assert len(result["fitted_s"]) == len(result["resident_s"]) == 1
    assert math.isclose(result["ratio"], result["step s"] / result["resident all-ckpt s"])
