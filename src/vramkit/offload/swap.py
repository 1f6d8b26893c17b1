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
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vramkit._validate import check_bool, check_choice, check_int, check_number, check_size
from vramkit.devices.resolve import resolve_device
from vramkit.errors import ConfigError, OffloadError, VramkitWarning
from vramkit.memory.layout import Random, Sequential, Strided, analyze_access_pattern
from vramkit.memory.transfer import transfer_streams
from vramkit.offload import _patch, _tree
from vramkit.offload._lean_checkpoint import LeanState
from vramkit.offload._state_dict import install_swap_hooks
from vramkit.offload._swap_blocks import (
    BlockFootprint,
    SwapEntry,
    SwappedBlock,
    block_footprint,
    block_tensors,
    is_swappable,
    layout_entries,
    schedule_bytes,
)
from vramkit.offload._swap_function import BlockCall, SwapBlockFunction
from vramkit.offload._swap_graph import (
    BlockBackward,
    OutputHook,
    enter_block,
    exit_block,
    hook_outputs,
)
from vramkit.offload._swap_host import DiskSplit, HostStore, MasterMemory, split_for_host_budget
from vramkit.offload._swap_optim import OptimizerFactory, SwappedOptimizer, SwapStepper
from vramkit.offload._swap_ring import COUNTERS as RING_COUNTERS
from vramkit.offload._swap_ring import BlockLoader, SlotRing
from vramkit.offload._swap_source import CheckpointSource
from vramkit.offload._swap_structure import shape_key, structure_epoch, watch_structure
from vramkit.offload.blocks import (
    BlockScheduleEntry,
    BlockSpec,
    as_block_specs,
    choose_swapped,
    find_blocks,
    module_bytes,
    named_schedule,
)
from vramkit.offload.checkpointing import (
    checkpoint_method,
    is_checkpointed,
    run_checkpointed,
    unwrapped_forward,
)
from vramkit.units import format_size

__all__ = [
    "BlockFootprint",
    "BlockLoader",
    "BlockScheduleEntry",
    "BlockSwapper",
    "DiskSplit",
    "GradientHook",
    "MasterMemory",
    "SwapConfig",
    "SwapStats",
]

# Called with a swapped block's name and its trainable weights' gradients on the device, once
# they are complete for the step; may return a finish() for work still in flight (see
# BlockSwapper.set_gradient_hook).
GradientHook = Callable[[str, list[torch.Tensor]], "Callable[[], None] | None"]

logger = logging.getLogger(__name__)

