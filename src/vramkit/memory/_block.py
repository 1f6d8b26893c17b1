"""Block handles and the pool's per-segment and per-allocation records (private to the pool).

:class:`Block` is public through :mod:`vramkit.memory.pool`; :class:`Segment` and
:class:`AllocRecord` are the pool's own bookkeeping objects and never leave it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vramkit._validate import check_int
from vramkit.errors import ConfigError, InvalidBlockError
from vramkit.memory._arena import RawStack

if TYPE_CHECKING:
    from vramkit.memory.pool import MemoryPool

__all__ = ["AllocRecord", "Block", "CudaBlockBuffer", "Segment", "shape_tuple"]


class Segment:
    """One piece of memory obtained from PyTorch; blocks are byte ranges inside it."""

    __slots__ = ("base_ptr", "id", "storage")

    def __init__(self, segment_id: int, storage: torch.Tensor) -> None:
        self.id = segment_id
        # 1-D uint8 tensor; its size lives in the ledger's arena, the one place sizes are kept.
        self.storage = storage
        self.base_ptr = storage.data_ptr()


class AllocRecord:
    """The pool's record of one allocation; a :class:`Block` is the user's handle to it."""

    __slots__ = ("auto_free", "capacity", "created", "freed", "nbytes", "offset", "relocatable",
                 "segment", "serial", "stack", "streams")

    def __init__(self, serial: int, segment: Segment, offset: int, capacity: int, nbytes: int,
                 relocatable: bool, created: float,
                 stack: RawStack | None) -> None:
        self.serial = serial
        self.segment = segment
        self.offset = offset
        self.capacity = capacity
        self.nbytes = nbytes
        self.relocatable = relocatable
        self.created = created
        self.stack = stack
        self.freed = False
        self.auto_free = False  # owned by a pool.tensor(): release on GC is not a leak
        self.streams: list[Any] | None = None


class Block:
    """A handle to ``nbytes`` of pool memory (FLAME ``allocation``, BitNet ``buffer``).

    The handle stays valid across :meth:`MemoryPool.defragment`: a relocatable block may move, so
    derive tensors from the handle (``block.view(...)``) after compaction; views obtained before
    compaction point at the old location and are invalid. Free it with :meth:`free` (or
    ``pool.free(block)``); a handle dropped without ``free`` is returned by its finalizer and
    counted in ``PoolStats.leaked_frees``.
    """

    __slots__ = ("_pool", "_rec")

    def __init__(self) -> None:
        raise TypeError("Blocks are created by MemoryPool.allocate()")

    def __del__(self) -> None:
        try:
            rec = self._rec
        except AttributeError:  # never initialized (direct construction was refused)
            return
        if not rec.freed:
            self._pool._dropped.append(rec)  # processed under the pool's lock at its next call

    # -- where it is --------------------------------------------------------------------

    @property
    def pool(self) -> MemoryPool:
        """The pool the block came from."""
        return self._pool

    @property
    def device(self) -> torch.device:
        """The device of the memory (``cpu`` for host pools)."""
        return self._pool.device

    @property
    def nbytes(self) -> int:
        """Bytes requested."""
        return self._rec.nbytes

    @property
    def capacity(self) -> int:
        """Bytes reserved for the block: ``nbytes`` rounded up to the pool's alignment."""
        return self._rec.capacity

    @property
    def offset(self) -> int:
        """Byte offset inside its segment (changes when :meth:`MemoryPool.defragment` moves it)."""
        return self._live_rec().offset

    @property
    def segment(self) -> int:
        """Id of the segment holding the block."""
        return self._live_rec().segment.id

    @property
    def data_ptr(self) -> int:
        """Address of the first byte."""
        rec = self._live_rec()
        return rec.segment.base_ptr + rec.offset

    @property
    def relocatable(self) -> bool:
        """Whether :meth:`MemoryPool.defragment` may move the block."""
        return self._rec.relocatable

    @property
    def freed(self) -> bool:
        """Whether the block was freed (its memory may belong to someone else now)."""
        return self._rec.freed

    # -- using it -----------------------------------------------------------------------

    @property
    def tensor(self) -> torch.Tensor:
        """A 1-D ``uint8`` view of the block's ``nbytes``."""
        rec = self._live_rec()
        return rec.segment.storage[rec.offset:rec.offset + rec.nbytes]

    def view(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over the block's first bytes.

        Args:
            shape: the tensor shape; its bytes must fit in ``nbytes``.
            dtype: element type (default ``torch.uint8``).

        Returns:
            A view sharing the block's memory (contents are whatever the block holds).

        Raises:
            ConfigError: when the shape does not fit or the offset is not aligned for ``dtype``.
            InvalidBlockError: when the block was freed.
        """
        rec = self._live_rec()
        dims = shape_tuple(shape)
        itemsize = dtype.itemsize
        need = math.prod(dims) * itemsize
        if need > rec.nbytes:
            raise ConfigError(f"a {tuple(dims)} {dtype} view needs {need} bytes but the block has "
                              f"{rec.nbytes}", hint="Allocate a larger block.")
        if rec.offset % itemsize:
            raise ConfigError(f"block offset {rec.offset} is not aligned for {dtype}",
                              hint="Use a PoolConfig.alignment of at least the element size.")
        raw = rec.segment.storage[rec.offset:rec.offset + need]
        return raw.view(dtype).view(dims)

    def record_stream(self, stream: Any) -> None:
        """Declare that work on ``stream`` uses this block (PyTorch ``Tensor.record_stream``).

        When the block is freed, an event is recorded on ``stream`` and the memory is not handed
        out again until that event has completed. A no-op on plain host pools, which have no
        streams.

        Args:
            stream: a ``torch.cuda.Stream`` on the pool's device (any CUDA stream for pinned
                pools).

        Raises:
            InvalidBlockError: when the block was freed.
            DeviceMismatchError: when the stream is on another device.
        """
        rec = self._live_rec()
        self._pool._check_stream(stream)
        if self._pool.kind == "cpu":
            return
        with self._pool._lock:
            if rec.streams is None:
                rec.streams = [stream]
            elif all(s != stream for s in rec.streams):
                rec.streams.append(stream)

    def free(self) -> None:
        """Return the block to its pool (same as ``pool.free(block)``)."""
        self._pool.free(self)

    def _live_rec(self) -> AllocRecord:
        rec = self._rec
        if rec.freed:
            raise InvalidBlockError(f"use of a freed block ({rec.nbytes} bytes)")
        return rec

    def __repr__(self) -> str:
        rec = self._rec
        state = "freed" if rec.freed else f"segment={rec.segment.id} offset={rec.offset}"
        return (f"Block(nbytes={rec.nbytes}, {state}, device={self._pool.device}, "
                f"relocatable={rec.relocatable})")


def shape_tuple(shape: Sequence[int] | int) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for d in dims:
        check_int(f"a dimension of shape {shape!r}", d, minimum=0)
    return dims


class CudaBlockBuffer:
    """A ``__cuda_array_interface__`` exporter that keeps its block alive while torch uses it."""

    __slots__ = ("__cuda_array_interface__", "block")

    def __init__(self, block: Block, ptr: int, nbytes: int) -> None:
        self.block = block
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }
