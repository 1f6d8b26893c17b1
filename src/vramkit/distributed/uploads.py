"""Sharded uploads: the GPUs of a node share the host->device copies of swapped blocks.

With a swapper per GPU, every GPU of a node copies every swapped block from host memory, and the
copies contend for the host's memory and PCIe root: on a 4x H100 node one GPU copies at
55 GB/s alone but 41 GB/s while four copy (``benchmarks/host_copy_scaling.py``). Where the node's GPUs are linked by NVLink,
:class:`ShardedUploads` (a :class:`~vramkit.offload.swap.BlockLoader`) has each of the node's N
GPUs copy 1/N of a block from the host and the GPUs all-gather the pieces into every slot over
NVLink (NCCL, in place), as FSDP does with its sharded parameters: the host is read once per
node instead of N times, and a block reaches every GPU 2.9x sooner on those four GPUs.

The cost: loads become collectives of the node's ranks, so every rank must load the same blocks
in the same order -- make the same swapped calls with gradients, as under FSDP. The swapper's
ring is deterministic given the calls (no timing decides what loads), and blocks kept on disk
are refused (their reads finish at different times). Calls under ``torch.no_grad()`` -- where a
rank's preview or validation pass usually runs, often on rank 0 alone -- load with plain copies
and the ring is put back as it was at the next call with gradients (or backward); calls with
gradients that one rank makes alone go in ``with swapper.local_calls():``, which does the same.
Blocks under ``min_bytes`` (1 MiB) load whole: a collective costs more than their copy.

:func:`node_uploads` decides per node (``uploads="auto"``: sharded where all the node's GPUs
see each other over NVLink, by NVML; consumer cards without NVLink keep whole copies, since
their all-gather would cross the same PCIe links) and creates one process group per sharing
node (collective over the whole job).
"""

from __future__ import annotations

import hashlib
import logging
import socket
from typing import Any

import torch

from vramkit._validate import check_choice, check_int
from vramkit.devices.nvml import nvlink_connected
from vramkit.errors import ConfigError
from vramkit.memory.transfer import Streams
from vramkit.units import format_size

__all__ = ["MIN_SHARDED_BYTES", "UPLOAD_MODES", "ShardedUploads", "node_uploads"]

logger = logging.getLogger(__name__)

MIN_SHARDED_BYTES = 1 << 20
UPLOAD_MODES = ("auto", "sharded", "whole")
_PIECE_ALIGN = 256  # bytes: each rank's piece starts on a 256-byte boundary


class ShardedUploads:
    """Each rank of ``group`` copies its share of a block host->device; the ranks all-gather
    the rest in place (module docstring). A :class:`~vramkit.offload.swap.BlockLoader`: give it
    to ``BlockSwapper(block_loader=...)``, or let :func:`vramkit.distributed.shared_swapper`
    do it.

    Args:
        group: the process group of the node's ranks (one GPU each).
        min_bytes: blocks smaller than this load whole (default :data:`MIN_SHARDED_BYTES`).

    Attributes:
        loads: sharded loads made (the bytes are the swapper's: ``SwapStats.gathered_bytes``).
    """

    def __init__(self, group: Any, *, min_bytes: int | None = None) -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("ShardedUploads needs torch.distributed, which is not initialized",
                              hint="Call vramkit.distributed.init_from_env() first.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.min_bytes = MIN_SHARDED_BYTES if min_bytes is None else check_int(
            "min_bytes", min_bytes, minimum=0)
        self.loads = 0

    def _sharded(self, nbytes: int) -> bool:
        return self.world_size > 1 and nbytes >= self.min_bytes

    def padded_bytes(self, nbytes: int) -> int:
        """A block's bytes rounded up to N equal, 256-byte aligned pieces (when sharded)."""
        if not self._sharded(nbytes):
            return nbytes
        unit = self.world_size * _PIECE_ALIGN
        return -(-nbytes // unit) * unit

    def prepare(self, names: list[str], sizes: list[int]) -> None:
        """Collective: refuse (on every rank) swappers that differ between the ranks, whose
        loads could never match."""
        layout = hashlib.sha1(repr((names, sizes)).encode()).hexdigest()
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, layout, group=self.group)
        if len(set(everyone)) > 1:
            raise ConfigError(
                "sharded uploads: the ranks of a node swap different blocks (the models or "
                "SwapConfigs differ), so their collective loads could never match",
                hint="Build the same model with the same SwapConfig on every rank (plan once, "
                     "or agree on one plan: vramkit.distributed.fit_rank), or pass "
                     "uploads='whole'.")

    def load(self, dest: torch.Tensor, source: torch.Tensor, streams: Streams,
             what: str) -> int:
        """Copy this rank's piece of ``source`` into ``dest`` and all-gather the others, on
        ``streams.h2d`` (the host does not wait). Returns the bytes copied from the host."""
        n = source.numel()
        if not self._sharded(n):
            streams.copy(dest[:n], source, streams.h2d, what)
            return n
        piece = dest.numel() // self.world_size
        lo = self.rank * piece
        hi = min(lo + piece, n)
        if hi > lo:
            streams.copy(dest[lo:hi], source[lo:hi], streams.h2d, what)
        with streams.on(streams.h2d):  # NCCL starts after the copy; h2d waits for the gather
            torch.distributed.all_gather_into_tensor(dest, dest[lo:lo + piece],
                                                     group=self.group)
        self.loads += 1
        return max(hi - lo, 0)

    def __repr__(self) -> str:
        return (f"ShardedUploads(rank {self.rank} of {self.world_size}, {self.loads} loads, "
                f"whole below {format_size(self.min_bytes)})")


