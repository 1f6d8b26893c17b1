"""Device records and detectors: NVML, PyTorch and JAX views of the same GPUs, joined by UUID.

This module holds the records other modules share (:class:`DeviceInfo`,
:class:`DeviceCapabilities`, :class:`DeviceType`) and the :class:`DeviceDetector` protocol that
:class:`~vramkit.devices.manager.DeviceManager` accepts for tests and exotic hardware, plus the
default detector :class:`SystemDetector` and the functions behind it.

How the three views are joined
------------------------------
NVML numbers GPUs by PCI bus order; CUDA numbers them by ``CUDA_DEVICE_ORDER`` and
``CUDA_VISIBLE_DEVICES``; JAX numbers them its own way. The UUID is the only key all of them
share, so :func:`detect_devices` asks PyTorch for each CUDA ordinal's UUID
(``torch.cuda.get_device_properties(i).uuid``) and looks it up in NVML. That join is
authoritative. Only when a UUID is missing or unknown to NVML does it fall back to
:func:`resolve_visible_devices`, which models CUDA's enumeration from the environment.

``detect_devices`` initializes CUDA in this process (``get_device_properties`` creates the
runtime's state, not a context on every device); that is the point where device work starts.
:func:`resolve_visible_devices` and everything in :mod:`vramkit.devices.nvml` never touch CUDA.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from vramkit.devices.ids import is_full_uuid, normalize_pci_bus_id, normalize_uuid
from vramkit.errors import ConfigError, JaxUnavailableError

if TYPE_CHECKING:
    from vramkit.devices.nvml import NvmlDevice, NvmlSnapshot

__all__ = [
    "DeviceCapabilities",
    "DeviceDetector",
    "DeviceInfo",
    "DeviceType",
    "SystemDetector",
    "VisibleDevice",
    "detect_devices",
    "normalize_uuid",
    "resolve_visible_devices",
    "summarize_capabilities",
]

logger = logging.getLogger(__name__)

# Every CUDA GPU since compute capability 2.0 has these limits; they stand in when an old
# torch does not expose the property (the values are architectural, not guesses).
_MAX_THREADS_PER_BLOCK = 1024
_STATIC_SHARED_MEMORY_PER_BLOCK = 48 * 1024


class DeviceType(str, enum.Enum):
    """The kind of compute device (Artifex ``DeviceType``)."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


@dataclass(frozen=True)
class DeviceInfo:
    """One CUDA device as this process sees it (BitNet ``CudaDeviceInfo`` plus join keys).

    ``device_id`` is the CUDA ordinal (``torch.device("cuda", device_id)``), which depends on
    ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``; ``nvml_index`` is the physical index NVML
    uses; ``uuid`` joins the two (and JAX's view).
    """

    device_id: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessor_count: int
    max_threads_per_block: int
    max_shared_memory_per_block: int
    supports_fp16: bool
    supports_bf16: bool
    uuid: str | None = None
    pci_bus_id: str | None = None
    nvml_index: int | None = None
    max_shared_memory_per_block_optin: int | None = None
    l2_cache_size: int | None = None
    warp_size: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    unified_memory: bool = False
    jax_id: int | None = None
    is_mig: bool = False


@dataclass(frozen=True)
class DeviceCapabilities:
    """Summary of the compute devices of this process (Artifex ``DeviceCapabilities``).

    ``compute_capability`` is a string like ``"9.0"`` (the lowest among visible GPUs) and
    ``total_memory_mb`` the sum over visible GPUs, both ``None`` without a GPU. ``reason`` says
    why no GPU is used when ``device_type`` is CPU (NVML's reason, or torch without CUDA).
    """

    device_type: DeviceType
    device_count: int
    total_memory_mb: int | None = None
    compute_capability: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    supports_mixed_precision: bool = False
    supports_distributed: bool = False
    reason: str | None = None


@runtime_checkable
class DeviceDetector(Protocol):
    """What :class:`~vramkit.devices.manager.DeviceManager` needs from a detector.

    A detector may also define ``list_devices() -> Sequence[DeviceInfo]``; the manager uses it
    when present (for ``DeviceManager.devices``) and falls back to an empty list otherwise.
    """

    def detect_capabilities(self) -> DeviceCapabilities: ...


