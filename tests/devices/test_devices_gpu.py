"""Device layer on a real NVIDIA GPU: NVML vs nvidia-smi, NVML/torch UUID join, env mapping.

Run on a GPU machine:
    PYTHONPATH=src python -m pytest tests/devices/test_devices_gpu.py -q -m gpu
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests._child import run_child
from vramkit.devices.info import detect_devices, normalize_uuid, resolve_visible_devices
from vramkit.devices.nvml import NvmlDevice, normalize_pci_bus_id, process_memory, query_nvml
from vramkit.devices.selection import select_device, select_devices, select_precision

pytestmark = pytest.mark.gpu

MiB = 1024**2


def _nvidia_smi(*fields: str) -> list[list[str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi not on PATH")
    out = subprocess.run([exe, f"--query-gpu={','.join(fields)}",
                          "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.strip().splitlines()]


def _run_child(code: str, env_changes: dict[str, str]) -> dict:
    return run_child(code, env=env_changes)  # type: ignore[no-any-return]


def _whole_gpus() -> list[NvmlDevice]:
    snap = query_nvml(include_processes=False)
    assert snap.available, snap.reason
    return [d for d in snap.devices if not d.mig_enabled]


def test_enumeration_matches_nvidia_smi() -> None:
    rows = _nvidia_smi("index", "uuid", "name", "pci.bus_id", "memory.total")
    snap = query_nvml()
    assert snap.available, snap.reason
    assert snap.driver_version and snap.cuda_driver_version
    assert len(snap.devices) == len(rows)
    for dev, (index, uuid, name, bus_id, total_mib) in zip(snap.devices, rows, strict=True):
        assert dev.index == int(index)
        assert dev.uuid == uuid
        assert dev.name == name
        assert dev.pci_bus_id == normalize_pci_bus_id(bus_id)
        if total_mib.startswith("["):  # "[N/A]": unified memory
            assert dev.memory_total is None and dev.unified_memory
        else:
            assert abs(dev.memory_total // MiB - int(total_mib)) <= 1
        assert dev.compute_capability is not None and dev.compute_capability >= (3, 0)


def test_nvml_and_torch_join_by_uuid() -> None:
    import torch

    snap = query_nvml(include_processes=False)
    infos = detect_devices(snapshot=snap)
    assert len(infos) == torch.cuda.device_count() > 0
    for info in infos:
        torch_uuid = normalize_uuid(torch.cuda.get_device_properties(info.device_id).uuid)
        nvml = snap.by_uuid(torch_uuid)
        assert nvml is not None, f"torch uuid {torch_uuid} unknown to NVML"
        assert info.nvml_index == nvml.index and normalize_uuid(info.uuid) == torch_uuid
        assert info.pci_bus_id == nvml.pci_bus_id
        assert info.compute_capability == torch.cuda.get_device_capability(info.device_id)
        assert info.multiprocessor_count > 0 and info.warp_size in (None, 32)
        if nvml.memory_total is not None:
            # CUDA's totalGlobalMem and NVML's total differ by reserved memory only.
            assert abs(info.total_memory - nvml.memory_total) < 0.05 * nvml.memory_total
    # No two CUDA ordinals map to the same physical device.
    assert len({i.uuid for i in infos}) == len(infos)


def test_env_model_agrees_with_cuda_here() -> None:
    import torch

    snap = query_nvml(include_processes=False)
    names = {d.name for d in snap.devices}
    if len(names) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        pytest.skip("heterogeneous GPUs under FASTEST_FIRST: the env model is approximate")
    visible = resolve_visible_devices(snap)
    torch_uuids = [normalize_uuid(torch.cuda.get_device_properties(i).uuid)
                   for i in range(torch.cuda.device_count())]
    assert [normalize_uuid(v.uuid) for v in visible] == torch_uuids


def _unique_prefix(uuid: str, others: list[str]) -> str:
    for length in range(12, len(uuid) + 1):  # "GPU-" + 8 hex digits at least
        prefix = uuid[:length]
        if not any(o.startswith(prefix) for o in others if o != uuid):
            return prefix
    return uuid


_CHILD = """
import json
import torch
from vramkit.devices.info import detect_devices, resolve_visible_devices
infos = detect_devices()
print(json.dumps({
    "count": torch.cuda.device_count(),
    "joined": [i.nvml_index for i in infos],
    "uuids": [i.uuid for i in infos],
    "env_model": [v.nvml_index for v in resolve_visible_devices()],
}))
"""


@pytest.mark.parametrize("form", ["uuid", "prefix", "pci_index"])
def test_cuda_visible_devices_in_subprocess(form: str) -> None:
    gpus = _whole_gpus()
    if not gpus:
        pytest.skip("every GPU is in MIG mode")
    target = gpus[-1]
    if form == "uuid":
        env = {"CUDA_VISIBLE_DEVICES": target.uuid}
    elif form == "prefix":
        env = {"CUDA_VISIBLE_DEVICES": _unique_prefix(target.uuid, [g.uuid for g in gpus])}
    else:
        env = {"CUDA_VISIBLE_DEVICES": str(target.index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    result = _run_child(_CHILD, env)
    assert result["count"] == 1
    assert result["joined"] == [target.index]
    assert result["uuids"] == [target.uuid]
    assert result["env_model"] == [target.index]


def test_selection_on_real_gpus() -> None:
    import torch

    choice = select_device("most_free_memory")
    assert 0 <= choice.cuda_ordinal < torch.cuda.device_count()
    selection = select_devices(1)
    assert selection.cuda_visible_devices == selection.devices[0].uuid
    precision = select_precision(choice.cuda_ordinal)
    major, _ = torch.cuda.get_device_capability(choice.cuda_ordinal)
    expected = torch.bfloat16 if major >= 8 else torch.float16 if major >= 6 else torch.float32
    assert precision.dtype == expected


def test_process_memory_sees_this_process() -> None:
    import torch

    block = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    used = process_memory()
    del block
    assert used is not None
    if used == 0:
        pytest.skip("NVML lists no process with this PID (container PID namespace)")
    assert used >= 512 * MiB


def test_jax_ids_are_joined() -> None:
    code = """
    import json
    try:
        import jax
        jax_gpus = jax.devices("gpu")
    except Exception as err:  # no JAX, or JAX without CUDA
        print(json.dumps({"skip": repr(err)}))
        raise SystemExit(0)
    from vramkit.devices.info import detect_devices
    infos = detect_devices(include_jax=True)
    print(json.dumps({"jax": sorted(d.id for d in jax_gpus),
                      "joined": sorted(i.jax_id for i in infos if i.jax_id is not None),
                      "count": len(infos)}))
    """
    result = _run_child(code, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if "skip" in result:
        pytest.skip(f"JAX GPU backend unavailable: {result['skip']}")
    assert result["joined"] == result["jax"]
    assert len(result["joined"]) == result["count"]
