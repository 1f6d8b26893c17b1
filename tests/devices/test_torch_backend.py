"""CPU tests of vramkit.devices.torch_backend: handles, validation, CPU streams, placement.

CUDA-only paths (tracked streams, peer access, synchronize) run against fakes of torch.cuda here;
tests/devices/test_torch_backend_gpu.py runs them on a real GPU.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import namedtuple
from typing import Any

import pytest
import torch

from vramkit.devices import torch_backend as tb
from vramkit.devices.info import DeviceInfo
from vramkit.devices.torch_backend import (
    CpuStream,
    Device,
    can_access_peer,
    distribute_batch,
    ensure_same_device,
    to_device,
)
from vramkit.errors import ConfigError, DeviceError, DeviceMismatchError


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this process sees two CUDA devices (counting only; nothing else is faked)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


class FakeStream:
    """Stands in for torch.cuda.Stream: records its arguments, reports a settable busy flag."""

    pool_size = 4  # torch hands out streams from a fixed pool: handles repeat

    _created = 0

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cuda", 0)
        self.priority = priority
        self.busy = False
        FakeStream._created += 1
        self.cuda_stream = 0x1000 + FakeStream._created % FakeStream.pool_size

    def query(self) -> bool:
        return not self.busy


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> dict[str, Any]:
    """An initialized two-GPU torch.cuda whose streams are FakeStreams."""
    state: dict[str, Any] = {"current": FakeStream(), "default": FakeStream(), "synced": []}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: state["default"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state["synced"].append(device))
    monkeypatch.setattr(tb, "_streams_by_ordinal", {})
    return state


# -- Device values ----------------------------------------------------------------------------

def test_constructors_and_properties() -> None:
    gpu = Device.cuda(1)
    assert (gpu.type, gpu.index, gpu.ordinal, gpu.is_cuda) == ("cuda", 1, 1, True)
    assert gpu.torch_device == torch.device("cuda", 1)
    assert str(gpu) == "cuda:1"
    assert Device.cuda() == Device.cuda(0)
    cpu = Device.cpu()
    assert (cpu.ordinal, cpu.is_cuda, str(cpu)) == (None, False, "cpu")
    assert cpu.torch_device == torch.device("cpu")


@pytest.mark.parametrize(("value", "expected"), [
    (torch.device("cuda", 2), Device.cuda(2)),
    ("cuda:3", Device.cuda(3)),
    (4, Device.cuda(4)),
    ("cpu", Device.cpu()),
    ("cpu:0", Device.cpu()),
    (torch.device("cpu"), Device.cpu()),
    (Device.cuda(5), Device.cuda(5)),
])
def test_from_torch(value: Any, expected: Device) -> None:
    assert Device.from_torch(value) == expected


def test_from_torch_bare_cuda_uses_current_device_only_when_initialized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert Device.from_torch("cuda") == Device.cuda(0)  # fresh process: CUDA not initialized
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert Device.from_torch("cuda") == Device.cuda(1)


@pytest.mark.parametrize(("make", "error"), [
    (lambda: Device("mps"), DeviceError),
    (lambda: Device.from_torch("meta"), DeviceError),
    (lambda: Device.from_torch("not-a-device"), DeviceError),
    (lambda: Device.from_torch(True), ConfigError),
    (lambda: Device.from_torch(2.5), ConfigError),
    (lambda: Device.cuda(-1), ConfigError),
    (lambda: Device.cuda(1.0), ConfigError),  # type: ignore[arg-type]
    (lambda: Device.cuda(True), ConfigError),
    (lambda: Device("cpu", 0), ConfigError),
])
def test_invalid_devices(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        make()


def test_hash_eq_and_frozen() -> None:
    keys = {Device.cuda(0): "a", Device.cpu(): "b"}
    assert keys[Device.from_torch("cuda:0")] == "a"
    assert keys[Device.from_torch("cpu")] == "b"
    assert len({Device.cuda(1), Device.from_torch(1), Device.cuda(2)}) == 2
    assert Device.cuda(0) != Device.cpu()
    with pytest.raises(dataclasses.FrozenInstanceError):
        Device.cuda(0).index = 1  # type: ignore[misc]


def test_validate_reports_visible_count(monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> None:
    assert Device.cuda(1).validate() == Device.cuda(1)
    assert Device.cpu().validate() == Device.cpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(DeviceError) as info:
        Device.cuda(2).validate()
    assert "sees 2 CUDA device(s)" in str(info.value)
    assert "cuda:0, cuda:1" in str(info.value)
    assert "CUDA_VISIBLE_DEVICES='3,5'" in str(info.value)


def test_validate_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError) as info:
        Device.cuda(0).validate()
    assert "sees no CUDA device" in info.value.hint


def _record(device_id: int) -> DeviceInfo:
    return DeviceInfo(device_id=device_id, name=f"Fake {device_id}", compute_capability=(9, 0),
                      total_memory=1 << 30, multiprocessor_count=1, max_threads_per_block=1024,
                      max_shared_memory_per_block=48 << 10, supports_fp16=True, supports_bf16=True)


def test_info_picks_the_record_of_the_ordinal(monkeypatch: pytest.MonkeyPatch,
                                              two_gpus: None) -> None:
    monkeypatch.setattr(tb, "_list_cuda_devices", lambda: [_record(0), _record(1)])
    assert Device.cuda(1).info == _record(1)
    assert Device.cpu().info is None
    with pytest.raises(DeviceError, match="not visible"):
        _ = Device.cuda(2).info
    monkeypatch.setattr(tb, "_list_cuda_devices", lambda: [_record(0)])
    with pytest.raises(DeviceError, match="no device record"):
        _ = Device.cuda(1).info


# -- streams ------------------------------------------------------------------------------------

def test_cpu_streams_are_documented_no_ops() -> None:
    cpu = Device.cpu()
    stream = cpu.new_stream(priority=-1)
    assert isinstance(stream, CpuStream) and stream.priority == -1
    assert stream.query() is True
    stream.synchronize()
    stream.wait_stream(stream)
    with cpu.stream(stream) as active:
        assert active is stream
    with cpu.stream() as active:
        assert isinstance(active, CpuStream)
    assert cpu.is_idle()
    cpu.synchronize()


def test_cpu_stream_context_rejects_foreign_stream() -> None:
    with pytest.raises(DeviceMismatchError), Device.cpu().stream(FakeStream()):
        pass


def test_new_stream_rejects_bad_priority() -> None:
    with pytest.raises(ConfigError):
        Device.cpu().new_stream(priority=1.5)  # type: ignore[arg-type]


def test_cuda_paths_do_nothing_before_cuda_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: pytest.fail("synchronize must not run"))
    assert Device.cuda(0).is_idle()
    Device.cuda(0).synchronize()


def test_is_idle_queries_tracked_current_and_default_streams(fake_cuda: dict[str, Any]) -> None:
    gpu = Device.cuda(1)
    stream = gpu.new_stream(priority=-2)
    assert isinstance(stream, FakeStream)
    assert stream.device == torch.device("cuda", 1) and stream.priority == -2
    assert gpu.is_idle()
    stream.busy = True
    assert not gpu.is_idle()
    assert Device.cuda(0).is_idle()  # streams are tracked per ordinal
    stream.busy = False
    fake_cuda["current"].busy = True
    assert not gpu.is_idle()
    fake_cuda["current"].busy = False
    fake_cuda["default"].busy = True
    assert not gpu.is_idle()


def test_stream_tracking_is_bounded_by_the_stream_pool(fake_cuda: dict[str, Any]) -> None:
    # Streams are tracked by their raw handle (strong references: torch stream objects do not
    # clear weak references when they die), so creating many stays bounded by torch's pool.
    gpu = Device.cuda(0)
    streams = [gpu.new_stream() for _ in range(50)]
    assert len(tb._streams_by_ordinal[0]) == FakeStream.pool_size
    streams[-1].busy = True
    del streams
    gc.collect()
    assert not gpu.is_idle()  # the newest stream for that handle is what is tracked


def test_synchronize_targets_the_ordinal(fake_cuda: dict[str, Any]) -> None:
    Device.cuda(1).synchronize()
    assert fake_cuda["synced"] == [1]


def test_stream_context_rejects_other_devices_stream(fake_cuda: dict[str, Any]) -> None:
    other = Device.cuda(1).new_stream()
    with pytest.raises(DeviceMismatchError, match="the stream"), Device.cuda(0).stream(other):
        pass


# -- peer access --------------------------------------------------------------------------------

def test_can_access_peer(monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> None:
    asked: list[tuple[int, int]] = []

    def fake_peer(a: int, b: int) -> bool:
        asked.append((a, b))
        return a == 0

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", fake_peer)
    assert can_access_peer("cpu", "cuda:0") is False
    assert can_access_peer(Device.cuda(1), "cpu") is False
    assert can_access_peer(1, 1) is True
    assert asked == []
    assert can_access_peer(0, "cuda:1") is True
    assert can_access_peer(torch.device("cuda", 1), 0) is False
    assert asked == [(0, 1), (1, 0)]
    with pytest.raises(DeviceError):
        can_access_peer(0, 2)


@pytest.fixture
def peer_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A fresh record of enabled pairs, and the PyTorch-side enabling replaced by a recorder."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(tb, "_peers_enabled", set())
    monkeypatch.setattr(tb, "_enable_peer_through_torch", lambda a, b: calls.append((a, b)))
    return calls


def test_enable_peer_access_checks_then_enables_once(
        monkeypatch: pytest.MonkeyPatch, two_gpus: None, peer_calls: list) -> None:
    asked: list[tuple[int, int]] = []

    def fake_peer(a: int, b: int) -> bool:
        asked.append((a, b))
        return True

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", fake_peer)
    tb.enable_peer_access(0, "cuda:1")
    assert asked == [(0, 1)] and peer_calls == [(0, 1)]
    # Idempotent: the same pair again (in any spelling) neither asks nor enables again.
    tb.enable_peer_access(Device.cuda(0), torch.device("cuda", 1))
    Device.cuda(0).enable_peer_access(1)
    assert asked == [(0, 1)] and peer_calls == [(0, 1)]
    # One direction at a time, as in CUDA: the reverse is its own pair.
    Device.cuda(1).enable_peer_access(Device.cuda(0))
    assert asked == [(0, 1), (1, 0)] and peer_calls == [(0, 1), (1, 0)]


def test_enable_peer_access_refuses_a_pair_without_a_peer_path(
        monkeypatch: pytest.MonkeyPatch, two_gpus: None, peer_calls: list) -> None:
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    with pytest.raises(DeviceError, match="cannot access cuda:1") as info:
        tb.enable_peer_access(0, 1)
    assert "nvidia-smi topo -m" in info.value.hint
    assert peer_calls == [] and tb._peers_enabled == set()


@pytest.mark.parametrize("count", [0, 1])
def test_enable_peer_access_needs_two_gpus(monkeypatch: pytest.MonkeyPatch, count: int,
                                           peer_calls: list) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer",
                        lambda a, b: pytest.fail("must not be asked"))
    with pytest.raises(DeviceError, match=f"needs two GPUs; this process sees {count}") as info:
        tb.enable_peer_access(0, 1)
    assert "CUDA_VISIBLE_DEVICES" in info.value.hint
    with pytest.raises(DeviceError, match="needs two GPUs"):
        Device.cuda(0).enable_peer_access("cuda:1")
    assert peer_calls == []


def test_enable_peer_access_refuses_the_cpu_and_one_gpu_twice(
        monkeypatch: pytest.MonkeyPatch, two_gpus: None, peer_calls: list) -> None:
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    with pytest.raises(DeviceError, match="between two GPUs") as info:
        tb.enable_peer_access("cpu", "cuda:0")
    assert "to_device" in info.value.hint
    with pytest.raises(DeviceError, match="between two GPUs"):
        Device.cuda(1).enable_peer_access("cpu")
    with pytest.raises(DeviceError, match="two different GPUs") as info:
        tb.enable_peer_access(1, "cuda:1")
    assert "own memory" in info.value.hint
    with pytest.raises(DeviceError, match="not visible"):
        tb.enable_peer_access(0, 2)
    assert peer_calls == []


def test_peer_access_is_enabled_through_a_pytorch_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real enabling step, with torch.empty faked: a one-byte tensor on the reading GPU is
    # copied to the other one (PyTorch's copy runs get_p2p_access(src, dst)), never waited for.
    events: list[tuple[Any, ...]] = []

    class Probe:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def to(self, device: torch.device, non_blocking: bool = False) -> Probe:
            events.append(("copy", self.device, device, non_blocking))
            return Probe(device)

    def fake_empty(*size: int, dtype: torch.dtype, device: torch.device) -> Probe:
        events.append(("empty", size, dtype, device))
        return Probe(device)

    monkeypatch.setattr(torch, "empty", fake_empty)
    tb._enable_peer_through_torch(0, 1)
    assert events == [("empty", (1,), torch.uint8, torch.device("cuda", 0)),
                      ("copy", torch.device("cuda", 0), torch.device("cuda", 1), True)]


# -- to_device ----------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["cpu", torch.device("cpu"), Device.cpu()])
@pytest.mark.parametrize("non_blocking", [True, False])
def test_to_device_same_device_is_a_no_op(target: Any, non_blocking: bool) -> None:
    tensor = torch.arange(6.0)
    assert to_device(tensor, target, non_blocking=non_blocking) is tensor
    moved, event = to_device(tensor, target, non_blocking=non_blocking, return_event=True)
    assert moved is tensor and event is None


def test_to_device_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError):
        to_device([1, 2], "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        to_device(None, "cpu")  # type: ignore[arg-type]
    with pytest.raises(DeviceError):
        to_device(torch.ones(1), "mps")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError, match="not visible"):
        to_device(torch.ones(1), 0)


# -- ensure_same_device -------------------------------------------------------------------------

def test_ensure_same_device() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    assert ensure_same_device(a) == torch.device("cpu")
    assert ensure_same_device(a, b) == torch.device("cpu")
    with pytest.raises(DeviceMismatchError) as info:
        ensure_same_device(a, b, torch.empty(2, device="meta"))
    assert info.value.what == "argument 2"
    assert info.value.expected == torch.device("cpu")
    assert info.value.got == torch.device("meta")
    assert "argument 2" in str(info.value)


def test_ensure_same_device_argument_errors() -> None:
    with pytest.raises(ConfigError):
        ensure_same_device()
    with pytest.raises(TypeError, match="argument 1"):
        ensure_same_device(torch.ones(1), "cpu")  # type: ignore[arg-type]


# -- distribute_batch ---------------------------------------------------------------------------

@pytest.mark.parametrize(("rows", "devices", "sizes"), [
    (10, 4, [3, 3, 2, 2]),
    (8, 4, [2, 2, 2, 2]),
    (3, 3, [1, 1, 1]),
    (7, 1, [7]),
    (5, 2, [3, 2]),
])
def test_distribute_uneven_splits(rows: int, devices: int, sizes: list[int]) -> None:
    batch = torch.arange(rows * 2).reshape(rows, 2)
    chunks = distribute_batch(batch, ["cpu"] * devices)
    assert [c.shape[0] for c in chunks] == sizes
    torch.testing.assert_close(torch.cat(chunks), batch)


def test_split_rule_matches_tensor_split() -> None:
    for rows in range(1, 40):
        for devices in range(1, rows + 1):
            chunks = distribute_batch(torch.arange(rows), [Device.cpu()] * devices)
            expected = torch.tensor_split(torch.arange(rows), devices)
            assert [c.tolist() for c in chunks] == [e.tolist() for e in expected]


def test_distribute_nested_structures() -> None:
    Pair = namedtuple("Pair", ["image", "label"])
    batch = {"pixels": torch.arange(5 * 3).reshape(5, 3),
             "extra": [torch.arange(5), (torch.ones(5, 2),)],
             "pair": Pair(torch.arange(5) * 10, torch.arange(5) * 100)}
    chunks = distribute_batch(batch, ["cpu", Device.cpu()])
    assert len(chunks) == 2
    first, second = chunks
    assert first["pixels"].shape == (3, 3) and second["pixels"].shape == (2, 3)
    assert first["extra"][0].tolist() == [0, 1, 2] and second["extra"][0].tolist() == [3, 4]
    assert isinstance(first["extra"], list) and isinstance(first["extra"][1], tuple)
    assert first["extra"][1][0].shape == (3, 2)
    assert isinstance(second["pair"], Pair)
    assert second["pair"].label.tolist() == [300, 400]
    assert all(t.device == torch.device("cpu") for t in (first["pixels"], second["pair"].image))


@pytest.mark.parametrize(("batch", "devices", "message"), [
    (torch.arange(2), ["cpu"] * 3, "cannot split 2 row"),
    (torch.arange(4), [], "at least one device"),
    ({"x": torch.arange(4), "y": torch.arange(5)}, ["cpu"] * 2, "batch['y'] has 5 rows"),
    ({"x": torch.arange(4), "names": ["a", "b", "c", "d"]}, ["cpu"], "batch['names'][0] is a str"),
    (torch.tensor(3.0), ["cpu"], "0-d"),
    ({}, ["cpu"], "no tensor"),
])
def test_distribute_errors(batch: Any, devices: list[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        distribute_batch(batch, devices)


def test_distribute_validates_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError):
        distribute_batch(torch.arange(4), ["cpu", "cuda:0"])
