"""Leak detection across training steps: is memory growing step after step, and what holds it?

:class:`LeakDetector` takes one reading per step boundary (``detector.step()`` at the end of each
training step) and judges the series with :class:`GrowthTracker`.

What is measured:

- **CUDA** (``device`` is a CUDA device): the caching allocator's allocated bytes at each boundary
  (exact, no host sync; read through the fast :func:`vramkit.observe.stats.read_cuda_figures`, or
  handed in by a :class:`~vramkit.observe.profiler.MemoryProfiler` that already read them). With ``record_stacks=True`` the detector turns on PyTorch's allocator history in
  ``"state"`` mode (every live block remembers the Python stack that allocated it) and groups the
  blocks that appeared after the baseline by stack (``torch.cuda.memory._snapshot``).
- **CPU**: bytes of live torch tensor storages created after the baseline, found by walking the
  garbage collector's objects (``gc.get_objects``) at each boundary. To keep this fast, the
  baseline objects are moved to the permanent generation with ``gc.freeze()`` (``freeze_baseline``)
  so later walks only visit objects created since; ``stop()`` calls ``gc.unfreeze()``. Tensors held
  only from C++ (for example saved tensors of an autograd graph kept alive by ``total += loss``) are
  invisible to this walk; a :class:`~vramkit.observe.profiler.MemoryProfiler` on the CPU judges
  host RSS at its steps, which does show that case. With ``record_stacks=True``
  a ``TorchDispatchMode`` stays active between ``start()`` and ``stop()`` and records the creating
  Python stack of every new storage (a few microseconds per op).

The verdict rule (:class:`GrowthTracker`): readings of the first ``warmup_steps`` steps are ignored
(optimizer state, caches and lazy buffers appear then). After that, memory is leaking when either

1. the latest ``window`` readings grow on their *floor* (the suffix minimum, so a temporary spike
   does not count as growth): the floor rose in at least two thirds of the window's steps and by
   at least ``threshold_bytes_per_step`` per step on average, and its last value is at least
   ``threshold_bytes_per_step`` above the window's first reading and every reading since warm-up
   before the window (memory climbing back after a dip, as an allocator or ``malloc_trim``
   returns pages and takes them again, reaches no new high: it is not growth); or
2. with at least ``3 * window`` readings, the least-squares slope of all readings since warm-up
   is at least ``threshold_bytes_per_step`` (this finds a steady leak under noise too large for
   a short window).

Fluctuations whose range stays below ``threshold_bytes_per_step * (window - 1)`` can never satisfy
rule 1, and their long-run slope tends to zero. With the defaults (warm-up 1, window 4, 256 KiB) a
steady 1 MiB/step leak is reported at step 5. ``first_leak_step`` keeps the first step at which
the rule held, even if the growth later stopped.

A verdict's ``bytes_per_step`` is the growth the verdict rests on, so a leak is never reported
at a rate below the threshold: the long-run slope, or, while only rule 1 holds (a leak that began
after a flat stretch the long-run slope still averages in), the window's floor growth per step.

**Workloads.** A verdict needs a steady state of one workload: the readings of a training run
followed by those of another run (a second model, a new optimizer, a swapper detached) grow at
the switch, and the rule would call that growth a leak. Steps given a ``workload`` name
(``detector.step(workload="swapped")``, or :meth:`MemoryProfiler.workload
<vramkit.observe.profiler.MemoryProfiler.workload>`) are judged per workload, each with its own
warm-up and window; steps of different workloads may alternate. :func:`combine_verdicts` turns
the verdicts of several workloads into the one a report shows (a leaking workload first).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from vramkit._validate import check_int
from vramkit.devices._runtime import cuda_initialized
from vramkit.errors import ConfigError
from vramkit.memory._stacks import STACK_UNKNOWN, format_frames, python_stack
from vramkit.observe.stats import read_cuda_figures, resolve_cuda_index

__all__ = ["GrowthTracker", "LeakDetector", "LeakSuspect", "LeakVerdict", "assess_growth",
           "combine_verdicts"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class LeakSuspect:
    """Memory that appeared after the baseline and is still alive, grouped by allocating stack.

    Attributes:
        stack: formatted frames, innermost first (``"file.py:12 in step"``).
        bytes: total bytes of the group.
        count: number of storages (CPU) or allocator blocks (CUDA) in the group.
        example: one member, described (``"float32[262144]"`` or ``"block of 1.0 MiB"``).
    """

    stack: tuple[str, ...]
    bytes: int
    count: int
    example: str = ""


@dataclass(frozen=True)
class LeakVerdict:
    """The judgement of a :class:`LeakDetector` (or of a profiler's step readings).

    Attributes:
        leak: whether memory is growing now, by the rule in the module docstring.
        conclusive: ``False`` while fewer than ``warmup_steps + window`` readings exist.
        bytes_per_step: growth per step after warm-up: the least-squares slope (0.0 without two
            readings), or, for a leak only the latest window shows, the window's floor growth
            per step; at least ``threshold_bytes_per_step`` whenever ``leak`` is set.
        growth_bytes: last reading minus the baseline reading.
        steps: readings taken.
        first_leak_step: the first step at which the rule held, ``None`` if never.
        metric: what was read (``"cuda_allocated"``, ``"cpu_tensor_bytes"``, ``"host_rss"``).
        threshold_bytes_per_step: the rule's threshold.
        suspects: the largest groups of surviving allocations (only from ``report()``).
        workload: the workload whose steps were judged (``None``: steps given no workload).
    """

    leak: bool
    conclusive: bool
    bytes_per_step: float
    growth_bytes: int
    steps: int
    first_leak_step: int | None
    metric: str
    threshold_bytes_per_step: int
    suspects: tuple[LeakSuspect, ...] = ()
    workload: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``json`` writes the suspect and stack tuples as lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeakVerdict:
        """Inverse of :meth:`to_dict`."""
        suspects = tuple(LeakSuspect(tuple(s["stack"]), int(s["bytes"]), int(s["count"]),
                                     s.get("example", "")) for s in data.get("suspects", ()))
        return cls(leak=bool(data["leak"]), conclusive=bool(data["conclusive"]),
                   bytes_per_step=float(data["bytes_per_step"]),
                   growth_bytes=int(data["growth_bytes"]), steps=int(data["steps"]),
                   first_leak_step=data.get("first_leak_step"), metric=str(data["metric"]),
                   threshold_bytes_per_step=int(data["threshold_bytes_per_step"]),
                   suspects=suspects, workload=data.get("workload"))


def _check_rule(warmup_steps: int, window: int, threshold: int) -> None:
    check_int("warmup_steps", warmup_steps, minimum=0)
    check_int("window", window, minimum=3,
              hint="Three readings is the least that tells growth from a single spike.")
    check_int("threshold_bytes_per_step", threshold, minimum=1)


class GrowthTracker:
    """Incremental form of the verdict rule (see the module docstring); O(window) per reading.

    Args:
        warmup_steps: readings ignored at the start (default 1).
        window: readings per judged window, >= 3 (default 4).
        threshold_bytes_per_step: least mean floor growth per step that counts (default 256 KiB).
    """

    def __init__(self, warmup_steps: int = 1, window: int = 4,
                 threshold_bytes_per_step: int = 256 * 1024) -> None:
        _check_rule(warmup_steps, window, threshold_bytes_per_step)
        self.warmup_steps = warmup_steps
        self.window = window
        self.threshold = threshold_bytes_per_step
        self._recent: deque[int] = deque(maxlen=window)
        # the highest reading since warm-up that has left the window (rule 1's "new high")
        self._high: int | None = None
        self._window_rate = 0.0  # rule 1's floor growth per step while it holds
        self.steps = 0
        self.baseline: int | None = None
        self.last: int | None = None
        self.first_leak_step: int | None = None
        self.leaking = False
        # running sums for the least-squares slope (constant memory over long runs)
        self._n = 0
        self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, value: int) -> None:
        """Record the reading of the step that just ended."""
        self.steps += 1
        if self.steps <= self.warmup_steps:
            return
        if self.baseline is None:
            self.baseline = value
        self.last = value
        x = float(self._n)
        self._n += 1
        self._sx += x
        self._sy += value
        self._sxx += x * x
        self._sxy += x * value
        if len(self._recent) == self.window:
            left = self._recent[0]
            self._high = left if self._high is None else max(self._high, left)
        self._recent.append(value)
        rate = (_window_rate(self._recent, self.threshold, self._high)
                if len(self._recent) == self.window else None)
        self._window_rate = rate or 0.0
        self.leaking = (rate is not None
                        or (self._n >= 3 * self.window and self.slope >= self.threshold))
        if self.leaking and self.first_leak_step is None:
            self.first_leak_step = self.steps

    @property
    def slope(self) -> float:
        """Least-squares bytes per step over the readings after warm-up."""
        n = self._n
        denom = n * self._sxx - self._sx * self._sx
        if n < 2 or denom == 0:
            return 0.0
        return (n * self._sxy - self._sx * self._sy) / denom

    def verdict(self, metric: str, suspects: Sequence[LeakSuspect] = (), *,
                workload: str | None = None) -> LeakVerdict:
        """The current :class:`LeakVerdict` for readings of ``metric`` (of ``workload``)."""
        rate = self.slope
        if self.leaking and rate < self.threshold:  # rule 1 alone: the window's growth
            rate = self._window_rate
        return LeakVerdict(
            leak=self.leaking,
            conclusive=self.steps >= self.warmup_steps + self.window,
            bytes_per_step=rate,
            growth_bytes=0 if self.baseline is None or self.last is None
            else self.last - self.baseline,
            steps=self.steps, first_leak_step=self.first_leak_step, metric=metric,
            threshold_bytes_per_step=self.threshold, suspects=tuple(suspects), workload=workload)


def combine_verdicts(verdicts: Iterable[LeakVerdict],
                     suspects: Sequence[LeakSuspect] = ()) -> LeakVerdict | None:
    """The one verdict a report shows for the verdicts of several workloads.

    A leaking workload wins (the one growing fastest); else the workload judged on the most
    steps after warm-up (conclusive ones first). Growth *between* workloads is never judged.

    Args:
        verdicts: one per workload.
        suspects: surviving allocations to attach (they are process-wide, not per workload).

    Returns:
        The chosen verdict with ``suspects``, or ``None`` for no verdicts.
    """
    ranked = sorted(verdicts, key=lambda v: (v.leak, v.leak and v.bytes_per_step, v.conclusive,
                                             v.steps), reverse=True)
    if not ranked:
        return None
    return dataclasses.replace(ranked[0], suspects=tuple(suspects))


def _window_rate(values: Sequence[int], threshold: int, high: int | None) -> float | None:
    """Rule 1 on the window ``values``: its floor's growth per step when it holds, else
    ``None``. ``high``: the highest reading since warm-up before the window."""
    floors = list(values)
    for i in range(len(floors) - 2, -1, -1):
        floors[i] = min(floors[i], floors[i + 1])
    rises = sum(1 for a, b in itertools.pairwise(floors) if b > a)
    steps = len(floors) - 1
    mean_rise = (floors[-1] - floors[0]) / steps
    # a new high: above the window's first reading and every reading before the window, not a
    # climb back to a level memory held before a dip
    earlier = values[0] if high is None else max(high, values[0])
    if (rises >= math.ceil(2 * steps / 3) and mean_rise >= threshold
            and floors[-1] - earlier >= threshold):
        return mean_rise
    return None


def assess_growth(values: Sequence[int], metric: str, *, warmup_steps: int = 1, window: int = 4,
                  threshold_bytes_per_step: int = 256 * 1024) -> LeakVerdict:
    """Judge a finished series of step-boundary readings with the rule of :class:`GrowthTracker`.

    Args:
        values: one reading per step, in order.
        metric: what the readings are (stored in the verdict).
        warmup_steps, window, threshold_bytes_per_step: as for :class:`GrowthTracker`.

    Returns:
        The :class:`LeakVerdict` (without suspects).
    """
    tracker = GrowthTracker(warmup_steps, window, threshold_bytes_per_step)
    for value in values:
        tracker.add(int(value))
    return tracker.verdict(metric)


# --- stacks ------------------------------------------------------------------------------------

def _make_stack_recorder(depth: int) -> Any:
    """A TorchDispatchMode that remembers the creating stack of each new CPU storage."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _StorageStackRecorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.stacks: weakref.WeakKeyDictionary[Any, tuple[tuple[str, int, str], ...]] = (
                weakref.WeakKeyDictionary())

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            stack: tuple[tuple[str, int, str], ...] | None = None
            for item in tree_flatten(out)[0]:
                if not isinstance(item, torch.Tensor) or item.device.type != "cpu":
                    continue
                storage = item.untyped_storage()
                if storage in self.stacks:
                    continue  # a view or an in-place result: the storage already has a stack
                if stack is None:
                    stack = python_stack(depth)
                self.stacks[storage] = stack
            return out

    return _StorageStackRecorder()


