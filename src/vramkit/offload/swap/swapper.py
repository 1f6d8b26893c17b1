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
  are frozen join the outer autograd graph (:mod:`vramkit.offload.swap.graph`): a pre-hook on
  each output node re-acquires the slot before the block's backward (and its recomputation when
  checkpointed), and the slot is released once the block's input gradients are done -- by an
  identity Function on the inputs, or, for a block fed by the previous swapped block's output,
  by that block's hook. Blocks with swapped trainable weights run through
  :class:`vramkit.offload.swap.function.SwapBlockFunction`, which re-acquires, recomputes when
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
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vramkit._validate import check_bool, check_size
from vramkit.devices.host import HostMemoryChoice
from vramkit.devices.resolve import resolve_device
from vramkit.errors import ConfigError, OffloadError, VramkitWarning
from vramkit.memory.transfer import transfer_streams
from vramkit.offload import _patch
from vramkit.offload._lean_checkpoint import LeanState
from vramkit.offload._structure import watch_structure
from vramkit.offload.blocks import (
    BlockScheduleEntry,
    BlockSpec,
    as_block_specs,
    choose_swapped,
    find_blocks,
    named_schedule,
)
from vramkit.offload.checkpointing import checkpoint_method, is_checkpointed, unwrapped_forward
from vramkit.offload.swap.attach import (
    Countdown,
    DDPIgnored,
    collect_swapped,
    guard_conversions,
    ignore_in_ddp,
    module_names,
    move_to_device,
    nothing_swapped_reason,
    refuse_held,
    refuse_wrapped,
    release_guards,
    restore_ddp_ignored,
    restore_entry,
    restore_moved,
)
from vramkit.offload.swap.calls import BlockCalls
from vramkit.offload.swap.config import GradientHook, SwapConfig, SwapStats
from vramkit.offload.swap.host import (
    DiskSplit,
    HostStore,
    MasterMemory,
    parks_grads,
    split_for_host_budget,
)
from vramkit.offload.swap.optimizer import SwappedOptimizer, run_pending_steps
from vramkit.offload.swap.records import (
    BlockFootprint,
    SwappedBlock,
    block_footprint,
    schedule_bytes,
)
from vramkit.offload.swap.ring import BlockLoader, SlotRing
from vramkit.offload.swap.source import CheckpointSource
from vramkit.offload.swap.staged import resolve_host_memory
from vramkit.offload.swap.state_dict import install_swap_hooks
from vramkit.offload.swap.stats import swap_stats
from vramkit.offload.swap.stepper import OptimizerFactory, SwapStepper
from vramkit.units import format_size

__all__ = ["BlockSwapper"]

