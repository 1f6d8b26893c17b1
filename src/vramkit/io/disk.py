"""How fast a checkpoint comes off the disk: one timed sequential read, cold when possible.

:func:`measure_read_bandwidth` reads up to ``max_bytes`` of a file (or of the largest file in a
checkpoint directory) in ``block_bytes`` requests and times it. A read that the page cache
serves measures memory, not the disk, so by default the read bypasses the cache:

1. ``O_DIRECT`` (Linux): reads go straight to the device into a page-aligned buffer (an
   anonymous ``mmap``); the kernel writes back any dirty cached pages of the range first.
   Some filesystems refuse it (tmpfs before Linux 6.6, some network and FUSE filesystems).
2. Otherwise buffered reads, after :func:`drop_page_cache` asked the kernel to evict the file's
   cached pages (``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed; the file's data is
   synced first, since dirty pages are not evicted). The result says whether that was possible:
   its ``method`` is ``"O_DIRECT"``, ``"buffered, page cache dropped"`` or ``"buffered, page
   cache may be warm"``.

Equivalent measurement: ``fio --name=r --rw=read --bs=16M --direct=1 --size=1G
--filename=PATH`` (or ``dd if=PATH of=/dev/null bs=16M iflag=direct``).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vramkit._validate import check_bool, check_int, check_size
from vramkit.errors import ConfigError, VramkitError
from vramkit.units import format_size

#: The most reads :func:`measure_read_bandwidth` keeps in flight at once.
MAX_READ_THREADS = 256

__all__ = ["DiskReadResult", "drop_page_cache", "measure_read_bandwidth"]

_ALIGN = 4096  # O_DIRECT offsets, sizes and buffer addresses: a multiple of the logical block
METHODS = ("O_DIRECT", "buffered, page cache dropped", "buffered, page cache may be warm")


@dataclass(frozen=True)
class DiskReadResult:
    """One timed sequential read.

    Attributes:
        path: the file read (for a directory, its largest file).
        bytes: bytes read.
        seconds: time the reads took (opening the file and dropping its cache not included).
        gb_per_s: ``bytes / seconds / 1e9`` (decimal GB, as disks are rated).
        method: ``"O_DIRECT"``, ``"buffered, page cache dropped"`` or ``"buffered, page cache
            may be warm"``.
        threads: reads in flight at once (each thread reads the next ``block_bytes`` range).
    """

    path: str
    bytes: int
    seconds: float
    gb_per_s: float
    method: str
    threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The fields, as JSON-ready data."""
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.gb_per_s:.2f} GB/s reading {format_size(self.bytes)} of {self.path} in "
                f"{self.seconds:.3f} s ({self.method}"
                + (f", {self.threads} threads" if self.threads > 1 else "") + ")")


# -- errors --------------------------------------------------------------------------------------


class _DiskPathNotFoundError(ConfigError, FileNotFoundError):
    """A path to measure that does not exist (also a ``FileNotFoundError``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_os_error, (type(self), self.__dict__.copy()))


class _DiskPathPermissionError(ConfigError, PermissionError):
    """A path to measure that this process may not read (also a ``PermissionError``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_os_error, (type(self), self.__dict__.copy()))


def _rebuild_os_error(cls: type[VramkitError], state: dict[str, Any]) -> VramkitError:
    # errors._rebuild calls cls.__new__(cls), which an OSError subclass refuses
    err = OSError.__new__(cls)  # type: ignore[arg-type]
    Exception.__init__(err, state.get("message", ""))
    err.__dict__.update(state)
    return err


_PATH_HINT = "Give the path of a checkpoint file, or of a directory holding one."


def _os_error(path: Path, err: OSError) -> VramkitError:
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        return _DiskPathNotFoundError(f"{path}: does not exist", hint=_PATH_HINT)
    if err.errno in (errno.EACCES, errno.EPERM):
        return _DiskPathPermissionError(
            f"{path}: permission denied", hint="Check the permissions of the file and of the "
                                               "directories above it, or give another path.")
    return ConfigError(f"{path}: cannot be read: {err.strerror or err}",
                       hint="Check that the path is on a mounted, readable filesystem.")


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as err:
        raise _os_error(path, err) from None
    except ValueError as err:  # an embedded NUL byte
        raise ConfigError(f"{path!r} is not a valid path ({err})", hint=_PATH_HINT) from None


