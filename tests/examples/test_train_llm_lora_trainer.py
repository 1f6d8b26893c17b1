"""examples/train_llm_lora_trainer.py: a Trainer LoRA fine-tune of a tiny Llama fitted under a
budget (blocks swapped), its checkpoints resumed by the Trainer."""

from __future__ import annotations

import math
from pathlib import Path

from tests.examples._load import example


def _run(tiny: Path, out: Path, *extra: str) -> dict:
    llama = tiny / "llama"
    return example("train_llm_lora_trainer").main([
        "--model", str(llama), "--train_file", str(llama / "train.txt"), "--output_dir",
        str(out), "--seq_len", "64", "--vram_budget", "2200KiB", "--cpu", *extra])


def test_trainer_fine_tunes_a_fitted_model_and_resumes(tiny: Path, tmp_path: Path) -> None:
    first = _run(tiny, tmp_path, "--max_steps", "2", "--save_steps", "2")
    assert first["plan"].swapped and first["global_step"] == 2
    assert all(math.isfinite(loss) for loss in first["losses"])
    assert (tmp_path / "adapter_model.safetensors").is_file()
    assert (tmp_path / "checkpoint-2").is_dir()
    resumed = _run(tiny, tmp_path, "--max_steps", "3", "--save_steps", "10",
                   "--resume_from_checkpoint", "latest", "--host_memory", "pageable")
    assert resumed["global_step"] == 3 and resumed["plan"].host_memory == "pageable"
