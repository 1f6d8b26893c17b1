"""LazySafetensors: one logical checkpoint (a file or Hugging Face shards), read on demand.

``LazySafetensors.open(path)`` parses every header once (no tensor data is read) and answers
names, shapes, dtypes and metadata. Tensors and slices are read when asked, each straight into
its own freshly allocated tensor: a slice along the first dimension reads only the bytes of the
rows it needs.

Each file is opened once and kept open (one descriptor, and one read-only memory map in mmap
mode) until :meth:`LazySafetensors.close`. Two read modes:

* ``use_mmap=True`` (default): bytes are copied out of a shared read-only mapping; the pages a
  read touched are released from this process's mapping afterwards (``MADV_DONTNEED``), so
  streaming a file larger than RAM does not grow the resident set (the page cache keeps them).
* ``use_mmap=False``: positional reads (``os.preadv``) straight into the destination memory, for
  network filesystems and machines where mapping a file larger than RAM fails.

Returned tensors never alias the file: they stay valid after :meth:`close`, and writing to
them does not change the file.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from vramkit._validate import check_choice, check_int
from vramkit.errors import ConfigError, SafetensorsFormatError
from vramkit.io import _paths
from vramkit.io._header import (
    SafetensorsHeader,
    ShardIndex,
    TensorEntry,
    missing_shard_error,
    read_header,
    read_index,
)

if TYPE_CHECKING:  # torch is imported where tensors are made: reading headers needs none
    import torch

__all__ = ["BadShard", "LazySafetensors", "ReadThreads", "TensorSlice", "resolve_checkpoint"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_MIN_PARALLEL_PIECE = 4 << 20  # below this, splitting a read across threads costs more than it saves


def resolve_checkpoint(path: str | os.PathLike[str]) -> tuple[Path | None, list[Path]]:
    """Find the files of a checkpoint given as a file, an index file or a directory.

    A directory with one ``*.safetensors.index.json`` is read through that index; without one,
    every ``*.safetensors`` entry in it is a shard (in natural name order; an entry that is not a
    regular file is reported when it is opened, never skipped). The path is classified before
    anything is opened (:mod:`vramkit.io._paths`): a named pipe, socket or device, a symbolic-link
    loop, a Hugging Face repo id, a diffusers pipeline root or a folder of pickle checkpoints is
    refused with an error saying what it is and what to pass instead.

    Args:
        path: a ``.safetensors`` file, a ``*.safetensors.index.json`` or a directory.

    Returns:
        ``(index_path or None, [safetensors files])``; the file list is empty for an index (its
        shards come from the index).

    Raises:
        SafetensorsFormatError: for a path that is not a checkpoint (``kind`` attribute says
            what it is; a missing path is also a ``FileNotFoundError``, an unreadable one a
            ``PermissionError``), or a directory with several index files.
    """
    return _paths.resolve(path)


@dataclass(frozen=True)
class BadShard:
    """A file of a sharded checkpoint that could not be read (``on_bad_shard="skip"``).

    Args:
        path: the shard file.
        error: why (its message names the file; its hint says what to do).
    """

    path: Path
    error: SafetensorsFormatError


class ReadThreads:
    """Threads that split large reads (positional reads and page-cache copies release the GIL).

    Args:
        threads: how many reads run at once; 1 reads in the calling thread.
    """

    def __init__(self, threads: int) -> None:
        self.threads: int = check_int("read threads", threads, minimum=1)
        self._executor = (ThreadPoolExecutor(threads, thread_name_prefix="vramkit-read")
                          if threads > 1 else None)

    def run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs`` (on the threads when there are several) and re-raise the first error."""
        if self._executor is None or len(jobs) < 2:
            for job in jobs:
                job()
            return
        futures = [self._executor.submit(job) for job in jobs]
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stop the threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> ReadThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pread_into(fd: int, dst: torch.Tensor, offset: int) -> int:
    """Read from ``fd`` at ``offset`` into the contiguous uint8 CPU tensor ``dst`` (no copy in
    between: the kernel writes into its memory); returns the bytes read, fewer only at the end
    of the file."""
    return pread_scatter(fd, [dst], offset)


