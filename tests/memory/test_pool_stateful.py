"""Property test of MemoryPool: random allocate/free/drop/defragment/trim/reset sequences.

After every step the pool must account exactly for its blocks, never overlap them, never exceed
its cap, and relocatable blocks must keep their contents across compaction.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vramkit.errors import PoolExhaustedError
from vramkit.memory import pool as pool_module
from vramkit.memory.pool import Block, MemoryPool, PoolConfig

MAX_SIZE = 256 * 1024


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: MemoryPool | None = None
        self.live: list[tuple[Block, torch.Tensor]] = []
        self.dropped = 0
        self.handed_out = 0  # bytes allocate() returned since creation or reset_stats
        self.now = 0.0
        self._real_clock = pool_module._clock
        pool_module._clock = lambda: self.now  # expiry driven by the advance_clock rule

    def teardown(self) -> None:
        pool_module._clock = self._real_clock

    @initialize(growth=st.sampled_from([1.0, 1.5, 2.0]), cached=st.sampled_from([0, 2, 8]),
                threshold=st.sampled_from([0.0, 0.5, 1.0]), alignment=st.sampled_from([64, 512]),
                initial=st.sampled_from([0, 16 * 1024]))
    def make_pool(self, growth: float, cached: int, threshold: float, alignment: int,
                  initial: int) -> None:
        self.pool = MemoryPool("cpu", PoolConfig(
            max_size=MAX_SIZE, growth_factor=growth, max_cached_buffers=cached,
            defrag_threshold=threshold, alignment=alignment, initial_size=initial,
            cleanup_interval=5.0))

    # Large sizes (up to 5/8 of the cap) make refusals common enough to check them.
    @rule(nbytes=st.one_of(st.integers(1, 4096), st.integers(4097, 40000),
                           st.integers(40001, 160000), st.sampled_from([512, 1024, 3000])),
          relocatable=st.booleans(), seed=st.integers(0, 250))
    def allocate(self, nbytes: int, relocatable: bool, seed: int) -> None:
        assert self.pool is not None
        sizes_before = self.pool.segment_sizes()
        defrags_before = self.pool.stats().defragmentations
        try:
            block = self.pool.allocate(nbytes, relocatable=relocatable)
        except PoolExhaustedError as exc:
            self.check_refusal_is_genuine(exc, nbytes, sizes_before, defrags_before)
            return
        pattern = (torch.arange(nbytes, dtype=torch.int64) * 7 + seed).remainder_(256)
        pattern = pattern.to(torch.uint8)
        block.tensor.copy_(pattern)
        self.live.append((block, pattern))
        self.handed_out += block.capacity

    def check_refusal_is_genuine(self, exc: PoolExhaustedError, nbytes: int,
                                 sizes_before: dict[int, int], defrags_before: int) -> None:
        """A refusal must follow the pool's rule, step by step, or it is spurious.

        Before refusing, the pool flushes the cache (cached blocks may coalesce into a fit),
        compacts when relocatable blocks are live and fragmentation exceeds defrag_threshold,
        releases empty segments, and fails only when growing by the request would pass the cap.
        """
        assert self.pool is not None
        config = self.pool.config
        stats = exc.stats
        assert stats is not None and exc.requested == nbytes
        cap = -(-nbytes // config.alignment) * config.alignment
        # No free range fits, and a segment of the request would pass the cap (a host pool
        # grows by at least the request whenever that much room is left).
        assert stats.largest_free_block < cap and stats.reserved + cap > MAX_SIZE
        assert stats.cached == 0 and stats.pending == 0  # the cache was flushed into the arena
        # Every segment holds a live block: no empty segment was left unreleased.
        sizes = self.pool.segment_sizes()
        assert set(sizes) <= {block.segment for block, _ in self.live}
        relocatable_live = any(block.relocatable for block, _ in self.live)
        if relocatable_live and stats.defragmentations == defrags_before:
            # Not compacted: fragmentation was at most the threshold when the pool decided, i.e.
            # after the flush and before the segments it released at the end.
            released = [size for segment, size in sizes_before.items() if segment not in sizes]
            usable = stats.free + sum(released)
            largest = max([stats.largest_free_block, *released])
            fragmentation = 1.0 - largest / usable if usable else 0.0
            assert fragmentation <= config.defrag_threshold

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def free(self, index: int) -> None:
        block, _ = self.live.pop(index % len(self.live))
        block.free()

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def drop_handle(self, index: int) -> None:
        # The handle dies here (the list held the only reference): its finalizer returns it.
        del self.live[index % len(self.live)]
        self.dropped += 1

    @rule()
    def defragment(self) -> None:
        assert self.pool is not None
        self.pool.defragment()

    @rule()
    def trim(self) -> None:
        assert self.pool is not None
        self.pool.trim()

    @rule()
    def reset_stats(self) -> None:
        assert self.pool is not None
        self.pool.reset_stats()
        stats = self.pool.stats()
        assert stats.peak_allocated == stats.allocated and stats.num_allocations == 0
        assert stats.total_allocated == 0
        self.dropped = 0
        self.handed_out = 0

    @rule(seconds=st.sampled_from([1.0, 6.0]))
    def advance_clock(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def accounting_is_exact(self) -> None:
        if self.pool is None:
            return
        stats = self.pool.stats()
        blocks = [block for block, _ in self.live]
        assert stats.allocated == sum(b.capacity for b in blocks)
        assert stats.requested == sum(b.nbytes for b in blocks)
        assert stats.live_blocks == len(blocks)
        assert stats.reserved == sum(self.pool.segment_sizes().values())
        assert stats.free + stats.allocated == stats.reserved
        assert stats.cached + stats.pending <= stats.free
        assert stats.reserved <= MAX_SIZE and stats.peak_reserved <= MAX_SIZE
        assert stats.peak_allocated >= stats.allocated and stats.peak_reserved >= stats.reserved
        assert 0.0 <= stats.fragmentation <= 1.0
        assert stats.largest_free_block <= stats.free
        assert stats.leaked_frees == self.dropped
        # Cumulative: every byte handed out counts, freed, dropped, compacted or not.
        assert stats.total_allocated == self.handed_out

    @invariant()
    def blocks_never_overlap(self) -> None:
        if self.pool is None:
            return
        sizes = self.pool.segment_sizes()
        placed = sorted((b.segment, b.offset, b.capacity) for b, _ in self.live)
        for (seg, off, cap), (next_seg, next_off, _) in itertools.pairwise(placed):
            if seg == next_seg:
                assert off + cap <= next_off
        for seg, off, cap in placed:
            assert off % self.pool.config.alignment == 0
            assert off + cap <= sizes[seg]

    @invariant()
    def contents_survive(self) -> None:
        for block, pattern in self.live:
            assert torch.equal(block.tensor, pattern)


PoolMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestPoolStateMachine = PoolMachine.TestCase
