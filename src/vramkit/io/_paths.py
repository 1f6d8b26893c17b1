"""What a checkpoint path is, decided before anything opens it.

The one place that answers "can vramkit read this as a safetensors checkpoint, and if not, what
is it?" for :meth:`~vramkit.io.lazy.LazySafetensors.open`, the
:class:`~vramkit.io.loader.MemoryEfficientLoader` and ``vramkit inspect``:

* a regular file or a directory: go on;
* a named pipe (FIFO), a Unix socket, a character or block device: refused *before* ``open()``
  (opening a FIFO blocks until a writer appears; opening some devices acts on them);
* a path that does not exist: a missing file, a dangling symbolic link, a symbolic-link loop,
  or a Hugging Face repo id (vramkit reads local files and does not download);
* permission denied;
* a directory without safetensors: a diffusers pipeline root (its component folders named), a
  folder of PyTorch pickle checkpoints, a parent of weight folders, or an empty folder;
* a pickle checkpoint (``.ckpt``, ``.bin``, ``.pt``, ``.pth``; a ``torch.save`` zip archive, a
  raw pickle), recognised by name or by its first bytes: vramkit does not unpickle.

Files are opened with ``O_NONBLOCK`` and checked again with ``fstat``, so a path that becomes a
FIFO between the check and the open cannot block either.

Every refusal is a :class:`vramkit.errors.SafetensorsFormatError` whose ``kind`` attribute names
what the path is (``"fifo"``, ``"symlink-loop"``, ``"pickle"``...) and whose hint says what to
do. A path that does not exist is also a ``FileNotFoundError`` and one that cannot be read a
``PermissionError``, so code that caught those before still does.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramkit.errors import SafetensorsFormatError, VramkitError

__all__ = [
    "PICKLE_SUFFIXES",
    "check_path",
    "directory_error",
    "list_directory",
    "not_safetensors_error",
    "open_file",
    "os_error",
    "pipeline_root_error",
    "resolve",
]

PICKLE_SUFFIXES = (".ckpt", ".bin", ".pt", ".pth", ".pkl", ".pickle")
"""File name endings of PyTorch/pickle checkpoints."""

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format is a zip archive holding a pickle
_NAMES_SHOWN = 8
_LINK_HOPS = 8

_UNREADABLE_HINT = ("Pass a .safetensors file, a *.safetensors.index.json or a directory holding "
                    "them. vramkit memory-maps checkpoints and reads them at offsets, which pipes, "
                    "sockets and devices do not allow: save the stream to a file first.")

_CONVERT_HINT = ("Convert it once, in a Python session: `sd = torch.load(PATH, map_location='cpu', "
                 "weights_only=True)` (for a .ckpt, then `sd = sd['state_dict']`), then "
                 "`safetensors.torch.save_file({k: v.clone().contiguous() for k, v in sd.items()}, "
                 "'model.safetensors')`. weights_only=True refuses pickles that would run code; "
                 "drop it only for a file whose origin you trust.")


# -- the errors ------------------------------------------------------------------------------


class _CheckpointPathError(SafetensorsFormatError):
    """A checkpoint path vramkit cannot read; ``kind`` says what the path is.

    Kinds: ``missing``, ``dangling-symlink``, ``symlink-loop``, ``repo-id``, ``not-a-directory``,
    ``permission``, ``fifo``, ``socket``, ``char-device``, ``block-device``, ``special-file``,
    ``directory``, ``empty-directory``, ``pipeline-root``, ``pickle-directory``,
    ``parent-directory``, ``pickle``, ``json``, ``os-error``.
    """

    def __init__(self, message: str, path: object | None = None, kind: str = "os-error",
                 hint: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message, path=path, tensor=tensor, hint=hint)
        self.kind = kind


def _rebuild_os_error(cls: type[VramkitError], state: dict[str, Any]) -> VramkitError:
    # errors._rebuild calls cls.__new__(cls), which an OSError subclass refuses
    err = OSError.__new__(cls)  # type: ignore[arg-type]
    Exception.__init__(err, state.get("message", ""))
    err.__dict__.update(state)
    return err


class _CheckpointNotFoundError(_CheckpointPathError, FileNotFoundError):
    """A checkpoint path that does not exist (also a ``FileNotFoundError``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_os_error, (type(self), self.__dict__.copy()))


