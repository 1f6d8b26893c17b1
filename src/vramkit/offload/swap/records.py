"""What a swapped block is made of: its tensors, its flat master layout, its slot, and the rule
for which tensors a swapper moves.

The rule (:func:`is_swappable`, :func:`block_footprint`) is the swapper's own and is asked by
everyone who needs it -- the schedule, the planner, the demo -- so it exists once. The records
(:class:`SwapEntry`, :class:`SwappedBlock`, :class:`Slot`, :class:`WeightRef`) and the
:class:`BlockRuntime` interface are shared by the swapper (:mod:`vramkit.offload.swap`), its slot
ring (:mod:`vramkit.offload.swap.ring`) and its autograd helpers
(:mod:`vramkit.offload.swap.function`, :mod:`vramkit.offload.swap.graph`), which see the
swapper only through that interface.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from vramkit.errors import OffloadError
from vramkit.memory.layout import align_up, calculate_alignment, is_dense
from vramkit.offload.blocks import module_bytes
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.memory.transfer import Streams

__all__ = [
    "ALIGN",
    "BlockFootprint",
    "BlockRuntime",
    "Slot",
    "SwapEntry",
    "SwapRule",
    "SwappedBlock",
    "WeightRef",
    "block_footprint",
    "block_tensors",
    "is_swappable",
    "layout_entries",
    "typed_view",
]

#: Offsets inside a master/slot: PyTorch's allocator granularity, so kernels see the same pointer
#: alignment as for ordinary tensors (cuBLAS picks kernels by alignment).
ALIGN = 512


class SwapRule(Protocol):
    """The settings the swappable rule reads (a :class:`~vramkit.offload.swap.SwapConfig`)."""

    min_param_bytes: int
    swap_buffers: bool
    trainable: str


def block_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor, bool]]:
    """``(owner, attribute, tensor, is_parameter)`` of every distinct tensor of ``module``."""
    seen: set[int] = set()
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield sub, attr, p, True
        for attr, b in sub._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                yield sub, attr, b, False


def is_swappable(tensor: torch.Tensor, rule: SwapRule, *, is_param: bool = True) -> bool:
    """Whether a swapper with settings ``rule`` moves ``tensor`` (tensors shared between blocks
    aside: those are found when attaching and stay resident).

    A tensor is swapped when it is a parameter (or a buffer, with ``swap_buffers``), frozen
    (or trainable with ``trainable != "resident"``), dense (its elements cover its memory
    exactly once, so one flat copy moves it) and at least ``min_param_bytes`` large.
    """
    if not is_param and not rule.swap_buffers:
        return False
    if tensor.requires_grad and rule.trainable == "resident":
        return False
    if not is_dense(tensor):  # expanded or overlapping: no flat copy of its real bytes
        return False
    return tensor.numel() * tensor.element_size() >= max(1, rule.min_param_bytes)


@dataclass
class SwapEntry:
    """One tensor of a swapped block: where it lives in the master and on the module."""

    owner: nn.Module
    attr: str
    is_param: bool
    tensor: torch.Tensor  # the Parameter / buffer object (identity preserved)
    offset: int
    nbytes: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    original_device: torch.device
    trainable: bool
    placeholder: torch.Tensor | None = None
    host_param: nn.Parameter | None = None


def layout_entries(entries: list[SwapEntry]) -> int:
    """Give each entry its offset in the block's flat master; returns the master's size.

    Each tensor starts at ``calculate_alignment(its size)``, raised to :data:`ALIGN`, so a slot
    view has the alignment an ordinary allocation would have.
    """
    offset = 0
    for e in entries:
        e.offset = align_up(offset, max(calculate_alignment(e.nbytes), ALIGN))
        offset = e.offset + e.nbytes
    return align_up(offset, ALIGN)


class BlockFootprint(NamedTuple):
    """What swapping one block means in bytes (:meth:`BlockSwapper.footprint`).

    Attributes:
        swapped: size of the block's flat master (and of its share of a GPU slot): its
            swappable tensors at their aligned offsets. 0 when nothing in it is swappable.
        resident: bytes of its tensors that stay on the GPU (small, trainable with
            ``trainable="resident"``, or excluded buffers).
    """

    swapped: int
    resident: int


def block_footprint(module: nn.Module, rule: SwapRule) -> BlockFootprint:
    """The bytes a swapper with settings ``rule`` would move and keep for ``module``.

    Works on the meta device (shapes and dtypes only). Tensors the module shares with other
    blocks are counted as swapped here; the swapper keeps those resident when it attaches.
    """
    entries: list[SwapEntry] = []
    resident = 0
    for owner, attr, tensor, is_param in block_tensors(module):
        nbytes = tensor.numel() * tensor.element_size()
        if is_swappable(tensor, rule, is_param=is_param):
            entries.append(SwapEntry(owner, attr, is_param, tensor, 0, nbytes, tensor.shape,
                                     tuple(tensor.stride()), tensor.dtype, tensor.device,
                                     bool(tensor.requires_grad)))
        else:
            resident += nbytes
    return BlockFootprint(layout_entries(entries) if entries else 0, resident)


def schedule_bytes(module: nn.Module, rule: SwapRule) -> int:
    """The size the schedule weighs a block by: its swapped bytes, or all of its bytes when
    nothing in it is swappable (such a block stays resident whatever the schedule says)."""
    return block_footprint(module, rule).swapped or module_bytes(module)


def typed_view(buffer: torch.Tensor, offset: int, entry: SwapEntry) -> torch.Tensor:
    """The tensor of ``entry`` as a view of a flat uint8 ``buffer`` (a master or a slot)."""
    count = math.prod(entry.shape)
    raw = buffer[offset:offset + count * entry.dtype.itemsize]
    return raw.view(entry.dtype).view(entry.shape)


class Slot:
    """One GPU slot of the ring: its bytes, the block in it and the events ordering its use."""

    __slots__ = ("block", "buffer", "free_event", "index", "last_used", "loaded_event",
                 "loaded_version", "locked", "pool_block", "writeback_event")

    def __init__(self, index: int, pool_block: Any, buffer: torch.Tensor,
                 streams: Streams) -> None:
        self.index = index
        self.pool_block = pool_block
        self.buffer = buffer  # uint8 view of the slot's bytes
        self.block: SwappedBlock | None = None
        self.loaded_event = streams.event()
        self.free_event = streams.event()
        # The master's _version when loaded. In-place updates of the host masters (a CPU
        # optimizer step) bump it, shared by every view of the pinned segment: the slot is then
        # stale and reloaded.
        self.loaded_version = -1
        self.locked = False
        self.last_used = -1
        # trainable="swap": the last device->host copy of updated weights out of this slot
        # (the next fill must wait for it).
        self.writeback_event: Any = None


class SwappedBlock:
    """A swapped block: its module, master, tensors and where it is now."""

    def __init__(self, index: int, name: str, module: nn.Module, entries: list[SwapEntry],
                 nbytes: int) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.entries = entries
        self.nbytes = nbytes  # aligned flat size
        self.master: torch.Tensor | None = None  # uint8 pinned view
        self.master_block: Any = None
        self.grad_buffer: torch.Tensor | None = None
        self.grad_block: Any = None
        self.grad_event: Any = None
        self.writeback_event: Any = None  # the last device->host write into the master
        self.slot: Slot | None = None
        self.slot_views: dict[int, list[torch.Tensor]] = {}
        self.slot_flat: dict[int, torch.Tensor] = {}  # the block's bytes of each slot
        self.master_views: list[torch.Tensor] = []
        self.wrapper: Any = None  # the forward wrapper the swapper installed
        self.checkpointed = False
        self.lean: Any = None  # LeanState: checkpointed the lean way (vramkit.offload.checkpointing)
        self.trainable_entries = [e for e in entries if e.trainable]
        self.bound: Slot | None = None  # the slot whose views the entries point at
        self.params: list[nn.Parameter] = []  # every parameter of the module, for requires_grad
        self.params_epoch = -1  # structure epoch when ``params`` was listed
        self.submodules: list[nn.Module] = []  # the module's submodules when ``params`` was listed
        self.shape_key = -1  # their child and parameter counts then
        self.on_disk = False  # no master: read from disk into staging (SwapConfig.host_budget)
        self.fill: Any = None  # the MasterFill still writing its master (wait before reading)
        # the version of the bytes a slot copy of a block without a master was made from (a
        # master compressed after a slot was loaded from it keeps its last version: the same
        # bytes, no reload)
        self.frozen_version = 0
        self.module_type: type = type(module)  # FSDP re-classes a module it shards: seen here

    def __repr__(self) -> str:
        return f"SwappedBlock({self.name}, {format_size(self.nbytes)})"


@dataclass(frozen=True)
class WeightRef:
    """What autograd keeps instead of a slot-resident tensor: where the bytes are in the block."""

    block: SwappedBlock
    offset: int  # bytes from the block's first byte in its slot
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class BlockRuntime(Protocol):
    """What the autograd helpers of a swapper may ask of it (the slot ring implements it)."""

    preserve_rng_state: bool

    def acquire(self, block: SwappedBlock, *, backward: bool, stream: Any = None) -> Any:
        """Make ``block``'s weights usable on ``stream`` (default: current); returns the stream."""

    def release(self, block: SwappedBlock, *, backward: bool, stream: Any = None) -> None:
        """``block`` is done with its slot once ``stream`` passes this point."""

    def weight_hooks(self, block: SwappedBlock, *,
                     forbid: bool = False) -> AbstractContextManager[None]:
        """Saved-tensor hooks turning slot-resident saved tensors into :class:`WeightRef`."""

    def begin_block_backward(self, block: SwappedBlock) -> None:
        """Before a block with trainable swapped weights back-propagates (gradient
        accumulation)."""

    def end_block_backward(self, block: SwappedBlock) -> None:
        """After it did: its gradients leave the GPU."""