# ----------------------------------------------------------------------------------------------
# UUIDs




# ----------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER


class VisibleDevice(NamedTuple):
    """One entry of the CUDA-ordinal <-> NVML map built by :func:`resolve_visible_devices`.

    Attributes:
        cuda_ordinal: the index torch/JAX use in this process (``cuda:<cuda_ordinal>``).
        nvml_index: NVML's index of the physical GPU (the parent's for a MIG instance).
        uuid: the NVML UUID of what CUDA sees (``"GPU-..."``, or ``"MIG-..."`` for an instance).
        device: the NVML record.
    """

    cuda_ordinal: int
    nvml_index: int
    uuid: str
    device: NvmlDevice


_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
_VISIBLE_HINT = ("CUDA_VISIBLE_DEVICES takes comma-separated indices ('1,0'), GPU UUIDs or unique "
                 "prefixes ('GPU-8932f937'), or MIG UUIDs ('MIG-<uuid>'); run `nvidia-smi -L` to "
                 "list them.")


def _speed_key(dev: NvmlDevice) -> tuple[int, int, int, int]:
    cc = dev.compute_capability or (0, 0)
    return (cc[0], cc[1], dev.cuda_cores or 0, dev.max_sm_clock_mhz or 0)


def _cuda_enumeration(devices: Sequence[NvmlDevice], order: str) -> list[NvmlDevice]:
    """All devices CUDA would enumerate, in CUDA's order, before CUDA_VISIBLE_DEVICES applies."""
    by_bus = sorted(devices, key=lambda d: (d.pci_bus_id or "", d.index))
    if order == "FASTEST_FIRST":
        # Approximation of CUDA's heuristic: newest architecture, then most cores and the fastest
        # clock first; ties keep PCI bus order (Python's sort is stable).
        by_bus = sorted(by_bus, key=_speed_key, reverse=True)
    out: list[NvmlDevice] = []
    for dev in by_bus:
        # With MIG enabled CUDA sees the instances, never the parent GPU.
        out.extend(dev.mig_devices if dev.mig_enabled else (dev,))
    return out


def _match_uuid_prefix(prefix: str, candidates: Sequence[NvmlDevice], entry: str,
                       what: str) -> NvmlDevice:
    key = normalize_uuid(prefix) if len(prefix.replace("-", "")) == 32 else prefix.lower()
    matches = [d for d in candidates if normalize_uuid(d.uuid).startswith(key)]
    if not matches:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no visible {what}",
                          _VISIBLE_HINT)
    if len(matches) > 1:
        names = ", ".join(d.uuid for d in matches)
        raise ConfigError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is ambiguous: it is a prefix "
                          f"of {len(matches)} {what}s ({names})",
                          "Use a longer UUID prefix that matches one device only.")
    return matches[0]


def _resolve_entry(entry: str, whole: Sequence[NvmlDevice], migs: Sequence[NvmlDevice],
                   enumeration: Sequence[NvmlDevice]) -> list[NvmlDevice]:
    if entry.isdigit():
        position = int(entry)
        if position >= len(enumeration):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES index {position} is out of range: CUDA enumerates "
                f"{len(enumeration)} device(s) (indices 0..{len(enumeration) - 1})",
                _VISIBLE_HINT)
        return [enumeration[position]]
    if entry.startswith("MIG-GPU-"):
        match = re.fullmatch(r"MIG-(GPU-[0-9A-Fa-f-]+)/(\d+)/(\d+)", entry)
        if match is None:
            raise ConfigError(f"malformed legacy MIG entry {entry!r} in CUDA_VISIBLE_DEVICES",
                              "The legacy form is MIG-GPU-<gpu-uuid>/<gi>/<ci>; newer drivers "
                              "use MIG-<uuid> (see `nvidia-smi -L`).")
        parent = _match_uuid_prefix(match.group(1)[4:], whole, entry, "GPU")
        gi, ci = int(match.group(2)), int(match.group(3))
        for mig in parent.mig_devices:
            if mig.gpu_instance_id == gi and mig.compute_instance_id == ci:
                return [mig]
        raise ConfigError(f"CUDA_VISIBLE_DEVICES entry {entry!r}: GPU {parent.uuid} has no MIG "
                          f"instance with GPU instance {gi} and compute instance {ci}",
                          _VISIBLE_HINT)
    if entry.startswith("GPU-"):
        gpu = _match_uuid_prefix(entry[4:], whole, entry, "GPU")
        return list(gpu.mig_devices) if gpu.mig_enabled else [gpu]
    if entry.startswith("MIG-"):
        return [_match_uuid_prefix(entry[4:], migs, entry, "MIG instance")]
    raise ConfigError(f"malformed CUDA_VISIBLE_DEVICES entry {entry!r}", _VISIBLE_HINT)


