"""The records of :class:`~vramkit.offload.cpu.CPUOffloadManager`: its settings, statistics,
managed tensors and load handles, and the name patterns it matches."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vramkit._validate import check_bool, check_choice, check_size
from vramkit.errors import ConfigError

if TYPE_CHECKING:
    from vramkit.offload.cpu import CPUOffloadManager

__all__ = ["CPUOffloadConfig", "CPUOffloadStats", "GradSeen", "LoadHandle", "Record",
           "as_patterns", "matches"]

_WRITEBACK_POLICIES = ("modified", "trainable")


@dataclass(frozen=True)
class CPUOffloadConfig:
    """Settings of a :class:`CPUOffloadManager`.

    Args:
        auto_load: when a forward reaches a module whose offloaded tensors are not loaded, load
            them (inactive, so the next :meth:`CPUOffloadManager.clear_inactive` drops them)
            instead of raising :class:`~vramkit.errors.OffloadError`. Default ``False``.
        writeback: which loaded tensors are copied back to their host master when cleared:
            ``"modified"`` (default) those whose autograd version counter changed since they
            were loaded (optimizer steps, in-place ops), trainable ones that received or
            still hold a gradient (fused optimizers do not bump the counter) and buffers of
            modules that ran a training-mode forward while loaded (running statistics);
            ``"trainable"`` those plus every tensor with ``requires_grad``. Frozen, unmodified
            tensors are never copied back.
        max_host_bytes: cap on the host memory the manager's own pool may reserve (int bytes or
            a size string such as ``"8GiB"``); ``None`` (default) means no cap. Not allowed
            together with a caller-supplied ``pinned_pool`` (configure that pool instead).

    Raises:
        ConfigError: for a value outside these ranges.
    """

    auto_load: bool = False
    writeback: str = "modified"
    max_host_bytes: int | str | None = None

    def __post_init__(self) -> None:
        check_bool("CPUOffloadConfig.auto_load", self.auto_load)
        check_choice("CPUOffloadConfig.writeback", self.writeback, _WRITEBACK_POLICIES)
        object.__setattr__(self, "max_host_bytes", check_size(
            "CPUOffloadConfig.max_host_bytes", self.max_host_bytes, minimum=1, allow_none=True))


@dataclass(frozen=True)
class CPUOffloadStats:
    """A snapshot of a :class:`CPUOffloadManager` (bytes are tensor bytes unless noted).

    Attributes:
        offloaded_tensors: tensors whose master lives on the host.
        offloaded_bytes: their bytes.
        kept_tensors: tensors kept on the device (``keep_on_gpu``).
        kept_bytes: their bytes.
        loaded_tensors: offloaded tensors with a device copy now.
        active_tensors: loaded tensors marked active (kept from ``clear_inactive``).
        resident_bytes: device bytes the manager accounts for: kept plus loaded tensors.
        host_bytes: bytes of the host pool allocations holding the masters (with alignment).
        pinned_bytes: ``host_bytes`` when the host pool is page-locked, else 0.
        loads: host->device tensor copies made so far.
        writebacks: device->host copies made when clearing modified tensors.
        h2d_bytes: bytes copied host->device (loads and restore).
        d2h_bytes: bytes copied device->host (offloading tensors from the device, write-backs).
        released_bytes: device-copy bytes dropped by clearing so far.
    """

    offloaded_tensors: int
    offloaded_bytes: int
    kept_tensors: int
    kept_bytes: int
    loaded_tensors: int
    active_tensors: int
    resident_bytes: int
    host_bytes: int
    pinned_bytes: int
    loads: int
    writebacks: int
    h2d_bytes: int
    d2h_bytes: int
    released_bytes: int


class Record:
    """One managed tensor: the user's tensor object plus where its bytes are."""

    __slots__ = ("active", "device_copy", "got_grad", "host_event", "kept", "load_event",
                 "loaded_version", "master", "names", "nbytes", "orig_device", "tensor",
                 "trained")

    def __init__(self, names: list[str], tensor: torch.Tensor, kept: bool) -> None:
        self.names = names
        self.tensor = tensor  # a strong reference also keeps id(tensor) unique while managed
        self.kept = kept
        self.nbytes = tensor.numel() * tensor.element_size()
        self.orig_device = tensor.device
        self.master: torch.Tensor | None = None
        self.device_copy: torch.Tensor | None = None
        self.load_event: Any = None  # set while the current stream has not waited for the load
        self.host_event: Any = None  # the last device->host copy into the master
        self.loaded_version = 0
        self.trained = False  # a buffer whose module ran a training-mode forward while loaded
        self.got_grad = False  # a gradient was accumulated into it while loaded
        self.active = False

    @property
    def name(self) -> str:
        return self.names[0]


class LoadHandle:
    """What :meth:`CPUOffloadManager.load_to_gpu` returns.

    Attributes:
        names: the primary names of the offloaded tensors the call resolved to.
        event: the event recorded after this call's copies (``None`` when nothing was copied).
        tensors: ``{name: tensor}`` for every resolved name (offloaded and kept), the user's
            tensor objects, whose storage is now on the device.
    """

    def __init__(self, manager: CPUOffloadManager, records: list[Record], event: Any,
                 tensors: dict[str, torch.Tensor]) -> None:
        self._manager = manager
        self._records = records
        # This call's copies and earlier loads of these tensors nobody has waited for yet.
        self._events = list({id(r.load_event): r.load_event for r in records
                             if r.load_event is not None}.values())
        self.names = tuple(r.name for r in records if not r.kept)
        self.event = event
        self.tensors = tensors

    def wait(self) -> None:
        """Make the current stream wait (on the GPU, no host sync) until the tensors are usable.
        Loads already waited for (by an earlier ``wait`` or a module's forward) are skipped."""
        self._manager._wait_loads(self._records)

    def done(self) -> bool:
        """Whether every copy this handle covers has completed (queries events, never blocks)."""
        streams = self._manager._streams
        return all(streams.done(event) for event in self._events)

    def synchronize(self) -> None:
        """Block the host until the copies have completed (not for hot paths)."""
        streams = self._manager._streams
        for event in self._events:
            streams.synchronize(event)

    def __repr__(self) -> str:
        return f"LoadHandle({len(self.names)} tensors, done={self.done()})"


class GradSeen:
    """Post-accumulate-grad hook: fused optimizers step without bumping the version counter,
    so a gradient arriving while a tensor is loaded is what marks it for write-back."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record

    def __call__(self, tensor: torch.Tensor) -> None:
        self.record.got_grad = True


def matches(name: str, pattern: str) -> bool:
    # "down_blocks.0" covers "down_blocks.0.weight" but not "down_blocks.01.weight".
    return name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)


def as_patterns(value: str | Iterable[str] | None, what: str) -> list[str]:
    if value is None:
        return []
    patterns = [value] if isinstance(value, str) else list(value)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{what} must be non-empty name patterns (str), got {pattern!r}",
                              hint="Give name patterns as non-empty strings, e.g. 'blocks.*' or "
                                   "['encoder.*', 'decoder.*'].")
    return patterns
