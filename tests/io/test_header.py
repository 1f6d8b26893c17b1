"""Header parsing: every malformed input is a SafetensorsFormatError naming file and tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vramkit.errors import SafetensorsFormatError
from vramkit.io._header import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    read_header,
    read_index,
)


def write_raw(path: Path, header: Any, data: bytes = b"", *, raw_header: bytes | None = None,
              length: int | None = None) -> Path:
    """Write a safetensors-shaped file from a header object (or raw header bytes) and data."""
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_valid_file_parsed_in_offset_order(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    save_file({"b": torch.ones(2, 3), "a": torch.zeros(4, dtype=torch.int64)}, path,
              metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == {"a", "b"}
    begins = [e.begin for e in header.tensors.values()]
    assert begins == sorted(begins) and begins[0] == 0
    a = header.tensors["a"]
    assert a.dtype == torch.int64 and a.shape == (4,) and a.nbytes == 32
    assert a.file_offset == header.data_start + a.begin
    assert header.tensors["b"].dtype_code == "F32"


def test_every_safetensors_dtype_maps_like_the_safetensors_library() -> None:
    import safetensors.torch as st

    library = getattr(st, "_TYPES", {})
    for code, dtype in library.items():
        assert SAFETENSORS_DTYPES[code] == dtype, code
    for code in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
                 "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"):
        assert code in SAFETENSORS_DTYPES


BAD_HEADERS: list[tuple[str, Any, bytes, str, str | None]] = [
    # (case, header, data, message fragment, tensor named)
    ("top-level array", [1, 2], b"", "not an object", None),
    ("entry not a dict", {"w": [1]}, b"", "not an object with dtype", "w"),
    ("missing keys", {"w": {"dtype": "F32"}}, b"", "lacks shape, data_offsets", "w"),
    ("unknown dtype", {"w": entry("Q7", [1], 0, 4)}, b"\0" * 4, "unknown dtype 'Q7'", "w"),
    ("dtype not a string", {"w": entry(3, [1], 0, 4)}, b"\0" * 4, "not a string", "w"),  # type: ignore[arg-type]
    ("negative dim", {"w": entry("F32", [-1], 0, 4)}, b"\0" * 4, "non-negative", "w"),
    ("bool dim", {"w": entry("F32", [True], 0, 4)}, b"\0" * 4, "non-negative", "w"),
    ("offsets not a pair", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
     b"\0" * 4, "pair", "w"),
    ("offsets reversed", {"w": entry("F32", [0], 4, 0)}, b"\0" * 4, "end before", "w"),
    ("shape/bytes mismatch", {"w": entry("F32", [2], 0, 4)}, b"\0" * 4, "needs 8 bytes", "w"),
    ("out of range", {"w": entry("F32", [2], 0, 8)}, b"\0" * 4, "run past", "w"),
    ("overlap", {"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, b"\0" * 8,
     "overlap", "b"),
    ("gap", {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, b"\0" * 12,
     "gap of 4 bytes", "b"),
    ("gap at start", {"a": entry("F32", [1], 4, 8)}, b"\0" * 8, "gap", "a"),
    ("trailing bytes", {"a": entry("F32", [1], 0, 4)}, b"\0" * 9, "5 trailing bytes", None),
    ("metadata not dict", {"__metadata__": [1]}, b"", "__metadata__", None),
    ("metadata value not str", {"__metadata__": {"k": 1}}, b"", "not a string", None),
]


@pytest.mark.parametrize(("case", "header", "data", "fragment", "tensor"), BAD_HEADERS,
                         ids=[c[0] for c in BAD_HEADERS])
def test_bad_header(tmp_path: Path, case: str, header: Any, data: bytes, fragment: str,
                    tensor: str | None) -> None:
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsFormatError, match=fragment) as info:
        read_header(path)
    assert info.value.path == str(path)
    assert info.value.tensor == tensor
    assert str(path) in str(info.value) and info.value.hint


@pytest.mark.parametrize("code", ["F4", "F6_E2M3"])
def test_valid_but_unsupported_dtype_is_named(tmp_path: Path, code: str) -> None:
    path = write_raw(tmp_path / "f4.safetensors", {"w": entry(code, [2], 0, 1)}, b"\0")
    with pytest.raises(SafetensorsFormatError, match=f"dtype '{code}' is valid safetensors"):
        read_header(path)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x05\0\0")
    with pytest.raises(SafetensorsFormatError, match="truncated file: 3 bytes"):
        read_header(path)


def test_header_length_beyond_file(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "long.safetensors", {}, length=1000)
    with pytest.raises(SafetensorsFormatError, match="beyond the end"):
        read_header(path)


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 2**63 + 5, 2**64 - 1])
def test_huge_header_length_rejected_before_allocating(tmp_path: Path, length: int) -> None:
    path = write_raw(tmp_path / "huge.safetensors", {}, length=length)
    with pytest.raises(SafetensorsFormatError, match="over the 100 MB limit"):
        read_header(path)


@pytest.mark.parametrize(("raw", "fragment"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not valid JSON"),
    (b'{"a": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b'{"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, '
     b'"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}', "names 'w' twice"),
])
def test_invalid_json(tmp_path: Path, raw: bytes, fragment: str) -> None:
    path = write_raw(tmp_path / "json.safetensors", None, b"\0" * 4, raw_header=raw)
    with pytest.raises(SafetensorsFormatError, match=fragment):
        read_header(path)


def test_header_padding_and_empty_tensors_are_valid(tmp_path: Path) -> None:
    header = {"e": entry("F32", [0, 3], 0, 0), "f": entry("F16", [2], 0, 4),
              "g": entry("BOOL", [], 4, 5)}
    raw = json.dumps(header).encode() + b"    "  # writers pad the header with spaces
    path = write_raw(tmp_path / "pad.safetensors", None, b"\0" * 5, raw_header=raw)
    parsed = read_header(path)
    assert parsed.tensors["e"].nbytes == 0 and parsed.tensors["g"].shape == ()


# -- shard indexes ---------------------------------------------------------------------------


def write_index(directory: Path, weight_map: dict[str, Any], name: str = "model") -> Path:
    path = directory / f"{name}.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def test_index_resolves_shards(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "s1.safetensors")
    index = read_index(write_index(tmp_path, {"a": "s1.safetensors"}))
    assert index.weight_map == {"a": tmp_path / "s1.safetensors"}
    assert index.shards == [tmp_path / "s1.safetensors"]
    assert index.metadata == {"total_size": 0}


@pytest.mark.parametrize(("weight_map", "fragment"), [
    ({"a": "missing.safetensors"}, "does not exist"),
    ({"a": "../up.safetensors"}, "outside the checkpoint directory"),
    ({"a": "/abs.safetensors"}, "outside the checkpoint directory"),
    ({"a": 3}, "not a shard file name"),
])
def test_bad_index(tmp_path: Path, weight_map: dict[str, Any], fragment: str) -> None:
    path = write_index(tmp_path, weight_map)
    with pytest.raises(SafetensorsFormatError, match=fragment) as info:
        read_index(path)
    assert info.value.tensor == "a"


def test_index_without_weight_map(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(SafetensorsFormatError, match="weight_map"):
        read_index(path)


def test_index_naming_a_tensor_twice(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "s1.safetensors")
    path = tmp_path / "m.safetensors.index.json"
    path.write_text('{"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}}')
    with pytest.raises(SafetensorsFormatError, match="names 'a' twice"):
        read_index(path)
