"""benchmarks/soak.py on the CPU (``--tiny``): the code paths of the GPU soak, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._benchmarks import load_benchmark


def test_the_soak_runs_tiny_on_the_cpu_flat_and_equal_to_the_resident_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    soak = load_benchmark("soak")
    threads = torch.get_num_threads()
    try:
        result = soak.main(["--device", "cpu", "--tiny", "--steps", "30", "--out",
                            str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert result["config"]["swapped_blocks"] > 0  # the budget forces swapping
    assert result["losses_equal"] and result["max_loss_difference"] == 0.0
    assert set(result["losses"]) == {"1", "15", "30"}
    assert result["checkpoint_saves"] == 3
    slopes = result["slopes"]
    assert set(slopes) == set(soak.SERIES)
    assert slopes["pinned"]["verdict"] == "flat" and slopes["pinned"]["bytes_per_step"] == 0
    assert all(s["verdict"] == "flat" for s in slopes.values()), slopes
    saved = torch.load(tmp_path / "soak_checkpoint.pt", weights_only=True)
    assert saved["step"] == 30 and saved["adapters"] and saved["optimizer"]["state"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "soak.json", "soak.md", "soak_checkpoint.pt"]  # no temporary left behind
