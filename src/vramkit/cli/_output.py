"""Shared output helpers for CLI commands: rich console, JSON emission."""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from typing import Any

from rich.console import Console


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
