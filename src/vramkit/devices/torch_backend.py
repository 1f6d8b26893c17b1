"""PyTorch device handles, streams, peer access and non-blocking placement (FLAME device API).

:class:`Device` is a small frozen value (``cpu`` or ``cuda:N``) that can be used as a dict key and
compared; it touches hardware only when asked to (``info``, streams, ``synchronize``).

Transfers follow the project rule "no host syncs in steady state":

* host -> device from *pageable* memory is staged through a pinned buffer taken from PyTorch's
  caching host allocator. A pageable ``cudaMemcpyAsync`` makes the driver wait for all earlier work
  on the stream before it copies (see the CUDA "API synchronization behavior" notes), which stalls
  the Python thread behind the GPU; the pinned copy does not. The staging buffer is not reused
  before the DMA finishes because ``copy_(non_blocking=True)`` records a CUDA event on the pinned
  block and the caching host allocator hands the block out again only after that event completes.
* device -> host with ``non_blocking=True`` lands in a pinned tensor that is valid to read only once
  the copy has finished; ask for ``return_event=True`` to get the event to wait on.

Importing this module does not initialize CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

import torch

from vramkit._validate import check_device, check_int
from vramkit.devices._runtime import current_cuda_ordinal
from vramkit.errors import ConfigError, DeviceError, DeviceMismatchError, InvalidDeviceError

if TYPE_CHECKING:
    from vramkit.devices.info import DeviceInfo

__all__ = [
    "CpuStream",
    "Device",
    "DeviceLike",
    "can_access_peer",
    "distribute_batch",
    "enable_peer_access",
    "ensure_same_device",
    "to_device",
]

logger = logging.getLogger(__name__)

DeviceLike: TypeAlias = "Device | torch.device | str | int"
"""Anything :meth:`Device.from_torch` accepts: a Device, a torch.device, ``"cuda:1"``, or a CUDA
ordinal as an int."""

_SUPPORTED_TYPES = ("cpu", "cuda")


class _NotATensorError(ConfigError, TypeError):
    """An argument that must be a ``torch.Tensor`` is not (a ConfigError and a TypeError)."""

    default_hint = "Pass torch.Tensor objects (or a dict/list/tuple of them where documented)."


# Streams created through Device.new_stream, per CUDA ordinal, keyed by the raw cudaStream_t.
# Strong references on purpose: torch's stream objects do not clear weak references when they
# die (a WeakSet handed back a freed object and is_idle() crashed in stream.query() on the H200),
# and the streams themselves come from torch's fixed per-device pool and are never destroyed, so
# keying by handle keeps this bounded (at most the pool's size per device and priority).
_streams_lock = threading.Lock()
_streams_by_ordinal: dict[int, dict[int, Any]] = {}

# (reading ordinal, read ordinal) pairs whose peer access enable_peer_access turned on. Peer
# access lasts as long as the CUDA context, i.e. the process, so the set only grows.
_peer_lock = threading.Lock()
_peers_enabled: set[tuple[int, int]] = set()


def _list_cuda_devices() -> list[DeviceInfo]:
    # The joined NVML + torch records (one detection); a seam the CPU tests replace.
    from vramkit.devices.info import detect_devices

    return detect_devices()


def _visible_devices_note() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""


class CpuStream:
    """The stream :meth:`Device.new_stream` returns for the CPU: a documented no-op.

    PyTorch runs CPU operations synchronously on the calling thread, so there is nothing to
    order or wait for. This object exists so that device-agnostic code (a swapper tested on CPU)
    can create, enter, query and synchronize streams without branching on the device type.
    ``query()`` is always ``True``; ``synchronize``, ``wait_stream`` and ``wait_event`` do nothing.

    Args:
        priority: recorded for symmetry with ``torch.cuda.Stream``; it has no effect on CPU.
    """

    device = torch.device("cpu")

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    def query(self) -> bool:
        """Return ``True``: CPU work is complete when the call that issued it returns."""
        return True

    def synchronize(self) -> None:
        """Do nothing (nothing is pending on the CPU)."""

    def wait_stream(self, stream: object) -> None:
        """Do nothing (CPU work is already ordered by program order)."""

    def wait_event(self, event: object) -> None:
        """Do nothing (CPU work is already ordered by program order)."""

    def __repr__(self) -> str:
        return f"CpuStream(priority={self.priority})"


@dataclass(frozen=True)
class Device:
    """A handle to one compute device: ``cpu`` or ``cuda:N`` (FLAME ``Device``).

    A Device is a plain value: equal handles compare equal and hash alike, and constructing one
    does not touch the hardware, so it can be built on any machine (for plans and configs).
    Methods that use the GPU (:attr:`info`, :meth:`new_stream`, :meth:`stream`,
    :meth:`synchronize`) first check that the ordinal is visible to this process and raise
    :class:`~vramkit.errors.DeviceError` if it is not.

    Args:
        type: ``"cpu"`` or ``"cuda"``.
        index: the CUDA ordinal (``None`` for the CPU).
    """

    type: str
    index: int | None = None

    def __post_init__(self) -> None:
        if self.type not in _SUPPORTED_TYPES:
            raise InvalidDeviceError(
                f"unsupported device type {self.type!r}: vramkit handles 'cpu' and 'cuda' devices",
                "Use Device.cpu() or Device.cuda(i).")
        if self.type == "cpu":
            if self.index is not None:
                raise ConfigError(f"a CPU device has no index, got index={self.index!r}",
                                  "Use Device.cpu().")
            return
        check_int("a CUDA ordinal", self.index, minimum=0,
                  hint="Use Device.cuda(0) for the first visible GPU.")

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def cuda(cls, index: int = 0) -> Device:
        """The CUDA device with ordinal ``index`` (default 0, as this process numbers them)."""
        return cls("cuda", index)

    @classmethod
    def cpu(cls) -> Device:
        """The host CPU."""
        return cls("cpu", None)

    @classmethod
    def from_torch(cls, device: DeviceLike) -> Device:
        """Build a Device from a torch.device, a string, an int ordinal or a Device.

        ``"cuda"`` without an index means the current CUDA device: ``torch.cuda.current_device()``
        once CUDA is initialized, and ordinal 0 before (the current device of a fresh process),
        so that this call never initializes CUDA. ``"cpu:0"`` is the CPU.

        Args:
            device: the device to convert. An ``int`` is a CUDA ordinal, as in PyTorch.

        Returns:
            The equivalent Device.

        Raises:
            InvalidDeviceError: (a ``ConfigError`` and a ``DeviceError``) for booleans, negative
                ordinals, values torch does not parse and device types other than cpu/cuda.
        """
        if isinstance(device, Device):
            return device
        # A tensor's own device (the common case, on every to_device) needs no checking.
        parsed = (device if type(device) is torch.device and device.type in _SUPPORTED_TYPES
                  else check_device("Device.from_torch", device))
        if parsed.type == "cpu":
            return cls.cpu()
        return cls.cuda(parsed.index if parsed.index is not None else current_cuda_ordinal())

    # -- properties -------------------------------------------------------------------------------

    @property
    def ordinal(self) -> int | None:
        """The CUDA ordinal, ``None`` for the CPU (FLAME ``ordinal()``)."""
        return self.index

    @property
    def is_cuda(self) -> bool:
        """Whether this is a CUDA device."""
        return self.type == "cuda"

    @property
    def torch_device(self) -> torch.device:
        """The equivalent ``torch.device``."""
        return torch.device(self.type, self.index) if self.is_cuda else torch.device("cpu")

    @property
    def info(self) -> DeviceInfo | None:
        """The :class:`~vramkit.devices.info.DeviceInfo` record of this GPU; ``None`` for the CPU.

        Raises:
            DeviceError: if the ordinal is not visible, or no record describes it.
        """
        if not self.is_cuda:
            return None
        self.validate()
        for record in _list_cuda_devices():
            if record.device_id == self.index:
                return record
        raise DeviceError(f"no device record describes {self}: the device listing and "
                          f"torch.cuda.device_count() disagree{_visible_devices_note()}")

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.is_cuda else "cpu"

    # -- checks ---------------------------------------------------------------------------------

    def _cuda_ordinal(self) -> int:
        if self.index is None:
            raise DeviceError("the CPU has no CUDA ordinal", "Use a CUDA device here.")
        return self.index

    def validate(self) -> Device:
        """Check that this device is visible to the process; return ``self``.

        Uses ``torch.cuda.device_count()``, which counts devices without creating a CUDA context.

        Raises:
            DeviceError: for a CUDA ordinal at or beyond the number of visible devices.
        """
        if not self.is_cuda:
            return self
        count = torch.cuda.device_count()
        if self._cuda_ordinal() >= count:
            visible = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise DeviceError(
                f"{self} is not visible to this process: it sees {count} CUDA device(s) "
                f"[{visible}]{_visible_devices_note()}",
                f"Use an ordinal below {count}, or check CUDA_VISIBLE_DEVICES; run `vramkit info` "
                "to list the devices." if count else
                "This process sees no CUDA device: use Device.cpu(), or run on a GPU machine.")
        return self

    # -- streams and synchronization -----------------------------------------------------------

    def new_stream(self, priority: int = 0) -> Any:
        """Create a stream on this device and track it for :meth:`is_idle`.

        Args:
            priority: CUDA stream priority (default 0); lower numbers run first, and torch clamps
                values outside the device's range to its nearest end. Ignored on the CPU.

        Returns:
            A ``torch.cuda.Stream`` on this device, or a :class:`CpuStream` (a no-op) on the CPU.
        """
        check_int("stream priority", priority)
        if not self.is_cuda:
            return CpuStream(priority)
        self.validate()
        stream = torch.cuda.Stream(device=self.torch_device, priority=priority)
        with _streams_lock:
            _streams_by_ordinal.setdefault(self._cuda_ordinal(), {})[stream.cuda_stream] = stream
        return stream

    @contextlib.contextmanager
    def stream(self, stream: Any = None) -> Iterator[Any]:
        """Run the enclosed work on ``stream``, with this device as the current device.

        Args:
            stream: a stream from :meth:`new_stream` (or any ``torch.cuda.Stream`` on this device);
                ``None`` keeps the device's current stream and only switches the device.

        Yields:
            The stream in use (the current stream when ``stream`` is None).

        Raises:
            DeviceMismatchError: if the stream belongs to another device.
        """
        if not self.is_cuda:
            if stream is not None and not isinstance(stream, CpuStream):
                raise DeviceMismatchError(self.torch_device, getattr(stream, "device", stream),
                                          what="the stream")
            yield stream if stream is not None else CpuStream()
            return
        self.validate()
        if stream is not None and torch.device(stream.device) != self.torch_device:
            raise DeviceMismatchError(self.torch_device, stream.device, what="the stream",
                                      hint="Create the stream with this device's new_stream().")
        with torch.cuda.device(self.index):
            if stream is None:
                yield torch.cuda.current_stream(self.index)
            else:
                with torch.cuda.stream(stream):
                    yield stream

    def synchronize(self) -> None:
        """Block until all work queued on this device has finished (FLAME ``synchronize``).

        A host sync: use it at phase boundaries, never per step. Does nothing on the CPU, and
        nothing before CUDA is initialized (no work can be queued yet), so it never creates a
        CUDA context.
        """
        if not self.is_cuda or not torch.cuda.is_initialized():
            return
        self.validate()
        torch.cuda.synchronize(self.index)

    def is_idle(self) -> bool:
        """Whether all work queued on this device has finished, without waiting (FLAME ``is_idle``).

        Queries (``stream.query()``, no sync) every live stream made with :meth:`new_stream` for
        this device, plus its current and default streams. Work on other streams created by
        other code is not seen. Always ``True`` on the CPU and before CUDA is initialized.
        """
        if not self.is_cuda or not torch.cuda.is_initialized():
            return True
        index = self.validate()._cuda_ordinal()
        with _streams_lock:
            tracked = list(_streams_by_ordinal.get(index, {}).values())
        streams = [*tracked, torch.cuda.current_stream(index), torch.cuda.default_stream(index)]
        return all(s.query() for s in streams)

    def enable_peer_access(self, other: DeviceLike) -> None:
        """Let kernels on this GPU read and write ``other``'s memory directly (one direction).

        See :func:`enable_peer_access` (this is ``enable_peer_access(self, other)``).

        Args:
            other: the GPU whose memory this one will access.

        Raises:
            DeviceError: a CPU device, the same GPU twice, fewer than two visible GPUs, or a
                pair without a peer path.
        """
        enable_peer_access(self, other)


def can_access_peer(a: DeviceLike, b: DeviceLike) -> bool:
    """Whether kernels on device ``a`` can read device ``b``'s memory directly.

    ``torch.cuda.can_device_access_peer`` for two different GPUs. The same GPU returns ``True``
    (a device always reads its own memory; note ``cudaDeviceCanAccessPeer(a, a)`` itself says 0).
    Anything involving the CPU returns ``False``: host memory is reached by copies through pinned
    buffers, not by peer access.

    Args:
        a: the device that would read.
        b: the device whose memory would be read.

    Raises:
        DeviceError: if either CUDA ordinal is not visible.
    """
    dev_a, dev_b = Device.from_torch(a), Device.from_torch(b)
    if not (dev_a.is_cuda and dev_b.is_cuda):
        return False
    dev_a.validate()
    dev_b.validate()
    if dev_a == dev_b:
        return True
    return bool(torch.cuda.can_device_access_peer(dev_a._cuda_ordinal(), dev_b._cuda_ordinal()))


def enable_peer_access(a: DeviceLike, b: DeviceLike) -> None:
    """Let kernels on GPU ``a`` read and write GPU ``b``'s memory directly (peer access).

    One direction, as in CUDA (``cudaDeviceEnablePeerAccess``): call ``enable_peer_access(b, a)``
    as well for the other one. The pair is checked with :func:`can_access_peer` first. Access is
    turned on through PyTorch, by a one-byte device-to-device copy from ``a`` to ``b``: PyTorch's
    copy enables peer access for the pair it copies between (``at::cuda::get_p2p_access``) and
    tells its caching allocator, which must know the peers to map memory it adds later
    (expandable segments) for them; enabling it behind PyTorch's back through the CUDA runtime
    would leave the allocator unaware. The copy is queued on ``a``'s current stream and nothing
    waits for it. PyTorch caches the result, so calling this again for a pair costs nothing; it
    is meant for set-up, once per pair, before multi-GPU work starts.

    Args:
        a: the GPU that will access (a :class:`Device`, ``torch.device``, ``"cuda:0"`` or an
            ordinal).
        b: the GPU whose memory it will access.

    Raises:
        DeviceError: a CPU device (host memory is reached by copies through pinned buffers,
            not by peer access); the same GPU twice; a process that sees fewer than two GPUs
            or an ordinal it does not see; a pair whose hardware has no peer path
            (:func:`can_access_peer` is ``False``).
    """
    dev_a, dev_b = Device.from_torch(a), Device.from_torch(b)
    if not (dev_a.is_cuda and dev_b.is_cuda):
        raise DeviceError(
            f"peer access is between two GPUs, got {dev_a} and {dev_b}",
            "Move host data with to_device() (pinned, non-blocking); peer access only lets one "
            "GPU address another GPU's memory.")
    count = torch.cuda.device_count()
    if count < 2:
        raise DeviceError(
            f"peer access needs two GPUs; this process sees {count}{_visible_devices_note()}",
            "Run on a machine with two or more GPUs, and check CUDA_VISIBLE_DEVICES (`vramkit "
            "info` lists the devices this process sees).")
    dev_a.validate()
    dev_b.validate()
    if dev_a == dev_b:
        raise DeviceError(f"peer access needs two different GPUs, got {dev_a} twice",
                          "A GPU always reads its own memory; name another GPU as the peer.")
    pair = (dev_a._cuda_ordinal(), dev_b._cuda_ordinal())
    with _peer_lock:
        if pair in _peers_enabled:
            return
        if not can_access_peer(dev_a, dev_b):
            raise DeviceError(
                f"{dev_a} cannot access {dev_b}'s memory directly: the driver reports no peer "
                "path between them",
                "Check the link with `nvidia-smi topo -m` (GPUs under different PCIe root "
                "complexes, or with the IOMMU on, have none); copies between them still work, "
                "staged through host memory, only slower.")
        _enable_peer_through_torch(*pair)
        _peers_enabled.add(pair)
    logger.info("peer access enabled: cuda:%d -> cuda:%d", *pair)


def _enable_peer_through_torch(reader: int, target: int) -> None:
    # PyTorch's copy kernel calls at::cuda::get_p2p_access(src, dst) for a copy between two
    # GPUs, which runs cudaDeviceEnablePeerAccess for src -> dst and registers the pair with the
    # caching allocator. One byte, queued on the source's current stream, never waited for.
    probe = torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", reader))
    probe.to(torch.device("cuda", target), non_blocking=True)


def _require_tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _NotATensorError(f"{what} must be a torch.Tensor, got {type(value).__name__}")
    return value


@overload
def to_device(tensor: torch.Tensor, device: DeviceLike, non_blocking: bool = ...,
              *, return_event: Literal[False] = ...) -> torch.Tensor: ...


@overload
def to_device(tensor: torch.Tensor, device: DeviceLike, non_blocking: bool = ...,
              *, return_event: Literal[True]) -> tuple[torch.Tensor, Any]: ...


def to_device(tensor: torch.Tensor, device: DeviceLike, non_blocking: bool = True,
              *, return_event: bool = False) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """Move a tensor to ``device`` without stalling the Python thread behind the GPU.

    * Same device (including CPU -> CPU): the tensor itself is returned, no copy.
    * Host -> GPU, ``non_blocking=True``: a pinned source is copied directly; a pageable source is
      first copied into a pinned staging buffer (a host memcpy), then DMA'd asynchronously. The
      staging block is recycled by PyTorch's caching host allocator only after the copy's event
      completes, so it is never overwritten while in flight.
    * GPU -> host, ``non_blocking=True``: the result is a new, contiguous, *pinned* CPU tensor
      whose contents are valid only after the copy completes: wait on the event
      (``return_event=True``), or synchronize the source device's current stream, before reading.
    * GPU -> GPU: ``Tensor.to`` (peer copy where enabled).
    * ``non_blocking=False``: an ordinary synchronous copy; the result is ready on return.

    GPU copies are queued on the *current* stream of the GPU involved (the destination for
    host -> GPU and GPU -> GPU, the source for GPU -> host), so work issued afterwards on that stream
    sees the data; wrap the call in ``with device.stream(copy_stream):`` to use a copy stream, and
    make consumers on other streams ``wait_stream`` it. Autograd is preserved.

    Args:
        tensor: the tensor to move.
        device: the destination (Device, torch.device, ``"cuda:1"``, or an int CUDA ordinal).
        non_blocking: return before the copy completes (default True).
        return_event: also return a ``torch.cuda.Event`` recorded right after the copy on the
            stream that performs it, or ``None`` when no asynchronous copy was queued (default
            False).

    Returns:
        The tensor on ``device``, or ``(tensor, event_or_None)`` with ``return_event=True``.

    Raises:
        ConfigError: (also a TypeError) if ``tensor`` is not a tensor.
        DeviceError: if the destination GPU is not visible.
    """
    _require_tensor(tensor, "tensor")
    target = Device.from_torch(device).validate()
    source = Device.from_torch(tensor.device)
    event: Any = None
    if source == target:
        result = tensor
    elif not non_blocking:
        result = tensor.to(target.torch_device)
    elif not source.is_cuda:
        staged = tensor if tensor.is_pinned() else _stage_pinned(tensor)
        result = staged.to(target.torch_device, non_blocking=True)
        event = _record_event(target) if return_event else None
    elif not target.is_cuda:
        result = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        result.copy_(tensor, non_blocking=True)
        event = _record_event(source) if return_event else None
    else:
        result = tensor.to(target.torch_device, non_blocking=True)
        event = _record_event(target) if return_event else None
    return (result, event) if return_event else result


def _stage_pinned(tensor: torch.Tensor) -> torch.Tensor:
    # The pinned block comes from torch's caching host allocator; freeing our reference right after
    # the async copy is safe because the copy records an event on the block (see module docstring).
    staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    staging.copy_(tensor)
    return staging


def _record_event(device: Device) -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device._cuda_ordinal()))
    return event


def ensure_same_device(*tensors: torch.Tensor) -> torch.device:
    """Check that all tensors live on one device and return it (FLAME ``ensure_same_device``).

    Args:
        *tensors: one or more tensors.

    Returns:
        The common ``torch.device``.

    Raises:
        ConfigError: if no tensor is given, or (also a TypeError) an argument is not a tensor.
        DeviceMismatchError: naming the first argument (by position) on another device.
    """
    if not tensors:
        raise ConfigError("ensure_same_device() needs at least one tensor",
                          hint="Pass the tensors to compare, e.g. ensure_same_device(x, "
                               "weight); with none there is no device to return.")
    expected = _require_tensor(tensors[0], "argument 0").device
    for position, value in enumerate(tensors[1:], start=1):
        got = _require_tensor(value, f"argument {position}").device
        if got != expected:
            raise DeviceMismatchError(expected, got, what=f"argument {position}")
    return expected


Batch: TypeAlias = "torch.Tensor | Mapping[Any, Batch] | Sequence[Batch]"


def distribute_batch(batch: Batch, devices: Sequence[DeviceLike], *,
                     non_blocking: bool = True) -> list[Any]:
    """Split a batch along dim 0 into one chunk per device and move each chunk there.

    The batch is a tensor or a (nested) dict/list/tuple of tensors that share their dim-0 size.
    Split rule (as ``torch.tensor_split``): with ``n`` rows and ``k`` devices each chunk gets
    ``n // k`` rows and the first ``n % k`` chunks one more, e.g. 10 rows on 4 devices -> 3, 3, 2, 2.
    Copies go through :func:`to_device` with ``non_blocking``, so host batches are staged through
    pinned memory and nothing waits for the GPUs.

    Args:
        batch: the batch to split.
        devices: the destinations, in chunk order (repeats allowed).
        non_blocking: passed to :func:`to_device` (default True).

    Returns:
        A list of ``len(devices)`` chunks, each shaped like ``batch`` (dicts stay dicts, tuples and
        named tuples keep their type).

    Raises:
        ConfigError: no devices, a non-tensor leaf, a 0-d tensor, dim-0 sizes that differ, or fewer
            rows than devices.
    """
    targets = [Device.from_torch(d) for d in devices]
    if not targets:
        raise ConfigError("distribute_batch() needs at least one device",
                          hint="Pass a non-empty list of devices, e.g. distribute_batch(batch, "
                               "['cuda:0', 'cuda:1']).")
    leaves: list[tuple[str, torch.Tensor]] = []
    _collect_leaves(batch, "batch", leaves)
    if not leaves:
        raise ConfigError("the batch holds no tensor", "Pass a tensor or a dict/list of tensors.")
    rows = leaves[0][1].shape[0]
    for path, leaf in leaves:
        if leaf.shape[0] != rows:
            raise ConfigError(
                f"{path} has {leaf.shape[0]} rows but {leaves[0][0]} has {rows}: every tensor of "
                "the batch must share its dim-0 size", "Split only tensors indexed by sample.")
    if rows < len(targets):
        raise ConfigError(
            f"cannot split {rows} row(s) across {len(targets)} devices: each device needs at "
            "least one row", "Use a larger batch or fewer devices.")
    base, extra = divmod(rows, len(targets))
    sizes = [base + 1 if i < extra else base for i in range(len(targets))]
    parts = {id(leaf): leaf.split(sizes) for _, leaf in leaves}  # split each tensor once
    return [_build_chunk(batch, index, parts, target, non_blocking)
            for index, target in enumerate(targets)]


def _collect_leaves(node: Any, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(node, torch.Tensor):
        if node.dim() == 0:
            raise ConfigError(f"{path} is a 0-d tensor and has no dim 0 to split",
                              hint="Give every batched tensor a leading batch dimension (e.g. "
                                   "t.unsqueeze(0)); pass per-batch scalars as Python numbers "
                                   "instead of 0-d tensors.")
        out.append((path, node))
    elif isinstance(node, Mapping):
        for key, value in node.items():
            _collect_leaves(value, f"{path}[{key!r}]", out)
    elif isinstance(node, (list, tuple)):
        for position, value in enumerate(node):
            _collect_leaves(value, f"{path}[{position}]", out)
    else:
        raise ConfigError(
            f"{path} is a {type(node).__name__}, not a tensor: distribute_batch splits tensors only",
            "Keep non-tensor metadata out of the batch you distribute.")


def _build_chunk(node: Any, index: int, parts: dict[int, tuple[torch.Tensor, ...]],
                 target: Device, non_blocking: bool) -> Any:
    if isinstance(node, torch.Tensor):
        return to_device(parts[id(node)][index], target, non_blocking=non_blocking)
    if isinstance(node, Mapping):
        return {key: _build_chunk(value, index, parts, target, non_blocking)
                for key, value in node.items()}
    items = [_build_chunk(value, index, parts, target, non_blocking) for value in node]
    if isinstance(node, tuple):
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    return items
