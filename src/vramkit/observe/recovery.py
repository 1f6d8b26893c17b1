"""Out-of-memory recovery: retry a training step smaller, or search the batch size that fits.

* :class:`MemoryRecovery` / :func:`train_with_memory_recovery` run one training step as
  micro-batches; on OOM they free the failed attempt (outside the ``except`` block), halve the
  micro-batch, double the accumulation (the effective batch stays the same) and remember the
  size that worked for the following steps.
* :func:`find_executable_batch_size` searches the largest batch size a function runs with.

Recognizing an OOM and saying which kind it is (:func:`is_oom_error`, :func:`classify_oom`,
:class:`OomDiagnosis`, ...) lives in :mod:`vramkit.observe.oom`; those names are re-exported here,
where they were first published.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from vramkit._validate import check_bool, check_choice, check_device, check_int, check_number
from vramkit.errors import ConfigError, RecoveryError
from vramkit.observe.oom import (
    DeviceMemoryReading,
    OomDiagnosis,
    _install_oom_observer,
    classify_oom,
    diagnose_memory,
    is_oom_error,
    read_device_memory,
)

__all__ = [
    "DeviceMemoryReading",
    "MemoryRecovery",
    "OomDiagnosis",
    "OomEvent",
    "RecoveryResult",
    "batch_size_of",
    "classify_oom",
    "diagnose_memory",
    "find_executable_batch_size",
    "is_oom_error",
    "read_device_memory",
    "split_batch",
    "train_with_memory_recovery",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Device types a recovery may run on: those whose OOMs is_oom_error recognizes, and the host.
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


# ------------------------------------------------------------------------------------------
# Freeing a failed attempt
# ------------------------------------------------------------------------------------------


def _release_cuda_cache(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


def _allocated(device: torch.device | None) -> int | None:
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated(device))  # a host-side counter: no sync
    return None


def _forget(error: BaseException) -> None:
    """Cut the references that keep a failed attempt's tensors alive."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def _resolve_device(device: Any) -> torch.device | None:
    """The device whose cache a recovery empties, checked for form (``None`` stays ``None``)."""
    resolved: torch.device | None = check_device("device", device, types=_DEVICE_TYPES,
                                                 allow_none=True)
    return resolved


def _free_failed_attempt(error: BaseException, device: torch.device | None,
                         params: list[torch.Tensor]) -> None:
    """Drop the failed attempt's tensors: its traceback frames, partial gradients, the cache."""
    _forget(error)
    for param in params:
        param.grad = None
    gc.collect()
    _release_cuda_cache(device)


# ------------------------------------------------------------------------------------------
# Splitting a batch into micro-batches
# ------------------------------------------------------------------------------------------


def _batch_sizes(batch: Any, out: list[int]) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.dim() >= 1:
            out.append(int(batch.shape[0]))
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _batch_sizes(value, out)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            _batch_sizes(value, out)


def batch_size_of(batch: Any) -> int:
    """The batch size of ``batch``: dim 0 of its tensors (all must agree).

    Args:
        batch: a tensor, or a mapping/tuple/list nesting tensors. Non-tensor leaves and 0-d
            tensors are not batched (they are passed to every micro-batch as they are).

    Returns:
        The size of dim 0.

    Raises:
        ConfigError: when there is no batched tensor or dim-0 sizes disagree.
    """
    sizes: list[int] = []
    _batch_sizes(batch, sizes)
    if not sizes:
        raise ConfigError("the batch holds no tensor with a batch dimension",
                          hint="Pass a tensor, or a dict/tuple/list of tensors batched on dim 0.")
    if len(set(sizes)) != 1:
        raise ConfigError(f"the batch's tensors disagree on dim 0: sizes {sorted(set(sizes))}",
                          hint="Give every batched tensor the same dim-0 size; pass per-batch "
                               "values as non-tensor leaves or 0-d tensors.")
    return sizes[0]


