"""GGUF headers: parsed as the gguf package reads them, written back by write_gguf, and every
damaged file an error naming what is wrong (never another exception, never a hang)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramkit.errors import SafetensorsFormatError
from vramkit.io._gguf_file import read_gguf_header, write_gguf

gguf = pytest.importorskip("gguf")


def _file(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "flux")
    weight = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("a.weight", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a.bias", np.arange(4, dtype=np.float16))
    writer.add_string("general.name", "tiny")
    writer.add_array("tokens", ["a", "bb", "ccc"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    path = _file(tmp_path / "t.gguf")
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(str(path))
    assert header.metadata["general.name"] == "tiny"
    assert header.metadata["tokens"] == ["a", "bb", "ccc"]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.name == theirs.name
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert header.data_start + ours.begin == theirs.data_offset
        assert ours.nbytes == theirs.n_bytes
        assert ours.type_id == int(theirs.tensor_type)


def test_write_gguf_is_read_back_by_the_gguf_package(tmp_path: Path) -> None:
    raw = np.random.default_rng(1).integers(0, 256, (4, 2 * 34), dtype=np.uint8)
    bias = np.arange(4, dtype=np.float32)
    path = tmp_path / "w.gguf"
    write_gguf(path, [("w", (4, 64), 8, lambda: raw), ("b", (4,), 0, lambda: bias)],
               {"general.architecture": "flux"})
    reader = gguf.GGUFReader(str(path))
    assert np.array_equal(np.asarray(reader.tensors[0].data), raw)
    assert np.array_equal(np.asarray(reader.tensors[1].data), bias)


_BASE: bytes = b""


def _base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    global _BASE
    if not _BASE:
        _BASE = _file(tmp_path_factory.mktemp("gguf") / "base.gguf").read_bytes()
    return _BASE


@settings(max_examples=60, deadline=2000,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=10_000), flips=st.lists(
    st.tuples(st.integers(min_value=0, max_value=10_000), st.integers(0, 255)), max_size=4))
def test_damaged_files_are_errors_that_say_so(tmp_path_factory: pytest.TempPathFactory,
                                              cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(_base(tmp_path_factory))
    for at, value in flips:
        data[at % len(data)] = value
    del data[cut % (len(data) + 1):]
    path = tmp_path_factory.mktemp("damaged") / "d.gguf"
    path.write_bytes(bytes(data))
    try:
        header = read_gguf_header(path)
    except SafetensorsFormatError:
        return
    for info in header.tensors:  # what parses is within the file
        assert header.data_start + info.begin + info.nbytes <= len(data)


def test_deeply_nested_metadata_arrays_are_refused(tmp_path: Path) -> None:
    import struct

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    body += struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2000 + struct.pack("<IQ", 4, 1)
    path = tmp_path / "deep.gguf"
    path.write_bytes(body + bytes(4))
    with pytest.raises(SafetensorsFormatError, match="nested over 8 deep"):
        read_gguf_header(path)
