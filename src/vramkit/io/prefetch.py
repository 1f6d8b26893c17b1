"""Reading a checkpoint into the page cache ahead of its use, while the process does other work.

A training script that loads a model from a checkpoint spends its first seconds importing
torch and diffusers, starting CUDA and planning before :func:`vramkit.fit` reads the file: the
disk idles all that time, and the first step waits for a cold read that started late (a 23.8
GB FLUX file at 1.4 GB/s: the first step came 2.0-2.1x the cold read after the command on an
H200 host). :func:`prefetch_checkpoint` starts reading the file at once, on background threads, into the
kernel's page cache; the swapper's fill later reads the same bytes from there (its reads are
buffered ``pread``), at memory speed for what was read ahead, and follows the prefetch at the
disk's speed for the rest. Nothing here imports torch: a script can call it before its heavy
imports::

    from vramkit.io.prefetch import prefetch_checkpoint   # stdlib only
    prefetch_checkpoint(path)                             # the read starts now
    import torch, diffusers                               # ... while these import

:func:`vramkit.fit` calls it for its ``checkpoint=`` while it plans. A file is prefetched only
where it fits in a share of the memory the kernel could hand out (:data:`PAGE_CACHE_SHARE` of
``MemAvailable``): beside the pinned masters the swapper will allocate, a larger file would be
evicted before its use, and reading it twice costs more than the prefetch saves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from vramkit.units import format_size

__all__ = ["PAGE_CACHE_SHARE", "Prefetch", "checkpoint_files", "prefetch_checkpoint"]

logger = logging.getLogger(__name__)

#: A checkpoint is prefetched only when its bytes fit in this share of ``MemAvailable``.
PAGE_CACHE_SHARE = 0.6
_CHUNK = 16 << 20  # one pread: large enough to stream; each thread holds one such buffer
_THREADS = 4
_SUFFIXES = (".safetensors", ".gguf")

_running: dict[tuple[str, ...], Prefetch] = {}  # one prefetch per checkpoint in a process
_lock = threading.Lock()


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files a checkpoint reads: the file itself, or the ``.safetensors`` / ``.gguf`` files
    of a folder and of its direct subfolders (a sharded checkpoint, a diffusers component)."""
    p = Path(path)
    if p.is_file():
        return [p] if not p.name.endswith(".json") else _indexed(p)
    if not p.is_dir():
        return []
    found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
    if not found:
        found = sorted(f for d in p.iterdir() if d.is_dir() for f in d.iterdir()
                       if f.is_file() and f.name.endswith(_SUFFIXES))
    return found


def _indexed(index: Path) -> list[Path]:
    """The shards a ``*.safetensors.index.json`` names."""
    import json

    try:
        names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(index.parent / n for n in names if (index.parent / n).is_file())


class Prefetch:
    """Background reads of ``files`` into the page cache (see the module docstring).

    Args:
        files: the files, read in order, each by ``threads`` threads in ``chunk``-byte preads.
        threads: concurrent reads (the disk's queue depth; default 4).
        chunk: bytes per read (default 16 MiB: the threads hold 64 MiB of buffers).

    Attributes:
        nbytes: the files' total size.
        bytes_read: bytes read so far.
    """

    def __init__(self, files: Iterable[str | os.PathLike[str]], *, threads: int = _THREADS,
                 chunk: int = _CHUNK) -> None:
        self.files = [Path(f) for f in files]
        self.nbytes = sum(f.stat().st_size for f in self.files)
        self.bytes_read = 0
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._chunk = chunk
        self._stop = threading.Event()
        self._count = threading.Lock()
        self._work = [(f, offset) for f in self.files
                      for offset in range(0, f.stat().st_size, chunk)]
        self._next = 0
        self._threads = [threading.Thread(target=self._read, name="vramkit-prefetch",
                                          daemon=True) for _ in range(max(1, threads))]
        self._left = len(self._threads)
        for t in self._threads:
            t.start()

    @property
    def done(self) -> bool:
        """Every byte read (or the prefetch stopped)."""
        return self._left == 0

    def _take(self) -> tuple[Path, int] | None:
        with self._count:
            if self._stop.is_set() or self._next >= len(self._work):
                return None
            item = self._work[self._next]
            self._next += 1
            return item

    def _read(self) -> None:
        buffer = bytearray(self._chunk)
        fds: dict[Path, int] = {}
        try:
            while (item := self._take()) is not None:
                path, offset = item
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                got = os.preadv(fd, [buffer], offset)
                with self._count:
                    self.bytes_read += got
        except OSError as exc:  # the fill reads the file again and reports what it finds
            self.error = exc
            self._stop.set()
        finally:
            for fd in fds.values():
                os.close(fd)
            with self._count:
                self._left -= 1
                last = self._left == 0
            if last:
                self.seconds = time.perf_counter() - self.started
                logger.debug("prefetch: %s of %s read in %.1f s", format_size(self.bytes_read),
                             format_size(self.nbytes), self.seconds)

    def stop(self, wait: bool = True) -> None:
        """Stop reading (what is cached stays cached); ``wait`` for the reads in flight."""
        self._stop.set()
        if wait:
            for t in self._threads:
                t.join()

    def __repr__(self) -> str:
        return (f"Prefetch({len(self.files)} file(s), {format_size(self.bytes_read)} of "
                f"{format_size(self.nbytes)} read{', done' if self.done else ''})")


def prefetch_checkpoint(path: str | os.PathLike[str], *, share: float = PAGE_CACHE_SHARE
                        ) -> Prefetch | None:
    """Start reading checkpoint ``path`` (a file, a sharded folder, an index) into the page
    cache on background threads; returns at once.

    Returns the running :class:`Prefetch` (the same one for a checkpoint already being
    prefetched in this process), or ``None`` where there is nothing to read or the files do not
    fit in ``share`` of the memory the kernel could hand out (``MemAvailable``), so the
    prefetch would be evicted before its use.
    """
    files = checkpoint_files(path)
    if not files:
        return None
    key = tuple(str(f.resolve()) for f in files)
    with _lock:
        running = _running.get(key)
        if running is not None and not running.done and not running._stop.is_set():
            return running
        size = sum(f.stat().st_size for f in files)
        from vramkit.devices.host import read_host_memory

        available = read_host_memory().available
        if available is not None and size > share * available:
            logger.info("prefetch: %s (%s) is more than %.0f %% of the %s the kernel could "
                        "hand out: not read ahead", path, format_size(size), share * 100,
                        format_size(available))
            return None
        started = _running[key] = Prefetch(files)
        return started
