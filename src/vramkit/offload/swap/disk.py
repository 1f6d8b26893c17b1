"""The disk tier of a block swapper: swapped blocks that do not fit in the host budget stay on
disk and are read into a small set of pinned staging buffers ahead of use.

``SwapConfig(host_budget=...)`` bounds the swapper's pinned host memory. The blocks whose masters
do not fit (frozen weights only) keep their bytes on disk:

* in the checkpoint itself when the swapper was attached with ``checkpoint=`` and the file holds
  the block's tensors in the module's dtypes (safetensors offsets are known: one positional read
  per tensor), else
* in a cache file written once, at attach, in the swapped layout (one read per block, page
  aligned, read with ``O_DIRECT`` where the filesystem allows it). The file is unlinked as soon
  as it is open: nothing is left behind, even after a crash (a process killed in the instant
  between creating and unlinking it leaves an empty hidden file, which the next swapper using
  the directory deletes: ``vramkit._files.new_temporary``).

A reader thread fills the staging buffers with the disk blocks the slot ring will need next (the
schedule is known: the ring passes the upcoming disk blocks in order, as far ahead as there are
buffers), waiting for a buffer's last host->device copy before overwriting it. The buffers are
also the host cache: a block still in one (the last blocks of forward, needed again first in
backward) is copied from it without a read; the least recently used buffer not holding an
upcoming block is refilled. Reads drop the pages they brought into the page cache
(``POSIX_FADV_DONTNEED``), so the host budget is what the swapper really holds and step times
measure the disk, not a warm cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vramkit._files import new_temporary
from vramkit.errors import OffloadError
from vramkit.io.lazy import pread_into
from vramkit.memory.transfer import Streams
from vramkit.offload.swap.records import SwappedBlock

__all__ = ["CacheFile", "DiskRead", "DiskTier", "open_read"]

logger = logging.getLogger(__name__)

DISK_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in whole logical blocks
_PIECE = 8 << 20  # reads larger than this are split across the read threads
_IN_FLIGHT = 2  # blocks being read at once
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


@dataclass(frozen=True)
class DiskRead:
    """One contiguous read of a disk block: ``nbytes`` at ``file_offset`` of ``file`` into the
    staging buffer at ``dst_offset``."""

    file: _DiskFile
    file_offset: int
    nbytes: int
    dst_offset: int


class _DiskFile:
    """An open file read with ``pread`` (and ``O_DIRECT`` where asked and allowed)."""

    def __init__(self, path: Path, fd: int, direct: bool) -> None:
        self.path = path
        self.fd = fd
        self.direct = direct

    def read(self, dst: torch.Tensor, offset: int) -> None:
        """Fill the contiguous uint8 CPU tensor ``dst`` from ``offset``."""
        nbytes = dst.numel()
        if nbytes == 0:
            return
        done = pread_into(self.fd, dst, offset)
        if done < nbytes:
            raise OffloadError(f"unexpected end of {self.path} at byte {offset + done}",
                               hint="The file changed after the swapper attached; attach "
                                    "again.")
        if _DONTNEED is not None and not self.direct:
            with contextlib.suppress(OSError):  # the page cache holds nothing we asked for
                os.posix_fadvise(self.fd, offset, nbytes, _DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_read(path: Path, *, direct: bool = False) -> _DiskFile:
    """Open ``path`` for positional reads; ``direct`` tries ``O_DIRECT`` (falls back to
    buffered reads where the filesystem refuses it, e.g. tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag:
        try:
            return _DiskFile(path, os.open(path, os.O_RDONLY | flag), True)
        except OSError as exc:
            logger.debug("O_DIRECT refused for %s (%s): buffered reads", path, exc)
    return _DiskFile(path, os.open(path, os.O_RDONLY), False)


class CacheFile:
    """A file of swapped blocks in their flat layout, written once (unlinked at once).

    Args:
        directory: where to create it (must exist and be writable).
    """

    def __init__(self, directory: Path) -> None:
        try:
            fd, name = new_temporary(Path(directory) / "vramkit-swap")
        except OSError as exc:
            raise OffloadError(f"cannot create the disk tier's cache file in {directory}: {exc}",
                               hint="Point SwapConfig.disk_cache_dir at a writable directory on "
                                    "a local disk with room for the blocks kept on disk.") from exc
        self.path = Path(name)
        self._write_fd = fd
        try:
            self.reader = open_read(self.path, direct=True)
        finally:
            os.unlink(name)  # the open descriptors keep it; nothing outlives the process
        self.size = 0

    def append(self, data: torch.Tensor) -> int:
        """Write the uint8 CPU tensor ``data`` at the next aligned offset; returns it."""
        offset = self.size
        nbytes = data.numel()
        view = memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
        done = 0
        try:
            while done < nbytes:
                done += os.pwrite(self._write_fd, view[done:], offset + done)
            padded = -(-nbytes // DISK_ALIGN) * DISK_ALIGN
            if padded > nbytes:
                os.pwrite(self._write_fd, bytes(padded - nbytes), offset + nbytes)
            os.fdatasync(self._write_fd) if hasattr(os, "fdatasync") else os.fsync(
                self._write_fd)
            if _DONTNEED is not None:
                os.posix_fadvise(self._write_fd, offset, padded, _DONTNEED)
        except OSError as exc:
            full = " (the disk is full)" if exc.errno == errno.ENOSPC else ""
            raise OffloadError(f"writing the disk tier's cache file in {self.path.parent} "
                               f"({offset + done} bytes so far) failed{full}: {exc}",
                               hint="Free disk space, or raise SwapConfig.host_budget so fewer "
                                    "blocks stay on disk.") from exc
        self.size = offset + padded
        return offset

    def close(self) -> None:
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        self.reader.close()


class _Staging:
    """A pinned staging buffer and the disk block it holds."""

    __slots__ = ("block", "busy", "event", "last_used", "state", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # uint8, page aligned
        self.block: SwappedBlock | None = None
        self.state = "empty"  # "reading" | "ready"
        self.event: Any = None  # the last host->device copy out of it
        self.busy = False  # a copy is being enqueued from it (never a refill victim)
        self.last_used = -1


class DiskTier:
    """Reads disk blocks ahead of use into pinned staging buffers.

    Args:
        reads: block -> the reads that fill its staging bytes.
        staging: the pinned staging buffers (uint8, at least as large as every disk block).
        streams: the device's copy streams (a buffer's host->device copy is waited for, on the
            reader thread, before it is refilled).
        threads: read threads; the pieces of up to two blocks' reads are queued on them at
            once, so the disk never idles between one block's last piece and the next one's
            first.
    """

    def __init__(self, reads: dict[SwappedBlock, list[DiskRead]], staging: Sequence[torch.Tensor],
                 streams: Streams, threads: int) -> None:
        if len(staging) < 2:
            raise OffloadError("the disk tier needs at least two staging buffers",
                               hint="This is a vramkit bug; please report it.")
        self.reads = reads
        self.blocks = list(reads)
        self.staging = [_Staging(t) for t in staging]
        self.depth = len(self.staging) - 1  # upcoming blocks wanted; one buffer stays free
        self.streams = streams
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vramkit-disk-read")
        self._in_flight = 0
        self._cond = threading.Condition()
        self._wanted: list[SwappedBlock] = []
        self._closed = False
        self._error: BaseException | None = None
        self._clock = 0
        self.counters = {"reads": 0, "read_bytes": 0, "read_seconds": 0.0, "hits": 0,
                         "waits": 0, "wait_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="vramkit-disk-tier", daemon=True)
        self._thread.start()

    # -- the ring's side -----------------------------------------------------------------

    def want(self, upcoming: Sequence[SwappedBlock]) -> None:
        """The disk blocks needed next, in order (at most :attr:`depth` are kept)."""
        wanted = list(upcoming[:self.depth])
        with self._cond:
            if wanted != self._wanted:
                self._wanted = wanted
                self._cond.notify_all()

    def request(self, block: SwappedBlock, *, wait: bool) -> torch.Tensor | None:
        """The staging bytes holding ``block``, reserved until :meth:`copied`; with
        ``wait=False`` ``None`` when they are not read yet (the read stays wanted)."""
        with self._cond:
            buf = self._holding(block)
            if buf is None or buf.state != "ready":
                if block not in self._wanted:
                    self._wanted = [block, *self._wanted][:self.depth]
                    self._cond.notify_all()
                if not wait:
                    return None
                began = time.perf_counter()
                self.counters["waits"] += 1
                while True:
                    self._raise_error()
                    buf = self._holding(block)
                    if buf is not None and buf.state == "ready":
                        break
                    self._cond.wait()
                self.counters["wait_seconds"] += time.perf_counter() - began
            elif buf.event is not None:
                self.counters["hits"] += 1  # read earlier, copied before: a host cache hit
            buf.busy = True
            self._clock += 1
            buf.last_used = self._clock
            return buf.tensor[:block.nbytes]

    def copied(self, block: SwappedBlock) -> None:
        """The host->device copy of ``block`` out of its staging buffer is enqueued on the
        copy stream; the buffer may be refilled once it is done."""
        with self._cond:
            buf = self._holding(block)
            if buf is None:  # pragma: no cover - request() reserved it
                return
            if buf.event is None:
                buf.event = self.streams.event()
            self.streams.record(buf.event, self.streams.h2d)
            buf.busy = False
            self._cond.notify_all()

    def read_tensor(self, block: SwappedBlock, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of a disk block, read into a new CPU tensor (for
        ``state_dict``)."""
        reads = self.reads[block]
        out = torch.empty(max(r.dst_offset + r.nbytes for r in reads), dtype=torch.uint8)
        for r in reads:
            out_view = out[r.dst_offset:r.dst_offset + r.nbytes]
            if r.dst_offset + r.nbytes <= offset or r.dst_offset >= offset + nbytes:
                continue
            if r.file.direct:
                self._read_direct(r, out_view)
            else:
                r.file.read(out_view, r.file_offset)
        return out[offset:offset + nbytes]

    # -- the reader thread ---------------------------------------------------------------

    def _holding(self, block: SwappedBlock) -> _Staging | None:
        for buf in self.staging:
            if buf.block is block:
                return buf
        return None

    def _next_job(self) -> tuple[_Staging, SwappedBlock] | None:
        wanted_ids = {id(b) for b in self._wanted}
        for block in self._wanted:
            if self._holding(block) is not None:
                continue
            victim: _Staging | None = None
            for buf in self.staging:
                if buf.busy or buf.state == "reading":
                    continue
                if buf.block is not None and id(buf.block) in wanted_ids:
                    continue
                if victim is None or buf.last_used < victim.last_used:
                    victim = buf
            return (victim, block) if victim is not None else None
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closed and self._error is None:
                    if self._in_flight < _IN_FLIGHT:
                        job = self._next_job()
                        if job is not None:
                            break
                    self._cond.wait()
                if job is None:
                    return
                buf, block = job
                buf.block, buf.state = block, "reading"
                event, buf.event = buf.event, None
                self._in_flight += 1
            try:
                if event is not None:  # its last copy to the GPU must be done before a refill
                    self.streams.synchronize(event)
                self._start_read(block, buf)
            except BaseException as exc:  # surfaced by the next request()
                self._read_done(buf, block, 0.0, exc)
                return

    def _start_read(self, block: SwappedBlock, buf: _Staging) -> None:
        """Queue every piece of ``block``'s reads; the last one to finish marks ``buf`` ready."""
        pieces: list[tuple[_DiskFile, torch.Tensor, int]] = []
        for r in self.reads[block]:
            target = buf.tensor[r.dst_offset:r.dst_offset + r.nbytes]
            step = max(_PIECE, -(-r.nbytes // self._threads))
            step = -(-step // DISK_ALIGN) * DISK_ALIGN
            pieces += [(r.file, target[start:start + step], r.file_offset + start)
                       for start in range(0, r.nbytes, step)]
        state = {"left": len(pieces), "error": None}
        lock = threading.Lock()
        began = time.perf_counter()

        def piece(file: _DiskFile, dst: torch.Tensor, offset: int) -> None:
            error = None
            try:
                file.read(dst, offset)
            except BaseException as exc:
                error = exc
            with lock:
                state["error"] = state["error"] or error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                self._read_done(buf, block, time.perf_counter() - began, state["error"])

        if not pieces:
            self._read_done(buf, block, 0.0, None)
        for file, dst, offset in pieces:
            self._pool.submit(piece, file, dst, offset)

    def _read_done(self, buf: _Staging, block: SwappedBlock, seconds: float,
                   error: BaseException | None) -> None:
        with self._cond:
            self._in_flight -= 1
            if error is not None:
                buf.block, buf.state = None, "empty"
                self._error = self._error or error
            else:
                buf.state = "ready"
                self._clock += 1
                buf.last_used = self._clock
                self.counters["reads"] += 1
                self.counters["read_bytes"] += sum(r.nbytes for r in self.reads[block])
                self.counters["read_seconds"] += seconds
            self._cond.notify_all()

    def _read_direct(self, r: DiskRead, out: torch.Tensor) -> None:
        # O_DIRECT wants an aligned buffer: read into an anonymous mapping, then copy.
        length = -(-r.nbytes // DISK_ALIGN) * DISK_ALIGN
        with mmap.mmap(-1, length) as mapping:
            raw = torch.frombuffer(mapping, dtype=torch.uint8)
            r.file.read(raw, r.file_offset)
            out.copy_(raw[:r.nbytes])
            del raw

    def _raise_error(self) -> None:
        if self._error is not None:
            raise OffloadError(f"reading a swapped block from disk failed: {self._error}",
                               hint="Check the checkpoint or cache file and the disk; the "
                                    "swapper cannot continue.") from self._error

    # -- bookkeeping ---------------------------------------------------------------------

    def staged_blocks(self) -> list[SwappedBlock]:
        with self._cond:
            return [b.block for b in self.staging if b.block is not None]

    def reset_counters(self) -> None:
        with self._cond:
            for key in self.counters:
                self.counters[key] = 0 if key not in ("read_seconds", "wait_seconds") else 0.0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._pool.shutdown(wait=True)  # reads under way finish before the files close
        files = {id(r.file): r.file for reads in self.reads.values() for r in reads}
        for f in files.values():
            f.close()
