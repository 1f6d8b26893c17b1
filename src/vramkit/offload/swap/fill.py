"""Filling a swapper's pinned masters at attach, in the foreground or in the background.

:class:`MasterFill` gives each swapped block its pinned master and writes the block's tensors
into it, block by block in execution order:

* a driver thread page-locks the next block's master (``cudaHostRegister`` through the pinned
  pool) while the read threads fill the ones before it, no further ahead than the reads need:
  ``LEAD`` blocks, or more while the blocks pinned and not yet read hold less than
  ``LEAD_BYTES`` (small blocks: a 283 MB Flux block is only 5 reads, so two of them left
  the 8 read threads idle while the next one was pinned). Pinning populates the pages (CPU
  work) and registers them under the CUDA driver's lock, so it is spread over the whole fill
  instead of being done all at the start, beside the main thread's first CUDA calls (a
  background fill runs beside the first steps);
* the tensors of a block that follow each other in a file are read by requests of up to
  ``PIECE`` bytes, each one ``preadv`` scattered into their places in the master
  (:meth:`CheckpointSource.scatter_jobs`), and all of a block's requests are queued at once,
  so the disk sees a steady queue of large sequential reads (no barrier per tensor) --
  straight from the checkpoint file into the master;
* a tensor that comes from the model instead (a model on the CPU) is copied by the same
  threads.

In the foreground (``wait_all`` at once) this is the attach. In the background
(``BlockSwapper(..., checkpoint=path)`` with frozen swapped weights) the swapper returns as soon
as the resident tensors are on the device and the first steps run while the masters fill: a
block's first use waits for its own bytes only (:meth:`MasterFill.wait`), so the first forward
pass keeps pace with the disk and the time to the first step is close to the checkpoint's read
time. A read error surfaces where the block is next needed, as an :class:`OffloadError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vramkit.errors import OffloadError
from vramkit.io._header import TensorEntry
from vramkit.offload.swap.records import SwapEntry, SwappedBlock, typed_view

if TYPE_CHECKING:
    from vramkit.offload.swap.source import CheckpointSource

__all__ = ["FillSpec", "MasterFill"]

logger = logging.getLogger(__name__)

PIECE = 64 << 20  # one read request: large for the disk (readahead, deep queues), and a block
# (hundreds of MB) is still several requests for the threads to share
LEAD = 2  # blocks allocated (pinned) ahead of the oldest block still being read, at least
LEAD_BYTES = 1 << 30  # ... and more while those hold less than this: 16 reads of PIECE queued


@dataclass(frozen=True)
class FillSpec:
    """Where one swapped tensor's value comes from: ``file`` (a checkpoint tensor) or ``data``
    (the model's tensor as it was before the swapper replaced it by a placeholder)."""

    entry: SwapEntry
    file: TensorEntry | None
    data: torch.Tensor | None


def _stopped() -> OffloadError:
    return OffloadError("the swapper was detached (or its attach failed) before this block's "
                        "master was filled", hint="Attach again to load the weights.")


class _Pending:
    """One block's fill: how many of its jobs are still running, and the first error."""

    __slots__ = ("error", "event", "filled_at", "lock", "pinned_at", "remaining", "specs")

    def __init__(self, specs: list[FillSpec]) -> None:
        self.specs: list[FillSpec] | None = specs  # dropped once filled (frees model tensors)
        self.event = threading.Event()
        self.lock = threading.Lock()
        self.remaining = 0
        self.error: BaseException | None = None
        self.pinned_at: float | None = None  # seconds since the fill started
        self.filled_at: float | None = None


class MasterFill:
    """Allocates and fills the masters of ``blocks`` (see the module docstring).

    Args:
        blocks: the blocks, in the order they are filled (execution order).
        specs: per block, where each of its entries' values come from.
        allocate: gives a block its master (pinning it) and returns it; runs on the driver
            thread, one block at a time.
        source: the checkpoint ``FillSpec.file`` entries are read from.
        threads: read/copy threads.
        on_done: called once on the driver thread when every block is filled or the fill
            stopped (closes the checkpoint in the background case).
    """

    def __init__(self, blocks: Sequence[SwappedBlock], specs: dict[int, list[FillSpec]],
                 allocate: Callable[[SwappedBlock], torch.Tensor],
                 source: CheckpointSource | None, *, threads: int,
                 on_done: Callable[[], None] | None = None) -> None:
        self.blocks = list(blocks)
        self._pending = {id(b): _Pending(specs[id(b)]) for b in self.blocks}
        self._allocate = allocate
        self._source = source
        self._threads = threads
        self._on_done = on_done
        self._cancelled = False
        self._error: BaseException | None = None  # the first error (the fill failed)
        self._alloc_error: BaseException | None = None  # pinning failed: later blocks fail too
        self._driver: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.background = False
        self.started = 0.0
        self.seconds: float | None = None  # from start until every block is filled
        self.nbytes = sum(b.nbytes for b in self.blocks)
        self._gate = threading.Condition()
        self._running = 0
        self._limit: int | None = None
        # What the figures of a fill are made of (see :meth:`figures`).
        self._busy = 0.0  # integral of the reads/copies in flight over time
        self._changed = 0.0

    def limit(self, jobs: int | None) -> None:
        """Run at most ``jobs`` reads/copies at once from now on (``None``: as many as there
        are threads). The attach lowers it while it loads the resident tensors itself, so the
        disk serves both but the resident tensors first -- the first forward needs them all."""
        with self._gate:
            self._limit = jobs
            self._gate.notify_all()

    # -- running ---------------------------------------------------------------------------

    def start(self, *, background: bool, on_done: Callable[[], None] | None = None) -> None:
        """Start filling; blocks are usable as :meth:`wait` returns for them. ``on_done``
        (when given) replaces the constructor's: the caller learns it only now."""
        if on_done is not None:
            self._on_done = on_done
        self.background = background
        self.started = time.perf_counter()
        for block in self.blocks:
            block.fill = self
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="vramkit-fill")
        self._driver = threading.Thread(target=self._drive, name="vramkit-fill-driver",
                                        daemon=True)
        self._driver.start()

    def _drive(self) -> None:
        pool = self._pool
        assert pool is not None
        oldest = 0  # the first block whose reads may still run
        try:
            for i, block in enumerate(self.blocks):
                pending = self._pending[id(block)]
                # Pin no further ahead than the reads need (see the module docstring).
                while oldest < i:
                    ahead = self._pending[id(self.blocks[oldest])]
                    if ahead.event.is_set():
                        oldest += 1
                        continue
                    if (i - oldest < LEAD
                            or sum(b.nbytes for b in self.blocks[oldest:i]) < LEAD_BYTES):
                        break
                    ahead.event.wait()
                # A read error fails its own block only (the others are still read: what can
                # be had is had, and detach restores the most); a block that could not be
                # pinned stops the fill.
                if self._cancelled or self._alloc_error is not None:
                    self._fail(pending, self._alloc_error or _stopped())
                    continue
                try:
                    master = self._allocate(block)
                    pending.pinned_at = time.perf_counter() - self.started
                    jobs = self._jobs(block, master, pending)
                except BaseException as exc:
                    self._error = self._error or exc
                    self._alloc_error = self._alloc_error or exc
                    self._fail(pending, exc)
                    continue
                pending.remaining = len(jobs)
                if not jobs:
                    self._finish_block(pending)
                for job in jobs:
                    pool.submit(self._run_job, job, pending)
        finally:
            pool.shutdown(wait=True)
            if self._error is None and not self._cancelled:
                self.seconds = time.perf_counter() - self.started
                for block in self.blocks:
                    block.fill = None  # every later use finds its bytes in place
                if self.background:
                    logger.info("BlockSwapper: %d swapped blocks (%.2f GiB) filled in the "
                                "background in %.1f s (%.1f reads in flight on average)",
                                len(self.blocks), self.nbytes / 2**30, self.seconds,
                                self.figures()["mean_in_flight"])
            if self._on_done is not None:
                self._on_done()

    def _jobs(self, block: SwappedBlock, master: torch.Tensor,
              pending: _Pending) -> list[Callable[[], None]]:
        jobs: list[Callable[[], None]] = []
        assert pending.specs is not None
        reads: list[tuple[TensorEntry, torch.Tensor]] = []
        for spec in pending.specs:
            view = typed_view(master, spec.entry.offset, spec.entry)
            if spec.file is not None:
                reads.append((spec.file, view))
            else:
                data = spec.data
                assert data is not None
                jobs.append(lambda v=view, d=data: v.copy_(d))
        if reads:
            assert self._source is not None
            jobs += self._source.scatter_jobs(reads, PIECE)
        return jobs

    def _run_job(self, job: Callable[[], None], pending: _Pending) -> None:
        with self._gate:
            while self._limit is not None and self._running >= self._limit:
                self._gate.wait()
            self._tick(+1)
        try:
            if pending.error is None and not self._cancelled:
                try:
                    job()
                except BaseException as exc:
                    with pending.lock:
                        pending.error = pending.error or exc
                    self._error = self._error or exc
        finally:
            with self._gate:
                self._tick(-1)
                self._gate.notify()
        with pending.lock:
            pending.remaining -= 1
            last = pending.remaining == 0
        if last:
            if self._cancelled and pending.error is None:
                pending.error = _stopped()
            self._finish_block(pending)

    def _tick(self, change: int) -> None:
        # Under self._gate: the in-flight count changes; its time integral grows.
        now = time.perf_counter()
        self._busy += self._running * (now - self._changed) if self._changed else 0.0
        self._changed = now
        self._running += change

    def _finish_block(self, pending: _Pending) -> None:
        pending.filled_at = time.perf_counter() - self.started
        if pending.error is None:
            pending.specs = None  # kept on failure: the model's own values can still go back
        pending.event.set()

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        pending.error = pending.error or exc
        self._finish_block(pending)

    # -- waiting -----------------------------------------------------------------------------

    def wait(self, block: SwappedBlock) -> None:
        """Return once ``block``'s master holds its values.

        Raises:
            OffloadError: reading or copying them failed (or the fill was cancelled).
        """
        pending = self._pending[id(block)]
        pending.event.wait()
        if pending.error is not None:
            raise self._wrapped(block, pending.error)

    def settled(self, block: SwappedBlock, timeout: float | None = None) -> bool:
        """Whether ``block``'s fill is over (filled or failed), waiting up to ``timeout``
        seconds for it (a background encode polls this, so that a cancel stops its wait)."""
        return self._pending[id(block)].event.wait(timeout)

    def failed(self, block: SwappedBlock) -> bool:
        """Whether ``block``'s fill is over without its values (:meth:`wait` raises why)."""
        pending = self._pending[id(block)]
        return pending.event.is_set() and pending.error is not None

    def wait_all(self, advance: Callable[[int], Any] | None = None) -> None:
        """Wait for every block in fill order (``advance(bytes)`` after each)."""
        for block in self.blocks:
            self.wait(block)
            if advance is not None:
                advance(block.nbytes)
        self.join()

    def join(self) -> None:
        """Wait for the driver to finish (every job done or dropped)."""
        if self._driver is not None and self._driver is not threading.current_thread():
            self._driver.join()

    def cancel(self) -> None:
        """Stop filling: queued reads are dropped, running ones finish; returns when nothing
        writes into the masters any more (blocks not filled by then fail)."""
        self._cancelled = True
        self.limit(None)  # jobs waiting for a turn go on, and drop their reads at once
        if self._driver is None:  # never started
            for pending in self._pending.values():
                if not pending.event.is_set():
                    self._fail(pending, _stopped())
        self.join()

    def covers(self, block: SwappedBlock) -> bool:
        """Whether ``block``'s master is (or was to be) filled by this fill."""
        return id(block) in self._pending

    def originals(self, block: SwappedBlock) -> list[torch.Tensor | None]:
        """The model's own tensors a block not filled came from (``None`` for those read from
        the checkpoint, which were never anywhere else)."""
        pending = self._pending[id(block)]
        if pending.specs is None:
            return [None] * len(block.entries)
        return [spec.data for spec in pending.specs]

    @property
    def done(self) -> bool:
        """Whether every block is filled (or failed)."""
        return all(p.event.is_set() for p in self._pending.values())

    def figures(self) -> dict[str, Any]:
        """How the fill went, for benchmarks and logs: ``seconds`` (start to last block),
        ``mean_in_flight`` (reads/copies running at once, averaged over that time: the read
        threads' occupancy) and ``blocks``, per block ``(name, bytes, pinned_at, filled_at)``
        in seconds since the start (``None`` where it did not happen)."""
        with self._gate:
            busy = self._busy + (self._running * (time.perf_counter() - self._changed)
                                 if self._changed else 0.0)
        span = max((p.filled_at or 0.0 for p in self._pending.values()), default=0.0)
        return {"seconds": self.seconds, "bytes": self.nbytes,
                "mean_in_flight": busy / span if span > 0 else 0.0,
                "blocks": [(b.name, b.nbytes, self._pending[id(b)].pinned_at,
                            self._pending[id(b)].filled_at) for b in self.blocks]}

    def _wrapped(self, block: SwappedBlock, exc: BaseException) -> OffloadError:
        if isinstance(exc, OffloadError):
            return exc
        where = (f"reading swapped block {block.name} from {self._source.source}"
                 if self._source is not None else f"copying swapped block {block.name}")
        error = OffloadError(f"{where} failed: {type(exc).__name__}: {exc}",
                             hint="Check the checkpoint file and the disk (a file changed or "
                                  "truncated after it was opened?); the swapper cannot run "
                                  "without these weights.")
        error.__cause__ = exc
        return error
