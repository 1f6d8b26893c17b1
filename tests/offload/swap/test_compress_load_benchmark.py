"""benchmarks/compress_load.py on the CPU (``--tiny``): its three arms end to end."""

from __future__ import annotations

from pathlib import Path

from tests._benchmarks import load_benchmark


def test_the_compressed_load_benchmark_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    bench = load_benchmark("compress_load")
    result = bench.main(["--tiny", "--rounds", "1", "--workdir", str(tmp_path / "work"),
                         "--out", str(tmp_path / "out")])
    arms = result["arms"]
    assert arms["bg"]["compressed_blocks"] == arms["fg"]["compressed_blocks"] == 4
    assert arms["raw"]["compressed_blocks"] == 0
    assert result["losses_identical"]
    assert result["first_step_bg_over_fg"] > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "compress_load.json", "compress_load.md"]
