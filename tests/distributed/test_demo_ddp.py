"""``torchrun --nproc_per_node 2 -m vramkit demo``: the demo as a two-rank data-parallel job
(CPU, gloo): rank 0 alone reports, the replicas stay equal, the frozen masters are shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed._launch import NPROC, describe, job_env, require_gloo, torchrun

require_gloo()
pytestmark = pytest.mark.slow  # torchrun jobs: ~10 s each

STEPS = 3


def _json_objects(text: str) -> list[Any]:
    """Every JSON value printed on ``text``, in order; fails on anything else there."""
    decoder = json.JSONDecoder()
    found, index = [], 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index == len(text):
            return found
        try:
            value, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            pytest.fail(f"stdout is not only JSON ({exc}):\n{text[-3000:]}")
        found.append(value)


@pytest.fixture(scope="module")
def json_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    cwd = tmp_path_factory.mktemp("demo_json")
    return torchrun(["-m", "vramkit", "demo", "--steps", str(STEPS), "--json"], cwd=cwd)


@pytest.fixture(scope="module")
def result(json_run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    if json_run.returncode != 0:
        pytest.fail(f"torchrun ... vramkit demo --json failed: {describe(json_run)}")
    objects = _json_objects(json_run.stdout)
    assert len(objects) == 1, f"expected rank 0's report only, got {len(objects)} JSON values"
    assert isinstance(objects[0], dict)
    return objects[0]


def test_the_job_exits_0_and_only_rank_0_prints_one_report(
        json_run: subprocess.CompletedProcess[str], result: dict[str, Any]) -> None:
    assert json_run.returncode == 0
    assert "Traceback" not in json_run.stderr, describe(json_run)
    assert result["world_size"] == NPROC
    assert result["backend"] == "gloo"
    assert result["devices"] == ["cpu"] * NPROC


def test_the_replicas_stay_equal_and_every_rank_planned_alike(result: dict[str, Any]) -> None:
    assert result["replicas_max_diff"] == 0
    assert result["plans_agree"] is True


def test_every_rank_is_under_its_budget(result: dict[str, Any]) -> None:
    budget = result["plan"]["budget_bytes"]
    assert result["under_budget"] is True
    assert len(result["peak_bytes"]) == NPROC
    assert all(0 < peak <= budget for peak in result["peak_bytes"])


def test_the_frozen_masters_are_one_shared_copy(result: dict[str, Any]) -> None:
    swapped = result["swapped_bytes"]
    assert 0 < result["swapped_blocks"] <= result["total_blocks"]
    assert swapped > 0
    # The shared mapping holds every swapped master, each block rounded up to whole pages.
    assert 0 < result["shared_bytes"] <= swapped * 1.05
    assert result["shared_bytes"] >= swapped
    assert len(result["pinned_bytes"]) == NPROC
    # CPU ranks have no NVLink: whole blocks from the host ("auto"), nothing gathered
    assert result["uploads"] == "whole"
    assert all(b > 0 for b in result["h2d_bytes"]) and result["gathered_bytes"] == [0] * NPROC


def test_it_trains_the_steps_asked(result: dict[str, Any]) -> None:
    losses = result["losses"]
    assert len(losses) == STEPS and len(result["step_seconds"]) == STEPS
    assert all(isinstance(x, float) and x == x and x > 0 for x in losses)
    assert result["median_step_seconds"] > 0 and result["samples_per_second"] > 0


def test_the_human_readable_report_names_the_ranks_and_the_replicas(
        tmp_path: Path) -> None:
    proc = torchrun(["-m", "vramkit", "demo", "--steps", str(STEPS)], cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    assert f"{NPROC} ranks" in out, out
    assert "replicas" in out and "equal on every rank" in out, out
    assert out.count("Data-parallel job") == 1, out  # rank 0 alone prints


def test_report_is_refused_under_torchrun_with_exit_code_2(tmp_path: Path) -> None:
    """What each rank does with ``--report`` under torchrun, seen through one process with
    torchrun's environment: it stops before joining the job (torchrun itself would exit 1
    with its own ChildFailedError summary)."""
    env = job_env(WORLD_SIZE=str(NPROC), RANK="0", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE=str(NPROC))
    proc = subprocess.run([sys.executable, "-m", "vramkit", "demo", "--steps", "1",
                           "--report", "x.html"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, describe(proc)
    assert "torchrun" in proc.stderr and "--report" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "x.html").exists()
    assert os.listdir(tmp_path) == []


def test_ranks_whose_plans_differ_all_run_the_slowest_on_their_own_device() -> None:
    """Calibration noise can make two GPUs plan differently; the node's ranks share one copy of
    the masters, so they must swap the same blocks."""
    import dataclasses

    from vramkit.recipes.demo import DemoConfig, plan_demo
    from vramkit.recipes.demo_ddp import agree_on_demo_plan

    base = plan_demo(DemoConfig(device="cpu", steps=1))
    # as two GPUs would plan: one keeps a block more resident, the other predicts a slower step
    planned = base.planned
    fewer = dataclasses.replace(base, planned=dataclasses.replace(
        planned, swapped=planned.swapped[:-1], resident=(*planned.swapped[-1:],
                                                         *planned.resident)),
        device="cuda:1", device_name="GPU one")
    slower = dataclasses.replace(base, planned=dataclasses.replace(
        planned, overhead_seconds=planned.overhead_seconds + 0.2), device="cuda:0",
        device_name="GPU zero")
    chosen, agree = agree_on_demo_plan([slower, fewer], fewer)
    assert not agree
    assert chosen.swapped_block_names == slower.swapped_block_names
    assert (chosen.device, chosen.device_name) == ("cuda:1", "GPU one")  # still mine
    same, agree = agree_on_demo_plan([base, base], base)
    assert agree and same is base
