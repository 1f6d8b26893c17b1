"""Shared helpers of the CLI commands: rich console and JSON output, flag errors, output paths.

Errors. A sub-command raises vramkit errors; :func:`vramkit.cli.main.main` prints them (one
line plus a hint, or one JSON object with ``--json``) and picks the exit code. ``ConfigError``s
raised inside :func:`flag_values` come from the values of flags: they become :class:`FlagError`
(exit code 2, like argparse's own errors); everything else a command raises is a runtime
failure (exit code 1). :func:`flag_text` rewrites the Python names of a config's fields in an
error (``DemoConfig.budget``, ``min_free_memory``, ``max_utilization=10``) as the command's
flags (``--budget``, ``--min-free``, ``--max-util 10``).

Output paths. Every command that writes files checks each path with :func:`check_output_file`
or :func:`check_output_dir` *before* any work starts: a path that is a directory, a parent
directory that does not exist (none is made) or is a file, a directory this process cannot
write in, a file format whose optional library is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from vramkit.errors import ConfigError

__all__ = [
    "REPORT_FORMATS",
    "FlagError",
    "check_output_dir",
    "check_output_file",
    "console",
    "flag_text",
    "flag_values",
    "module_available",
    "print_json",
    "to_jsonable",
]

#: Memory report formats by suffix, with the optional library each needs (``None``: none).
#: The same suffixes as :func:`vramkit.observe.report.save_report`.
REPORT_FORMATS: dict[str, str | None] = {".html": None, ".htm": None, ".json": None,
                                         ".png": "matplotlib"}


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr).

    When the stream is not a terminal (a pipe, a log file, CI), rich would assume 80 columns and
    cut the wide device tables; 200 columns keeps UUIDs whole.
    """
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def to_jsonable(value: Any) -> Any:
    """Convert records (dataclasses, NamedTuples, enums, tuples, torch dtypes) to JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: to_jsonable(v) for k, v in value._asdict().items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def print_json(data: Any) -> None:
    json.dump(to_jsonable(data), sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()


# -- flag errors --------------------------------------------------------------------------------


class FlagError(ConfigError):
    """A flag value the command cannot use (exit code 2, like argparse's errors).

    Made by :func:`flag_values` from the ``ConfigError`` raised while the command turned its
    flags into settings; the original is its ``__cause__``.
    """

    default_hint = "Run the command with --help to see what each flag accepts."


@contextlib.contextmanager
def flag_values() -> Iterator[None]:
    """Mark a block that turns flags into settings: a ``ConfigError`` raised in it is a usage
    error (re-raised as :class:`FlagError`), not a runtime failure.

    Put the checks of every flag (and of every output path) in one such block before the work
    starts, so a bad value costs no work and exits with code 2.
    """
    try:
        yield
    except FlagError:
        raise
    except ConfigError as err:
        raise FlagError(err.message, err.hint) from err


def flag_text(text: str, flags: Mapping[str, str]) -> str:
    """``text`` with the Python names of ``flags`` (field or argument name -> flag) as flags.

    Rewritten: qualified names, as validators name a field of a config class or an argument
    of a function (``DemoConfig.budget``, ``measure_read_bandwidth.threads`` -> ``--budget``,
    ``--disk-threads``), keyword forms (``max_utilization=10`` -> ``--max-util 10``) and names
    with an underscore (``min_free_memory`` -> ``--min-free``). Plain words (``steps``,
    ``device``) are rewritten only in the first two forms: as words they are ordinary English
    (and ``torch.device`` is a module's name, not a qualified argument: a function qualifier
    has an underscore).
    """
    for name in sorted(flags, key=len, reverse=True):
        flag = flags[name]
        escaped = re.escape(name)
        text = re.sub(rf"(?<![\w.-])(?:[A-Z]\w*|[a-z]\w*_\w*)\.{escaped}\b", flag, text)
        text = re.sub(rf"(?<![\w.-]){escaped}=", f"{flag} ", text)
        if "_" in name:
            text = re.sub(rf"(?<![\w.-]){escaped}\b", flag, text)
    return text


# -- output paths -------------------------------------------------------------------------------


def module_available(name: str) -> bool:
    """Whether the optional library ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (directories still to be made skipped)."""
    current = path
    while not os.path.lexists(current) and current != current.parent:
        current = current.parent
    return current


def _probe_directory(directory: Path) -> None:
    """Create (and at once drop) a nameless file in ``directory``: what writing there needs.

    ``os.access`` alone would not do: it says yes to root everywhere, and it does not see
    every read-only mount. Raises the ``OSError`` the write would meet.
    """
    with tempfile.TemporaryFile(dir=directory):
        pass


def _check_writable_dir(flag: str, path: Path, directory: Path) -> None:
    """``directory``, where ``path`` will be written, must exist and take files.

    A missing directory is refused, not made: a typo in a directory name would otherwise grow
    a tree of directories nobody asked for.
    """
    existing = _nearest_existing(directory)
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is not a directory",
                          hint=f"Give {flag} a path whose parent is a directory.")
    if existing != directory:
        raise ConfigError(f"{flag} {path}: the directory {directory} does not exist",
                          hint=f"Create {directory} first, or give {flag} a path in an "
                               "existing directory.")
    try:
        _probe_directory(existing)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"{flag} {path}: cannot write in {existing} ({reason})",
                          hint=f"Give {flag} a path in a directory you can write to, or fix "
                               f"the permissions of {existing}.") from None


def check_output_file(flag: str, path: str | os.PathLike[str], *,
                      formats: Mapping[str, str | None] | None = None,
                      what: str = "the output", extra_hint: str = "") -> Path:
    """Check, before any work, that ``path`` (given with ``flag``) can be written.

    Args:
        flag: the flag that named the path (``"--report"``), for the messages.
        path: the file to be written, in an existing, writable directory.
        formats: accepted suffixes (lower case, with the dot), each with the optional library it
            needs (``None``: none); ``None`` accepts any suffix.
        what: what the file is, for messages (``"a profile report"``).
        extra_hint: appended to the hint of a bad suffix (``"or --report '' for none"``).

    Returns:
        ``Path(path)``.

    Raises:
        ConfigError: for an unknown suffix, a missing library, a path that is a directory, a
            parent directory that does not exist or is a file, an unwritable file or
            directory.
    """
    target = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag} needs a file path", hint=f"Give {flag} a file path.")
    if formats is not None:
        suffix = target.suffix.lower()
        if suffix not in formats:
            listed = ", ".join(formats)
            raise ConfigError(
                f"{flag}: cannot write {what} as {str(path)!r}: the format follows the suffix",
                hint=f"Give {flag} a path ending in {listed}{extra_hint}.")
        package = formats[suffix]
        if package is not None and not module_available(package):
            others = ", ".join(s for s, need in formats.items() if need is None)
            raise ConfigError(
                f"{flag} {path}: writing a {suffix} file needs {package}, which is not "
                "installed",
                hint=f"pip install {package}, or give {flag} a path ending in {others}.")
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory",
                          hint=f"Give {flag} the path of a file (one inside {target}, say).")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{flag} {path}: the file exists and is not writable",
                              hint=f"Give {flag} another path, or fix the file's permissions.")
        return target
    _check_writable_dir(flag, target, target.parent)
    return target


def check_output_dir(flag: str, path: str | os.PathLike[str],
                     files: Iterable[str] = ()) -> Path:
    """Check, before any work, that directory ``path`` can be made (if missing: in an existing
    parent) and written, and that none of ``files`` inside it is a directory.

    Raises:
        ConfigError: naming ``flag``.
    """
    target = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag} needs a directory", hint=f"Give {flag} a directory path.")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory",
                          hint=f"Give {flag} a directory (it is made when missing).")
    _check_writable_dir(flag, target, target if target.is_dir() else target.parent)
    for name in files:
        inner = target / name
        if inner.is_dir():
            raise ConfigError(f"{flag} {path}: {inner} is a directory, where the command "
                              "writes a file", hint=f"Remove {inner} or give {flag} another "
                                                    "directory.")
        if inner.exists() and not os.access(inner, os.W_OK):
            raise ConfigError(f"{flag} {path}: {inner} exists and is not writable",
                              hint=f"Give {flag} another directory, or fix the permissions.")
    return target
