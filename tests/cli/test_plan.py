"""`vramkit plan`: presets and local folders planned offline, tables and JSON, flag errors as
exit code 2, an impossible budget as exit code 1 with the minimum and the flag to try."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli._helpers import check_error, run_vramkit
from vramkit.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("peft")

GiB = 1 << 30

# A Llama small enough to trace in a fraction of a second, written as a transformers folder.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 6, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON document on stdout


def test_a_local_folder_plans_offline_as_json(llama_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
                 "--seq-len", "512")
    assert data["mode"] == "train" and "LoRA r16" in data["trainable"]
    assert "512" in data["shapes"]
    plan = data["plan"]
    assert plan["machine"] == "rtx4090" and plan["budget_bytes"] == 8 * GiB
    assert plan["swapped"] == [] and len(plan["resident"]) == 6  # everything fits
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"] - plan["headroom_bytes"]
    assert plan["predicted_step_seconds"] > 0
    assert data["note"] is None  # the hardware was named


def test_a_tight_budget_swaps_and_the_table_explains_it(llama_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import vramkit
    from vramkit.errors import PlanError
    from vramkit.recipes.targets import build_target

    target = build_target(llama_dir, seq_len=512)
    with pytest.raises(PlanError) as info:
        vramkit.plan(target.model, target.inputs, 1, step=target.step, autocast=None,
                     hardware="l4", headroom=0)
    minimum = info.value.minimum_budget
    assert minimum is not None
    code = main(["plan", str(llama_dir), "--budget", str(minimum), "--headroom", "0",
                 "--hardware", "l4", "--seq-len", "512", "--blocks"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on l4" in out and "predicted step" in out and "Predicted peak" in out
    assert "Trains: LoRA r16" in out
    assert "model.layers.5" in out  # --blocks lists every block
    data = _json(capsys, str(llama_dir), "--budget", str(minimum), "--headroom", "0",
                 "--hardware", "l4", "--seq-len", "512")
    assert data["plan"]["swapped"]  # the smallest budget that works swaps blocks
    assert data["plan"]["predicted_peak_bytes"] <= minimum
    placements = [line.split()[3] for line in out.splitlines()
                  if line.startswith("│ model.layers.")]
    assert len(placements) == 6 and "swapped" in placements
    # Pageable masters: priced through the staging pool, and said so.
    assert main(["plan", str(llama_dir), "--budget", str(minimum), "--headroom", "0",
                 "--hardware", "l4", "--seq-len", "512", "--host-memory", "pageable",
                 "--staging-pool", "256MiB"]) == 0
    out = capsys.readouterr().out
    assert "pageable host memory, copied through a" in out and "pinned staging pool" in out
    data = _json(capsys, str(llama_dir), "--budget", str(minimum), "--headroom", "0",
                 "--hardware", "l4", "--seq-len", "512")
    assert data["plan"]["host_memory"] == "pinned"  # auto, offline, not on Windows/WSL
    # Full fine-tuning: every parameter trains, so no block has frozen weights to swap.
    assert main(["plan", str(llama_dir), "--budget", "8GiB", "--hardware", "l4",
                 "--lora-rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "Trains: all" in out and "full fine-tuning" in out
    # The 1-byte budget of the CLI: a plan error with the minimum, not a headroom complaint.
    code = main(["plan", str(llama_dir), "--budget", "1", "--hardware", "rtx4090", "--json"])
    error = json.loads(capsys.readouterr().out)
    assert code == 1 and "needs a budget of" in error["error"]


def test_without_a_gpu_the_plan_says_which_gpu_it_assumed(
        llama_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from vramkit.cli import plan as plan_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = _json(capsys, str(llama_dir), "--budget", "8GiB")
    assert data["plan"]["machine"] == plan_cli.DEFAULT_OFFLINE_HARDWARE
    assert plan_cli.DEFAULT_OFFLINE_HARDWARE in data["note"]


def test_an_impossible_budget_names_the_minimum_and_the_flag(
        llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", str(llama_dir), "--budget", "64MiB", "--hardware", "rtx4090"])
    captured = capsys.readouterr()
    text = check_error(code, captured.out, captured.err, sub="plan", exit_code=1,
                       says=("needs a budget of", "--allow fp8"))
    assert "allow_formats" not in text
    # With both packed formats allowed, the minimum falls and no format is left to suggest.
    code = main(["plan", str(llama_dir), "--budget", "64MiB", "--hardware", "rtx4090",
                 "--allow", "fp8,nf4", "--json"])
    captured = capsys.readouterr()
    packed = check_error(code, captured.out, captured.err, sub="plan", exit_code=1,
                         as_json=True, says=("needs a budget of", "smaller batch"),
                         not_says=("--allow",))
    assert packed


@pytest.mark.parametrize(("argv", "says"), [
    ([], ("MODEL is missing", "vramkit plan --list")),
    (["sdxl"], ("--budget is missing",)),
    (["sdxl", "--budget", "lots"], ("--budget",)),
    (["sdxl", "--budget", "12GiB", "--allow", "fp9"], ("--allow", "fp8")),
    (["sdxl", "--budget", "12GiB", "--lora-rank", "x"], ("--lora-rank", "16")),
    (["sdxl", "--budget", "12GiB", "--batch", "0"], ("--batch",)),
    (["sdxl", "--budget", "12GiB", "--hardware", "rtx9999"], ("rtx9999",)),
    (["sdxl", "--budget", "12GiB", "--headroom", "much"], ("--headroom",)),
    (["no-such-model", "--budget", "12GiB"], ("no-such-model", "flux-dev")),
    (["sdxl", "--budget", "12GiB", "--disk-speed", "fast"], ("--disk-speed", "GB/s")),
    (["sdxl", "--budget", "12GiB", "--disk-speed", "0"], ("--disk-speed", "> 0")),
    (["sdxl", "--budget", "12GiB", "--checkpointing", "some"], ("--checkpointing", "all")),
    (["sdxl", "--budget", "12GiB", "--mode", "infer", "--checkpointing", "all"],
     ("--checkpointing all applies to training",)),
])
def test_flag_errors_exit_2(argv: list[str], says: tuple[str, ...],
                            capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=2, says=says)
    code = main(["plan", *argv, "--json"])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=2, as_json=True,
                says=says)


def test_list_names_the_presets_and_the_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--list")
    assert {"flux-dev", "sdxl", "sd3.5-large", "qwen-image", "wan2.1-14b",
            "llama-3.1-8b"} <= set(data["models"])
    assert {"rtx3090", "rtx4090", "h100-pcie", "l4"} <= set(data["hardware"])
    assert main(["plan", "--list"]) == 0
    assert "llama-3.1-8b" in capsys.readouterr().out


@pytest.mark.slow
def test_the_readme_command_plans_flux_dev_on_a_cpu_machine() -> None:
    pytest.importorskip("diffusers")
    done = run_vramkit("plan", "flux-dev", "--budget", "12GiB", "--json",
                       env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    plan = data["plan"]
    assert len(plan["block_order"]) == 57  # 19 double + 38 single blocks
    assert plan["swapped"] and plan["checkpointed"]
    assert plan["predicted_peak_bytes"] <= 12 * GiB - plan["headroom_bytes"]
    assert "planned offline" in data["note"]


def test_a_host_budget_below_the_masters_keeps_blocks_on_disk(
        llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--host-budget plans the swapper's disk tier, its reads at --disk-speed."""
    common = [str(llama_dir), "--hardware", "l4", "--seq-len", "512", "--headroom", "0"]
    import vramkit
    from vramkit.errors import PlanError
    from vramkit.recipes.targets import build_target

    target = build_target(llama_dir, seq_len=512)
    with pytest.raises(PlanError) as info:
        vramkit.plan(target.model, target.inputs, 1, step=target.step, autocast=None,
                     hardware="l4", headroom=0)
    budget = str(info.value.minimum_budget)
    in_ram = _json(capsys, *common, "--budget", budget)["plan"]
    assert in_ram["swapped"] and in_ram["disk_blocks"] == []
    host = str(in_ram["host_bytes"] // 2)
    data = _json(capsys, *common, "--budget", budget, "--host-budget", host,
                 "--disk-speed", "0.5")["plan"]
    assert data["disk_blocks"] and data["host_bytes"] <= int(host)
    assert data["disk_bytes_per_s"] == 0.5e9
    assert data["predicted_step_seconds"] > in_ram["predicted_step_seconds"]
    assert main(["plan", *common, "--budget", budget, "--host-budget", host]) == 0
    out = capsys.readouterr().out
    assert "on disk" in out and "assumed at 1.0 GB/s" in out


def test_ddp_plans_one_rank_with_the_gradient_buckets_kept_free(
        llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.distributed import ddp_bucket_bytes
    from vramkit.recipes.targets import build_target

    common = [str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090", "--seq-len", "512"]
    alone = _json(capsys, *common)
    rank = _json(capsys, *common, "--ddp")
    buckets = ddp_bucket_bytes(build_target(llama_dir, seq_len=512).model)
    assert buckets > 0
    assert rank["plan"]["headroom_bytes"] == alone["plan"]["headroom_bytes"] + buckets
    assert "DDP" in rank["note"] and alone["note"] is None


def test_checkpointing_all_or_none_as_asked(llama_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    common = (str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090", "--seq-len", "512")
    auto = _json(capsys, *common)["plan"]
    assert auto["checkpointing"] == "auto" and auto["checkpointed"] == []  # everything fits
    every = _json(capsys, *common, "--checkpointing", "all")["plan"]
    assert every["checkpointing"] == "all" and every["checkpointed"] == every["block_order"]
    assert every["predicted_step_seconds"] > auto["predicted_step_seconds"]  # recomputation
    # A budget that needs checkpointing: none cannot fit, and the error says what would.
    tight = (str(llama_dir), "--budget", "400MiB", "--hardware", "rtx4090")
    assert _json(capsys, *tight)["plan"]["checkpointed"]  # auto fits by checkpointing
    code = main(["plan", *tight, "--checkpointing", "none"])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=1,
                says=("no block checkpointed, as asked", "--checkpointing auto"))


def test_flux_inference_at_diffusers_peak_splits_its_blocks(
        capsys: pytest.CaptureFixture[str]) -> None:
    """2 GiB: whole 648 MiB double blocks leave one slot; their children swap through three."""
    pytest.importorskip("diffusers")
    argv = ["flux-dev", "--mode", "infer", "--budget", "2GiB", "--hardware", "h200"]
    plan = _json(capsys, *argv)["plan"]
    assert plan["split"] is True
    assert len(plan["block_order"]) == 247  # 19 x 5 + 38 x 4 children
    assert "transformer_blocks.0.attn" in plan["block_order"]
    assert plan["num_slots"] >= 2
    assert plan["predicted_peak_bytes"] <= 2 * GiB - plan["headroom_bytes"]
    assert main(["plan", *argv]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "units (blocks split)" in out and "Blocks split into their children" in out


def test_an_impossible_budget_gives_the_minimum_as_a_number_in_json(
        llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.units import parse_size

    code = main(["plan", str(llama_dir), "--budget", "64MiB", "--hardware", "rtx4090",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    minimum = data["minimum_budget_bytes"]
    assert isinstance(minimum, int) and minimum > 64 << 20
    # just below it: the two sizes the message prints differ, the minimum rounded up
    code = main(["plan", str(llama_dir), "--budget", str(minimum - 1), "--hardware", "rtx4090"])
    err = capsys.readouterr().err
    assert code == 1
    budget_text = err.split("a budget of ", 1)[1].split(" cannot", 1)[0]
    need_text = err.split("needs a budget of ", 1)[1].split(" (", 1)[0]
    assert budget_text != need_text
    assert parse_size(need_text.replace(" ", "")) >= minimum


@pytest.mark.parametrize("text", ["2", "8", "1.5"])
def test_a_bare_headroom_number_of_one_or_more_is_refused_by_the_cli(
        text: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "sdxl", "--budget", "12GiB", "--hardware", "rtx4090",
                 "--headroom", text])
    err = capsys.readouterr().err
    assert code == 2 and "--headroom" in err and "GiB" in err, err


def test_a_budget_above_the_named_gpu_memory_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "sdxl", "--budget", "48GiB", "--hardware", "rtx4090"])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=2,
                says=("--budget", "48.0 GiB", "24.0 GiB", "rtx4090"))


def test_save_writes_the_plan_printed_and_the_fit_call_applies_it(
        llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.planning.record import Plan

    path = tmp_path / "llama.plan.json"
    data = _json(capsys, str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
                 "--seq-len", "512", "--allow", "fp8", "--save", str(path))
    assert data["saved"] == str(path)
    assert Plan.load(path) == Plan.from_dict(data["plan"])  # the file is the plan printed
    assert data["fit_call"] == f'vramkit.fit(model, inputs, "8GiB", plan="{path}")'
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, renamed
    # the text names the call; without --save, the options that plan the same way
    assert main(["plan", str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
                 "--seq-len", "512", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert f'vramkit.fit(model, inputs, "8GiB", plan="{path}")' in out and str(path) in out
    data = _json(capsys, str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
                 "--seq-len", "512", "--mode", "infer", "--allow", "fp8,nf4",
                 "--headroom", "0.1")
    assert data["saved"] is None
    assert data["fit_call"] == ('vramkit.fit(model, inputs, "8GiB", mode="infer", '
                                "allow_formats=('fp8', 'nf4'), headroom=0.1)")


def test_save_to_a_folder_that_does_not_exist_is_a_usage_error(
        llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
                 "--save", str(tmp_path / "missing" / "plan.json")])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=2, says=("--save",))


def test_allow_takes_the_w8a8_formats(llama_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, str(llama_dir), "--budget", "8GiB", "--hardware", "rtx3090",
                 "--seq-len", "512", "--allow", "int8-w8a8,fp8-w8a8")
    plan = data["plan"]
    assert {plan["swapped_format"], plan["resident_format"]} <= {"bf16", "int8-w8a8"}
    # the RTX 3090 has no fp8 tensor cores: the format is not offered, and the plan says so
    assert any(note.startswith("fp8-w8a8 is not offered") for note in plan["notes"])


@pytest.mark.parametrize(("argv", "says"), [
    (["flux-dev", "--frames", "9"], ("flux-dev is an image model: --frames does not apply",)),
    (["llama-3.1-8b", "--resolution", "512"], ("language model: --resolution does not apply",)),
    (["flux-dev", "--resolution", "1000"], ("multiples of 16", "992x992")),
    (["wan2.1-14b", "--frames", "80"], ("4k+1 frames", "77 frames")),
])
def test_options_the_model_does_not_take_are_usage_errors_before_it_is_built(
        argv: list[str], says: tuple[str, ...], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The README promises flags are checked before any work: these waited 5-11 s of building.
    from vramkit.recipes import targets

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before its flags were checked")

    monkeypatch.setattr(targets, "_build", no_build)
    for as_json in (False, True):
        code = main(["plan", *argv, "--budget", "24GiB", *(["--json"] if as_json else [])])
        captured = capsys.readouterr()
        text = check_error(code, captured.out, captured.err, sub="plan", exit_code=2,
                           as_json=as_json, says=says)
        if not as_json:
            assert len([li for li in captured.err.splitlines() if ": error: " in li]) == 1
            assert text.splitlines()[0].count("error") == 1


def test_compress_off_reaches_the_planner(llama_dir: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--compress (default auto, as vramkit.plan's) is passed on; a bad value is a flag error."""
    from vramkit.planning import api

    seen: list[object] = []
    real = api.plan
    monkeypatch.setattr(api, "plan", lambda *a, **kw: seen.append(kw.get("compress"))
                        or real(*a, **kw))
    for extra in ([], ["--compress", "off"]):
        _json(capsys, str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
              "--seq-len", "512", *extra)
    assert seen == ["auto", "off"]
    assert main(["plan", str(llama_dir), "--budget", "8GiB", "--compress", "on"]) == 2
    assert "--compress" in capsys.readouterr().err


def test_subblock_reaches_the_planner_and_the_fit_call(
        llama_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--subblock auto|on|off (default auto, as vramkit.plan's subblock_checkpoint) is passed
    on, said by the fit call and the table; on with --mode infer is a flag error."""
    from vramkit.planning import api

    seen: list[object] = []
    real = api.plan
    monkeypatch.setattr(api, "plan", lambda *a, **kw: seen.append(
        kw.get("subblock_checkpoint")) or real(*a, **kw))
    calls = []
    for extra in ([], ["--subblock", "on"], ["--subblock", "off"]):
        data = _json(capsys, str(llama_dir), "--budget", "8GiB", "--hardware", "rtx4090",
                     "--seq-len", "512", *extra)
        calls.append(data["fit_call"])
        assert data["plan"]["subblock_checkpoint"] is (extra[1:] == ["on"])
    assert seen == ["auto", True, False]
    assert "subblock" not in calls[0]
    assert calls[1].endswith("subblock_checkpoint=True)")
    assert calls[2].endswith("subblock_checkpoint=False)")
    assert main(["plan", str(llama_dir), "--budget", "8GiB", "--subblock", "yes"]) == 2
    assert main(["plan", str(llama_dir), "--budget", "8GiB", "--mode", "infer",
                 "--subblock", "on"]) == 2
    assert "--subblock on applies to training" in capsys.readouterr().err


def test_full_fine_tuning_plans_with_trainable_swap_and_the_optimizers_state(
        llama_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--lora-rank 0 --trainable swap plans full fine-tuning with the swapped blocks' state in
    host memory, priced at --optimizer-state-bytes; the fit call names the factory it needs."""
    from vramkit.planning import api

    seen: list[tuple[object, object]] = []
    real = api.plan
    monkeypatch.setattr(api, "plan", lambda *a, **kw: seen.append(
        (kw.get("trainable"), kw.get("optimizer_state_bytes"))) or real(*a, **kw))
    common = [str(llama_dir), "--lora-rank", "0", "--budget", "320MiB", "--hardware",
              "rtx4090", "--seq-len", "512", "--trainable", "swap"]
    adamw = _json(capsys, *common)
    eight_bit = _json(capsys, *common, "--optimizer-state-bytes", "2")
    assert seen == [("swap", None), ("swap", 2.0)]
    for data, per_param in ((adamw, 8.0), (eight_bit, 2.0)):
        plan = data["plan"]
        assert plan["trainable"] == "swap" and plan["swapped"]
        assert plan["optimizer_state_bytes"] == per_param
        masters = plan["host_breakdown"]["masters"]  # bf16 weights: 2 bytes a parameter
        assert plan["host_breakdown"]["optimizer_state"] == pytest.approx(
            masters / 2 * per_param, rel=0.01)
        assert data["fit_call"].endswith('trainable="swap", optimizer=make_optimizer)')
    # a saved plan's call still hands fit the factory
    saved = llama_dir / "ft.json"
    data = _json(capsys, *common, "--save", str(saved))
    assert data["fit_call"].endswith(f"plan={json.dumps(str(saved))}, optimizer=make_optimizer)")


def test_full_fine_tuning_that_does_not_fit_resident_names_trainable_swap(
        llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", str(llama_dir), "--lora-rank", "0", "--budget", "320MiB",
                 "--hardware", "rtx4090", "--seq-len", "512"])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=1,
                says=("needs a budget of", "--trainable swap", "--optimizer-state-bytes 2"))
    # LoRA's own miss says nothing of full fine-tuning
    code = main(["plan", str(llama_dir), "--budget", "64MiB", "--hardware", "rtx4090"])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=1,
                says=("needs a budget of",), not_says=("--trainable",))


@pytest.mark.parametrize(("argv", "says"), [
    (["--trainable", "cpu"], ("--trainable", "resident")),
    (["--optimizer-state-bytes", "two"], ("--optimizer-state-bytes", "AdamW8bit")),
    (["--optimizer-state-bytes", "0"], ("--optimizer-state-bytes", "> 0")),
    (["--optimizer-state-bytes", "inf"], ("--optimizer-state-bytes", "> 0")),
    (["--mode", "infer", "--trainable", "swap"], ("--trainable swap applies to training",)),
    (["--mode", "infer", "--optimizer-state-bytes", "2"],
     ("--optimizer-state-bytes applies to training",)),
])
def test_full_fine_tuning_flag_errors_exit_2(argv: list[str], says: tuple[str, ...],
                                             llama_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", str(llama_dir), "--budget", "8GiB", *argv])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="plan", exit_code=2, says=says)
