"""`vramkit inspect`: JSON and tables, shards, memory estimates, errors as exit code 1."""

from __future__ import annotations

import argparse
import json
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
    assert data["parameters"] == 128 * 256 + 128 + 64 * 256 + 10
    stored = 128 * 256 * 2 + 128 * 2 + 64 * 256 * 4 + 80
    assert data["total_bytes"] == stored
    assert data["dtypes"]["BF16"] == {"tensors": 2, "parameters": 128 * 257, "bytes": 128 * 514}
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
