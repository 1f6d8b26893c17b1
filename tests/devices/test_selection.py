"""Device selection from NVML (policies, filters, errors) and precision selection."""

from __future__ import annotations

import pytest
import torch

from tests.devices.fakes import (
    GiB,
    forbid_cuda,
    install_fake_nvml,
    install_fake_torch_cuda,
    install_missing_nvml,
    make_gpu,
)
from vramkit.devices.info import DeviceInfo, resolve_visible_devices
from vramkit.devices.nvml import query_nvml
from vramkit.devices.selection import (
    SELECTION_POLICIES,
    is_cuda_available,
    list_cuda_devices,
    select_device,
    select_devices,
    select_precision,
)
from vramkit.errors import ConfigError, DeviceError

PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _three(monkeypatch: pytest.MonkeyPatch) -> list:
    """GPU 0: most free memory; GPU 1: largest memory (busy); GPU 2: fastest (little free)."""
    gpus = [make_gpu(0, name="RTX A6000", compute_capability=(8, 6), cuda_cores=10752,
                     max_sm_clock_mhz=1800, memory_total=48 * GiB, memory_used=0,
                     utilization=(5, 1)),
            make_gpu(1, name="NVIDIA H200", memory_total=141 * GiB, memory_used=100 * GiB,
                     utilization=(90, 60), compute_capability=(9, 0), cuda_cores=16896,
                     max_sm_clock_mhz=1500),
            make_gpu(2, name="NVIDIA B200", compute_capability=(10, 0), cuda_cores=18944,
                     max_sm_clock_mhz=1965, memory_total=180 * GiB, memory_used=170 * GiB,
                     utilization=(0, 0))]
    install_fake_nvml(monkeypatch, gpus)
    forbid_cuda(monkeypatch)  # selection must work from NVML alone
    return gpus


@pytest.mark.parametrize(("policy", "expected"), [
    ("most_free_memory", 0), ("largest_memory", 2), ("fastest", 2)])
def test_policies(monkeypatch: pytest.MonkeyPatch, policy: str, expected: int) -> None:
    gpus = _three(monkeypatch)
    choice = select_device(policy, env=PCI)
    assert choice.device.uuid == gpus[expected].uuid
    assert choice.cuda_ordinal == expected and choice.policy == policy
    assert gpus[expected].name in choice.reason
    assert choice.torch_device == torch.device("cuda", expected)


def test_largest_and_fastest_differ_when_hardware_does(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = _three(monkeypatch)
    install_fake_nvml(monkeypatch, gpus[:2])  # A6000 + H200: most free A6000, largest H200
    assert select_device("largest_memory", env=PCI).cuda_ordinal == 1
    assert select_device("most_free_memory", env=PCI).cuda_ordinal == 0


def test_selection_respects_visible_devices_and_ordinals(monkeypatch: pytest.MonkeyPatch) -> None:
    _three(monkeypatch)
    choice = select_device("most_free_memory", env={**PCI, "CUDA_VISIBLE_DEVICES": "2,1"})
    # GPU 0 (most free) is hidden; of 2 and 1, GPU 1 has 41 GiB free vs 10 GiB.
    assert choice.device.index == 1 and choice.cuda_ordinal == 1


def test_unknown_policy_lists_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    _three(monkeypatch)
    with pytest.raises(ConfigError, match="unknown device selection policy") as info:
        select_device("cheapest", env=PCI)
    for name in SELECTION_POLICIES:
        assert name in info.value.hint
    with pytest.raises(ConfigError):
        select_devices(1, policy="cheapest", env=PCI)


def test_no_gpu_is_device_error_with_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    install_missing_nvml(monkeypatch)
    with pytest.raises(DeviceError, match="no NVIDIA GPU visible") as info:
        select_device()
    assert "driver" in info.value.hint
    install_fake_nvml(monkeypatch, [])
    with pytest.raises(DeviceError, match="reports no NVIDIA GPU"):
        select_devices(1, env={})
    install_fake_nvml(monkeypatch, [make_gpu(0)])
    with pytest.raises(DeviceError, match="hides them all"):
        select_device(env={"CUDA_VISIBLE_DEVICES": "-1"})


def test_unified_memory_ranks_last_for_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0, unified_memory=True),
                                    make_gpu(1, memory_total=8 * GiB, memory_used=7 * GiB)])
    assert select_device(env=PCI).device.index == 1


