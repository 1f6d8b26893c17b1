"""Reading a checkpoint into the page cache ahead of its use (``vramkit.io.prefetch``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramkit.io import prefetch as prefetch_module
from vramkit.io.prefetch import Prefetch, checkpoint_files, prefetch_checkpoint


def _file(path: Path, nbytes: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(256)) * (nbytes // 256) + b"x" * (nbytes % 256))
    return path


def test_a_prefetch_reads_every_byte_of_every_file(tmp_path: Path) -> None:
    files = [_file(tmp_path / "a.safetensors", 1_000_003), _file(tmp_path / "b.gguf", 70_000)]
    p = Prefetch(files, threads=3, chunk=65_536)
    for t in p._threads:
        t.join()
    assert p.done and p.error is None
    assert p.bytes_read == p.nbytes == 1_070_003


def test_stop_ends_the_reads_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import threading

    f = _file(tmp_path / "big.safetensors", 4 << 20)
    first, release = threading.Event(), threading.Event()
    real = os.preadv

    def held(fd: int, buffers: list[bytearray], offset: int) -> int:
        got = real(fd, buffers, offset)
        first.set()
        release.wait(10)  # the first read stays in flight until the stop is asked
        return got

    monkeypatch.setattr(os, "preadv", held)
    p = Prefetch([f], threads=1, chunk=4096)
    assert first.wait(10)
    p.stop(wait=False)
    release.set()
    p.stop()
    assert p.done and p.bytes_read == 4096 < p.nbytes


def test_the_files_of_a_checkpoint(tmp_path: Path) -> None:
    single = _file(tmp_path / "one.safetensors", 10)
    assert checkpoint_files(single) == [single]
    shards = [_file(tmp_path / "sharded" / f"m-0000{i}.safetensors", 10) for i in (1, 2)]
    _file(tmp_path / "sharded" / "config.json", 10)
    assert checkpoint_files(tmp_path / "sharded") == shards
    component = _file(tmp_path / "pipe" / "transformer" / "m.safetensors", 10)
    assert checkpoint_files(tmp_path / "pipe") == [component]
    index = tmp_path / "sharded" / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shards[1].name, "b": shards[1].name}}))
    assert checkpoint_files(index) == [shards[1]]
    assert checkpoint_files(tmp_path / "missing") == []


def test_one_prefetch_per_checkpoint_and_none_that_would_not_stay_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from vramkit.devices import host

    class Running:  # a prefetch that has not finished
        def __init__(self, files: list[Path]) -> None:
            self.files, self.done, self._stop = files, False, threading.Event()
            made.append(self)

    made: list[Running] = []
    monkeypatch.setattr(prefetch_module, "Prefetch", Running)
    f = _file(tmp_path / "m.safetensors", 1 << 20)
    real = host.read_host_memory()
    monkeypatch.setattr(host, "read_host_memory",
                        lambda **kw: host.HostMemory(**{**real.__dict__, "available": 1 << 20}))
    assert prefetch_checkpoint(f) is None and not made  # 1 MiB > 0.6 x 1 MiB: evicted
    monkeypatch.setattr(host, "read_host_memory",
                        lambda **kw: host.HostMemory(**{**real.__dict__, "available": 1 << 40}))
    first = prefetch_checkpoint(f)
    assert first is made[0] and first.files == [f]
    assert prefetch_checkpoint(f) is first  # still reading: shared
    first.done = True
    assert prefetch_checkpoint(f) is made[1]  # finished (maybe evicted since): read again
    assert prefetch_checkpoint(tmp_path / "nothing") is None and len(made) == 2


def test_the_module_imports_without_torch() -> None:
    code = ("import sys; from vramkit.io.prefetch import prefetch_checkpoint; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
