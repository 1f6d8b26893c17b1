"""Rebuilding frozen config dataclasses from their ``to_dict`` output."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vramkit.errors import ConfigError

__all__ = ["check_known_fields"]


def check_known_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as a new dict, after checking every key names a field of dataclass ``cls``.

    Args:
        cls: a dataclass type.
        data: field name -> value (missing fields take their defaults when ``cls`` is built).

    Returns:
        A copy of ``data`` the caller may convert further before ``cls(**values)``.

    Raises:
        ConfigError: naming the unknown keys and the known ones.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} keys: {unknown}",
                          hint=f"Known keys: {sorted(known)}.")
    return dict(data)
