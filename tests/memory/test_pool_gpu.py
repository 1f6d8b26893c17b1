"""GPU tests of vramkit.memory.pool: CUDA arenas, stream-ordered reuse, pinned pools, MemPool scope."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from vramkit.errors import ConfigError, DeviceError
from vramkit.memory import _segments
from vramkit.memory.pool import MemoryPool, PoolConfig

pytestmark = pytest.mark.gpu

MiB = 1024 * 1024
# torch.cuda._sleep spins for this many GPU cycles: ~0.5 s at the H200's ~2 GHz, long enough
# that the host checks below run while the kernel is still busy.
SLEEP_CYCLES = 1_000_000_000


def _wait(event_or_stream: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not event_or_stream.query():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "GPU work did not finish in time"
        time.sleep(1e-3)


def test_cuda_block_comes_back_at_the_same_address() -> None:
    pool = MemoryPool("cuda")
    block = pool.allocate(MiB)
    assert block.tensor.device.type == "cuda" and block.data_ptr % 512 == 0
    address = block.data_ptr
    block.free()
    again = pool.allocate(MiB)
    assert again.data_ptr == address and pool.stats().cache_hits == 1


def test_pending_block_is_not_reused_before_its_stream_finishes() -> None:
    pool = MemoryPool("cuda", PoolConfig(max_cached_buffers=8))
    block = pool.allocate(MiB)
    address = block.data_ptr
    block.tensor.fill_(1)
    # Load the reduction kernel now: CUDA loads kernels lazily on first use, and that load
    # waits for the device, which would let the spin below finish before the checks.
    block.tensor.sum()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        total = block.tensor.sum()  # reads the block after the sleep
    block.record_stream(side)
    block.free()
    other = pool.allocate(MiB)
    assert not side.query(), "the side-stream kernel finished too early for this test"
    assert other.data_ptr != address
    assert pool.stats().pending == MiB
    side.synchronize()
    reused = pool.allocate(MiB)
    assert reused.data_ptr == address and pool.stats().pending == 0
    assert total.item() == MiB
    other.free()
    reused.free()


def test_record_stream_checks_the_stream() -> None:
    block = MemoryPool("cuda").allocate(1024)
    with pytest.raises(ConfigError):
        block.record_stream("stream")
    block.record_stream(torch.cuda.current_stream())
    block.free()


def test_cuda_defragment_moves_bytes_on_device() -> None:
    pool = MemoryPool("cuda", PoolConfig(max_cached_buffers=0, initial_size="8MiB"))
    gap = pool.allocate(2 * MiB)
    mover = pool.allocate(3 * MiB, relocatable=True)
    pattern = torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8, device="cuda")
    mover.tensor.copy_(pattern)
    # Load every kernel used below now: CUDA loads kernels lazily on first use, and that load
    # waits for the device, which would let the spin finish before compaction starts.
    expected = pattern + 1
    pattern.clone().add_(1)  # the in-place kernel the side stream runs
    torch.equal(expected, pattern)  # (the same tensor twice may skip the kernels)
    torch.cuda._sleep(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        mover.tensor.add_(1)  # the compaction copy must wait for this, queued after the spin
    mover.record_stream(side)
    gap.free()
    assert not side.query(), "the side-stream kernel finished too early for this test"
    result = pool.defragment()
    assert result.moved_blocks == 1 and mover.offset == 0
    assert torch.equal(mover.tensor, expected)


def test_cuda_pool_tensor_returns_on_gc() -> None:
    pool = MemoryPool("cuda")
    tensor = pool.tensor((256, 256), torch.float32)
    assert tensor.device.type == "cuda"
    tensor.fill_(3.0)
    assert tensor.sum().item() == 3.0 * 256 * 256
    assert pool.stats().live_blocks == 1
    del tensor
    gc.collect()
    stats = pool.stats()
    assert stats.live_blocks == 0 and stats.leaked_frees == 0


def test_cuda_trim_returns_memory_to_the_driver() -> None:
    pool = MemoryPool("cuda", PoolConfig(max_cached_buffers=0))
    pool.allocate(64 * MiB).free()
    before = torch.cuda.memory_reserved()
    assert pool.trim() == 64 * MiB
    assert torch.cuda.memory_reserved() <= before - 64 * MiB
    assert pool.stats().reserved == 0


class RecordingCudart:
    """Wraps the real torch.cuda.cudart() and records cudaHostUnregister calls."""

    def __init__(self, real: object) -> None:
        self.real = real
        self.unregistered: list[int] = []

    def cudaHostUnregister(self, ptr: int) -> object:
        self.unregistered.append(ptr)
        return self.real.cudaHostUnregister(ptr)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def _recording_pinned_pool(config: PoolConfig) -> tuple[MemoryPool, RecordingCudart]:
    pool = MemoryPool.pinned(config)
    backend = pool._backend
    assert isinstance(backend, _segments.RegisteredPinnedSegments), (
        "this PyTorch has no cudaHostRegister in torch.cuda.cudart()")
    backend.cudart = recording = RecordingCudart(backend.cudart)
    return pool, recording


def test_pinned_pool_reserves_exact_bytes_and_is_page_locked() -> None:
    size = 3 * MiB + 1024  # a multiple of the 512-byte alignment: reserved exactly
    pool = MemoryPool.pinned(PoolConfig(initial_size=size))
    assert isinstance(pool._backend, _segments.RegisteredPinnedSegments)
    assert pool.stats().reserved == size and pool.segment_sizes() == {0: size}
    block = pool.allocate(MiB)
    assert block.tensor.is_pinned() and block.view((1024,), torch.float32).is_pinned()
    assert pool.tensor((1024,)).is_pinned()
    block.free()
    odd = MemoryPool.pinned(PoolConfig(initial_size=size + 1))
    assert odd.stats().reserved == size + 512  # rounded only to the alignment


def test_pinned_copy_is_asynchronous_and_overlaps_compute() -> None:
    pool = MemoryPool.pinned()
    count = 16 * MiB  # float32 elements: 64 MiB
    block = pool.allocate(count * 4)
    host = block.view((count,), torch.float32)
    host.fill_(1.0)
    device = torch.empty(count, device="cuda")
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(copy):
        torch.cuda._sleep(SLEEP_CYCLES)
        device.copy_(host, non_blocking=True)  # queued behind the sleep on its stream
        copied = torch.cuda.Event()
        copied.record(copy)
    # From pageable memory the copy would have waited for the sleep before returning.
    assert not copied.query(), "copy_ from pool memory blocked the host"
    with torch.cuda.stream(compute):
        torch.cuda._sleep(4 * SLEEP_CYCLES)
    block.record_stream(copy)
    _wait(copied)
    assert not compute.query(), "the copy did not run while the compute kernel was busy"
    block.free()
    torch.cuda.synchronize()
    assert device.sum().item() == float(count)


def test_pinned_trim_unregisters_the_released_segment() -> None:
    pool, cudart = _recording_pinned_pool(PoolConfig(growth_factor=1.0))
    keep = pool.allocate(MiB)
    spare = pool.allocate(2 * MiB)
    address, stale_view = spare.data_ptr, spare.tensor
    assert stale_view.is_pinned()
    spare.free()
    torch.cuda.current_stream().synchronize()  # the free's event completes: nothing pending
    assert pool.trim() == 2 * MiB
    assert cudart.unregistered == [address] and pool.stats().segments == 1
    # Unregistered, yet still mapped: a stale view reads plain host memory, never freed memory.
    assert not stale_view.is_pinned() and int(stale_view[0]) >= 0
    assert keep.tensor.is_pinned()
    keep.free()


def test_pinned_pool_garbage_collection_unregisters() -> None:
    pool, cudart = _recording_pinned_pool(PoolConfig())
    block = pool.allocate(MiB)
    view = block.tensor
    block.free()
    del block, pool
    gc.collect()
    assert len(cudart.unregistered) == 1 and not view.is_pinned()
    view.fill_(7)  # the memory outlives its registration


def test_pinned_pool_falls_back_to_power_of_two_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_segments, "host_register_api", lambda: None)
    pool = MemoryPool.pinned(PoolConfig(initial_size="3MiB"))
    assert isinstance(pool._backend, _segments.PowerOfTwoPinnedSegments)
    assert pool.stats().reserved == 4 * MiB  # a power of two, as PyTorch really pins it
    block = pool.allocate(MiB)
    assert block.tensor.is_pinned()
    block.free()


def test_pinned_free_waits_for_the_current_stream() -> None:
    pool = MemoryPool.pinned(PoolConfig(max_cached_buffers=8))
    block = pool.allocate(MiB)
    address = block.data_ptr
    device = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    device.copy_(block.tensor, non_blocking=True)  # queued behind the sleep
    block.free()
    busy = pool.allocate(MiB)
    assert busy.data_ptr != address  # still pending: the DMA has not read it yet
    torch.cuda.current_stream().synchronize()
    assert pool.allocate(MiB).data_ptr == address


def _mem_pool_segments(mem_pool: object) -> list[tuple[int, int]]:
    snapshot = getattr(mem_pool, "snapshot", None)
    if snapshot is not None:
        segments = snapshot()
    else:
        pool_id = tuple(mem_pool.id)  # type: ignore[attr-defined]
        segments = [s for s in torch.cuda.memory_snapshot()
                    if tuple(s.get("segment_pool_id", ())) == pool_id]
    return [(s["address"], s["total_size"]) for s in segments]


def test_scope_routes_allocations_into_a_mem_pool() -> None:
    pool = MemoryPool("cuda")
    if not hasattr(torch.cuda, "use_mem_pool") or not hasattr(torch.cuda, "MemPool"):
        with pytest.raises(DeviceError), pool.scope():
            pass
        return
    with pool.scope() as mem_pool:
        inside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    outside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    segments = _mem_pool_segments(mem_pool)

    def in_pool(t: torch.Tensor) -> bool:
        return any(start <= t.data_ptr() < start + size for start, size in segments)

    assert pool.mem_pool is mem_pool
    assert in_pool(inside) and not in_pool(outside)