def _regular_files(directory: Path) -> list[tuple[int, Path]]:
    """``(size, path)`` of every regular file under ``directory`` (file links followed, so a
    Hugging Face cache snapshot's links to its blobs count; directory links not)."""
    found: list[tuple[int, Path]] = []
    for folder, _dirs, names in os.walk(directory):
        for name in names:
            candidate = Path(folder) / name
            try:
                info = os.stat(candidate)
            except OSError:
                continue  # a dangling link, a file removed meanwhile
            if stat.S_ISREG(info.st_mode):
                found.append((info.st_size, candidate))
    return found


def _file_to_read(path: Path) -> tuple[Path, int]:
    """The regular file to time and its size: ``path``, or the largest file under it."""
    info = _stat(path)
    if stat.S_ISDIR(info.st_mode):
        files = _regular_files(path)
        if not files:
            raise ConfigError(f"{path}: the directory holds no regular file to read",
                              hint=_PATH_HINT)
        _size, largest = max(files, key=lambda item: (item[0], str(item[1])))
        path, info = largest, _stat(largest)
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"{path}: is not a regular file (file mode {stat.filemode(info.st_mode)})",
            hint="Give a file on the disk to measure; pipes, sockets and devices are not read.")
    if info.st_size == 0:
        raise ConfigError(f"{path}: the file is empty, there is nothing to read",
                          hint="Give a file with data in it (a checkpoint), or a directory "
                               "whose largest file is one.")
    return path, info.st_size


# -- the page cache ------------------------------------------------------------------------------


def _drop_file(path: Path) -> bool:
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return False
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            os.fdatasync(fd)  # dirty pages are not evicted: make them clean first
        except (OSError, AttributeError):
            pass
        fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def drop_page_cache(path: str | os.PathLike[str]) -> bool:
    """Ask the kernel to evict ``path``'s pages from the page cache (every regular file under
    it, for a directory), so that the next read comes from the disk.

    Uses ``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``, which needs no root: it evicts clean
    pages (each file's data is synced first so that its pages are clean), and pages another
    process has mapped stay.

    Returns:
        ``True`` when every file was advised; ``False`` where ``posix_fadvise`` does not exist
        (macOS, Windows) or a file could not be opened or advised (nothing is raised).
    """
    target = Path(path)
    if target.is_dir():
        files = _regular_files(target)
        return all([_drop_file(file) for _size, file in files])
    return _drop_file(target)


# -- the measurement -----------------------------------------------------------------------------


def _read_ranges(fd: int, target: int, block: int, threads: int, want: Callable[[int], int]
                 ) -> tuple[int, float]:
    """Read ``[0, target)`` of ``fd`` in ``block`` ranges, ``threads`` of them in flight (each
    thread takes the next range); ``want(n)`` is the request size for ``n`` bytes left in a
    range. Returns ``(bytes, seconds)``."""
    offsets = iter(range(0, target, block))
    lock = threading.Lock()
    total = [0]

    def worker() -> None:
        buffer = mmap.mmap(-1, block)  # anonymous mappings are page-aligned (O_DIRECT)
        view = memoryview(buffer)
        try:
            while True:
                with lock:
                    offset = next(offsets, None)
                if offset is None:
                    return
                request = want(min(block, target - offset))
                got = os.preadv(fd, [view[:request]], offset)
                with lock:
                    total[0] += min(got, target - offset)
                if got < request:
                    return  # end of file
        finally:
            view.release()
            buffer.close()

    start = time.perf_counter()
    if threads == 1:
        worker()
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="vramkit-disk-bw") as pool:
            for future in [pool.submit(worker) for _ in range(threads)]:
                future.result()
    return total[0], time.perf_counter() - start