# --- CUDA allocator history (shared with the profiler's trace mode) ----------------------------

_history_lock = threading.Lock()
_history_requests: dict[int, tuple[str, int]] = {}
_history_next_token = 0


def acquire_memory_history(mode: str, max_entries: int = 100_000) -> int:
    """Turn on ``torch.cuda.memory._record_memory_history`` for one user; returns a token.

    Several users (a leak detector in ``"state"`` mode, a profiler trace in ``"all"`` mode) can
    hold it at once: the strongest request wins and the last release turns it off.

    Args:
        mode: ``"state"`` (live blocks keep stacks) or ``"all"`` (plus an event trace).
        max_entries: trace entries kept in ``"all"`` mode (default 100000).
    """
    global _history_next_token
    import torch

    with _history_lock:
        _history_next_token += 1
        token = _history_next_token
        _history_requests[token] = (mode, max_entries)
        _apply_history(torch)
    return token


def release_memory_history(token: int) -> None:
    """Give back a token from :func:`acquire_memory_history` (unknown tokens are ignored)."""
    import torch

    with _history_lock:
        if _history_requests.pop(token, None) is None:
            return
        _apply_history(torch)


def _apply_history(torch: Any) -> None:
    if not _history_requests:
        torch.cuda.memory._record_memory_history(enabled=None)
        return
    modes = [m for m, _ in _history_requests.values()]
    mode = "all" if "all" in modes else "state"
    entries = max(e for _, e in _history_requests.values())
    torch.cuda.memory._record_memory_history(enabled=mode, context="alloc", stacks="python",
                                             max_entries=entries)