class _CheckpointPermissionError(_CheckpointPathError, PermissionError):
    """A checkpoint path this process may not read (also a ``PermissionError``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_os_error, (type(self), self.__dict__.copy()))


# -- stat before open ------------------------------------------------------------------------


def check_path(path: Path) -> os.stat_result:
    """``stat`` a checkpoint path (following links) and refuse what vramkit cannot read.

    Args:
        path: the path as given.

    Returns:
        The ``stat`` of a regular file or a directory.

    Raises:
        SafetensorsFormatError: with ``kind`` naming what the path is (see the module docstring).
    """
    try:
        info = os.stat(path)
    except OSError as err:
        raise os_error(path, err) from None
    except ValueError as err:  # an embedded NUL byte
        raise _CheckpointPathError(f"is not a valid path ({err})", path, "os-error",
                                   hint="Pass the path of a checkpoint file or directory.") from None
    if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
        return info
    raise _special_file_error(path, info.st_mode)


def open_file(path: Path) -> tuple[int, os.stat_result]:
    """Open a checkpoint file for reading without ever blocking on it.

    The path is checked with ``stat`` first (a FIFO, socket or device is never opened), then
    opened with ``O_NONBLOCK`` and checked again with ``fstat`` (so a FIFO swapped in between
    returns at once and is refused), and the descriptor is switched back to blocking reads.

    Args:
        path: the file.

    Returns:
        ``(file descriptor, its fstat)``; the caller closes the descriptor.

    Raises:
        SafetensorsFormatError: for anything but a readable regular file (``kind`` says what).
    """
    info = check_path(path)
    if stat.S_ISDIR(info.st_mode):
        raise _directory_not_file(path)
    flags = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_NOCTTY", 0))
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise os_error(path, err) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise _directory_not_file(path)
        if not stat.S_ISREG(info.st_mode):
            raise _special_file_error(path, info.st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _directory_not_file(path: Path) -> _CheckpointPathError:
    return _CheckpointPathError(
        "is a directory where a checkpoint file was expected", path, "directory",
        hint="Name a .safetensors file here, or pass the directory itself as the checkpoint.")


_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "fifo", "a named pipe (FIFO), not a regular file (opening it would wait for a "
                            "writer)"),
    (stat.S_ISSOCK, "socket", "a Unix socket, not a regular file"),
    (stat.S_ISCHR, "char-device", "a character device, not a regular file"),
    (stat.S_ISBLK, "block-device", "a block device (a disk or partition), not a regular file"),
)


def _special_file_error(path: Path, mode: int) -> _CheckpointPathError:
    for test, kind, what in _SPECIAL_KINDS:
        if test(mode):
            return _CheckpointPathError(f"is {what}", path, kind, hint=_UNREADABLE_HINT)
    return _CheckpointPathError(f"is not a regular file (file mode {stat.filemode(mode)})", path,
                                "special-file", hint=_UNREADABLE_HINT)


def os_error(path: Path, err: OSError) -> SafetensorsFormatError:
    """The vramkit error for an ``OSError`` raised while reaching or reading ``path``."""
    code = err.errno
    if code == errno.ELOOP:
        return _symlink_loop_error(path)
    if code == errno.ENOENT:
        return _missing_error(path)
    if code == errno.ENOTDIR:
        return _CheckpointNotFoundError(
            "does not exist: a part of the path before the last is a file, not a directory",
            path, "not-a-directory", hint="Check the path: only its last part may be a file.")
    if code in (errno.EACCES, errno.EPERM):
        return _CheckpointPermissionError(
            f"permission denied: this process (user id {os.geteuid()}) may not read it",
            path, "permission",
            hint=f"Check the permissions with `ls -ld {path}` and of the directories above it; "
                 "make it readable (chmod a+r) or run as a user who can read it.")
    if code == errno.ENXIO:  # open() of a socket, or a device with nothing behind it
        try:
            return _special_file_error(path, os.stat(path).st_mode)
        except OSError:
            pass
    reason = err.strerror or str(err)
    return _CheckpointPathError(f"cannot be read: {reason}", path, "os-error",
                                hint="Check that the file is on a mounted, readable filesystem "
                                     "and retry; re-copy it if the disk reports errors.")


def _link_chain(path: Path) -> list[str]:
    chain = [str(path)]
    current = path
    for _ in range(_LINK_HOPS):
        try:
            target = os.readlink(current)
        except OSError:
            break
        current = current.parent / target
        chain.append(target)
        if os.path.normpath(current) == os.path.normpath(path):
            break
    return chain


def _symlink_loop_error(path: Path) -> _CheckpointPathError:
    if os.path.islink(path):
        chain = " -> ".join(_link_chain(path))
        message = f"is a symbolic-link loop ({chain}), not a file"
    else:
        message = "goes through a symbolic-link loop in one of its directories"
    return _CheckpointPathError(
        message, path, "symlink-loop",
        hint="Fix or remove the looping links (`ls -l` shows where each points) and pass the real "
             "checkpoint file or directory.")


_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _looks_like_repo_id(path: Path) -> bool:
    text = str(path)
    if not _REPO_ID.fullmatch(text) or text.endswith((".safetensors", ".json", *PICKLE_SUFFIXES)):
        return False
    return not os.path.lexists(text.split("/", 1)[0])


def _hub_cache() -> Path:
    # huggingface_hub's own rules (constants.py), without importing it
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"),
                                                     "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of ``repo_id`` in the Hugging Face cache, if one was downloaded."""
    repo = _hub_cache() / ("models--" + repo_id.replace("/", "--"))
    try:
        revision = (repo / "refs" / "main").read_text().strip()
        if revision and (repo / "snapshots" / revision).is_dir():
            return repo / "snapshots" / revision
        snapshots = [p for p in (repo / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def _missing_error(path: Path) -> _CheckpointPathError:
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return _CheckpointNotFoundError(
            f"is a symbolic link to {target}, which does not exist", path, "dangling-symlink",
            hint="The link's target was moved or deleted (in a Hugging Face cache: its blob was "
                 "removed); download the checkpoint again or pass the real file.")
    if _looks_like_repo_id(path):
        repo_id = str(path)
        local_dir = repo_id.rsplit("/", 1)[1]
        snapshot = _cached_snapshot(repo_id)
        found = (f"; a downloaded copy is in the Hugging Face cache: pass {snapshot}"
                 if snapshot is not None else "")
        return _CheckpointNotFoundError(
            "does not exist here; it looks like a Hugging Face repo id, and vramkit reads local "
            "files only (it does not download)" + found, path, "repo-id",
            hint=f"Download it first: `hf download {repo_id} --local-dir {local_dir}` (the "
                 "huggingface_hub CLI; older versions call it huggingface-cli), or in Python "
                 f"`huggingface_hub.snapshot_download({repo_id!r})`, which returns the local "
                 "path. Then pass that directory (for a diffusers pipeline, its transformer/ "
                 f"or unet/ folder). If you meant a local path, it is relative to {os.getcwd()}.")
    return _CheckpointNotFoundError(
        "does not exist", path, "missing",
        hint=f"Check the path (a relative path starts at the current directory, {os.getcwd()}).")


# -- what files make the checkpoint ----------------------------------------------------------


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def resolve(path: str | os.PathLike[str]) -> tuple[Path | None, list[Path]]:
    """The files of a checkpoint given as a file, an index file or a directory.

    See :func:`vramkit.io.lazy.resolve_checkpoint`, which documents it.
    """
    path = Path(path)
    info = check_path(path)
    if stat.S_ISDIR(info.st_mode):
        entries = list_directory(path)
        indexes = sorted(e.name for e in entries
                         if e.name.endswith(".safetensors.index.json") and not _is_dir(e))
        if len(indexes) > 1:
            raise SafetensorsFormatError(f"the directory holds several index files "
                                         f"({', '.join(indexes)})", path=path,
                                         hint="Pass the index file of the checkpoint you want "
                                              "instead of the directory.")
        if indexes:
            return path / indexes[0], []
        # Every entry named *.safetensors that is not a directory: a FIFO, a dangling link or a
        # link loop among the shards is reported by name when it is opened, never skipped.
        files = sorted((path / e.name for e in entries
                        if e.name.endswith(".safetensors") and not _is_dir(e)), key=_natural_key)
        if not files:
            raise directory_error(path, entries)
        return None, files
    if path.name == "model_index.json":
        raise pipeline_root_error(path.parent)
    if path.name.endswith(".json"):
        return path, []
    return None, [path]


# -- directories -----------------------------------------------------------------------------


def list_directory(path: Path) -> list[os.DirEntry[str]]:
    """The entries of a checkpoint directory (errors reported as vramkit errors)."""
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError as err:
        raise os_error(path, err) from None


def _is_dir(entry: os.DirEntry[str] | Path) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a link loop, a vanished entry
        return False


def _holds_safetensors(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(e.name.endswith(".safetensors") or e.name.endswith(".safetensors.index.json")
                       for e in entries)
    except OSError:
        return False


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_NAMES_SHOWN])
    return shown + (f" and {len(items) - _NAMES_SHOWN} more" if len(items) > _NAMES_SHOWN else "")


def directory_error(path: Path,
                    entries: Sequence[os.DirEntry[str]] | None = None) -> _CheckpointPathError:
    """Why a directory holding no ``*.safetensors`` file is not a checkpoint, and where to look.

    Args:
        path: the directory.
        entries: its entries, when already listed.
    """
    if entries is None:
        entries = list_directory(path)
    folders = sorted(e.name for e in entries if _is_dir(e) and _holds_safetensors(Path(e.path)))
    names = {e.name for e in entries}
    if "model_index.json" in names:
        return pipeline_root_error(path, folders)
    pickles = sorted(e.name for e in entries
                     if e.name.endswith(PICKLE_SUFFIXES) and not _is_dir(e))
    if pickles:
        return _CheckpointPathError(
            f"holds no .safetensors file, only pickle checkpoints ({_names(pickles)}): vramkit "
            "does not unpickle (loading a pickle can run arbitrary code)", path,
            "pickle-directory", hint=_CONVERT_HINT.replace("PATH", repr(str(path / pickles[0]))))
    if folders:
        return _CheckpointPathError(
            "holds no .safetensors file itself; these folders in it do: "
            + _names([f + "/" for f in folders]), path, "parent-directory",
            hint=f"Pass one of those folders, e.g. {path / folders[0]}.")
    return _CheckpointPathError(
        "holds no .safetensors file", path, "empty-directory",
        hint="Point at the model's weights: the folder with its *.safetensors files or its "
             "*.safetensors.index.json.")


def pipeline_root_error(path: Path, folders: Sequence[str] | None = None) -> _CheckpointPathError:
    """A diffusers pipeline root (it has ``model_index.json``) given where one model was expected.

    Args:
        path: the pipeline directory.
        folders: its sub-folders holding safetensors (found when not given).
    """
    if folders is None:
        folders = sorted(e.name for e in list_directory(path)
                         if _is_dir(e) and _holds_safetensors(Path(e.path)))
    if not folders:
        return _CheckpointPathError(
            "is a diffusers pipeline root (it has model_index.json), and none of its component "
            "folders holds .safetensors files", path, "pipeline-root",
            hint="Download the pipeline's safetensors weights (the *.safetensors files of "
                 "transformer/ or unet/), or convert its .bin files to safetensors.")
    denoiser = next((f for f in ("transformer", "unet", "prior", "decoder") if f in folders),
                    folders[0])
    return _CheckpointPathError(
        "holds no .safetensors file itself: it is a diffusers pipeline root (it has "
        "model_index.json), whose weights are in its component folders: "
        + _names([f + "/" for f in folders]), path, "pipeline-root",
        hint=f"Pass one component folder, e.g. {path / denoiser} (the denoiser: transformer/ "
             "for Flux and SD3, unet/ for SD 1.x and SDXL).")


# -- files that are not safetensors ----------------------------------------------------------


def not_safetensors_error(path: Path, prefix: bytes,
                          length_possible: bool) -> _CheckpointPathError | None:
    """What a file that failed to parse as safetensors is, when it is something known, else
    ``None`` (then it is a damaged safetensors file).

    Called only after the safetensors checks failed. By content, only when the first 8 bytes
    cannot be a safetensors header length (over the format's 100 MB limit; every pickle, zip
    archive and JSON text is): a truncated safetensors file whose 640-byte header length reads
    ``80 02 ...`` is damaged, not a pickle. A file is then a pickle checkpoint when it begins
    like a zip archive (``torch.save``) or a pickle of protocol 2 to 5, and a JSON file (a
    ``config.json``; a diffusers ``model_index.json``, which points to the pipeline's component
    folders) when it begins like JSON text. By name, whatever its content: a file named
    ``.ckpt``, ``.bin``, ``.pt``, ``.pth``, ``.pkl`` or ``.pickle``.

    Args:
        path: the file.
        prefix: its first (up to 8) bytes.
        length_possible: whether ``prefix`` reads as a header length the format allows.
    """
    what = None
    if not length_possible:
        if prefix.lstrip()[:1] in (b"{", b"["):
            if path.name == "model_index.json":
                return pipeline_root_error(path.parent)
            return _CheckpointPathError(
                "is a JSON file, not safetensors weights", path, "json",
                hint="Pass the weights: a *.safetensors file, a directory of them, or the "
                     "*.safetensors.index.json of a sharded checkpoint as the checkpoint itself.")
        if prefix.startswith(_ZIP_MAGIC):
            what = "is a zip archive, the format torch.save writes (a pickle checkpoint)"
        elif len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
            what = (f"is a Python pickle (protocol {prefix[1]}), the format of .ckpt files and "
                    "legacy torch.save")
    if what is None and path.name.endswith(PICKLE_SUFFIXES):
        what = f"is named like a PyTorch pickle checkpoint ({path.suffix})"
    if what is None:
        return None
    return _CheckpointPathError(
        f"{what}, not safetensors: vramkit does not unpickle (loading a pickle can run arbitrary "
        "code)", path, "pickle", hint=_CONVERT_HINT.replace("PATH", repr(str(path))))
