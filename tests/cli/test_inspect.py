"""`vramkit inspect`: JSON and tables, shards, memory estimates, errors as exit code 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vramkit.cli import inspect as inspect_cli
from vramkit.errors import VramkitError


def run_cli(argv: list[str]) -> int:
    """Parse like `vramkit` does (the lead adds inspect to cli/main.py) and map errors to 1."""
    parser = argparse.ArgumentParser(prog="vramkit")
    inspect_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect", *argv])
    try:
        return int(args.func(args) or 0)
    except VramkitError as err:
        print(f"vramkit inspect: error: {err}", file=sys.stderr)
        return 1


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_file({"layers.0.weight": torch.zeros(128, 256, dtype=torch.bfloat16),
               "layers.0.bias": torch.zeros(128, dtype=torch.bfloat16),
               "embed": torch.zeros(64, 256, dtype=torch.float32),
               "ids": torch.zeros(10, dtype=torch.int64)}, tmp_path / "m.safetensors",
              metadata={"format": "pt"})
    return tmp_path / "m.safetensors"


def read_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert run_cli([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = read_json(capsys, str(checkpoint), "--top", "2")
    assert data["num_tensors"] == 4 and data["metadata"] == {"format": "pt"}
    # the int64 ids are not parameters: they are shown apart
    assert data["parameters"] == 128 * 256 + 128 + 64 * 256
    assert data["other"] == {"tensors": 1, "elements": 10, "bytes": 80}
    stored = 128 * 256 * 2 + 128 * 2 + 64 * 256 * 4 + 80
    assert data["total_bytes"] == stored
    assert data["dtypes"]["BF16"] == {"tensors": 2, "elements": 128 * 257, "bytes": 128 * 514}
    assert data["dtypes"]["I64"] == {"tensors": 1, "elements": 10, "bytes": 80}
    assert [t["name"] for t in data["largest"]] == ["embed", "layers.0.weight"]
    assert len(data["tensors"]) == 4
    memory = data["memory"]
    # bf16: every floating tensor at 2 bytes, int64 ids as stored
    assert memory["bf16"] == (128 * 256 + 128 + 64 * 256) * 2 + 80
    assert memory["int4"] < memory["int8"] < memory["bf16"]
    assert memory["fp8"] < memory["bf16"]
    weights = 128 * 256 + 64 * 256
    # quantized 2-D weights take about 1 byte (fp8/int8) or 0.5 byte (int4) per element
    assert weights <= memory["int8"] - (128 * 2 + 80) < weights * 1.2
    assert weights / 2 <= memory["int4"] - (128 * 2 + 80) < weights * 0.7


def test_only_weights_are_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Integer and bool tensors (position ids, masks, step counters) are not parameters; a
    # quantized weight counts its original elements once, not its packed parts and scales.
    from vramkit.quant.formats import quantize_tensor
    from vramkit.quant.serialization import save_quantized

    weight = torch.randn(64, 128)
    save_quantized({"fc.weight": quantize_tensor(weight, "int8"), "fc.bias": torch.zeros(64),
                    "position_ids": torch.arange(512), "mask": torch.ones(16, dtype=torch.bool),
                    "num_batches_tracked": torch.tensor(7)}, tmp_path / "q.safetensors")
    data = read_json(capsys, str(tmp_path / "q.safetensors"))
    assert data["parameters"] == 64 * 128 + 64
    assert data["other"] == {"tensors": 3, "elements": 512 + 16 + 1,
                             "bytes": 512 * 8 + 16 + 8}
    assert run_cli([str(tmp_path / "q.safetensors")]) == 0
    out = capsys.readouterr().out
    assert f"{64 * 128 + 64:,} parameters" in out
    assert "3 other tensors (buffers: 529 elements" in out


def test_arithmetic_ratios_without_vramkit_quant(checkpoint: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspect_cli, "_format_bytes_per_element", lambda: (None, "arithmetic"))
    report = inspect_cli.inspect_checkpoint(str(checkpoint))
    assert report["ratio_source"] == "arithmetic"
    rest = 128 * 2 + 80  # bias in bf16, ids as stored
    assert report["memory"]["fp8"] == 128 * (256 + 4) + 64 * (256 + 4) + rest
    assert report["memory"]["int8"] == 128 * (256 + 16) + 64 * (256 + 16) + rest
    assert report["memory"]["int4"] == 128 * (128 + 16) + 64 * (128 + 16) + rest


def test_table_output(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli([str(checkpoint), "--list"]) == 0
    out = capsys.readouterr().out
    for text in ("4 tensors in 1 file(s)", "BF16", "largest", "int4", "layers.0.bias", "ids"):
        assert text in out, text
    assert run_cli([str(checkpoint), "--top", "0"]) == 0
    assert "layers.0.bias" not in capsys.readouterr().out


def test_sharded_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"a": torch.zeros(4, 4)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(2)}, tmp_path / "model-00002-of-00002.safetensors")
    data = read_json(capsys, str(tmp_path))
    assert data["num_tensors"] == 2 and len(data["files"]) == 2


def test_malformed_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    assert run_cli([str(bad)]) == 1
    assert "over the 100 MB limit" in capsys.readouterr().err
    assert run_cli([str(bad), "--top", "-1"]) == 1


# -- through `vramkit` itself: errors, bad shards, metadata ----------------------------------


def run_main(argv: list[str], seconds: float = 30.0) -> int:
    """`vramkit inspect ...` through the real entry point, in a thread with a time limit (a path
    that blocks must fail the test, not hang the suite)."""
    import threading

    from vramkit.cli.main import main

    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(["inspect", *argv])),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for word in argv:  # release a reader blocked opening a FIFO
            try:
                os.close(os.open(word, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"vramkit inspect {argv} did not return within {seconds} s")
    return codes[0]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    save_file({"a": torch.zeros(4, 4)}, tmp_path / "model-00001-of-00003.safetensors")
    (tmp_path / "model-00002-of-00003.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    save_file({"b": torch.zeros(2)}, tmp_path / "model-00003-of-00003.safetensors")
    return tmp_path


def test_bad_shard_is_marked_and_the_rest_shown(shards: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([str(shards)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    out = captured.out
    assert "2 tensors in 3 file(s)" in out  # the readable shards are reported
    bad_row = next(line for line in out.splitlines() if "model-00002-of-00003" in line)
    assert "ERROR" in bad_row and "over the 100 MB limit" in bad_row
    ok_row = next(line for line in out.splitlines() if "model-00001-of-00003" in line)
    assert "ok" in ok_row and "ERROR" not in ok_row
    assert "hint:" in out
    assert "1 of 3 shard file(s) could not be read" in captured.err
    assert "model-00002-of-00003.safetensors" in captured.err


def test_bad_shard_in_json(shards: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([str(shards), "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout is one JSON document
    assert data["num_tensors"] == 2 and len(data["files"]) == 3
    assert [e["file"] for e in data["errors"]] == [
        str(shards / "model-00002-of-00003.safetensors")]
    error = data["errors"][0]
    assert "model-00002-of-00003.safetensors" in error["error"]
    assert "over the 100 MB limit" in error["error"] and error["hint"]
    assert "Traceback" not in captured.err


def test_sound_checkpoint_has_no_errors(checkpoint: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([str(checkpoint), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["errors"] == []


def test_metadata_is_shown_in_the_table(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    long_value = json.dumps({"[/bold]": 1, "tags": "x" * 400})
    path = tmp_path / "lora.safetensors"
    save_file({"lora_up.weight": torch.zeros(8, 4)}, path,
              metadata={"ss_network_dim": "16", "ss_network_alpha": "8",
                        "ss_tag_frequency": long_value, "[red]markup": "[/x] literal"})
    assert run_main([str(path)]) == 0
    out = capsys.readouterr().out
    dim_row = next(line for line in out.splitlines() if "ss_network_dim" in line)
    assert "16" in dim_row
    assert "ss_network_alpha" in out
    assert "ss_tag_frequency" in out and '{"[/bold]": 1' in out  # markup shown as text
    assert "x" * 400 not in out  # shortened...
    assert "(+" in out and "--json shows them whole" in out  # ...and said so
    assert "[red]markup" in out and "[/x] literal" in out
    assert run_main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["ss_tag_frequency"] == long_value


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def _pickle(tmp_path: Path) -> Path:
    torch.save({"w": torch.ones(2)}, tmp_path / "model.ckpt")
    return tmp_path / "model.ckpt"


def _pipeline(tmp_path: Path) -> Path:
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "transformer").mkdir()
    save_file({"w": torch.ones(1)}, tmp_path / "transformer" / "m.safetensors")
    return tmp_path


def _loop(tmp_path: Path) -> Path:
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    return tmp_path / "a"


@pytest.mark.parametrize(("make", "said", "hinted"), [
    (_fifo, "named pipe (FIFO)", "save the stream to a file"),
    (_pickle, "does not unpickle", "weights_only=True"),
    (_pipeline, "diffusers pipeline root", "transformer"),
    (_loop, "symbolic-link loop", "links"),
    (lambda tmp_path: Path("black-forest-labs/FLUX.1-dev"), "Hugging Face repo id",
     "hf download black-forest-labs/FLUX.1-dev"),
], ids=["fifo", "pickle", "pipeline-root", "symlink-loop", "repo-id"])
def test_paths_that_are_not_checkpoints(make: Any, said: str, hinted: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    path = make(tmp_path)
    assert run_main([str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert said in captured.err and "hint:" in captured.err and hinted in captured.err
    assert run_main([str(path), "--json"]) == 1
    captured = capsys.readouterr()
    error = json.loads(captured.out)
    assert said in error["error"] and hinted in error["hint"]


def test_quantized_ratios_are_what_vramkit_quant_stores() -> None:
    # The command ships these figures so that it needs neither torch nor vramkit.quant; they
    # must stay what quantizing the 16x1024 sample gives.
    from vramkit.quant.formats import quantize_tensor

    sample = torch.randn(inspect_cli._SAMPLE_SHAPE, generator=torch.Generator().manual_seed(0))
    measured = {fmt: quantize_tensor(sample, fmt).nbytes / sample.numel()
                for fmt in ("fp8", "int8", "int4")}
    assert inspect_cli.QUANTIZED_BYTES_PER_ELEMENT == measured


def _assert_inspect_imports_neither_torch_nor_vramkit_quant(path: Path) -> None:
    """``vramkit inspect path`` in a fresh interpreter loads no torch, vramkit.quant or numpy."""
    import subprocess

    script = ("import sys\n"
              "from vramkit.cli.main import main\n"
              f"code = main(['inspect', {str(path)!r}])\n"
              "loaded = [m for m in ('torch', 'vramkit.quant', 'numpy') if m in sys.modules]\n"
              "print('LOADED', loaded, code)\n")
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(src), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "LOADED [] 0" in done.stdout, (done.stdout, done.stderr)


def test_inspect_imports_neither_torch_nor_vramkit_quant(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(8, 8), "ids": torch.arange(4)}, tmp_path / "m.safetensors")
    _assert_inspect_imports_neither_torch_nor_vramkit_quant(tmp_path / "m.safetensors")


def _gguf(tmp_path: Path) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "flux1-dev-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "flux")
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("double_blocks.0.img_attn.qkv.weight", gguf.quants.quantize(weight, qtype),
                      raw_dtype=qtype)
    writer.add_tensor("double_blocks.0.img_attn.qkv.bias", np.zeros(64, dtype=np.float32))
    writer.add_array("tokens", list(range(200)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_files_show_their_types_and_layout(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    report = read_json(capsys, str(_gguf(tmp_path)))
    assert report["format"]["container"] == "gguf"
    assert report["format"]["layout"] == "flux"
    assert report["format"]["quant_types"] == {"Q8_0": 1, "F32": 1}
    assert report["dtypes"]["Q8_0"] == {"tensors": 1, "elements": 64 * 64, "bytes": 64 * 2 * 34}
    assert report["parameters"] == 64 * 64 + 64
    assert report["metadata"]["tokens"] == "<array of 200 i32>"
    assert run_cli([str(_gguf(tmp_path))]) == 0
    assert "format: gguf (Q8_0 x 1, F32 x 1), single-file FLUX layout" in capsys.readouterr().out


def test_single_file_layouts_and_fp8_scaled_are_named(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "flux1-dev-fp8.safetensors"
    prefix = "model.diffusion_model."
    save_file({f"{prefix}double_blocks.0.img_attn.qkv.weight":
               torch.zeros(6, 4, dtype=torch.float8_e4m3fn),
               f"{prefix}double_blocks.0.img_attn.qkv.scale_weight": torch.ones(()),
               "scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}, path)
    fmt = read_json(capsys, str(path))["format"]
    assert (fmt["layout"], fmt["prefix"], fmt["fp8_scaled"]) == ("flux", prefix, True)


def test_inspecting_a_gguf_file_imports_neither_torch_nor_vramkit_quant(tmp_path: Path) -> None:
    _assert_inspect_imports_neither_torch_nor_vramkit_quant(_gguf(tmp_path))