def _block_frames(block: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(str(f.get("filename", "?")), int(f.get("line", 0)), str(f.get("name", "?")))
            for f in block.get("frames", ())]


def _cuda_live_blocks(index: int) -> list[dict[str, Any]]:
    import torch

    snapshot = torch.cuda.memory._snapshot()
    return [block for segment in snapshot.get("segments", ()) if segment.get("device") == index
            for block in segment.get("blocks", ()) if block.get("state") == "active_allocated"]


# --- the detector ------------------------------------------------------------------------------

_freeze_owner: LeakDetector | None = None


class LeakDetector:
    """Watch memory at step boundaries and report growth and the allocations that survive.

    Call :meth:`step` at the end of every training step. :meth:`start` (implicit at the first
    ``step()``) begins stack recording; :meth:`stop` ends it (and undoes ``gc.freeze``). Usable as
    a context manager.

    Args:
        device: the device whose memory is watched: a CUDA device (readings are
            ``torch.cuda.memory_allocated``) or ``"cpu"`` (readings are live tensor storage bytes).
            Default ``None``: the current CUDA device when CUDA is available, else the CPU.
        warmup_steps: steps ignored before the baseline (default 1).
        window: readings per judged window, >= 3 (default 4); with the defaults a steady leak is
            reported at step 5.
        threshold_bytes_per_step: least growth per step that counts as a leak (default 256 KiB).
        record_stacks: record allocating stacks for the suspects (default ``True``; on CUDA this
            is PyTorch's allocator history, on CPU a dispatch mode active until ``stop()``).
        stack_depth: user frames kept per stack (default 6).
        max_suspects: groups kept in ``report()`` (default 10).
        freeze_baseline: on CPU, ``gc.freeze()`` the baseline objects so each step's walk only
            visits new objects (default ``True``; skipped when something else already froze).

    Steps given a ``workload`` (see :meth:`step`) are judged per workload: the rule (warm-up,
    window) applies to each workload's own readings, never across a switch of workload. The
    baseline of surviving allocations is taken once, after the first ``warmup_steps`` steps.
    """

    def __init__(self, device: Any = None, *, warmup_steps: int = 1, window: int = 4,
                 threshold_bytes_per_step: int = 256 * 1024, record_stacks: bool = True,
                 stack_depth: int = 6, max_suspects: int = 10,
                 freeze_baseline: bool = True) -> None:
        # GrowthTracker validates the rule settings it is given, so the checked values are the used ones
        rule = GrowthTracker(warmup_steps, window, threshold_bytes_per_step)
        self.warmup_steps, self.window, self.threshold = rule.warmup_steps, rule.window, rule.threshold
        self._trackers: dict[str | None, GrowthTracker] = {}
        check_int("stack_depth", stack_depth, minimum=1)
        check_int("max_suspects", max_suspects, minimum=1)
        self._index = resolve_cuda_index(device)
        self.device = "cpu" if self._index is None else f"cuda:{self._index}"
        self.metric = "cpu_tensor_bytes" if self._index is None else "cuda_allocated"
        self.record_stacks = record_stacks
        self.stack_depth = stack_depth
        self.max_suspects = max_suspects
        self.freeze_baseline = freeze_baseline
        self._started = False
        self._history_token: int | None = None
        self._recorder: Any = None
        self._baseline_taken = False
        self._baseline_storages: weakref.WeakSet[Any] = weakref.WeakSet()
        self._baseline_blocks: set[int] = set()
        self._tensor_types: dict[type, bool] = {}
        self.readings: list[int] = []

    # lifecycle ------------------------------------------------------------------------------
    def start(self) -> LeakDetector:
        """Begin watching (stack recording on); takes the baseline now if ``warmup_steps == 0``."""
        if self._started:
            return self
        self._started = True
        if self.record_stacks:
            if self._index is not None:
                self._history_token = acquire_memory_history("state")
            else:
                self._recorder = _make_stack_recorder(self.stack_depth)
                self._recorder.__enter__()
        if self.warmup_steps == 0:
            self._take_baseline()
        return self

    def stop(self) -> None:
        """Stop stack recording and undo ``gc.freeze``; readings and verdict stay available."""
        global _freeze_owner
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._history_token is not None:
            release_memory_history(self._history_token)
            self._history_token = None
        if _freeze_owner is self:
            gc.unfreeze()
            _freeze_owner = None
        self._started = False

    def __enter__(self) -> LeakDetector:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # readings -------------------------------------------------------------------------------
    def step(self, value: int | None = None, *, workload: str | None = None) -> None:
        """Record the reading at the end of a training step (starts the detector if needed).

        Args:
            value: on a CUDA detector, the allocated bytes of its device that the caller just
                read (a profiler passes its own reading so the allocator is read once per step);
                ``None`` (default) reads them here.
            workload: the workload this step belongs to (``"swapped"``, ``"resident"``...);
                each workload's steps are judged apart. Default ``None``.

        Raises:
            ConfigError: ``value`` given to a CPU detector (its reading is a walk over live
                tensors that only the detector can take).
        """
        if value is not None and self._index is None:
            raise ConfigError("a CPU LeakDetector takes its own readings: call step() without "
                              "a value",
                              hint="On the CPU call detector.step() with no value; pass a reading "
                                   "as value only to a CUDA LeakDetector.")
        if not self._started:
            self.start()
        reading = self._read() if value is None else int(value)
        tracker = self._trackers.get(workload)
        if tracker is None:
            tracker = self._trackers[workload] = GrowthTracker(self.warmup_steps, self.window,
                                                               self.threshold)
        tracker.add(reading)
        self.readings.append(reading)
        if not self._baseline_taken and len(self.readings) >= self.warmup_steps:
            # the last warm-up step ends here: what is alive now is the baseline
            self._take_baseline()

    def _read(self) -> int:
        if self._index is not None:
            return read_cuda_figures(self._index)[0] if cuda_initialized() else 0
        if not self._baseline_taken:
            return 0
        return sum(self._new_cpu_storages().values())

    def _take_baseline(self) -> None:
        global _freeze_owner
        self._baseline_taken = True
        if self._index is not None:
            if self.record_stacks:
                self._baseline_blocks = {int(b["address"]) for b in _cuda_live_blocks(self._index)}
            return
        gc.collect()
        for tensor in self._live_tensors():
            self._baseline_storages.add(tensor.untyped_storage())
        if self.freeze_baseline and _freeze_owner is None and gc.get_freeze_count() == 0:
            gc.freeze()
            _freeze_owner = self

    def _live_tensors(self) -> list[Any]:
        import torch

        objects = gc.get_objects()
        # type() rather than isinstance: some lazy proxy objects run code on __class__ lookups;
        # set and list comprehensions keep this walk in C as much as Python allows.
        memo = self._tensor_types
        for kind in {type(obj) for obj in objects} - memo.keys():
            memo[kind] = issubclass(kind, torch.Tensor)
        tensor_types = {kind for kind, is_tensor in memo.items() if is_tensor}
        return [obj for obj in objects
                if type(obj) in tensor_types and obj.device.type == "cpu"]

    def _new_cpu_storages(self) -> dict[Any, int]:
        """Live CPU storages created after the baseline -> bytes (each storage counted once)."""
        seen: dict[Any, int] = {}
        for tensor in self._live_tensors():
            storage = tensor.untyped_storage()
            if storage in seen or storage in self._baseline_storages:
                continue
            seen[storage] = int(storage.nbytes())
        return seen

    # verdicts -------------------------------------------------------------------------------
    def verdicts(self) -> dict[str | None, LeakVerdict]:
        """The verdict of each workload's steps (key ``None``: steps given no workload)."""
        return {name: tracker.verdict(self.metric, workload=name)
                for name, tracker in list(self._trackers.items())}

    def verdict(self) -> LeakVerdict:
        """The current verdict from the readings (cheap; no suspects): with several workloads,
        the one :func:`combine_verdicts` picks."""
        return self._combined(())

    def report(self) -> LeakVerdict:
        """The verdict plus the surviving allocations grouped by stack, largest first."""
        return self._combined(self.suspects())

    def _combined(self, suspects: Sequence[LeakSuspect]) -> LeakVerdict:
        combined = combine_verdicts(self.verdicts().values(), suspects)
        if combined is None:  # no step yet
            return GrowthTracker(self.warmup_steps, self.window, self.threshold).verdict(
                self.metric, suspects)
        return combined

    def suspects(self) -> list[LeakSuspect]:
        """Allocations made after the baseline that are still alive, grouped by stack."""
        if not self._baseline_taken:
            return []
        groups: dict[tuple[str, ...], list[Any]] = {}
        if self._index is not None:
            if not self.record_stacks:
                return []
            for block in _cuda_live_blocks(self._index):
                if int(block["address"]) in self._baseline_blocks:
                    continue
                stack = format_frames(_block_frames(block), self.stack_depth)
                entry = groups.setdefault(stack, [0, 0, ""])
                entry[0] += int(block.get("size", 0))
                entry[1] += 1
                entry[2] = entry[2] or f"block of {int(block.get('size', 0))} B"
        else:
            stacks = self._recorder.stacks if self._recorder is not None else {}
            examples: dict[Any, str] = {}
            for tensor in self._live_tensors():
                storage = tensor.untyped_storage()
                if storage not in examples:
                    examples[storage] = (f"{str(tensor.dtype).replace('torch.', '')}"
                                         f"{list(tensor.shape)}")
            for storage, nbytes in self._new_cpu_storages().items():
                raw = stacks.get(storage)
                stack = format_frames(raw, self.stack_depth) if raw else STACK_UNKNOWN
                entry = groups.setdefault(stack, [0, 0, ""])
                entry[0] += nbytes
                entry[1] += 1
                entry[2] = entry[2] or examples.get(storage, "")
        ranked = sorted(groups.items(), key=lambda kv: kv[1][0], reverse=True)
        return [LeakSuspect(stack, int(b), int(c), str(e))
                for stack, (b, c, e) in ranked[: self.max_suspects]]

    def __repr__(self) -> str:
        v = self.verdict()
        return (f"LeakDetector(device={self.device!r}, steps={v.steps}, leak={v.leak}, "
                f"bytes_per_step={v.bytes_per_step:.0f})")
