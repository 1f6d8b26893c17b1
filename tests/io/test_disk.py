"""vramkit.io.disk: timed reads of real temporary files, and the errors for bad paths."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from vramkit.errors import ConfigError
from vramkit.io.disk import METHODS, DiskReadResult, drop_page_cache, measure_read_bandwidth

MiB = 1 << 20


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def test_reads_a_small_file_whole(tmp_path: Path) -> None:
    path = _file(tmp_path / "model.safetensors", 3 * MiB + 123)  # not a multiple of 4 KiB
    result = measure_read_bandwidth(path)
    assert isinstance(result, DiskReadResult)
    assert result.path == str(path)
    assert result.bytes == 3 * MiB + 123
    assert result.seconds > 0
    assert result.gb_per_s == pytest.approx(result.bytes / result.seconds / 1e9)
    assert result.method in METHODS
    assert result.method != "buffered, page cache may be warm" or not hasattr(os, "posix_fadvise")


def test_max_bytes_is_honoured(tmp_path: Path) -> None:
    path = _file(tmp_path / "big.bin", 4 * MiB)
    assert measure_read_bandwidth(path, max_bytes="1MiB", block_bytes="256KiB").bytes == MiB
    # O_DIRECT reads whole 4 KiB blocks: an odd cap is rounded down, never exceeded.
    odd = measure_read_bandwidth(path, max_bytes=10_000, block_bytes=4096)
    assert 0 < odd.bytes <= 10_000
    tiny = measure_read_bandwidth(path, max_bytes=100)
    assert tiny.bytes == 100


def test_odd_block_sizes(tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", MiB + 7)
    assert measure_read_bandwidth(path, block_bytes=1000).bytes == MiB + 7


def test_warm_read_goes_through_the_page_cache(tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", MiB)
    result = measure_read_bandwidth(path, cold=False)
    assert result.method == "buffered, page cache may be warm"
    assert result.bytes == MiB


def test_buffered_fallback_drops_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    from vramkit.io import disk

    monkeypatch.setattr(disk, "_read_direct", lambda *args: None)  # a filesystem without it
    path = _file(tmp_path / "f.bin", MiB)
    result = measure_read_bandwidth(path)
    expected = ("buffered, page cache dropped" if hasattr(os, "posix_fadvise")
                else "buffered, page cache may be warm")
    assert result.method == expected
    assert result.bytes == MiB


def test_directory_reads_its_largest_file(tmp_path: Path) -> None:
    _file(tmp_path / "ckpt/config.json", 100)
    _file(tmp_path / "ckpt/model-00001-of-00002.safetensors", 2 * MiB)
    largest = _file(tmp_path / "ckpt/transformer/model-00002-of-00002.safetensors", 3 * MiB)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "ckpt/pipe")  # not a regular file: skipped, never opened
    result = measure_read_bandwidth(tmp_path / "ckpt")
    assert result.path == str(largest)
    assert result.bytes == 3 * MiB


def test_to_dict_is_json_serializable(tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", 64 * 1024)
    result = measure_read_bandwidth(str(path))
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data) == {"path", "bytes", "seconds", "gb_per_s", "method", "threads"}
    assert "GB/s" in str(result)


@pytest.mark.parametrize("cold", [True, False])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_parallel_reads_cover_the_file_once(tmp_path: Path, threads: int, cold: bool) -> None:
    # 5 ranges of 16 KiB and a short one: every byte counted once, whatever the thread count
    path = _file(tmp_path / "f.bin", 5 * 16384 + 5000)
    result = measure_read_bandwidth(path, block_bytes="16KiB", threads=threads, cold=cold)
    assert result.bytes == 5 * 16384 + 5000 and result.threads == threads
    assert (f"{threads} threads" in str(result)) == (threads > 1)
    capped = measure_read_bandwidth(path, block_bytes="16KiB", max_bytes="40KiB",
                                    threads=threads, cold=cold)
    assert capped.bytes == 40 * 1024


def test_bad_thread_count(tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", 4096)
    with pytest.raises(ConfigError, match="threads"):
        measure_read_bandwidth(path, threads=0)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        measure_read_bandwidth(tmp_path / "nope.safetensors")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.hint
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and again.message == info.value.message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    path.touch()
    with pytest.raises(ConfigError, match="empty"):
        measure_read_bandwidth(path)


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="no regular file"):
        measure_read_bandwidth(tmp_path / "d")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_non_regular_file_is_refused_without_opening(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # and no hang on open()
        measure_read_bandwidth(fifo)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads anything")
def test_unreadable_file(tmp_path: Path) -> None:
    path = _file(tmp_path / "secret.bin", 4096)
    path.chmod(0)
    try:
        with pytest.raises(ConfigError, match="permission denied") as info:
            measure_read_bandwidth(path)
        assert isinstance(info.value, PermissionError)
    finally:
        path.chmod(0o600)


@pytest.mark.parametrize("kwargs", [{"max_bytes": 0}, {"max_bytes": "lots"},
                                    {"block_bytes": -1}, {"cold": "yes"}])
def test_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    path = _file(tmp_path / "f.bin", 4096)
    with pytest.raises(ConfigError):
        measure_read_bandwidth(path, **kwargs)


def test_drop_page_cache_returns_a_bool(tmp_path: Path) -> None:
    path = _file(tmp_path / "a/f.bin", 64 * 1024)
    _file(tmp_path / "a/b/g.bin", 4096)
    supported = hasattr(os, "posix_fadvise")
    assert drop_page_cache(path) is supported
    assert drop_page_cache(tmp_path / "a") is supported
    assert drop_page_cache(tmp_path / "missing") is False


def test_drop_page_cache_without_fadvise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    assert drop_page_cache(_file(tmp_path / "f.bin", 4096)) is False
