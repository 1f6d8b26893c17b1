"""The staging pipeline on host streams: chunking, conversion, buffer rotation and ordering."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from vramkit.errors import ConfigError
from vramkit.io._header import TensorEntry
from vramkit.io._staging import DeviceStager, plan_chunks
from vramkit.io.lazy import LazySafetensors, ReadThreads
from vramkit.memory.pool import MemoryPool
from vramkit.memory.transfer import HostStreams, StreamOp


def fake_entries(sizes: list[int], itemsize: int = 2) -> list[TensorEntry]:
    code = {1: "U8", 2: "BF16", 4: "F32", 8: "F64"}[itemsize]
    entries, offset = [], 0
    for i, size in enumerate(sizes):
        entries.append(TensorEntry(f"t{i}", code, (size,), offset,
                                   offset + size * itemsize, 8, Path("f")))
        offset += size * itemsize
    return entries


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=12),
       chunk=st.sampled_from([16, 48, 64, 256, 1024]), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_chunks_cover_every_tensor_exactly(sizes: list[int], chunk: int, itemsize: int) -> None:
    entries = fake_entries(sizes, itemsize)
    covered = {e.name: 0 for e in entries}
    for pieces in plan_chunks(entries, chunk):
        end = 0
        for piece in pieces:
            assert piece.staging_offset % 16 == 0 or piece.nbytes == 0
            assert piece.staging_offset >= end or piece.nbytes == 0
            assert piece.staging_offset + piece.nbytes <= chunk
            assert piece.start == covered[piece.entry.name]  # in order, no gap, no overlap
            assert piece.start % itemsize == 0 and piece.nbytes % itemsize == 0
            covered[piece.entry.name] += piece.nbytes
            end = piece.staging_offset + piece.nbytes
    assert covered == {e.name: e.nbytes for e in entries}


def test_chunk_size_must_be_a_multiple_of_16() -> None:
    with pytest.raises(ConfigError):
        list(plan_chunks(fake_entries([4]), 24))


@pytest.fixture
def checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tensors = {"a.big": torch.randn(1000), "b.small": torch.randn(3, 5).to(torch.bfloat16),
               "c.ids": torch.arange(7), "d.empty": torch.zeros(0, 2), "e.mid": torch.randn(77)}
    save_file(tensors, tmp_path / "m.safetensors")
    return tensors


def run_stager(path: Path, chunk_bytes: int, num_buffers: int, dtype: torch.dtype | None,
               log: list[StreamOp] | None = None) -> tuple[DeviceStager, dict[str, torch.Tensor]]:
    stager = DeviceStager(torch.device("cpu"), HostStreams(log=log), MemoryPool("cpu"),
                          chunk_bytes=chunk_bytes, num_buffers=num_buffers,
                          threads=ReadThreads(2))
    out: dict[str, torch.Tensor] = {}
    progress: list[int] = []
    with LazySafetensors.open(path) as lazy:
        entries = lazy.entries()

        def dtype_for(entry: TensorEntry) -> torch.dtype:
            return dtype if (dtype is not None and entry.dtype.is_floating_point) else entry.dtype

        stager.load(lazy, entries, dtype_for, out.__setitem__, progress.append)
        assert sum(progress) == sum(e.nbytes for e in entries)
    return stager, out


@pytest.mark.parametrize("chunk_bytes", [64, 512, 1 << 20])
@pytest.mark.parametrize("dtype", [None, torch.float16, torch.float64])
def test_stager_delivers_exact_tensors(tmp_path: Path, checkpoint: dict[str, torch.Tensor],
                                       chunk_bytes: int, dtype: torch.dtype | None) -> None:
    stager, out = run_stager(tmp_path / "m.safetensors", chunk_bytes, 2, dtype)
    with LazySafetensors.open(tmp_path / "m.safetensors") as lazy:
        assert list(out) == lazy.tensor_names()  # delivered in file order
    for name, tensor in checkpoint.items():
        want = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name
    total = sum(t.numel() * t.element_size() for t in checkpoint.values())
    assert stager.h2d_bytes == total and stager.file_bytes == total
    if chunk_bytes == 64:
        assert stager.chunks >= total // 64  # the 4000-byte tensor was split


def buffer_waits(log: list[StreamOp]) -> tuple[int, int]:
    """(chunks enqueued before the first wait for a staging buffer, number of such waits)."""
    first = next(i for i, op in enumerate(log) if op.kind == "sync")
    copies_before = len({op.what for op in log[:first] if op.kind == "copy"})
    return copies_before, sum(op.kind == "sync" for op in log)


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_buffers_rotate_and_are_waited_for_before_reuse(
        tmp_path: Path, checkpoint: dict[str, torch.Tensor], num_buffers: int) -> None:
    log: list[StreamOp] = []
    stager, _ = run_stager(tmp_path / "m.safetensors", 512, num_buffers, None, log)
    # every chunk ends with a "buffer free" record on h2d; each reuse waits for that event
    records = [op for op in log if op.kind == "record" and op.stream == "h2d"]
    syncs = [op for op in log if op.kind == "sync"]
    assert len(syncs) == stager.chunks - num_buffers
    chunk_ends = []
    for op in log:  # the free events are the ones later synchronized on
        if op.kind == "sync":
            chunk_ends.append(op.event)
    record_ids = [op.event for op in records]
    for event in chunk_ends:
        assert event in record_ids
    # the i-th wait is for the buffer of chunk i, i.e. the (num_buffers)-th chunk back
    assert [record_ids.index(e) for e in chunk_ends] == sorted(record_ids.index(e)
                                                               for e in chunk_ends)


def test_copies_wait_for_the_callers_stream_and_callers_wait_for_copies(
        tmp_path: Path, checkpoint: dict[str, torch.Tensor]) -> None:
    log: list[StreamOp] = []
    run_stager(tmp_path / "m.safetensors", 1 << 20, 2, torch.float16, log)
    first_copy = next(i for i, op in enumerate(log) if op.kind == "copy")
    # new destinations: record on compute, h2d waits, before any copy into them
    assert [(op.kind, op.stream) for op in log[first_copy - 2:first_copy]] == [
        ("record", "compute"), ("wait", "h2d")]
    ready_waits = [op for op in log if op.kind == "wait" and op.stream == "compute"]
    assert len(ready_waits) == len(checkpoint)  # one device-side wait per delivered tensor
    assert not any(op.kind == "sync" for op in log)  # one chunk: the host never waited


def test_cuda_staging_needs_a_pinned_pool() -> None:
    with pytest.raises(ConfigError, match="pinned"):
        DeviceStager(torch.device("cuda", 0), HostStreams(), MemoryPool("cpu"), chunk_bytes=64)
    with pytest.raises(ConfigError, match="num_buffers"):
        DeviceStager(torch.device("cpu"), HostStreams(), MemoryPool("cpu"), chunk_bytes=64,
                     num_buffers=0)
