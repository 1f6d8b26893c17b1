"""The demo's timing harness: training runs stepped one at a time, paired alternating rounds, the
CUDA memory cap, and the profiler the runs report to.

**One step-time statistic.** Every figure of speed is the *median step time with the first step
left out* (:func:`median_step_seconds`; the first step learns the block order and starts the
libraries). :class:`DemoProgress` carries the running value of the same statistic, so a
progress bar and the summary agree.

**Paired rounds** (:func:`alternate`): round ``r`` runs one step of each of two runs, the
swapped one first in even rounds and second in odd ones (ABBA), so drift of a shared machine
(other processes, clocks) falls on both alike. The ratio of the two medians comes with the spread
of the rounds' own ratios (:func:`ratio_spread`): on a loaded machine they scatter, and when
their interquartile range is wider than :data:`WIDE_SPREAD` of their median the ratio is said to
mean little (the same demo read 1.14x, 0.37x and 1.09x on a loaded CPU).

**Step times** come from CUDA events around each step (or the host clock on the CPU); the host
stays at most one step ahead of the GPU (a step's loss is read while the next step is already
queued), so the swapper's copy stream is not drained by the harness itself.

**Profile.** Each run is a profiler workload (``"swapped"`` or ``"resident"``): the leak verdict
judges each run's own steps, never the switch from one run to the other. After each phase of a
swapped step the swapper's new block loads are recorded as ``"block loads"`` events.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramkit.recipes.dit import DiTConfig, flow_matching_loss, synthetic_batch

__all__ = ["MIN_ROUNDS", "WIDE_SPREAD", "DemoProgress", "ProgressCallback", "RatioSpread", "TrainingRun",
           "alternate", "fixed_batch", "make_profiler", "median_step_seconds", "memory_cap",
           "ratio_spread"]

#: The rule for a ratio that means little: its rounds' ratios have an interquartile range wider
#: than this share of their median (0.2: a 1.10x ratio whose middle half of rounds spans more
#: than 0.22x), or fewer than :data:`MIN_ROUNDS` rounds were timed.
WIDE_SPREAD = 0.2
#: Fewer paired rounds than this (the first left out) cannot show a spread.
MIN_ROUNDS = 4


@dataclass(frozen=True)
class DemoProgress:
    """One progress report of :func:`~vramkit.recipes.demo.run_demo`.

    Attributes:
        stage: ``"build"`` (making the model), ``"train"`` (under swapping) or ``"baseline"``
            (fully resident).
        step: steps finished in this stage (0: the stage starts).
        total: steps of this stage (0 for ``"build"``).
        loss: loss of the step just finished, else ``None``.
        step_seconds: its duration, else ``None``.
        median_step_seconds: the stage's median step time so far, the first step left out once
            there are two (the statistic ``DemoResult`` reports), else ``None``.
    """

    stage: str
    step: int
    total: int
    loss: float | None = None
    step_seconds: float | None = None
    median_step_seconds: float | None = None


ProgressCallback = Callable[[DemoProgress], None]

#: The host clock CPU step times are read from (a module attribute, so tests can drive it).
_clock = time.perf_counter


def median_step_seconds(step_seconds: list[float]) -> float:
    """The demo's step-time statistic: the median, the first step left out when there are two
    or more."""
    timed = step_seconds[1:] if len(step_seconds) >= 2 else step_seconds
    return statistics.median(timed)


def fixed_batch(config: DiTConfig, batch_size: int, seed: int,
                device: torch.device) -> dict[str, torch.Tensor]:
    """One fixed synthetic batch, as in a few-image (DreamBooth-style) LoRA fine-tune: the loss
    falls visibly within a few steps, and runs seeded alike see the same data."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return synthetic_batch(config, batch_size, generator=generator, device=device)


