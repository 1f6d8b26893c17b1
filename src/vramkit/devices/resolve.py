"""Which device a request means, on this machine: the one device resolver of vramkit.

:func:`vramkit._validate.check_device` checks a device value's form (configs do that, so they can
be made anywhere); :func:`resolve_device` also checks that the device is there, and gives
``cuda`` its index, when work starts. Neither creates a CUDA context: ``"cuda"`` means the current
device, which is ordinal 0 until CUDA starts (the current device of a fresh process). Importing
this module does not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from vramkit._validate import check_device
from vramkit.devices import _runtime
from vramkit.errors import DeviceError

if TYPE_CHECKING:
    import torch

__all__ = ["cuda_ordinal", "resolve_device"]


def _visible_note() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""


def resolve_device(device: Any, *, owner: str, default: str = "cuda",
                   types: Collection[str] = ("cpu", "cuda")) -> torch.device:
    """The device ``owner`` runs on: its form checked, and a CUDA device checked to be visible.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int ordinal, a ``torch.device``, a vramkit
            ``Device``, or ``None`` (``default``).
        owner: who asks (``"BlockSwapper"``), for messages.
        default: the device ``None`` means (default ``"cuda"``: the current CUDA device).
        types: device types ``owner`` takes (default cpu and cuda).

    Returns:
        ``cpu``, or ``cuda:N`` with an explicit index (other accepted types as given).

    Raises:
        InvalidDeviceError: for a value that is not a device of an accepted type.
        DeviceError: when CUDA is not available, or the ordinal is not visible to this process.
    """
    import torch

    resolved = check_device(f"{owner} device", default if device is None else device, types=types)
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        return resolved
    return torch.device("cuda", cuda_ordinal(resolved, owner=owner))


def cuda_ordinal(device: torch.device, *, owner: str) -> int:
    """The ordinal of a CUDA ``torch.device`` after checking it is visible.

    Raises:
        DeviceError: when CUDA is not available or the ordinal is out of range.
    """
    # Through the module, so the one seam tests replace (_runtime.is_cuda_available) applies.
    if not _runtime.is_cuda_available():
        raise DeviceError(f"{owner} cannot use {device}: CUDA is not available",
                          hint=f"Pass device='cpu' to run {owner} on the host, or run "
                               "`vramkit info` to see why no GPU is visible.")
    import torch

    index = device.index if device.index is not None else _runtime.current_cuda_ordinal()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise DeviceError(f"{owner} cannot use cuda:{index}: it does not exist (this process "
                          f"sees {count} CUDA device(s){_visible_note()})",
                          hint="Run `vramkit info` to see the devices this process can see.")
    return index
