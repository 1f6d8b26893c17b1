"""``accelerate launch`` starts the same job as torchrun (it sets the same variables and runs
torchrun underneath): DDP around a swapper and sharded uploads work under it as they do under
torchrun (two CPU ranks, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed._checks import check_sharded
from tests.distributed._launch import WORKER, accelerate_launch, describe, require_gloo

pytest.importorskip("accelerate")
require_gloo()
pytestmark = pytest.mark.slow


def test_swapped_ddp_and_sharded_uploads_under_accelerate_launch(tmp_path: Path) -> None:
    proc = accelerate_launch([str(WORKER), "--out", str(tmp_path), "--scenarios",
                              "lora,sharded"], cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    ranks = {name: [json.loads((tmp_path / f"{name}-rank{r}.json").read_text())
                    for r in (0, 1)] for name in ("lora", "sharded")}
    for name, found in ranks.items():
        for r in found:
            assert "error" not in r, f"{name}: {r.get('traceback')}"
            assert r["world_size"] == 2 and r["backend"] == "gloo"
    assert [r["local_rank"] for r in ranks["lora"]] == [0, 1]
    for r in ranks["lora"]:
        assert r["ddp_type"] == "DistributedDataParallel"
        assert r["grad_diff"] <= 1e-6 and r["param_diff"] <= 1e-6
        assert r["shared_bytes"] >= r["swapped_bytes"] > 0
    check_sharded(ranks["sharded"], 2, 1e-6)
