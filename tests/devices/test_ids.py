"""vramkit.devices.ids: the join keys of GPUs (UUIDs, PCI bus ids) in one canonical form.

The spellings NVML and PyTorch use are tested where they are read (test_info.py, test_nvml.py);
this file covers the forms only ids.py handles and the properties the joins rely on.
"""

from __future__ import annotations

import types

import pytest

from vramkit.devices import ids, info, nvml
from vramkit.devices.ids import is_full_uuid, normalize_pci_bus_id, normalize_uuid

CANONICAL = "8932f937-d72c-4106-c12f-20bd9faed9f6"
RAW = bytes.fromhex(CANONICAL.replace("-", ""))


def test_torch_uuid_bytes_as_a_list_of_ints() -> None:
    # torch's _CUuuid.bytes is a list of 16 ints, not a bytes object.
    cu_uuid = types.SimpleNamespace(bytes=list(RAW))
    assert normalize_uuid(cu_uuid) == CANONICAL
    assert normalize_uuid(bytearray(RAW)) == CANONICAL


def test_normalizing_is_idempotent() -> None:
    for form in (f"GPU-{CANONICAL}", f"MIG-{CANONICAL.upper()}", "MIG-GPU-ABC/1/0", RAW):
        once = normalize_uuid(form)
        assert normalize_uuid(once) == once


@pytest.mark.parametrize(("key", "full"), [
    (CANONICAL, True),
    (CANONICAL.replace("-", ""), True),
    ("mig-gpu-abc/1/0", False),  # legacy MIG text is kept, not a UUID
    ("8932f937", False),
    ("", False),
])
def test_is_full_uuid(key: str, full: bool) -> None:
    assert is_full_uuid(key) is full


def test_nvml_and_cuda_bus_ids_join() -> None:
    assert normalize_pci_bus_id("00000000:3B:00.0") == normalize_pci_bus_id("0000:3b:00.0")
    assert normalize_pci_bus_id(" 3b:00.0 ") == "3b:00.0"  # not domain:bus:device: lower-cased


def test_one_implementation_behind_the_old_import_paths() -> None:
    assert info.normalize_uuid is ids.normalize_uuid
    assert nvml.normalize_pci_bus_id is ids.normalize_pci_bus_id
