"""Functional tests of vramkit.memory.pool on host memory (no GPU needed)."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import numpy as np
import pytest
import torch

from vramkit.errors import (
    ConfigError,
    DeviceError,
    DeviceMismatchError,
    InvalidBlockError,
    PoolExhaustedError,
)
from vramkit.memory import _arena, _segments
from vramkit.memory import pool as pool_module
from vramkit.memory._arena import Arena, PoolLedger, fit_segment
from vramkit.memory.pool import Block, MemoryPool, PoolConfig, PoolStats, live_pools

KiB = 1024
MiB = 1024 * 1024


def make_pool(**config: object) -> MemoryPool:
    return MemoryPool("cpu", PoolConfig(**config))


class FakeClock:
    """Stands in for time.monotonic so cache expiry and ages are deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(pool_module, "_clock", fake)
    return fake


# -- PoolConfig ------------------------------------------------------------------------------


def test_config_defaults_and_size_strings() -> None:
    config = PoolConfig(initial_size="1MiB", max_size="8 MiB")
    assert config.initial_size == MiB and config.max_size == 8 * MiB
    assert config.alignment == 512 and config.growth_factor == 2.0
    assert PoolConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("kwargs", [
    dict(growth_factor=0.9), dict(growth_factor=float("nan")), dict(growth_factor="2"),
    dict(max_size=0), dict(max_size="lots"), dict(initial_size=-1),
    dict(initial_size="2MiB", max_size="1MiB"), dict(defrag_threshold=1.5),
    dict(defrag_threshold=-0.1), dict(max_cached_buffers=-1), dict(max_cached_buffers=1.5),
    dict(max_cached_buffers=True), dict(cleanup_interval=0), dict(enable_memory_tracking=1),
    dict(alignment=384), dict(alignment=0), dict(alignment=True),
])
def test_config_rejects_invalid_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PoolConfig(**kwargs)


def test_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        PoolConfig.from_dict({"max_pool_size": 1})


def test_config_presets_differ_as_documented() -> None:
    dev, prod, test = PoolConfig.development(), PoolConfig.production(), PoolConfig.testing()
    assert dev.enable_memory_tracking and test.enable_memory_tracking
    assert prod.max_cached_buffers > dev.max_cached_buffers > test.max_cached_buffers
    assert prod.cleanup_interval > dev.cleanup_interval > test.cleanup_interval
    assert test.max_size == 1 << 30 and test.growth_factor == 1.0
    assert prod.max_size is None
    assert PoolConfig.production(max_size="2GiB").max_size == 2 << 30


def test_memory_debug_env_turns_tracking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRAMKIT_MEMORY_DEBUG", raising=False)
    assert PoolConfig().enable_memory_tracking is False
    monkeypatch.setenv("VRAMKIT_MEMORY_DEBUG", "1")
    assert PoolConfig().enable_memory_tracking is True
    assert PoolConfig(enable_memory_tracking=False).enable_memory_tracking is False


# -- construction and devices ----------------------------------------------------------------