def pread_scatter(fd: int, dsts: Sequence[torch.Tensor], offset: int) -> int:
    """Read the file range starting at ``offset`` into the contiguous uint8 CPU tensors
    ``dsts`` in turn (one ``preadv`` with a buffer per tensor: one large request for the disk
    however the bytes are scattered in memory); returns the bytes read, fewer only at the end
    of the file."""
    views = [memoryview((ctypes.c_char * d.numel()).from_address(d.data_ptr())).cast("B")
             for d in dsts if d.numel()]
    done = 0
    while views:
        got = os.preadv(fd, views, offset + done)
        if got <= 0:
            break
        done += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return done


class _FileReader:
    """One open checkpoint file: a descriptor, and a read-only memory map in mmap mode."""

    def __init__(self, path: Path, use_mmap: bool) -> None:
        self.path = path
        # Never a blocking open: the path is checked again here (it may have changed since its
        # header was read) and opened with O_NONBLOCK.
        self._fd, info = _paths.open_file(path)
        self._size = info.st_size
        self._map: mmap.mmap | None = None
        if use_mmap and self._size > 0:
            try:
                self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            except BaseException:
                os.close(self._fd)
                raise
        self._lock = threading.Lock()
        self.bytes_read = 0

    @property
    def mode(self) -> str:
        return "mmap" if self._map is not None else "pread"

    def read_into(self, dst: torch.Tensor, offset: int, threads: ReadThreads | None = None) -> None:
        """Fill the contiguous CPU uint8 tensor ``dst`` with file bytes from ``offset``.

        Args:
            dst: 1-D contiguous ``uint8`` CPU tensor (pinned or pageable).
            offset: absolute file offset.
            threads: when given, large reads are split across its threads.
        """
        nbytes = dst.numel()
        if nbytes == 0:
            return
        if self._map is not None:
            # Touching mapped pages past a shrunken file's end is SIGBUS, not an exception.
            self._size = min(len(self._map), os.fstat(self._fd).st_size)
        self._check_range(offset, nbytes)
        if threads is not None and threads.threads > 1 and nbytes >= 2 * _MIN_PARALLEL_PIECE:
            piece = max(_MIN_PARALLEL_PIECE, -(-nbytes // threads.threads))
            piece = -(-piece // _PAGE) * _PAGE
            threads.run([functools.partial(self._read_range, dst[start:start + piece],
                                           offset + start)
                         for start in range(0, nbytes, piece)])
        else:
            self._read_range(dst, offset)
        with self._lock:
            self.bytes_read += nbytes

    def read_scatter(self, dsts: Sequence[torch.Tensor], offset: int) -> None:
        """Fill the contiguous uint8 CPU tensors ``dsts`` in turn from the file bytes starting
        at ``offset`` (one request per call in pread mode; see :func:`pread_scatter`)."""
        nbytes = sum(d.numel() for d in dsts)
        if nbytes == 0:
            return
        if self._map is not None:
            for dst in dsts:
                self.read_into(dst, offset)
                offset += dst.numel()
            return
        self._check_range(offset, nbytes)
        done = pread_scatter(self._fd, dsts, offset)
        if done < nbytes:
            raise SafetensorsFormatError(f"unexpected end of file at byte {offset + done}",
                                         path=self.path)
        with self._lock:
            self.bytes_read += nbytes

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset + nbytes > self._size:
            raise SafetensorsFormatError(f"read of {nbytes} bytes at {offset} runs past the end of "
                                         f"the {self._size}-byte file (did it change after it "
                                         "was opened?)", path=self.path)

    def _read_range(self, dst: torch.Tensor, offset: int) -> None:
        nbytes = dst.numel()
        if self._map is not None:
            with warnings.catch_warnings():
                # the mapping is read-only; the view is only ever a copy source
                warnings.simplefilter("ignore", UserWarning)
                import torch

                src = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)
            dst.copy_(src)
            del src
            # Drop this process's page references (the page cache keeps the data): without it a
            # streamed file larger than RAM would count fully in our resident set.
            start = offset - offset % _PAGE
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
            return
        done = pread_into(self._fd, dst, offset)
        if done < nbytes:
            raise SafetensorsFormatError(f"unexpected end of file at byte {offset + done}",
                                         path=self.path)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a frombuffer view is still alive; the GC closes it later
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LazySafetensors:
    """A safetensors checkpoint (one file or several shards) opened without reading tensor data.

    Create it with :meth:`open`. Use as a context manager, or call :meth:`close`, to release the
    open files.

    Args:
        headers: the validated header of every file, in read order.
        index: the shard index, when the checkpoint came with one.
        use_mmap: read through a memory map (default) or positional reads.
        source: the path the checkpoint was opened from (for messages).
        bad_shards: shards left out because they could not be read (``open(...,
            on_bad_shard="skip")``); the index's entries pointing to them are not checked.
    """

    def __init__(self, headers: Sequence[SafetensorsHeader], *, index: ShardIndex | None = None,
                 use_mmap: bool = True, source: Path | None = None,
                 bad_shards: Sequence[BadShard] = ()) -> None:
        self._headers = list(headers)
        self.index = index
        self.use_mmap = bool(use_mmap)
        self.bad_shards: list[BadShard] = list(bad_shards)
        if source is None and not self._headers:
            raise ConfigError("LazySafetensors needs a source path when it has no headers",
                              hint="Build it with LazySafetensors.open(path), which reads the "
                                   "headers for you.")
        self.source = source if source is not None else self._headers[0].path
        self._entries: dict[str, TensorEntry] = {}
        for header in self._headers:
            for name, entry in header.tensors.items():
                other = self._entries.get(name)
                if other is not None:
                    raise SafetensorsFormatError(
                        f"the tensor is stored in two shards, {other.path.name} and "
                        f"{entry.path.name}", path=self.source, tensor=name,
                        hint="The shards come from different checkpoints; download them again.")
                self._entries[name] = entry
        if index is not None:
            self._check_index(index, {bad.path for bad in self.bad_shards})
        self._readers: dict[Path, _FileReader] = {}
        self._closed_bytes_read = 0
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, use_mmap: bool = True,
             on_bad_shard: str = "raise") -> LazySafetensors:
        """Open a checkpoint and parse its headers (no tensor data is read).

        The path is classified before anything is opened (never blocking: a named pipe, socket
        or device is refused; see :func:`resolve_checkpoint` for the other cases).

        Args:
            path: a ``.safetensors`` file, a ``*.safetensors.index.json`` (Hugging Face sharded
                layout), or a directory holding either.
            use_mmap: read tensor bytes through a memory map (default ``True``) or with
                positional reads (``False``: network filesystems, files larger than RAM).
            on_bad_shard: ``"raise"`` (default): a shard that cannot be read (missing,
                malformed, not a regular file, a pickle) raises its error, which names the shard
                file; ``"skip"``: leave it out and record it in :attr:`bad_shards` (for reports
                such as ``vramkit inspect``; never load a model from a partial checkpoint).

        Returns:
            The opened checkpoint.

        Raises:
            SafetensorsFormatError: for a path that is not a checkpoint, or any malformed file
                or index (file and tensor named). A missing path is also a
                ``FileNotFoundError``.
            ConfigError: for an ``on_bad_shard`` other than ``"raise"`` or ``"skip"``.
        """
        skip = check_choice("on_bad_shard", on_bad_shard, ("raise", "skip")) == "skip"
        index_path, files = resolve_checkpoint(path)
        index = read_index(index_path, check_shards=not skip) if index_path is not None else None
        if index is not None:
            files = index.shards
        headers: list[SafetensorsHeader] = []
        bad: list[BadShard] = []
        for file in files:
            try:
                if index is not None and not os.path.lexists(file):
                    raise missing_shard_error(index.path, file)
                headers.append(read_header(file))
            except SafetensorsFormatError as err:
                if not skip:
                    raise
                bad.append(BadShard(file, err))
        return cls(headers, index=index, use_mmap=use_mmap, source=Path(path), bad_shards=bad)

    def _check_index(self, index: ShardIndex, skipped: set[Path]) -> None:
        for name, shard in index.weight_map.items():
            if shard in skipped:
                continue
            entry = self._entries.get(name)
            if entry is None:
                raise SafetensorsFormatError(f"the index maps the tensor to {shard.name}, which "
                                             "does not hold it", path=index.path, tensor=name)
            if entry.path != shard:
                raise SafetensorsFormatError(f"the index maps the tensor to {shard.name} but it is "
                                             f"stored in {entry.path.name}", path=index.path,
                                             tensor=name)
        extra = [name for name in self._entries if name not in index.weight_map]
        if extra:
            logger.warning("%s: %d tensor(s) are in the shards but not in the index's weight_map "
                           "(e.g. %r); loading them too", index.path, len(extra), extra[0])

    # -- what is in it --------------------------------------------------------------------

    @property
    def files(self) -> list[Path]:
        """The safetensors files of the checkpoint, in read order."""
        return [header.path for header in self._headers]

    @property
    def headers(self) -> list[SafetensorsHeader]:
        """The validated header of each file."""
        return list(self._headers)

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` strings of the files, merged (the first file wins)."""
        merged: dict[str, str] = {}
        for header in reversed(self._headers):
            merged.update(header.metadata)
        return merged

    def tensor_names(self) -> list[str]:
        """Every tensor name, in read order (file by file, by data offset)."""
        return list(self._entries)

    def entry(self, name: str) -> TensorEntry:
        """The header record of ``name`` (dtype, shape, file, offsets).

        Raises:
            KeyError: when the checkpoint holds no such tensor.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.source}: no tensor named {name!r}") from None

    def entries(self, names: Sequence[str] | None = None) -> list[TensorEntry]:
        """Header records of ``names`` (default all), in read order."""
        if names is None:
            return list(self._entries.values())
        wanted = set(names)
        for name in wanted:
            self.entry(name)
        return [e for n, e in self._entries.items() if n in wanted]

    def shape(self, name: str) -> torch.Size:
        """The shape of ``name``."""
        import torch

        return torch.Size(self.entry(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype of ``name``."""
        return self.entry(name).dtype

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the whole checkpoint."""
        return sum(entry.nbytes for entry in self._entries.values())

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from the files so far (slices count only what they read)."""
        return self._closed_bytes_read + sum(reader.bytes_read
                                             for reader in list(self._readers.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    # -- reading --------------------------------------------------------------------------

    def reader(self, path: Path) -> _FileReader:
        """The open reader of one of the checkpoint's files (opened on first use)."""
        with self._lock:
            reader = self._readers.get(path)
            if reader is None:
                reader = self._readers[path] = _FileReader(path, self.use_mmap)
            return reader

    def read_bytes(self, entry: TensorEntry, dst: torch.Tensor, start: int = 0,
                   threads: ReadThreads | None = None) -> None:
        """Copy bytes ``[start, start + dst.numel())`` of a tensor's data into ``dst``.

        Args:
            entry: the tensor (from :meth:`entry`).
            dst: a contiguous 1-D ``uint8`` CPU tensor.
            start: byte offset inside the tensor's data.
            threads: threads to split large reads across (default: read in this thread).
        """
        if start < 0 or start + dst.numel() > entry.nbytes:
            raise ConfigError(f"bytes [{start}, {start + dst.numel()}) are outside tensor "
                              f"{entry.name!r} ({entry.nbytes} bytes)",
                              hint="Keep start >= 0 and start + dst.numel() <= entry.nbytes; read "
                                   "a large tensor in several calls with increasing start.")
        self.reader(entry.path).read_into(dst, entry.file_offset + start, threads)

    def load_tensor(self, name: str, index: Any = None, *,
                    threads: ReadThreads | None = None) -> torch.Tensor:
        """Read one tensor (or a slice of it) into a new CPU tensor of its stored dtype.

        Args:
            name: the tensor's name.
            index: ``None`` (default: the whole tensor), or basic indexing -- an int, a slice with
                a positive step, ``...``, or a tuple of those. Only the rows covering the first
                dimension's index are read from the file.
            threads: threads to split large reads across (default: this thread).

        Returns:
            A tensor that does not alias the file.

        Raises:
            KeyError: for an unknown name.
            ConfigError: for an index that is not supported (negative steps, tensors, too many
                dimensions).
        """
        entry = self.entry(name)
        if index is None:
            return self._read_rows(entry, 0, entry.shape[0] if entry.shape else 1, threads)
        return self._load_indexed(entry, index, threads)

    def load_tensors(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Read several tensors (default all), in file order.

        Args:
            names: the tensors to read (default all).

        Returns:
            name -> CPU tensor.
        """
        return {entry.name: self.load_tensor(entry.name) for entry in self.entries(names)}

    def get_slice(self, name: str) -> TensorSlice:
        """A handle whose ``[...]`` reads only the needed rows of ``name``."""
        return TensorSlice(self, self.entry(name))

    def _read_rows(self, entry: TensorEntry, row0: int, row1: int,
                   threads: ReadThreads | None) -> torch.Tensor:
        import torch

        if not entry.shape:  # a 0-d tensor is one "row"
            raw = torch.empty(entry.nbytes, dtype=torch.uint8)
            self.read_bytes(entry, raw, 0, threads)
            return raw.view(entry.dtype).view(())
        row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
        raw = torch.empty((row1 - row0) * row_bytes, dtype=torch.uint8)
        self.read_bytes(entry, raw, row0 * row_bytes, threads)
        return raw.view(entry.dtype).view(row1 - row0, *entry.shape[1:])

    def _load_indexed(self, entry: TensorEntry, index: Any,
                      threads: ReadThreads | None) -> torch.Tensor:
        parts = index if isinstance(index, tuple) else (index,)
        if not entry.shape:
            raise ConfigError(f"tensor {entry.name!r} is 0-dimensional and cannot be sliced",
                              hint="Load a 0-d tensor whole, with load_tensor(name) and no index.")
        for part in parts:
            if not (part is Ellipsis or isinstance(part, slice)
                    or (isinstance(part, int) and not isinstance(part, bool))):
                raise ConfigError(f"unsupported index {part!r}: use ints, slices and ...",
                                  hint="Load the tensor and index it with torch for advanced "
                                       "indexing.")
            if isinstance(part, slice) and part.step is not None and part.step <= 0:
                raise ConfigError(f"slice step must be positive, got {part.step}",
                                  hint="Use a positive step (e.g. [::2]), or load the range and "
                                       "call torch.flip for reversed order.")
        if sum(part is not Ellipsis for part in parts) > len(entry.shape):
            raise ConfigError(f"too many indices for tensor {entry.name!r} of shape "
                              f"{list(entry.shape)}",
                              hint="Give at most one index per dimension of the tensor (see "
                                   "entry.shape); use ... for the rest.")
        first = parts[0]
        rows = entry.shape[0]
        if first is Ellipsis:
            return self._read_rows(entry, 0, rows, threads)[parts]
        if isinstance(first, int):
            row = first + rows if first < 0 else first
            if not 0 <= row < rows:
                raise IndexError(f"index {first} is out of range for dimension 0 of tensor "
                                 f"{entry.name!r} (size {rows})")
            return self._read_rows(entry, row, row + 1, threads)[(0, *parts[1:])].clone()
        start, stop, step = first.indices(rows)
        chosen = range(start, stop, step)
        if not chosen:
            return self._read_rows(entry, 0, 0, threads)[(slice(None), *parts[1:])]
        row0, row1 = chosen[0], chosen[-1] + 1
        block = self._read_rows(entry, row0, row1, threads)
        result = block[(slice(0, row1 - row0, step), *parts[1:])]
        return result if result.numel() == block.numel() else result.clone()

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the open files (tensors already read stay valid)."""
        with self._lock:
            readers, self._readers = self._readers, {}
        for reader in readers.values():
            self._closed_bytes_read += reader.bytes_read
            reader.close()

    def __enter__(self) -> LazySafetensors:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finalizer
            pass

    def __repr__(self) -> str:
        return (f"LazySafetensors({str(self.source)!r}, {len(self._entries)} tensors, "
                f"{len(self._headers)} file(s), {self.nbytes} bytes)")


class TensorSlice:
    """A lazily read tensor: ``handle[index]`` reads only the rows the index needs.

    Args:
        checkpoint: the open checkpoint.
        entry: the tensor's header record.
    """

    def __init__(self, checkpoint: LazySafetensors, entry: TensorEntry) -> None:
        self._checkpoint = checkpoint
        self._entry = entry

    @property
    def shape(self) -> torch.Size:
        """The full tensor's shape."""
        import torch

        return torch.Size(self._entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype."""
        return self._entry.dtype

    def get_shape(self) -> list[int]:
        """The full tensor's shape as a list (the ``safetensors`` slice API)."""
        return list(self._entry.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._checkpoint.load_tensor(self._entry.name, index)

    def __repr__(self) -> str:
        return f"TensorSlice({self._entry.name!r}, {list(self._entry.shape)}, {self._entry.dtype})"