def node_uploads(device: torch.device, uploads: str = "auto", group: Any = None, *,
                 disk_tier: bool = False) -> ShardedUploads | None:
    """Collective over the whole job: the sharded uploads of this rank's node, or ``None``
    where each rank copies whole blocks.

    Args:
        device: this rank's device.
        uploads: ``"auto"`` (sharded on nodes whose GPUs all see each other over NVLink, by
            NVML), ``"sharded"`` (on every node of two or more ranks, NVLink or not; on the CPU
            too, through gloo), ``"whole"`` (never).
        group: the job's process group; sharded uploads need the whole job (``None``).
        disk_tier: the swapper keeps blocks on disk (``SwapConfig.host_budget``): ``"auto"``
            then copies whole blocks (a disk read ends at a different time on each rank, and
            the swapper refuses a collective loader with it).

    Returns:
        This node's :class:`ShardedUploads`, or ``None`` (no process group, ``"whole"``, a rank
        alone on its node, or ``"auto"`` without NVLink).

    Raises:
        ConfigError: ``uploads="sharded"`` with a ``group`` smaller than the job (node groups
            must be created by every rank of the job).
    """
    check_choice("uploads", uploads, UPLOAD_MODES)
    dist = torch.distributed
    if disk_tier and uploads == "auto":
        uploads = "whole"
    if uploads == "whole" or not (dist.is_available() and dist.is_initialized()):
        return None
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        if uploads == "sharded":
            raise ConfigError(
                "uploads='sharded' with a group smaller than the job: the node groups it "
                "all-gathers in must be created by every rank of the job",
                hint="Use the default group, or uploads='whole'.")
        return None
    uuid = None
    if device.type == "cuda":
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    world = dist.get_world_size()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (socket.gethostname(), uuid))
    nodes: dict[str, list[int]] = {}
    for r, (host, _) in enumerate(everyone):
        nodes.setdefault(host, []).append(r)
    mine = everyone[dist.get_rank()][0]
    local = nodes[mine]
    if len(local) < 2:
        ok = False
    elif uploads == "sharded":
        ok = True
    else:
        uuids = [everyone[r][1] for r in local]
        ok = all(u is not None for u in uuids) and nvlink_connected(uuids) is True
    votes: list[Any] = [None] * world
    dist.all_gather_object(votes, ok)
    chosen: Any = None
    for host, ranks in sorted(nodes.items(), key=lambda item: item[1][0]):
        if len(ranks) >= 2 and all(votes[r] for r in ranks):
            g = dist.new_group(ranks)  # every rank creates every group, in the same order
            if host == mine:
                chosen = g
    if chosen is None:
        logger.info("vramkit.distributed: whole-block uploads on %s (%s)", mine,
                    "one rank" if len(local) < 2 else "no NVLink between its GPUs")
        return None
    logger.info("vramkit.distributed: sharded uploads over ranks %s of %s", local, mine)
    return ShardedUploads(chosen)
