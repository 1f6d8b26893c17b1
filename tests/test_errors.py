from __future__ import annotations

import pickle

import pytest

from vramkit import errors


def test_every_error_has_a_hint_in_its_message() -> None:
    samples = [
        errors.VramkitError("boom"),
        errors.ConfigError("bad value"),
        errors.DeviceError("no such device"),
        errors.DeviceMismatchError("cuda:0", "cpu", what="input"),
        errors.NvmlError("no NVML"),
        errors.JaxUnavailableError("no jax"),
        errors.TooLateError("PYTORCH_ALLOC_CONF", "CUDA is already initialized"),
        errors.PoolExhaustedError("full", requested=10),
        errors.InvalidBlockError("double free"),
    ]
    for err in samples:
        assert err.hint, type(err)
        assert "hint:" in str(err)
        assert isinstance(err, errors.VramkitError)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        raise errors.ConfigError("fraction must be in (0, 1]")


def test_device_mismatch_keeps_expected_and_got() -> None:
    err = errors.DeviceMismatchError("cuda:0", "cpu", what="argument 1")
    assert err.expected == "cuda:0"
    assert err.got == "cpu"
    assert "argument 1 is on cpu" in str(err)
    assert "expected cuda:0" in str(err)


def test_too_late_names_the_setting() -> None:
    err = errors.TooLateError("XLA_CLIENT_MEM_FRACTION", "the JAX backend already started")
    assert err.setting == "XLA_CLIENT_MEM_FRACTION"
    assert "XLA_CLIENT_MEM_FRACTION" in str(err)


def test_pool_exhausted_is_a_memory_error() -> None:
    err = errors.PoolExhaustedError("over cap", requested=4096, stats={"reserved": 1})
    assert isinstance(err, MemoryError)
    assert err.requested == 4096


def test_custom_hint_and_pickling() -> None:
    err = errors.DeviceMismatchError("cuda:1", "cuda:0", hint="use .to('cuda:1')")
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is errors.DeviceMismatchError
    assert clone.expected == "cuda:1"
    assert str(clone) == str(err)
