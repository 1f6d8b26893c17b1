"""Swapped training under torch.distributed: DDP around a swapper, one pinned host copy per node.

* :func:`init_from_env` joins the job ``torchrun`` started (NCCL on GPUs, gloo on the CPU);
  :func:`shutdown` leaves it.
* :func:`shared_swapper` attaches a :class:`~vramkit.offload.swap.BlockSwapper` whose frozen
  masters live in memory shared by the node's local ranks (:class:`NodeSharedMasters`).
* :func:`wrap_ddp` wraps the swapped model in ``DistributedDataParallel``: rank 0's masters are
  broadcast, swapped trainable gradients are averaged by the swapper's hook
  (:class:`GradientAverager`), the rest by DDP.
* :func:`plan_for_rank` plans one rank (DDP's buckets counted); :func:`fit_rank` plans every
  rank, agrees on one plan and applies it with node-shared masters.
* :class:`ShardedUploads` (:func:`node_uploads`): where NVLink links a node's GPUs, each copies
  its share of a swapped block from the host and they all-gather the rest (``shared_swapper``
  and ``fit_rank`` choose it with ``uploads="auto"``).

FSDP: the swapper and FSDP both own the storage of the parameters they manage, so one module
cannot be both swapped and sharded; ``BlockSwapper`` refuses a model FSDP shards, before or
after it attaches. ``docs/distributed.md`` has the compatibility matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".ddp": ("GradientAverager", "RankInfo", "broadcast_masters", "init_from_env",
             "shared_swapper", "shutdown", "wrap_ddp"),
    ".planning": ("agree_on_plan", "ddp_bucket_bytes", "fit_rank", "plan_for_rank",
                  "NODE_COPIES", "NodeCopies", "node_copies_for", "rank_copy_bytes_per_s"),
    ".shared": ("SHM_DIR", "NodeSharedMasters"),
    ".uploads": ("MIN_SHARDED_BYTES", "UPLOAD_MODES", "ShardedUploads", "node_uploads"),
    "vramkit.devices.host": ("process_pss_bytes",),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.devices.host import process_pss_bytes as process_pss_bytes
    from vramkit.distributed.ddp import *  # noqa: F403
    from vramkit.distributed.planning import *  # noqa: F403
    from vramkit.distributed.shared import *  # noqa: F403
    from vramkit.distributed.uploads import *  # noqa: F403
