"""The NVML layer against a fake ``pynvml``: enumeration, missing NVML, unified memory, MIG."""

from __future__ import annotations

import os

import pytest

from tests.devices.fakes import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    FakeMig,
    GiB,
    forbid_cuda,
    install_fake_nvml,
    install_missing_nvml,
    make_gpu,
    mig_uuid,
)
from vramkit.devices.nvml import (
    NvmlDevice,
    NvmlProcess,
    normalize_pci_bus_id,
    process_memory,
    query_nvml,
)


def test_zero_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install_fake_nvml(monkeypatch, [])
    snap = query_nvml()
    assert snap.available and snap.devices == () and snap.reason is None
    assert snap.driver_version == "560.35.03"
    assert nvml.init_calls == 1 and nvml.shutdown_calls == 1


def test_one_gpu_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0, memory_used=3 * GiB, utilization=(42, 17), pcie=(4, 8, 5, 16),
                   processes=[(111, 1 * GiB), (222, 2 * GiB)], graphics_processes=[(222, 2 * GiB)])
    install_fake_nvml(monkeypatch, [gpu], cuda_driver_version=12040)
    forbid_cuda(monkeypatch)  # NVML queries must never touch CUDA
    snap = query_nvml()
    (dev,) = snap.devices
    assert dev == NvmlDevice(
        index=0, uuid=gpu.uuid, name="NVIDIA H200", pci_bus_id="00000000:01:00.0",
        memory_total=80 * GiB, memory_free=77 * GiB, memory_used=3 * GiB,
        unified_memory=False, compute_capability=(9, 0), pcie_generation=4, pcie_width=8,
        pcie_max_generation=5, pcie_max_width=16, utilization_gpu=42, utilization_memory=17,
        cuda_cores=16896, max_sm_clock_mhz=1980,
        processes=(NvmlProcess(111, 1 * GiB, "C"), NvmlProcess(222, 2 * GiB, "C+G")),
        mig_enabled=False)
    assert snap.cuda_driver_version == "12.4"
    assert not dev.is_mig
    assert dev.process_memory(222) == 2 * GiB and dev.process_memory(999) == 0


def test_four_gpus_in_nvml_order(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [make_gpu(n) for n in range(4)]
    install_fake_nvml(monkeypatch, gpus)
    snap = query_nvml(include_processes=False)
    assert [d.index for d in snap.devices] == [0, 1, 2, 3]
    assert [d.uuid for d in snap.devices] == [g.uuid for g in gpus]
    assert snap.device_count == 4
    assert snap.by_uuid(gpus[2].uuid.upper()) is snap.devices[2]
    assert snap.by_uuid(gpus[2].uuid[4:]) is snap.devices[2]  # torch's form, no prefix
    assert snap.by_uuid("GPU-ffffffff-0000-0000-0000-000000000000") is None


def test_include_processes_false_skips_process_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0, processes=[(5, GiB)])])
    assert query_nvml(include_processes=False).devices[0].processes == ()
    assert query_nvml().devices[0].processes == (NvmlProcess(5, GiB, "C"),)


def test_nvml_not_installed_is_no_gpu_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    install_missing_nvml(monkeypatch)
    snap = query_nvml()
    assert not snap.available and snap.devices == ()
    assert "nvidia-ml-py" in (snap.reason or "")


@pytest.mark.parametrize(("code", "words"), [(NVML_ERROR_LIBRARY_NOT_FOUND, "not found"),
                                             (NVML_ERROR_DRIVER_NOT_LOADED, "driver not loaded")])
def test_nvml_init_failure_keeps_reason(monkeypatch: pytest.MonkeyPatch, code: int,
                                        words: str) -> None:
    nvml = install_fake_nvml(monkeypatch, [make_gpu(0)], init_error=code)
    snap = query_nvml()
    assert not snap.available and snap.devices == ()
    assert words in (snap.reason or "").lower()
    assert nvml.shutdown_calls == 0  # never initialized, so never shut down


def test_unified_memory_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0, name="NVIDIA GH200 480GB", unified_memory=True)])
    (dev,) = query_nvml().devices
    assert dev.unified_memory is True
    assert dev.memory_total is None and dev.memory_free is None and dev.memory_used is None
    assert dev.compute_capability == (9, 0)  # the rest still reported


def test_per_field_not_supported_is_none_for_that_field_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = make_gpu(0, not_supported=frozenset({"nvmlDeviceGetUtilizationRates",
                                               "nvmlDeviceGetCurrPcieLinkGeneration",
                                               "nvmlDeviceGetComputeRunningProcesses"}),
                   graphics_processes=[(7, GiB)])
    install_fake_nvml(monkeypatch, [gpu])
    (dev,) = query_nvml().devices
    assert dev.utilization_gpu is None and dev.utilization_memory is None
    assert dev.pcie_generation is None and dev.pcie_width == 16
    assert dev.processes == (NvmlProcess(7, GiB, "G"),)
    assert dev.memory_total == 80 * GiB and dev.unified_memory is False


def test_missing_getter_in_old_pynvml_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install_fake_nvml(monkeypatch, [make_gpu(0)])
    monkeypatch.delattr(nvml, "nvmlDeviceGetNumGpuCores")
    monkeypatch.delattr(nvml, "nvmlSystemGetCudaDriverVersion_v2")
    snap = query_nvml()
    assert snap.devices[0].cuda_cores is None and snap.cuda_driver_version is None


