"""BlockSwapper: train and run models whose blocks do not all fit on the GPU.

Swap units are *blocks* (transformer blocks, UNet stages; found by
:func:`vramkit.offload.blocks.find_blocks`). The schedule keeps some blocks resident on the GPU
and swaps the others, spread evenly by bytes so resident compute hides the swapped blocks'
transfers. How a swapped block moves:

* **One flat pinned master per swapped block**, allocated once from a pinned
  :class:`~vramkit.memory.pool.MemoryPool` sized exactly to the masters. Its parameters (and
  large buffers) are packed into it at 512-byte aligned offsets, as raw bytes: any dtype,
  including the packed bytes of quantized weights, moves the same way.
* **A ring of R GPU slots** (``SwapConfig.num_slots``, default 2), preallocated from a device
  :class:`~vramkit.memory.pool.MemoryPool` and sized to the largest swapped block. Nothing is
  allocated per swap.
* **One copy stream** (the device's shared host->device stream,
  :func:`vramkit.memory.transfer.transfer_streams`) fills a slot after the slot's *free* event
  (recorded on the compute stream when the previous block using it finished); the compute stream
  waits on the slot's *loaded* event. No host synchronization in steady state.
* **Frozen weights move host->device only**: eviction is a pointer repoint (the block's
  ``Parameter`` objects get a one-element placeholder of the right shape, dtype and device);
  nothing is copied back.
* **Prefetch**: when a block releases its slot, the next ``SwapConfig.prefetch`` blocks (default
  R) in the predicted order that are not in a slot yet are loaded, into slots whose blocks are
  not among them. The order is learnt from the last pass (registration
  order at first). Forward goes front to back; backward back to front, so the last R blocks
  stay loaded across the forward->backward turn; inference wraps around to the first blocks.
* **Backward**: saved weights are block handles, never GPU memory. Blocks whose swapped weights
  are frozen join the outer autograd graph (:mod:`vramkit.offload._swap_graph`): a pre-hook on
  each output node re-acquires the slot before the block's backward (and its recomputation when
  checkpointed), and the slot is released once the block's input gradients are done -- by an
  identity Function on the inputs, or, for a block fed by the previous swapped block's output,
  by that block's hook. Blocks with swapped trainable weights run through
  :class:`vramkit.offload._swap_function.SwapBlockFunction`, which re-acquires, recomputes when
  checkpointed and back-propagates in its own backward.

Trainable weights in swapped blocks (``SwapConfig.trainable="cpu"``, full fine-tuning): after a
block's backward its gradients go device->host into a pinned gradient buffer (the GPU gradients
are dropped), and the host masters are stepped by a CPU optimizer built over
:meth:`BlockSwapper.host_parameters`. An optimizer step bumps the masters' version counter, so
slots loaded before the step are reloaded. With ``trainable="resident"`` (default) trainable
parameters (LoRA adapters, say) stay on the GPU and only frozen weights are swapped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.hooks import RemovableHandle

from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.layout import (
    Random,
    Sequential,
    Strided,
    align_up,
    analyze_access_pattern,
    calculate_alignment,
)
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams, resolve_offload_device, transfer_streams
from vramkit.offload import _tree
from vramkit.offload._state_dict import install_swap_hooks
from vramkit.offload._swap_function import BlockCall, SwapBlockFunction, WeightRef
from vramkit.offload._swap_graph import (
    BlockBackward,
    OutputHook,
    enter_block,
    exit_block,
    hook_outputs,
)
from vramkit.offload.blocks import (
    BlockScheduleEntry,
    BlockSpec,
    find_blocks,
    module_bytes,
    natural_key,
    spread_evenly,
)
from vramkit.units import format_size, parse_size

__all__ = ["BlockScheduleEntry", "BlockSwapper", "SwapConfig", "SwapStats"]

logger = logging.getLogger(__name__)

_ALIGN = 512  # offsets inside a master/slot: PyTorch's allocator granularity, so kernels see
# the same pointer alignment as for ordinary tensors (cuBLAS picks kernels by alignment).
_TRAINABLE = ("resident", "cpu")
# Argument/output types that are leaves for certain (the fast path skips the tree walk for calls
# made only of these); a tensor subclass or a container takes the general path.
_PLAIN_LEAVES = frozenset({torch.Tensor, nn.Parameter, type(None), bool, int, float, str})


@dataclass(frozen=True)
class SwapConfig:
    """How a :class:`BlockSwapper` chooses and moves blocks.

    Args:
        max_gpu_blocks: keep at most this many blocks resident; the rest are swapped.
        max_gpu_bytes: GPU bytes allowed for blocks: resident blocks plus the R slots (an int
            or a string such as ``"6GiB"``). With both limits the stricter one wins; with
            neither (default) every block is swapped.
        num_slots: R, the GPU slots of the ring (default 2, at least 1).
        prefetch: how many of the next blocks (in predicted order) should be in slots when a
            block releases its slot; missing ones are loaded then. Default ``num_slots`` (the
            released slot is free for the block after the next), at most that; 0 loads every
            block on demand.
        checkpointing: recompute swapped blocks in backward instead of keeping their
            activations. ``None`` (default) follows the blocks:
            :func:`vramkit.offload.checkpointing.enable_gradient_checkpointing` marks them.
        min_param_bytes: tensors smaller than this stay resident (norms, biases, modulation
            tables). Default 64 KiB.
        swap_buffers: swap large buffers as well as parameters (default ``True``). Swapped
            buffers are read-only: a write in forward is lost at eviction.
        trainable: ``"resident"`` (default) keeps trainable parameters on the GPU;
            ``"cpu"`` swaps them too, offloads their gradients to pinned host memory and expects
            a CPU optimizer over :meth:`BlockSwapper.host_parameters`.
        preserve_rng_state: replay the RNG state when recomputing a checkpointed block, so
            dropout masks match (default ``True``).
    """

    max_gpu_blocks: int | None = None
    max_gpu_bytes: int | str | None = None
    num_slots: int = 2
    prefetch: int | None = None
    checkpointing: bool | None = None
    min_param_bytes: int = 64 * 1024
    swap_buffers: bool = True
    trainable: str = "resident"
    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        if self.max_gpu_blocks is not None and (
                isinstance(self.max_gpu_blocks, bool) or not isinstance(self.max_gpu_blocks, int)
                or self.max_gpu_blocks < 0):
            raise ConfigError(f"SwapConfig.max_gpu_blocks must be an int >= 0 or None, got "
                              f"{self.max_gpu_blocks!r}")
        if self.max_gpu_bytes is not None:
            try:
                value = parse_size(self.max_gpu_bytes)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"SwapConfig.max_gpu_bytes: {exc}") from None
            object.__setattr__(self, "max_gpu_bytes", value)
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) \
                or self.num_slots < 1:
            raise ConfigError(f"SwapConfig.num_slots must be an int >= 1, got {self.num_slots!r}")
        if self.prefetch is not None and (
                isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int)
                or not 0 <= self.prefetch <= self.num_slots):
            raise ConfigError(
                f"SwapConfig.prefetch must be an int in [0, num_slots={self.num_slots}], "
                f"got {self.prefetch!r}",
                hint="Prefetching more blocks than there are slots would evict blocks before "
                     "they are used. Raise num_slots.")
        if not (self.checkpointing is None or isinstance(self.checkpointing, bool)):
            raise ConfigError(f"SwapConfig.checkpointing must be None, True or False, got "
                              f"{self.checkpointing!r}")
        if isinstance(self.min_param_bytes, bool) or not isinstance(self.min_param_bytes, int) \
                or self.min_param_bytes < 0:
            raise ConfigError(f"SwapConfig.min_param_bytes must be an int >= 0, got "
                              f"{self.min_param_bytes!r}")
        if self.trainable not in _TRAINABLE:
            raise ConfigError(f"SwapConfig.trainable must be one of {_TRAINABLE}, got "
                              f"{self.trainable!r}")
        for name in ("swap_buffers", "preserve_rng_state"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SwapConfig.{name} must be a bool")

    @property
    def lookahead(self) -> int:
        """How many upcoming blocks should be loaded when a slot is released."""
        return self.num_slots if self.prefetch is None else self.prefetch


@dataclass(frozen=True)
class SwapStats:
    """What a :class:`BlockSwapper` holds and has moved.

    Attributes:
        blocks: blocks found; ``swapped_blocks`` of them are swapped.
        swapped_bytes: bytes of the swapped tensors (their pinned masters, before alignment).
        pinned_bytes: pinned host bytes reserved for masters (and gradient buffers).
        slot_bytes: GPU bytes of the ring (R x the largest swapped block).
        resident_block_bytes: bytes of blocks (and swapped blocks' small tensors) kept on GPU.
        loads: slot fills; ``prefetched`` of them were issued ahead of use, ``on_demand`` when
            a block was needed and not on its way (a misprediction or the first pass).
        hits: acquisitions that found the block already in a slot.
        h2d_bytes / d2h_bytes: bytes copied host->device (weights) / device->host (gradients).
        enqueue_seconds: host time spent in acquire/release (enqueuing copies and events).
        acquisitions: blocks acquired (forward and backward).
        order_pattern: how the learnt forward order walks the swapped blocks' model positions
            (:func:`vramkit.memory.layout.analyze_access_pattern`): ``Sequential()`` for a
            plain front-to-back stack, ``Strided``/``Random`` when blocks are called out of
            their container order (prefetch follows the learnt order either way).
    """

    blocks: int
    swapped_blocks: int
    swapped_bytes: int
    pinned_bytes: int
    slot_bytes: int
    resident_block_bytes: int
    loads: int
    prefetched: int
    on_demand: int
    hits: int
    h2d_bytes: int
    d2h_bytes: int
    acquisitions: int
    enqueue_seconds: float
    order_pattern: Sequential | Strided | Random = field(default_factory=Sequential)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["order_pattern"] = type(self.order_pattern).__name__.lower()
        return out


@dataclass
class _Entry:
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


class _Slot:
    __slots__ = ("block", "buffer", "free_event", "index", "last_used", "loaded_event",
                 "loaded_version", "locked", "pool_block")

    def __init__(self, index: int, pool_block: Any, buffer: torch.Tensor, streams: Streams) -> None:
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


class SwappedBlock:
    """A swapped block: its module, master, tensors and where it is now."""

    def __init__(self, index: int, name: str, module: nn.Module, entries: list[_Entry],
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
        self.slot: _Slot | None = None
        self.slot_views: dict[int, list[torch.Tensor]] = {}
        self.slot_flat: dict[int, torch.Tensor] = {}  # the block's bytes of each slot
        self.master_views: list[torch.Tensor] = []
        self.original_forward: Any = None
        self.had_instance_forward = False
        self.checkpointed = False
        self.trainable_entries = [e for e in entries if e.trainable]
        self.bound: _Slot | None = None  # the slot whose views the entries point at
        self.params: list[nn.Parameter] = []  # every parameter of the module, for requires_grad
        self.params_epoch = -1  # _structure_epoch() when ``params`` was listed
        self.submodules: list[nn.Module] = []  # the module's submodules when ``params`` was listed
        self.shape_key = -1  # their child and parameter counts then (see _has_trainable)

    def __repr__(self) -> str:
        return f"SwappedBlock({self.name}, {format_size(self.nbytes)})"


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _typed_view(buffer: torch.Tensor, offset: int, entry: _Entry) -> torch.Tensor:
    count = math.prod(entry.shape)
    raw = buffer[offset:offset + count * entry.dtype.itemsize]
    return raw.view(entry.dtype).view(entry.shape)


class BlockSwapper:
    """Streams a model's blocks between pinned host memory and a ring of GPU slots.

    Args:
        model: any ``nn.Module`` (on the CPU or the device).
        blocks: ``"auto"`` (default) or names/patterns, as :func:`find_blocks` takes them.
        config: a :class:`SwapConfig` (default: every block swapped, R=2).
        device: where compute runs (default ``"cuda"``; ``"cpu"`` runs the same machinery
            synchronously, for tests and CPU-only machines).

    Everything that is not a swapped tensor (other modules, resident blocks, small tensors of
    swapped blocks) is moved to ``device``; :meth:`detach` puts every tensor back where it was,
    with its values, and removes the swapper's wrappers.

    Example:
        >>> swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=8))  # doctest: +SKIP
        >>> loss = model(x).mean(); loss.backward()                            # doctest: +SKIP
        >>> swapper.detach()                                                   # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, blocks: str | Sequence[str] = "auto",
                 config: SwapConfig | None = None,
                 device: str | int | torch.device = "cuda") -> None:
        if config is None:
            config = SwapConfig()
        elif not isinstance(config, SwapConfig):
            raise ConfigError(f"config must be a SwapConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.device = resolve_offload_device(device, "BlockSwapper")
        self.streams = transfer_streams(self.device)
        self._attached = False
        found = find_blocks(model, blocks)
        specs = [BlockSpec(name, self._swappable_bytes(module)) for name, module in found]
        self.schedule = self.create_schedule(specs, config.max_gpu_blocks,
                                             max_gpu_bytes=config.max_gpu_bytes,
                                             num_slots=config.num_slots)
        self._counters = dict.fromkeys(("loads", "prefetched", "on_demand", "hits", "h2d_bytes",
                                        "d2h_bytes", "acquisitions"), 0)
        self._enqueue_seconds = 0.0
        self._clock = 0
        self._moved: list[tuple[torch.Tensor, torch.device]] = []
        self._state_hooks: list[RemovableHandle] = []  # state_dict through the host masters
        self._blocks: list[SwappedBlock] = []
        self._slots: list[_Slot] = []
        self._order: list[SwappedBlock] = []
        self._position: dict[int, int] = {}
        self._upcoming_cache: dict[tuple[int, bool, bool], list[SwappedBlock]] = {}
        self._trainable_cache: dict[int, bool] = {}
        self._observed: list[SwappedBlock] = []
        self._observed_ids: set[int] = set()
        self._direction = "forward"
        self._training_pass = False
        # Output hooks of the swapped call just made (node sequence number, hook): the next
        # call chains to them when its inputs come from one of those nodes (_call_in_graph).
        self._last_hooks: list[tuple[int, OutputHook]] = []
        self._master_pool: MemoryPool | None = None
        self._grad_pool: MemoryPool | None = None
        self._slot_pool: MemoryPool | None = None
        self._anchor: torch.Tensor | None = None
        self._resident_block_bytes = 0
        self._unwatch: weakref.finalize | None = None
        try:
            self._attach(found)
        except BaseException:
            self._undo_attach()
            raise

    # -- the schedule -----------------------------------------------------------------------

    @staticmethod
    def create_schedule(blocks: Sequence[BlockSpec | tuple[str, int] | nn.Module | str],
                        max_gpu_blocks: int | None = None, *,
                        max_gpu_bytes: int | str | None = None,
                        num_slots: int = 2) -> list[BlockScheduleEntry]:
        """Choose which blocks to swap (seed ``BlockSwapper::create_schedule``).

        The swapped set is the smallest one that meets the limits, spread evenly over the
        blocks' cumulative bytes (so each swapped block sits among resident ones whose compute
        hides its transfer); entries come back in execution order. Names passed without sizes
        (plain strings) count as equal-sized and are ordered numerically ("blocks.2" before
        "blocks.10").

        Args:
            blocks: :class:`BlockSpec`, ``(name, nbytes)`` pairs, modules (named ``"0"``,
                ``"1"``...) or names, in execution order.
            max_gpu_blocks: blocks that may stay resident (``None``: no count limit).
            max_gpu_bytes: GPU bytes for resident blocks plus ``num_slots`` slots of the
                largest swapped block (``None``: no byte limit).
            num_slots: R, the slots of the ring (counted in the byte limit).

        Returns:
            One :class:`BlockScheduleEntry` per block. With no limit at all every block is
            swapped.

        Raises:
            OffloadError: when even swapping every block does not fit ``max_gpu_bytes``.
        """
        if max_gpu_blocks is not None and (isinstance(max_gpu_blocks, bool) or not isinstance(
                max_gpu_blocks, int) or max_gpu_blocks < 0):
            raise ConfigError(f"max_gpu_blocks must be an int >= 0 or None, got "
                              f"{max_gpu_blocks!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"num_slots must be an int >= 1, got {num_slots!r}")
        specs = _as_specs(blocks)
        n = len(specs)
        sizes = [s.nbytes for s in specs]
        budget = None if max_gpu_bytes is None else parse_size(max_gpu_bytes)
        if max_gpu_blocks is None and budget is None:
            count = n
        else:
            count = 0 if max_gpu_blocks is None else max(0, n - max_gpu_blocks)
            if budget is not None:
                while count <= n:
                    chosen = spread_evenly(sizes, count)
                    resident = sum(sizes) - sum(sizes[i] for i in chosen)
                    slots = num_slots * max((sizes[i] for i in chosen), default=0)
                    if resident + slots <= budget:
                        break
                    count += 1
                else:
                    need = num_slots * max(sizes, default=0)
                    raise OffloadError(
                        f"max_gpu_bytes={format_size(budget)} cannot hold even {num_slots} "
                        f"slots of the largest block ({format_size(need)} with every block "
                        f"swapped)",
                        hint="Raise the budget, lower num_slots, or split the largest blocks.")
        swapped = set(spread_evenly(sizes, count))
        return [BlockScheduleEntry(i, s.name, s.nbytes, i in swapped) for i, s in enumerate(specs)]

    # -- attaching --------------------------------------------------------------------------

    def _swappable_bytes(self, module: nn.Module) -> int:
        total = 0
        for _, _, tensor, _ in self._tensors_of(module):
            if self._is_swappable(tensor):
                total += _align(tensor.numel() * tensor.element_size())
        return total or module_bytes(module)

    def _tensors_of(self, module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor, bool]]:
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

    def _is_swappable(self, tensor: torch.Tensor, is_param: bool = True) -> bool:
        if not is_param and not self.config.swap_buffers:
            return False
        if tensor.requires_grad and self.config.trainable == "resident":
            return False
        if not _dense(tensor):  # expanded or overlapping: no flat copy of its real bytes
            return False
        return tensor.numel() * tensor.element_size() >= max(1, self.config.min_param_bytes)

    def _attach(self, found: list[tuple[str, nn.Module]]) -> None:
        shared = self._shared_tensor_ids(found)
        swapped_modules: dict[int, SwappedBlock] = {}
        for entry in self.schedule:
            name, module = found[entry.index]
            if not entry.swapped:
                self._resident_block_bytes += module_bytes(module)
                continue
            entries: list[_Entry] = []
            for owner, attr, tensor, is_param in self._tensors_of(module):
                if id(tensor) in shared or not self._is_swappable(tensor, is_param):
                    self._resident_block_bytes += tensor.numel() * tensor.element_size()
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                entries.append(_Entry(owner, attr, is_param, tensor, 0, nbytes,
                                      tensor.shape, tuple(tensor.stride()), tensor.dtype,
                                      tensor.device, bool(tensor.requires_grad)))
            if not entries:
                continue  # nothing worth swapping: the block stays resident
            # The flat master's layout: each tensor at calculate_alignment(its size), raised to
            # _ALIGN so a slot view has the alignment an ordinary allocation would have.
            offset = 0
            for e in entries:
                e.offset = align_up(offset, max(calculate_alignment(e.nbytes), _ALIGN))
                offset = e.offset + e.nbytes
            block = SwappedBlock(entry.index, name, module, entries, _align(offset))
            swapped_modules[id(module)] = block
            self._blocks.append(block)
        self._allocate_host(self._blocks)
        swapped_ids = {id(e.tensor) for b in self._blocks for e in b.entries}
        # Everything else goes to the device (placement recorded for detach).
        for owner in self.model.modules():
            for tensors in (owner._parameters, owner._buffers):
                for t in tensors.values():
                    if t is not None and id(t) not in swapped_ids and t.device != self.device:
                        self._moved.append((t, t.device))
                        t.data = t.data.to(self.device)
        self._allocate_slots()
        for block in self._blocks:
            self._wrap_forward(block)
            self._state_hooks += install_swap_hooks(block)
        self._order = list(self._blocks)
        self._position = {id(b): i for i, b in enumerate(self._order)}
        _watch_structure(True)
        # Released by detach(), or when the swapper is collected without one.
        self._unwatch = weakref.finalize(self, _watch_structure, False)
        self._attached = True
        logger.info("BlockSwapper: %d of %d blocks swapped (%s pinned, %d slots of %s)",
                    len(self._blocks), len(self.schedule),
                    format_size(sum(b.nbytes for b in self._blocks)), len(self._slots),
                    format_size(self._slot_bytes()))

    def _shared_tensor_ids(self, found: list[tuple[str, nn.Module]]) -> set[int]:
        """Tensors used by more than one block, or by a block and the rest of the model: tied
        weights stay resident, because a swapped copy would diverge from its twin."""
        owners: dict[int, set[int]] = {}
        prefixes = [(name + ".", i) for i, (name, _) in enumerate(found)]
        names = {name: i for i, (name, _) in enumerate(found)}
        # remove_duplicate=False: a submodule shared by two blocks is listed under both names.
        for qual, sub in self.model.named_modules(remove_duplicate=False):
            where = names.get(qual, -1)
            if where < 0:
                where = next((i for prefix, i in prefixes if qual.startswith(prefix)), -1)
            for t in list(sub._parameters.values()) + list(sub._buffers.values()):
                if t is not None:
                    owners.setdefault(id(t), set()).add(where)
        return {k for k, v in owners.items() if len(v) > 1}

    def _allocate_host(self, blocks: list[SwappedBlock]) -> None:
        if not blocks:
            return
        total = sum(b.nbytes for b in blocks)
        grads = sum(b.nbytes for b in blocks if b.trainable_entries)
        self._master_pool = self._host_pool(total)
        if grads:
            self._grad_pool = self._host_pool(grads)
        placeholder_cache: dict[torch.dtype, torch.Tensor] = {}
        for block in blocks:
            block.master_block = self._master_pool.allocate(block.nbytes)
            block.master = block.master_block.view((block.nbytes,), torch.uint8)
            if block.trainable_entries and self._grad_pool is not None:
                block.grad_block = self._grad_pool.allocate(block.nbytes)
                block.grad_buffer = block.grad_block.view((block.nbytes,), torch.uint8)
            for e in block.entries:
                view = _typed_view(block.master, e.offset, e)
                view.copy_(e.tensor.detach())
                block.master_views.append(view)
                if e.dtype not in placeholder_cache:
                    placeholder_cache[e.dtype] = torch.zeros((), dtype=e.dtype,
                                                             device=self.device)
                e.placeholder = placeholder_cache[e.dtype].expand(e.shape)
                e.tensor.data = e.placeholder
                if e.trainable:
                    e.host_param = nn.Parameter(view, requires_grad=True)  # .grad set by
                    # the first backward that produces one, as for any parameter

    def _host_pool(self, nbytes: int) -> MemoryPool:
        config = PoolConfig(initial_size=nbytes, max_size=nbytes, growth_factor=1.0,
                            alignment=_ALIGN, max_cached_buffers=0)
        if self.device.type == "cuda":
            return MemoryPool.pinned(config)
        return MemoryPool("cpu", config)

    def _slot_bytes(self) -> int:
        return max((b.nbytes for b in self._blocks), default=0)

    def _allocate_slots(self) -> None:
        size = self._slot_bytes()
        if not size:
            return
        r = self.config.num_slots
        self._slot_pool = MemoryPool(self.device, PoolConfig(
            initial_size=r * size, max_size=r * size, growth_factor=1.0, alignment=_ALIGN,
            max_cached_buffers=0))
        for i in range(r):
            pool_block = self._slot_pool.allocate(size)
            slot = _Slot(i, pool_block, pool_block.view((size,), torch.uint8), self.streams)
            self._slots.append(slot)
            for block in self._blocks:
                block.slot_views[i] = [_typed_view(slot.buffer, e.offset, e)
                                       for e in block.entries]
                block.slot_flat[i] = slot.buffer[:block.nbytes]

    def _anchor_tensor(self) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        return self._anchor

    def _wrap_forward(self, block: SwappedBlock) -> None:
        module = block.module
        block.had_instance_forward = "forward" in module.__dict__
        block.original_forward = module.__dict__.get("forward")
        fn, checkpointed = _unwrapped_forward(module)
        block.checkpointed = (checkpointed if self.config.checkpointing is None
                              else self.config.checkpointing)
        swapper = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            return swapper._call_block(block, fn, args, kwargs)

        forward.__vramkit_swapped__ = True  # type: ignore[attr-defined]
        module.forward = forward

    # -- the hot path -----------------------------------------------------------------------

    def _call_block(self, block: SwappedBlock, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if not self._attached:
            raise OffloadError(f"swapped block {block.name} called after detach()")
        self._observe(block)
        chain = self._last_hooks
        if chain:
            self._last_hooks = []  # only the immediately preceding call chains
        if not torch.is_grad_enabled():
            self._training_pass = False
            stream = self._acquire(block, backward=False)
            try:
                return fn(*args, **kwargs)
            finally:
                self._release(block, backward=False, stream=stream)
        # Most blocks take plain tensors positionally: one pass over them, no tree walk (this
        # path runs once per block and step, where the swapper is host-bound).
        spec = None
        positions: list[int] | None = [] if not kwargs else None
        if positions is not None:
            for i, a in enumerate(args):
                kind = type(a)
                if kind is torch.Tensor or kind is nn.Parameter:
                    if a.requires_grad:
                        positions.append(i)
                elif kind not in _PLAIN_LEAVES:
                    positions = None
                    break
        if positions is None:
            leaves, spec = _tree.flatten((args, kwargs))
            positions = [i for i, x in enumerate(leaves)
                         if isinstance(x, torch.Tensor) and x.requires_grad]
        else:
            leaves = list(args)
        # Whether the block has trainable parameters only matters when no input requires
        # grad (LoRA on a frozen model's first block) or for the anchor of swapped trainable
        # weights: otherwise the per-pass requires_grad check is skipped.
        if not positions and not self._has_trainable(block):
            self._training_pass = False
            stream = self._acquire(block, backward=False)
            try:
                # Grad mode with nothing to differentiate: anything autograd still saves from
                # the slot (a requires-grad tensor hidden from pytree) must fail loudly.
                with self._weight_hooks(block, forbid=True):
                    return fn(*args, **kwargs)
            finally:
                self._release(block, backward=False, stream=stream)
        self._training_pass = True
        if not block.trainable_entries:
            return self._call_in_graph(block, fn, leaves, spec, positions, chain)
        if spec is None:
            spec = _tree.flatten((args, kwargs))[1]
        call = BlockCall(self, block, fn, leaves, spec, block.checkpointed)
        tensors = [x for x, t in zip(leaves, call.is_tensor, strict=True) if t]
        anchor = self._anchor_tensor() if self._has_trainable(block) else None
        outs = SwapBlockFunction.apply(call, anchor, *tensors)
        return call.rebuild_outputs(list(outs))

    def _call_in_graph(self, block: SwappedBlock, fn: Callable[..., Any], leaves: list[Any],
                       spec: Any, positions: list[int],
                       chain: list[tuple[int, OutputHook]]) -> Any:
        """A training call whose nodes join the outer graph (see ``_swap_graph``): pre-hooks on
        the output nodes and an identity Function on the inputs hold the slot across the block's
        backward. ``spec`` is ``None`` when ``leaves`` are the positional arguments themselves;
        ``positions`` index the leaves that require grad; ``chain`` holds the output hooks of
        the swapped call made just before."""
        call = BlockBackward(self, block)
        entry = None
        if positions:
            # A chain of swapped blocks: when every differentiable input comes from one output
            # node of the previous call, that node's hook releases this call (no entry Function).
            entry = leaves[positions[0]].grad_fn
            link = None
            if chain and entry is not None:
                number = entry._sequence_nr()
                for n, hook in chain:
                    if n == number:
                        link = hook
                        break
                if link is not None:
                    for i in positions:
                        if leaves[i].grad_fn is not entry:
                            link = None
                            break
            if link is not None:
                link.consumers.append(call)
            else:
                entered = enter_block(call, [leaves[i] for i in positions])
                for i, t in zip(positions, entered, strict=True):
                    leaves[i] = t
                entry = entered[0].grad_fn
        if spec is None:
            args: Any = leaves
            kwargs: dict[str, Any] = {}
        else:
            args, kwargs = _tree.unflatten(leaves, spec)
        stream = self._acquire(block, backward=False)
        try:
            if block.checkpointed:
                # Non-reentrant: keeps the inputs, recomputes in backward after the output
                # hooks re-acquired the slot, and stops once the saved tensors are rebuilt. Every
                # tensor saved inside goes through the checkpoint's own (innermost) hooks, so
                # no slot weight can be saved: the swapper's hooks are not needed here.
                out = torch_checkpoint(fn, *args, use_reentrant=False,
                                       preserve_rng_state=self.config.preserve_rng_state,
                                       **kwargs)
            else:
                with self._weight_hooks(block):
                    out = fn(*args, **kwargs)
        finally:
            self._release(block, backward=False, stream=stream)
        if type(out) is torch.Tensor:
            if not out.requires_grad:
                return out
            hooked = hook_outputs(call, [out], entry)
            if hooked is not None:
                self._last_hooks = hooked
                return out
            return exit_block(call, [out])[0]
        if type(out) is tuple and all(type(o) in _PLAIN_LEAVES for o in out):
            out_leaves, out_spec = list(out), None
        else:
            out_leaves, out_spec = _tree.flatten(out)
        outputs = [i for i, x in enumerate(out_leaves)
                   if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outputs:
            return out
        differentiable = [out_leaves[i] for i in outputs]
        hooked = hook_outputs(call, differentiable, entry)
        if hooked is not None:
            self._last_hooks = hooked
            return out
        exited = exit_block(call, differentiable)
        for i, t in zip(outputs, exited, strict=True):
            out_leaves[i] = t
        return tuple(out_leaves) if out_spec is None else _tree.unflatten(out_leaves, out_spec)

    def _has_trainable(self, block: SwappedBlock) -> bool:
        """Whether the block has a parameter that requires grad. Re-read at the start of every
        pass (adapters may be added or weights unfrozen between steps) and cached within it:
        walking the module's parameters costs tens of microseconds per block, so the list is
        kept and listed again only after a module or parameter was registered anywhere
        (PyTorch's global registration hooks count those, :func:`_structure_epoch`) or a child
        or parameter count of the block's modules changed (writes that bypass those hooks,
        such as ``ModuleList.insert``; replacing an entry of ``_modules`` in place is not
        seen)."""
        cached = self._trainable_cache.get(id(block))
        if cached is None:
            epoch = _structure_epoch()
            # Registrations anywhere bump the epoch; writes that skip PyTorch's registration
            # hooks (ModuleList.insert, del) still change a child or parameter count.
            if block.params_epoch != epoch or block.shape_key != _shape_key(block.submodules):
                block.submodules = list(block.module.modules())
                block.params = list(block.module.parameters())
                block.params_epoch = epoch
                block.shape_key = _shape_key(block.submodules)
            cached = any(p.requires_grad for p in block.params)
            self._trainable_cache[id(block)] = cached
        return cached

    def _observe(self, block: SwappedBlock) -> None:
        """Learn the forward order: a block seen twice (or after backward) starts a new pass."""
        if self._direction == "backward":
            self._observed, self._observed_ids = [], set()
            self._trainable_cache.clear()
        elif id(block) in self._observed_ids:
            self._commit_order()
            self._trainable_cache.clear()
        elif not self._observed:
            self._trainable_cache.clear()
        self._direction = "forward"
        self._observed.append(block)
        self._observed_ids.add(id(block))

    def _commit_order(self) -> None:
        if self._observed and len(self._observed) == len(self._blocks) and \
                self._observed != self._order:
            self._order = list(self._observed)
            self._position = {id(b): i for i, b in enumerate(self._order)}
            self._upcoming_cache.clear()
        self._observed = []
        self._observed_ids = set()

    def _acquire(self, block: SwappedBlock, *, backward: bool, stream: Any = None) -> Any:
        """Make ``block`` usable on ``stream`` (default: the current stream, returned): load it
        unless its slot holds it, order the stream after the load, point its tensors at the
        slot."""
        start = time.perf_counter()
        if backward and self._direction != "backward":
            self._commit_order()  # the forward just seen predicts this backward
            self._direction = "backward"
            self._last_hooks = []
        self._counters["acquisitions"] += 1
        slot = block.slot
        if slot is not None and slot.loaded_version == block.master._version:  # type: ignore[union-attr]
            self._counters["hits"] += 1
        else:
            slot = self._load(block, on_demand=True)
            if slot is None:
                raise OffloadError(
                    f"no free slot for swapped block {block.name}: all "
                    f"{len(self._slots)} slots are in use",
                    hint="A swapped block called inside another swapped block needs more "
                         "slots: raise SwapConfig.num_slots.")
        if stream is None:
            stream = self.streams.current()
        self.streams.wait(stream, slot.loaded_event)
        slot.locked = True
        self._clock += 1
        slot.last_used = self._clock
        if block.bound is not slot:  # still bound when the block kept its slot since last time
            for e, view in zip(block.entries, block.slot_views[slot.index], strict=False):
                e.tensor.data = view
            block.bound = slot
        self._enqueue_seconds += time.perf_counter() - start
        return stream

    def _release(self, block: SwappedBlock, *, backward: bool, stream: Any = None) -> None:
        """The block is done with its slot once ``stream`` (default: the current stream) gets
        past this point; prefetch what comes next."""
        start = time.perf_counter()
        slot = block.slot
        if slot is not None:
            self.streams.record(slot.free_event,
                                stream if stream is not None else self.streams.current())
            slot.locked = False
        self._prefetch_after(block, backward)
        self._enqueue_seconds += time.perf_counter() - start

    def _upcoming(self, block: SwappedBlock, backward: bool
                  ) -> tuple[list[SwappedBlock], set[int]]:
        """The next ``lookahead`` distinct blocks needed after ``block`` in the predicted order
        (``block`` itself when it is needed again next: the forward->backward turn), and their
        ids. Cached per order: this runs after every block call, and building the sequence is
        O(blocks)."""
        pos = self._position.get(id(block))
        if pos is None:
            return [], set()
        key = (pos, backward, self._training_pass)
        cached = self._upcoming_cache.get(key)
        if cached is None:
            blocks = self._compute_upcoming(pos, backward)
            cached = self._upcoming_cache[key] = (blocks, {id(b) for b in blocks})
        return cached

    def _compute_upcoming(self, pos: int, backward: bool) -> list[SwappedBlock]:
        k = self.config.lookahead
        order = self._order
        n = len(order)
        if not k or not n:
            return []
        out: list[SwappedBlock] = []
        if backward:
            seq = [order[i] for i in range(pos - 1, -1, -1)]
            seq += order  # then the next step's forward, from the first block
        elif self._training_pass:
            seq = order[pos + 1:] + [order[i] for i in range(n - 1, -1, -1)]
        else:  # inference: wrap around to the first blocks of the next call
            seq = order[pos + 1:] + order
        for b in seq:
            if b in out:
                continue
            out.append(b)
            if len(out) == k:
                break
        return out

    def _prefetch_after(self, block: SwappedBlock, backward: bool) -> None:
        upcoming, keep = self._upcoming(block, backward)
        for b in upcoming:
            slot = b.slot
            if slot is not None and slot.loaded_version == b.master._version:  # type: ignore[union-attr]
                continue
            if self._load(b, on_demand=False, keep=keep) is None:
                break

    def _load(self, block: SwappedBlock, *, on_demand: bool,
              keep: set[int] | None = None) -> _Slot | None:
        """Fill a slot with ``block``: the least recently used unlocked slot whose block is not
        wanted soon. Returns ``None`` when every slot is locked or wanted."""
        slot: _Slot | None = None
        for s in self._slots:  # R is small: a plain loop beats building candidate lists
            if s.locked:
                continue
            held = s.block
            if held is block:
                slot = s  # its own slot, reloaded in place
                break
            if held is not None and keep is not None and id(held) in keep:
                continue
            if slot is None or s.last_used < slot.last_used:
                slot = s
        if slot is None:
            return None
        old = slot.block
        if old is not None and old is not block:
            old.slot = None
            old.bound = None
            for e in old.entries:  # eviction: a pointer repoint, nothing copied back
                e.tensor.data = e.placeholder
        streams = self.streams
        streams.wait(streams.h2d, slot.free_event)
        assert block.master is not None
        streams.copy(block.slot_flat[slot.index], block.master, streams.h2d, block.name)
        streams.record(slot.loaded_event, streams.h2d)
        slot.block = block
        slot.loaded_version = block.master._version
        self._clock += 1
        slot.last_used = self._clock
        block.slot = slot
        self._counters["loads"] += 1
        self._counters["on_demand" if on_demand else "prefetched"] += 1
        self._counters["h2d_bytes"] += block.nbytes
        return slot

    @contextlib.contextmanager
    def _weight_hooks(self, block: SwappedBlock, *, forbid: bool = False) -> Iterator[None]:
        """Saved-tensor hooks for a block call: tensors in the slot become :class:`WeightRef`
        handles (or, with ``forbid``, an error); every other tensor goes to the hooks that were
        active outside the block (activation offload, a parent-level checkpoint), so those keep
        working inside swapped blocks."""
        slot = block.slot
        if slot is None:
            raise OffloadError(f"swapped block {block.name} runs without a slot")
        base = slot.buffer.data_ptr()
        end = base + block.nbytes
        device = self.device
        outer = _outer_saved_tensor_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor) -> Any:
            if t.device == device and base <= t.data_ptr() < end:
                if forbid:
                    raise OffloadError(
                        f"autograd saved a weight of swapped block {block.name} although the "
                        "call looked like it needed no gradient",
                        hint="Pass tensors that require grad as plain arguments (or in "
                             "lists/tuples/dicts) of the block's forward.")
                return WeightRef(block, t.data_ptr() - base, t.shape, tuple(t.stride()), t.dtype)
            if outer_pack is not None:
                return _OuterSaved(outer_pack(t))
            return t

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, WeightRef):
                return self._weight_from_slot(saved)
            if isinstance(saved, _OuterSaved) and outer_unpack is not None:
                return outer_unpack(saved.value)
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _weight_from_slot(self, ref: WeightRef) -> torch.Tensor:
        slot = ref.block.slot
        if slot is None or not slot.locked or slot.block is not ref.block:
            raise OffloadError(f"a saved weight of {ref.block.name} was used outside its "
                               "block's backward",
                               hint="This is a vramkit bug; please report it with the model.")
        itemsize = ref.dtype.itemsize
        flat = slot.buffer.view(ref.dtype)
        return torch.as_strided(flat, ref.shape, ref.stride,
                                flat.storage_offset() + ref.offset // itemsize)

    def _before_block_backward(self, block: SwappedBlock) -> None:
        """Gradients accumulate as PyTorch's do: while a host gradient holds a value (not set to
        None by ``zero_grad``), start the GPU gradient from it, so backward adds to it."""
        pending = [(e, e.host_param.grad) for e in block.trainable_entries
                   if e.host_param is not None and e.host_param.grad is not None]
        if not pending:
            return
        if block.grad_event is not None:  # the previous device->host copy must land first
            self.streams.wait(self.streams.current(), block.grad_event)
        for e, grad in pending:
            e.tensor.grad = grad.to(self.device, non_blocking=True)

    def _after_block_backward(self, block: SwappedBlock) -> None:
        if not block.trainable_entries:
            return
        streams = self.streams
        ready = streams.event()
        streams.record(ready, streams.current())
        streams.wait(streams.d2h, ready)
        if block.grad_buffer is None:
            raise OffloadError(f"swapped block {block.name} has no gradient buffer")
        copied = False
        for e in block.trainable_entries:
            grad = e.tensor.grad
            hp = e.host_param
            if grad is None or hp is None:
                continue  # no gradient this step: the host gradient keeps its state
            target = _typed_view(block.grad_buffer, e.offset, e)
            streams.copy(target, grad, streams.d2h, block.name)
            hp.grad = target
            if grad.device.type == "cuda":
                grad.record_stream(streams.d2h)
            e.tensor.grad = None
            self._counters["d2h_bytes"] += e.nbytes
            copied = True
        if copied:
            block.grad_event = streams.event()
            streams.record(block.grad_event, streams.d2h)

    # -- public API -------------------------------------------------------------------------

    @property
    def swapped_names(self) -> list[str]:
        """Qualified names of the swapped blocks, in execution order."""
        return [b.name for b in self._blocks]

    @property
    def blocks(self) -> list[SwappedBlock]:
        """The swapped blocks (read-only use)."""
        return list(self._blocks)

    def host_parameters(self) -> list[nn.Parameter]:
        """Host-side parameters of swapped trainable weights (``trainable="cpu"``).

        Each is a view of its block's pinned master with ``.grad`` a view of the pinned gradient
        buffer; build a CPU optimizer over them. Call :meth:`sync_gradients` before its
        ``step()``; after ``zero_grad()`` the next backward overwrites the buffers.
        """
        return [e.host_param for b in self._blocks for e in b.trainable_entries
                if e.host_param is not None]

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """Every parameter an optimizer should step while attached: the model's trainable
        parameters that are not swapped (on the device), then :meth:`host_parameters`.

        The module's swapped Parameter objects hold zero-byte placeholders between calls, so an
        optimizer must not be built over ``model.parameters()`` with ``trainable="cpu"``; with
        ``trainable="resident"`` this is the model's trainable parameters.
        """
        swapped = {id(e.tensor) for b in self._blocks for e in b.trainable_entries}
        seen: set[int] = set()
        out: list[nn.Parameter] = []
        for p in self.model.parameters():
            if p.requires_grad and id(p) not in swapped and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out + self.host_parameters()

    def sync_gradients(self) -> None:
        """Wait (on the host) until every offloaded gradient has arrived and no copy still reads
        the masters: call it once per optimizer step, before stepping the host parameters."""
        for block in self._blocks:
            if block.grad_event is not None:
                self.streams.synchronize(block.grad_event)
                block.grad_event = None
            # A gradient set to None by zero_grad() is re-attached at the next backward.
        for slot in self._slots:
            self.streams.synchronize(slot.loaded_event)
            # The host step that follows rewrites trainable masters, and fused optimizers (and
            # writes through .data) do not bump version counters: reload such blocks next time.
            if slot.block is not None and slot.block.trainable_entries:
                slot.loaded_version = -1

    def forward_with_swapping(self, input: Any, forward_fn: Callable[[Any], Any] | None = None
                              ) -> Any:
        """Run an inference forward (seed API): ``forward_fn(input)`` (default ``model(input)``)
        under ``torch.no_grad()``; blocks are prefetched with wrap-around, so the next call
        finds the first blocks already loaded."""
        fn = forward_fn if forward_fn is not None else self.model
        with torch.no_grad():
            return fn(input)

    def stats(self) -> SwapStats:
        """Counters and sizes (see :class:`SwapStats`)."""
        c = self._counters
        pinned = sum(p.stats().reserved for p in (self._master_pool, self._grad_pool)
                     if p is not None)
        return SwapStats(
            blocks=len(self.schedule), swapped_blocks=len(self._blocks),
            swapped_bytes=sum(e.nbytes for b in self._blocks for e in b.entries),
            pinned_bytes=pinned, slot_bytes=self._slot_bytes() * len(self._slots),
            resident_block_bytes=self._resident_block_bytes,
            loads=c["loads"], prefetched=c["prefetched"], on_demand=c["on_demand"],
            hits=c["hits"], h2d_bytes=c["h2d_bytes"], d2h_bytes=c["d2h_bytes"],
            acquisitions=c["acquisitions"], enqueue_seconds=self._enqueue_seconds,
            order_pattern=analyze_access_pattern(
                [self._blocks.index(b) for b in self._order]))

    def reset_stats(self) -> None:
        """Zero the transfer counters (sizes are kept)."""
        for key in self._counters:
            self._counters[key] = 0
        self._enqueue_seconds = 0.0

    def detach(self) -> None:
        """Put the model back as it was: every tensor on its original device with its current
        values (trained weights included), the same ``Parameter`` objects, forwards unwrapped.
        Frees the pinned masters and GPU slots. Waits for outstanding copies (a host sync)."""
        if not self._attached:
            raise OffloadError("this BlockSwapper is already detached")
        self._attached = False
        self._undo_attach()

    def _undo_attach(self) -> None:
        if self._unwatch is not None:
            self._unwatch()  # runs _watch_structure(False) once
            self._unwatch = None
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.current_stream(self.device).synchronize()
            torch.cuda.synchronize(self.device)
        for handle in self._state_hooks:
            handle.remove()
        self._state_hooks = []
        for block in self._blocks:
            module = block.module
            if block.had_instance_forward:
                module.forward = block.original_forward
            else:
                module.__dict__.pop("forward", None)
            for e, master_view in zip(block.entries, block.master_views, strict=False):
                restored = torch.empty_strided(e.shape, e.stride, dtype=e.dtype,
                                               device=e.original_device)
                restored.copy_(master_view)
                e.tensor.data = restored
                e.host_param = None
            block.slot = block.bound = None
            block.slot_views.clear()
            block.slot_flat.clear()
            block.master_views = []
            for attr in ("master_block", "grad_block"):
                handle = getattr(block, attr)
                if handle is not None and not handle.freed:
                    handle.free()
                setattr(block, attr, None)
            block.master = block.grad_buffer = None
        for tensor, device in self._moved:
            grad = tensor.grad
            if grad is not None:
                tensor.grad = None
            tensor.data = tensor.data.to(device)
            if grad is not None:
                tensor.grad = grad.to(device)
        self._moved = []
        for slot in self._slots:
            if not slot.pool_block.freed:
                slot.pool_block.free()
        self._slots = []
        for pool in (self._slot_pool, self._master_pool, self._grad_pool):
            if pool is not None:
                pool.clear(force=True)
        self._slot_pool = self._master_pool = self._grad_pool = None
        self._blocks = []
        self._anchor = None
        self._last_hooks = []

    def __enter__(self) -> BlockSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._attached:
            self.detach()

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (f"BlockSwapper({len(self._blocks)}/{len(self.schedule)} blocks swapped, "
                f"{len(self._slots)} slots of {format_size(self._slot_bytes())}, "
                f"device={self.device}, {state})")


# -- helpers -----------------------------------------------------------------------------------


def _as_specs(blocks: Sequence[BlockSpec | tuple[str, int] | nn.Module | str]) -> list[BlockSpec]:
    if isinstance(blocks, (str, nn.Module)) or not isinstance(blocks, Sequence):
        raise ConfigError("blocks must be a sequence of BlockSpec, (name, nbytes), modules or "
                          "names")
    if blocks and all(isinstance(b, str) for b in blocks):
        return [BlockSpec(name, 1) for name in sorted(blocks, key=natural_key)]  # type: ignore[arg-type]
    specs = []
    for i, b in enumerate(blocks):
        if isinstance(b, BlockSpec):
            specs.append(b)
        elif isinstance(b, nn.Module):
            specs.append(BlockSpec(str(i), module_bytes(b)))
        elif isinstance(b, tuple) and len(b) == 2:
            specs.append(BlockSpec(b[0], b[1]))
        else:
            raise ConfigError(f"cannot read block {b!r}: expected BlockSpec, (name, nbytes), "
                              "a module or a name")
    return specs


def _unwrapped_forward(module: nn.Module) -> tuple[Callable[..., Any], bool]:
    """The forward to run for a block and whether vramkit checkpointing had marked it."""
    try:
        from vramkit.offload.checkpointing import is_checkpointed, unwrapped_forward
    except ImportError:  # checkpointing is optional for the swapper
        return module.forward, False
    if is_checkpointed(module):
        return unwrapped_forward(module), True
    return module.forward, False


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements cover its memory exactly once (any dimension order)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True),
                               key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _OuterSaved:
    """A tensor saved through the hooks that were active outside the swapped block."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _outer_saved_tensor_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # older PyTorch: outer hooks do not reach inside swapped blocks
        return None
    return top(False)


# Module structure changes (adapters added after attaching, say) are seen through PyTorch's
# global registration hooks: each registered module or parameter anywhere bumps the epoch, and a
# block whose parameter list is older lists its parameters again. The hooks are installed while
# at least one swapper is attached.
_STRUCTURE = {"epoch": 0, "users": 0}
_STRUCTURE_HANDLES: list[Any] = []


def _structure_epoch() -> int:
    return _STRUCTURE["epoch"]


def _shape_key(modules: list[nn.Module]) -> int:
    return sum(len(m._modules) + len(m._parameters) for m in modules)


def _bump_structure_epoch(*_: Any) -> None:
    _STRUCTURE["epoch"] += 1


def _watch_structure(on: bool) -> None:
    from torch.nn.modules import module as torch_module
    if on:
        _STRUCTURE["users"] += 1
        if _STRUCTURE["users"] == 1:
            _STRUCTURE["epoch"] += 1  # registrations while nobody watched went uncounted
            _STRUCTURE_HANDLES.append(
                torch_module.register_module_module_registration_hook(_bump_structure_epoch))
            _STRUCTURE_HANDLES.append(
                torch_module.register_module_parameter_registration_hook(_bump_structure_epoch))
        return
    _STRUCTURE["users"] -= 1
    if _STRUCTURE["users"] == 0:
        for handle in _STRUCTURE_HANDLES:
            handle.remove()
        _STRUCTURE_HANDLES.clear()
