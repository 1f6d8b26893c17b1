"""Data-parallel training of swapped models: DDP around a :class:`BlockSwapper`.

The supported order is *swap, then wrap*::

    info = vramkit.distributed.init_from_env()          # torchrun's environment
    swapper = vramkit.distributed.shared_swapper(model, config=..., device=info.device)
    ddp = vramkit.distributed.wrap_ddp(model, swapper)  # a DistributedDataParallel

* The swapper lists its swapped tensors in ``model._ddp_params_and_buffers_to_ignore`` while it
  is attached, DDP's own switch for tensors it must leave alone: their placeholders (one
  element seen through a zero stride) are neither broadcast at construction -- which is where a
  plain ``DistributedDataParallel(model)`` failed before ("more than one element of the
  written-to tensor refers to a single memory location") -- nor bucketed for reduction.
* The gradients of trainable parameters that are not swapped (LoRA adapters, resident layers)
  reduce through DDP as usual, overlapped with backward by its buckets.
* Swapped trainable weights (``SwapConfig(trainable="cpu")`` or ``"swap"``) reduce through the
  swapper's gradient hook (:class:`GradientAverager`): as soon as a block's gradients are
  complete, on the device, an asynchronous all-reduce starts; with ``trainable="cpu"`` only the
  device->host copy stream waits for it, so the next blocks' backward overlaps the reduction;
  with ``"swap"`` the block's optimizer step (next on the compute stream) waits for it.
* The initial state goes through the host masters (:func:`broadcast_masters`): rank 0's masters
  reach every rank (node-shared masters only between nodes: a node holds one copy already).
* Attaching a swapper to a model DDP already wraps is refused (``BlockSwapper`` raises): DDP
  would have broadcast and registered the very tensors the swapper replaces.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_choice, check_number
from vramkit.devices.resolve import resolve_device
from vramkit.distributed.shared import NodeSharedMasters
from vramkit.distributed.uploads import UPLOAD_MODES, node_uploads
from vramkit.errors import ConfigError, OffloadError, VramkitWarning
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.units import format_size

__all__ = ["GradientAverager", "RankInfo", "broadcast_masters", "init_from_env",
           "shared_swapper", "shutdown", "wrap_ddp"]

logger = logging.getLogger(__name__)

_STAGING = 64 << 20  # bytes per broadcast through the GPU (NCCL reduces device tensors only)


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its job.

    Attributes:
        rank / world_size: this process and the job's processes.
        local_rank / local_world_size: the same on this node.
        device: this process's device (``cuda:<local_rank>``, or ``cpu``).
        backend: the process group's backend (``"nccl"``, ``"gloo"``), ``None`` when the job is
            one process and no group was created.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that prints)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer",
                          hint="Launch with torchrun, which sets RANK, WORLD_SIZE and "
                               "LOCAL_RANK.") from None


def init_from_env(backend: str | None = None, *, timeout_seconds: float = 600.0) -> RankInfo:
    """Join the job torchrun started, from its environment (``accelerate launch --multi_gpu``
    sets the same variables).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; with a GPU per
    local rank it makes ``cuda:<LOCAL_RANK>`` the current device *before* creating the group
    (NCCL binds to it). A launcher's job of one process (``torchrun --nproc_per_node 1``) gets a
    group of one; without the launcher's variables (a plain ``python``) no group is created and
    the job is this one process.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL where every local rank has a GPU,
            else gloo (CPU).
        timeout_seconds: how long a collective may wait for the other ranks.

    Returns:
        The :class:`RankInfo`.

    Raises:
        ConfigError: malformed variables, NCCL asked without enough GPUs.
    """
    if backend is not None:
        check_choice("backend", backend, ("nccl", "gloo"))
    check_number("timeout_seconds", timeout_seconds, minimum=0, low_open=True)
    dist = torch.distributed
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank if world > 1 else 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= local_world and gpus > 0 else "gloo"
    if backend == "nccl" and local_rank >= gpus:
        raise ConfigError(
            f"NCCL needs a GPU per local rank: local rank {local_rank}, {gpus} visible GPU(s)",
            hint="Start at most as many processes per node as GPUs (torchrun "
                 "--nproc_per_node), or use backend='gloo' on the CPU.")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launched = "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ
    if world <= 1 and not launched:
        return RankInfo(0, 1, 0, 1, device, dist.get_backend() if dist.is_initialized()
                        else None)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend,
                                  "timeout": timedelta(seconds=timeout_seconds)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device,
                    str(dist.get_backend()))


def shutdown() -> bool:
    """Leave the job: destroy its process groups, at the end of a rank's work.

    Drop your references to the ``DistributedDataParallel`` module first (``del ddp``, or
    return from the function that made it): DDP's reducer holds the process group, and a group
    destroyed while something still holds it keeps its gloo worker threads until interpreter
    exit. Freed there, the last all-reduce DDP started in a backward drops a Python object
    (PyTorch stashes the backward's ``contextvars`` context in the work's thread state) with the
    interpreter half gone, and the process aborts ("terminate called without an active
    exception", about one run in 25 on a loaded machine). This collects garbage first (a DDP
    module in a reference cycle goes then), warns when a DDP module is still alive, and
    destroys the groups: their worker threads end here, while the interpreter is whole.

    Returns:
        ``True`` when a process group was destroyed, ``False`` when there was none (a plain
        ``python train.py``: nothing to do).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.nn.parallel import DistributedDataParallel

    gc.collect()
    # type(), not isinstance(): the latter reads __class__, which some of torch's deprecated
    # objects answer with a warning.
    alive = sum(1 for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel))
    if alive:
        warnings.warn(
            f"vramkit.distributed.shutdown(): {alive} DistributedDataParallel module(s) still "
            "referenced keep the process group (and gloo's worker threads) alive past its "
            "destruction, which can abort the process at exit. Delete them first "
            "(del ddp).", VramkitWarning, stacklevel=2)
    dist.destroy_process_group()
    return True