def resolve_visible_devices(
    devices: NvmlSnapshot | Sequence[NvmlDevice] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[VisibleDevice, ...]:
    """Map CUDA ordinals to NVML devices from ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.

    This never initializes CUDA; it models what the CUDA runtime will do. Rules:

    * ``CUDA_DEVICE_ORDER``: ``PCI_BUS_ID`` enumerates by PCI bus id (what ``nvidia-smi``
      shows); ``FASTEST_FIRST`` (CUDA's default, also used when unset) is modelled as compute
      capability, then CUDA core count, then max SM clock, descending, ties in PCI order. The
      real FASTEST_FIRST order is the driver's; :func:`detect_devices` reads it from torch's
      UUIDs whenever CUDA is up, and this model is only the fallback. Any other value raises
      :class:`~vramkit.errors.ConfigError` (CUDA would silently use FASTEST_FIRST).
    * A GPU with MIG enabled is replaced by its MIG instances in the enumeration.
    * ``CUDA_VISIBLE_DEVICES`` unset: every enumerated device, in order.
    * Empty (or blank), ``"NoDevFiles"``, or a first entry that is negative (``"-1"``): no
      devices.
    * Otherwise a comma-separated list (spaces around entries ignored) of one kind only:
      decimal indices into the enumeration above; or ``GPU-<uuid>`` (a unique prefix is enough,
      ``GPU-8932f937``; a MIG-enabled GPU brings all its instances); or ``MIG-<uuid>`` (prefix
      allowed) and legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` for MIG instances. The list order is the
      CUDA ordinal order.
    * CUDA silently stops at the first invalid entry and turns duplicates into "no devices";
      vramkit raises :class:`~vramkit.errors.ConfigError` instead, with a hint, for: an empty
      entry (``"0,,1"``), a later negative or malformed entry, mixing indices with UUIDs, an
      index out of range, a UUID that matches nothing or is ambiguous, and duplicates.

    Args:
        devices: an :class:`~vramkit.devices.nvml.NvmlSnapshot` or a sequence of NVML device
            records (default: a fresh :func:`~vramkit.devices.nvml.query_nvml`).
        env: the environment to read (default: ``os.environ``).

    Returns:
        One :class:`VisibleDevice` per CUDA ordinal, in ordinal order.

    Raises:
        vramkit.errors.ConfigError: for the malformed values listed above.
    """
    if devices is None:
        from vramkit.devices.nvml import query_nvml

        devices = query_nvml(include_processes=False)
    whole = list(getattr(devices, "devices", devices))
    env = os.environ if env is None else env
    order = (env.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST").strip().upper()
    if order not in _ORDERS:
        raise ConfigError(f"CUDA_DEVICE_ORDER={env.get('CUDA_DEVICE_ORDER')!r} is not valid",
                          "Use CUDA_DEVICE_ORDER=PCI_BUS_ID (nvidia-smi's order) or "
                          "FASTEST_FIRST (CUDA's default).")
    enumeration = _cuda_enumeration(whole, order)
    chosen = _select_visible(env.get("CUDA_VISIBLE_DEVICES"), whole, enumeration)
    return tuple(
        VisibleDevice(ordinal, dev.index, dev.uuid, dev) for ordinal, dev in enumerate(chosen))


def _select_visible(value: str | None, whole: Sequence[NvmlDevice],
                    enumeration: Sequence[NvmlDevice]) -> list[NvmlDevice]:
    if value is None:
        return list(enumeration)
    text = value.strip()
    if not text or text == "NoDevFiles" or text.startswith("-"):
        return []
    entries = [e.strip() for e in text.split(",")]
    if any(not e for e in entries):
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={value!r} has an empty entry",
                          "Remove the stray comma; CUDA would ignore every entry after it.")
    kinds = {"index" if e.lstrip("+-").isdigit() else "uuid" for e in entries}
    if len(kinds) > 1:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={value!r} mixes indices and UUIDs",
                          "Use only indices or only UUIDs (torch and CUDA disagree on mixed "
                          "lists).")
    for entry in entries:
        if entry.startswith(("-", "+")):
            raise ConfigError(f"CUDA_VISIBLE_DEVICES={value!r}: entry {entry!r} is not a "
                              "device index",
                              "Remove it: CUDA ignores every entry from the first negative one "
                              "on; use '-1' alone to hide all devices.")
    migs = [m for dev in whole for m in dev.mig_devices]
    chosen: list[NvmlDevice] = []
    for entry in entries:
        for dev in _resolve_entry(entry, whole, migs, enumeration):
            if any(normalize_uuid(c.uuid) == normalize_uuid(dev.uuid) for c in chosen):
                raise ConfigError(f"CUDA_VISIBLE_DEVICES={value!r} names device {dev.uuid} "
                                  "twice",
                                  "List each device once; CUDA treats duplicates as 'no "
                                  "devices'.")
            chosen.append(dev)
    return chosen


