"""examples/train_flux_lora.py on a tiny FLUX written to disk: trains under swapping, saves and
resumes its state, reads a single-file transformer, and reports the time to the first step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples._load import example

# --cpu: the tiny budgets are for the CPU, which keeps no headroom for a GPU's allocator
COMMON = ["--cpu", "--random_embeddings", "--max_sequence_length", "16", "--resolution", "32",
          "--mixed_precision", "no", "--vram_budget", "6MiB", "--rank", "4"]


def _run(tiny: Path, out: Path, *extra: str) -> dict:
    return example("train_flux_lora").main([
        "--pretrained_model_name_or_path", str(tiny / "flux"),
        "--instance_data_dir", str(tiny / "images"), "--output_dir", str(out), *COMMON, *extra])


def test_trains_under_swapping_saves_and_resumes(tiny: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    first = _run(tiny, tmp_path, "--max_train_steps", "2", "--checkpointing_steps", "2",
                 "--host_memory", "pageable")
    assert first["plan"].swapped and first["plan"].host_memory == "pageable"
    assert first["global_step"] == 2 and len(first["losses"]) == 2
    assert (tmp_path / "checkpoint-2").is_dir()
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    out = capsys.readouterr().out
    assert "time from command to first step:" in out and first["first_step_seconds"] > 0
    resumed = _run(tiny, tmp_path, "--max_train_steps", "3", "--resume_from_checkpoint",
                   "latest")
    assert resumed["global_step"] == 3 and len(resumed["losses"]) == 1
    assert "resumed from checkpoint-2 (step 2)" in capsys.readouterr().out


def test_reads_the_transformer_from_one_file_with_a_saved_plan(tiny: Path,
                                                              tmp_path: Path) -> None:
    file = str(tiny / "flux" / "flux-transformer.safetensors")
    plan_file = tmp_path / "plan.json"
    first = _run(tiny, tmp_path / "a", "--max_train_steps", "1", "--transformer_file", file,
                 "--plan_file", str(plan_file))
    assert first["global_step"] == 1 and first["plan"].swapped and plan_file.is_file()
    again = _run(tiny, tmp_path / "b", "--max_train_steps", "1", "--transformer_file", file,
                 "--plan_file", str(plan_file))  # applied as saved, not planned again
    assert again["plan"] == first["plan"]


def test_a_missing_file_or_embeddings_is_a_clear_exit(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not a file"):
        _run(tiny, tmp_path, "--transformer_file", str(tmp_path / "nope.safetensors"))
    with pytest.raises(SystemExit, match="--embeddings_file"):
        example("train_flux_lora").main([
            "--pretrained_model_name_or_path", str(tiny / "flux"),
            "--instance_data_dir", str(tiny / "images"), "--output_dir", str(tmp_path),
            "--resolution", "32", "--mixed_precision", "no", "--cpu"])


def test_the_weights_start_streaming_before_the_heavy_imports(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Run as a script, it starts the transformer's prefetch from its arguments alone (the
    single file, else the folder's transformer/); a malformed command prefetches nothing."""
    module = example("train_flux_lora")
    asked: list[object] = []
    monkeypatch.setattr(module, "prefetch_checkpoint", asked.append)
    module._prefetch_from_argv(["--pretrained_model_name_or_path", "/m", "--transformer_file",
                                str(tmp_path / "t.safetensors"), "--rank", "4"])
    module._prefetch_from_argv(["--pretrained_model_name_or_path=/m", "--cpu"])
    module._prefetch_from_argv(["--transformer_file"])
    assert asked == [str(tmp_path / "t.safetensors"), Path("/m") / "transformer"]


def _original_state(tiny: Path) -> dict:
    """The tiny transformer's weights in Black Forest Labs' own layout (as single files are)."""
    from safetensors.torch import load_file

    from tests.io._single_files import to_original

    state = load_file(str(tiny / "flux" / "flux-transformer.safetensors"))
    return to_original("flux", state)


@pytest.mark.parametrize("kind", ["gguf", "fp8_scaled"])
def test_trains_lora_on_a_gguf_or_fp8_scaled_single_file(kind: str, tiny: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """The files inference tools made popular: a GGUF (Q8_0) and a ComfyUI fp8_scaled
    transformer, their weights kept packed as stored, LoRA on top; finite losses that move."""
    import torch

    state = _original_state(tiny)
    if kind == "gguf":
        pytest.importorskip("gguf")
        from tests.io._single_files import write_gguf

        file = tmp_path / "flux-Q8_0.gguf"
        write_gguf(str(file), state, {n: "Q8_0" for n, t in state.items()
                                      if n.endswith(".weight") and t.dim() == 2
                                      and t.shape[1] % 32 == 0})
        says = "Q8_0 x"
    else:
        from safetensors.torch import save_file

        fp8 = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
        for name, t in state.items():
            if name.endswith(".weight") and t.dim() == 2:
                scale = t.abs().max().float() / 448
                fp8[name] = (t.float() / scale).to(torch.float8_e4m3fn)
                fp8[name.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
            else:
                fp8[name] = t
        file = tmp_path / "flux-fp8_scaled.safetensors"
        save_file(fp8, str(file))
        says = "fp8_scaled"
    result = _run(tiny, tmp_path / "out", "--max_train_steps", "3", "--transformer_file",
                  str(file))
    assert says in capsys.readouterr().out
    losses = result["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()


def test_a_file_that_is_no_checkpoint_is_a_clear_exit(tiny: Path, tmp_path: Path) -> None:
    junk = tmp_path / "notes.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(SystemExit, match="cannot be read as a checkpoint"):
        _run(tiny, tmp_path / "out", "--transformer_file", str(junk))