def _require_group(what: str) -> None:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"{what} needs torch.distributed, which is not initialized",
                          hint="Call vramkit.distributed.init_from_env() (under torchrun) or "
                               "torch.distributed.init_process_group() first.")


def shared_swapper(model: nn.Module, blocks: str | Sequence[str] = "auto",
                   config: SwapConfig | None = None,
                   device: str | int | torch.device | None = None, *, group: Any = None,
                   uploads: str = "auto", **swapper_options: Any) -> BlockSwapper:
    """A :class:`BlockSwapper` whose frozen masters are shared by the local ranks of each node.

    Collective: every rank calls it with the same model and config. Without a process group
    (a plain ``python train.py``: one process, nothing to share) it is a plain
    :class:`BlockSwapper`, so one script runs alone and under torchrun. The lowest local rank
    fills the masters (from ``model`` or ``checkpoint=``); the others map them, so their model
    may be built on the meta device and the node holds one copy (see
    :mod:`vramkit.distributed.shared`). Trainable swapped weights keep per-rank masters (each
    rank steps its own copy). A rank alone on its node, or a node where the memory cannot be
    shared, pins per rank as a plain swapper does (the latter with one warning).

    Args:
        model / blocks / config: as for :class:`BlockSwapper`.
        device: this rank's device (default: the current CUDA device, or the CPU without one).
        group: the process group (default: the whole job).
        uploads: how the node's GPUs fill their slots (:mod:`vramkit.distributed.uploads`):
            ``"auto"`` (default) shares each block's host->device copy between the node's GPUs
            and all-gathers the pieces where NVLink links them all, else copies whole blocks;
            ``"sharded"`` shares them on any node of two or more ranks; ``"whole"`` never.
            With shared copies every rank must make the same swapped calls (wrap the calls one
            rank makes alone in ``swapper.local_calls()``); ``"auto"`` copies whole blocks
            when ``config.host_budget`` keeps some on disk.
        **swapper_options: the other keyword arguments of :class:`BlockSwapper`
            (``checkpoint``, ``prefix``, ``optimizer``...).

    Returns:
        The attached swapper; ``swapper.master_memory`` is the shared memory (``None`` when not
        shared), ``swapper.stats().shared_bytes`` its size.
    """
    for own in ("master_memory", "block_loader"):
        if own in swapper_options:
            raise ConfigError(f"shared_swapper chooses {own} itself",
                              hint=f"Use BlockSwapper(..., {own}=...) directly for your own.")
    check_choice("uploads", uploads, UPLOAD_MODES)
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.cuda.is_available() else torch.device("cpu"))
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            _require_group("shared_swapper(group=...)")
        return BlockSwapper(model, blocks, config, device, **swapper_options)
    loader = node_uploads(resolve_device(device, owner="shared_swapper"), uploads, group,
                          disk_tier=config is not None and config.host_budget is not None)
    return BlockSwapper(model, blocks, config, device, master_memory=NodeSharedMasters(group),
                        block_loader=loader, **swapper_options)


