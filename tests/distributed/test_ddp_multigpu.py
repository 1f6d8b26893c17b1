"""The distributed scenarios of ``_worker.py`` on two GPUs with NCCL (``multigpu``: skipped
without two CUDA GPUs; run on a multi-GPU machine with ``pytest -m multigpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multigpu

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("lora", "plain_ddp", "full_cpu", "full_swap", "pss", "accumulate_cpu",
             "accumulate_swap", "sharded", "sharded_compressed")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("nccl")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "tests" / "distributed" / "_worker.py"), "--out", str(out),
         "--scenarios", ",".join(SCENARIOS)],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {s: [json.loads((out / f"{s}-rank{r}.json").read_text()) for r in (0, 1)]
             for s in SCENARIOS}
    for name, ranks in found.items():
        for r in ranks:
            assert "error" not in r, f"{name}: {r.get('traceback')}"
    return found


def test_nccl_backend_on_two_gpus(results: dict[str, list[dict[str, Any]]]) -> None:
    assert {r["backend"] for r in results["lora"]} == {"nccl"}


@pytest.mark.parametrize("scenario", ["lora", "plain_ddp"])
def test_gradients_equal_one_process_on_the_whole_batch(
        results: dict[str, list[dict[str, Any]]], scenario: str) -> None:
    for r in results[scenario]:
        assert r["grad_diff"] <= 1e-6


@pytest.mark.parametrize("scenario", ["lora", "full_cpu", "full_swap", "accumulate_cpu",
                                      "accumulate_swap"])
def test_parameters_after_three_steps_equal_one_process(
        results: dict[str, list[dict[str, Any]]], scenario: str) -> None:
    for r in results[scenario]:
        assert r["param_diff"] <= 1e-5  # AdamW on GPU grads reduced by NCCL vs one process


def test_frozen_masters_shared_once_per_node(results: dict[str, list[dict[str, Any]]]) -> None:
    lora = results["lora"][0]
    assert lora["swapped_bytes"] <= lora["shared_bytes"] <= lora["swapped_bytes"] * 1.1
    pss = results["pss"]
    if pss[0]["shared_pss_delta"] is None:
        pytest.skip("no /proc smaps_rollup")
    swapped = pss[0]["shared_swapped_bytes"]
    shared = sum(r["shared_pss_delta"] for r in pss)
    per_rank = sum(r["per_rank_pss_delta"] for r in pss)
    assert shared <= 1.3 * swapped < per_rank
    assert pss[0]["shared_out"] == pss[0]["per_rank_out"]


def test_sharded_uploads_all_gather_over_nccl_and_train_exactly(
        results: dict[str, list[dict[str, Any]]]) -> None:
    """uploads='sharded' on two GPUs: each copies half of a block from the host and NCCL
    all-gathers the rest into its slot; rank 0's local_calls() between steps leaves the
    ranks' collective loads matched."""
    from tests.distributed._checks import check_sharded

    check_sharded(results["sharded"], 2, 1e-5)  # AdamW on NCCL-reduced grads, as above


def test_sharded_uploads_of_compressed_masters_decode_on_each_gpu_and_train_exactly(
        results: dict[str, list[dict[str, Any]]]) -> None:
    """compress="on" beside uploads='sharded' on two GPUs: each rank copies its piece of a
    compressed payload, NCCL gathers the rest, each GPU decodes; training equals one process."""
    from tests.distributed._checks import check_sharded_compressed

    check_sharded_compressed(results["sharded_compressed"], 2, 1e-5)