# ----------------------------------------------------------------------------------------------
# torch and JAX views


def _torch_uuid(props: Any) -> str | None:
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    key = normalize_uuid(uuid)
    return key if is_full_uuid(key) else None


def _torch_pci_bus_id(props: Any) -> str | None:
    bus = getattr(props, "pci_bus_id", None)
    if not isinstance(bus, int):
        return None
    domain = getattr(props, "pci_domain_id", 0)
    device = getattr(props, "pci_device_id", 0)
    domain = domain if isinstance(domain, int) else 0
    device = device if isinstance(device, int) else 0
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _device_info(ordinal: int, props: Any, nvml: NvmlDevice | None,
                 uuid_key: str | None) -> DeviceInfo:
    cc = (int(props.major), int(props.minor))
    l2 = getattr(props, "L2_cache_size", None)
    if l2 is None:
        l2 = getattr(props, "l2_cache_size", None)
    if nvml is not None:
        uuid: str | None = nvml.uuid
    else:
        uuid = f"GPU-{uuid_key}" if uuid_key is not None else None
    return DeviceInfo(
        device_id=ordinal,
        name=str(props.name),
        compute_capability=cc,
        total_memory=int(props.total_memory),
        multiprocessor_count=int(props.multi_processor_count),
        max_threads_per_block=(_int_or_none(getattr(props, "max_threads_per_block", None))
                               or _MAX_THREADS_PER_BLOCK),
        max_shared_memory_per_block=(
            _int_or_none(getattr(props, "shared_memory_per_block", None))
            or _STATIC_SHARED_MEMORY_PER_BLOCK),
        supports_fp16=cc >= (6, 0),
        supports_bf16=cc >= (8, 0),
        uuid=uuid,
        pci_bus_id=(nvml.pci_bus_id if nvml is not None and nvml.pci_bus_id
                    else _torch_pci_bus_id(props)),
        nvml_index=nvml.index if nvml is not None else None,
        max_shared_memory_per_block_optin=_int_or_none(
            getattr(props, "shared_memory_per_block_optin", None)),
        l2_cache_size=_int_or_none(l2),
        warp_size=_int_or_none(getattr(props, "warp_size", None)),
        memory_free=nvml.memory_free if nvml is not None else None,
        memory_used=nvml.memory_used if nvml is not None else None,
        unified_memory=(nvml.unified_memory if nvml is not None
                        else bool(getattr(props, "is_integrated", False))),
        is_mig=nvml.is_mig if nvml is not None else False,
    )


def _torch_cuda() -> Any | None:
    """``torch.cuda`` when torch is importable and CUDA usable, else ``None``."""
    from vramkit.devices._runtime import is_cuda_available

    if not is_cuda_available():
        return None
    import torch

    return torch.cuda


