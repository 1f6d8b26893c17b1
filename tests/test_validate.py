"""vramkit._validate: the shared unknown-key check of config ``from_dict`` methods."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vramkit._validate import check_known_fields
from vramkit.errors import ConfigError


@dataclass(frozen=True)
class _Config:
    a: int = 1
    b: str = "x"


def test_known_keys_are_copied() -> None:
    data = {"a": 2}
    values = check_known_fields(_Config, data)
    assert values == {"a": 2} and values is not data
    assert _Config(**values) == _Config(a=2)


def test_unknown_keys_are_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown _Config keys: \['c', 'z'\]") as info:
        check_known_fields(_Config, {"a": 1, "z": 0, "c": 0})
    assert "['a', 'b']" in info.value.hint
