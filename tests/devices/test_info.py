"""UUID joins, CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER resolution, detection and capabilities."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.devices.fakes import (
    FakeCuUuid,
    FakeJaxDevice,
    FakeMig,
    GiB,
    build_fake_pynvml,
    install_fake_jax,
    install_fake_nvml,
    install_fake_torch_cuda,
    install_missing_nvml,
    make_gpu,
    mig_uuid,
)
from vramkit.devices.info import (
    DeviceDetector,
    DeviceType,
    SystemDetector,
    detect_devices,
    normalize_uuid,
    resolve_visible_devices,
    summarize_capabilities,
)
from vramkit.devices.nvml import NvmlSnapshot, query_nvml
from vramkit.errors import ConfigError, JaxUnavailableError

PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _snapshot(monkeypatch: pytest.MonkeyPatch, gpus: list) -> NvmlSnapshot:
    install_fake_nvml(monkeypatch, gpus)
    return query_nvml(include_processes=False)


def _hetero(monkeypatch: pytest.MonkeyPatch) -> tuple[list, NvmlSnapshot]:
    """Three GPUs in PCI order: an old T4, an H200, an A100 (FASTEST_FIRST: H200, A100, T4)."""
    gpus = [make_gpu(0, name="Tesla T4", compute_capability=(7, 5), cuda_cores=2560,
                     max_sm_clock_mhz=1590, memory_total=16 * GiB),
            make_gpu(1, name="NVIDIA H200"),
            make_gpu(2, name="NVIDIA A100", compute_capability=(8, 0), cuda_cores=6912,
                     max_sm_clock_mhz=1410)]
    return gpus, _snapshot(monkeypatch, gpus)


# ---------------------------------------------------------------------------------- UUIDs


@pytest.mark.parametrize("form", [
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "gpu-8932F937-D72C-4106-C12F-20BD9FAED9F6",
    "MIG-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "8932f937-d72c-4106-c12f-20bd9faed9f6",
    "8932f937d72c4106c12f20bd9faed9f6",
    bytes.fromhex("8932f937d72c4106c12f20bd9faed9f6"),
    FakeCuUuid("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"),
])
def test_normalize_uuid_forms(form: object) -> None:
    assert normalize_uuid(form) == "8932f937-d72c-4106-c12f-20bd9faed9f6"


def test_normalize_uuid_leaves_legacy_mig_text_alone() -> None:
    assert normalize_uuid("MIG-GPU-ABC/1/0") == "mig-gpu-abc/1/0"


# ---------------------------------------------------------------------- visible devices


def test_unset_means_all_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _snapshot(monkeypatch, [make_gpu(n) for n in range(4)])
    visible = resolve_visible_devices(snap, {})
    assert [v.cuda_ordinal for v in visible] == [0, 1, 2, 3]
    assert [v.nvml_index for v in visible] == [0, 1, 2, 3]  # homogeneous: same as PCI order


def test_device_order_fastest_first_vs_pci_bus_id(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus, snap = _hetero(monkeypatch)
    fastest = resolve_visible_devices(snap, {})
    assert [v.nvml_index for v in fastest] == [1, 2, 0]
    pci = resolve_visible_devices(snap, PCI)
    assert [v.nvml_index for v in pci] == [0, 1, 2]
    # The same index names a different GPU under each order.
    assert resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": "0"})[0].uuid == gpus[1].uuid
    assert (resolve_visible_devices(snap, {**PCI, "CUDA_VISIBLE_DEVICES": "0"})[0].uuid
            == gpus[0].uuid)


def test_fastest_first_ties_keep_pci_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bus ids listed out of NVML order: the model sorts by bus id, then by speed (stable).
    gpus = [make_gpu(0, pci_bus_id="00000000:81:00.0"), make_gpu(1, pci_bus_id="00000000:01:00.0")]
    snap = _snapshot(monkeypatch, gpus)
    assert [v.nvml_index for v in resolve_visible_devices(snap, {})] == [1, 0]


def test_index_list_selects_and_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _snapshot(monkeypatch, [make_gpu(n) for n in range(4)])
    visible = resolve_visible_devices(snap, {**PCI, "CUDA_VISIBLE_DEVICES": " 3, 1 "})
    assert [(v.cuda_ordinal, v.nvml_index) for v in visible] == [(0, 3), (1, 1)]


def test_uuid_and_unique_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(n) for n in range(3)]
    snap = _snapshot(monkeypatch, gpus)
    full = resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": f"{gpus[2].uuid},{gpus[0].uuid}"})
    assert [v.nvml_index for v in full] == [2, 0]
    prefix = gpus[1].uuid[:12]  # "GPU-00000001"
    assert [v.nvml_index for v in resolve_visible_devices(
        snap, {"CUDA_VISIBLE_DEVICES": prefix})] == [1]


def test_ambiguous_uuid_prefix_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _snapshot(monkeypatch, [make_gpu(n) for n in range(3)])
    with pytest.raises(ConfigError, match="ambiguous") as info:
        resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": "GPU-0000"})
    assert "longer" in info.value.hint


def _mig_snapshot(monkeypatch: pytest.MonkeyPatch) -> tuple[list, NvmlSnapshot]:
    migs = [FakeMig(mig_uuid(1, 0), gpu_instance_id=1, compute_instance_id=0),
            FakeMig(mig_uuid(1, 1), gpu_instance_id=2, compute_instance_id=0)]
    gpus = [make_gpu(0), make_gpu(1, name="NVIDIA H100", mig=migs)]
    return gpus, _snapshot(monkeypatch, gpus)


def test_mig_enabled_gpu_is_replaced_by_its_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus, snap = _mig_snapshot(monkeypatch)
    visible = resolve_visible_devices(snap, PCI)
    assert [v.uuid for v in visible] == [gpus[0].uuid, gpus[1].mig[0].uuid, gpus[1].mig[1].uuid]
    assert [v.nvml_index for v in visible] == [0, 1, 1]


def test_mig_uuid_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus, snap = _mig_snapshot(monkeypatch)
    new = resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": gpus[1].mig[1].uuid})
    assert [v.uuid for v in new] == [gpus[1].mig[1].uuid]
    legacy = resolve_visible_devices(
        snap, {"CUDA_VISIBLE_DEVICES": f"MIG-{gpus[1].uuid}/1/0"})
    assert [v.uuid for v in legacy] == [gpus[1].mig[0].uuid]
    assert legacy[0].nvml_index == 1 and legacy[0].device.is_mig
    with pytest.raises(ConfigError, match="no MIG instance"):
        resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": f"MIG-{gpus[1].uuid}/9/0"})
    with pytest.raises(ConfigError, match="malformed legacy MIG"):
        resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": f"MIG-{gpus[1].uuid}/x"})


@pytest.mark.parametrize("value", ["", "  ", "-1", "-1,0", "NoDevFiles"])
def test_values_meaning_no_devices(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    snap = _snapshot(monkeypatch, [make_gpu(0), make_gpu(1)])
    assert resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": value}) == ()


@pytest.mark.parametrize(("value", "words"), [
    ("0,,1", "empty entry"),
    ("0,", "empty entry"),
    ("0,-1", "not a device index"),
    ("2", "out of range"),
    ("0,0", "twice"),
    ("1gpu", "malformed"),
    ("0,GPU-00000000", "mixes indices and UUIDs"),
    ("GPU-12345678", "matches no visible GPU"),
    ("MIG-12345678", "matches no visible MIG"),
    ("GPU-00000000,GPU-00000000-aaaa", "twice"),
])
def test_malformed_visible_devices_raise_with_hint(monkeypatch: pytest.MonkeyPatch, value: str,
                                                   words: str) -> None:
    snap = _snapshot(monkeypatch, [make_gpu(0), make_gpu(1)])
    with pytest.raises(ConfigError, match=words) as info:
        resolve_visible_devices(snap, {"CUDA_VISIBLE_DEVICES": value})
    assert info.value.hint and "hint:" in str(info.value)


def test_bad_device_order_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _snapshot(monkeypatch, [make_gpu(0)])
    with pytest.raises(ConfigError, match="CUDA_DEVICE_ORDER"):
        resolve_visible_devices(snap, {"CUDA_DEVICE_ORDER": "SLOWEST_FIRST"})


def test_reads_os_environ_and_nvml_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0), make_gpu(1)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [v.nvml_index for v in resolve_visible_devices()] == [1]


_EIGHT = build_fake_pynvml([make_gpu(n) for n in range(8)])


def _eight_snapshot() -> NvmlSnapshot:
    sys_modules_backup = sys.modules.get("pynvml")
    sys.modules["pynvml"] = _EIGHT
    try:
        return query_nvml(include_processes=False)
    finally:
        if sys_modules_backup is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = sys_modules_backup


_EIGHT_SNAPSHOT = _eight_snapshot()


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(8)).flatmap(
    lambda p: st.integers(1, 8).map(lambda k: p[:k])),
    st.booleans(), st.sampled_from(["PCI_BUS_ID", "FASTEST_FIRST", None]))
def test_any_permutation_round_trips(indices: list[int], by_uuid: bool,
                                     order: str | None) -> None:
    devices = _EIGHT_SNAPSHOT.devices
    if by_uuid:
        value = ",".join(devices[i].uuid for i in indices)
    else:
        value = ",".join(map(str, indices))
    env = {"CUDA_VISIBLE_DEVICES": value}
    if order is not None:
        env["CUDA_DEVICE_ORDER"] = order
    visible = resolve_visible_devices(_EIGHT_SNAPSHOT, env)
    # Identical GPUs: FASTEST_FIRST keeps PCI order, so indices are NVML indices either way.
    assert [v.nvml_index for v in visible] == list(indices)
    assert [v.cuda_ordinal for v in visible] == list(range(len(indices)))
    # Feeding the resolved UUIDs back gives the same map.
    again = resolve_visible_devices(
        _EIGHT_SNAPSHOT, {"CUDA_VISIBLE_DEVICES": ",".join(v.uuid for v in visible)})
    assert again == visible


# ------------------------------------------------------------------------------ detection


def test_detect_joins_torch_and_nvml_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(n, memory_used=(n + 1) * GiB) for n in range(4)]
    install_fake_nvml(monkeypatch, gpus)
    # torch's order disagrees with NVML's; the UUID join must follow torch.
    install_fake_torch_cuda(monkeypatch, [gpus[2], gpus[0]])
    infos = detect_devices(env={})
    assert [(i.device_id, i.nvml_index) for i in infos] == [(0, 2), (1, 0)]
    first = infos[0]
    assert first.uuid == gpus[2].uuid and first.pci_bus_id == "00000000:03:00.0"
    assert first.memory_free == 77 * GiB and first.memory_used == 3 * GiB
    assert first.total_memory == 80 * GiB and first.multiprocessor_count == 132
    assert first.compute_capability == (9, 0) and first.supports_bf16 and first.supports_fp16
    assert first.max_shared_memory_per_block_optin == 227 * 1024
    assert first.l2_cache_size == 60 * 1024**2 and first.warp_size == 32
    assert first.jax_id is None and not first.unified_memory


def test_detect_with_old_torch_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0, compute_capability=(7, 0), torch_missing_attrs=frozenset(
        {"max_threads_per_block", "shared_memory_per_block", "shared_memory_per_block_optin",
         "L2_cache_size", "warp_size"}))
    install_fake_nvml(monkeypatch, [gpu])
    install_fake_torch_cuda(monkeypatch, [gpu])
    (info,) = detect_devices(env={})
    assert info.max_threads_per_block == 1024 and info.max_shared_memory_per_block == 48 * 1024
    assert info.max_shared_memory_per_block_optin is None and info.l2_cache_size is None
    assert info.warp_size is None
    assert info.supports_fp16 and not info.supports_bf16


def test_detect_falls_back_to_env_when_uuid_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(n) for n in range(3)]
    install_fake_nvml(monkeypatch, gpus)
    torch_view = [make_gpu(n + 100) for n in range(2)]  # UUIDs NVML has never heard of
    install_fake_torch_cuda(monkeypatch, torch_view)
    infos = detect_devices(env={**PCI, "CUDA_VISIBLE_DEVICES": "2,1"})
    assert [i.nvml_index for i in infos] == [2, 1]
    # If the env model disagrees with torch on the count, nothing is joined (no guessing).
    unjoined = detect_devices(env={**PCI, "CUDA_VISIBLE_DEVICES": "2"})
    assert [i.nvml_index for i in unjoined] == [None, None]
    # A value the env model rejects costs the join, not the detection.
    malformed = detect_devices(env={"CUDA_VISIBLE_DEVICES": "0,,1"})
    assert [(i.device_id, i.nvml_index) for i in malformed] == [(0, None), (1, None)]


def test_detect_mig_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus, _ = _mig_snapshot(monkeypatch)
    install_fake_torch_cuda(monkeypatch, [(gpus[1].mig[1], gpus[1])])
    (info,) = detect_devices(env={})
    assert info.is_mig and info.uuid == gpus[1].mig[1].uuid and info.nvml_index == 1
    assert info.total_memory == 40 * GiB and info.multiprocessor_count == 60


def test_detect_unified_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0, name="NVIDIA GH200 480GB", unified_memory=True)
    install_fake_nvml(monkeypatch, [gpu])
    install_fake_torch_cuda(monkeypatch, [gpu])
    (info,) = detect_devices(env={})
    assert info.unified_memory and info.memory_free is None and info.nvml_index == 0


def test_detect_with_torch_cuda_but_no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0)
    install_missing_nvml(monkeypatch)
    install_fake_torch_cuda(monkeypatch, [gpu])
    (info,) = detect_devices(env={})
    assert info.uuid == gpu.uuid and info.nvml_index is None and info.memory_free is None


def test_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    install_fake_nvml(monkeypatch, [make_gpu(0)])  # NVML sees a GPU, torch cannot use it
    assert detect_devices() == []
    caps = SystemDetector().detect_capabilities()
    assert caps.device_type is DeviceType.CPU and caps.device_count == 1
    assert caps.total_memory_mb is None and caps.compute_capability is None
    assert not caps.supports_mixed_precision and not caps.supports_distributed
    assert "torch cannot use CUDA" in (caps.reason or "")
    assert caps.driver_version == "560.35.03"
    install_missing_nvml(monkeypatch)
    assert "nvidia-ml-py" in (SystemDetector().detect_capabilities().reason or "")


def test_capabilities_four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(n) for n in range(3)] + [make_gpu(3, compute_capability=(8, 6),
                                                       memory_total=24 * GiB)]
    install_fake_nvml(monkeypatch, gpus)
    install_fake_torch_cuda(monkeypatch, gpus, cuda_version="12.8")
    detector = SystemDetector()
    assert isinstance(detector, DeviceDetector)
    assert len(detector.list_devices()) == 4
    caps = detector.detect_capabilities()
    assert caps.device_type is DeviceType.GPU and caps.device_count == 4
    assert caps.total_memory_mb == (3 * 80 + 24) * 1024
    assert caps.compute_capability == "8.6"  # the lowest
    assert caps.cuda_version == "12.8" and caps.driver_version == "560.35.03"
    assert caps.supports_mixed_precision and caps.supports_distributed and caps.reason is None


def test_capabilities_one_old_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed

    gpu = make_gpu(0, name="GTX 1080", compute_capability=(6, 1))
    install_fake_nvml(monkeypatch, [gpu])
    install_fake_torch_cuda(monkeypatch, [gpu])
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    caps = SystemDetector().detect_capabilities()
    assert caps.compute_capability == "6.1" and not caps.supports_mixed_precision
    assert not caps.supports_distributed
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert SystemDetector().detect_capabilities().supports_distributed


def test_summarize_without_snapshot() -> None:
    caps = summarize_capabilities([])
    assert caps.device_type is DeviceType.CPU and caps.reason == "no CUDA device visible to torch"


# ------------------------------------------------------------------------------------ JAX


def test_default_detection_never_imports_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0)
    install_fake_nvml(monkeypatch, [gpu])
    install_fake_torch_cuda(monkeypatch, [gpu])
    monkeypatch.setitem(sys.modules, "jax", None)  # any `import jax` now fails
    assert len(detect_devices(env={})) == 1
    assert len(SystemDetector().list_devices()) == 1
    with pytest.raises(JaxUnavailableError):
        detect_devices(include_jax=True, env={})


def test_jax_ids_joined_by_bus_id_then_local_hardware_id(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(n) for n in range(3)]
    install_fake_nvml(monkeypatch, gpus)
    install_fake_torch_cuda(monkeypatch, [gpus[2], gpus[0], gpus[1]])
    install_fake_jax(monkeypatch, [
        FakeJaxDevice(id=10, local_hardware_id=0, pci_bus_id="0000:01:00.0"),  # cuda:1 by bus
        FakeJaxDevice(id=11, local_hardware_id=0),  # no bus id: ordinal 0
        FakeJaxDevice(id=12, local_hardware_id=2),
    ])
    infos = detect_devices(include_jax=True, env={})
    assert [i.jax_id for i in infos] == [11, 10, 12]
    assert [i.jax_id for i in SystemDetector(include_jax=True).list_devices()] == [11, 10, 12]


def test_jax_without_gpu_backend_leaves_ids_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0)
    install_fake_nvml(monkeypatch, [gpu])
    install_fake_torch_cuda(monkeypatch, [gpu])
    install_fake_jax(monkeypatch, [], gpu_backend=False)
    assert [i.jax_id for i in detect_devices(include_jax=True, env={})] == [None]


def test_system_detector_detects_once_for_capabilities_and_listing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # DeviceManager asks for capabilities, then for the list: one detection must serve both.
    import vramkit.devices.info as info_module

    calls: list[int] = []
    real = info_module.detect_devices

    def counting(**kwargs: object) -> list:
        calls.append(1)
        return real(**kwargs)  # type: ignore[arg-type]

    install_fake_nvml(monkeypatch, [make_gpu(0)])
    install_fake_torch_cuda(monkeypatch, [make_gpu(0)])
    monkeypatch.setattr(info_module, "detect_devices", counting)
    detector = info_module.SystemDetector()
    caps = detector.detect_capabilities()
    devices = detector.list_devices()
    assert caps.device_count == len(devices) == 1 and len(calls) == 1
    detector.list_devices()  # later listings detect afresh
    assert len(calls) == 2
