"""vramkit._validate: the one field validator (ints, bools, numbers, sizes, choices, devices, and
the unknown-key check of config ``from_dict`` methods)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vramkit._validate import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_known_fields,
    check_number,
    check_size,
)
from vramkit.errors import ConfigError, DeviceError, InvalidDeviceError


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


# -- the field checks ----------------------------------------------------------------------------



def test_check_int_accepts_ints_in_range_only() -> None:
    assert check_int("n", 3, minimum=1, maximum=3) == 3
    assert check_int("n", None, allow_none=True) is None
    for bad in (True, 2.0, "3", None, 0, 4):
        with pytest.raises(ConfigError, match=r"n must be an int in \[1, 3\]"):
            check_int("n", bad, minimum=1, maximum=3)
    with pytest.raises(ConfigError, match="must be an int >= 0 or None") as info:
        check_int("Cfg.k", -1, minimum=0, allow_none=True)
    assert "Cfg.k" in info.value.hint and "whole number" in info.value.hint
    with pytest.raises(ConfigError) as info:
        check_int("k", 0, minimum=1, hint="Use one slot or more.")
    assert info.value.hint == "Use one slot or more."


def test_check_bool_refuses_truthy_values() -> None:
    assert check_bool("flag", False) is False
    assert check_bool("flag", None, allow_none=True) is None
    for bad in (1, 0, "yes", None):
        with pytest.raises(ConfigError, match="flag must be a bool"):
            check_bool("flag", bad)
    with pytest.raises(ConfigError, match="True, False or None"):
        check_bool("flag", 1, allow_none=True)


def test_check_number_bounds_and_finiteness() -> None:
    assert check_number("lr", 1, minimum=0, low_open=True) == 1.0
    assert isinstance(check_number("lr", 1, minimum=0), float)
    for bad in (0, -1.0, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ConfigError, match="lr must be a finite number > 0"):
            check_number("lr", bad, minimum=0, low_open=True)
    with pytest.raises(ConfigError, match=r"in \[0, 1\)"):
        check_number("h", 1.0, minimum=0, maximum=1, high_open=True)


def test_check_size_parses_and_bounds() -> None:
    assert check_size("budget", "2GiB") == 2 * 2**30
    assert check_size("budget", 4096) == 4096
    assert check_size("budget", None, allow_none=True) is None
    with pytest.raises(ConfigError, match="budget: invalid size") as info:
        check_size("budget", "lots")
    assert "GiB" in info.value.hint
    with pytest.raises(ConfigError, match="at least 1 bytes"):
        check_size("budget", 0, minimum=1)
    with pytest.raises(ConfigError):
        check_size("budget", True)


def test_check_choice_names_the_choices() -> None:
    assert check_choice("mode", "train", ("train", "infer")) == "train"
    with pytest.raises(ConfigError, match="'train', 'infer'"):
        check_choice("mode", "fit", ("train", "infer"))
    with pytest.raises(ConfigError):
        check_choice("mode", ["train"], {"train"})  # unhashable


def test_check_device_checks_form_not_presence() -> None:
    assert check_device("d", "cpu") == torch.device("cpu")
    assert check_device("d", "cuda:3") == torch.device("cuda", 3)  # no GPU needed
    assert check_device("d", 1) == torch.device("cuda", 1)
    assert check_device("d", torch.device("cuda")) == torch.device("cuda")
    assert check_device("d", None, allow_none=True) is None
    for bad, words in ((True, "boolean"), (-1, "invalid CUDA ordinal"),
                       ("banana", "invalid device"), ("meta", "not 'meta'")):
        with pytest.raises(InvalidDeviceError, match=words) as info:
            check_device("d", bad)
        assert isinstance(info.value, ConfigError) and isinstance(info.value, DeviceError)
        assert "'cpu'" in info.value.hint
    assert check_device("d", "meta", types=("meta",)) == torch.device("meta")
