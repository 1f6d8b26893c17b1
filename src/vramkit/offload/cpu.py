"""CPUOffloadManager: park weights in pinned host memory and bring them to the GPU on demand.

The seed API (EriDiffusion's ``CPUOffloadManager``): ``offload_weights(weights, keep_on_gpu)``,
``load_to_gpu(names)``, ``clear_inactive()``. It suits models whose parts run at distinct times
(a UNet's down/mid/up stages, a text encoder used once per prompt); stacks of repeated blocks
that run every step are better served by :class:`vramkit.offload.swap.BlockSwapper`, which
prefetches on its own and keeps a fixed GPU ring instead of allocating per load.

How it works:

* **Host masters.** Each :meth:`CPUOffloadManager.offload_weights` call takes *one* allocation
  from the host pool (pinned when the device is CUDA) and lays every offloaded tensor of that
  call out in it at 256-byte offsets: one page-locked registration per call, host bytes within
  a few hundred bytes per tensor of the offloaded bytes, nothing allocated per step.
* **Identity.** A tensor is never replaced, only its storage: ``tensor.data`` becomes a
  placeholder (a 0-dim tensor on the device expanded to the tensor's shape, so it costs no
  memory and any in-place write to it raises) and later the loaded device copy. ``Parameter``
  objects, and so optimizers built before offloading, keep working. State dicts work the same
  way: the dict's tensor objects are the ones repointed (a ``model.state_dict()`` holds aliases
  of the model's storage, so offloading it releases nothing while the model lives).
* **Loads.** :meth:`~CPUOffloadManager.load_to_gpu` allocates the device copies on the shared
  host->device copy stream (:func:`vramkit.memory.transfer.transfer_streams`), copies
  non-blocking from the pinned masters, records one event, and either makes the *current*
  stream wait on it (on the GPU; no host synchronization) or hands it back in a
  :class:`LoadHandle` so the caller can overlap the copy with compute.
* **Active set.** Loading marks tensors active; :meth:`~CPUOffloadManager.release` marks them
  inactive; :meth:`~CPUOffloadManager.clear_inactive` drops the device copies of loaded, inactive
  tensors (``record_stream`` keeps the caching allocator from reusing memory the current stream
  may still read). Tensors loaded on demand by ``auto_load`` are loaded inactive.
* **Write-back.** Frozen, unmodified weights only ever travel host->device. When cleared, a
  tensor is copied device->host into its master (on the device->host stream) if, while loaded,
  its autograd version counter moved (in-place ops; foreach and single-tensor ``torch.optim``
  steps), it received a gradient or still holds one (fused optimizers, ``fused=True``, step
  without bumping the counter), or it is a buffer whose module ran a training-mode forward
  (BatchNorm updates running statistics without bumping it). The next load of it waits for
  that copy on the GPU, so clearing needs no host sync either.
  ``CPUOffloadConfig(writeback="trainable")`` also copies back every tensor with
  ``requires_grad`` (for code that mutates ``param.data``, which the counter does not see).
* **Safety nets.** Modules that own offloaded tensors get a forward pre-hook: a forward that
  would read an unloaded tensor raises :class:`~vramkit.errors.OffloadError` (or loads it, with
  ``auto_load=True``), and a forward after ``load_to_gpu(..., wait=False)`` waits for the copy.
  Clearing bumps each tensor's version counter, so a backward pass that still needs a cleared
  weight raises PyTorch's "modified by an inplace operation" error instead of computing with
  the placeholder: clear after backward, not between forward and backward.

Gradients are not offloaded: ``param.grad`` stays on the device (use
``optimizer.zero_grad(set_to_none=True)``). While a module's tensors are offloaded,
``module.state_dict()`` returns the host masters of the unloaded ones (CPU tensors, current
values) and ``module.load_state_dict()`` writes into them (``vramkit.offload._state_dict``);
loaded tensors go through PyTorch as usual. Keep the manager alive while it holds tensors (it
owns the only copy of their values). One manager is
meant to be driven from one thread and one compute stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.layout import aligned_offsets
from vramkit.memory.pool import Block, MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams, resolve_offload_device, transfer_streams
from vramkit.offload import _patch
from vramkit.offload._cpu_records import (
    CPUOffloadConfig,
    CPUOffloadStats,
    GradSeen,
    LoadHandle,
    Record,
    as_patterns,
    matches,
)
from vramkit.offload._state_dict import MasterTensor, install_master_hooks
from vramkit.units import format_size

__all__ = ["CPUOffloadConfig", "CPUOffloadManager", "CPUOffloadStats", "LoadHandle"]

logger = logging.getLogger(__name__)

class _LoadingForward(_patch.MethodWrapper):
    """The ``forward`` of a module with offloaded tensors: loads them (or refuses) first."""

    __slots__ = ("buffers", "manager", "module", "qualname", "records")

    kind = "cpu_offload"

    def __init__(self, manager: CPUOffloadManager, module: nn.Module, qualname: str,
                 records: list[Record], buffers: list[Record]) -> None:
        super().__init__()
        self.manager = manager
        self.module = module
        self.qualname = qualname
        self.records = records
        self.buffers = buffers

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.active:
            self.manager._ensure_loaded(self.module, self.qualname, self.records, self.buffers)
        return self.inner(*args, **kwargs)


class CPUOffloadManager:
    """Keeps chosen weights in pinned host memory and loads them to the device when asked.

    Args:
        device: the compute device, ``"cuda"`` / ``"cuda:N"`` (default ``"cuda"``, the current
            device) or ``"cpu"`` (host copies in a plain host pool, synchronous stand-in streams;
            for tests and CPU-only machines).
        pinned_pool: the host pool for the masters (default: a pool the manager creates,
            page-locked on CUDA, growing by exactly what each offload call needs). On a CUDA
            device it must be pinned: copies from pageable memory are not asynchronous.
        config: the manager's settings (default ``CPUOffloadConfig()``).

    Raises:
        ConfigError: for an invalid config, a pageable or device pool, or ``max_host_bytes``
            together with ``pinned_pool``.
        DeviceError: when CUDA is asked for but unavailable.

    Example:
        >>> mgr = CPUOffloadManager("cuda")                              # doctest: +SKIP
        >>> mgr.offload_weights(unet, keep_on_gpu=["down_blocks.0", "mid_block"])  # doctest: +SKIP
        >>> mgr.load_to_gpu(["up_blocks.3"])                              # doctest: +SKIP
        >>> mgr.release(); mgr.clear_inactive()                           # doctest: +SKIP
    """

    def __init__(self, device: str | int | torch.device = "cuda", *,
                 pinned_pool: MemoryPool | None = None,
                 config: CPUOffloadConfig | None = None) -> None:
        if config is None:
            config = CPUOffloadConfig()
        elif not isinstance(config, CPUOffloadConfig):
            raise ConfigError(f"config must be a CPUOffloadConfig, got {type(config).__name__}",
                              hint="Pass a CPUOffloadConfig, e.g. CPUOffloadManager('cuda', "
                                   "config=CPUOffloadConfig()), or leave config out for the "
                                   "defaults.")
        self.config = config
        self.device = resolve_offload_device(device, "CPUOffloadManager")
        if pinned_pool is not None:
            _check_pool(pinned_pool, self.device, config)
        self._host_pool = pinned_pool
        self._owns_pool = pinned_pool is None
        self._streams: Streams = transfer_streams(self.device)
        self._records: dict[str, Record] = {}  # primary name -> record
        self._by_name: dict[str, Record] = {}  # every name (aliases too) -> record
        self._by_id: dict[int, Record] = {}
        self._blocks: list[Block] = []
        self._host_bytes = 0
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._wrappers: list[tuple[nn.Module, _LoadingForward]] = []
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._closed = False
        self._loads = self._writebacks = 0
        self._h2d_bytes = self._d2h_bytes = self._released_bytes = 0

    # -- offloading -------------------------------------------------------------------------

    def offload_weights(self, weights: nn.Module | Mapping[str, torch.Tensor],
                        keep_on_gpu: str | Iterable[str] | None = None, *,
                        prefix: str = "") -> list[str]:
        """Move every tensor not matched by ``keep_on_gpu`` to a host master and free its device
        storage; move the kept ones to the device.

        Args:
            weights: a module (its parameters and buffers) or a mapping of name -> tensor (its
                tensor objects are repointed in place; the mapping itself is not changed).
            keep_on_gpu: name patterns of tensors to keep on the device: an exact name, a
                prefix (``"down_blocks.0"`` covers ``"down_blocks.0.weight"``) or an
                ``fnmatch`` glob, matched against names relative to ``weights``. A tied tensor
                is kept when any of its names matches. Default: keep nothing.
            prefix: prepended to every name the manager registers (for several modules whose
                names collide, e.g. ``"unet."``); default ``""``.

        Returns:
            The names of the offloaded tensors (for tied tensors, the first name), in order.

        Raises:
            OffloadError: for a tensor already managed, a name already registered, a meta or
                non-strided tensor, or a manager that was restored.
            PoolExhaustedError: when the host pool cannot hold the masters (nothing is changed).
        """
        self._check_open()
        keep = as_patterns(keep_on_gpu, "keep_on_gpu")
        groups = self._collect(weights, prefix)
        offloaded: list[Record] = []
        kept: list[Record] = []
        for names, tensor in groups:
            relative = [name[len(prefix):] for name in names]
            keep_it = any(matches(name, pattern) for name in relative for pattern in keep)
            (kept if keep_it else offloaded).append(Record(names, tensor, keep_it))
        used = {p for p in keep if any(matches(n[len(prefix):], p) for r in kept for n in r.names)}
        for pattern in keep:
            if pattern not in used:
                logger.warning("keep_on_gpu pattern %r matches no tensor", pattern)
        block = self._allocate_masters(offloaded)  # first: a failure here changes nothing
        for record in kept:
            if record.tensor.device != self.device:
                record.tensor.data = record.tensor.data.to(self.device)
        self._copy_to_masters(offloaded)
        for record in offloaded:
            self._drop_device_storage(record)
        for record in offloaded + kept:
            self._register(record)
        for record in offloaded:
            tensor = record.tensor
            if tensor.requires_grad and tensor.is_leaf:
                self._hooks.append(tensor.register_post_accumulate_grad_hook(
                    GradSeen(record)))
        if block is not None:
            self._blocks.append(block)
        if isinstance(weights, nn.Module) and offloaded:
            self._install_hooks(weights, {id(r.tensor) for r in offloaded})
        logger.info("offloaded %d tensors (%s) to host, kept %d on %s", len(offloaded),
                    format_size(sum(r.nbytes for r in offloaded)), len(kept), self.device)
        return [r.name for r in offloaded]

    def _collect(self, weights: nn.Module | Mapping[str, torch.Tensor],
                 prefix: str) -> list[tuple[list[str], torch.Tensor]]:
        if isinstance(weights, nn.Module):
            items: Iterable[tuple[str, Any]] = [
                *weights.named_parameters(remove_duplicate=False),
                *weights.named_buffers(remove_duplicate=False)]
        elif isinstance(weights, Mapping):
            items = weights.items()
        else:
            raise OffloadError(f"offload_weights expects an nn.Module or a mapping of name -> "
                               f"tensor, got {type(weights).__name__}",
                               hint="Pass a module (manager.offload_weights(model.text_encoder)) "
                                    "or a dict such as model.state_dict().")
        by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise OffloadError(f"{name!r} is a {type(tensor).__name__}, not a tensor",
                                   hint="Pass a mapping of name -> torch.Tensor.")
            full = prefix + name
            if full in self._by_name:
                raise OffloadError(f"{full!r} is already managed by this manager",
                                   hint="Offload each tensor once; use prefix= to tell apart "
                                        "modules whose names collide.")
            if id(tensor) in self._by_id:
                raise OffloadError(f"{full!r} is already managed (as "
                                   f"{self._by_id[id(tensor)].name!r})",
                                   hint="Offload each tensor once.")
            if tensor.device.type == "meta" or tensor.layout != torch.strided:
                raise OffloadError(f"{full!r} cannot be offloaded: it is a "
                                   f"{tensor.device.type} {tensor.layout} tensor",
                                   hint="Only materialized dense tensors can be offloaded.")
            entry = by_id.setdefault(id(tensor), ([], tensor))
            entry[0].append(full)
        return list(by_id.values())

    def _allocate_masters(self, records: list[Record]) -> Block | None:
        # Each tensor starts at calculate_alignment(its size): 256 bytes (DMA- and every
        # dtype's alignment) for all but tiny tensors, which pack tighter.
        offsets, total = aligned_offsets(record.nbytes for record in records)
        if total == 0:
            for record in records:
                record.master = torch.empty(record.tensor.shape, dtype=record.tensor.dtype)
            return None
        block = self._pool().allocate(total)
        if self.device.type == "cuda":
            # The pool must not reuse a master while a copy stream still reads or writes it.
            block.record_stream(self._streams.h2d)
            block.record_stream(self._streams.d2h)
        raw = block.tensor
        for record, offset in zip(records, offsets, strict=True):
            tensor = record.tensor
            if record.nbytes:
                view = raw[offset:offset + record.nbytes].view(tensor.dtype)
            else:
                view = torch.empty(0, dtype=tensor.dtype)
            record.master = view.view(tensor.shape)
        self._host_bytes += block.capacity
        return block

    def _copy_to_masters(self, records: list[Record]) -> None:
        streams = self._streams
        on_device = [r for r in records if r.tensor.device == self.device and r.nbytes]
        async_ids = {id(r) for r in on_device}
        for record in records:
            if id(record) not in async_ids:
                assert record.master is not None
                record.master.copy_(record.tensor.detach())  # host or foreign device: blocking
        if not on_device:
            return
        # The copy must see every write the compute stream has queued to these tensors.
        ready = streams.event()
        streams.record(ready, streams.current())
        streams.wait(streams.d2h, ready)
        for record in on_device:
            source = record.tensor.detach()
            assert record.master is not None
            streams.copy(record.master, source, streams.d2h, record.name)
            if source.is_cuda:
                source.record_stream(streams.d2h)  # freed storage is not reused mid-copy
            self._d2h_bytes += record.nbytes
        copied = streams.event()
        streams.record(copied, streams.d2h)
        for record in on_device:
            record.host_event = copied

    def _register(self, record: Record) -> None:
        self._records[record.name] = record
        self._by_id[id(record.tensor)] = record
        for name in record.names:
            self._by_name[name] = record

    # -- loading ----------------------------------------------------------------------------

    def load_to_gpu(self, names_or_patterns: str | Iterable[str], *,
                    wait: bool = True) -> LoadHandle:
        """Copy offloaded tensors to the device (non-blocking, on the shared copy stream) and
        mark them active. Tensors already loaded are not copied again.

        Args:
            names_or_patterns: names, prefixes or ``fnmatch`` globs of managed tensors (kept
                tensors may be named; they are already on the device).
            wait: make the current stream wait for the copies before returning (on the GPU;
                the host does not block). With ``False`` the caller must call
                ``handle.wait()`` before using the tensors outside a module forward (the
                forward pre-hook waits by itself). Default ``True``.

        Returns:
            A :class:`LoadHandle` (``.event``, ``.wait()``, ``.done()``, ``.tensors``).

        Raises:
            OffloadError: when a pattern matches no managed tensor, or after :meth:`restore`.
        """
        self._check_open()
        records = self._resolve(names_or_patterns)
        offloaded = [r for r in records if not r.kept]
        event = self._load(offloaded)
        for record in offloaded:
            record.active = True
        handle = LoadHandle(self, records, event,
                            {r.name: r.tensor for r in records})
        if wait:
            handle.wait()
        return handle

    def _load(self, records: list[Record]) -> Any:
        missing = [r for r in records if r.device_copy is None]
        if not missing:
            return None
        streams = self._streams
        pending = {id(r.host_event): r.host_event for r in missing if r.host_event is not None}
        for host_event in pending.values():  # a write-back into the master must land first
            streams.wait(streams.h2d, host_event)
        # Allocated on the copy stream: the caching allocator then orders reuse of this memory
        # after the copy; clear() records the compute stream's use before dropping it.
        with streams.on(streams.h2d):
            copies = [torch.empty(r.tensor.shape, dtype=r.tensor.dtype, device=self.device)
                      for r in missing]
        for record, copy in zip(missing, copies, strict=True):
            assert record.master is not None
            streams.copy(copy, record.master, streams.h2d, record.name)
        event = streams.event()
        streams.record(event, streams.h2d)
        for record, copy in zip(missing, copies, strict=True):
            record.device_copy = copy
            record.tensor.data = copy
            record.load_event = event
            record.loaded_version = record.tensor._version
            record.trained = False
            record.got_grad = False
            self._loads += 1
            self._h2d_bytes += record.nbytes
        return event

    def _wait_loads(self, records: Iterable[Record]) -> None:
        streams = self._streams
        current = streams.current()
        waited: set[int] = set()
        for record in records:
            event = record.load_event
            if event is None:
                continue
            if id(event) not in waited:
                streams.wait(current, event)
                waited.add(id(event))
            record.load_event = None

    # -- clearing ---------------------------------------------------------------------------

    def release(self, names_or_patterns: str | Iterable[str] | None = None) -> None:
        """Mark loaded tensors inactive, so the next :meth:`clear_inactive` drops them.

        Args:
            names_or_patterns: which tensors (names, prefixes, globs); ``None`` (default) means
                all of them.

        Raises:
            OffloadError: when a pattern matches no managed tensor, or after :meth:`restore`.
        """
        self._check_open()
        records = (list(self._records.values()) if names_or_patterns is None
                   else self._resolve(names_or_patterns))
        for record in records:
            record.active = False

    def clear_inactive(self) -> int:
        """Drop the device copies of loaded tensors that are not active, writing modified ones
        back to their host masters first (on the device->host stream; no host sync).

        Returns:
            Bytes of device copies dropped (memory is reused once the current stream is done
            with it).

        Raises:
            OffloadError: after :meth:`restore`.
        """
        self._check_open()
        victims = [r for r in self._records.values()
                   if not r.kept and r.device_copy is not None and not r.active]
        if not victims:
            return 0
        streams = self._streams
        current = streams.current()
        dirty = [r for r in victims if self._needs_writeback(r)]
        if dirty:
            ready = streams.event()
            streams.record(ready, current)  # the optimizer's updates are queued on this stream
            streams.wait(streams.d2h, ready)
            loads = {id(r.load_event): r.load_event for r in dirty if r.load_event is not None}
            for load_event in loads.values():  # a load the current stream never waited for
                streams.wait(streams.d2h, load_event)
            for record in dirty:
                assert record.master is not None and record.device_copy is not None
                streams.copy(record.master, record.device_copy, streams.d2h, record.name)
                if record.device_copy.is_cuda:
                    record.device_copy.record_stream(streams.d2h)
                self._d2h_bytes += record.nbytes
                self._writebacks += 1
            copied = streams.event()
            streams.record(copied, streams.d2h)
            for record in dirty:
                record.host_event = copied
        released = 0
        for record in victims:
            copy = record.device_copy
            assert copy is not None
            if copy.is_cuda:
                copy.record_stream(current)
            self._drop_device_storage(record)
            released += record.nbytes
        self._released_bytes += released
        logger.debug("cleared %d tensors (%s), %d written back", len(victims),
                     format_size(released), len(dirty))
        return released

    def _needs_writeback(self, record: Record) -> bool:
        tensor = record.tensor
        if tensor._version != record.loaded_version or record.trained or record.got_grad:
            return True
        if tensor.requires_grad and tensor.grad is not None:
            return True  # a gradient is waiting for (or just had) an optimizer step
        return self.config.writeback == "trainable" and tensor.requires_grad

    def _drop_device_storage(self, record: Record) -> None:
        tensor = record.tensor
        self._point_at_placeholder(record)
        record.device_copy = None
        record.load_event = None
        if not tensor.is_inference():
            # A backward pass that saved this tensor now fails loudly instead of reading the
            # placeholder (set_data alone keeps the version counter).
            torch.autograd.graph.increment_version(tensor)

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        placeholder = self._placeholders.get(dtype)
        if placeholder is None:
            placeholder = torch.empty((), dtype=dtype, device=self.device)
            self._placeholders[dtype] = placeholder
        return placeholder

    # -- forward hooks ----------------------------------------------------------------------

    def _install_hooks(self, module: nn.Module, offloaded_ids: set[int]) -> None:
        for qualname, sub in module.named_modules():
            params = [(a, self._by_id[id(t)]) for a, t in sub._parameters.items()
                      if t is not None and id(t) in offloaded_ids]
            buffers = [(a, self._by_id[id(t)]) for a, t in sub._buffers.items()
                       if t is not None and id(t) in offloaded_ids]
            if params or buffers:
                wrapper = _LoadingForward(self, sub, qualname, [r for _, r in params + buffers],
                                          [r for _, r in buffers])
                self._wrappers.append((sub, _patch.install(sub, wrapper)))
                # state_dict/load_state_dict read and write the masters of unloaded tensors.
                self._hooks += install_master_hooks(
                    sub, [MasterTensor([attr], r.tensor, partial(self._current_master, r),
                                       partial(self._point_at_placeholder, r))
                          for attr, r in params + buffers], qualname or type(sub).__name__)

    def _current_master(self, record: Record) -> torch.Tensor | None:
        """The host master when it holds the tensor's value (not loaded), else ``None``."""
        return None if record.device_copy is not None else self.host_tensor(record.name)

    def _point_at_placeholder(self, record: Record) -> None:
        tensor = record.tensor
        tensor.data = self._placeholder(tensor.dtype).expand(tensor.shape)

    def _ensure_loaded(self, module: nn.Module, qualname: str, records: list[Record],
                       buffers: list[Record]) -> None:
        """Before ``module``'s forward: its offloaded tensors are loaded (or an error says
        which are not, without ``auto_load``) and the compute stream waits for them."""
        missing = [r for r in records if r.device_copy is None]
        if missing:
            if not self.config.auto_load:
                names = ", ".join(r.name for r in missing[:4])
                more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
                raise OffloadError(
                    f"forward of {qualname or type(module).__name__!r} uses offloaded "
                    f"tensors that are not on {self.device}: {names}{more}",
                    hint="Call manager.load_to_gpu([...]) before this forward, or create "
                         "the manager with CPUOffloadConfig(auto_load=True).")
            self._load(missing)  # loaded inactive: clear_inactive() may drop them
        self._wait_loads(records)
        if module.training:
            # Running statistics (BatchNorm) are updated inside kernels that do not bump
            # the version counter, so a training-mode forward marks its buffers modified.
            for record in buffers:
                record.trained = True

    # -- queries ----------------------------------------------------------------------------

    def _resolve(self, names_or_patterns: str | Iterable[str]) -> list[Record]:
        patterns = as_patterns(names_or_patterns, "names_or_patterns")
        found: dict[int, Record] = {}
        for pattern in patterns:
            exact = self._by_name.get(pattern)
            hits = [exact] if exact is not None else [
                r for name, r in self._by_name.items() if matches(name, pattern)]
            if not hits:
                sample = ", ".join(list(self._records)[:5])
                raise OffloadError(f"{pattern!r} matches no tensor managed by this manager",
                                   hint=f"Managed names look like: {sample or '(none)'}.")
            for record in hits:
                found.setdefault(id(record), record)
        return list(found.values())

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Names of the offloaded tensors (first name of tied ones), in offload order."""
        return tuple(n for n, r in self._records.items() if not r.kept)

    @property
    def kept(self) -> tuple[str, ...]:
        """Names of the tensors kept on the device."""
        return tuple(n for n, r in self._records.items() if r.kept)

    @property
    def loaded(self) -> frozenset[str]:
        """Names of offloaded tensors that have a device copy now."""
        return frozenset(n for n, r in self._records.items() if r.device_copy is not None)

    @property
    def active(self) -> frozenset[str]:
        """Names of loaded tensors marked active (``clear_inactive`` keeps them)."""
        return frozenset(n for n, r in self._records.items()
                         if r.active and r.device_copy is not None)

    def host_tensor(self, name: str) -> torch.Tensor:
        """The host master of an offloaded tensor, after any pending copy into it has landed.

        Args:
            name: the tensor's name (any of its names when tied).

        Returns:
            A view of the master (pinned on CUDA). Writing into it changes what the next load
            brings to the device.

        Raises:
            OffloadError: for an unknown or kept name, or after :meth:`restore`.
        """
        self._check_open()
        record = self._by_name.get(name)
        if record is None or record.kept:
            raise OffloadError(f"{name!r} is not an offloaded tensor of this manager",
                               hint="See manager.offloaded for the names.")
        if record.host_event is not None:
            self._streams.synchronize(record.host_event)  # host reads must follow the DMA
            record.host_event = None
        assert record.master is not None
        return record.master

    def stats(self) -> CPUOffloadStats:
        """A snapshot of what is where and what has moved (no device work, no sync)."""
        offloaded = [r for r in self._records.values() if not r.kept]
        kept = [r for r in self._records.values() if r.kept]
        loaded = [r for r in offloaded if r.device_copy is not None]
        pinned = self._host_pool is not None and self._host_pool.kind == "pinned"
        return CPUOffloadStats(
            offloaded_tensors=len(offloaded),
            offloaded_bytes=sum(r.nbytes for r in offloaded),
            kept_tensors=len(kept),
            kept_bytes=sum(r.nbytes for r in kept),
            loaded_tensors=len(loaded),
            active_tensors=sum(1 for r in loaded if r.active),
            resident_bytes=sum(r.nbytes for r in kept + loaded),
            host_bytes=self._host_bytes,
            pinned_bytes=self._host_bytes if pinned else 0,
            loads=self._loads,
            writebacks=self._writebacks,
            h2d_bytes=self._h2d_bytes,
            d2h_bytes=self._d2h_bytes,
            released_bytes=self._released_bytes,
        )

    # -- restoring --------------------------------------------------------------------------

    def restore(self) -> None:
        """Put every managed tensor back where it was before offloading (same objects), remove
        the hooks and free the host masters. Calling it again does nothing; every other method
        then raises :class:`~vramkit.errors.OffloadError`.

        Tensors that were on the device come back as the current device copy (loaded ones keep
        their on-device updates); tensors that came from the host come back as host tensors.
        """
        if self._closed:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module, wrapper in reversed(self._wrappers):
            _patch.restore(module, wrapper)
        self._wrappers.clear()
        records = list(self._records.values())
        back_on_device = [r for r in records if not r.kept and r.orig_device == self.device]
        self._load(back_on_device)
        self._wait_loads(back_on_device)
        for record in records:
            tensor = record.tensor
            if record.kept:
                if tensor.device != record.orig_device:
                    tensor.data = tensor.data.to(record.orig_device)
            elif record.orig_device != self.device:
                if record.device_copy is not None:
                    self._wait_loads([record])
                    tensor.data = record.device_copy.to(record.orig_device)
                else:
                    if record.host_event is not None:
                        self._streams.synchronize(record.host_event)
                    assert record.master is not None
                    tensor.data = record.master.to(record.orig_device, copy=True)
            record.device_copy = None
            record.master = None
        for block in self._blocks:
            block.free()  # pending until the copy streams are done with it
        self._blocks.clear()
        if self._owns_pool and self._host_pool is not None:
            self._host_pool.clear()  # waits for those copies: a host sync, at teardown only
        self._host_pool = None
        self._host_bytes = 0
        self._records.clear()
        self._by_name.clear()
        self._by_id.clear()
        self._placeholders.clear()
        self._closed = True
        logger.info("restored %d tensors", len(records))

    def __enter__(self) -> CPUOffloadManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        if self._closed:
            return f"CPUOffloadManager({self.device}, restored)"
        s = self.stats()
        return (f"CPUOffloadManager({self.device}, offloaded={s.offloaded_tensors} "
                f"({format_size(s.offloaded_bytes)}), loaded={s.loaded_tensors}, "
                f"kept={s.kept_tensors})")

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this CPUOffloadManager was restored and manages nothing now",
                               hint="Create a new CPUOffloadManager to offload again.")

    def _pool(self) -> MemoryPool:
        if self._host_pool is None:
            # growth_factor=1.0: each offload call reserves what it needs, so host bytes track
            # offloaded bytes instead of doubling.
            pool_config = PoolConfig(growth_factor=1.0, max_size=self.config.max_host_bytes)
            if self.device.type == "cuda":
                self._host_pool = MemoryPool.pinned(pool_config)
            else:
                self._host_pool = MemoryPool("cpu", pool_config)
        return self._host_pool


def _check_pool(pool: object, device: torch.device, config: CPUOffloadConfig) -> None:
    if not isinstance(pool, MemoryPool):
        raise ConfigError(f"pinned_pool must be a MemoryPool, got {type(pool).__name__}",
                          hint="Pass pinned_pool=MemoryPool.pinned() (or MemoryPool('cpu')), or "
                               "leave it out to let the offloader create one.")
    if pool.kind == "cuda":
        raise ConfigError("pinned_pool is a device pool; the masters need a host pool",
                          hint="Pass MemoryPool.pinned(PoolConfig(...)).")
    if device.type == "cuda" and pool.kind != "pinned":
        raise ConfigError("pinned_pool holds pageable host memory: copies from it to the GPU "
                          "would be synchronous",
                          hint="Pass MemoryPool.pinned(PoolConfig(...)).")
    if config.max_host_bytes is not None:
        raise ConfigError("CPUOffloadConfig.max_host_bytes applies to the manager's own pool, "
                          "not to a pinned_pool passed in",
                          hint="Set PoolConfig(max_size=...) on that pool instead.")
