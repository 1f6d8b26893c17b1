"""Atomic file writes: the one way vramkit replaces a file.

Every file vramkit writes for a user or a later run (a saved plan, a memory report, a quantized
checkpoint, an allocation trace, a kernel-cache entry) is written under a temporary name in the
same directory, flushed to disk and renamed over its target with :func:`os.replace`. A process
killed or interrupted while writing leaves the previous file whole, never half of a new one.

Temporary names are ``.<target name>.<pid>.<random>.tmp``: hidden, never the target's suffix (no
reader globbing ``*.safetensors`` or ``*.json`` finds one), and carrying the writer's process id,
so a later write of the same target deletes the ones their (dead) writers left behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_open", "atomic_path", "leftover_temporaries", "new_temporary"]

_SUFFIX = ".tmp"


def _prefix(target: Path) -> str:
    return f".{target.name}."


def leftover_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """The temporaries of ``path`` whose writing process is gone (killed mid-write)."""
    target = Path(path)
    prefix = _prefix(target)
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            name = entry.name
            if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
                continue
            pid = name[len(prefix):].split(".", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                found.append(target.parent / name)
    return found


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def new_temporary(path: str | os.PathLike[str]) -> tuple[int, Path]:
    """Create a temporary file for ``path`` in its directory, named so that a later call finds
    it when this process is gone; the temporaries of ``path`` that killed writers left behind
    are deleted first.

    Returns:
        ``(fd, temporary path)``: the file is open for reading and writing.

    Raises:
        OSError: when the directory does not allow it.
    """
    target = Path(path)
    for stale in leftover_temporaries(target):  # a killed run's: never read, cleaned here
        with contextlib.suppress(OSError):
            stale.unlink()
    fd, name = tempfile.mkstemp(prefix=f"{_prefix(target)}{os.getpid()}.", suffix=_SUFFIX,
                                dir=target.parent)
    return fd, Path(name)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that takes a path; renamed over ``path``
    when the block ends without an error, deleted when it raises.

    Args:
        path: the file to replace (its directory must exist).
        fsync: flush the written bytes to disk before the rename (default), so a crash of the
            machine after the rename cannot leave an empty file under the target's name.

    Yields:
        The temporary path (created empty; the writer overwrites it).
    """
    target = Path(path)
    handle, temporary = new_temporary(target)
    os.close(handle)
    try:
        yield temporary
        if fsync:
            fd = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(temporary, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = None,
                fsync: bool = True) -> Iterator[IO[Any]]:
    """``open(path, mode)`` for writing, atomically (see :func:`atomic_path`).

    Args:
        path: the file to replace.
        mode: ``"w"`` or ``"wb"``.
        encoding: for text mode (default UTF-8).
        fsync: as for :func:`atomic_path`.

    Yields:
        The open file; it is closed, flushed and renamed over ``path`` when the block ends.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path, fsync=fsync) as temporary:
        if mode == "w":
            with open(temporary, mode, encoding=encoding or "utf-8") as file:
                yield file
        else:
            with open(temporary, mode) as file:
                yield file
