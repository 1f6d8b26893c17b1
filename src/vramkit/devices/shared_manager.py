"""The process-wide :class:`~vramkit.devices.manager.DeviceManager` and the queries answered
through it.

:func:`get_device_manager` creates (and applies) one manager per process on first call; the
queries (:func:`has_gpu`, :func:`get_default_device`, :func:`print_device_info`) use it when it
exists and otherwise look through a manager that applies nothing, so that asking "is there a
GPU?" never caps memory or touches the environment.
"""

from __future__ import annotations

import threading
from typing import IO, TYPE_CHECKING, Any

from vramkit.devices.manager import DeviceConfiguration, DeviceManager
from vramkit.errors import ConfigError
from vramkit.units import format_size

if TYPE_CHECKING:
    import torch
    from rich.console import Console

__all__ = ["get_default_device", "get_device_manager", "has_gpu", "print_device_info"]

_shared_manager: DeviceManager | None = None
_shared_lock = threading.Lock()


def get_device_manager(config: DeviceConfiguration | None = None, force_reinit: bool = False,
                       *, detector: Any = None) -> DeviceManager:
    """The process-wide :class:`DeviceManager`, created (and applied) on first call.

    Args:
        config: configuration for a new shared manager (default: keep the existing one, or
            ``DeviceConfiguration()`` when there is none).
        force_reinit: replace the shared manager with a new one built from ``config``
            (default False). The new manager applies every setting that can still take effect
            and warns (:class:`~vramkit.errors.VramkitWarning`) about each one that cannot --
            JAX's memory fraction once its GPU backend started -- listing them in its
            ``settings`` (and ``get_device_info()["settings"]``).
        detector: detector for a newly created manager (default ``SystemDetector``).

    Returns:
        The shared manager.

    Raises:
        ConfigError: ``config`` differs from the shared manager's and ``force_reinit`` is
            False (it would otherwise be ignored).
        TooLateError: (without ``force_reinit``, for the first manager) a setting can no
            longer take effect.
    """
    global _shared_manager
    with _shared_lock:
        current = _shared_manager
        if current is not None and not force_reinit:
            if detector is not None:
                raise ConfigError(
                    "the shared DeviceManager already exists; a detector only applies to a new one",
                    "Pass force_reinit=True to rebuild it with this detector, or create your "
                    "own DeviceManager(detector=...).")
            if config is not None and config != current.config:
                raise ConfigError(
                    "the shared DeviceManager already exists with another configuration "
                    f"({current.config.memory_strategy.value}, "
                    f"fraction {current.config.effective_fraction})",
                    "Pass force_reinit=True to replace it, or create your own "
                    "DeviceManager(config).")
            return current
        _shared_manager = DeviceManager(config, detector=detector,
                                        on_too_late="warn" if force_reinit else "raise")
        return _shared_manager


def _manager_for_query() -> DeviceManager:
    # Queries use the shared manager when there is one; otherwise they look without applying
    # anything, so that asking "is there a GPU?" never caps memory or touches the environment.
    with _shared_lock:
        current = _shared_manager
    return current if current is not None else DeviceManager(apply=False)


def has_gpu() -> bool:
    """Whether this process has a GPU (shared manager, or detection without side effects).

    Returns:
        True when at least one GPU is available.
    """
    return _manager_for_query().has_gpu


def get_default_device() -> torch.device:
    """The default compute device (see :meth:`DeviceManager.get_default_device`).

    Returns:
        A ``torch.device``; the CPU when there is no GPU.
    """
    return _manager_for_query().get_default_device()


def print_device_info(manager: DeviceManager | None = None, *, file: IO[str] | None = None,
                      console: Console | None = None) -> None:
    """Print devices, configuration and versions as a table.

    Args:
        manager: the manager to describe (default: the shared one, or a detection-only one).
        file: text stream to write to (default stdout); ignored when ``console`` is given.
        console: a ``rich.console.Console`` to print on (default: a new one on ``file``).
    """
    from rich.console import Console
    from rich.table import Table

    info = (manager or _manager_for_query()).get_device_info()
    table = Table(title="vramkit devices", show_header=False)
    table.add_column("setting", style="bold")
    table.add_column("value")
    for key in ("backend", "default_device", "device_type", "device_count", "gpu_count",
                "memory_strategy", "memory_fraction", "preallocate", "platform_priority",
                "total_memory_mb", "compute_capability", "supports_mixed_precision"):
        table.add_row(key.replace("_", " "), str(info[key]))
    for name, version in info["versions"].items():
        table.add_row(f"{name} version", str(version) if version else "-")
    for setting, reason in info["settings"]["not_applied"].items():
        table.add_row(f"not applied: {setting}", reason)
    for dev in info["devices"]:
        table.add_row(f"cuda:{dev['device_id']}",
                      f"{dev['name']} ({format_size(dev['total_memory'])}, "
                      f"sm {dev['compute_capability']}, {dev['uuid'] or 'no uuid'})")
    (console or Console(file=file)).print(table)
