"""``torchrun --nproc_per_node 2 -m vramkit demo`` on two GPUs (NCCL): each rank plans and caps its
own GPU, the frozen masters are shared, the replicas stay equal (``multigpu``: skipped without two
CUDA GPUs)."""

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


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "vramkit", "demo", "--steps", "4", "--json"],
        cwd=tmp_path_factory.mktemp("demo_nccl"), env=env, capture_output=True, text=True,
        timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


def test_two_gpus_train_their_shares_with_nccl(report: dict[str, Any]) -> None:
    assert report["world_size"] == 2 and report["backend"] == "nccl"
    assert report["devices"] == ["cuda:0", "cuda:1"]
    # Each rank plans its own GPU; timing noise may make them differ, and then every rank runs
    # the slowest plan (plans_agree says which happened). Either way the replicas are equal.
    assert isinstance(report["plans_agree"], bool)
    assert report["replicas_max_diff"] == 0
    assert len(report["losses"]) == 4


def test_each_rank_stays_under_its_budget_and_the_masters_are_shared(
        report: dict[str, Any]) -> None:
    assert report["peak_source"] == "measured" and report["under_budget"]
    assert all(0 < p <= report["plan"]["budget_bytes"] for p in report["peak_bytes"])
    assert report["swapped_bytes"] <= report["shared_bytes"] <= report["swapped_bytes"] * 1.05
    # NVLink-linked GPUs (H100s of one host): each copies its share, gathers the rest
    if report["uploads"] == "sharded":
        assert all(g > 0 for g in report["gathered_bytes"])