def complete_gradients(hook: Callable[[str, list[torch.Tensor]], Any] | None,
                       block: SwappedBlock, grads: list[torch.Tensor]
                       ) -> Callable[[], None] | None:
    """A swapped block's trainable gradients are complete for the step: give them to the
    swapper's gradient hook (``BlockSwapper.set_gradient_hook``) and return what the hook
    returned for later (a ``finish()`` to run on the stream that reads the gradients, for a
    hook whose work is still in flight), else ``None``. Without a hook in a job of several
    processes, refuse: DDP does not see swapped weights, so each rank would step its own
    gradients and the replicas would drift apart without a word."""
    if hook is not None:
        finish = hook(block.name, grads) if grads else None
        if finish is not None and not callable(finish):
            raise OffloadError(
                f"the gradient hook returned a {type(finish).__name__} for block {block.name}",
                hint="A gradient hook returns None, or a function to call once before the "
                     "gradients are read (on the stream that reads them).")
        return finish
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise OffloadError(
            f"swapped block {block.name} has trainable weights whose gradients no one reduces "
            f"across the {dist.get_world_size()} processes of this job (DDP leaves swapped "
            "weights to the swapper)",
            hint="Wrap the model with vramkit.distributed.wrap_ddp(model, swapper), which "
                 "averages them; or call swapper.set_gradient_hook(lambda name, grads: None) "
                 "to train each rank's copy on its own on purpose.")
