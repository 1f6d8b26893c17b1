"""vramkit.devices.resolve: the one device resolver (form through _validate, then presence)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vramkit.devices import _runtime
from vramkit.devices.resolve import cuda_ordinal, resolve_device
from vramkit.devices.torch_backend import Device
from vramkit.errors import ConfigError, DeviceError, InvalidDeviceError


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that sees two CUDA devices (no CUDA context: nothing here creates one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# -- accepted forms ---------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("cpu", torch.device("cpu")),
    ("cpu:0", torch.device("cpu")),
    (torch.device("cpu"), torch.device("cpu")),
    (Device.cpu(), torch.device("cpu")),
    ("cuda", torch.device("cuda", 0)),  # CUDA not initialized: the current device is 0
    ("cuda:1", torch.device("cuda", 1)),
    (1, torch.device("cuda", 1)),
    (0, torch.device("cuda", 0)),
    (torch.device("cuda", 1), torch.device("cuda", 1)),
    (torch.device("cuda"), torch.device("cuda", 0)),
    (Device.cuda(1), torch.device("cuda", 1)),
    (None, torch.device("cuda", 0)),  # the default, "cuda"
])
def test_every_accepted_form(two_gpus: None, value: Any, expected: torch.device) -> None:
    resolved = resolve_device(value, owner="test")
    assert resolved == expected
    assert resolved.type == "cpu" or resolved.index is not None  # cuda always gets its index


def test_bare_cuda_is_the_current_device_once_cuda_started(
        monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda", owner="test") == torch.device("cuda", 1)
    assert resolve_device(None, owner="test") == torch.device("cuda", 1)


def test_default_and_types(no_cuda: None) -> None:
    assert resolve_device(None, owner="test", default="cpu") == torch.device("cpu")
    meta = resolve_device("meta", owner="test", types=("cpu", "cuda", "meta"))
    assert meta == torch.device("meta")


def test_cpu_needs_no_cuda(no_cuda: None) -> None:
    assert resolve_device("cpu", owner="test") == torch.device("cpu")


def test_resolving_creates_no_cuda_context(two_gpus: None) -> None:
    resolve_device("cuda:1", owner="test")
    resolve_device(None, owner="test")
    assert not torch.cuda.is_initialized()


# -- invalid values: InvalidDeviceError, both a ConfigError and a DeviceError -------------------


@pytest.mark.parametrize(("value", "words"), [
    (True, "boolean"),
    (False, "boolean"),
    (-1, "invalid CUDA ordinal"),
    ("not-a-device", "invalid device"),
    ("cuda:x", "invalid device"),
    (2.5, "invalid device"),
    ([0], "invalid device"),
    ("meta", "not 'meta'"),
    (torch.device("meta"), "not 'meta'"),
])
def test_invalid_values(two_gpus: None, value: Any, words: str) -> None:
    with pytest.raises(InvalidDeviceError, match=words) as info:
        resolve_device(value, owner="BlockSwapper")
    error = info.value
    assert isinstance(error, ConfigError) and isinstance(error, DeviceError)
    assert isinstance(error, ValueError)
    assert "BlockSwapper device" in error.message  # the owner is named
    assert error.hint and error.hint != ConfigError.default_hint


def test_invalid_values_are_refused_before_presence_is_asked(no_cuda: None) -> None:
    # A wrong value is a ConfigError even on a machine without CUDA.
    with pytest.raises(InvalidDeviceError):
        resolve_device(True, owner="test")
    with pytest.raises(InvalidDeviceError):
        resolve_device("tpu:0", owner="test")


# -- presence: DeviceError (not a ConfigError) ---------------------------------------------------


@pytest.mark.parametrize("value", ["cuda", "cuda:0", 0, torch.device("cuda", 1), None])
def test_no_cuda_is_a_device_error(no_cuda: None, value: Any) -> None:
    with pytest.raises(DeviceError, match="CUDA is not available") as info:
        resolve_device(value, owner="BlockSwapper")
    assert not isinstance(info.value, ConfigError)
    assert "device='cpu'" in info.value.hint and "BlockSwapper" in info.value.hint


def test_the_runtime_seam_decides_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(_runtime, "is_cuda_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda:0", owner="test")
    monkeypatch.setattr(_runtime, "is_cuda_available", lambda: True)
    assert resolve_device("cuda:3", owner="test") == torch.device("cuda", 3)


@pytest.mark.parametrize("value", [2, "cuda:2", torch.device("cuda", 7)])
def test_out_of_range_ordinal_is_a_device_error(monkeypatch: pytest.MonkeyPatch,
                                                two_gpus: None, value: Any) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(DeviceError, match="does not exist") as info:
        resolve_device(value, owner="MemoryPool")
    error = info.value
    assert not isinstance(error, ConfigError)
    assert "sees 2 CUDA device(s)" in error.message
    assert "CUDA_VISIBLE_DEVICES='4,5'" in error.message
    assert error.message.startswith("MemoryPool cannot use cuda:")


# -- cuda_ordinal ----------------------------------------------------------------------------------


def test_cuda_ordinal(monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> None:
    assert cuda_ordinal(torch.device("cuda", 1), owner="test") == 1
    assert cuda_ordinal(torch.device("cuda"), owner="test") == 0
    with pytest.raises(DeviceError, match="does not exist"):
        cuda_ordinal(torch.device("cuda", 2), owner="test")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        cuda_ordinal(torch.device("cuda", 0), owner="test")
