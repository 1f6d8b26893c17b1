"""Join keys of GPUs: UUIDs and PCI bus ids in one canonical form.

NVML, PyTorch and JAX each spell a device's identity their own way (``"GPU-8932f937-..."``,
a ``_CUuuid``, ``"0000:3b:00.0"``); vramkit joins them by these canonical forms.
"""

from __future__ import annotations

import re

__all__ = ["is_full_uuid", "normalize_pci_bus_id", "normalize_uuid"]

_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def normalize_uuid(value: object) -> str:
    """The join key of a GPU or MIG UUID: 8-4-4-4-12 lower-case hex, no ``GPU-``/``MIG-`` prefix.

    Accepts NVML's ``"GPU-8932f937-..."`` and ``"MIG-..."``, torch's ``props.uuid`` (a ``_CUuuid``
    whose ``str`` has no prefix and whose ``bytes`` is a list of 16 ints), 16 raw ``bytes``, and
    bare hex with or without dashes.
    Text that is not a 128-bit UUID (the legacy ``"MIG-GPU-<uuid>/gi/ci"``) comes back lower-cased
    and otherwise unchanged.

    Args:
        value: the UUID in any of those forms.

    Returns:
        The normalized UUID string.
    """
    raw = getattr(value, "bytes", value)
    if (isinstance(raw, (list, tuple)) and len(raw) == 16
            and all(isinstance(b, int) and 0 <= b < 256 for b in raw)):
        raw = bytes(raw)  # torch's _CUuuid.bytes is a list of 16 ints
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        digits = bytes(raw).hex()
    else:
        text = str(value).strip().lower()
        if text.startswith(("gpu-", "mig-")) and not text.startswith("mig-gpu-"):
            text = text[4:]
        digits = text.replace("-", "")
        if not _HEX32.match(digits):
            return text
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """Canonical PCI bus id: 8 hex digits of domain, lower case (``"00000000:3b:00.0"``).

    NVML gives ``"00000000:3B:00.0"``, the CUDA runtime ``"0000:3b:00.0"``; both map to the same
    string here so that they compare equal.

    Args:
        bus_id: a bus id in NVML or CUDA form, bytes or str, or ``None``.

    Returns:
        The canonical form, or ``None`` for ``None``/empty input.
    """
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    text = bus_id.strip().rstrip("\x00").lower()
    if not text:
        return None
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, rest = parts
        return f"{int(domain, 16):08x}:{bus}:{rest}"
    return text


def is_full_uuid(key: str) -> bool:
    """Whether a :func:`normalize_uuid` result is a whole 128-bit UUID (not MIG legacy text)."""
    return bool(_HEX32.match(key.replace("-", "")))