def detect_devices(
    *,
    include_jax: bool = False,
    snapshot: NvmlSnapshot | None = None,
    env: Mapping[str, str] | None = None,
) -> list[DeviceInfo]:
    """The CUDA devices this process can use, with NVML's view joined in by UUID.

    Reads PyTorch's device properties for each CUDA ordinal (this initializes CUDA in torch,
    which is acceptable here: callers ask for devices because they are about to use them) and
    joins each to NVML by UUID for the NVML index, PCI bus id and free/used memory. When torch's
    UUID is missing or unknown to NVML, the ordinal is mapped through
    :func:`resolve_visible_devices` instead (the environment model), if that model has the same
    number of devices as torch.

    Args:
        include_jax: also fill ``jax_id`` from ``jax.devices("gpu")`` (default ``False``; JAX is
            imported only then). Creating JAX's GPU client preallocates 75% of GPU memory unless
            ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` is set.
        snapshot: an NVML snapshot to join with (default: a fresh ``query_nvml()``).
        env: environment for the fallback mapping (default: ``os.environ``).

    Returns:
        One :class:`DeviceInfo` per CUDA ordinal; empty when torch has no usable CUDA.

    Raises:
        vramkit.errors.JaxUnavailableError: ``include_jax`` without JAX installed.

    A malformed ``CUDA_VISIBLE_DEVICES`` met in the fallback is logged as a warning and leaves
    the affected devices unjoined (``nvml_index=None``): torch already accepted it, so detection
    itself still succeeds.
    """
    cuda = _torch_cuda()
    if cuda is None:
        infos: list[DeviceInfo] = []
    else:
        if snapshot is None:
            from vramkit.devices.nvml import query_nvml

            snapshot = query_nvml(include_processes=False)
        infos = _join_torch_with_nvml(cuda, snapshot, env)
    if include_jax:
        infos = _attach_jax_ids(infos)
    return infos


def _join_torch_with_nvml(cuda: Any, snapshot: NvmlSnapshot,
                          env: Mapping[str, str] | None) -> list[DeviceInfo]:
    count = int(cuda.device_count())
    fallback: tuple[VisibleDevice, ...] | None = None
    infos: list[DeviceInfo] = []
    for ordinal in range(count):
        props = cuda.get_device_properties(ordinal)
        key = _torch_uuid(props)
        nvml = snapshot.by_uuid(key) if key is not None and snapshot.available else None
        if nvml is None and snapshot.available and snapshot.devices:
            if fallback is None:
                try:
                    fallback = resolve_visible_devices(snapshot, env)
                except ConfigError as err:
                    # torch already enumerated devices, so CUDA accepted this environment; an
                    # env model that cannot read it only costs the join, not the detection.
                    logger.warning("cannot map cuda:%d to NVML: %s", ordinal, err.message)
                    fallback = ()
            if len(fallback) == count:
                nvml = fallback[ordinal].device
                logger.debug("cuda:%d joined to NVML %d by environment (uuid %s not in NVML)",
                             ordinal, nvml.index, key)
            else:
                logger.debug("cuda:%d not joined: torch sees %d devices, env model %d",
                             ordinal, count, len(fallback))
        infos.append(_device_info(ordinal, props, nvml, key))
    return infos


def _attach_jax_ids(infos: list[DeviceInfo]) -> list[DeviceInfo]:
    try:
        import jax  # only here: the default path must never import JAX
    except ImportError as err:
        raise JaxUnavailableError(f"include_jax=True but JAX is not importable ({err})") from err
    try:
        jax_devices = list(jax.devices("gpu"))
    except RuntimeError as err:  # no GPU backend in this jaxlib (CPU-only install)
        logger.debug("JAX has no GPU backend: %s", err)
        return infos
    by_bus = {i.pci_bus_id: n for n, i in enumerate(infos) if i.pci_bus_id}
    out = list(infos)
    for dev in jax_devices:
        # JAX has no UUID; prefer its PCI bus id when this jaxlib reports one, else its local
        # hardware id, which is the CUDA ordinal (JAX honours CUDA_VISIBLE_DEVICES the same way).
        bus = normalize_pci_bus_id(getattr(dev, "pci_bus_id", None) or None)
        position = by_bus.get(bus) if bus else None
        if position is None:
            hw = getattr(dev, "local_hardware_id", None)
            position = hw if isinstance(hw, int) and 0 <= hw < len(out) else None
        if position is not None:
            out[position] = dataclasses.replace(out[position], jax_id=int(dev.id))
    return out


