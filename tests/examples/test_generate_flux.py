"""examples/generate_flux.py: a FluxPipeline of tiny parts on disk generates the same image with
its transformer fitted (blocks streamed through slots) as without."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.examples._load import example


def test_the_fitted_pipeline_makes_the_same_image(tiny: Path, tmp_path: Path) -> None:
    common = ["--model", str(tiny / "flux"), "--random_embeddings", "--max_sequence_length",
              "16", "--height", "32", "--width", "32", "--steps", "2", "--dtype", "fp32",
              "--cpu"]
    run = example("generate_flux").main
    fitted = run([*common, "--vram_budget", "4MiB", "--host_memory", "pageable",
                  "--output", str(tmp_path / "fitted.png")])
    reference = run([*common, "--no_fit", "--output", str(tmp_path / "reference.png")])
    assert fitted["plan"].swapped and reference["plan"] is None
    assert (tmp_path / "fitted.png").is_file()
    assert np.array_equal(np.asarray(fitted["image"]), np.asarray(reference["image"]))