def _take(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() >= 1 else batch  # a view: no copy
    if isinstance(batch, Mapping):
        return {key: _take(value, start, stop) for key, value in batch.items()}
    if isinstance(batch, tuple):
        items = [_take(value, start, stop) for value in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [_take(value, start, stop) for value in batch]
    return batch


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split ``batch`` along dim 0 into micro-batches of ``micro_batch_size`` (the last smaller).

    Tensors become views (no copy); mappings become dicts, tuples (named tuples too) and lists
    keep their type; other leaves and 0-d tensors are shared by every micro-batch.

    Args:
        batch: a tensor or a nesting of mappings/tuples/lists of tensors batched on dim 0.
        micro_batch_size: rows per micro-batch, >= 1.

    Returns:
        ``ceil(batch_size / micro_batch_size)`` micro-batches, in order.
    """
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    total = batch_size_of(batch)
    return [_take(batch, start, min(start + micro_batch_size, total))
            for start in range(0, total, micro_batch_size)]


# ------------------------------------------------------------------------------------------
# Recovering a training step
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OomEvent:
    """One OOM that :class:`MemoryRecovery` recovered from (or gave up on).

    Attributes:
        micro_batch_size: the micro-batch size of the failed attempt.
        diagnosis: its :class:`OomDiagnosis`.
        allocated_before: ``torch.cuda.memory_allocated`` when the attempt started (``None``
            off CUDA).
        allocated_after: the same after the failed attempt was freed.
    """

    micro_batch_size: int
    diagnosis: OomDiagnosis
    allocated_before: int | None
    allocated_after: int | None


@dataclass(frozen=True)
class RecoveryResult:
    """What one recovered step did.

    Attributes:
        loss: the batch loss (micro-batch losses weighted by their share of the batch), a
            detached tensor on the loss's device (never synchronized); ``None`` when the step
            function returned no tensor.
        batch_size: rows in the batch (the effective batch).
        micro_batch_size: the size that ran.
        accumulation_steps: micro-batches the batch was split into.
        attempts: tries this step took (1 = no OOM).
        events: the OOMs of this step, in order.
    """

    loss: torch.Tensor | None
    batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    attempts: int
    events: tuple[OomEvent, ...] = ()


class MemoryRecovery:
    """Runs training steps as micro-batches and shrinks them on OOM, remembering what worked.

    A step runs the batch as ``ceil(N / m)`` micro-batches of ``m`` rows (the last may be
    smaller); each micro-batch's loss is weighted by its share of the batch, so the accumulated
    gradient equals the full-batch gradient of a mean loss whatever ``m`` is. On an OOM the
    failed attempt is freed (outside the ``except`` block: the exception's traceback is cut, the
    attempt's gradients dropped, ``gc.collect()`` and ``torch.cuda.empty_cache()`` run), ``m``
    is halved and the whole batch is run again. The size that worked is kept for later steps.

    Gradients: when a step starts, gradients already on ``params`` (accumulated by earlier steps)
    are set aside and the step accumulates into fresh ``.grad`` tensors; a failed attempt's
    gradients are dropped (never half-accumulated); on success the set-aside gradients are added
    back in place. While a step runs with pre-existing gradients, both gradient buffers exist:
    call ``optimizer.zero_grad(set_to_none=True)`` before each step to avoid that.

    Args:
        params: the parameters whose gradients the step accumulates (an ``nn.Module`` means its
            parameters); ``()`` for steps that produce no gradients.
        attempts: tries per step, the first included (default 3): at most ``attempts - 1``
            halvings.
        micro_batch_size: the micro-batch size to start from (default ``None``: the batch size
            of the first step). Larger batches are split from the first attempt.
        min_micro_batch_size: give up rather than go below this (default 1).
        run_backward: ``True`` (default): ``step_fn(micro_batch)`` returns the micro-batch's
            mean loss and this object calls ``(loss * weight).backward()``. ``False``:
            ``step_fn(micro_batch, weight)`` runs its own backward on ``loss * weight`` and
            returns the (unweighted) loss or ``None``.
        device: the device whose cache is emptied and whose allocator is read (default: the
            first CUDA parameter's device, else none).
        on_oom: called with each :class:`OomEvent` after the failed attempt was freed
            (default ``None``).

    Raises:
        ConfigError: for invalid values.
    """

    def __init__(self, params: Iterable[torch.Tensor] | nn.Module, *, attempts: int = 3,
                 micro_batch_size: int | None = None, min_micro_batch_size: int = 1,
                 run_backward: bool = True, device: Any = None,
                 on_oom: Callable[[OomEvent], None] | None = None) -> None:
        self.attempts = check_int("attempts", attempts, minimum=1)
        self.min_micro_batch_size = check_int("min_micro_batch_size", min_micro_batch_size,
                                              minimum=1)
        check_int("micro_batch_size", micro_batch_size, minimum=self.min_micro_batch_size,
                  allow_none=True)
        check_bool("run_backward", run_backward)
        if on_oom is not None and not callable(on_oom):
            raise ConfigError("on_oom must be callable",
                              hint="Pass a function that takes an OomEvent, e.g. on_oom=print, or "
                                   "None.")
        if isinstance(params, nn.Module):
            params = params.parameters()
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params: list[torch.Tensor] = list(params)
        if not all(isinstance(p, torch.Tensor) for p in self.params):
            raise ConfigError("params must be tensors (or an nn.Module)",
                              hint="Pass model.parameters(), the nn.Module itself, a list of "
                                   "tensors, or () for steps without gradients.")
        self.run_backward = run_backward
        self.on_oom = on_oom
        self.device = _resolve_device(device)
        if self.device is None:
            self.device = next((p.device for p in self.params if p.device.type == "cuda"), None)
        self.micro_batch_size = micro_batch_size
        self.events: list[OomEvent] = []

    def reset(self) -> None:
        """Forget the settled micro-batch size: the next step starts from the whole batch."""
        self.micro_batch_size = None

    def step(self, step_fn: Callable[..., Any], batch: Any) -> RecoveryResult:
        """Run one training step over ``batch``, recovering from OOM.

        Args:
            step_fn: see ``run_backward`` in the class docstring.
            batch: a tensor or a nesting of dicts/tuples/lists of tensors batched on dim 0.

        Returns:
            A :class:`RecoveryResult`.

        Raises:
            RecoveryError: when the micro-batch reached ``min_micro_batch_size`` or every
                attempt ran out of memory; gradients are then as they were before the step.
            Any non-OOM error of ``step_fn`` (gradients restored likewise).
        """
        total = batch_size_of(batch)
        micro = min(self.micro_batch_size or total, total)
        if self.device is not None and self.device.type == "cuda" and torch.cuda.is_initialized():
            _install_oom_observer()
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        events: list[OomEvent] = []
        tries = 0
        while True:
            tries += 1
            before = _allocated(self.device)
            error: BaseException | None = None
            loss: torch.Tensor | None = None
            try:
                loss = self._attempt(step_fn, batch, total, micro)
            except BaseException as exc:
                if not is_oom_error(exc):
                    self._restore(saved)
                    raise
                error = exc
            if error is None:
                break
            # Out of the except block: the interpreter no longer pins the exception, so cutting
            # its traceback releases the frames (and the activations they reference).
            diagnosis = classify_oom(error, self.device)
            _free_failed_attempt(error, self.device, self.params)
            del error
            event = OomEvent(micro, diagnosis, before, _allocated(self.device))
            events.append(event)
            self.events.append(event)
            logger.warning("OOM at micro-batch %d of %d (%s)", micro, total, diagnosis.kind)
            if self.on_oom is not None:
                self.on_oom(event)
            if micro <= self.min_micro_batch_size or tries >= self.attempts:
                self._restore(saved)
                why = (f"the micro-batch is already {micro}" if micro <= self.min_micro_batch_size
                       else f"all {self.attempts} attempts ran out of memory")
                raise RecoveryError(f"out of memory on a batch of {total}: {why}; last "
                                    f"diagnosis: {diagnosis.kind}", hint=diagnosis.hint)
            micro = max(self.min_micro_batch_size, micro // 2)
        self._merge(saved)
        self.micro_batch_size = micro
        return RecoveryResult(loss=loss, batch_size=total, micro_batch_size=micro,
                              accumulation_steps=math.ceil(total / micro), attempts=tries,
                              events=tuple(events))

    def _attempt(self, step_fn: Callable[..., Any], batch: Any, total: int,
                 micro: int) -> torch.Tensor | None:
        accumulated: torch.Tensor | None = None
        for part in split_batch(batch, micro):
            weight = batch_size_of(part) / total
            if self.run_backward:
                loss = step_fn(part)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ConfigError("step_fn must return the micro-batch's scalar loss "
                                      f"(got {type(loss).__name__})",
                                      hint="Or pass run_backward=False and call backward "
                                           "yourself on loss * weight.")
                (loss * weight).backward()
            else:
                loss = step_fn(part, weight)
            if isinstance(loss, torch.Tensor):
                part_loss = loss.detach().reshape(()) * weight
                accumulated = part_loss if accumulated is None else accumulated + part_loss
            del loss
        return accumulated

    def _restore(self, saved: list[torch.Tensor | None]) -> None:
        for param, grad in zip(self.params, saved, strict=True):
            param.grad = grad

    def _merge(self, saved: list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for param, old in zip(self.params, saved, strict=True):
                if old is None:
                    continue
                if param.grad is not None:
                    old.add_(param.grad)
                param.grad = old

    def __repr__(self) -> str:
        return (f"MemoryRecovery(micro_batch_size={self.micro_batch_size}, "
                f"attempts={self.attempts}, ooms={len(self.events)})")


def train_with_memory_recovery(step_fn: Callable[..., Any], batch: Any, attempts: int = 3, *,
                               params: Iterable[torch.Tensor] | nn.Module,
                               recovery: MemoryRecovery | None = None,
                               **options: Any) -> RecoveryResult:
    """Run one training step over ``batch``, halving the micro-batch on OOM (seed function).

    For several steps keep a :class:`MemoryRecovery` (pass it as ``recovery``) so later steps
    start at the size that worked.

    Args:
        step_fn: ``step_fn(micro_batch) -> loss`` (see :class:`MemoryRecovery`).
        batch: the batch.
        attempts: tries, the first included (default 3); must stay at its default when
            ``recovery`` is given (the object's own ``attempts`` apply).
        params: the parameters the step computes gradients for (required, so a failed
            attempt's partial gradients can be dropped).
        recovery: a :class:`MemoryRecovery` to use and update (default: a new one).
        **options: other :class:`MemoryRecovery` arguments when ``recovery`` is ``None``.

    Returns:
        A :class:`RecoveryResult`.

    Raises:
        RecoveryError: when recovery gives up.
    """
    if recovery is None:
        recovery = MemoryRecovery(params, attempts=attempts, **options)
    elif options or attempts != 3:
        given = sorted(options) + (["attempts"] if attempts != 3 else [])
        raise ConfigError(f"options {given} conflict with the given recovery object",
                          hint="Set them on the MemoryRecovery object instead.")
    return recovery.step(step_fn, batch)


# ------------------------------------------------------------------------------------------
# Batch-size search
# ------------------------------------------------------------------------------------------

_MODES = ("power", "binsearch")


class _BatchSizeSearch:
    """The callable :func:`find_executable_batch_size` returns (see there)."""

    def __init__(self, fn: Callable[..., _T], starting_batch_size: int, mode: str,
                 headroom: float, device: torch.device | None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.starting_batch_size = starting_batch_size
        self.mode = mode
        self.headroom = headroom
        self.device = device
        self.batch_size: int | None = None
        self.probes: list[tuple[int, bool]] = []
        self.diagnoses: list[OomDiagnosis] = []

    def _probe(self, size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        device = self.device
        if device is None and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        if device is not None and device.type == "cuda":
            _install_oom_observer()
        error: BaseException | None = None
        try:
            result = self.fn(size, *args, **kwargs)
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            error = exc
        self.probes.append((size, error is None))
        if error is None:
            return True, result
        if device is None and torch.cuda.is_initialized():
            # CUDA was first initialised inside fn (the usual case on a first probe): the
            # diagnosis and the cache release need the device all the same.
            device = torch.device("cuda", torch.cuda.current_device())
        self.diagnoses.append(classify_oom(error, device))
        _free_failed_attempt(error, device, [])
        del error
        logger.info("batch size %d ran out of memory", size)
        return False, None

    def _descend(self, size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[int, Any, int | None]:
        """Halve from ``size`` until a call runs: (size that ran, its result, smallest failure)."""
        failed: int | None = None
        while True:
            ok, result = self._probe(size, args, kwargs)
            if ok:
                return size, result, failed
            failed = size
            if size == 1:
                raise RecoveryError("even batch size 1 runs out of memory",
                                    hint=self.diagnoses[-1].hint)
            size //= 2

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "batch_size" in kwargs:
            raise ConfigError("do not pass batch_size: find_executable_batch_size passes it as "
                              "the first argument",
                              hint="Call the decorated function without batch_size: "
                                   "fn(*other_args); it is called as fn(batch_size, *other_args).")
        self.probes = []
        self.diagnoses = []
        start = self.batch_size or self.starting_batch_size
        ran, result, failed = self._descend(start, args, kwargs)
        if failed is None:  # the first size ran: nothing says it is near the limit
            self.batch_size = ran
            return result
        if self.mode == "binsearch":
            low, high = ran, failed
            while high - low > 1:
                mid = (low + high) // 2
                ok, mid_result = self._probe(mid, args, kwargs)
                if ok:
                    low, ran, result = mid, mid, mid_result
                else:
                    high = mid
        chosen = max(1, math.floor(ran * (1.0 - self.headroom)))
        if chosen != ran:
            ok, result = self._probe(chosen, args, kwargs)
            if not ok:
                chosen, result, _ = self._descend(max(1, chosen // 2), args, kwargs)
        self.batch_size = chosen
        return result

    def reset(self) -> None:
        """Forget the size found: the next call starts from ``starting_batch_size``."""
        self.batch_size = None


def find_executable_batch_size(fn: Callable[..., Any] | None = None, *,
                               starting_batch_size: int = 128, mode: str = "power",
                               headroom: float = 0.05, device: Any = None) -> Any:
    """Find the largest batch size ``fn(batch_size, *args, **kwargs)`` runs with.

    Usable as ``@find_executable_batch_size(starting_batch_size=64)``, as a bare decorator, or
    as a function ``find_executable_batch_size(fn, starting_batch_size=64)``; each returns a
    callable that takes ``fn``'s other arguments, runs the search and returns ``fn``'s result.
    The callable keeps the size it settled on (``.batch_size``; later calls start there,
    ``.reset()`` forgets it), the probes of the last call (``.probes``: ``(size, ran)``) and
    the OOM diagnoses (``.diagnoses``).

    The search, with ``b`` the largest size that ran:

    * ``"power"`` (default): try ``starting_batch_size`` and halve after each OOM; ``b`` is the
      first size that runs.
    * ``"binsearch"``: after the halving found ``b`` (with ``2b`` failing), bisect between them
      for the largest size that runs. Every call in between is a probe, so ``fn`` should be one
      training step, not a whole training run.

    ``headroom``: when some probe ran out of memory (``b`` sits at the memory limit), the size
    used is ``max(1, floor(b * (1 - headroom)))``, so data-dependent variation (longer
    sequences, another allocation pattern) still fits; ``fn`` is called once more at that size
    and its result returned (if even that fails, halving resumes below it). When the first size
    runs, it is used as is. ``headroom=0`` returns the result of the run at ``b``.

    Args:
        fn: the function; its first positional parameter is the batch size.
        starting_batch_size: the first size tried (default 128).
        mode: ``"power"`` or ``"binsearch"`` (default ``"power"``).
        headroom: fraction in ``[0, 1)`` to stay below the largest size that ran (default 0.05).
        device: the device whose cache is emptied after an OOM (default: the current CUDA
            device when CUDA is initialized).

    Returns:
        The searching callable, or a decorator when ``fn`` is ``None``.

    Raises:
        ConfigError: for invalid arguments.
        RecoveryError: (from the callable) when batch size 1 runs out of memory.
    """
    check_int("starting_batch_size", starting_batch_size, minimum=1)
    check_choice("mode", mode, _MODES)
    headroom = check_number("headroom", headroom, minimum=0.0, maximum=1.0, high_open=True)
    resolved = _resolve_device(device)

    def decorate(function: Callable[..., Any]) -> _BatchSizeSearch:
        if not callable(function):
            raise ConfigError(f"fn must be callable, got {type(function).__name__}",
                              hint="Decorate a function whose first parameter is the batch size: "
                                   "@find_executable_batch_size(starting_batch_size=64).")
        return _BatchSizeSearch(function, starting_batch_size, mode, headroom, resolved)

    return decorate if fn is None else decorate(fn)
