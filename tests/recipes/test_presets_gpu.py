"""On a GPU: the tightest presets (8 GB) train SDXL and FLUX.1-dev at full size, 1024x1024, under
an 8 GB card's memory cap (``set_per_process_memory_fraction`` at 7.5 GiB).

Each runs one row of benchmarks/presets.py in its own process (the cap is per process); the
full table of tiers is the benchmark's job (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "presets.py"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("model", ["sdxl", "flux"])
def test_8gb_preset_trains_under_an_8gb_cap(model: str, tmp_path: Path) -> None:
    result = tmp_path / "row.json"
    subprocess.run([sys.executable, str(SCRIPT), "--row", f"{model}:8", "--result-file",
                    str(result), "--device", "cuda", "--steps", "2"], check=True, timeout=600)
    row = json.loads(result.read_text())
    assert row["status"] == "ok", row.get("error")
    assert row["cap_gib"] == 7.5 and row["peak_reserved_gib"] <= row["cap_gib"]
    assert len(row["loss"]) == 2