class TrainingRun:
    """One training run: its model, an AdamW over ``params``, a fixed batch, and per-step
    results (``losses`` as 0-d tensors, ``seconds``).

    Each :meth:`step` is one AdamW step under the profiler's workload (``"swapped"`` for stage
    ``"train"``, ``"resident"`` for ``"baseline"``), with phase marks and, when ``loads`` is
    given (the swapper's load counter), the new block loads recorded as profiler events after
    each phase.
    """

    def __init__(self, stage: str, model: nn.Module, params: list[nn.Parameter], *,
                 steps: int, learning_rate: float, batch: Any, device: torch.device,
                 profiler: Any = None, progress: ProgressCallback | None = None,
                 loads: Callable[[], int] | None = None) -> None:
        self.stage = stage
        self.workload = "swapped" if stage == "train" else "resident"
        self.model = model
        self.total = steps
        self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
        self.batch = batch
        self.cuda = device.type == "cuda"
        self.profiler = profiler
        self.progress = progress
        self.loads = loads
        self.loads_seen = loads() if loads is not None else 0
        self.losses: list[torch.Tensor] = []
        self.seconds: list[float] = []
        self.pending: list[tuple[Any, Any]] = []  # CUDA events of steps not read yet

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return _clock()

    def _mark(self, phase: str | None) -> None:
        if self.profiler is not None:
            self.profiler.mark(None if phase is None else f"{self.workload} {phase}")

    def _note_loads(self, phase: str) -> None:
        if self.loads is None or self.profiler is None:
            return
        loads = self.loads()
        if loads > self.loads_seen:
            count = loads - self.loads_seen
            self.profiler.event("block loads", f"{count} block loads in {self.workload} "
                                               f"{phase}, step {len(self.losses) + 1}", count)
        self.loads_seen = loads

    def step(self) -> None:
        """One training step; reports it (on CUDA: the previous one, still on the GPU now)."""
        if not self.losses and self.progress is not None:
            self.progress(DemoProgress(self.stage, 0, self.total))
        workload = (self.profiler.workload(self.workload) if self.profiler is not None
                    else contextlib.nullcontext())
        with workload:
            start = self._now()
            self._mark("forward")
            loss = flow_matching_loss(self.model, self.batch)
            self._note_loads("forward")
            self._mark("backward")
            loss.backward()
            self._note_loads("backward")
            self._mark("optimizer")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            end = self._now()
            self._mark(None)
            if self.profiler is not None:
                self.profiler.step()
        # a 0-d copy: the loss tensor itself keeps a larger storage alive (2 KiB on the CPU)
        self.losses.append(loss.detach().clone())
        if self.cuda:
            self.pending.append((start, end))
            if len(self.pending) > 1:  # the host stays one step ahead of the device
                self._report(*self.pending.pop(0))
        else:
            self._report(start, end)

    def finish(self) -> None:
        """Report the steps still on the device."""
        while self.pending:
            self._report(*self.pending.pop(0))

    def _report(self, start: Any, end: Any) -> None:
        if self.cuda:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
        else:
            seconds = end - start
        self.seconds.append(seconds)
        index = len(self.seconds) - 1
        if self.progress is not None:
            self.progress(DemoProgress(self.stage, index + 1, self.total,
                                       float(self.losses[index]), seconds,
                                       median_step_seconds(self.seconds)))

    def run(self) -> None:
        """Every step, then the report of those still on the device."""
        for _ in range(self.total):
            self.step()
        self.finish()


def alternate(swapped: TrainingRun, resident: TrainingRun) -> list[dict[str, Any]]:
    """Paired rounds: one step of each run per round, the swapped one first in even rounds and
    second in odd ones (ABBA), so drift of the machine falls on both alike. Returns one entry
    per round: ``{"round", "first", "swapped_seconds", "resident_seconds"}``."""
    rounds = []
    for index in range(swapped.total):
        order = (swapped, resident) if index % 2 == 0 else (resident, swapped)
        for run in order:
            run.step()
        rounds.append({"round": index, "first": order[0].workload,
                       "swapped_seconds": swapped.seconds[index],
                       "resident_seconds": resident.seconds[index]})
    return rounds


