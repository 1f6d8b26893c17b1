"""Dequantize a block's packed weights together, once per call of the block: :class:`DenseGroup`.

A :class:`~vramkit.quant.linear.QuantizedLinear` dequantizes its own weight at every call (a
kernel launch and a fresh bf16 tensor) before its matmul. A block of such layers (a FLUX block
that :func:`vramkit.fit` stores as fp8 has 7 to 14) spends the host a launch, an allocation and
the argument handling per layer and call, and on a fast GPU that turns the block host-bound.

A :class:`DenseGroup` gathers the quantized linears of one block. The first of them called
dequantizes **all** of them into one device buffer, a :class:`DenseScratch`: fp8 weights with
one scale per row in one Triton launch on CUDA (a table of the layers' addresses, built once per
placement of their packed tensors), two batched torch calls elsewhere (``torch._foreach_copy_``
casts every layer's codes, ``torch._foreach_mul_`` applies the row scales), other formats one
dequantize per layer. Each layer then multiplies with its view of that buffer, as a plain layer
would. The values are those of the layer's own dequantize, bit for bit (the same fp32 multiply,
the same rounding). Backward reuses the views while the buffer still holds the block (a
checkpointed block's recomputation is followed at once by its backward); otherwise the layer
dequantizes its saved packed bytes as it always did.

One scratch serves every group of a model and holds one group at a time: sized to the largest
group, a generation counter says whose weights it holds. A layer re-dequantizes its group when
the scratch moved on to another group, or when its own packed tensors are not the ones (or no
longer at the version) it was dequantized from -- a :class:`~vramkit.offload.swap.BlockSwapper`
points them at another slot, ``load_state_dict`` writes into them. The scratch costs the device
the largest group's weights in the compute dtype (a FLUX double block: 0.68 GB in bf16); the
planner counts it (``BlockCost.dense``).

Example:
    >>> scratch = DenseScratch()                                   # doctest: +SKIP
    >>> for block in model.transformer_blocks:                     # doctest: +SKIP
    ...     group_dense(block, scratch)

Not used: under ``torch.compile`` (the compiled graph dequantizes per layer), for
``activation_fp8`` layers (the fp8 GEMM reads the packed weight) and for a few tokens on CUDA
(the fused decode kernel never writes the weight out). A layer called with a few tokens
(FLUX's modulation layers, on one conditioning token: a third of a double block's weights) is
left out of its group's dequantizes until it asks for its dense weight again.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vramkit.errors import QuantizationError
from vramkit.quant.formats import FP8Config
from vramkit.quant.kernels import triton_available

if TYPE_CHECKING:
    from vramkit.quant.linear import QuantizedLinear

__all__ = ["DenseGroup", "DenseScratch", "dense_nbytes", "group_dense", "ungroup_dense"]

#: Byte alignment of each layer's view in the scratch (the caching allocator's granularity, so
#: cuBLAS sees the alignment it would for an ordinary tensor).
_ALIGN = 512


class DenseScratch:
    """The device buffer that holds one :class:`DenseGroup`'s dequantized weights at a time.

    Allocated at the first use (on the packed weights' device, in the compute dtype) and kept;
    :meth:`release` frees it. Copying a model (``copy.deepcopy``) gives the copy an empty scratch
    of its own.
    """

    __slots__ = ("_buffer", "_carved", "_largest", "generation")

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._largest = (0, 0)  # the largest registered group: (elements, layers)
        self.generation = 0
        # per group and dtype: its layers' views of the buffer and their element offsets, kept
        # with the buffer (dropped with it, so no view outlives the buffer it was cut from)
        self._carved: dict[tuple[DenseGroup, torch.dtype],
                           tuple[list[torch.Tensor], list[int]]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the scratch holds on its device now (0 before the first use)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def _register(self, elements: int, layers: int) -> None:
        self._largest = max(self._largest, (elements, layers))

    def claim(self, nbytes: int, device: torch.device, itemsize: int
              ) -> tuple[torch.Tensor, int]:
        """The buffer (bytes, at least ``nbytes``) for a group and its new generation. A new
        buffer is sized for the largest registered group at ``itemsize`` bytes per element, so
        it grows once, not group by group."""
        buffer = self._buffer
        if buffer is None or buffer.device != device or buffer.numel() < nbytes:
            self._buffer = None  # the old one goes back to the allocator first
            self._carved.clear()
            elements, layers = self._largest
            size = max(nbytes, _aligned(elements * itemsize) + layers * _ALIGN)
            buffer = self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.generation += 1
        return buffer, self.generation

    def release(self) -> None:
        """Free the buffer; every group dequantizes again at its next call."""
        self._buffer = None
        self._carved.clear()
        self.generation += 1

    def carve(self, group: DenseGroup, dtype: torch.dtype
              ) -> tuple[list[torch.Tensor], list[int]]:
        """``group``'s layers' views of the buffer in ``dtype`` (``[rows, cols]`` each, at
        512-byte aligned offsets) and their element offsets: cut once per buffer, group and
        dtype (the buffer must have been claimed for the group)."""
        carved = self._carved.get((group, dtype))  # a group hashes by identity
        if carved is not None:
            return carved
        buffer = self._buffer
        if buffer is None:
            raise QuantizationError("the dense scratch holds no buffer to carve",
                                    hint="This is a vramkit bug; please report it.")
        views: list[torch.Tensor] = []
        offsets: list[int] = []
        offset = 0
        itemsize = dtype.itemsize
        for layer in group.layers:
            rows, cols = layer.out_features, layer.in_features
            nbytes = rows * cols * itemsize
            views.append(buffer[offset:offset + nbytes].view(dtype).view(rows, cols))
            offsets.append(offset // itemsize)
            offset += _aligned(nbytes)
        self._carved[(group, dtype)] = (views, offsets)
        return views, offsets

    def forget(self, group: DenseGroup) -> None:
        """Drop ``group``'s cached views (it left the scratch)."""
        for key in [key for key in self._carved if key[0] is group]:
            del self._carved[key]

    def invalidate(self) -> None:
        """Keep the buffer, forget whose weights it holds: every group dequantizes again at its
        next call, as in a step where the buffer has moved on to other blocks meanwhile."""
        self.generation += 1

    def __deepcopy__(self, memo: dict[int, Any]) -> DenseScratch:
        new = DenseScratch()
        new._largest = self._largest
        memo[id(self)] = new
        return new

    def __repr__(self) -> str:
        return f"DenseScratch(nbytes={self.nbytes}, generation={self.generation})"


class DenseGroup:
    """Quantized linears dequantized together into a :class:`DenseScratch` (see the module).

    Built by :func:`group_dense`; each layer keeps a reference to it (``layer._dense``) until
    :meth:`remove`.

    Args:
        layers: the quantized linears of one block (all on one device when called).
        scratch: the shared buffer.

    Raises:
        QuantizationError: for a layer already in another group, or an empty list.
    """

    def __init__(self, layers: Sequence[QuantizedLinear], scratch: DenseScratch) -> None:
        if not layers:
            raise QuantizationError("a DenseGroup needs at least one QuantizedLinear",
                                    hint="Pass the quantized linears of a block, or skip "
                                         "blocks without any (group_dense returns None).")
        for layer in layers:
            if getattr(layer, "_dense", None) is not None:
                raise QuantizationError(f"{layer!r} is already in a DenseGroup",
                                        hint="Call ungroup_dense(block) before grouping its "
                                             "layers again.")
        self.layers = tuple(layers)
        self.scratch = scratch
        self._views: list[torch.Tensor] = []
        self._generation = -1
        self._dtype: torch.dtype | None = None
        self._sources: list[tuple[Any, ...]] = []  # per layer: (packed tensors, versions)
        self._tables: dict[tuple[Any, ...], torch.Tensor] = {}  # fp8 launch tables
        self._fp8 = [i for i, layer in enumerate(self.layers)
                     if isinstance(layer.quant_config, FP8Config)
                     and layer.quant_config.granularity == "channel"]
        self._other = sorted(set(range(len(self.layers))) - set(self._fp8))
        # per fp8 layer: its index and the positions of its codes and scales in _packed()
        self._fp8_at = [(i, self.layers[i]._layout.names.index("data"),
                         self.layers[i]._layout.names.index("scales")) for i in self._fp8]
        self._sizes: dict[int, int] = {}  # itemsize -> bytes of the group's views
        # layers last called with a few tokens on CUDA: the fused decode kernel reads their
        # packed weight, so the group's dequantize leaves them out (FLUX's modulation layers,
        # a third of a double block's weights)
        self._decoding: set[int] = set()
        scratch._register(sum(layer.out_features * layer.in_features for layer in self.layers),
                          len(self.layers))
        for i, layer in enumerate(self.layers):
            layer._dense = (self, i)

    def _nbytes(self, itemsize: int) -> int:
        nbytes = self._sizes.get(itemsize)
        if nbytes is None:
            nbytes = self._sizes[itemsize] = sum(
                _aligned(layer.out_features * layer.in_features * itemsize)
                for layer in self.layers)
        return nbytes

    def weight(self, index: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Layer ``index``'s weight in ``dtype`` (a view of the scratch), dequantizing the whole
        group first when the scratch does not hold it."""
        source = self._sources[index] if self._views else None
        if index in self._decoding:  # left out of the last dequantize: in again from now on
            self._decoding.discard(index)
            source = None
        if (self.scratch.generation != self._generation or dtype != self._dtype
                or source is None or not _unchanged(self.layers[index], source)):
            self._expand(dtype, device)
        return self._views[index]

    def decodes(self, index: int) -> None:
        """Layer ``index`` was called with a few tokens (the fused kernel, no dense weight):
        leave it out of the group's dequantizes until it asks for its :meth:`weight`."""
        self._decoding.add(index)

    def current(self, index: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Layer ``index``'s view if the scratch holds this group in ``dtype`` now, else
        ``None`` (backward's question). Any of the group's dequantizes will do: a checkpointed
        block's backward runs in the nodes of its first forward, after its recomputation
        dequantized the same frozen weights again."""
        if (self._generation == self.scratch.generation and dtype == self._dtype
                and index not in self._decoding):
            return self._views[index]
        return None

    def _expand(self, dtype: torch.dtype, device: torch.device) -> None:
        itemsize = dtype.itemsize
        buffer, generation = self.scratch.claim(self._nbytes(itemsize), device, itemsize)
        views, offsets = self.scratch.carve(self, dtype)
        packed = [layer._packed() for layer in self.layers]
        sources = [(tensors, tuple(t._version for t in tensors)) for tensors in packed]
        skip = self._decoding
        fp8 = [entry for entry in self._fp8_at if entry[0] not in skip]
        if fp8:
            codes = [packed[i][data] for i, data, _ in fp8]
            scales = [packed[i][sc] for i, _, sc in fp8]
            if not self._fp8_launch(codes, scales, [offsets[i] for i, _, _ in fp8], buffer,
                                    dtype):
                outs = [views[i] for i, _, _ in fp8]
                torch._foreach_copy_(outs, codes)
                torch._foreach_mul_(outs, scales)
        for i in self._other:
            if i not in skip:
                views[i].copy_(self.layers[i]._layout.dequantize(packed[i], dtype))
        self._views, self._sources = views, sources
        self._generation, self._dtype = generation, dtype

    def _fp8_launch(self, codes: list[torch.Tensor], scales: list[torch.Tensor],
                    offsets: list[int], buffer: torch.Tensor, dtype: torch.dtype) -> bool:
        """The fp8 layers in one Triton launch (CUDA), from a table of their addresses (built
        once per placement of the packed tensors: a swapped block has one per slot). False
        where that launch does not apply (CPU, no Triton, a non-contiguous tensor)."""
        device = buffer.device
        if device.type != "cuda" or not triton_available(device):
            return False
        for c, sc in zip(codes, scales, strict=True):
            if not (c.is_contiguous() and sc.is_contiguous() and sc.dtype == torch.float32):
                return False
        key = (buffer.data_ptr(), dtype, *(c.data_ptr() for c in codes),
               *(sc.data_ptr() for sc in scales))
        table = self._tables.get(key)
        if table is None:
            rows = [[c.data_ptr(), sc.data_ptr(), off, c.shape[0], c.shape[-1]]
                    for c, sc, off in zip(codes, scales, offsets, strict=True)]
            # A small pageable copy that waits for the stream: once per placement (the first
            # steps: a swapped block lands in each of its slots once), never in steady state.
            table = torch.tensor(rows, dtype=torch.int64, device=device)
            self._tables[key] = table
        from vramkit.quant import _triton

        _triton.dequantize_fp8_rows_many(table, buffer.view(dtype),
                                         max(c.shape[0] for c in codes))
        return True

    def remove(self) -> None:
        """Take the layers out of the group (they dequantize per call again)."""
        for layer in self.layers:
            if getattr(layer, "_dense", None) is not None and layer._dense[0] is self:
                layer._dense = None
        self.scratch.forget(self)
        self._views, self._sources, self._tables = [], [], {}

    def __deepcopy__(self, memo: dict[int, Any]) -> DenseGroup:
        new = DenseGroup.__new__(DenseGroup)
        memo[id(self)] = new
        new.layers = copy.deepcopy(self.layers, memo)
        new.scratch = copy.deepcopy(self.scratch, memo)
        new._views, new._sources, new._tables = [], [], {}
        new._generation, new._dtype = -1, None
        new._fp8, new._other = list(self._fp8), list(self._other)
        new._fp8_at, new._sizes = list(self._fp8_at), dict(self._sizes)
        new._decoding = set(self._decoding)
        return new

    def __repr__(self) -> str:
        return f"DenseGroup(layers={len(self.layers)}, fp8_batched={len(self._fp8)})"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _unchanged(layer: QuantizedLinear, source: tuple[Any, ...]) -> bool:
    tensors, versions = source
    buffers = layer._buffers
    for name, was, version in zip(layer._buffer_names, tensors, versions, strict=True):
        if buffers[name] is not was or was._version != version:
            return False
    return True


def dense_nbytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes a :class:`DenseScratch` needs to hold ``module``'s quantized linears dequantized
    (what :func:`group_dense` of ``module`` would claim; 0 without any).

    Args:
        module: a block (its quantized linears may hold meta storage).
        dtype: the compute dtype the views are made in (default: each weight's own).
    """
    from vramkit.quant.linear import QuantizedLinear

    return sum(_aligned(m.out_features * m.in_features
                        * (dtype or m._layout.dtype).itemsize)
               for m in module.modules() if isinstance(m, QuantizedLinear))


def group_dense(module: nn.Module, scratch: DenseScratch) -> DenseGroup | None:
    """Group the :class:`~vramkit.quant.linear.QuantizedLinear` layers of ``module`` (a block)
    so they are dequantized together (see the module).

    Args:
        module: the block; its quantized linears, in the order ``modules()`` lists them.
        scratch: the buffer shared by every group of the model.

    Returns:
        The group, or ``None`` when ``module`` has no quantized linear.

    Raises:
        QuantizationError: when one of its layers is already grouped.
    """
    from vramkit.quant.linear import QuantizedLinear

    layers = [m for m in module.modules() if isinstance(m, QuantizedLinear)]
    return DenseGroup(layers, scratch) if layers else None


def ungroup_dense(module: nn.Module) -> int:
    """Take every quantized linear of ``module`` out of its group.

    Returns:
        How many groups were removed.
    """
    groups = {id(g): g for m in module.modules()
              if (entry := getattr(m, "_dense", None)) is not None
              for g in (entry[0],)}
    for group in groups.values():
        group.remove()
    return len(groups)
