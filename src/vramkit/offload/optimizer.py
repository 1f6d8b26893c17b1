"""Optimizer state offload (ZeRO-Offload style): states on the host, stepped on the CPU.

:class:`CPUOffloadOptimizer` wraps any ``torch.optim.Optimizer`` class. For each accelerator
parameter it keeps an fp32 *master* copy in pinned host memory and builds the inner optimizer over
the masters, so the optimizer states (Adam's ``exp_avg`` / ``exp_avg_sq``: 8 bytes per parameter)
never touch the GPU. What happens in one training step:

1. **Backward** (``offload_gradients=True``): when a parameter's gradient is final, a
   ``post_accumulate_grad`` hook enqueues a device->host copy of it into a pinned staging buffer on
   the shared d2h copy stream (:func:`vramkit.memory.transfer.transfer_streams`; the copy waits,
   on the GPU, for the stream that produced the gradient) and drops the GPU gradient at once, so
   gradients never pile up on the GPU. A worker thread waits for each copy's event (on the worker,
   never on the main or autograd thread), converts the gradient to fp32 and -- with
   ``overlap=True`` -- steps that parameter on the CPU right away, while the GPU is still running
   the rest of backward.
2. **step()** waits for the worker (a host synchronization at the step boundary, the one place
   this class blocks), steps whatever was not stepped yet, then enqueues host->device copies of
   the updated masters (cast to the parameter dtype on the host, so bf16 parameters cost 2 bytes
   per element on the link) on the shared h2d stream; the current stream waits on their event, so
   the next forward sees the new weights without a host synchronization.

Modes:

* ``overlap=True`` (default): the CPU update overlaps backward. Each parameter is stepped as its
  gradient arrives, so gradient clipping by global norm (``max_grad_norm``) and accumulating
  gradients over several backward passes are impossible: the first is refused at construction
  (``ConfigError``), the second at the second backward (``OffloadError``).
* ``overlap=False``: gradients are accumulated on the host (fp32) over any number of backward
  passes; ``step()`` clips them when ``max_grad_norm`` is set and runs one inner step over all
  masters (vectorized, e.g. the fused CPU AdamW).
* ``offload_gradients=False``: gradients stay on the GPU (autograd accumulates them there, as
  usual); ``step()`` copies them to the host, and with ``overlap=True`` steps each parameter as its
  copy lands (overlapping the CPU update with the remaining transfers).

Parameters already on the host are supported too (the block swapper keeps swapped trainable
weights as host masters): an fp32 host parameter is its own master and is stepped in place with
its own ``.grad`` (no copies); a 16-bit host parameter gets an fp32 master like a GPU one, through
the same code path (on the CPU the "streams" are :class:`~vramkit.memory.transfer.HostStreams`,
which copy at once) -- which is how this module is unit-tested without a GPU.

Compared against: torchao's ``CPUOffloadOptimizer`` (one inner optimizer per parameter, CPU step
inside ``step()`` after all gradients landed, no overlap with backward; torchao is not a dependency
of vramkit) and DeepSpeed's ZeRO-Offload / ``DeepSpeedCPUAdam`` (needs the DeepSpeed engine and a
compiled extension). This implementation adds the overlap with backward, pinned masters from
:class:`~vramkit.memory.pool.MemoryPool` (one flat allocation per parameter group) and the copy
streams shared with the other offloaders; the CPU arithmetic is PyTorch's own (fused AdamW by
default), so results match ``torch.optim.AdamW`` on fp32 masters bit for bit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vramkit._validate import check_number
from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.pool import Block, MemoryPool, PoolConfig
from vramkit.memory.transfer import Streams, transfer_streams
from vramkit.offload._optimizer_records import (
    OptimizerOffloadStats,
    ParamSlot,
    aligned_size,
    host_master_dtype,
)

__all__ = ["CPUOffloadOptimizer", "OptimizerOffloadStats"]

logger = logging.getLogger(__name__)

_FUSED_BY_DEFAULT = (torch.optim.Adam, torch.optim.AdamW)  # CPU fused kernels: ~4x the for-loop


def _worker_loop(work: queue.SimpleQueue[ParamSlot | None],
                 owner: weakref.ReferenceType[CPUOffloadOptimizer]) -> None:
    # Holds only a weak reference between items, so a dropped optimizer is collected and its
    # finalizer's sentinel ends the thread.
    while True:
        slot = work.get()
        if slot is None:
            return
        optimizer = owner()
        if optimizer is None:
            return
        optimizer._process(slot)
        del optimizer


def _shutdown(work: queue.SimpleQueue[ParamSlot | None], slots: list[ParamSlot],
              blocks: list[Block]) -> None:
    work.put(None)
    for slot in slots:
        if slot.hook is not None:
            slot.hook.remove()
            slot.hook = None
    for block in blocks:
        if not block.freed:
            block.free()
    blocks.clear()


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """Keep an optimizer's states on the host and step it on the CPU (ZeRO-Offload style).

    A ``torch.optim.Optimizer`` subclass so learning-rate schedulers accept it; ``param_groups``,
    ``state`` and ``defaults`` are the inner optimizer's (whose parameters are the host masters).
    Gradient clipping must go through ``max_grad_norm``: with ``offload_gradients=True`` the GPU
    parameters have no ``.grad`` for ``clip_grad_norm_`` to see. ``torch.amp.GradScaler`` is not
    supported (train in bf16). Mixed precision: a bf16 GPU parameter is updated through its fp32
    master and receives ``master.to(bf16)``; gradients accumulated on the host add in fp32.

    Args:
        params: parameters or parameter groups, as for any torch optimizer. GPU parameters and
            host parameters may be mixed; each must be a floating-point leaf tensor.
        optimizer_class: the inner optimizer, built over the host masters (default
            ``torch.optim.AdamW``). For ``Adam``/``AdamW`` without ``fused``/``foreach`` in
            ``opt_kwargs``, ``fused=True`` is passed (the CPU fused kernel is ~4x the default).
        offload_gradients: copy each gradient to the host during backward and free it on the GPU
            (default ``True``); ``False`` leaves gradients on the GPU until ``step()``.
        overlap: step each parameter on a worker thread as soon as its gradient is on the host
            (default ``True``); ``False`` steps everything in ``step()``, which allows gradient
            accumulation and ``max_grad_norm``.
        max_grad_norm: clip gradients to this global L2 norm in ``step()`` (like
            ``torch.nn.utils.clip_grad_norm_``); default ``None`` (no clipping). Needs
            ``overlap=False``.
        pool: host pool for masters and staging buffers; default: a new pinned pool when any
            parameter is on an accelerator, else a plain host pool. Must be pinned for
            accelerator parameters (copies from pageable memory are synchronous).
        **opt_kwargs: hyperparameters for ``optimizer_class`` (``lr``, ``weight_decay``, ...).

    Raises:
        ConfigError: for an empty or invalid parameter list, an unsupported combination of
            options, a pageable pool, or hyperparameters the inner optimizer rejects.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3, overlap=False)
        >>> model(torch.ones(3, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.close()
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 offload_gradients: bool = True, overlap: bool = True,
                 max_grad_norm: float | None = None, pool: MemoryPool | None = None,
                 **opt_kwargs: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                              f"{optimizer_class!r}",
                              hint="Pass the class itself, not an instance, e.g. "
                                   "optimizer_class=torch.optim.AdamW.")
        check_number("max_grad_norm", max_grad_norm, minimum=0, low_open=True, allow_none=True)
        if max_grad_norm is not None:
            if overlap:
                raise ConfigError(
                    "max_grad_norm needs overlap=False: with overlap each parameter is stepped "
                    "as its gradient arrives, before the global norm is known",
                    hint="Pass overlap=False to clip by global norm.")
        self._optimizer_class = optimizer_class
        self._offload_gradients = bool(offload_gradients)
        self._overlap = bool(overlap)
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        # Host accumulation over several backward passes (only when nothing is stepped early).
        self._host_accumulation = self._offload_gradients and not self._overlap
        if (optimizer_class in _FUSED_BY_DEFAULT and "fused" not in opt_kwargs
                and "foreach" not in opt_kwargs):
            opt_kwargs["fused"] = True
        self._opt_kwargs = opt_kwargs

        groups = self._normalize_groups(params)
        self._slots: list[ParamSlot] = []
        self._blocks: list[Block] = []
        self._seen: set[int] = set()
        self._owns_pool = pool is None
        self._pool = pool if pool is not None else self._default_pool(groups)
        if self._pool.device.type != "cpu":
            raise ConfigError(f"pool must be a host pool, got one on {self._pool.device}",
                              hint="Use MemoryPool.pinned().")
        if self._pool.kind != "pinned" and any(p.device.type != "cpu" for g in groups
                                               for p in g["params"]
                                               if isinstance(p, torch.Tensor)):
            raise ConfigError("pool must be pinned when parameters live on an accelerator: "
                              "copies from pageable memory are synchronous",
                              hint="Use MemoryPool.pinned(), or leave pool=None.")

        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._work: queue.SimpleQueue[ParamSlot | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._grads_transferred = 0
        self._d2h_bytes = 0
        self._h2d_bytes = 0
        self._steps = 0
        self._cpu_seconds = 0.0
        self._wait_seconds = 0.0
        # Hooks and pool blocks are released when the optimizer is closed or collected.
        self._finalizer = weakref.finalize(self, _shutdown, self._work, self._slots, self._blocks)

        master_groups = [self._build_group(group, gi) for gi, group in enumerate(groups)]
        try:
            self._inner = optimizer_class(master_groups, **opt_kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            self.close()
            raise ConfigError(f"{optimizer_class.__name__} rejected its arguments: {exc}",
                              hint="Check the keyword arguments passed through to the "
                                   "optimizer class (lr, betas, weight_decay...) against "
                                   "its signature.") from exc
        for slot in self._slots:
            self._attach(slot)
        logger.debug("CPUOffloadOptimizer over %d params (%s, overlap=%s, offload_gradients=%s)",
                     len(self._slots), optimizer_class.__name__, self._overlap,
                     self._offload_gradients)

    # -- the torch.optim.Optimizer surface ------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (parameters are the host masters); schedulers drive them."""
        return self._inner.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The inner optimizer's state, keyed by host masters."""
        return self._inner.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults."""
        return self._inner.defaults

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer stepping the host masters."""
        return self._inner

    def __repr__(self) -> str:
        return (f"CPUOffloadOptimizer({self._optimizer_class.__name__}, params={len(self._slots)},"
                f" overlap={self._overlap}, offload_gradients={self._offload_gradients})")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (masters, staging buffers and hooks are created for it).

        Args:
            param_group: a dict with ``"params"`` and optional hyperparameters.
        """
        self._check_open()
        self._drain()
        [group] = self._normalize_groups([param_group])
        first = len(self._slots)
        master_group = self._build_group(group, len(self._inner.param_groups))
        try:
            self._inner.add_param_group(master_group)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot add the parameter group: {exc}",
                              hint="Give the group as {'params': [tensors], ...} with "
                                   "options the inner optimizer accepts.") from exc
        for slot in self._slots[first:]:
            self._attach(slot)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finish the CPU update and copy the new weights back to the parameters.

        Blocks until every gradient transfer and CPU step of this iteration is done (the step
        boundary is this class's one host synchronization), then enqueues the host->device copies
        and makes the current stream wait for them (no further host synchronization).

        Args:
            closure: optional, re-evaluates the model and returns the loss (run with grad enabled
                before the update).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            OffloadError: when the worker failed (its exception is chained).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        if not self._offload_gradients:
            self._enqueue_resident_grads()
        self._enqueue_assigned_host_grads()
        start = time.perf_counter()
        self._drain()
        self._wait_seconds += time.perf_counter() - start
        self._raise_worker_error()
        if self._overlap:
            updated = [slot for slot in self._slots if slot.stepped]
        else:
            updated = self._step_all()
        self._upload([slot for slot in updated if not slot.in_place])
        for slot in self._slots:
            slot.stepped = False
            slot.received = False
            if not self._host_accumulation:
                slot.grad_count = 0  # consumed; host accumulation keeps it until zero_grad
        self._steps += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: the parameters' ``.grad`` and the host gradient buffers.

        Args:
            set_to_none: set ``.grad`` to ``None`` instead of zeroing it (default ``True``).
        """
        self._drain()
        for slot in self._slots:
            grad = slot.param.grad
            if grad is not None:
                if set_to_none:
                    slot.param.grad = None
                else:
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()
            if not slot.in_place:
                slot.master.grad = None
            slot.grad_count = 0
            slot.received = False

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus ``"masters"``: the fp32 masters of 16-bit
        parameters (their extra precision is not in the model's own state dict).

        Returns:
            A dict loadable by :meth:`load_state_dict` (its ``state``/``param_groups`` are those
            of a plain optimizer over the same parameters).
        """
        self._drain()
        result = self._inner.state_dict()
        result["masters"] = {slot.index: slot.master.clone() for slot in self._slots
                             if not slot.in_place and slot.param.dtype != slot.master.dtype}
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load states (moved to the host masters' device and dtype) and refresh the masters.

        Masters saved by :meth:`state_dict` are restored; the others are re-read from the
        parameters, so load the model's weights first.

        Args:
            state_dict: from :meth:`state_dict`, or from a plain optimizer over the same params.
        """
        self._check_open()
        self._drain()
        saved = dict(state_dict)
        masters = saved.pop("masters", {})
        self._inner.load_state_dict(saved)
        self.refresh_masters()
        for slot in self._slots:
            if slot.index in masters:
                slot.master.copy_(masters[slot.index])

    # -- vramkit additions -------------------------------------------------------------------

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Re-read the masters from the parameters (after changing weights outside the optimizer,
        e.g. loading a checkpoint into the model). Synchronous (a device->host copy)."""
        self._drain()
        for slot in self._slots:
            if not slot.in_place:
                slot.master.copy_(slot.param.detach())

    def stats(self) -> OptimizerOffloadStats:
        """Sizes and transfer counters (see :class:`OptimizerOffloadStats`)."""
        self._drain()
        state_bytes = gpu_state_bytes = gpu_grad_bytes = host_grad_bytes = 0
        device_params = host_params = staged_host = 0
        for slot in self._slots:
            nbytes = sum(v.nbytes for v in self._inner.state.get(slot.master, {}).values()
                         if isinstance(v, torch.Tensor))
            state_bytes += nbytes
            if slot.param.device.type != "cpu":
                device_params += 1
                gpu_state_bytes += nbytes
                if self._offload_gradients:
                    gpu_grad_bytes += slot.param.nbytes
            elif slot.in_place:
                host_params += 1
            else:
                staged_host += 1
            if slot.grad is not None and slot.grad is not slot.staging:
                host_grad_bytes += slot.grad.nbytes
        return OptimizerOffloadStats(
            device_params=device_params, host_params=host_params, staged_host_params=staged_host,
            pinned_bytes=sum(block.capacity for block in self._blocks if not block.freed),
            host_grad_bytes=host_grad_bytes, state_bytes=state_bytes,
            gpu_state_bytes_saved=gpu_state_bytes, gpu_grad_bytes_saved=gpu_grad_bytes,
            grads_transferred=self._grads_transferred, d2h_bytes=self._d2h_bytes,
            h2d_bytes=self._h2d_bytes, steps=self._steps, cpu_step_seconds=self._cpu_seconds,
            step_wait_seconds=self._wait_seconds)

    def close(self) -> None:
        """Remove the gradient hooks, stop the worker and return the pool blocks (idempotent).
        The optimizer is unusable afterwards; the parameters keep their current values."""
        if self._closed:
            return
        self._drain()
        self._closed = True
        self._finalizer()
        if self._owns_pool:
            self._pool.trim()  # unpin now rather than when the optimizer is collected

    def __enter__(self) -> CPUOffloadOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def _normalize_groups(params: Any) -> list[dict[str, Any]]:
        if isinstance(params, torch.Tensor):
            raise ConfigError("params must be an iterable of tensors or dicts, got a single "
                              "tensor", hint="Pass model.parameters() or [tensor].")
        groups = list(params)
        if not groups:
            raise ConfigError("CPUOffloadOptimizer got an empty parameter list",
                              hint="Pass the parameters to optimize, e.g. model.parameters() or [p "
                                   "for p in model.parameters() if p.requires_grad]; check that "
                                   "the model has trainable parameters.")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        normalized = []
        for group in groups:
            if not isinstance(group, dict) or "params" not in group:
                raise ConfigError("each parameter group must be a dict with a 'params' entry",
                                  hint="Give each group as a dict: [{'params': "
                                       "model.encoder.parameters(), 'lr': 1e-4}, ...].")
            members = group["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            normalized.append({**group, "params": members})
        return normalized

    @staticmethod
    def _default_pool(groups: list[dict[str, Any]]) -> MemoryPool:
        on_device = any(isinstance(p, torch.Tensor) and p.device.type != "cpu"
                        for group in groups for p in group["params"])
        config = PoolConfig(growth_factor=1.0, max_cached_buffers=0)
        return MemoryPool.pinned(config) if on_device else MemoryPool("cpu", config)

    def _build_group(self, group: dict[str, Any], group_index: int) -> dict[str, Any]:
        """Validate a group's params, carve their masters and buffers from one flat block."""
        params = group["params"]
        slots: list[ParamSlot] = []
        pinned_bytes = grad_numel = 0
        for position, param in enumerate(params):
            name = f"group{group_index}.param{position}"
            self._validate_param(param, name)
            master_dtype = host_master_dtype(param.dtype)
            in_place = param.device.type == "cpu" and param.dtype == master_dtype
            slot = ParamSlot(len(self._slots) + len(slots), group_index, name, param,
                         param if in_place else param.detach(), in_place)
            if not in_place:
                pinned_bytes += aligned_size(param.numel() * master_dtype.itemsize)
                pinned_bytes += aligned_size(param.numel() * param.dtype.itemsize)
                if param.dtype != master_dtype or self._host_accumulation:
                    grad_numel += param.numel()
            slots.append(slot)

        raw = None
        if pinned_bytes:
            try:
                block = self._pool.allocate(pinned_bytes)
            except MemoryError as exc:
                raise OffloadError(f"cannot allocate {pinned_bytes} bytes of host memory for "
                                   f"the optimizer masters: {exc}",
                                   hint="Free host memory (other processes, or the "
                                        "container's pinned-memory limit), raise "
                                        "PoolConfig.max_size if you passed a capped "
                                        "pool=, or offload fewer parameters.") from exc
            self._blocks.append(block)
            raw = block.tensor
        # fp32 gradients are never copied to or from the device: plain host memory suffices.
        grads = torch.empty(grad_numel, dtype=torch.float32) if grad_numel else None
        offset = grad_offset = 0
        for slot in slots:
            if slot.in_place:
                continue
            assert raw is not None  # pinned_bytes > 0 whenever a slot is staged
            param = slot.param
            master_dtype = host_master_dtype(param.dtype)
            numel, shape = param.numel(), param.shape
            nbytes = numel * master_dtype.itemsize
            slot.master = raw[offset:offset + nbytes].view(master_dtype).view(shape)
            offset += aligned_size(nbytes)
            nbytes = numel * param.dtype.itemsize
            slot.staging = raw[offset:offset + nbytes].view(param.dtype).view(shape)
            offset += aligned_size(nbytes)
            with torch.no_grad():
                slot.master.copy_(param.detach())
            if param.dtype != master_dtype or self._host_accumulation:
                assert grads is not None
                slot.grad = grads[grad_offset:grad_offset + numel].view(shape)
                grad_offset += numel
            else:
                slot.grad = slot.staging  # fp32 and consumed within the step: use it in place
            # The upload reads the master directly when no cast is needed.
            slot.upload = slot.staging if param.dtype != master_dtype else slot.master
            try:
                slot.streams = transfer_streams(param.device)
            except ValueError as exc:
                raise ConfigError(f"{slot.name}: parameters on {param.device} are not supported "
                                  "(CUDA devices and the CPU are)",
                                  hint="Keep the parameters on a CUDA device or on the "
                                       "CPU (model.to('cuda')) before building the "
                                       "optimizer.") from exc
            slot.ready = slot.streams.event()
            slot.done = slot.streams.event()
        self._slots.extend(slots)
        return {**group, "params": [slot.master for slot in slots]}

    def _validate_param(self, param: Any, name: str) -> None:
        if not isinstance(param, torch.Tensor):
            raise ConfigError(f"{name}: expected a tensor, got {type(param).__name__}",
                              hint="Every entry of 'params' must be a torch.Tensor, e.g. from "
                                   "model.parameters().")
        if id(param) in self._seen:
            raise ConfigError(f"{name}: a parameter appears twice in the parameter groups",
                              hint="List each parameter once across all groups (shared/tied "
                                   "weights included).")
        if not param.is_leaf:
            raise ConfigError(f"{name}: can't optimize a non-leaf tensor",
                              hint="Pass the leaf parameters (model.parameters()), not tensors "
                                   "computed from them; use t.detach().requires_grad_() to make a "
                                   "new leaf.")
        if not param.is_floating_point() or param.is_sparse:
            raise ConfigError(f"{name}: parameters must be dense floating-point tensors, got "
                              f"{param.dtype} ({param.layout})",
                              hint="Leave integer, boolean and sparse tensors out of the parameter "
                                   "groups, e.g. filter with p.is_floating_point().")
        self._seen.add(id(param))

    def _attach(self, slot: ParamSlot) -> None:
        """Register the gradient hook the mode needs (none for stepping everything in step())."""
        if not slot.param.requires_grad:
            return  # frozen: never receives a gradient
        if self._overlap:
            slot.sub = self._optimizer_class([slot.master], **self._opt_kwargs)
        # Host params step with their own .grad, so only overlap needs to hear about it.
        needed = self._offload_gradients and (self._overlap or not slot.in_place)
        if not needed:
            return
        owner = weakref.ref(self)

        def on_grad_ready(param: torch.Tensor) -> None:
            optimizer = owner()
            if optimizer is not None:
                optimizer._grad_ready(slot)

        slot.hook = slot.param.register_post_accumulate_grad_hook(on_grad_ready)

    # -- gradients ---------------------------------------------------------------------------

    def _grad_ready(self, slot: ParamSlot) -> None:
        """Backward hook: ship the finished gradient to the host and free it on the GPU."""
        self._raise_worker_error()
        if self._overlap and slot.received:
            raise OffloadError(
                f"{slot.name}: a second gradient arrived before step(); with overlap=True each "
                "parameter is updated as its gradient arrives, so gradient accumulation over "
                "several backward passes is not possible",
                hint="Use CPUOffloadOptimizer(..., overlap=False) to accumulate gradients.")
        if slot.in_place:
            self._enqueue(slot)
            return
        grad = slot.param.grad
        if grad is None:
            return
        self._transfer_grad(slot, grad, release=True)

    def _transfer_grad(self, slot: ParamSlot, grad: torch.Tensor, *, release: bool) -> None:
        if slot.in_flight:
            # The previous backward's copy into this staging buffer is not consumed yet (host
            # accumulation); a full forward passed since, so this is normally no wait at all.
            with self._cond:
                while slot.in_flight and self._error is None:
                    self._cond.wait()
        streams = slot.streams
        assert streams is not None and slot.staging is not None
        # The copy must see the finished gradient: wait (on the GPU) for the producing stream.
        streams.record(slot.ready, streams.current())
        streams.wait(streams.d2h, slot.ready)
        streams.copy(slot.staging, grad, streams.d2h, slot.name)
        streams.record(slot.done, streams.d2h)
        self._grads_transferred += 1
        self._d2h_bytes += grad.nbytes
        if release:
            if grad.device.type == "cuda":
                grad.record_stream(streams.d2h)  # not reused before the copy has read it
            slot.param.grad = None
        self._enqueue(slot)

    def _enqueue_resident_grads(self) -> None:
        """offload_gradients=False: ship every gradient now (they stay on the GPU as usual)."""
        for slot in self._slots:
            if slot.param.grad is None:
                continue
            if not slot.in_place:
                slot.grad_count = 0
                self._transfer_grad(slot, slot.param.grad, release=False)
            elif self._overlap:
                self._enqueue(slot)

    def _enqueue_assigned_host_grads(self) -> None:
        """16-bit host parameters whose ``.grad`` was *assigned* rather than accumulated by
        autograd -- the block swapper's host parameters (``SwapConfig(trainable="cpu")``) get
        their gradients that way in ``sync_gradients()`` -- never fire the post-accumulate hook:
        pick their gradients up here (a host-to-host copy into the fp32 master gradient)."""
        for slot in self._slots:
            if slot.in_place or slot.received or slot.param.device.type != "cpu":
                continue
            grad = slot.param.grad
            if grad is not None:
                self._transfer_grad(slot, grad, release=True)

    def _enqueue(self, slot: ParamSlot) -> None:
        with self._cond:
            self._pending += 1
            slot.in_flight = True
            slot.received = True
            if self._worker is None:
                self._worker = threading.Thread(
                    target=_worker_loop, args=(self._work, weakref.ref(self)), daemon=True,
                    name="vramkit-offload-optimizer")
                self._worker.start()
        self._work.put(slot)

    def _process(self, slot: ParamSlot) -> None:
        """Worker: wait for the slot's copy, land the gradient in fp32, step it if overlapping."""
        try:
            if self._error is None:
                if not slot.in_place:
                    assert slot.streams is not None
                    slot.streams.synchronize(slot.done)
                    self._land_grad(slot)
                if self._overlap:
                    self._step_one(slot)
        except BaseException as exc:  # handed to the main thread, re-raised by step()
            logger.debug("offload optimizer worker failed on %s", slot.name, exc_info=True)
            with self._cond:
                if self._error is None:
                    self._error = exc
        finally:
            with self._cond:
                slot.in_flight = False
                self._pending -= 1
                self._cond.notify_all()

    @staticmethod
    def _land_grad(slot: ParamSlot) -> None:
        staging, grad = slot.staging, slot.grad
        assert staging is not None and grad is not None
        if grad is not staging:
            if slot.grad_count:
                grad.add_(staging)  # in fp32, whatever the parameter dtype
            else:
                grad.copy_(staging)
        slot.grad_count += 1

    # -- stepping ----------------------------------------------------------------------------

    def _step_one(self, slot: ParamSlot) -> None:
        """Worker: one parameter's update with the inner optimizer's current hyperparameters."""
        sub = slot.sub
        assert sub is not None
        master = slot.master
        if slot.in_place and master.grad is None:
            return
        # The single-parameter optimizer shares the inner state, and takes the group's current
        # hyperparameters (an lr scheduler changes the inner groups, not this one).
        sub.state = self._inner.state
        sub_group = sub.param_groups[0]
        for key, value in self._inner.param_groups[slot.group].items():
            if key != "params":
                sub_group[key] = value
        if not slot.in_place:
            master.grad = slot.grad
        start = time.perf_counter()
        try:
            sub.step()
        finally:
            self._cpu_seconds += time.perf_counter() - start
            if not slot.in_place:
                master.grad = None
        if slot.staging is not None and slot.upload is slot.staging:
            slot.staging.copy_(master)  # cast on the host: half the bytes on the link for bf16
        slot.stepped = True

    def _step_all(self) -> list[ParamSlot]:
        """Main thread, overlap=False: clip and step every master that has a gradient."""
        updated = []
        for slot in self._slots:
            if slot.in_place:
                if slot.param.grad is not None:
                    updated.append(slot)
            elif slot.grad_count:
                slot.master.grad = slot.grad
                updated.append(slot)
        if not updated:
            return updated
        if self._max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([slot.master for slot in updated],
                                           self._max_grad_norm)
        start = time.perf_counter()
        try:
            self._inner.step()
        finally:
            self._cpu_seconds += time.perf_counter() - start
            for slot in updated:
                if not slot.in_place:
                    slot.master.grad = None
        for slot in updated:
            if slot.staging is not None and slot.upload is slot.staging:
                slot.staging.copy_(slot.master)
        return updated

    def _upload(self, slots: list[ParamSlot]) -> None:
        """Enqueue the copies back to the parameters; the current stream waits on the GPU."""
        by_streams: dict[int, tuple[Streams, list[ParamSlot]]] = {}
        for slot in slots:
            assert slot.streams is not None
            by_streams.setdefault(id(slot.streams), (slot.streams, []))[1].append(slot)
        for streams, members in by_streams.values():
            current = streams.current()
            # The copies overwrite weights the queued backward kernels may still read. The host
            # sources are safe until the next update: that update waits for a gradient copy
            # which is ordered after the forward that waited for these copies.
            ready = streams.event()
            streams.record(ready, current)
            streams.wait(streams.h2d, ready)
            for slot in members:
                assert slot.upload is not None
                streams.copy(slot.param, slot.upload, streams.h2d, slot.name)
                self._h2d_bytes += slot.upload.nbytes
            done = streams.event()
            streams.record(done, streams.h2d)
            streams.wait(current, done)

    # -- plumbing ----------------------------------------------------------------------------

    def _drain(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()

    def _raise_worker_error(self) -> None:
        error = self._error
        if error is not None:
            raise OffloadError(f"the CPU optimizer worker failed: {error!r}",
                               hint="The parameters may be partly updated; rebuild the optimizer "
                                    "from a checkpoint.") from error

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this CPUOffloadOptimizer was closed",
                               hint="Create a new optimizer; close() releases its memory.")