# ----------------------------------------------------------------------------------------------
# capabilities


def _nccl_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_nccl_available())


def summarize_capabilities(devices: Sequence[DeviceInfo],
                           snapshot: NvmlSnapshot | None = None) -> DeviceCapabilities:
    """Reduce per-device records to a :class:`DeviceCapabilities` summary.

    Args:
        devices: the CUDA devices of this process (from :func:`detect_devices`).
        snapshot: NVML's snapshot, for the driver versions and the no-GPU reason (optional).

    Returns:
        GPU capabilities when ``devices`` is non-empty; otherwise ``DeviceType.CPU`` with
        ``device_count=1`` (the CPU itself), no mixed precision and no distributed support.
    """
    driver = snapshot.driver_version if snapshot is not None else None
    try:
        import torch

        runtime_cuda = torch.version.cuda
    except ImportError:
        runtime_cuda = None
    cuda_version = runtime_cuda or (snapshot.cuda_driver_version if snapshot else None)
    if not devices:
        if snapshot is not None and not snapshot.available:
            reason = snapshot.reason
        elif snapshot is not None and snapshot.devices:
            reason = (f"NVML sees {len(snapshot.devices)} GPU(s) but torch cannot use CUDA "
                      "(CPU-only torch build, or CUDA_VISIBLE_DEVICES hides them)")
        else:
            reason = "no CUDA device visible to torch"
        return DeviceCapabilities(device_type=DeviceType.CPU, device_count=1,
                                  cuda_version=runtime_cuda, driver_version=driver,
                                  reason=reason)
    lowest = min(d.compute_capability for d in devices)
    return DeviceCapabilities(
        device_type=DeviceType.GPU,
        device_count=len(devices),
        total_memory_mb=sum(d.total_memory for d in devices) // (1024 * 1024),
        compute_capability=f"{lowest[0]}.{lowest[1]}",
        cuda_version=cuda_version,
        driver_version=driver,
        supports_mixed_precision=lowest >= (7, 0),
        supports_distributed=len(devices) > 1 or _nccl_available(),
    )


class SystemDetector:
    """The default detector: NVML + PyTorch (+ JAX on request) of this machine.

    Args:
        include_jax: fill ``DeviceInfo.jax_id`` (imports JAX; default ``False``).
        env: environment for the fallback ordinal mapping (default: ``os.environ``).
    """

    def __init__(self, *, include_jax: bool = False,
                 env: Mapping[str, str] | None = None) -> None:
        self.include_jax = include_jax
        self.env = env
        # The devices found by the last detect_capabilities(), handed to the list_devices()
        # call that follows it (DeviceManager asks for both), so one detection serves both.
        self._pending_devices: list[DeviceInfo] | None = None

    def _snapshot(self) -> NvmlSnapshot:
        from vramkit.devices.nvml import query_nvml

        return query_nvml(include_processes=False)

    def list_devices(self) -> list[DeviceInfo]:
        """The CUDA devices of this process (see :func:`detect_devices`).

        Right after :meth:`detect_capabilities` this returns the devices that call detected
        (once); otherwise it detects afresh.
        """
        devices, self._pending_devices = self._pending_devices, None
        if devices is not None:
            return devices
        return detect_devices(include_jax=self.include_jax, snapshot=self._snapshot(),
                              env=self.env)

    def detect_capabilities(self) -> DeviceCapabilities:
        """A :class:`DeviceCapabilities` summary of :meth:`list_devices`."""
        snapshot = self._snapshot()
        devices = detect_devices(include_jax=self.include_jax, snapshot=snapshot, env=self.env)
        self._pending_devices = devices
        return summarize_capabilities(devices, snapshot)