@dataclass(frozen=True)
class RatioSpread:
    """How the per-round ratios (swapped step / resident step of one round) of paired rounds
    scatter, the first round left out as in :func:`median_step_seconds`.

    Attributes:
        rounds: the rounds counted.
        low / q1 / median / q3 / high: the ratios' minimum, quartiles and maximum.
        wide: the rule of :data:`WIDE_SPREAD` holds: the ratio means little.
        rule: the rule, in words.
    """

    rounds: int
    low: float
    q1: float
    median: float
    q3: float
    high: float
    wide: bool
    rule: str

    def describe(self) -> str:
        """``"rounds 0.95-1.31x (middle half 1.02-1.18x, 9 rounds)"`` and, when wide, why the
        ratio means little."""
        text = (f"rounds {self.low:.2f}-{self.high:.2f}x (middle half {self.q1:.2f}-"
                f"{self.q3:.2f}x, {self.rounds} round{'s' if self.rounds != 1 else ''})")
        if self.wide:
            text += f"; too spread for the ratio to mean much ({self.rule})"
        return text


def ratio_spread(rounds: list[dict[str, Any]]) -> RatioSpread | None:
    """The spread of the per-round ratios of :func:`alternate`'s rounds (``None``: no rounds)."""
    timed = rounds[1:] if len(rounds) >= 2 else rounds
    ratios = sorted(r["swapped_seconds"] / r["resident_seconds"] for r in timed
                    if r["resident_seconds"] > 0)
    if not ratios:
        return None
    if len(ratios) >= 2:
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        q1 = median = q3 = ratios[0]
    rule = (f"the middle half of the rounds' ratios spans more than {WIDE_SPREAD:.0%} of "
            f"their median, or fewer than {MIN_ROUNDS} rounds were timed")
    wide = len(ratios) < MIN_ROUNDS or (q3 - q1) > WIDE_SPREAD * median
    return RatioSpread(rounds=len(ratios), low=ratios[0], q1=q1, median=median, q3=q3,
                       high=ratios[-1], wide=wide, rule=rule)


@contextlib.contextmanager
def memory_cap(device: torch.device, budget: int) -> Iterator[tuple[int, int]]:
    """Cap this process's CUDA allocator at what it holds now plus ``budget``; yields the bytes
    (allocated, reserved) before, and restores the previous fraction on exit.

    Garbage is collected first: device tensors of earlier work that only the collector would
    free (reference cycles) would count in "before" and, freed during the run, take the run's
    own peak below it (a second demo in one process read a peak of 0 bytes)."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = get_fraction(device) if get_fraction is not None else 1.0  # torch < 2.9: no getter
    held = torch.cuda.memory_reserved(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, (held + budget) / total), device)
    try:
        torch.cuda.reset_peak_memory_stats(device)
        yield torch.cuda.memory_allocated(device), held
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def make_profiler(device: str, report: str | Path | None) -> tuple[Any, str | None]:
    """The memory profiler the runs report to: ``(profiler, None)``, or ``(None, why not)``.

    The demo's only use of :mod:`vramkit.memory`'s profiler and leak detector is here."""
    if report is None:
        return None, "no report asked for"
    try:
        from vramkit.observe.leaks import LeakDetector
        from vramkit.observe.profiler import MemoryProfiler
    except ImportError as exc:  # the profiler is optional for the demo
        return None, f"memory profiler unavailable: {exc}"
    # On the CPU the leak verdict counts live tensor bytes: host RSS, the timeline's figure
    # there, also grows while the C allocator's arenas settle in the first steps. On CUDA the
    # profiler's allocated bytes are exact already.
    detector = (LeakDetector("cpu", record_stacks=False) if device == "cpu" else False)
    # The demo reads the CUDA peak itself, so the profiler must not reset it.
    return MemoryProfiler(device=device, sample_interval=0.02, reset_peak=False,
                          detect_leaks=detector), None