logger = logging.getLogger(__name__)



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
        refuse_wrapped(model)
        refuse_held(model)
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
        self._guards: list[Any] = []  # .to(dtype) / device moves refused while attached
        self._state_hooks: list[RemovableHandle] = []  # state_dict through the host masters
        self._blocks: list[SwappedBlock] = []
        self._ring: SlotRing | None = None
        self._calls: BlockCalls | None = None  # the per-call path, once the ring exists
        self._stepper: SwapStepper | None = None
        self._optimizer: SwappedOptimizer | None = None
        self._resident_block_bytes = 0
        self._unwatch: weakref.finalize | None = None
        self._source: CheckpointSource | None = None
        self._host = HostStore(
            self.device, self.streams, None, master_memory,
            host_params=config.trainable == "cpu",
            park_grads=parks_grads(config.trainable, config.accumulation_steps,
                                   config.max_grad_norm),
            host_budget=config.host_budget,  # type: ignore[arg-type]  # normalized to int
            disk_cache_dir=config.disk_cache_dir, compress=config.compress,
            compressed_blocks=config.compressed_blocks)
        if block_loader is not None and config.host_budget is not None:
            raise ConfigError(
                "block_loader= with SwapConfig.host_budget: blocks read from disk become ready "
                "at different times in each process, and a collective load needs the same "
                "order everywhere",
                hint="Drop host_budget (keep every swapped block in RAM), or load whole blocks "
                     "(shared_swapper(..., uploads='whole')).")
        if master_memory is not None and config.compress == "on":
            raise ConfigError(
                "SwapConfig(compress='on') with master_memory=: masters in node-shared memory "
                "are written once per node and stay raw; compressed masters are per process",
                hint="Use compress='off' (or 'auto') with shared masters, or give each process "
                     "its own masters (no master_memory; sharded uploads then gather the "
                     "compressed payloads).")
        self._loader = block_loader
        # compressed masters with a collective loader: encoded before attach returns, alike in
        # every process (the loads gather compressed payloads: docs/architecture.md)
        self._host.collective = block_loader is not None
        self._host_memory = HostMemoryChoice("pinned", "nothing was swapped yet")
        self._gradient_hook: GradientHook | None = None
        self._ddp_ignored: DDPIgnored | None = None
        self._model_type = type(model)
        self._load_began = time.perf_counter()
        self._load_stats = (0, 0.0)
        self._source_lock = threading.Lock()
        check_bool("load_in_background", load_in_background)
        try:
            if checkpoint is not None:
                check_bool("strict", strict)
                check_bool("progress", progress, allow_none=True)
                skip = module_names(model, checkpoint_skip)
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
            A :class:`~vramkit.offload.swap.host.DiskSplit` (indices on disk, staging buffers,
            pinned bytes), or ``None`` when every master fits.

        Raises:
            ConfigError: the budget is too small even with every frozen block on disk.
        """
        budget = check_size("host_budget", host_budget, allow_none=True)
        return split_for_host_budget(list(sizes), list(frozen), budget)

    # -- attaching --------------------------------------------------------------------------

    def _attach(self, found: list[tuple[str, nn.Module]], *, background: bool = False) -> None:
        if self.config.compressed_blocks is not None:  # before anything is moved
            unknown = sorted(set(self.config.compressed_blocks) - {name for name, _ in found})
            if unknown:
                raise ConfigError(
                    f"SwapConfig.compressed_blocks names modules that are not blocks of this "
                    f"swapper: {unknown[:4]}",
                    hint="Name blocks as find_blocks(model) does (a plan's swapped blocks).")
        self._blocks, self._resident_block_bytes = collect_swapped(
            self.model, found, self.schedule, self.config)
        self._host_memory = resolve_host_memory(self.config, self.device, self._blocks,
                                                shared=self._host.shared is not None,
                                                loader=self._loader is not None)
        if self._host_memory.mode == "pageable":
            self._host.staging = (self.config.staging_pool,  # type: ignore[assignment]
                                  self.config.num_slots + 1)
        self._host.place(self._blocks)
        swapped_ids = {id(e.tensor) for b in self._blocks for e in b.entries}
        # Everything else goes to the device (placement recorded for detach); from the
        # checkpoint when one is given and holds it.
        source = self._source
        self._moved, from_file = move_to_device(self.model, swapped_ids, source, self.device)
        # The masters start filling first, so the disk reads them beside the resident tensors
        # (the whole checkpoint is read at the disk's pace: the loader alone does not keep it
        # busy); in the background when asked, with few reads in flight until the resident
        # tensors are in place (the first forward needs them first). The checkpoint closes once
        # both are done with it.
        close = Countdown(2 if source is not None else 1, self._close_source)
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
            # ... and load the same bytes: a compressed block's payload (equal where the
            # weights are: the encoder is deterministic)
            packed = self._host.packed
            self._loader.prepare([b.name for b in self._blocks], [
                packed.packed[id(b)].compressed_nbytes if packed is not None and packed.holds(b)
                else b.nbytes for b in self._blocks])
        self._ring = SlotRing(self._blocks, self.device, self.streams,
                              num_slots=self.config.num_slots, lookahead=self.config.lookahead,
                              preserve_rng_state=self.config.preserve_rng_state,
                              loader=self._loader)
        self._ring.disk = self._host.disk
        self._ring.packed = self._host.packed
        self._ring.staged = self._host.staged
        if self.config.trainable == "swap":
            assert self._factory is not None  # checked in __init__
            self._stepper = SwapStepper(
                [b for b in self._blocks if b.trainable_entries], self._factory, self.device,
                self.streams, self._host.pool, accumulation_steps=self.config.accumulation_steps,
                max_grad_norm=self.config.max_grad_norm, counters=self._ring.counters,
                state_slots=self.config.num_slots)
            self._ring.stepper = self._stepper
            self._optimizer = SwappedOptimizer(self._stepper, self._run_pending_steps)
        self._calls = BlockCalls(self._ring, self.device, stepper=self._stepper,
                                 preserve_rng_state=self.config.preserve_rng_state)
        self._ring.on_backward_turn = self._calls.forget_chain
        for block in self._blocks:
            self._wrap_forward(block)
            self._state_hooks += install_swap_hooks(
                block, functools.partial(self._sync_masters, block),
                reader=functools.partial(self._reader, block))
        self._ddp_ignored = ignore_in_ddp(self.model, self._blocks)
        self._guards = guard_conversions(self.model, self._blocks, self.device)
        watch_structure(True)
        # Released by detach(), or when the swapper is collected without one.
        self._unwatch = weakref.finalize(self, watch_structure, False)
        self._attached = True
        if not self._blocks:
            warnings.warn(nothing_swapped_reason(self.config, self.schedule, found), VramkitWarning,
                          stacklevel=3)
        logger.info("BlockSwapper: %d of %d blocks swapped (%s pinned, %d slots of %s)",
                    len(self._blocks), len(self.schedule),
                    format_size(sum(b.nbytes for b in self._blocks)), len(self._ring.slots),
                    format_size(self._ring.slot_bytes))

    def _reader(self, block: SwappedBlock) -> Any:
        """How ``state_dict`` reads a block without a master: from disk, or decoded (``None``:
        it has a master). A block compressed in the background is encoded first."""
        host = self._host
        if host.packed is not None:
            host.packed.wait_encoded(block)  # (its encode failed: raised here)
            if host.packed.holds(block):  # in RAM or on disk
                return host.packed.read
        if block.on_disk and host.disk is not None:
            return host.disk.read_tensor
        return None

    def _sync_masters(self, block: SwappedBlock | None = None) -> None:
        """Before ``block``'s master (every master: ``None``) is read or written on the host:
        a background fill and pending write-backs land first."""
        self._host.wait(block)
        if self._host.staged is not None:  # its worker may be reading the masters
            self._host.staged.drain()
        if self._stepper is not None:
            self._stepper.synchronize()

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

    # -- the hot path -----------------------------------------------------------------------

    def _call_block(self, block: SwappedBlock, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if not self._attached:
            raise OffloadError(f"swapped block {block.name} called after detach()",
                               hint="Call the model, not a forward kept from before detach().")
        if type(block.module) is not block.module_type or type(self.model) is not self._model_type:
            refuse_wrapped(self.model, attached=True)
            block.module_type, self._model_type = type(block.module), type(self.model)
        return self._calls.run(block, fn, args, kwargs)  # type: ignore[union-attr]  # attached

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
        """The deferred steps (clipping), once the swapper knows it may run them:
        :func:`~vramkit.offload.swap.optimizer.run_pending_steps`."""
        stepper, ring = self._stepper, self._ring
        if stepper is None or ring is None or not stepper.pending():
            return
        if not self._attached:
            raise OffloadError("this BlockSwapper is detached",
                               hint="Step before swapper.detach().")
        run_pending_steps(stepper, ring)

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
        return swap_stats(blocks=len(self.schedule), swapped=self._blocks, ring=self._ring,
                          stepper=self._stepper, host=self._host.stats(),
                          resident_block_bytes=self._resident_block_bytes,
                          load=self._load_figures())

    def _load_figures(self) -> dict[str, Any]:
        source = self._source  # still open: the masters are filling in the background
        if source is None:
            # (the checkpoint is read; compressed masters may still be encoding)
            return {"checkpoint_bytes": self._load_stats[0],
                    "load_seconds": self._load_stats[1], "loading": self._host.encoding}
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
        load continues in the background after the constructor; see ``load_in_background``),
        and compressed where ``SwapConfig.compress`` compresses it.

        Raises:
            OffloadError: reading the checkpoint (or encoding a master) failed.
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
        release_guards(self._guards)
        self._guards = []
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
                restore_entry(e, view)
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
        restore_moved(self._moved)
        self._moved = []
        if self._ddp_ignored is not None:
            restore_ddp_ignored(self.model, self._ddp_ignored)
            self._ddp_ignored = None
        if self._ring is not None:
            self._ring.disk = None  # the host store stops the reader
            self._ring.close()
        encode_failed = self._host.encode_error() if detaching else None
        self._host.close()
        self._blocks = []
        self._calls = None
        if failed is not None:
            raise OffloadError(
                f"detached, but the swapped blocks whose load failed are left on the meta "
                f"device: {failed}", hint="Load the model again once the checkpoint reads "
                "cleanly.") from failed
        if encode_failed is not None:  # the weights are back (from the raw master): said once
            raise OffloadError(f"detached with every weight restored, but {encode_failed.message}",
                               hint=encode_failed.hint) from encode_failed

    @property
    def host_memory(self) -> HostMemoryChoice:
        """Where the swapped masters live (``"pinned"`` or ``"pageable"``) and why:
        ``SwapConfig.host_memory`` as resolved at attach."""
        return self._host_memory

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