_TRAINABLE = ("resident", "cpu", "swap")
_STAGING_MIN = 3  # disk tier: one buffer copying to the GPU, one ready, one being read
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
            neither (default) every block is swapped. It counts weights: with
            ``trainable="swap"`` the state slots (R x the largest block's optimizer state,
            known after the first step: ``stats().state_slot_bytes``) come on top.
        num_slots: R, the GPU slots of the ring (default 2, at least 1). With
            ``trainable="swap"`` also the optimizer-state slots (at least 2), and more slots let
            write-backs overlap the next loads: give it what the card has room for (Flux-12B
            full fine-tuning reached its copy bound at 8; docs/benchmarks.md).
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
            a CPU optimizer over :meth:`BlockSwapper.host_parameters`; ``"swap"`` swaps them
            with their optimizer state and steps each block's own optimizer on the GPU inside
            backward (full fine-tuning; give ``BlockSwapper(..., optimizer=factory)``).
        accumulation_steps: with ``trainable="swap"``, backward passes per optimizer step of the
            swapped blocks (default 1); the gradients of the first ``N - 1`` wait in pinned
            host memory.
        max_grad_norm: with ``trainable="swap"``, clip the gradients by their global L2 norm
            (resident and swapped together). The swapped blocks' steps are then deferred: call
            :meth:`BlockSwapper.clip_grad_norm_` and ``swapper.optimizer.step()`` after
            backward. Default ``None`` (no clipping; blocks step inside backward).
        preserve_rng_state: replay the RNG state when recomputing a checkpointed block, so
            dropout masks match (default ``True``).
        swapped_blocks: the names of the blocks to swap, as a planner chose them (the other
            blocks stay resident); a list is stored as a tuple. Not with ``max_gpu_blocks`` or
            ``max_gpu_bytes``. Default ``None``: the schedule chooses by the limits.
        host_budget: pinned host bytes the swapper may hold (masters, gradient buffers and
            disk staging; an int or a string such as ``"8GiB"``). Swapped blocks whose masters
            do not fit stay on disk (frozen weights only): in the checkpoint the swapper was
            attached with, or in a cache file written once, and are read ahead of use into a
            few pinned staging buffers (:mod:`vramkit.offload._swap_disk`). Default ``None``:
            every swapped block is pinned.
        disk_cache_dir: where the disk tier writes its cache file when blocks cannot be read
            from a checkpoint (default: ``$VRAMKIT_CACHE_DIR`` or ``~/.cache/vramkit``). Use a
            local disk, not tmpfs (that would be RAM again).
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
    swapped_blocks: tuple[str, ...] | None = None
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    host_budget: int | str | None = None
    disk_cache_dir: str | None = None

    def __post_init__(self) -> None:
        check_int("SwapConfig.max_gpu_blocks", self.max_gpu_blocks, minimum=0, allow_none=True)
        object.__setattr__(self, "max_gpu_bytes", check_size(
            "SwapConfig.max_gpu_bytes", self.max_gpu_bytes, allow_none=True))
        check_int("SwapConfig.num_slots", self.num_slots, minimum=1)
        check_int("SwapConfig.prefetch", self.prefetch, minimum=0, maximum=self.num_slots,
                  allow_none=True,
                  hint="Prefetching more blocks than there are slots would evict blocks before "
                       "they are used. Raise num_slots.")
        check_bool("SwapConfig.checkpointing", self.checkpointing, allow_none=True)
        check_int("SwapConfig.min_param_bytes", self.min_param_bytes, minimum=0)
        check_choice("SwapConfig.trainable", self.trainable, _TRAINABLE)
        check_bool("SwapConfig.swap_buffers", self.swap_buffers)
        check_bool("SwapConfig.preserve_rng_state", self.preserve_rng_state)
        check_int("SwapConfig.accumulation_steps", self.accumulation_steps, minimum=1)
        object.__setattr__(self, "max_grad_norm", check_number(
            "SwapConfig.max_grad_norm", self.max_grad_norm, minimum=0.0, low_open=True,
            allow_none=True))
        if self.trainable != "swap" and (self.accumulation_steps != 1
                                         or self.max_grad_norm is not None):
            knob = ("accumulation_steps" if self.accumulation_steps != 1 else "max_grad_norm")
            raise ConfigError(
                f"SwapConfig.{knob} applies to trainable='swap' (the swapper steps the "
                f"swapped blocks' optimizers), not to trainable={self.trainable!r}",
                hint="Use trainable='swap' with an optimizer factory, or accumulate and clip "
                     "in your own training loop.")
        object.__setattr__(self, "host_budget", check_size(
            "SwapConfig.host_budget", self.host_budget, allow_none=True))
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, (str, os.PathLike)) or not str(
                    self.disk_cache_dir):
                raise ConfigError(
                    f"SwapConfig.disk_cache_dir must be a directory path, got "
                    f"{self.disk_cache_dir!r}",
                    hint="Pass a path on a local disk, e.g. '/scratch/vramkit-cache'.")
            object.__setattr__(self, "disk_cache_dir", os.fspath(self.disk_cache_dir))
            if self.host_budget is None:
                raise ConfigError(
                    "SwapConfig.disk_cache_dir is where the disk tier writes, and there is no "
                    "disk tier without host_budget",
                    hint="Set host_budget (e.g. '8GiB') as well, or drop disk_cache_dir.")
        if self.host_budget is not None and self.trainable == "swap":
            raise ConfigError(
                "SwapConfig.host_budget does not bound trainable='swap' yet: the block "
                "optimizers' state masters are pinned on their first step and not counted",
                hint="Drop host_budget for full fine-tuning (pinned = weights + optimizer "
                     "state), or use it with frozen swapped weights (LoRA).")
        if self.swapped_blocks is not None:
            names = self.swapped_blocks
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
                    isinstance(n, str) and n for n in names):
                raise ConfigError(
                    f"SwapConfig.swapped_blocks must be a list of block names, got {names!r}",
                    hint="Name blocks as find_blocks(model) does, e.g. ['blocks.0', 'blocks.3'].")
            if self.max_gpu_blocks is not None or self.max_gpu_bytes is not None:
                raise ConfigError(
                    "SwapConfig.swapped_blocks names the blocks to swap; max_gpu_blocks and "
                    "max_gpu_bytes would choose them again",
                    hint="Give either swapped_blocks or the limits, not both.")
            object.__setattr__(self, "swapped_blocks", tuple(names))

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
        pinned_bytes: host bytes reserved for masters (and gradient buffers, disk staging), page
            locked on a GPU except ``pageable_bytes`` of them.
        slot_bytes: GPU bytes of the ring (R x the largest swapped block).
        resident_block_bytes: bytes of blocks (and swapped blocks' small tensors) kept on GPU.
        loads: slot fills; ``prefetched`` of them were issued ahead of use, ``on_demand`` when
            a block was needed and not on its way (a misprediction or the first pass).
        hits: acquisitions that found the block already in a slot.
        h2d_bytes / d2h_bytes: bytes copied host->device (weights) / device->host (gradients).
        gathered_bytes: weight bytes that reached the slots from the other GPUs instead of the
            host (a collective ``block_loader``: sharded uploads).
        enqueue_seconds: host time spent in acquire/release (enqueuing copies and events).
        acquisitions: blocks acquired (forward and backward).
        order_pattern: how the learnt forward order walks the swapped blocks' model positions
            (:func:`vramkit.memory.layout.analyze_access_pattern`): ``Sequential()`` for a
            plain front-to-back stack, ``Strided``/``Random`` when blocks are called out of
            their container order (prefetch follows the learnt order either way).
        optimizer_steps: block optimizer steps taken (``trainable="swap"``).
        state_bytes: pinned host bytes of the block optimizers' state masters (included in
            ``pinned_bytes``; grows as blocks adopt their state on their first step).
        state_slot_bytes: GPU bytes of the optimizer state slots (``num_slots`` of them, at
            least two).
        state_prefetched: block optimizer states loaded right behind their block's weights
            when prefetched in backward (the others load as the block's backward begins).
        pageable_bytes: host bytes of masters/buffers that could not be page-locked (the
            pinned pool fell back to pageable memory: copies from them are slower).
        disk_blocks / disk_bytes: swapped blocks kept on disk (``host_budget``) and their
            bytes; ``staging_bytes`` the pinned staging buffers they are read into (included
            in ``pinned_bytes``).
        disk_reads / disk_read_bytes / disk_read_seconds: blocks read from disk, bytes and
            time the reader spent; ``disk_hits`` copies served from a staging buffer without a
            read; ``disk_waits`` / ``disk_wait_seconds`` times (and time) a block was needed
            before its read finished.
        shared_bytes: of ``pinned_bytes``, the masters in memory shared by the processes of
            one node (``vramkit.distributed``): one copy per node, not per process.
        checkpoint_bytes / load_seconds: bytes read from the checkpoint and the time from
            the start of the attach to the end of the load (``checkpoint=``); ``loading``:
            swapped blocks are still being read in the background (these two figures and
            ``pinned_bytes`` are then the ones so far).
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
    optimizer_steps: int = 0
    state_bytes: int = 0
    state_slot_bytes: int = 0
    pageable_bytes: int = 0
    disk_blocks: int = 0
    disk_bytes: int = 0
    staging_bytes: int = 0
    disk_reads: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_hits: int = 0
    disk_waits: int = 0
    disk_wait_seconds: float = 0.0
    checkpoint_bytes: int = 0
    load_seconds: float = 0.0
    loading: bool = False
    shared_bytes: int = 0
    gathered_bytes: int = 0
    state_prefetched: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["order_pattern"] = type(self.order_pattern).__name__.lower()
        return out


class _SwappedForward(_patch.MethodWrapper):
    """A swapped block's ``forward``: every call goes through its swapper."""

    __slots__ = ("block", "fn", "swapper")

    kind = "swap"

    def __init__(self, swapper: BlockSwapper, block: SwappedBlock,
                 fn: Callable[..., Any]) -> None:
        super().__init__()
        self.swapper = swapper
        self.block = block
        self.fn = fn  # the forward to run: the block's own, without vramkit's checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:  # restored beneath a foreign patch: a plain forward again
            return self.inner(*args, **kwargs)
        return self.swapper._call_block(self.block, self.fn, args, kwargs)


class BlockSwapper:
    """Streams a model's blocks between pinned host memory and a ring of GPU slots.

    Args:
        model: any ``nn.Module`` (on the CPU or the device).
        blocks: ``"auto"`` (default) or names/patterns, as :func:`find_blocks` takes them.
        config: a :class:`SwapConfig` (default: every block swapped, R=2).
        device: where compute runs (default ``"cuda"``; ``"cpu"`` runs the same machinery
            synchronously, for tests and CPU-only machines).
        optimizer: with ``SwapConfig(trainable="swap")`` (required then, refused otherwise):
            ``factory(params) -> torch.optim.Optimizer``, called once per swapped block with
            its trainable parameters (``lambda ps: torch.optim.AdamW(ps, lr=1e-5)``,
            ``AdamW8bit``, Adafactor, ...). :attr:`optimizer` is those optimizers as one (for
            LR schedulers and checkpoints); your own optimizer steps
            :meth:`optimizer_parameters`.
        checkpoint: a safetensors file, sharded directory, index or diffusers component folder
            to fill ``model`` from as it attaches. Build the model on the meta device
            (``with torch.device("meta"): model = ...``): swapped tensors are read straight into
            their pinned masters (or left on disk, ``SwapConfig.host_budget``), the rest goes
            to ``device`` through pinned staging; the model never exists as a CPU copy.
            Tensors already materialized are overwritten by the checkpoint's values.
        prefix: with ``checkpoint``, the prefix checkpoint names carry (``"model."``).
        strict: with ``checkpoint``, refuse missing or unexpected keys (default ``True``).
        progress: with ``checkpoint``, show a progress bar (default: for loads of at least
            1 GiB on a terminal).
        load_in_background: with ``checkpoint`` and frozen swapped weights (the default
            ``trainable="resident"``), return once the resident tensors are on ``device`` and
            fill the swapped blocks' masters in the background, in execution order: the first
            forward pass runs while the file is read, each block waiting for its own bytes
            only, so the first step comes about when the read ends. Read errors surface where
            the block is next used (an :class:`~vramkit.errors.OffloadError`);
            :meth:`wait_loaded` waits for the whole load. ``False`` loads everything before
            returning (as trainable swapped weights always do).
        master_memory: where frozen blocks' masters live instead of this swapper's own pinned
            pool (a :class:`MasterMemory`); ``vramkit.distributed.shared_swapper`` passes
            memory shared by the local ranks of a node, so the node holds one copy. Its masters
            are filled before the constructor returns.
        checkpoint_skip: with ``checkpoint``, qualified names of submodules already filled
            another way (``vramkit.fit`` quantizes blocks while reading them): the file's keys
            under them are neither read nor required.
        block_loader: fills slots from the masters another way than one host->device copy per
            load (a :class:`BlockLoader`); ``vramkit.distributed.shared_swapper`` passes one
            where each GPU of a node copies its share of a block and the GPUs all-gather the
            rest over NVLink. Loads are then collectives: every process must make the same
            swapped calls (wrap the others in :meth:`local_calls`). Not with
            ``SwapConfig.host_budget`` (disk reads finish at different times on each process).

    Distributed training: attach the swapper first, then wrap the model in
    ``DistributedDataParallel`` (``vramkit.distributed.wrap_ddp`` also broadcasts the masters
    and reduces swapped trainable gradients). The swapped tensors are listed in the model's
    ``_ddp_params_and_buffers_to_ignore`` while attached, so DDP neither broadcasts nor reduces
    their placeholders. A model already wrapped by DDP or sharded by FSDP is refused.

    Everything that is not a swapped tensor (other modules, resident blocks, small tensors of
    swapped blocks) is moved to ``device``; :meth:`detach` puts every tensor back where it was,
    with its values, and removes the swapper's wrappers (tensors that were on the meta device
    and came from ``checkpoint`` go to the CPU).

    Example:
        >>> swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=8))  # doctest: +SKIP
        >>> loss = model(x).mean(); loss.backward()                            # doctest: +SKIP
        >>> swapper.detach()                                                   # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, blocks: str | Sequence[str] = "auto",
                 config: SwapConfig | None = None,
                 device: str | int | torch.device = "cuda", *,
                 optimizer: OptimizerFactory | None = None,
                 checkpoint: str | os.PathLike[str] | None = None, prefix: str | None = None,
                 strict: bool = True, progress: bool | None = None,
                 load_in_background: bool = True,
                 master_memory: MasterMemory | None = None,
                 block_loader: BlockLoader | None = None,
                 checkpoint_skip: Sequence[str] = ()) -> None:
        if config is None:
            config = SwapConfig()
        elif not isinstance(config, SwapConfig):
            raise ConfigError(f"config must be a SwapConfig, got {type(config).__name__}",
                              hint="Build one: SwapConfig(max_gpu_bytes='10GiB').")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be an nn.Module, got {type(model).__name__}",
                              hint="Pass the torch.nn.Module whose blocks should be swapped.")
        _refuse_wrapped(model)
        if config.trainable == "swap" and not callable(optimizer):
            raise ConfigError(
                "SwapConfig(trainable='swap') steps each swapped block with its own optimizer: "
                + ("pass optimizer=factory" if optimizer is None
                   else f"optimizer must be a callable, got {type(optimizer).__name__}"),
                hint="BlockSwapper(model, config=..., optimizer=lambda params: "
                     "torch.optim.AdamW(params, lr=1e-5)).")
        if config.trainable != "swap" and optimizer is not None:
            raise ConfigError(
                f"optimizer= is for SwapConfig(trainable='swap'); with "
                f"trainable={config.trainable!r} the swapper steps no optimizer",
                hint="Use trainable='swap' for full fine-tuning with the optimizer on the GPU, "
                     "or build your optimizer over swapper.optimizer_parameters().")
        self.model = model
        self.config = config
        self._factory = optimizer
        self.device = resolve_device(device, owner="BlockSwapper")
        self.streams = transfer_streams(self.device)
        self._attached = False
        found = find_blocks(model, blocks)
        specs = [BlockSpec(name, schedule_bytes(module, config)) for name, module in found]
        if config.swapped_blocks is not None:
            self.schedule = named_schedule(specs, config.swapped_blocks)
        else:
            self.schedule = choose_swapped(
                specs, max_gpu_blocks=config.max_gpu_blocks,
                max_gpu_bytes=config.max_gpu_bytes,  # type: ignore[arg-type]
                num_slots=config.num_slots)
        self._moved: list[tuple[torch.Tensor, torch.device]] = []
        self._state_hooks: list[RemovableHandle] = []  # state_dict through the host masters
        self._blocks: list[SwappedBlock] = []
        self._ring: SlotRing | None = None
        self._trainable_cache: dict[int, bool] = {}
        # Output hooks of the swapped call just made (node sequence number, hook): the next
        # call chains to them when its inputs come from one of those nodes (_call_in_graph).
        self._last_hooks: list[tuple[int, OutputHook]] = []
        self._anchor: torch.Tensor | None = None
        self._stepper: SwapStepper | None = None
        self._optimizer: SwappedOptimizer | None = None
        self._resident_block_bytes = 0
        self._unwatch: weakref.finalize | None = None
        self._source: CheckpointSource | None = None
        self._host = HostStore(config, self.device, self.streams, None, master_memory)
        if block_loader is not None and config.host_budget is not None:
            raise ConfigError(
                "block_loader= with SwapConfig.host_budget: blocks read from disk become ready "
                "at different times in each process, and a collective load needs the same "
                "order everywhere",
                hint="Drop host_budget (keep every swapped block in RAM), or load whole blocks "
                     "(shared_swapper(..., uploads='whole')).")
        self._loader = block_loader
        self._gradient_hook: GradientHook | None = None
        self._ddp_ignored: tuple[bool, Any] | None = None  # (had the attribute, its value)
        self._model_type = type(model)
        self._load_began = time.perf_counter()
        self._load_stats = (0, 0.0)
        self._source_lock = threading.Lock()
        check_bool("load_in_background", load_in_background)
        try:
            if checkpoint is not None:
                check_bool("strict", strict)
                check_bool("progress", progress, allow_none=True)
                skip = _module_names(model, checkpoint_skip)
                self._source = CheckpointSource(model, checkpoint, prefix=prefix, strict=strict,
                                                progress=progress, skip=skip)
                self._host.source = self._source
            elif (prefix is not None or strict is not True or progress is not None
                  or load_in_background is not True or checkpoint_skip):
                knob = ("prefix" if prefix is not None
                        else "strict" if strict is not True
                        else "progress" if progress is not None
                        else "checkpoint_skip" if checkpoint_skip else "load_in_background")
                raise ConfigError(f"{knob}= applies to checkpoint=",
                                  hint=f"Pass checkpoint=path with it, or drop {knob}.")
            self._attach(found, background=load_in_background)
        except BaseException:
            self._undo_attach()
            self._close_source()
            raise

    def _close_source(self) -> None:
        """The checkpoint is done with (the load ended, or failed): record its figures, close
        it (once). Runs on the fill's driver thread when the masters fill in the background."""
        with self._source_lock:
            source = self._source
            if source is None:
                return
            self._load_stats = (source.bytes_read, time.perf_counter() - self._load_began)
            self._source = self._host.source = None
        source.close()

    # -- the schedule and the swappable rule ------------------------------------------------

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
            blocks: an ``nn.ModuleList`` / ``nn.Sequential`` of blocks, or a sequence of
                :class:`BlockSpec`, ``(name, nbytes)`` pairs, modules (named ``"0"``, ``"1"``...)
                or names, in execution order.
            max_gpu_blocks: blocks that may stay resident (``None``: no count limit).
            max_gpu_bytes: GPU bytes for resident blocks plus ``num_slots`` slots of the
                largest swapped block (``None``: no byte limit).
            num_slots: R, the slots of the ring (counted in the byte limit).

        Returns:
            One :class:`BlockScheduleEntry` per block. With no limit at all every block is
            swapped.

        Raises:
            ConfigError: for limits out of range (checked as :class:`SwapConfig` checks them).
            OffloadError: when even swapping every block does not fit ``max_gpu_bytes``.
        """
        config = SwapConfig(max_gpu_blocks=max_gpu_blocks, max_gpu_bytes=max_gpu_bytes,
                            num_slots=num_slots)
        return choose_swapped(as_block_specs(blocks), max_gpu_blocks=config.max_gpu_blocks,
                              max_gpu_bytes=config.max_gpu_bytes,  # type: ignore[arg-type]
                              num_slots=config.num_slots)

    @staticmethod
    def footprint(module: nn.Module, config: SwapConfig | None = None) -> BlockFootprint:
        """The bytes a swapper with ``config`` would move and keep for one block.

        The rule every planner asks (never copied): tensors of at least ``min_param_bytes``,
        dense, frozen (or trainable with ``trainable="cpu"``) are packed at 512-byte aligned
        offsets into one flat master of ``swapped`` bytes, the size of the block's share of a
        GPU slot; the rest (``resident``) stays on the device. Works on the meta device.

        Args:
            module: a block (a module whose tensors would be swapped together).
            config: the swapper's settings (default :class:`SwapConfig()`).

        Returns:
            A :class:`BlockFootprint` ``(swapped, resident)``.
        """
        return block_footprint(module, config if config is not None else SwapConfig())

    @staticmethod
    def disk_split(sizes: Sequence[int], frozen: Sequence[bool],
                   host_budget: int | str | None) -> DiskSplit | None:
        """Which swapped blocks ``SwapConfig(host_budget=...)`` keeps on disk, from their sizes.

        The rule a swapper applies when it attaches, for planners (never copied): the fewest
        frozen blocks, spread evenly, stay on disk so that the other masters plus the pinned
        staging buffers fit the budget; the rest of the budget buys more staging buffers.

        Args:
            sizes: each swapped block's master bytes (:meth:`footprint`'s ``swapped``), in
                execution order.
            frozen: whether each block's swapped weights are frozen (only those go to disk).
            host_budget: the pinned host budget (bytes or a size string; ``None``: no limit).

        Returns:
            A :class:`~vramkit.offload._swap_host.DiskSplit` (indices on disk, staging buffers,
            pinned bytes), or ``None`` when every master fits.

        Raises:
            ConfigError: the budget is too small even with every frozen block on disk.
        """
        budget = check_size("host_budget", host_budget, allow_none=True)
        return split_for_host_budget(list(sizes), list(frozen), budget)

    # -- attaching --------------------------------------------------------------------------

    def _attach(self, found: list[tuple[str, nn.Module]], *, background: bool = False) -> None:
        shared = self._shared_tensor_ids(found)
        for entry in self.schedule:
            name, module = found[entry.index]
            if not entry.swapped:
                self._resident_block_bytes += module_bytes(module)
                continue
            entries: list[SwapEntry] = []
            for owner, attr, tensor, is_param in block_tensors(module):
                if id(tensor) in shared or not is_swappable(tensor, self.config,
                                                             is_param=is_param):
                    self._resident_block_bytes += tensor.numel() * tensor.element_size()
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                # A tensor built on meta comes back to the CPU at detach, with its values.
                home = torch.device("cpu") if tensor.is_meta else tensor.device
                entries.append(SwapEntry(owner, attr, is_param, tensor, 0, nbytes,
                                         tensor.shape, tuple(tensor.stride()), tensor.dtype,
                                         home, bool(tensor.requires_grad)))
            if not entries:
                continue  # nothing worth swapping: the block stays resident
            self._blocks.append(SwappedBlock(entry.index, name, module, entries,
                                             layout_entries(entries)))
        self._host.place(self._blocks)
        swapped_ids = {id(e.tensor) for b in self._blocks for e in b.entries}
        # Everything else goes to the device (placement recorded for detach); from the
        # checkpoint when one is given and holds it.
        source = self._source
        from_file: list[torch.Tensor] = []
        seen: set[int] = set()
        for owner in self.model.modules():
            for tensors in (owner._parameters, owner._buffers):
                for t in tensors.values():
                    if t is None or id(t) in swapped_ids or id(t) in seen:
                        continue
                    seen.add(id(t))
                    if source is not None and source.entry(t) is not None:
                        from_file.append(t)
                    elif t.is_meta:
                        continue  # a non-persistent buffer recomputed below, or an error
                    elif t.device != self.device:
                        self._moved.append((t, t.device))
                        t.data = t.data.to(self.device)
        # The masters start filling first, so the disk reads them beside the resident tensors
        # (the whole checkpoint is read at the disk's pace: the loader alone does not keep it
        # busy); in the background when asked, with few reads in flight until the resident
        # tensors are in place (the first forward needs them first). The checkpoint closes once
        # both are done with it.
        close = _Countdown(2 if source is not None else 1, self._close_source)
        self._host.start_fill(background=background and source is not None,
                              on_done=close.release)
        try:
            if source is not None:
                homes = {id(t): t.device for t in from_file}
                for t, was_meta in source.load_to_device(from_file, self.device):
                    self._moved.append((t, torch.device("cpu") if was_meta
                                        else homes.get(id(t), t.device)))
                # peft adapters the file lacks, created on the device: to the CPU at detach
                self._moved += [(t, torch.device("cpu")) for t in source.finish(self.device)]
        finally:
            self._host.resident_loaded()
            if source is not None:
                close.release()
        self._host.finish_fill()
        if self._loader is not None:  # collective: the processes must swap the same blocks
            self._loader.prepare([b.name for b in self._blocks], [b.nbytes for b in self._blocks])
        self._ring = SlotRing(self._blocks, self.device, self.streams,
                              num_slots=self.config.num_slots, lookahead=self.config.lookahead,
                              preserve_rng_state=self.config.preserve_rng_state,
                              on_backward_turn=self._forget_chain, loader=self._loader)
        self._ring.disk = self._host.disk
        if self.config.trainable == "swap":
            assert self._factory is not None  # checked in __init__
            self._stepper = SwapStepper(
                [b for b in self._blocks if b.trainable_entries], self._factory, self.device,
                self.streams, self._host.pool, accumulation_steps=self.config.accumulation_steps,
                max_grad_norm=self.config.max_grad_norm, counters=self._ring.counters,
                state_slots=self.config.num_slots)
            self._ring.stepper = self._stepper
            self._optimizer = SwappedOptimizer(self._stepper, self._run_pending_steps)
        for block in self._blocks:
            self._wrap_forward(block)
            self._state_hooks += install_swap_hooks(
                block, functools.partial(self._sync_masters, block),
                reader=(self._host.disk.read_tensor if block.on_disk and self._host.disk
                        else None))
        self._ignore_in_ddp()
        watch_structure(True)
        # Released by detach(), or when the swapper is collected without one.
        self._unwatch = weakref.finalize(self, watch_structure, False)
        self._attached = True
        if not self._blocks:
            warnings.warn(self._nothing_swapped_reason(found), VramkitWarning, stacklevel=3)
        logger.info("BlockSwapper: %d of %d blocks swapped (%s pinned, %d slots of %s)",
                    len(self._blocks), len(self.schedule),
                    format_size(sum(b.nbytes for b in self._blocks)), len(self._ring.slots),
                    format_size(self._ring.slot_bytes))

    def _ignore_in_ddp(self) -> None:
        """List the swapped tensors in ``model._ddp_params_and_buffers_to_ignore`` (DDP's own
        way to leave tensors out): their placeholders must not be broadcast (they alias one
        element) nor reduced (vramkit.distributed reduces swapped trainable gradients)."""
        swapped = {id(e.tensor) for b in self._blocks for e in b.entries}
        if not swapped:
            return
        names = [n for n, t in (*self.model.named_parameters(remove_duplicate=False),
                                *self.model.named_buffers(remove_duplicate=False))
                 if id(t) in swapped]
        had = hasattr(self.model, "_ddp_params_and_buffers_to_ignore")
        before = getattr(self.model, "_ddp_params_and_buffers_to_ignore", None)
        self._ddp_ignored = (had, before)
        merged = list(before or []) + [n for n in names if n not in set(before or [])]
        self.model._ddp_params_and_buffers_to_ignore = merged  # type: ignore[assignment]

    def _restore_ddp_ignored(self) -> None:
        if self._ddp_ignored is None:
            return
        had, before = self._ddp_ignored
        self._ddp_ignored = None
        if had:
            self.model._ddp_params_and_buffers_to_ignore = before  # type: ignore[assignment]
        elif hasattr(self.model, "_ddp_params_and_buffers_to_ignore"):
            del self.model._ddp_params_and_buffers_to_ignore

    def _nothing_swapped_reason(self, found: list[tuple[str, nn.Module]]) -> str:
        """Why an attached swapper swaps no block, in words a user can act on."""
        config = self.config
        chosen = [found[e.index] for e in self.schedule if e.swapped]
        prefix = f"BlockSwapper swaps none of the {len(found)} blocks it found: "
        if not chosen:
            if config.swapped_blocks is not None:
                return prefix + "SwapConfig.swapped_blocks is empty."
            limit = (f"max_gpu_bytes={format_size(config.max_gpu_bytes)}"  # type: ignore[arg-type]
                     if config.max_gpu_bytes is not None
                     else f"max_gpu_blocks={config.max_gpu_blocks}")
            return (prefix + f"{limit} holds every block "
                    f"({format_size(sum(e.nbytes for e in self.schedule))}), so the model runs "
                    "resident. Lower the limit if the GPU cannot hold it.")
        tensors = [(t, is_param) for _, module in chosen
                   for _, _, t, is_param in block_tensors(module)]
        largest = max((t.numel() * t.element_size() for t, _ in tensors), default=0)
        if largest < max(1, config.min_param_bytes):
            return (prefix + f"every tensor of the {len(chosen)} blocks the schedule chose is "
                    f"below min_param_bytes={format_size(config.min_param_bytes)} (the largest "
                    f"is {format_size(largest)}). Lower SwapConfig.min_param_bytes to swap "
                    "small blocks.")
        big = [t for t, _ in tensors
               if t.numel() * t.element_size() >= max(1, config.min_param_bytes)]
        if config.trainable == "resident" and all(t.requires_grad for t in big):
            return (prefix + "the large tensors of the blocks it chose are trainable and "
                    "trainable='resident' keeps them on the GPU. Freeze the base weights "
                    "(LoRA), or use SwapConfig(trainable='swap') (optimizer on the GPU) or "
                    "trainable='cpu' for full fine-tuning.")
        return (prefix + "the tensors of the blocks it chose are shared with other blocks, "
                "buffers with swap_buffers=False, or not dense, so they stay resident.")

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

    def _sync_masters(self, block: SwappedBlock | None = None) -> None:
        """Before ``block``'s master (every master: ``None``) is read or written on the host:
        a background fill and pending write-backs land first."""
        self._host.wait(block)
        if self._stepper is not None:
            self._stepper.synchronize()

    def _anchor_tensor(self) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        return self._anchor

    def _wrap_forward(self, block: SwappedBlock) -> None:
        module = block.module
        # The swapper recomputes checkpointed blocks itself: it runs the forward beneath
        # vramkit's checkpoint wrapper, and the mark decides when the config does not.
        fn = unwrapped_forward(module)
        checkpointed = is_checkpointed(module)
        block.checkpointed = (checkpointed if self.config.checkpointing is None
                              else self.config.checkpointing)
        # The method the block was checkpointed with (lean when the config alone asks).
        block.lean = (LeanState() if block.checkpointed and checkpoint_method(module) == "lean"
                      else None)
        block.wrapper = _patch.install(module, _SwappedForward(self, block, fn))
        block.module_type = type(module)

    def _forget_chain(self) -> None:
        self._last_hooks = []

    # -- the hot path -----------------------------------------------------------------------

    def _call_block(self, block: SwappedBlock, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if not self._attached:
            raise OffloadError(f"swapped block {block.name} called after detach()",
                               hint="Call the model, not a forward kept from before detach().")
        ring: SlotRing = self._ring  # type: ignore[assignment]  # set before _attached
        if type(block.module) is not block.module_type or type(self.model) is not self._model_type:
            _refuse_wrapped(self.model, attached=True)
            block.module_type, self._model_type = type(block.module), type(self.model)
        if ring.observe(block):
            self._trainable_cache.clear()
        chain = self._last_hooks
        if chain:
            self._last_hooks = []  # only the immediately preceding call chains
        if not torch.is_grad_enabled():
            ring.begin_no_grad()  # a collective loader copies plainly (maybe one rank alone)
            ring.training_pass = False
            stream = ring.acquire(block, backward=False)
            try:
                return fn(*args, **kwargs)
            finally:
                ring.release(block, backward=False, stream=stream)
        ring.end_no_grad()
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
            ring.training_pass = False
            stream = ring.acquire(block, backward=False)
            try:
                # Grad mode with nothing to differentiate: anything autograd still saves from
                # the slot (a requires-grad tensor hidden from pytree) must fail loudly.
                with ring.weight_hooks(block, forbid=True):
                    return fn(*args, **kwargs)
            finally:
                ring.release(block, backward=False, stream=stream)
        ring.training_pass = True
        if not block.trainable_entries:
            return self._call_in_graph(ring, block, fn, leaves, spec, positions, chain)
        if spec is None:
            spec = _tree.flatten((args, kwargs))[1]
        call = BlockCall(ring, block, fn, leaves, spec, block.checkpointed)
        if self._stepper is not None:
            self._stepper.forward_call(block, call)  # steps after the last call's backward
        tensors = [x for x, t in zip(leaves, call.is_tensor, strict=True) if t]
        anchor = self._anchor_tensor() if self._has_trainable(block) else None
        outs = SwapBlockFunction.apply(call, anchor, *tensors)
        return call.rebuild_outputs(list(outs))

    def _call_in_graph(self, ring: SlotRing, block: SwappedBlock, fn: Callable[..., Any],
                       leaves: list[Any], spec: Any, positions: list[int],
                       chain: list[tuple[int, OutputHook]]) -> Any:
        """A training call whose nodes join the outer graph (see ``_swap_graph``): pre-hooks on
        the output nodes and an identity Function on the inputs hold the slot across the block's
        backward. ``spec`` is ``None`` when ``leaves`` are the positional arguments themselves;
        ``positions`` index the leaves that require grad; ``chain`` holds the output hooks of
        the swapped call made just before."""
        call = BlockBackward(ring, block)
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
        stream = ring.acquire(block, backward=False)
        try:
            if block.checkpointed:
                # Keeps the inputs and recomputes in backward after the output hooks
                # re-acquired the slot. Lean: the forward saves nothing but the inputs (no slot
                # weight), and the recomputation's graph lives inside its backward, while the
                # slot is held. PyTorch's: every tensor saved inside goes through the
                # checkpoint's own (innermost) hooks. Either way the swapper's hooks are not
                # needed here.
                out = run_checkpointed(fn, args, kwargs, self.config.preserve_rng_state,
                                       module=block.module, lean=block.lean)
            else:
                with ring.weight_hooks(block):
                    out = fn(*args, **kwargs)
        finally:
            ring.release(block, backward=False, stream=stream)
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
        (PyTorch's global registration hooks count those, ``_swap_structure``) or a child
        or parameter count of the block's modules changed (writes that bypass those hooks,
        such as ``ModuleList.insert``; replacing an entry of ``_modules`` in place is not
        seen)."""
        cached = self._trainable_cache.get(id(block))
        if cached is None:
            epoch = structure_epoch()
            # Registrations anywhere bump the epoch; writes that skip PyTorch's registration
            # hooks (ModuleList.insert, del) still change a child or parameter count.
            if block.params_epoch != epoch or block.shape_key != shape_key(block.submodules):
                block.submodules = list(block.module.modules())
                block.params = list(block.module.parameters())
                block.params_epoch = epoch
                block.shape_key = shape_key(block.submodules)
            cached = any(p.requires_grad for p in block.params)
            self._trainable_cache[id(block)] = cached
        return cached

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

    @property
    def optimizer(self) -> SwappedOptimizer:
        """The swapped blocks' optimizers as one ``torch.optim.Optimizer``
        (``trainable="swap"``): build LR schedulers over it, save and load its
        ``state_dict()``, call its ``step()`` after your own optimizer's (it runs the deferred
        steps when clipping; otherwise the blocks already stepped inside backward).

        Raises:
            ConfigError: without ``trainable="swap"``.
        """
        if self._optimizer is None:
            raise ConfigError(
                f"swapper.optimizer exists with SwapConfig(trainable='swap'); this swapper has "
                f"trainable={self.config.trainable!r}",
                hint="Build your optimizer over swapper.optimizer_parameters() instead.")
        return self._optimizer

    def clip_grad_norm_(self, max_norm: float | None = None) -> torch.Tensor:
        """Clip every trainable gradient by the global L2 norm, as
        ``torch.nn.utils.clip_grad_norm_`` would over the whole model (``trainable="swap"``
        with ``SwapConfig(max_grad_norm=...)``).

        The resident trainable parameters' gradients (:meth:`optimizer_parameters`) are scaled
        now; the swapped blocks' gradients, parked in pinned memory at the end of backward,
        are scaled when ``swapper.optimizer.step()`` runs their deferred steps.

        Args:
            max_norm: the limit (default ``SwapConfig.max_grad_norm``).

        Returns:
            The total norm before clipping (a 0-dim device tensor; reading it syncs).

        Raises:
            ConfigError: without ``max_grad_norm`` in the config, or for a bad ``max_norm``.
            OffloadError: in the middle of an accumulation window.
        """
        if self._stepper is None:
            raise ConfigError(
                "swapper.clip_grad_norm_() is for SwapConfig(trainable='swap', "
                "max_grad_norm=...)",
                hint="With other modes use torch.nn.utils.clip_grad_norm_ over "
                     "swapper.optimizer_parameters().")
        if not self._attached:
            raise OffloadError("this BlockSwapper is detached",
                               hint="Clip before swapper.detach().")
        # The model's order, so norms add up as torch's clip_grad_norm_ adds them.
        return self._stepper.clip_grad_norm_(self.optimizer_parameters(), max_norm,
                                             self.model.parameters())

    def _run_pending_steps(self) -> None:
        """The deferred steps (clipping): blocks in backward order, each acquired (weights),
        its state and parked gradients loaded, stepped and written back; the ring prefetches
        the next ones meanwhile."""
        stepper, ring = self._stepper, self._ring
        if stepper is None or ring is None:
            return
        pending = {id(bo.block): bo for bo in stepper.pending()}
        if not pending:
            return
        if not self._attached:
            raise OffloadError("this BlockSwapper is detached",
                               hint="Step before swapper.detach().")
        for block in reversed(ring.order):
            bo = pending.get(id(block))
            if bo is None:
                continue
            ring.acquire(block, backward=True)
            try:
                stepper.step_pending_block(bo)
            finally:
                ring.release(block, backward=True)
        stepper.finish_pending()

    def set_gradient_hook(self, hook: GradientHook | None) -> None:
        """Call ``hook(block_name, grads)`` on each swapped block's trainable gradients.

        ``grads`` are the block's gradients on the device (``trainable="cpu"`` or ``"swap"``),
        complete for the step: after the block's last backward of the step and, with
        ``accumulation_steps``, of the window; before they go to the host or the block's
        optimizer steps (and before clipping's norms). The hook may change them in place: a
        data-parallel job averages them over its ranks here
        (``vramkit.distributed.wrap_ddp`` installs such a hook). ``None`` removes it.

        A hook that starts asynchronous work (an all-reduce with ``async_op=True``) returns a
        ``finish()`` instead of waiting: the swapper calls it on the stream that reads the
        gradients, just before reading them -- with ``trainable="cpu"`` the device->host copy
        stream, so the next blocks' backward runs while the reduction is in flight; with
        ``"swap"`` at once, since the block's optimizer steps next.

        In a job of several processes (``torch.distributed`` initialized, world size > 1) a
        swapper with swapped trainable weights refuses to back-propagate without a hook, since
        DDP does not see those weights and the ranks would drift apart silently; pass a hook
        that does nothing to train them per rank on purpose.

        Raises:
            ConfigError: ``hook`` is not callable.
        """
        if hook is not None and not callable(hook):
            raise ConfigError(f"hook must be callable or None, got {type(hook).__name__}",
                              hint="Pass a function hook(block_name, grads).")
        self._gradient_hook = hook
        if self._ring is not None:
            self._ring.gradient_hook = hook
        if self._stepper is not None:
            self._stepper.gradient_hook = hook

    @contextlib.contextmanager
    def local_calls(self) -> Iterator[None]:
        """Calls of the model that this process makes alone, under a collective
        :class:`BlockLoader` (``shared_swapper``'s sharded uploads). Inside, blocks load with
        plain copies; on the way out the slots get back the blocks they held, so the processes'
        next loads match again. Calls under ``torch.no_grad()`` get this by themselves (until
        the next call with gradients); this is for calls with gradients that not every rank
        makes. Without a loader it does nothing. Enter it between calls of the model.

        Example:
            >>> if rank == 0:                                        # doctest: +SKIP
            ...     with swapper.local_calls():
            ...         probe = model(sample).mean()  # with gradients, on rank 0 only
        """
        if self._ring is None:
            yield
            return
        with self._ring.local_calls():
            yield

    def masters_changed(self) -> None:
        """Say that the host masters were rewritten where PyTorch's version counters do not see
        it (a ``torch.distributed`` broadcast into them, a write from C++ or another process):
        slots copied from them are reloaded at their next use. Waits until no copy reads the
        masters. ``vramkit.distributed.broadcast_masters`` calls it."""
        self._sync_masters()
        if self._ring is not None:
            self._ring.forget_loaded()

    def sync_gradients(self) -> None:
        """Wait (on the host) until every offloaded gradient has arrived and no copy still reads
        the masters: call it once per optimizer step, before stepping the host parameters."""
        if self._ring is not None:
            self._ring.sync_gradients()

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
        ring = self._ring
        c = ring.counters if ring is not None else dict.fromkeys(RING_COUNTERS, 0)
        host = self._host.stats()
        stepper = self._stepper
        state_bytes = stepper.state_bytes() if stepper is not None else 0
        order = ring.order if ring is not None else []
        return SwapStats(
            blocks=len(self.schedule), swapped_blocks=len(self._blocks),
            swapped_bytes=sum(e.nbytes for b in self._blocks for e in b.entries),
            pinned_bytes=host.pop("pinned") + state_bytes,
            slot_bytes=ring.slot_bytes * len(ring.slots) if ring is not None else 0,
            resident_block_bytes=self._resident_block_bytes,
            loads=c["loads"], prefetched=c["prefetched"], on_demand=c["on_demand"],
            hits=c["hits"], h2d_bytes=c["h2d_bytes"], d2h_bytes=c["d2h_bytes"],
            acquisitions=c["acquisitions"], gathered_bytes=c["gathered_bytes"],
            state_prefetched=c["state_prefetched"],
            enqueue_seconds=ring.enqueue_seconds if ring is not None else 0.0,
            order_pattern=analyze_access_pattern([self._blocks.index(b) for b in order]),
            optimizer_steps=stepper.steps if stepper is not None else 0,
            state_bytes=state_bytes,
            state_slot_bytes=stepper.state_slot_bytes() if stepper is not None else 0,
            **host, **self._load_figures())

    def _load_figures(self) -> dict[str, Any]:
        source = self._source  # still open: the masters are filling in the background
        if source is None:
            return {"checkpoint_bytes": self._load_stats[0],
                    "load_seconds": self._load_stats[1], "loading": False}
        return {"checkpoint_bytes": source.bytes_read,
                "load_seconds": time.perf_counter() - self._load_began, "loading": True}

    def reset_stats(self) -> None:
        """Zero the transfer counters (sizes are kept)."""
        if self._ring is not None:
            self._ring.reset_counters()

    def detach(self) -> None:
        """Put the model back as it was: every tensor on its original device with its current
        values (trained weights included), the same ``Parameter`` objects, forwards unwrapped.
        Frees the pinned masters and GPU slots. Waits for outstanding copies (a host sync)."""
        if not self._attached:
            raise OffloadError("this BlockSwapper is already detached",
                               hint="Each swapper is detached once; create a new one to swap "
                                    "the model again.")
        self._attached = False
        self._undo_attach(detaching=True)

    def wait_loaded(self) -> None:
        """Wait until every swapped block loaded from ``checkpoint=`` is in its master (the
        load continues in the background after the constructor; see ``load_in_background``).

        Raises:
            OffloadError: reading the checkpoint failed.
        """
        self._host.wait()

    def _undo_attach(self, *, detaching: bool = False) -> None:
        """Undo what attaching did: every swapped tensor gets its master's value (a failed
        attach stops a fill still running first; the model's own tensors go back where the
        masters were not filled, meta tensors stay on meta)."""
        failed: OffloadError | None = None
        if not detaching:
            self._host.stop_fill()
        if self._unwatch is not None:
            self._unwatch()  # runs watch_structure(False) once
            self._unwatch = None
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.current_stream(self.device).synchronize()
            torch.cuda.synchronize(self.device)
        if self._stepper is not None:
            self._stepper.close()  # block optimizers keep their state, on the model's devices
            self._stepper = None
        for handle in self._state_hooks:
            handle.remove()
        self._state_hooks = []
        for block in self._blocks:
            if block.wrapper is not None:
                _patch.restore(block.module, block.wrapper)
                block.wrapper = None
            block.lean = None  # its structure watch goes with it
            views, error = self._host.restored_views(block)
            if error is not None and detaching:
                failed = failed or error
            # (no views: the attach failed before this block's tensors were replaced)
            for e, view in zip(block.entries, views, strict=False):
                e.host_param = None
                if view is None:  # built on meta and never read (a failed load): meta again
                    self._back_to_meta(e)
                    continue
                restored = torch.empty_strided(e.shape, e.stride, dtype=e.dtype,
                                               device=e.original_device)
                restored.copy_(view)
                e.tensor.data = restored
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
        self._restore_ddp_ignored()
        if self._ring is not None:
            self._ring.disk = None  # the host store stops the reader
            self._ring.close()
        self._host.close()
        self._blocks = []
        self._anchor = None
        self._last_hooks = []
        if failed is not None:
            raise OffloadError(
                f"detached, but the swapped blocks whose load failed are left on the meta "
                f"device: {failed}", hint="Load the model again once the checkpoint reads "
                "cleanly.") from failed

    @property
    def block_loader(self) -> BlockLoader | None:
        """How slots are filled when not by one host->device copy (``block_loader=``)."""
        return self._loader

    @property
    def master_memory(self) -> MasterMemory | None:
        """The shared memory the frozen masters live in (``None``: this swapper's own pool, or
        the shared memory could not be had)."""
        return self._host.shared if self._host.shared_masters else None

    def is_shared(self, block: SwappedBlock) -> bool:
        """Whether ``block``'s master lives in :attr:`master_memory` (one copy per node)."""
        return id(block) in self._host.shared_masters

    @staticmethod
    def _back_to_meta(e: SwapEntry) -> None:
        # A meta tensor cannot take another device's data, nor the reverse: a new object.
        meta = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device="meta")
        tensor = (nn.Parameter(meta, requires_grad=e.tensor.requires_grad) if e.is_param
                  else meta)
        (e.owner._parameters if e.is_param else e.owner._buffers)[e.attr] = tensor
        e.tensor = tensor

    def __enter__(self) -> BlockSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._attached:
            self.detach()

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        slots = len(self._ring.slots) if self._ring is not None else 0
        slot_bytes = self._ring.slot_bytes if self._ring is not None else 0
        return (f"BlockSwapper({len(self._blocks)}/{len(self.schedule)} blocks swapped, "
                f"{slots} slots of {format_size(slot_bytes)}, "
                f"device={self.device}, {state})")



