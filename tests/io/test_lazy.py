"""LazySafetensors: lazy metadata, every dtype, slices that read only their rows, shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vramkit.errors import ConfigError, SafetensorsFormatError
from vramkit.io._header import SAFETENSORS_DTYPES
from vramkit.io.lazy import LazySafetensors
from vramkit.io.loader import MemoryEfficientLoader


def sample_of(dtype: torch.dtype, shape: tuple[int, ...] = (5, 7)) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(0, 100, shape).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.fixture
def all_dtypes(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {code.lower(): sample_of(dtype) for code, dtype in SAFETENSORS_DTYPES.items()}
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 3)
    path = tmp_path / "all.safetensors"
    save_file(tensors, path, metadata={"who": "test"})
    return path, tensors


@pytest.mark.parametrize("use_mmap", [True, False])
def test_every_dtype_round_trips(all_dtypes: tuple[Path, dict[str, torch.Tensor]],
                                 use_mmap: bool) -> None:
    path, tensors = all_dtypes
    with LazySafetensors.open(path, use_mmap=use_mmap) as checkpoint:
        assert sorted(checkpoint.tensor_names()) == sorted(tensors)
        loaded = checkpoint.load_tensors()
        assert checkpoint.reader(path).mode == ("mmap" if use_mmap else "pread")
    for name, tensor in tensors.items():
        assert same_bytes(loaded[name], tensor), name


def test_metadata_without_reading_data(all_dtypes: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = all_dtypes
    checkpoint = LazySafetensors.open(path)
    assert checkpoint.metadata == {"who": "test"}
    assert checkpoint.shape("f32") == torch.Size([5, 7])
    assert checkpoint.dtype("bf16") == torch.bfloat16
    assert "f16" in checkpoint and len(checkpoint) == len(tensors)
    assert checkpoint.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert checkpoint.bytes_read == 0
    checkpoint.load_tensor("f32")
    assert checkpoint.bytes_read == 5 * 7 * 4
    checkpoint.close()
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        checkpoint.entry("nope")


def test_tensors_stay_valid_after_close_and_do_not_alias_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.arange(10.0)}, path)
    checkpoint = LazySafetensors.open(path)
    w = checkpoint.load_tensor("w")
    checkpoint.close()
    w += 1
    assert torch.equal(w, torch.arange(10.0) + 1)
    assert torch.equal(LazySafetensors.open(path).load_tensor("w"), torch.arange(10.0))


INDICES = [
    (slice(2, 5),), (1,), (-1,), (slice(None), 3), (slice(1, 9, 3), slice(2, 4)), (...,),
    (slice(7, 7),), (slice(None, None, 2), ..., 1), (slice(-3, None),),
]


@pytest.mark.parametrize("use_mmap", [True, False])
@pytest.mark.parametrize("index", INDICES, ids=[repr(i) for i in INDICES])
def test_slices_match_torch_and_read_only_their_rows(tmp_path: Path, index: tuple[object, ...],
                                                     use_mmap: bool) -> None:
    weight = torch.randn(10, 6, 4)
    path = tmp_path / "s.safetensors"
    save_file({"w": weight}, path)
    with LazySafetensors.open(path, use_mmap=use_mmap) as checkpoint:
        got = checkpoint.get_slice("w")[index if len(index) > 1 else index[0]]
        assert torch.equal(got, weight[index])
        rows = range(10)[index[0]] if isinstance(index[0], slice) else None
        if rows is not None and index[0] != slice(None) and len(rows):
            assert checkpoint.bytes_read == (rows[-1] + 1 - rows[0]) * 6 * 4 * 4
        if isinstance(index[0], int):
            assert checkpoint.bytes_read == 6 * 4 * 4


def test_slice_handle_and_bad_indices(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    save_file({"w": torch.ones(4, 2), "s": torch.tensor(1.0)}, path)
    checkpoint = LazySafetensors.open(path)
    handle = checkpoint.get_slice("w")
    assert handle.shape == torch.Size([4, 2]) and handle.get_shape() == [4, 2]
    assert handle.dtype == torch.float32
    for bad in (slice(None, None, -1), torch.tensor([0]), (0, 0, 0), None.__class__):
        with pytest.raises(ConfigError):
            checkpoint.load_tensor("w", bad)
    with pytest.raises(IndexError, match="out of range"):
        checkpoint.load_tensor("w", 4)
    with pytest.raises(ConfigError, match="0-dimensional"):
        checkpoint.load_tensor("s", 0)


def test_file_shrunk_after_open_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    save_file({"a": torch.ones(4096), "b": torch.ones(4096)}, path)
    for use_mmap in (True, False):
        checkpoint = LazySafetensors.open(path, use_mmap=use_mmap)
        checkpoint.load_tensor("a")
        size = path.stat().st_size
        os.truncate(path, size - 8192)
        with pytest.raises(SafetensorsFormatError):
            checkpoint.load_tensor("b")
        checkpoint.close()
        save_file({"a": torch.ones(4096), "b": torch.ones(4096)}, path)


# -- sharded checkpoints ---------------------------------------------------------------------


def make_shards(directory: Path, with_index: bool = True) -> dict[str, torch.Tensor]:
    tensors = {f"layers.{i}.weight": torch.full((3, 2), float(i)) for i in range(5)}
    tensors["embed"] = torch.arange(6.0)
    shard_of = {}
    for number, names in enumerate((["embed", "layers.0.weight", "layers.1.weight"],
                                    ["layers.2.weight", "layers.3.weight", "layers.4.weight"])):
        file = f"model-{number + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names}, directory / file)
        shard_of.update(dict.fromkeys(names, file))
    if with_index:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 1}, "weight_map": shard_of}))
    return tensors


@pytest.mark.parametrize("how", ["directory", "index file", "directory without index"])
def test_sharded_checkpoint_is_one_logical_checkpoint(tmp_path: Path, how: str) -> None:
    tensors = make_shards(tmp_path, with_index=how != "directory without index")
    source = tmp_path / "model.safetensors.index.json" if how == "index file" else tmp_path
    with LazySafetensors.open(source) as checkpoint:
        assert len(checkpoint.files) == 2
        assert sorted(checkpoint.tensor_names()) == sorted(tensors)
        for name, tensor in checkpoint.load_tensors().items():
            assert torch.equal(tensor, tensors[name])
        if how != "directory without index":
            assert checkpoint.index is not None and checkpoint.index.metadata["total_size"] == 1


def test_tensor_in_two_shards_is_an_error(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "x-1.safetensors")
    save_file({"a": torch.ones(1), "b": torch.ones(1)}, tmp_path / "x-2.safetensors")
    with pytest.raises(SafetensorsFormatError, match="stored in two shards") as info:
        LazySafetensors.open(tmp_path)
    assert info.value.tensor == "a"


def test_index_pointing_to_the_wrong_shard(tmp_path: Path) -> None:
    make_shards(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["embed"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SafetensorsFormatError, match="stored in model-00001"):
        LazySafetensors.open(index)
    data["weight_map"]["ghost"] = "model-00002-of-00002.safetensors"
    data["weight_map"]["embed"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SafetensorsFormatError, match="does not hold it") as info:
        LazySafetensors.open(index)
    assert info.value.tensor == "ghost"


def test_index_with_missing_shard(tmp_path: Path) -> None:
    make_shards(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SafetensorsFormatError, match="does not exist"):
        LazySafetensors.open(tmp_path)


def test_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsFormatError, match=r"no \.safetensors file"):
        LazySafetensors.open(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors.index.json").write_text("{}")
    with pytest.raises(SafetensorsFormatError, match="several index files"):
        LazySafetensors.open(tmp_path)
    with pytest.raises(FileNotFoundError):
        LazySafetensors.open(tmp_path / "nothing.safetensors")


# -- a bad shard -----------------------------------------------------------------------------


def damage(path: Path) -> None:
    path.write_bytes(b"\xff" * 8 + b"{}")


@pytest.mark.parametrize("how", ["directory", "index file", "directory without index"])
def test_a_bad_shard_is_named(tmp_path: Path, how: str) -> None:
    make_shards(tmp_path, with_index=how != "directory without index")
    damage(tmp_path / "model-00002-of-00002.safetensors")
    source = tmp_path / "model.safetensors.index.json" if how == "index file" else tmp_path
    with pytest.raises(SafetensorsFormatError) as info:
        LazySafetensors.open(source)
    assert info.value.path == str(tmp_path / "model-00002-of-00002.safetensors")
    assert "model-00002-of-00002.safetensors" in info.value.message
    with pytest.raises(SafetensorsFormatError, match="model-00002-of-00002"):
        MemoryEfficientLoader("cpu").load_safetensors(source)


@pytest.mark.parametrize("how", ["index file", "directory without index"])
def test_skip_bad_shards_keeps_the_rest(tmp_path: Path, how: str) -> None:
    tensors = make_shards(tmp_path, with_index=how == "index file")
    bad = tmp_path / "model-00002-of-00002.safetensors"
    damage(bad)
    source = tmp_path / "model.safetensors.index.json" if how == "index file" else tmp_path
    with LazySafetensors.open(source, on_bad_shard="skip") as checkpoint:
        assert [b.path for b in checkpoint.bad_shards] == [bad]
        assert "over the 100 MB limit" in checkpoint.bad_shards[0].error.message
        assert checkpoint.files == [tmp_path / "model-00001-of-00002.safetensors"]
        assert sorted(checkpoint.tensor_names()) == ["embed", "layers.0.weight", "layers.1.weight"]
        assert torch.equal(checkpoint.load_tensor("embed"), tensors["embed"])
    bad.unlink()  # a missing shard the index lists is skipped as well, with the index's words
    if how == "index file":
        with LazySafetensors.open(source, on_bad_shard="skip") as checkpoint:
            assert "does not exist" in checkpoint.bad_shards[0].error.message
            assert "Download every shard" in checkpoint.bad_shards[0].error.hint
    with pytest.raises(ConfigError, match="on_bad_shard"):
        LazySafetensors.open(source, on_bad_shard="ignore")


def test_pread_scatter_fills_every_buffer_across_short_reads(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from vramkit.io import lazy

    data = bytes(range(256)) * 4
    file = tmp_path / "raw.bin"
    file.write_bytes(data)
    real = os.preadv

    def short_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        # at most 7 bytes per call, possibly ending inside a buffer
        budget, cut = 7, []
        for b in buffers:
            if budget == 0:
                break
            cut.append(b[:budget])
            budget -= len(cut[-1])
        return real(fd, cut, offset)

    monkeypatch.setattr(lazy.os, "preadv", short_preadv)
    dsts = [torch.empty(n, dtype=torch.uint8) for n in (5, 0, 13, 1, 40)]
    fd = os.open(file, os.O_RDONLY)
    try:
        assert lazy.pread_scatter(fd, dsts, 100) == 59
        assert b"".join(bytes(d.tolist()) for d in dsts) == data[100:159]
        tail = [torch.empty(30, dtype=torch.uint8)]
        assert lazy.pread_scatter(fd, tail, len(data) - 10) == 10  # end of file
    finally:
        os.close(fd)