def test_lost_gpu_is_skipped_with_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install_fake_nvml(monkeypatch, [make_gpu(0), make_gpu(1, lost=True), make_gpu(2)])
    snap = query_nvml()
    assert [d.index for d in snap.devices] == [0, 2]
    assert len(snap.warnings) == 1 and "GPU 1" in snap.warnings[0]
    assert nvml.init_calls == nvml.shutdown_calls == 1


def test_mig_instances_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    migs = [FakeMig(mig_uuid(0, 0), gpu_instance_id=1, compute_instance_id=0,
                    processes=[(os.getpid(), 5 * GiB)]),
            FakeMig(mig_uuid(0, 1), gpu_instance_id=2, compute_instance_id=0)]
    install_fake_nvml(monkeypatch, [make_gpu(0, name="NVIDIA H100", mig=migs), make_gpu(1)])
    snap = query_nvml()
    parent = snap.devices[0]
    assert parent.mig_enabled and snap.devices[1].mig_enabled is False
    assert [m.uuid for m in parent.mig_devices] == [m.uuid for m in migs]
    first = parent.mig_devices[0]
    assert first.is_mig and first.parent_uuid == parent.uuid and first.index == 0
    assert (first.mig_index, first.gpu_instance_id, first.compute_instance_id) == (0, 1, 0)
    assert first.memory_total == 40 * GiB and first.compute_capability == (9, 0)
    assert len(snap.all_devices()) == 4
    assert snap.by_uuid(migs[1].uuid) is parent.mig_devices[1]
    assert process_memory() == 5 * GiB


def test_process_memory_sums_over_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    install_fake_nvml(monkeypatch, [
        make_gpu(0, processes=[(me, 2 * GiB), (1, 9 * GiB)], graphics_processes=[(me, 2 * GiB)]),
        make_gpu(1, processes=[(me, 3 * GiB)]),
        make_gpu(2)])
    assert process_memory() == 5 * GiB  # C+G on GPU 0 counted once
    assert process_memory(1) == 9 * GiB
    assert process_memory(424242) == 0
    assert process_memory([me, 1]) == 14 * GiB  # several PIDs, one NVML session


def test_process_memory_counts_mig_instances_not_the_aggregate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # In MIG mode the parent's process list aggregates its instances (with privileges): reading
    # both would count the same process twice.
    me = os.getpid()
    migs = [FakeMig(mig_uuid(0, 0), processes=[(me, 2 * GiB)]),
            FakeMig(mig_uuid(0, 1), gpu_instance_id=2, processes=[(me, 1 * GiB)])]
    install_fake_nvml(monkeypatch, [make_gpu(0, mig=migs, processes=[(me, 3 * GiB)])])
    assert process_memory() == 3 * GiB


def test_process_memory_unknown_or_unavailable_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0, processes=[(os.getpid(), None)])])
    assert process_memory() is None
    install_missing_nvml(monkeypatch)
    assert process_memory() is None
    install_fake_nvml(monkeypatch, [make_gpu(0)], init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
    assert process_memory() is None


@pytest.mark.parametrize(("raw", "expected"), [
    ("00000000:3B:00.0", "00000000:3b:00.0"),
    ("0000:3b:00.0", "00000000:3b:00.0"),
    (b"00000000:01:00.0\x00", "00000000:01:00.0"),
    ("", None),
    (None, None),
])
def test_normalize_pci_bus_id(raw: str | bytes | None, expected: str | None) -> None:
    assert normalize_pci_bus_id(raw) == expected


# -- NVLink between GPUs (sharded uploads of vramkit.distributed) ------------------------------


def _with_p2p(monkeypatch: pytest.MonkeyPatch, linked: set[frozenset[int]]) -> list[str]:
    """Four fake GPUs; pairs in ``linked`` report NVLink peer-to-peer OK."""
    gpus = [make_gpu(i) for i in range(4)]
    nvml = install_fake_nvml(monkeypatch, gpus)
    by_uuid = {g.uuid: i for i, g in enumerate(gpus)}

    def handle_by_uuid(uuid: str) -> int:
        if uuid not in by_uuid:
            raise nvml.NVMLError(13)  # NOT_FOUND
        return by_uuid[uuid]

    def p2p(a: int, b: int, index: int) -> int:
        assert index == nvml.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if frozenset((a, b)) in linked else 4  # OK / NOT_SUPPORTED

    nvml.NVML_P2P_CAPS_INDEX_NVLINK = 2
    nvml.NVML_P2P_STATUS_OK = 0
    nvml.nvmlDeviceGetHandleByUUID = handle_by_uuid
    nvml.nvmlDeviceGetP2PStatus = p2p
    return [g.uuid for g in gpus]


def test_nvlink_connected_needs_every_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.devices.nvml import nvlink_connected

    uuids = _with_p2p(monkeypatch, {frozenset(p) for p in ((0, 1), (0, 2), (1, 2))})
    forbid_cuda(monkeypatch)
    assert nvlink_connected(uuids[:3]) is True
    assert nvlink_connected(uuids) is False  # GPU 3 has no link
    assert nvlink_connected(uuids[3:]) is True  # one GPU
    # torch's form of a UUID (no "GPU-" prefix) is accepted
    assert nvlink_connected([u.removeprefix("GPU-") for u in uuids[:2]]) is True


def test_nvlink_connected_is_unknown_without_nvml_or_a_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.devices.nvml import nvlink_connected

    uuids = _with_p2p(monkeypatch, set())
    assert nvlink_connected([uuids[0], "GPU-00000000-0000-0000-0000-000000000000"]) is None
    install_missing_nvml(monkeypatch)
    assert nvlink_connected(uuids[:2]) is None