def _read_direct(path: Path, size: int, max_bytes: int, block: int,
                 threads: int) -> tuple[int, float] | None:
    """``(bytes, seconds)`` read with ``O_DIRECT``, or ``None`` where it cannot be used."""
    o_direct = getattr(os, "O_DIRECT", 0)
    # Every request must be a whole number of blocks: stop at max_bytes rounded down, unless
    # the end of the file comes first (the short read at EOF is fine).
    target = size if size <= max_bytes else max_bytes // _ALIGN * _ALIGN
    if not o_direct or getattr(os, "preadv", None) is None or target == 0:
        return None
    block = max(_ALIGN, -(-block // _ALIGN) * _ALIGN)
    try:
        fd = os.open(path, os.O_RDONLY | o_direct | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None  # the filesystem refuses O_DIRECT
        raise _os_error(path, err) from None
    try:
        with mmap.mmap(-1, _ALIGN) as probe:  # accepted at open, refused at read on some
            try:                               # FUSE filesystems
                with memoryview(probe) as view:
                    os.preadv(fd, [view], 0)
            except OSError as err:
                if err.errno == errno.EINVAL:
                    return None
                raise
        return _read_ranges(fd, target, block, threads,
                            lambda n: -(-n // _ALIGN) * _ALIGN)
    finally:
        os.close(fd)


def _read_buffered(path: Path, size: int, max_bytes: int, block: int,
                   threads: int) -> tuple[int, float]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise _os_error(path, err) from None
    try:
        target = min(size, max_bytes)
        if target == 0:
            return 0, 0.0
        return _read_ranges(fd, target, min(block, target), threads, lambda n: n)
    finally:
        os.close(fd)


def measure_read_bandwidth(path: str | os.PathLike[str], *, max_bytes: int | str = "1GiB",
                           block_bytes: int | str = "16MiB", cold: bool = True,
                           threads: int = 1) -> DiskReadResult:
    """Time a sequential read of ``path`` (of its largest file, for a directory).

    Args:
        path: a file, or a directory (a checkpoint folder): its largest regular file is read.
        max_bytes: read at most this many bytes (default ``"1GiB"``); a smaller file is read
            whole.
        block_bytes: bytes per read request (default ``"16MiB"``, rounded up to 4 KiB for
            ``O_DIRECT``).
        cold: measure the disk, not the page cache (default ``True``): ``O_DIRECT`` where the
            filesystem takes it, else buffered reads after :func:`drop_page_cache`. ``False``
            reads through the page cache as it is (what a second load of the same file sees).
        threads: reads in flight at once (default 1: one sequential stream). NVMe and network
            disks often reach their rated bandwidth only with several (vramkit's loaders use
            up to 8).

    Returns:
        A :class:`DiskReadResult` (its ``method`` says how cold the read was).

    Raises:
        ConfigError: a path that does not exist (also a ``FileNotFoundError``), cannot be read
            (also a ``PermissionError``), is not a regular file or a directory holding one, or
            is an empty file; a bad ``max_bytes`` / ``block_bytes`` / ``cold``.
        OSError: the disk failed while being read.
    """
    max_bytes = check_size("measure_read_bandwidth.max_bytes", max_bytes, minimum=1)
    block_bytes = check_size("measure_read_bandwidth.block_bytes", block_bytes, minimum=1)
    cold = check_bool("measure_read_bandwidth.cold", cold)
    threads = check_int("measure_read_bandwidth.threads", threads, minimum=1,
                        maximum=MAX_READ_THREADS)
    file, size = _file_to_read(Path(path))
    measured = _read_direct(file, size, max_bytes, block_bytes, threads) if cold else None
    if measured is not None:
        method = METHODS[0]
    else:
        dropped = cold and drop_page_cache(file)
        method = METHODS[1] if dropped else METHODS[2]
        measured = _read_buffered(file, size, max_bytes, block_bytes, threads)
    nbytes, seconds = measured
    return DiskReadResult(path=str(file), bytes=nbytes, seconds=seconds,
                          gb_per_s=nbytes / max(seconds, 1e-9) / 1e9, method=method,
                          threads=threads)
