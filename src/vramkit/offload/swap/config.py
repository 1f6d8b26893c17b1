"""What a :class:`~vramkit.offload.swap.swapper.BlockSwapper` is told and what it reports.

:class:`SwapConfig` (the user's settings, checked on construction), :class:`SwapStats` (its
counters and sizes) and :data:`GradientHook`. Every other module of the package may import this
one; it imports none of them, so the settings sit below everything that reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vramkit._validate import check_bool, check_choice, check_int, check_number, check_size
from vramkit.devices.host import HOST_MEMORY_MODES
from vramkit.errors import ConfigError
from vramkit.memory.layout import Random, Sequential, Strided

__all__ = ["GradientHook", "SwapConfig", "SwapStats"]

# Called with a swapped block's name and its trainable weights' gradients on the device, once
# they are complete for the step; may return a finish() for work still in flight (see
# BlockSwapper.set_gradient_hook).
GradientHook = Callable[[str, list[torch.Tensor]], "Callable[[], None] | None"]

_TRAINABLE = ("resident", "cpu", "swap")
_COMPRESS = ("off", "on", "auto")  # vramkit.offload.swap.packed.COMPRESS_MODES


def _block_names(field: str, names: object) -> tuple[str, ...]:
    """``names`` as a tuple of block names, or a ConfigError naming ``SwapConfig.<field>``."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
            isinstance(n, str) and n for n in names):
        raise ConfigError(f"SwapConfig.{field} must be a list of block names, got {names!r}",
                          hint="Name blocks as find_blocks(model) does, e.g. ['blocks.0', "
                               "'blocks.3'].")
    return tuple(names)


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
            full fine-tuning reached its copy bound at 8; ``benchmarks/swap_full_ft.py``).
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
            few pinned staging buffers (:mod:`vramkit.offload.swap.disk`). Default ``None``:
            every swapped block is pinned.
        disk_cache_dir: where the disk tier writes its cache file when blocks cannot be read
            from a checkpoint (default: ``$VRAMKIT_CACHE_DIR`` or ``~/.cache/vramkit``). Use a
            local disk, not tmpfs (that would be RAM again).
        compress: keep frozen swapped blocks' masters losslessly compressed in host memory
            (:mod:`vramkit.compress`: bf16 exponents and 8-bit weights entropy-coded, about
            0.67-0.70x the bytes of trained bf16 weights) and decode them on the device after
            each copy, bit for bit. ``"off"`` (default), ``"on"`` (every frozen block, its
            master in RAM or, with ``host_budget``, in the disk tier's cache file: fewer bytes
            read too), ``"auto"`` (only blocks that shrink to 0.9x or less). The masters
            are encoded once at attach, each as soon as it is filled: with a background fill
            (``checkpoint=``) the encode runs beside it on one thread (on the GPU, falling back
            to the CPU when out of memory), a block loaded before its encode is done copies
            its raw master, and ``wait_loaded()`` waits for the encode too; the device holds
            two scratch buffers of the largest compressed block. Trainable masters are
            never compressed: they change every step. With ``host_memory="pageable"`` the
            compressed masters are pageable too: the staging pool's worker copies each one
            into the device scratch and then launches its decode. With a collective
            ``block_loader`` (sharded uploads) the masters are encoded before the attach
            returns and each load gathers the compressed payload. Masters in node-shared
            memory (``master_memory=``) stay raw (``"on"`` is refused there).
        compressed_blocks: with ``compress`` on, only these swapped blocks' masters are
            compressed (names as :func:`~vramkit.offload.blocks.find_blocks` gives them; what a
            plan chooses where compressing every block would cost more decode time than the
            copies it saves). Default ``None``: every eligible block.
        host_memory: where the swapped blocks' masters live on the host. ``"pinned"``: page
            locked (the fastest copies, one copy stream and no thread). ``"pageable"``:
            ordinary memory, each block copied to the GPU through a bounded pinned staging pool
            (``staging_pool``) on a worker thread (:mod:`vramkit.offload.swap.staged`): for
            Windows / WSL 2, where pinned memory counts as shared GPU memory, and for hosts
            that cannot lock the model. ``"auto"`` (default) chooses per machine at attach
            (:func:`vramkit.devices.host.choose_host_memory`: pageable on Windows and WSL, and
            where the masters would take most of the pinning cap; ``BlockSwapper.host_memory``
            says which and why). With ``trainable="cpu"`` the gradients come back through
            the same pool into pageable buffers. Not with ``trainable="swap"`` (its
            write-backs need pinned masters) or a ``master_memory``/``block_loader``.
        staging_pool: pinned bytes of the staging pool with ``host_memory="pageable"`` (an int
            or a size string; default ``"2GiB"``, at least two chunks); a small model uses less
            (no more than the blocks the ring has in flight).
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
    compress: str = "off"
    compressed_blocks: tuple[str, ...] | None = None
    host_memory: str = "auto"
    staging_pool: int | str = "2GiB"

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
        check_choice("SwapConfig.compress", self.compress, _COMPRESS)
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
        check_choice("SwapConfig.host_memory", self.host_memory, HOST_MEMORY_MODES)
        object.__setattr__(self, "staging_pool", check_size(
            "SwapConfig.staging_pool", self.staging_pool, minimum=1024,
            hint="Give at least two chunks of 512 bytes; the default is '2GiB'."))
        if self.host_memory == "pinned" and self.staging_pool != 2 << 30:
            raise ConfigError(
                "SwapConfig.staging_pool sizes the staging of pageable masters; with "
                "host_memory='pinned' there is none",
                hint="Use host_memory='pageable' (or 'auto') with it, or drop staging_pool.")
        if self.host_memory == "pageable" and self.trainable == "swap":
            raise ConfigError(
                "SwapConfig(host_memory='pageable') with trainable='swap': the block "
                "optimizers write weights and state back into pinned masters",
                hint="Use host_memory='pinned' (or 'auto', which pins for trainable='swap') "
                     "for full fine-tuning.")
        if self.swapped_blocks is not None:
            names = _block_names("swapped_blocks", self.swapped_blocks)
            if self.max_gpu_blocks is not None or self.max_gpu_bytes is not None:
                raise ConfigError(
                    "SwapConfig.swapped_blocks names the blocks to swap; max_gpu_blocks and "
                    "max_gpu_bytes would choose them again",
                    hint="Give either swapped_blocks or the limits, not both.")
            object.__setattr__(self, "swapped_blocks", names)
        if self.compressed_blocks is not None:
            names = _block_names("compressed_blocks", self.compressed_blocks)
            if self.compress == "off":
                raise ConfigError(
                    "SwapConfig.compressed_blocks names the blocks whose masters are "
                    "compressed, but compress='off'",
                    hint="Set compress='on' (or 'auto') with compressed_blocks, or drop them.")
            object.__setattr__(self, "compressed_blocks", names)

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
        compressed_blocks / compressed_bytes / compressed_raw_bytes: blocks whose masters are
            compressed (``SwapConfig.compress``), their payload bytes (what their loads copy;
            in ``pinned_bytes`` for masters in RAM, in the cache file for disk-tier blocks)
            and their bytes decoded; ``compress_scratch_bytes`` the
            device scratch the payloads are copied into before decoding.
        host_memory: where the masters live, ``"pinned"`` or ``"pageable"``
            (``SwapConfig.host_memory`` resolved at attach); with pageable masters
            ``staging_pool_bytes`` of pinned staging (included in ``pinned_bytes``) carried
            ``staged_copies`` block copies (``staged_copy_bytes``), and a chunk was still in
            flight when the worker needed it ``staged_chunk_waits`` times.
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
    compressed_blocks: int = 0
    compressed_bytes: int = 0
    compressed_raw_bytes: int = 0
    compress_scratch_bytes: int = 0
    host_memory: str = "pinned"
    staging_pool_bytes: int = 0
    staged_copies: int = 0
    staged_copy_bytes: int = 0
    staged_chunk_waits: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["order_pattern"] = type(self.order_pattern).__name__.lower()
        return out