class GradientAverager:
    """A swapper gradient hook that averages a block's gradients over the ranks of ``group``
    (one all-reduce per block and dtype, on flattened gradients; what DDP's default hook does
    for its buckets: divide by the world size, then sum).

    Args:
        group: the process group (default: the whole job).
    """

    def __init__(self, group: Any = None) -> None:
        _require_group("GradientAverager")
        self.group = group
        self.world_size = torch.distributed.get_world_size(group)
        self.calls = 0
        self.bytes = 0

    def __call__(self, block_name: str, grads: list[torch.Tensor]) -> Callable[[], None]:
        """Start the all-reduces (asynchronously) and return the ``finish()`` the swapper runs
        on the stream that reads the gradients: it waits for them there (on a GPU: that stream
        waits, the host does not) and copies flattened results back."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        pending: list[tuple[Any, torch.Tensor, list[torch.Tensor] | None]] = []
        for same in by_dtype.values():
            single = len(same) == 1 and same[0].is_contiguous()
            flat = same[0] if single else torch.cat([g.reshape(-1) for g in same])
            flat.div_(self.world_size)
            work = torch.distributed.all_reduce(flat, group=self.group, async_op=True)
            pending.append((work, flat, None if single else same))
            self.bytes += flat.numel() * flat.element_size()
        self.calls += 1

        def finish() -> None:
            for work, flat, parts in pending:
                work.wait()
                if parts is None:
                    continue
                if flat.device.type == "cuda":  # freed by Python, reused only after this stream
                    flat.record_stream(torch.cuda.current_stream(flat.device))
                offset = 0
                for g in parts:
                    n = g.numel()
                    g.copy_(flat[offset:offset + n].view_as(g))
                    offset += n

        return finish


def broadcast_masters(swapper: BlockSwapper, *, src: int = 0, group: Any = None) -> int:
    """Give every rank ``src``'s swapped weights, through the host masters (collective).

    Masters of trainable swapped weights (one per rank) are broadcast among all ranks. Frozen
    masters are broadcast among the ranks that own a writable copy: on a node that shares its
    masters only the node's writer (its local ranks map the same memory), on a node that does
    not every rank; on one sharing node nothing moves. Blocks kept on disk
    (``SwapConfig.host_budget``) are read from each rank's own checkpoint and are not
    broadcast. With NCCL the bytes go through a 64 MiB device buffer. Ranks are global ranks.

    Args:
        swapper: an attached swapper (every rank's swaps the same blocks).
        src: the rank whose weights win (default 0, which always writes its node's copy).
        group: the process group (default: the whole job).

    Returns:
        Bytes this rank received (or sent, on ``src``).

    Raises:
        ConfigError: ``src`` only maps its node's shared copy (it is not its node's writer).
    """
    _require_group("broadcast_masters")
    dist = torch.distributed
    rank = dist.get_rank()
    swapper.wait_loaded()
    swapper.sync_gradients()
    memory = swapper.master_memory
    reader = memory is not None and not memory.writer
    size = dist.get_world_size(group)
    roles: list[Any] = [None] * size
    dist.all_gather_object(roles, (rank, reader), group=group)
    owners = [r for r, is_reader in roles if not is_reader]  # global ranks
    if src not in owners:
        raise ConfigError(f"broadcast_masters(src={src}): rank {src} maps its node's shared "
                          "masters but does not write them",
                          hint="Use src=0 (rank 0 always writes its node's copy).")
    spread = len(owners) > 1  # frozen masters exist in more than one writable copy
    if group is not None and spread and len(owners) != size:
        # A group of the owners must be created by every rank of the job, not of ``group``.
        raise ConfigError("broadcast_masters(group=...) with node-shared masters on several "
                          "nodes: the writers' group would need the whole job to create it",
                          hint="Call it (or wrap_ddp) with the default group.")
    # Every rank takes part in creating a group, member or not, in the same order.
    frozen_group = group if len(owners) == size else (
        dist.new_group(owners) if spread else None)
    is_nccl = "nccl" in str(dist.get_backend(group)).lower()
    staging = (torch.empty(_STAGING, dtype=torch.uint8, device=swapper.device)
               if is_nccl else None)
    moved = 0
    for block in swapper.blocks:
        if block.master is None or block.on_disk:
            continue
        if block.trainable_entries:  # one master per rank
            moved += _broadcast(block.master, src, group, staging)
        elif spread and not reader:
            moved += _broadcast(block.master, src, frozen_group, staging)
    dist.barrier(group=group)  # readers of shared masters wait for their writer's copy
    swapper.masters_changed()  # collectives bump no version counter: reload stale slots
    logger.info("vramkit.distributed: broadcast %s of masters from rank %d",
                format_size(moved), src)
    return moved


def _broadcast(tensor: torch.Tensor, src: int, group: Any, staging: torch.Tensor | None) -> int:
    dist = torch.distributed
    if staging is None:
        dist.broadcast(tensor, src, group=group)
        return tensor.numel()
    rank = dist.get_rank()
    for start in range(0, tensor.numel(), staging.numel()):
        piece = tensor[start:start + staging.numel()]
        buf = staging[:piece.numel()]
        if rank == src:
            buf.copy_(piece)
        dist.broadcast(buf, src, group=group)
        if rank != src:
            piece.copy_(buf)
    return tensor.numel()


def wrap_ddp(model: nn.Module, swapper: BlockSwapper, *, group: Any = None,
             broadcast: bool = True, **ddp_options: Any) -> nn.Module:
    """Wrap a swapped model in ``DistributedDataParallel`` (collective; see the module
    docstring for what goes where).

    Args:
        model: the model ``swapper`` is attached to (not yet wrapped).
        swapper: its attached :class:`BlockSwapper` (from :func:`shared_swapper` for one copy
            of the masters per node).
        group: the process group (default: the whole job).
        broadcast: broadcast rank 0's masters first (:func:`broadcast_masters`; default
            ``True``); DDP broadcasts the rest of the model's state itself.
        **ddp_options: passed to ``DistributedDataParallel`` (``device_ids`` defaults to the
            swapper's GPU).

    Returns:
        The ``DistributedDataParallel`` module; the model itself when nothing is left for DDP
        to reduce (every trainable weight is swapped: the swapper's hook reduces them all), or
        when there is no process group (a plain ``python train.py``: one process, nothing to
        reduce), so one script runs alone and under torchrun.

    Raises:
        ConfigError: ``swapper`` not attached to ``model``; a ``group`` without
            torch.distributed initialized.
    """
    check_bool("broadcast", broadcast)
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ConfigError("wrap_ddp got a model DDP already wraps",
                          hint="Pass the plain model: swap first, then wrap once.")
    if swapper.model is not model:
        raise ConfigError("wrap_ddp: the swapper is attached to another model",
                          hint="Pass the model the swapper was built with.")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None or ddp_options:
            _require_group("wrap_ddp with group= or DDP options")
        logger.info("wrap_ddp: no process group (one process): the model is used as it is")
        return model
    if not swapper.swapped_names and not swapper.blocks:
        logger.info("wrap_ddp: the swapper swaps no block; DDP as usual")
    if broadcast:
        broadcast_masters(swapper, group=group)
    if any(b.trainable_entries for b in swapper.blocks):
        swapper.set_gradient_hook(GradientAverager(group))
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()) or ())
    if not any(p.requires_grad for n, p in model.named_parameters() if n not in ignored):
        logger.info("wrap_ddp: every trainable weight is swapped; the swapper's gradient hook "
                    "reduces them, no DDP wrapper is needed")
        return model
    if swapper.device.type == "cuda":
        ddp_options.setdefault("device_ids", [swapper.device.index])
    try:
        return DistributedDataParallel(model, process_group=group, **ddp_options)
    except RuntimeError as exc:
        raise OffloadError(f"DistributedDataParallel refused the swapped model: {exc}",
                           hint="Report this with the model and SwapConfig; swapped tensors "
                                "should be in model._ddp_params_and_buffers_to_ignore."
                           ) from exc
