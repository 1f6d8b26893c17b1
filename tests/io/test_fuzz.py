"""Fuzzing the reader: any mutation of a valid file either loads or is a SafetensorsFormatError."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from vramkit.errors import SafetensorsFormatError
from vramkit.io.lazy import LazySafetensors

SRC = Path(__file__).resolve().parents[2] / "src"


def valid_file() -> bytes:
    torch.manual_seed(0)
    return save({"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int16),
                 "c": torch.ones(2, dtype=torch.bfloat16), "d": torch.zeros(0)},
                metadata={"k": "v"})


VALID = valid_file()


def load_everything(data: bytes) -> None:
    """Open and read every tensor and a slice; only SafetensorsFormatError may escape."""
    with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as handle:
        handle.write(data)
    try:
        for use_mmap in (True, False):
            try:
                with LazySafetensors.open(handle.name, use_mmap=use_mmap) as checkpoint:
                    for name in checkpoint.tensor_names():
                        tensor = checkpoint.load_tensor(name)
                        assert tensor.shape == checkpoint.shape(name)
                        if tensor.dim() and tensor.shape[0]:
                            checkpoint.load_tensor(name, slice(0, 1))
            except SafetensorsFormatError as err:
                assert err.path is not None and err.hint
    finally:
        os.unlink(handle.name)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=6))
def test_flipped_bytes(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    load_everything(bytes(data))


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, len(VALID)))
def test_truncations(cut: int) -> None:
    load_everything(VALID[:cut])


HEADER_LENGTH = struct.unpack("<Q", VALID[:8])[0]
HEADER = json.loads(VALID[8:8 + HEADER_LENGTH])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6)


@settings(max_examples=80, deadline=None)
@given(tensor=st.sampled_from(sorted(HEADER)), field=st.sampled_from(
    ["dtype", "shape", "data_offsets", "extra"]), value=json_values,
    extra_data=st.binary(max_size=8), length_delta=st.integers(-3, 3))
def test_header_edits(tensor: str, field: str, value: object, extra_data: bytes,
                      length_delta: int) -> None:
    header = json.loads(json.dumps(HEADER))
    if isinstance(header[tensor], dict):
        header[tensor][field] = value
    body = json.dumps(header).encode()
    data = VALID[8 + HEADER_LENGTH:] + extra_data
    load_everything(struct.pack("<Q", max(0, len(body) + length_delta)) + body + data)


@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=64))
def test_random_bytes(data: bytes) -> None:
    load_everything(data)


ATHERIS_TARGET = r'''
import os, sys, tempfile
import atheris
import torch  # imported first so that only vramkit's reader is instrumented (torch is huge)
import vramkit.errors, vramkit.memory, vramkit.units  # noqa: F401
with atheris.instrument_imports(include=["vramkit.io"]):
    from vramkit.errors import SafetensorsFormatError
    from vramkit.io.lazy import LazySafetensors

def one_input(data: bytes) -> None:
    fd, name = tempfile.mkstemp(suffix=".safetensors")
    os.write(fd, data)
    os.close(fd)
    try:
        with LazySafetensors.open(name) as checkpoint:
            for tensor in checkpoint.tensor_names():
                checkpoint.load_tensor(tensor)
    except SafetensorsFormatError:
        pass
    finally:
        os.unlink(name)

atheris.Setup(sys.argv, one_input)
atheris.Fuzz()
'''


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_atheris_fuzz(tmp_path: Path) -> None:
    target = tmp_path / "fuzz_safetensors.py"
    target.write_text(ATHERIS_TARGET)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "valid").write_bytes(VALID)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, str(target), "-runs=3000", "-max_total_time=20",
                             "-max_len=2048", str(corpus)], capture_output=True, text=True,
                            env=env, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done" in result.stderr and "Instrumenting vramkit.io._header" in result.stderr
