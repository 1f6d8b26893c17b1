"""One pinned host copy of the swapped weights per node, shared by its local ranks.

Each process of a data-parallel job holds the same frozen weights. With a
:class:`~vramkit.offload.swap.BlockSwapper` per rank, each would pin its own masters: four ranks
swapping 24 GB of Flux would pin 96 GB of host RAM. :class:`NodeSharedMasters` puts the frozen
masters in one shared mapping per node instead:

* the lowest rank of each node (the *writer*) creates a file in ``/dev/shm`` (tmpfs: RAM, not
  disk), reserves its pages with ``posix_fallocate`` (so a full tmpfs is an error now, not a
  ``SIGBUS`` later), and fills the masters from its model or checkpoint;
* the other local ranks map the same file and never read or copy the weights (their model may
  even be on the meta device);
* every process page-locks its own view with ``cudaHostRegister`` (the pages are shared, the
  registration is per process), through the pinned pool's backend, so a refused registration
  falls back to pageable memory with the pool's one warning;
* the file is unlinked as soon as every local rank has mapped it: the memory goes back to the
  system when the last process unmaps it, even after a crash.

Host memory therefore stays at one copy of the masters per node whatever the number of local
ranks (measured as proportional set size, :func:`vramkit.devices.host.process_pss_bytes`).
Where sharing is impossible (no ``/dev/shm``, or too little room in it for the masters) every
rank pins its own copy and the job is told once why (:class:`~vramkit.errors.VramkitWarning`).

Everything here that talks to the other processes is a collective over ``group`` (default: the
whole job), called by every rank at the same point: the swapper's constructor.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import socket
import uuid
import warnings
from typing import Any

import torch

from vramkit.devices.host import filesystem_room
from vramkit.errors import ConfigError, OffloadError, VramkitWarning
from vramkit.memory._segments import RegisteredPinnedSegments, host_register_api
from vramkit.units import format_size

__all__ = ["SHM_DIR", "NodeSharedMasters"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE


def _room(directory: str) -> int:
    """Free bytes in ``directory`` (-1 when it does not exist or cannot be read)."""
    free, _ = filesystem_room(directory)
    return -1 if free is None else free


class NodeSharedMasters:
    """Frozen masters in memory shared by the local ranks of each node (module docstring).

    Implements :class:`vramkit.offload.swap.MasterMemory`; give it to
    ``BlockSwapper(..., master_memory=...)``, or let :func:`vramkit.distributed.shared_swapper`
    do it. One instance serves one swapper.

    Args:
        group: the process group whose ranks attach together (default: the whole job).
        directory: the tmpfs directory of the shared file (default ``/dev/shm``).

    Raises:
        ConfigError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, group: Any = None, *, directory: str = SHM_DIR) -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "NodeSharedMasters shares masters between the processes of a torch.distributed "
                "job, and torch.distributed is not initialized",
                hint="Call torch.distributed.init_process_group() first (torchrun sets the "
                     "environment; vramkit.distributed.init_from_env() does both).")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ConfigError(f"directory must be a path, got {directory!r}",
                              hint="Pass a tmpfs directory such as '/dev/shm'.")
        self.group = group
        self.directory = os.fspath(directory)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._writer = False
        self._local: list[int] = []
        self._storage: torch.Tensor | None = None
        self._pins: RegisteredPinnedSegments | None = None
        self.nbytes = 0
        self.pinned = False
        self.reason: str | None = None  # why the masters are not shared, when they are not

    @property
    def writer(self) -> bool:
        """Whether this process writes the masters (the lowest rank of its node)."""
        return self._writer

    @property
    def local_ranks(self) -> list[int]:
        """The ranks (in ``group``) that share this node's mapping, after :meth:`reserve`."""
        return list(self._local)

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, value, group=self.group)
        return out

    def reserve(self, names: list[str], sizes: list[int], device: torch.device
                ) -> list[torch.Tensor] | None:
        """Collective: map this node's shared masters (see the module docstring).

        Returns:
            One uint8 tensor of ``sizes[i]`` bytes per block, or ``None`` when this rank is
            alone on its node (its own pinned pool is as good) or sharing is impossible (every
            rank of the node then pins its own, and the job is warned once).

        Raises:
            ConfigError: the local ranks attach different blocks (different models or configs).
        """
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _PAGE) * _PAGE
        layout = hashlib.sha1(repr((names, sizes)).encode()).hexdigest()
        me = (socket.gethostname(), layout, _room(self.directory), uuid.uuid4().hex)
        # Every rank takes part in every gather below, whatever its node decides: a rank that
        # stopped early would leave the others waiting in the next collective.
        everyone = self._gather(me)
        nodes: dict[str, list[int]] = {}
        for r, v in enumerate(everyone):
            nodes.setdefault(v[0], []).append(r)
        mixed = [host for host, ranks in nodes.items()
                 if len({everyone[r][1] for r in ranks}) > 1]
        if mixed:  # raised on every rank of every node, so that none waits for the others
            raise ConfigError(
                f"the local ranks of {mixed[0]} attached swappers to different blocks (the "
                "models or SwapConfigs differ between ranks), so they cannot share one copy of "
                "the masters",
                hint="Build the same model with the same SwapConfig on every rank (plan once, "
                     "or plan with the same inputs everywhere).")
        local = nodes[me[0]]
        self._local = local
        leader = local[0]
        short = min(everyone[r][2] for r in local)
        sharing = len(local) >= 2 and short >= total
        why = None
        if len(local) >= 2 and not sharing:
            why = (f"{self.directory} does not exist" if short < 0 else
                   f"{self.directory} has {format_size(short)} free on {me[0]}")
            why += f", and the masters need {format_size(total)}"
        path = os.path.join(self.directory, f"vramkit-masters-{everyone[leader][3]}")
        self._writer = sharing and self.rank == leader
        fd = -1
        error = None
        if self._writer:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                error = f"creating {path} ({format_size(total)}) failed: {exc}"
        created = self._gather(error)
        failed = next((created[r] for r in local if created[r] is not None), None)
        if sharing and failed is None and not self._writer:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                error = f"opening {path} failed: {exc}"
        mapping = None
        if fd >= 0 and failed is None and error is None:
            try:
                mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                error = f"mapping {path} failed: {exc}"
        if fd >= 0:
            os.close(fd)
        opened = self._gather(error)
        if self._writer:  # every local rank has it mapped (or gave up): the name can go
            try:
                os.unlink(path)
            except OSError:
                pass
        if not sharing:
            self._writer = False
            if why is not None:
                self._fallback(why, total)
            return None
        failed = failed or next((opened[r] for r in local if opened[r] is not None), None)
        if failed is not None:
            del mapping
            self._writer = False
            self._fallback(failed, total)
            return None
        assert mapping is not None
        storage = torch.frombuffer(mapping, dtype=torch.uint8)
        del mapping  # the tensor keeps the mapping alive
        self._storage = storage
        self.nbytes = total
        if device.type == "cuda":
            cudart = host_register_api()
            if cudart is not None:
                self._pins = RegisteredPinnedSegments(cudart, _PAGE)
                self.pinned = self._pins.pin(storage)
        logger.info("vramkit.distributed: %s of frozen masters shared by local ranks %s "
                    "(%s, this rank %s)", format_size(total), local,
                    "page-locked" if self.pinned else "pageable",
                    "writes them" if self._writer else "maps them")
        return [storage[o:o + s] for o, s in zip(offsets, sizes, strict=True)]

    def _fallback(self, why: str, total: int) -> None:
        self.reason = why
        if self.rank == (self._local[0] if self._local else 0):
            warnings.warn(
                f"vramkit: the local ranks cannot share one copy of the swapped weights: {why}. "
                f"Each rank pins its own ({format_size(total)} each, "
                f"{format_size(total * len(self._local))} on this node). Hint: give "
                f"{self.directory} room (docker run --shm-size, a larger tmpfs), or lower "
                "the swapped bytes (SwapConfig.host_budget keeps blocks on disk).",
                VramkitWarning, stacklevel=4)

    def published(self, ok: bool) -> None:
        """Collective: the writer filled the masters (or failed); raise everywhere if it
        failed, so that no rank waits forever or trains on half-written weights."""
        states = self._gather(bool(ok))
        bad = [r for r, s in enumerate(states) if not s]
        if bad:
            raise OffloadError(
                f"rank(s) {bad} failed while the shared masters were being filled",
                hint="See the error on those ranks: every rank stops so none trains on "
                     "half-written weights.")

    def close(self) -> None:
        """Unpin and drop this process's view (the memory goes when the last rank drops it)."""
        if self._pins is not None:
            self._pins.close()
            self._pins = None
        self._storage = None
        self.pinned = False

    def __repr__(self) -> str:
        role = "writer" if self._writer else "reader"
        return (f"NodeSharedMasters({format_size(self.nbytes)}, local ranks {self._local}, "
                f"{role})")