class _Countdown:
    """Calls ``action`` once, on the ``count``-th :meth:`release` (from any thread)."""

    def __init__(self, count: int, action: Callable[[], None]) -> None:
        self._count = count
        self._action = action
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._action()


def _refuse_wrapped(model: nn.Module, *, attached: bool = False) -> None:
    """Refuse a model wrapped by DDP or sharded by FSDP (``attached``: it happened after the
    swapper attached, seen at the next call of a swapped block)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ConfigError(
            "BlockSwapper cannot attach to a DistributedDataParallel wrapper: DDP has already "
            "registered the weights it would swap (and broadcast them)",
            hint="Attach to the plain model first, then wrap it: swapper = BlockSwapper(model, "
                 "...); ddp = vramkit.distributed.wrap_ddp(model, swapper).")
    sharded = [name or "the model" for name, m in model.named_modules() if _is_fsdp(m)]
    if sharded:
        when = ("was sharded by FSDP after the swapper attached" if attached
                else "is sharded by FSDP")
        raise ConfigError(
            f"{sharded[0]} {when}: FSDP and BlockSwapper both own the storage of the same "
            "parameters (FSDP shards and all-gathers them, the swapper streams them from host "
            "masters), so they cannot manage one module",
            hint="Use BlockSwapper with DistributedDataParallel (vramkit.distributed.wrap_ddp), "
                 "or FSDP with its own CPUOffloadPolicy, not both on the same module "
                 "(docs/distributed.md has the compatibility matrix).")


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is managed by FSDP (FSDP2's ``fully_shard`` or FSDP1's wrapper), by
    its classes' names and modules: FSDP itself is never imported to ask."""
    for cls in type(module).__mro__:
        if cls.__name__ in ("FSDPModule", "FullyShardedDataParallel") and cls.__module__.startswith(
                "torch.distributed"):
            return True
    return False


def _module_names(model: nn.Module, names: Sequence[str]) -> list[str]:
    """``names`` checked to be submodules of ``model`` (``checkpoint_skip``)."""
    if isinstance(names, str):
        names = [names]
    known = dict(model.named_modules())
    unknown = [n for n in names if not isinstance(n, str) or n not in known or not n]
    if unknown:
        raise ConfigError(f"checkpoint_skip names modules the model does not have: {unknown[:5]}",
                          hint="Pass qualified names from model.named_modules(), such as "
                               "'transformer_blocks.3'.")
    return list(names)