def test_pool_rejects_bad_devices_and_configs() -> None:
    with pytest.raises(DeviceError):
        MemoryPool("meta")
    with pytest.raises(DeviceError):
        MemoryPool("not-a-device")
    with pytest.raises(ConfigError):
        MemoryPool(1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        MemoryPool("cpu", {"max_size": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        MemoryPool("cuda:0", pinned=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU errors")
def test_cuda_and_pinned_pools_need_cuda() -> None:
    with pytest.raises(DeviceError, match="CUDA"):
        MemoryPool("cuda")
    with pytest.raises(DeviceError, match="pinned"):
        MemoryPool.pinned()
    assert not torch.cuda.is_initialized()


def test_initial_size_is_reserved_eagerly() -> None:
    pool = make_pool(initial_size="64KiB")
    assert pool.stats().reserved == 64 * KiB and pool.stats().segments == 1
    assert make_pool().stats().reserved == 0


def test_initial_size_sizes_the_first_segment_after_a_trim() -> None:
    pool = make_pool(initial_size="64KiB")
    pool.allocate(4096).free()
    assert pool.trim() == 64 * KiB and pool.stats().reserved == 0
    block = pool.allocate(4096)  # the request (or growth from 0 reserved) would be 4 KiB
    assert pool.segment_sizes() == {1: 64 * KiB} and block.segment == 1


def test_live_pools_tracks_pools_weakly() -> None:
    pool = make_pool()
    assert any(p is pool for p in live_pools())
    pool_id = id(pool)
    del pool
    gc.collect()
    assert all(id(p) != pool_id for p in live_pools())


# -- allocation, alignment, views ------------------------------------------------------------


def test_blocks_are_aligned_and_rounded() -> None:
    pool = make_pool()
    blocks = [pool.allocate(n) for n in (1, 100, 513, 4096)]
    for block in blocks:
        assert block.offset % 512 == 0 and block.data_ptr % 512 == 0
        assert block.capacity == -(-block.nbytes // 512) * 512
    assert pool.stats().allocated == sum(b.capacity for b in blocks)
    assert pool.stats().requested == 1 + 100 + 513 + 4096


def test_alignment_knob_changes_rounding() -> None:
    pool = make_pool(alignment=64)
    block = pool.allocate(100)
    assert block.capacity == 128 and block.data_ptr % 64 == 0


@pytest.mark.parametrize("bad", [0, -4, 1.5, "4KiB", True, None])
def test_allocate_rejects_bad_sizes(bad: object) -> None:
    with pytest.raises(ConfigError):
        make_pool().allocate(bad)  # type: ignore[arg-type]


def test_allocate_accepts_integer_like_sizes() -> None:
    assert make_pool().allocate(np.int64(4096)).nbytes == 4096


def test_views_share_block_memory() -> None:
    pool = make_pool()
    block = pool.allocate(4096)
    view = block.view((4, 256), torch.float32)
    view.fill_(2.5)
    assert block.tensor.numel() == 4096
    assert torch.equal(block.view(1024, torch.float32), torch.full((1024,), 2.5))
    with pytest.raises(ConfigError, match="needs"):
        block.view((2048,), torch.float32)
    with pytest.raises(ConfigError):
        block.view((-1,), torch.float32)


def test_view_refuses_misaligned_dtype() -> None:
    pool = make_pool(alignment=1, max_cached_buffers=0, initial_size=64)
    first = pool.allocate(1)
    block = pool.allocate(16)
    assert block.offset == 1 and first.offset == 0
    with pytest.raises(ConfigError, match="aligned"):
        block.view((2,), torch.float32)


def test_blocks_cannot_be_constructed_directly() -> None:
    with pytest.raises(TypeError):
        Block()


# -- exact-size cache ------------------------------------------------------------------------


def test_cache_hit_returns_same_memory() -> None:
    pool = make_pool()
    first = pool.allocate(3000)
    address = first.data_ptr
    first.free()
    second = pool.allocate(3000)
    assert second.data_ptr == address
    stats = pool.stats()
    assert (stats.cache_hits, stats.cache_misses) == (1, 1)
    assert stats.hit_rate == 0.5


def test_max_cached_buffers_zero_disables_cache() -> None:
    pool = make_pool(max_cached_buffers=0)
    pool.allocate(4096).free()
    pool.allocate(4096).free()
    stats = pool.stats()
    assert stats.cache_hits == 0 and stats.cache_misses == 2 and stats.cached == 0


def test_max_cached_buffers_limits_per_size() -> None:
    pool = make_pool(max_cached_buffers=2)
    blocks = [pool.allocate(1024) for _ in range(3)]
    other = pool.allocate(2048)
    for block in blocks:
        block.free()
    other.free()
    assert pool.stats().cached == 2 * 1024 + 2048  # the third 1 KiB block went to the arena


def test_cached_blocks_expire_after_cleanup_interval(clock: FakeClock) -> None:
    pool = make_pool(cleanup_interval=5.0, initial_size="64KiB")
    a, b = pool.allocate(1024), pool.allocate(1024)
    a.free()
    b.free()
    assert pool.stats().cached == 2048
    clock.now += 4.9
    pool.allocate(4096).free()  # not yet expired; the 4 KiB block is now cached too
    assert pool.stats().cache_expired == 0
    clock.now += 0.2
    c = pool.allocate(512)  # expiry runs lazily here: the 1 KiB blocks return to the arena
    stats = pool.stats()
    assert stats.cache_expired == 2 and stats.cached == 4096
    assert c.offset == 0  # best fit: the coalesced 2 KiB range the expired blocks left
    clock.now += 10
    c.free()  # free also expires
    assert pool.stats().cache_expired == 3


def test_cache_buckets_do_not_accumulate_distinct_sizes(clock: FakeClock) -> None:
    pool = make_pool(cleanup_interval=5.0, initial_size="1MiB")  # never grows (growth flushes)
    for i in range(1, 33):
        pool.allocate(512 * i).free()
    assert len(pool._book.cache) == 32
    clock.now += 6
    pool.allocate(100).free()  # expiry returns every stale bucket; only this size's is left
    assert list(pool._book.cache) == [512]
    held = [pool.allocate(512 * i) for i in range(2, 33)]  # misses: the buckets are gone
    for block in held:
        block.free()
    held = [pool.allocate(512 * i) for i in range(2, 33)]  # hits empty those 31 buckets
    assert pool.stats().cache_hits == 31
    clock.now += 6
    pool.allocate(100).free()  # buckets emptied by hits go at the next expiry too
    assert list(pool._book.cache) == [512]
    for block in held:
        block.free()
    assert len(pool._book.cache) == 32
    pool.trim()  # flushing the cache forgets the buckets as well
    assert pool._book.cache == {}


def test_cleanup_interval_knob_matters(clock: FakeClock) -> None:
    short, long_ = make_pool(cleanup_interval=1.0), make_pool(cleanup_interval=100.0)
    for pool in (short, long_):
        pool.allocate(1024).free()
    clock.now += 2
    for pool in (short, long_):
        pool.allocate(2048).free()
    assert short.stats().cache_expired == 1 and long_.stats().cache_expired == 0


# -- growth and the cap ----------------------------------------------------------------------


def test_growth_factor_scales_reserved() -> None:
    doubling = make_pool(growth_factor=2.0, max_cached_buffers=0)
    exact = make_pool(growth_factor=1.0, max_cached_buffers=0)
    held = [pool.allocate(4096) for pool in (doubling, exact) for _ in range(3)]
    # The 2nd segment grows reserved by x2 (4 KiB -> 8 KiB), the 3rd again (8 KiB -> 16 KiB).
    assert doubling.segment_sizes() == {0: 4096, 1: 4096, 2: 8192}
    assert exact.segment_sizes() == {0: 4096, 1: 4096, 2: 4096}
    assert doubling.allocate(4096).segment == 2 and len(held) == 6  # the spare 4 KiB is used


def test_max_size_is_a_hard_cap() -> None:
    pool = make_pool(max_size="64KiB", growth_factor=4.0)
    blocks = []
    with pytest.raises(PoolExhaustedError) as info:
        while True:
            blocks.append(pool.allocate(5000))
            assert pool.stats().reserved <= 64 * KiB
    err = info.value
    assert isinstance(err.stats, PoolStats) and err.requested == 5000
    assert err.stats.reserved <= 64 * KiB and "max_size" in str(err) and err.hint


def test_request_larger_than_cap_has_specific_hint() -> None:
    pool = make_pool(max_size="1MiB")
    with pytest.raises(PoolExhaustedError, match="larger than max_size") as info:
        pool.allocate(2 * MiB)
    assert "at least 2.0 MiB" in info.value.hint
    assert isinstance(info.value, MemoryError)


def test_empty_segments_are_released_to_make_room_under_the_cap() -> None:
    pool = make_pool(max_size="8KiB", growth_factor=1.0, max_cached_buffers=0)
    a, b = pool.allocate(4096), pool.allocate(4096)
    assert pool.stats().segments == 2
    a.free()
    b.free()
    big = pool.allocate(8192)  # needs one 8 KiB segment: the two empty ones are released
    assert big.nbytes == 8192 and pool.segment_sizes() == {2: 8192}


def test_best_fit_picks_the_smallest_hole() -> None:
    pool = make_pool(max_cached_buffers=0, initial_size="64KiB")
    blocks = [pool.allocate(n) for n in (8192, 1024, 4096, 1024, 16384, 1024)]
    blocks[0].free()  # 8 KiB hole at 0
    blocks[2].free()  # 4 KiB hole
    fit = pool.allocate(4000)
    assert fit.offset == 8192 + 1024  # the 4 KiB hole, not the 8 KiB one


def test_freed_neighbours_coalesce() -> None:
    pool = make_pool(max_cached_buffers=0, initial_size="16KiB")
    blocks = [pool.allocate(4096) for _ in range(4)]
    for i in (0, 2, 1):
        blocks[i].free()
    stats = pool.stats()
    assert stats.largest_free_block == 3 * 4096 and stats.fragmentation == 0.0


def test_fragmentation_is_computed_from_free_ranges() -> None:
    pool = make_pool(max_cached_buffers=0, initial_size="16KiB")
    blocks = [pool.allocate(4096) for _ in range(4)]
    blocks[0].free()
    blocks[2].free()
    stats = pool.stats()
    assert stats.free == 8192 and stats.largest_free_block == 4096
    assert stats.fragmentation == pytest.approx(0.5)
    assert stats.allocated + stats.free == stats.reserved


# -- defragment ------------------------------------------------------------------------------


def _fill(block: Block, seed: int) -> torch.Tensor:
    pattern = torch.arange(block.nbytes, dtype=torch.int64).add_(seed).remainder_(251)
    pattern = pattern.to(torch.uint8)
    block.tensor.copy_(pattern)
    return pattern


def test_defragment_moves_relocatable_blocks_and_keeps_contents() -> None:
    pool = make_pool(max_cached_buffers=0, growth_factor=1.0)
    pinned_down = pool.allocate(4096)
    holes = [pool.allocate(4096) for _ in range(3)]
    movers = [pool.allocate(3000, relocatable=True) for _ in range(3)]
    patterns = [_fill(b, i) for i, b in enumerate(movers)]
    for hole in holes:
        hole.free()
    result = pool.defragment()
    assert result.moved_blocks == 3 and result.moved_bytes == 9000
    for block, pattern in zip(movers, patterns, strict=True):
        assert torch.equal(block.tensor, pattern)
    assert pinned_down.offset == 0 and pinned_down.segment == 0
    # growth_factor=1: one segment per block; movers leave segments 4-6 for the freed 1-3.
    assert sorted(b.segment for b in movers) == [1, 2, 3]
    assert result.released_segments == 3 and pool.stats().segments == 4
    assert pool.stats().defragmentations == 1


@pytest.mark.parametrize("hole,size", [(8192, 16384), (512, 65536)])
def test_defragment_slides_over_overlapping_ranges(hole: int, size: int) -> None:
    # (8 KiB hole, 16 KiB block): chunked copy; (512 B hole, 64 KiB block): staged copy.
    pool = make_pool(max_cached_buffers=0, initial_size=hole + size)
    gap = pool.allocate(hole)
    mover = pool.allocate(size, relocatable=True)
    pattern = _fill(mover, 7)
    gap.free()
    result = pool.defragment()
    assert result.moved_blocks == 1 and mover.offset == 0
    assert torch.equal(mover.tensor, pattern)


def test_non_relocatable_blocks_never_move() -> None:
    pool = make_pool(max_cached_buffers=0, initial_size="16KiB")
    a, b = pool.allocate(4096), pool.allocate(4096)
    a.free()
    assert pool.defragment().moved_blocks == 0 and b.offset == 4096


def _fragmented_at_cap(threshold: float) -> tuple[MemoryPool, list[Block]]:
    pool = make_pool(max_size="32KiB", initial_size="32KiB", max_cached_buffers=0,
                     defrag_threshold=threshold)
    blocks = [pool.allocate(4096, relocatable=True) for _ in range(8)]
    for block in blocks[::2]:
        block.free()  # 4 holes of 4 KiB: fragmentation 0.75, no 8 KiB fit
    return pool, blocks[1::2]


def test_automatic_defragment_when_fragmentation_passes_threshold() -> None:
    pool, live = _fragmented_at_cap(threshold=0.5)
    patterns = [_fill(b, i) for i, b in enumerate(live)]
    big = pool.allocate(8192)
    assert big.nbytes == 8192 and pool.stats().defragmentations == 1
    assert pool.stats().reserved == 32 * KiB
    for block, pattern in zip(live, patterns, strict=True):
        assert torch.equal(block.tensor, pattern)


def test_defrag_threshold_one_disables_automatic_compaction() -> None:
    pool, _ = _fragmented_at_cap(threshold=1.0)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(8192)
    assert pool.stats().defragmentations == 0


# -- trim and clear --------------------------------------------------------------------------


def test_trim_releases_empty_segments_and_flushes_cache() -> None:
    pool = make_pool(growth_factor=1.0)
    keep = pool.allocate(4096)
    pool.allocate(8192).free()  # cached in its own segment
    assert pool.stats().segments == 2 and pool.stats().cached == 8192
    assert pool.trim() == 8192
    stats = pool.stats()
    assert stats.segments == 1 and stats.cached == 0 and stats.reserved == 4096
    assert keep.offset == 0


def test_clear_refuses_live_blocks_unless_forced() -> None:
    pool = make_pool()
    block = pool.allocate(4096)
    with pytest.raises(InvalidBlockError, match="still live"):
        pool.clear()
    pool.clear(force=True)
    assert pool.stats().reserved == 0 and pool.stats().allocated == 0
    with pytest.raises(InvalidBlockError):
        block.view(16)
    with pytest.raises(InvalidBlockError):
        block.free()
    assert pool.allocate(100).nbytes == 100  # the pool is usable again


# -- invalid handles -------------------------------------------------------------------------


def test_double_free_and_use_after_free() -> None:
    pool = make_pool()
    block = pool.allocate(1024)
    block.free()
    assert block.freed
    with pytest.raises(InvalidBlockError, match="double free"):
        pool.free(block)
    for use in (lambda: block.tensor, lambda: block.view(4), lambda: block.data_ptr,
                lambda: block.offset, lambda: block.record_stream(None)):
        with pytest.raises(InvalidBlockError):
            use()
    assert "freed" in repr(block)


def test_free_rejects_foreign_blocks() -> None:
    pool, other = make_pool(), make_pool()
    block = other.allocate(1024)
    with pytest.raises(InvalidBlockError, match="another pool"):
        pool.free(block)
    with pytest.raises(InvalidBlockError, match="expects a Block"):
        pool.free("block")  # type: ignore[arg-type]


def test_record_stream_is_a_no_op_on_host_pools() -> None:
    pool = make_pool()
    block = pool.allocate(1024)
    address = block.data_ptr
    block.record_stream(object())
    block.free()
    assert pool.stats().pending == 0 and pool.allocate(1024).data_ptr == address


def test_record_stream_rejects_streams_of_other_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # The device check itself, exercised without a GPU by posing as a cuda:0 pool.
    class FakeStream:
        def __init__(self, index: int) -> None:
            self.device = torch.device("cuda", index)

        def query(self) -> bool:
            return True

    pool = make_pool()
    monkeypatch.setattr(pool, "kind", "cuda")
    monkeypatch.setattr(pool, "device", torch.device("cuda", 0))
    with pytest.raises(DeviceMismatchError):
        pool._check_stream(FakeStream(1))
    with pytest.raises(ConfigError):
        pool._check_stream(object())
    pool._check_stream(FakeStream(0))


# -- finalizers, pool.tensor -----------------------------------------------------------------


def test_dropped_handle_is_returned_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    pool = make_pool(enable_memory_tracking=True)

    def leaky_helper() -> None:
        pool.allocate(4096)  # handle dropped on return

    with caplog.at_level(logging.WARNING, logger=pool_module.__name__):
        leaky_helper()
        stats = pool.stats()
    assert stats.leaked_frees == 1 and stats.allocated == 0 and stats.num_frees == 1
    assert "leaky_helper" in caplog.text


def test_pool_tensor_is_freed_when_garbage_collected() -> None:
    pool = make_pool()
    tensor = pool.tensor((8, 16), torch.float32)
    view = tensor[2:4].view(-1)
    assert tensor.shape == (8, 16) and tensor.dtype == torch.float32
    assert pool.stats().allocated == 512
    tensor.fill_(1.0)
    del tensor
    gc.collect()
    assert pool.stats().live_blocks == 1  # the view still holds the memory
    assert view.sum().item() == 32.0
    del view
    gc.collect()
    stats = pool.stats()
    assert stats.live_blocks == 0 and stats.leaked_frees == 0 and stats.num_frees == 1


def test_pool_tensor_zero_size_uses_no_pool_memory() -> None:
    pool = make_pool()
    assert pool.tensor((0, 4)).shape == (0, 4) and pool.stats().num_allocations == 0


# -- leaks, tracking, stats ------------------------------------------------------------------


def test_check_leaks_reports_age_and_stacks(clock: FakeClock) -> None:
    pool = make_pool(enable_memory_tracking=True)
    old = pool.allocate(1000)
    clock.now += 10
    young = pool.allocate(2000)
    leaks = pool.check_leaks()
    assert [leak.nbytes for leak in leaks] == [1000, 2000]
    assert leaks[0].age == pytest.approx(10.0)
    assert any("test_check_leaks_reports_age_and_stacks" in line for line in leaks[0].stack)
    assert [leak.nbytes for leak in pool.check_leaks(min_age=5)] == [1000]
    assert "allocated at" in str(leaks[0])
    old.free()
    young.free()
    assert pool.check_leaks() == []


def test_check_leaks_without_tracking_has_no_stack() -> None:
    pool = make_pool(enable_memory_tracking=False)
    pool_block = pool.allocate(100)
    (leak,) = pool.check_leaks()
    assert leak.stack is None and "VRAMKIT_MEMORY_DEBUG" in str(leak)
    pool_block.free()


def test_track_allocations_records_only_inside_the_block() -> None:
    pool = make_pool(enable_memory_tracking=False)
    pool.allocate(111)

    def inner_allocation() -> Block:
        return pool.allocate(222)

    with pool.track_allocations() as tracker:
        kept = [inner_allocation(), pool.allocate(333)]
    pool.allocate(444)
    records = tracker.allocations()
    assert [size for size, _ in records] == [222, 333]
    assert any("inner_allocation" in line for line in records[0][1])
    tracker.stop()  # idempotent
    assert len(kept) == 2


def test_reset_stats_resets_peaks_and_counters() -> None:
    pool = make_pool()
    blocks = [pool.allocate(4096) for _ in range(4)]
    for block in blocks[1:]:
        block.free()
    again = pool.allocate(4096)
    before = pool.stats()
    assert before.peak_allocated == 4 * 4096 and before.cache_hits == 1
    pool.reset_stats()
    after = pool.stats()
    assert after.peak_allocated == after.allocated == 2 * 4096
    assert after.peak_reserved == after.reserved
    assert ((after.num_allocations, after.num_frees, after.cache_hits, after.cache_misses)
            == (0, 0, 0, 0))
    assert again.nbytes == 4096


def test_total_allocated_counts_every_byte_ever_handed_out() -> None:
    pool = make_pool(alignment=512)
    assert pool.stats().total_allocated == 0
    first = pool.allocate(1000)  # 1024 bytes after alignment, as ``allocated`` counts it
    first.free()
    again = pool.allocate(1000)  # a cache hit: the same bytes, handed out a second time
    other = pool.allocate(4096)
    stats = pool.stats()
    assert stats.allocated == 1024 + 4096  # what is live now
    assert stats.total_allocated == 2 * 1024 + 4096  # freed or not
    assert stats.to_dict()["total_allocated"] == stats.total_allocated
    # Like MemoryStats.total_allocated, a difference of two readings is what a call allocated.
    before = pool.stats().total_allocated
    pool.allocate(512).free()
    pool.allocate(2048).free()
    assert pool.stats().total_allocated - before == 512 + 2048
    # A counter: reset_stats starts it again from zero; the live figures stay.
    pool.reset_stats()
    after = pool.stats()
    assert after.total_allocated == 0 and after.allocated == 1024 + 4096
    pool.allocate(512)
    assert pool.stats().total_allocated == 512
    again.free()
    other.free()


def _accelerator_oom() -> torch.AcceleratorError:
    error = torch.AcceleratorError("CUDA error: out of memory")
    error.error_code = 2  # type: ignore[attr-defined]  # as torch sets it (cudaErrorMemoryAllocation)
    return error


@pytest.mark.parametrize("make_error", [
    _accelerator_oom, lambda: torch.OutOfMemoryError("CUDA out of memory"),
], ids=["accelerator_error_code_2", "out_of_memory_error"])
def test_growth_that_runs_out_retries_at_the_request_size(
        monkeypatch: pytest.MonkeyPatch, make_error: object) -> None:
    pool = make_pool(growth_factor=2.0, max_cached_buffers=0)
    full = pool.allocate(MiB)  # one segment of 1 MiB, full
    sizes: list[int] = []
    real_new_storage = pool._backend.new_storage

    def new_storage(size: int) -> torch.Tensor:
        sizes.append(size)
        if size > 64 * KiB:
            raise make_error()  # type: ignore[operator]
        return real_new_storage(size)

    monkeypatch.setattr(pool._backend, "new_storage", new_storage)
    small = pool.allocate(4 * KiB)  # growth wants +1 MiB, which fails; +4 KiB does not
    assert sizes == [MiB, 4 * KiB]
    assert pool.stats().reserved == MiB + 4 * KiB and pool.stats().segments == 2
    small.free()
    full.free()


def test_growth_failure_told_only_by_its_text_is_not_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(growth_factor=2.0)
    full = pool.allocate(MiB)
    sizes: list[int] = []

    def new_storage(size: int) -> torch.Tensor:
        sizes.append(size)
        raise RuntimeError("CUDA error: out of memory")  # no type, no code: not an OOM

    monkeypatch.setattr(pool._backend, "new_storage", new_storage)
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.allocate(4 * KiB)
    assert sizes == [MiB]
    full.free()


def test_scope_needs_a_cuda_pool() -> None:
    with pytest.raises(DeviceError, match="CUDA"), make_pool().scope():
        pass


def test_concurrent_allocate_and_free_keep_stats_exact() -> None:
    pool = make_pool(max_cached_buffers=4)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            held = []
            for i in range(300):
                held.append(pool.allocate(512 * (1 + (seed + i) % 7)))
                if len(held) > 5:
                    held.pop(0).free()
            for block in held:
                block.free()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = pool.stats()
    assert not errors
    assert stats.allocated == 0 and stats.num_allocations == stats.num_frees == 1200
    assert stats.free == stats.reserved


# -- pinned pools, registration path (fake CUDA runtime) --------------------------------------


class FakeCudart:
    """Stands in for torch.cuda.cudart(): records register/unregister calls in a shared log."""

    def __init__(self, log: list[tuple[str, int]], fail_with: int = 0) -> None:
        self.log, self.fail_with = log, fail_with
        self.registered: dict[int, int] = {}
        self.register_calls: list[tuple[int, int, int]] = []
        self.unregister_calls: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.register_calls.append((ptr, size, flags))
        if self.fail_with:
            return self.fail_with
        assert ptr not in self.registered
        self.registered[ptr] = size
        self.log.append(("register", ptr))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregister_calls.append(ptr)
        self.log.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 713  # not registered


class FakeEvent:
    complete = True  # class-wide switch: False keeps freed pinned blocks pending

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] | None = None

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return FakeEvent.complete

    def synchronize(self) -> None:
        if self.log is not None:
            self.log.append(("synchronize", 0))


class FakeStream:
    def synchronize(self) -> None:
        pass


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch, cudart: object,
                      log: list[tuple[str, int]] | None = None) -> list[tuple[str, int]]:
    """Make CUDA look available with ``cudart`` as its runtime, fake streams and events; every
    mapping a pinned segment gets is watched: ("freed", base) is appended to ``log`` (returned)
    when it is unmapped."""
    log = [] if log is None else log
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "complete", True)
    real_mmap = _segments._anonymous_mmap
    watched: list[object] = []

    def watched_mmap(size: int) -> object:
        mapping = real_mmap(size)
        base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        watched.append(weakref.ref(mapping, lambda _: log.append(("freed", base))))
        return mapping

    monkeypatch.setattr(_segments, "_anonymous_mmap", watched_mmap)
    return log


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCudart, list[tuple[str, int]]]:
    """A pinned pool can be built without a GPU: CUDA 'available', a fake runtime and events."""
    log: list[tuple[str, int]] = []
    cudart = FakeCudart(log)
    return cudart, install_fake_cuda(monkeypatch, cudart, log)


def test_pinned_segments_are_registered_at_their_exact_size(fake_cuda: tuple) -> None:
    cudart, _ = fake_cuda
    size = 3 * MiB + KiB
    pool = MemoryPool.pinned(PoolConfig(initial_size=size, growth_factor=1.0))
    assert pool.stats().reserved == size  # no power-of-two rounding
    ((ptr, registered, flags),) = cudart.register_calls
    assert (registered, flags) == (size, 0) and ptr % 4096 == 0
    block = pool.allocate(size + 1)  # grows by one more exact (aligned) segment
    assert cudart.register_calls[1][1] == size + 512 == pool.stats().reserved - size
    assert block.data_ptr == cudart.register_calls[1][0]


def test_capped_pinned_pool_holds_a_block_as_large_as_the_cap(fake_cuda: tuple) -> None:
    pool = MemoryPool.pinned(PoolConfig(max_size="3MiB"))
    block = pool.allocate(3 * MiB)  # power-of-two segments could hold at most 2 MiB
    assert pool.stats().reserved == 3 * MiB and block.nbytes == 3 * MiB
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(KiB)
    assert "power" not in (info.value.hint or "")


def test_trim_unregisters_before_the_memory_is_freed(fake_cuda: tuple) -> None:
    cudart, log = fake_cuda
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    keep = pool.allocate(4096)
    pool.allocate(64 * KiB).free()
    (_, ptr_keep), (_, ptr_trim) = [e for e in log if e[0] == "register"]
    assert pool.trim() == 64 * KiB and pool.stats().segments == 1
    gc.collect()
    assert cudart.unregister_calls == [ptr_trim]
    assert log.index(("unregister", ptr_trim)) < log.index(("freed", ptr_trim))
    pool.trim()
    pool.clear(force=True)  # the remaining segment, once
    assert cudart.unregister_calls == [ptr_trim, ptr_keep] and not cudart.registered
    del pool, keep
    gc.collect()  # the finalizer finds nothing left to unregister
    assert cudart.unregister_calls == [ptr_trim, ptr_keep]


def test_pool_garbage_collection_unregisters_after_pending_copies(fake_cuda: tuple) -> None:
    cudart, log = fake_cuda
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    pool.allocate(4096).free()
    block = pool.allocate(8192)  # a second segment
    FakeEvent.complete = False
    block.free()  # a (fake) non-blocking copy may still read it: pending
    ((*_, events),) = pool._book.pending
    for event in events:
        event.log = log
    ptrs = [ptr for kind, ptr in log if kind == "register"]
    assert pool.stats().pending == 8192 and len(ptrs) == 2
    del pool, block
    gc.collect()
    assert sorted(cudart.unregister_calls) == sorted(ptrs) and not cudart.registered
    first_unregister = min(log.index(("unregister", p)) for p in ptrs)
    assert log.index(("synchronize", 0)) < first_unregister
    for ptr in ptrs:
        assert log.index(("unregister", ptr)) < log.index(("freed", ptr))


def test_pending_block_is_reused_once_its_events_complete(fake_cuda: tuple) -> None:
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    FakeEvent.complete = False
    block = pool.allocate(4096)
    address = block.data_ptr
    block.free()  # a (fake) non-blocking copy may still read it: pending
    other = pool.allocate(4096)
    assert other.data_ptr != address
    FakeEvent.complete = True
    reused = pool.allocate(4096)  # the miss reclaims the completed block: it becomes a hit
    assert reused.data_ptr == address
    stats = pool.stats()
    assert stats.pending == 0 and (stats.cache_hits, stats.cache_misses) == (1, 2)


def test_cache_hits_do_not_query_pending_events(fake_cuda: tuple,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    queried: list[object] = []

    def counting_query(self: FakeEvent) -> bool:
        queried.append(self)
        return FakeEvent.complete

    monkeypatch.setattr(FakeEvent, "query", counting_query)
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    big = pool.allocate(8192)
    pool.allocate(4096).free()
    assert pool.stats().cached == 4096  # its event completed: reclaimed into the cache
    FakeEvent.complete = False
    big.free()  # stays pending
    queried.clear()
    hit = pool.allocate(4096)
    assert queried == []  # the fast path never looks at pending blocks
    miss = pool.allocate(4096)
    assert queried  # a miss does, before carving or growing
    stats = pool.stats()
    assert stats.pending == 8192 and stats.cache_hits == 1
    assert hit.data_ptr != miss.data_ptr


def test_registration_failure_is_a_device_error(fake_cuda: tuple) -> None:
    cudart, log = fake_cuda
    cudart.fail_with = 2  # cudaErrorMemoryAllocation
    pool = MemoryPool.pinned(PoolConfig(pin_fallback=False))  # (the default falls back)
    with pytest.raises(DeviceError, match="cudaHostRegister") as info:
        pool.allocate(4096)
    assert "max_size" in info.value.hint
    gc.collect()
    assert pool.stats().reserved == 0 and not cudart.registered
    assert [kind for kind, _ in log] == ["freed"]  # the mapping was not kept


def test_pinned_pool_falls_back_to_power_of_two_segments(
        fake_cuda: tuple, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A torch whose cudart lacks cudaHostRegister: pinned memory from torch's host allocator,
    # which rounds to powers of two (stood in for by pageable memory on this CPU-only machine).
    monkeypatch.setattr(torch.cuda, "cudart", lambda: object())
    monkeypatch.setattr(_segments.PowerOfTwoPinnedSegments, "_raw",
                        lambda self, n: torch.empty(n, dtype=torch.uint8))
    emptied: list[bool] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(True), raising=False)
    with caplog.at_level(logging.WARNING, logger=_segments.__name__):
        pool = MemoryPool.pinned(PoolConfig(initial_size="3MiB"))
    assert "power of two" in caplog.text
    assert pool.stats().reserved == 4 * MiB
    capped = MemoryPool.pinned(PoolConfig(max_size="3MiB"))
    with pytest.raises(PoolExhaustedError) as info:
        capped.allocate(3 * MiB)
    assert "powers of two" in info.value.hint
    pool.trim()
    assert emptied == [True]


# -- pure parts: arena, ledger, segment sizing -----------------------------------------------


def test_arena_best_fit_split_and_coalesce() -> None:
    arena = Arena()
    arena.add_segment(0, 100)
    assert arena.take(30) == (0, 0) and arena.take(30) == (0, 30)
    arena.give(0, 0, 30)
    assert arena.take(40) == (0, 60)  # the 40-byte tail, not the 30-byte hole
    assert arena.take(10) == (0, 0)  # best fit: the 30-byte hole
    arena.give(0, 30, 30)
    arena.give(0, 0, 10)
    arena.give(0, 60, 40)
    # One free range spanning the whole segment: everything coalesced back.
    assert arena.empty_segments() == [0] and arena.largest_free == arena.total_free == 100
    with pytest.raises(ValueError):
        arena.give(0, 0, 10)  # already free
    with pytest.raises(ValueError):
        arena.give(0, 90, 20)  # outside


def test_arena_take_lowest_and_segment_removal() -> None:
    arena = Arena()
    arena.add_segment(0, 64)
    arena.add_segment(1, 64)
    assert arena.take(64) == (0, 0)
    assert arena.take(8) == (1, 0)
    with pytest.raises(ValueError):
        arena.remove_segment(1)
    arena.give(0, 0, 64)
    assert arena.take_lowest(16) == (0, 0) and arena.take_lowest(100) is None
    assert arena.empty_segments() == []
    with pytest.raises(KeyError):
        arena.add_segment(0, 8)


def test_ledger_pending_ranges_wait_for_their_events() -> None:
    class FakeEvent:
        done = False

        def query(self) -> bool:
            return self.done

    ledger = PoolLedger(max_cached=4, interval=10.0)
    ledger.add_segment(0, 1024)
    segment, offset = ledger.arena.take(512)
    event = FakeEvent()
    ledger.add_pending(segment, offset, 512, [event])
    ledger.reclaim_pending(now=0.0)
    assert ledger.pending_bytes == 512 and ledger.cached_bytes == 0
    event.done = True
    ledger.reclaim_pending(now=0.0)
    assert ledger.pending_bytes == 0 and ledger.cached_bytes == 512


def test_fit_segment_rounding_rules() -> None:
    # Pinned: powers of two, never above the room left under the cap.
    assert fit_segment("pinned", 4096, 3 << 20, None, 512) == 4 << 20
    assert fit_segment("pinned", 4096, 3 << 20, 3 << 20, 512) == 2 << 20
    assert fit_segment("pinned", 3 << 20, 3 << 20, 3 << 20, 512) is None
    # CUDA: 2 MiB multiples above 1 MiB, alignment below.
    assert fit_segment("cuda", 3 << 20, 3 << 20, None, 512) == 4 << 20
    assert fit_segment("cuda", 3 << 20, 3 << 20, 3 << 20, 512) == 3 << 20
    assert fit_segment("cuda", 1000, 1000, None, 512) == 1024
    assert fit_segment("cpu", 1024, 5000, 4096, 512) == 4096
    assert fit_segment("cpu", 8192, 8192, 4096, 512) is None
    assert _arena.pow2_ceil(1) == 1 and _arena.pow2_ceil(1025) == 2048