def test_select_devices_best_first_with_uuid_string(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = _three(monkeypatch)
    sel = select_devices(2, env=PCI)
    assert [d.index for d in sel.devices] == [0, 1] and sel.cuda_ordinals == (0, 1)
    assert sel.cuda_visible_devices == f"{gpus[0].uuid},{gpus[1].uuid}"
    # The string is a valid CUDA_VISIBLE_DEVICES naming exactly those devices, in that order.
    snap = query_nvml(include_processes=False)
    child = resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": sel.cuda_visible_devices})
    assert [v.nvml_index for v in child] == [0, 1]


def test_min_free_memory_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = _three(monkeypatch)
    sel = select_devices(2, min_free_memory="10GiB", policy="fastest", env=PCI)
    assert [d.uuid for d in sel.devices] == [gpus[2].uuid, gpus[1].uuid]
    with pytest.raises(DeviceError) as info:
        select_devices(2, min_free_memory=45 * GiB, env=PCI)
    message = str(info.value)
    assert "only 1 of 3 qualify" in message
    assert "cuda:1 (NVIDIA H200): 41.0 GiB free < 45.0 GiB" in message
    assert "cuda:2 (NVIDIA B200): 10.0 GiB free" in message


def test_max_utilization_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    _three(monkeypatch)
    sel = select_devices(2, max_utilization=10, env=PCI)
    assert sorted(d.index for d in sel.devices) == [0, 2]
    with pytest.raises(DeviceError, match=r"utilization 90% > 10%"):
        select_devices(3, max_utilization=10, env=PCI)


def test_unknown_figures_are_rejected_when_filtering(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0, unified_memory=True, not_supported=frozenset(
        {"nvmlDeviceGetUtilizationRates"}))])
    assert select_devices(1, env={}).devices[0].index == 0
    with pytest.raises(DeviceError, match="free memory unknown"):
        select_devices(1, min_free_memory="1GiB", env={})
    with pytest.raises(DeviceError, match="utilization unknown"):
        select_devices(1, max_utilization=50, env={})


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"count": 0}, "positive integer"),
    ({"count": True}, "positive integer"),
    ({"count": 1.5}, "positive integer"),
    ({"count": 1, "min_free_memory": "lots"}, "min_free_memory"),
    ({"count": 1, "min_free_memory": "20 GiBs"}, "unknown unit"),
    ({"count": 1, "min_free_memory": -5}, "negative"),
    ({"count": 1, "max_utilization": 150}, r"\[0, 100\]"),
    ({"count": 1, "max_utilization": "50"}, r"\[0, 100\]"),
])
def test_bad_arguments(monkeypatch: pytest.MonkeyPatch, kwargs: dict, words: str) -> None:
    _three(monkeypatch)
    with pytest.raises(ConfigError, match=words) as info:
        select_devices(env=PCI, **kwargs)
    assert info.value.hint and info.value.hint != ConfigError.default_hint


# ------------------------------------------------------------------------- torch listing


def test_is_cuda_available_and_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert is_cuda_available() is False and list_cuda_devices() == []
    gpus = [make_gpu(0), make_gpu(1)]
    install_fake_nvml(monkeypatch, gpus)
    install_fake_torch_cuda(monkeypatch, gpus)
    assert is_cuda_available() is True
    assert [d.nvml_index for d in list_cuda_devices()] == [0, 1]


def test_is_cuda_available_survives_broken_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert is_cuda_available() is False


# ---------------------------------------------------------------------------- precision


def _info(cc: tuple[int, int]) -> DeviceInfo:
    return DeviceInfo(device_id=0, name="GPU", compute_capability=cc, total_memory=GiB,
                      multiprocessor_count=10, max_threads_per_block=1024,
                      max_shared_memory_per_block=48 * 1024, supports_fp16=cc >= (6, 0),
                      supports_bf16=cc >= (8, 0))


@pytest.mark.parametrize(("cc", "dtype", "name", "words"), [
    ((9, 0), torch.bfloat16, "bf16", "bf16"),
    ((8, 0), torch.bfloat16, "bf16", "bf16"),
    ((7, 5), torch.float16, "fp16", "tensor cores"),
    ((7, 0), torch.float16, "fp16", "tensor cores"),
    ((6, 0), torch.float16, "fp16", "without tensor cores"),
    ((6, 1), torch.float16, "fp16", "slow on 6.1"),
    ((5, 2), torch.float32, "fp32", "before 6.0"),
])
def test_precision_by_compute_capability(cc: tuple[int, int], dtype: torch.dtype, name: str,
                                         words: str) -> None:
    choice = select_precision(_info(cc))
    assert (choice.dtype, choice.name) == (dtype, name)
    assert words in choice.reason and f"{cc[0]}.{cc[1]}" in choice.reason


def test_precision_accepts_every_device_form(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(0, compute_capability=(7, 5), name="Tesla T4"), make_gpu(1)]
    install_fake_torch_cuda(monkeypatch, gpus)
    assert select_precision(0).name == "fp16"
    assert select_precision(1).name == "bf16"
    assert select_precision("cuda:1").name == "bf16"
    assert select_precision(torch.device("cuda", 0)).name == "fp16"
    assert select_precision("cuda").name == "fp16"  # current device is 0
    assert select_precision().name == "fp16"
    with pytest.raises(DeviceError, match="does not exist"):
        select_precision(2)


def test_precision_cpu_depends_on_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    choice = select_precision("cpu")
    assert choice.dtype == torch.bfloat16 and "CPU" in choice.reason
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    choice = select_precision(torch.device("cpu"))
    assert choice.dtype == torch.float32 and "no native bf16" in choice.reason


def test_precision_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        select_precision(0)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        select_precision("cuda")
    with pytest.raises(ConfigError, match="invalid CUDA ordinal"):
        select_precision(-1)
    with pytest.raises(ConfigError, match="invalid device"):
        select_precision("tpu:0")
    with pytest.raises(ConfigError, match="not 'meta'"):
        select_precision("meta")
    with pytest.raises(ConfigError):
        select_precision(True)
