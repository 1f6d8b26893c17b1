"""Activation offload: saved activations go to pinned host memory in forward and come back ahead
of use in backward.

Training keeps every tensor that autograd saves for backward on the GPU from the moment the
forward pass produces it until backward consumes it; for long sequences those saved activations
dwarf the weights. :class:`ActivationOffloader` installs a
``torch.autograd.graph.saved_tensors_hooks`` pair that moves them out of the way:

* **pack** (forward, at save time): the copy stream ``d2h`` of :func:`transfer_streams` waits on
  an event recorded on the compute stream, copies the tensor asynchronously into a block of a
  pinned :class:`~vramkit.memory.pool.MemoryPool` and records a "stored" event. The offloader
  keeps the device tensor until ``max_inflight_bytes`` of newer copies are queued behind it; then
  the compute stream waits (a GPU-side wait) on its "stored" event and the tensor is let go, so the
  caching allocator reuses the memory in stream order. (``record_stream`` plus dropping the
  reference at once would look cheaper, but the allocator then frees the memory only when the
  *host* sees the copy complete, and the host runs ahead of the GPU by most of a forward pass:
  the peak would not go down.) The pool is created on first use and owned by the offloader.
  Host blocks are not returned to it between steps: a block whose host->device copy was issued
  is kept as a *spare* and the next offload of the same size reuses it, its device->host copy
  waiting (on the GPU) for that load. Handing it back to the pinned pool instead would park it
  until the *host* sees the load complete -- a step later, as the host runs ahead -- so each
  step's offloads would miss and grow the pool with slow ``cudaHostRegister`` calls. A steady
  training loop takes pinned memory from the pool in its first step only; spares unused for a
  whole forward pass (the shapes changed) go back to the pool, and :meth:`~ActivationOffloader.trim`
  returns them all.
* **unpack** (backward, reverse order): a tensor whose device memory is still held (the last
  ones of the forward pass) is used as it is. A prefetched one: the compute stream waits on its
  "loaded" event. Otherwise its host->device copy is issued now (an *on-demand* load). In all
  cases further tensors are issued until ``prefetch`` tensors and ``prefetch_bytes`` bytes are
  on their way ahead of use, walking down the pack order from the newest tensor not yet asked
  for. The block of a tensor used as it was stays until autograd drops the saved tensor, so a
  second backward (``retain_graph=True``) can reload it.

Nothing on these paths synchronizes the host with the GPU. All copies go through the process-wide
streams of :func:`~vramkit.memory.transfer.transfer_streams`, the ones the block swapper uses,
so activation traffic and weight swaps share one copy queue per direction (the PCIe budget).

What stays on the device (counted in :meth:`ActivationOffloader.stats`): parameters and views of
parameters (they are resident anyway), tensors smaller than ``min_bytes`` (not worth a copy),
tensors on another device, tensor subclasses / non-strided layouts / conjugate or negative views,
and tensors that do not fit under ``max_pinned_bytes``. The same tensor saved twice (``x * x``)
is copied once. Dense tensors come back with their exact strides; overlapping ones (``expand``)
are copied as their storage span and rebuilt with the same strides; views with gaps (a slice of
a wider tensor) are copied compactly and come back contiguous (same values, other strides).

Composition:

* ``torch.utils.checkpoint`` (non-reentrant) installs its own saved-tensor hooks inside the
  checkpointed region; nested hooks resolve innermost-first, so the region's tensors are
  recomputed (not offloaded) and everything outside it is offloaded by this class -- the
  region's *inputs* too: the checkpoint saves them with ``save_for_backward`` on a node of its
  own, outside its region's hooks (PyTorch >= 2.1; tested), so with every block checkpointed
  the blocks' inputs are what this class moves. That holds for *positional* tensors only: the
  checkpoint keeps keyword arguments (and tensors inside tuples) by reference, so vramkit's
  checkpointing and the block swapper pass every tensor of a checkpointed call positionally
  (:func:`vramkit.offload.checkpointing.run_checkpointed`; diffusers calls its blocks with
  keywords). A model that calls ``torch.utils.checkpoint`` itself with keyword tensors keeps
  those on the device. The reentrant variant also saves its inputs through
  ``save_for_backward``: offloaded as well.
* :class:`~vramkit.offload.swap.BlockSwapper` installs its own hooks while a non-checkpointed
  swapped block runs: tensors saved inside a swapped block's region are handled by the swapper,
  those outside (non-block layers, resident blocks, the inputs a checkpointed swapped block saves
  with ``save_for_backward``) by this class. Both use the same copy streams.

On a CPU device (``device="cpu"``) everything runs the same way with synchronous copies
(:class:`~vramkit.memory.transfer.HostStreams`) into a plain host pool. That saves no memory --
the tensors were on the host already -- and exists to exercise the mechanics (ordering,
deduplication, pool reuse, caps) without a GPU. ``device=None`` means the current CUDA device and
raises :class:`~vramkit.errors.DeviceError` when CUDA is unavailable.

Typical use: create the offloader once and enter it around every step's forward pass, so the
pinned pool is reused; backward may run inside or outside the ``with`` block::

    offloader = ActivationOffloader(ActivationOffloadConfig(min_bytes="1MiB", prefetch=2))
    for batch in loader:
        with offloader:
            loss = model(batch)
        loss.backward()
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections import deque
from types import TracebackType
from typing import Any

import torch
from torch import nn

from vramkit.errors import ConfigError, DeviceError, OffloadError, PoolExhaustedError
from vramkit.memory.pool import Block, MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams, resolve_offload_device, transfer_streams
from vramkit.offload._activation_settings import (
    ActivationOffloadConfig,
    ActivationOffloadStats,
    Counters,
)
from vramkit.units import format_size

__all__ = [
    "ActivationOffloadConfig",
    "ActivationOffloadStats",
    "ActivationOffloader",
    "offload_activations",
]

logger = logging.getLogger(__name__)

# A forward pass saves many tensors of a handful of sizes; the pool's per-size cache must hold a
# whole step's worth of one size, or blocks spill into the arena and are re-carved every step.
_POOL_CACHED_PER_SIZE = 4096
# Pinned segments are page-locked host RAM: grow gently so the pool does not overshoot the
# step's need by the 2x a doubling policy can leave behind.
_POOL_GROWTH_FACTOR = 1.25
_POOL_ALIGNMENT = 512


# States of an offloaded tensor.
_IN_FLIGHT = 0  # device->host copy issued; the offloader still holds the device tensor
_ON_HOST = 1  # the compute stream waited for the copy and the device tensor was let go
_ORIGINAL = 2  # unpacked while still held: backward got the original tensor, the host copy stays
_LOADED = 3  # copied back host->device; the host block is freed


class _Held:
    """An in-flight device tensor, owned by the offloader's queue (never by its handle: a
    tensor saved as its own op's output references that op's node, which references the handle,
    and a handle referencing the tensor would close a cycle the garbage collector cannot see)."""

    __slots__ = ("__weakref__", "handle", "nbytes", "tensor")

    def __init__(self, handle: _Offloaded, tensor: torch.Tensor, nbytes: int) -> None:
        self.handle = weakref.ref(handle)
        self.tensor: torch.Tensor | None = tensor
        self.nbytes = nbytes


class _Offloaded:
    """The packed form of one offloaded saved tensor (what autograd keeps instead of it).

    ``span`` elements starting at the tensor's storage offset were copied; the tensor is rebuilt
    as ``span_tensor.as_strided(shape, stride)``. A handle dropped before backward used it (a
    graph freed without backward through it) or after its original tensor was used hands what
    it holds back to the offloader, which releases it at its next operation: inside a
    garbage-collection pass the pool's lock may be held, and the compute stream must first wait
    for a copy still writing a device tensor.
    """

    __slots__ = ("__weakref__", "ahead_bytes", "ahead_gen", "block", "capacity", "dtype", "held",
                 "index", "loaded", "nbytes", "owner", "result", "shape", "shared", "source",
                 "span", "state", "stored", "stride", "unpacked", "version")

    def __init__(self, owner: ActivationOffloader, index: int, tensor: torch.Tensor,
                 shape: tuple[int, ...], stride: tuple[int, ...], span: int, block: Block) -> None:
        self.owner = owner
        self.index = index
        self.shape = shape
        self.stride = stride
        self.span = span
        self.dtype = tensor.dtype
        self.nbytes = span * tensor.element_size()
        self.block: Block | None = block
        self.capacity = block.capacity
        self.source = weakref.ref(tensor)
        self.version = tensor._version
        self.held: weakref.ref[_Held] | None = None
        self.stored: Any = None
        self.loaded: Any = None
        self.result: torch.Tensor | None = None  # the host->device copy, once loaded
        self.state = _IN_FLIGHT
        self.unpacked = False
        # Saved more than once (one copy for every save): backward asks for it out of the pack
        # order, at the first of its users -- the last to run forward.
        self.shared = False
        # Counted in the prefetch window of generation ``ahead_gen`` with ``ahead_bytes``.
        self.ahead_gen = -1
        self.ahead_bytes = 0

    def __del__(self) -> None:
        try:
            orphans = self.owner._orphans
        except AttributeError:  # interpreter shutdown
            return
        block, self.block = self.block, None
        tensor = None
        if self.state == _LOADED and not self.unpacked:
            # Prefetched, never used: the host->device copy may still be writing the tensor.
            tensor = self.result
        if block is not None or tensor is not None or not self.unpacked:
            orphans.append((block, self.capacity, tensor, self.loaded,
                            -1 if self.unpacked else self.ahead_gen, self.ahead_bytes))


def _layout(t: torch.Tensor) -> tuple[int, bool]:
    """``(elements to copy, keep strides)`` for a strided tensor.

    Its storage span (from the first to the last element it addresses) when that is no larger
    than the tensor itself -- dense tensors in any dimension order, and overlapping ones such as
    ``expand`` results -- so the copy can be rebuilt with identical strides; otherwise (a view
    with gaps) the element count, copied compactly.
    """
    numel = t.numel()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    if span <= numel:
        return span, True
    return numel, False


class ActivationOffloader:
    """Offloads saved activations to pinned host memory and prefetches them back in backward.

    Use it as a context manager around the forward pass; create it once and enter it every step
    so its pinned pool is reused (see the module docstring for what is offloaded and how).

    Args:
        config: the settings (default ``ActivationOffloadConfig()``).
        device: the CUDA device whose activations are offloaded (``None``, the default: the
            current CUDA device), or ``"cpu"`` to run the mechanics on the host (no memory is
            saved; for tests and CPU-only machines).
        streams: the copy streams to use (default: the shared ``transfer_streams(device)``);
            tests pass a ``HostStreams(log=[])`` to observe the order of copies and events.

    Raises:
        ConfigError: for a config of the wrong type.
        DeviceError: when the device is not a CUDA device or the CPU, or CUDA is unavailable.
    """

    def __init__(self, config: ActivationOffloadConfig | None = None, *,
                 device: str | int | torch.device | None = None,
                 streams: Streams | None = None) -> None:
        if config is None:
            config = ActivationOffloadConfig()
        elif not isinstance(config, ActivationOffloadConfig):
            raise ConfigError(f"config must be an ActivationOffloadConfig, got "
                              f"{type(config).__name__}",
                              hint="Pass an ActivationOffloadConfig, e.g. ActivationOffloader("
                                   "ActivationOffloadConfig(min_bytes='1MiB')), or leave config "
                                   "out for the defaults.")
        self.config = config
        self.device = resolve_offload_device(device, "activation offload")
        self._cuda = self.device.type == "cuda"
        if streams is not None and torch.device(streams.device) != self.device:
            raise DeviceError(f"streams are for {streams.device}, the offloader for {self.device}",
                              hint="Pass the streams of the offloader's device, or none.")
        self._streams = streams if streams is not None else transfer_streams(self.device)
        self._pool: MemoryPool | None = None
        self._lock = threading.RLock()
        self._counters = Counters()
        # Offloaded tensors in pack order (weak: autograd owns them); index i lives at
        # position i - _first_index. Prefetch walks it downwards from the unpacked tensor.
        self._order: list[weakref.ref[_Offloaded]] = []
        self._first_index = 0
        self._next_index = 0
        # Device tensors whose copy may still run, oldest first, and their bytes.
        self._in_flight: deque[_Held] = deque()
        self._in_flight_bytes = 0
        # The same tensor saved twice within one forward: key -> (tensor ref, handle ref).
        self._seen: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor],
                                                weakref.ref[_Offloaded]]] = {}
        # (block, capacity, tensor, event, ahead generation, ahead bytes) left by dead handles;
        # appended without the lock.
        self._orphans: deque[tuple[Block | None, int, torch.Tensor | None, Any, int, int]] = (
            deque())
        # Host blocks whose copies are issued, kept for the next forward pass instead of going
        # back to the pool: nbytes -> [(block, event of its last host->device copy or None,
        # forward pass it was freed in)], oldest first. The pool would park a freed pinned block
        # until the *host* sees its copy complete, and the host runs a step ahead of the GPU:
        # every step's offloads would miss and grow the pool (cudaHostRegister). Reusing the
        # block needs only a GPU-side wait of the next device->host copy on that event.
        self._spares: dict[int, deque[tuple[Block, Any, int]]] = {}
        self._spare_bytes = 0
        self._forward_passes = 0
        # Backward's prefetch window: the next pack index to consider (walking down; None until
        # the first unpack after a forward), and what is loaded ahead of use in generation
        # ``_ahead_gen`` (bumped when the window restarts).
        self._cursor: int | None = None
        self._ahead_gen = 0
        self._ahead_count = 0
        self._ahead_bytes = 0
        # Originals handed to backward, by handle index, until the handle dies (or the next
        # forward starts: a graph kept with retain_graph then reloads from its host copy).
        self._originals: dict[int, torch.Tensor] = {}
        self._hooks: Any = None

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> ActivationOffloader:
        if self._hooks is not None:
            raise OffloadError("this ActivationOffloader is already active",
                               hint="Enter an offloader once at a time (nesting it is "
                                    "meaningless: the innermost hooks win).")
        with self._lock:
            self._trim_order()
            self._originals.clear()
            self._forward_passes += 1
            self._release_spares(self._forward_passes - 1)
            self._cursor = None
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks = hooks
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # In-flight copies stay as they are: the last tensors saved are the first backward
        # needs, and if their device memory is still held they are used without a round trip.
        hooks, self._hooks = self._hooks, None
        self._seen.clear()
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)

    @property
    def active(self) -> bool:
        """Whether the hooks are installed (inside the ``with`` block)."""
        return self._hooks is not None

    # -- observation ---------------------------------------------------------------------------

    @property
    def pool(self) -> MemoryPool | None:
        """The pinned (CUDA) or host (CPU) pool of offloaded bytes; ``None`` before first use."""
        return self._pool

    @property
    def streams(self) -> Streams:
        """The copy streams in use."""
        return self._streams

    def stats(self) -> ActivationOffloadStats:
        """A snapshot of the counters.

        Returns:
            An :class:`ActivationOffloadStats`.
        """
        with self._lock:
            self._free_orphans()
            return self._counters.snapshot(self._spare_bytes)

    def reset_stats(self) -> None:
        """Zero every counter; the peak restarts from the bytes held now."""
        with self._lock:
            self._counters = Counters(self._counters.pinned_bytes)

    def trim(self) -> int:
        """Give memory back: device tensors still held for their copy (the compute stream waits
        for those copies), what dropped graphs left behind, the host blocks kept for reuse, and
        the pool's unused segments (segments whose blocks' copies the host has not yet seen
        complete stay until a later ``trim``).

        Returns:
            Bytes released by the pool (0 before the pool exists).
        """
        with self._lock:
            self._release_in_flight(0)
            self._originals.clear()
            self._free_orphans()
            self._release_spares(None)
            self._trim_order()
            pool = self._pool
        return pool.trim() if pool is not None else 0

    def __repr__(self) -> str:
        c = self._counters
        return (f"ActivationOffloader(device={self.device}, active={self.active}, offloaded="
                f"{c.offloaded_tensors} ({format_size(c.offloaded_bytes)}), pinned="
                f"{format_size(c.pinned_bytes)})")

    # -- pack: forward -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        reason = self._keep_reason(t)
        if reason is not None:
            with self._lock:
                setattr(self._counters, reason, getattr(self._counters, reason) + 1)
                self._counters.kept_bytes += t.numel() * t.element_size()
            return t
        span, keep_strides = _layout(t)
        nbytes = span * t.element_size()
        if nbytes < self.config.min_bytes or nbytes == 0:
            with self._lock:
                self._counters.kept_small += 1
                self._counters.kept_bytes += nbytes
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype, t._version)
        with self._lock:
            if self._orphans:
                self._free_orphans()
            seen = self._seen.get(key)
            if seen is not None:
                source, handle = seen[0](), seen[1]()
                # The original still alive means its memory was not reused by another tensor.
                if source is not None and handle is not None:
                    self._counters.deduplicated += 1
                    handle.shared = True
                    return handle
            handle = self._offload(t, span, keep_strides, nbytes)
            if handle is None:
                self._counters.kept_over_cap += 1
                self._counters.kept_bytes += nbytes
                return t
            self._seen[key] = (handle.source, weakref.ref(handle))
            held = _Held(handle, t, nbytes)
            handle.held = weakref.ref(held)
            self._in_flight.append(held)
            self._in_flight_bytes += nbytes
            self._release_in_flight(self.config.max_inflight_bytes)
            return handle

    def _keep_reason(self, t: torch.Tensor) -> str | None:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return "kept_parameters"
        if (type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device
                or t.is_conj() or t.is_neg() or t.is_quantized):
            return "kept_unsupported"
        return None

    def _offload(self, t: torch.Tensor, span: int, keep_strides: bool,
                 nbytes: int) -> _Offloaded | None:
        """Start the device->host copy of ``t``; ``None`` when the pinned cap leaves no room."""
        counters = self._counters
        cap = self.config.max_pinned_bytes
        capacity = -(-nbytes // _POOL_ALIGNMENT) * _POOL_ALIGNMENT
        if cap is not None and counters.pinned_bytes + capacity > cap:
            return None
        block, last_read = self._take_block(nbytes)
        if block is None:
            return None
        streams = self._streams
        shape = tuple(t.shape)
        host = block.view((span,), t.dtype)
        if keep_strides:
            stride = tuple(t.stride())
            source = t.detach().as_strided((span,), (1,), t.storage_offset())
        else:
            stride = _contiguous_strides(shape)
            source = t.detach()
            host = host.view(shape)
        d2h = streams.d2h
        if last_read is not None:  # a reused block: its previous tensor's load must be done
            streams.wait(d2h, last_read)
        ready = streams.event()
        streams.record(ready, streams.current())
        streams.wait(d2h, ready)
        index = self._next_index
        with torch.no_grad():
            streams.copy(host, source, d2h, f"d2h:{index}")
        stored = streams.event()
        streams.record(stored, d2h)
        if self._cuda:
            # Freed (after backward or with a dropped graph) only once the copy into it is done.
            block.record_stream(d2h)
        handle = _Offloaded(self, index, t, shape, stride, span, block)
        handle.stored = stored
        self._next_index = index + 1
        self._cursor = None  # a new forward pass: backward's window starts from the top again
        originals = self._originals
        self._order.append(weakref.ref(handle, lambda _, i=index: originals.pop(i, None)))
        counters.offloaded_tensors += 1
        counters.offloaded_bytes += nbytes
        counters.pinned_bytes += block.capacity
        if counters.pinned_bytes > counters.pinned_peak_bytes:
            counters.pinned_peak_bytes = counters.pinned_bytes
        return handle

    def _release_in_flight(self, limit: int) -> None:
        """Let go of the oldest device tensors until at most ``limit`` bytes are held.

        The compute stream waits (on the GPU) for each one's copy first, so the caching allocator
        may hand the memory to the next kernel at once, in stream order. (``record_stream`` would
        instead hold the memory until the *host* sees the copy complete, and the host runs far
        ahead of the GPU during a forward pass: nothing would be freed before its end.) A tensor
        whose handle is gone needs no wait: nobody will read its host copy.
        """
        in_flight, streams = self._in_flight, self._streams
        compute = None
        while self._in_flight_bytes > limit and in_flight:
            held = in_flight.popleft()
            self._in_flight_bytes -= held.nbytes
            handle = held.handle()
            if held.tensor is not None and handle is not None and handle.state == _IN_FLIGHT:
                if compute is None:
                    compute = streams.current()
                streams.wait(compute, handle.stored)
                handle.state = _ON_HOST
                self._counters.released += 1
            held.tensor = None

    def _take_block(self, nbytes: int) -> tuple[Block | None, Any]:
        """A host block of ``nbytes`` and the event its last reader recorded (or ``None``).

        A spare of that exact size first (the common case from the second step on: no pool call,
        no event query); else a pool block. When the pool is at its cap, the spares go back to
        it first. ``(None, None)`` when nothing fits.
        """
        bucket = self._spares.get(nbytes)
        if bucket:
            block, last_read, _ = bucket.popleft()
            if not bucket:
                del self._spares[nbytes]
            self._spare_bytes -= block.capacity
            self._counters.reused_blocks += 1
            return block, last_read
        pool = self._pool if self._pool is not None else self._create_pool()
        try:
            block = pool.allocate(nbytes)
        except PoolExhaustedError:
            if not self._spares:
                # Under the cap by our count, but blocks whose host->device copy is still
                # running (pending in the pool) or fragmentation fill it: keep it on the device.
                return None, None
            self._release_spares(None)
            try:
                block = pool.allocate(nbytes)
            except PoolExhaustedError:
                return None, None
        self._counters.pool_allocations += 1
        return block, None

    def _recycle(self, block: Block, last_read: Any) -> None:
        """Keep a block whose copies are issued for the next offload of the same size."""
        bucket = self._spares.get(block.nbytes)
        if bucket is None:
            bucket = self._spares[block.nbytes] = deque()
        bucket.append((block, last_read, self._forward_passes))
        self._spare_bytes += block.capacity

    def _release_spares(self, older_than: int | None) -> None:
        """Give spares back to the pool: all (``None``), or those freed before forward pass
        ``older_than`` (a whole forward pass went by without a use for them: the shapes
        changed)."""
        cuda, streams = self._cuda, self._streams
        for nbytes in list(self._spares):
            bucket = self._spares[nbytes]
            while bucket and (older_than is None or bucket[0][2] < older_than):
                block, _, _ = bucket.popleft()
                self._spare_bytes -= block.capacity
                if cuda:
                    # The pool reuses it once the host sees both copy streams past this point.
                    block.record_stream(streams.h2d)
                    block.record_stream(streams.d2h)
                block.free()
            if not bucket:
                del self._spares[nbytes]

    def _create_pool(self) -> MemoryPool:
        config = PoolConfig(max_size=self.config.max_pinned_bytes,
                            growth_factor=_POOL_GROWTH_FACTOR,
                            max_cached_buffers=_POOL_CACHED_PER_SIZE, alignment=_POOL_ALIGNMENT,
                            defrag_threshold=1.0)
        pool = MemoryPool.pinned(config) if self._cuda else MemoryPool("cpu", config)
        self._pool = pool
        logger.debug("%s: created %s", self, pool)
        return pool

    # -- unpack: backward ----------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed  # kept on the device
        handle = packed
        with self._lock:
            if self._orphans:
                self._free_orphans()
            source = handle.source()
            if source is not None and source._version != handle.version:
                raise OffloadError(
                    f"a tensor of shape {list(handle.shape)} saved for backward was modified in "
                    f"place after it was offloaded (version {handle.version} -> "
                    f"{source._version})",
                    hint="Autograd needs the value it saved: avoid the in-place operation, or "
                         "clone the tensor before modifying it.")
            if not handle.unpacked:
                handle.unpacked = True
                if handle.ahead_gen == self._ahead_gen:
                    self._ahead_count -= 1
                    self._ahead_bytes -= handle.ahead_bytes
                if handle.state == _IN_FLIGHT:
                    self._counters.device_hits += 1
                    original = self._take_original(handle)
                    self._prefetch(handle.index, handle.shared)
                    return original
                if handle.state == _ON_HOST:
                    self._counters.on_demand_loads += 1
                    self._load(handle)
                else:
                    self._counters.prefetch_hits += 1
                self._prefetch(handle.index, handle.shared)
            elif handle.state == _ORIGINAL:  # unpacked again (saved twice, or retain_graph)
                original = self._originals.get(handle.index)
                if original is not None:
                    return original
                self._load(handle)  # the original is gone; the host copy was kept for this
            result, loaded = handle.result, handle.loaded
        if result is None:  # pragma: no cover - every path above sets it
            raise OffloadError("internal error: an offloaded tensor has no device copy",
                               hint="This is a vramkit bug in activation offloading; please report "
                                    "it, and run without the ActivationOffloader meanwhile.")
        self._streams.wait(self._streams.current(), loaded)
        return result

    def _take_original(self, handle: _Offloaded) -> torch.Tensor:
        """Backward wants a tensor whose device memory is still held: use it, skip the copies.

        The queue lets go of it (backward owns it now). The host block stays until the handle
        dies, in case backward asks again after the original is gone (``retain_graph``).
        """
        held = handle.held() if handle.held is not None else None
        original = held.tensor if held is not None else None
        if held is not None:
            held.tensor = None
            self._in_flight_bytes -= held.nbytes
            held.nbytes = 0
        if original is None:  # pragma: no cover - an in-flight handle's tensor is queued
            raise OffloadError("internal error: an in-flight tensor left the queue",
                               hint="This is a vramkit bug in the activation offload queue; please "
                                    "report it, and run without the ActivationOffloader meanwhile.")
        if self._cuda:
            # Backward frees it whenever it likes; the copy may still be reading it and the host
            # copy must stay valid for a reload. Only the last tensors of a forward pass take
            # this (host-timed) path, and their copies are nearly done by then.
            original.record_stream(self._streams.d2h)
        handle.state = _ORIGINAL
        # Kept for further unpacks of the same handle (a tensor saved by several nodes) until
        # the handle dies -- by the offloader, not the handle (see _Held).
        self._originals[handle.index] = original
        return original

    def _load(self, handle: _Offloaded) -> None:
        """Issue the host->device copy of ``handle`` and free its host block (stream-ordered)."""
        block = handle.block
        if block is None:  # pragma: no cover - a live handle on the host holds its block
            raise OffloadError("internal error: an offloaded tensor lost its host copy",
                               hint="This is a vramkit bug (a host copy freed too early); please "
                                    "report it, and run without the ActivationOffloader meanwhile.")
        streams = self._streams
        h2d = streams.h2d
        compute = streams.current()
        # Allocated on the compute stream, which will use and free it; h2d writes it only after
        # the compute stream's earlier work, which may still use the memory's previous owner.
        flat = torch.empty((handle.span,), dtype=handle.dtype, device=self.device)
        allocated = streams.event()
        streams.record(allocated, compute)
        streams.wait(h2d, allocated)
        streams.wait(h2d, handle.stored)
        streams.copy(flat, block.view((handle.span,), handle.dtype), h2d, f"h2d:{handle.index}")
        loaded = streams.event()
        streams.record(loaded, h2d)
        self._recycle(block, loaded)
        handle.block = None
        handle.stored = None
        handle.loaded = loaded
        if (handle.span == math.prod(handle.shape)
                and handle.stride == _contiguous_strides(handle.shape)):
            handle.result = flat.view(handle.shape)
        else:
            handle.result = flat.as_strided(handle.shape, handle.stride)
        handle.state = _LOADED
        counters = self._counters
        counters.loaded_bytes += handle.nbytes
        counters.pinned_bytes -= handle.capacity

    def _prefetch(self, index: int, out_of_order: bool = False) -> None:
        """Keep ``prefetch`` tensors and ``prefetch_bytes`` bytes on their way back ahead of use.

        The window walks down the pack order from a cursor that starts at the newest tensor, not
        from the one just unpacked: a backward node unpacks its saved tensors in *forward*
        order (attention asks for q before k, v and its output), so the tensors above the one
        asked for are needed next too. When backward asks for a tensor at or below the cursor
        the window fell behind (or backward skipped part of the graph): its count restarts and
        it goes on from the cursor, so the tensors between (that node's others) come first.

        A tensor saved by several nodes (``out_of_order``: FLUX's rotary embedding, an input of
        every checkpointed block) is asked for first by the last of them, far below the cursor,
        while the window still holds what comes next: that is no sign of the window falling
        behind, and a restart there would load a second window beside the first (measured on
        FLUX.1-dev at 15.5 GiB: 851 MB of restored tensors alive at the peak against a 256 MiB
        window, one restart for each of the embedding's two tensors).
        """
        config = self.config
        if config.prefetch == 0 and config.prefetch_bytes == 0:
            return
        cursor = self._cursor
        if cursor is None or (index <= cursor and not out_of_order):
            # A new backward pass, or one that outran its window: count afresh (tensors counted
            # before and never asked for must not hold the window shut).
            if cursor is None:
                cursor = self._next_index - 1
            self._ahead_gen += 1
            self._ahead_count = self._ahead_bytes = 0
        order, first, gen = self._order, self._first_index, self._ahead_gen
        while ((self._ahead_count < config.prefetch or self._ahead_bytes < config.prefetch_bytes)
               and cursor >= first):
            handle = order[cursor - first]()
            cursor -= 1
            if handle is None or handle.unpacked or handle.ahead_gen == gen:
                continue
            if handle.state == _ON_HOST:
                self._load(handle)
            # Still held on the device: ready, and it costs the link nothing.
            nbytes = 0 if handle.state == _IN_FLIGHT else handle.nbytes
            handle.ahead_gen, handle.ahead_bytes = gen, nbytes
            self._ahead_count += 1
            self._ahead_bytes += nbytes
        self._cursor = cursor

    # -- housekeeping (under the lock) ---------------------------------------------------------

    def _free_orphans(self) -> None:
        orphans, streams = self._orphans, self._streams
        while orphans:
            block, capacity, tensor, loaded, ahead_gen, ahead_bytes = orphans.popleft()
            if ahead_gen == self._ahead_gen:  # counted in the window, never unpacked
                self._ahead_count -= 1
                self._ahead_bytes -= ahead_bytes
            if block is not None:
                # Only its device->host copy touched it (a loaded block was recycled by
                # _load): the next copy into it is on the same stream, so no event is needed.
                self._recycle(block, None)
                self._counters.pinned_bytes -= capacity
            if tensor is not None:
                streams.wait(streams.current(), loaded)
                del tensor  # now in stream order after the copy that wrote it

    def _trim_order(self) -> None:
        order = self._order
        dead = 0
        while dead < len(order) and order[dead]() is None:
            dead += 1
        if dead:
            del order[:dead]
            self._first_index += dead


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def offload_activations(config: ActivationOffloadConfig | None = None, *,
                        device: str | int | torch.device | None = None) -> ActivationOffloader:
    """An :class:`ActivationOffloader`, to use as a context manager around a forward pass.

    ``with offload_activations(): loss = model(x)`` works for one step; for a training loop,
    keep the returned object and enter it every step, so its pinned pool is reused.

    Args:
        config: the settings (default ``ActivationOffloadConfig()``).
        device: the CUDA device (default: the current one) or ``"cpu"`` for the host mechanics.

    Returns:
        A new, inactive :class:`ActivationOffloader`.
    """
    return ActivationOffloader(config, device=device)
