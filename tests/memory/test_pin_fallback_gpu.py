"""GPU tests of the pinned pool's fallback to pageable memory: a real cudaHostRegister failure,
the CUDA error it leaves behind, and copies through vramkit.memory.transfer from and into the
fallback memory."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vramkit.devices import host as host_module
from vramkit.devices.host import HostMemory
from vramkit.errors import VramkitWarning
from vramkit.memory import _segments
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import transfer_streams

pytestmark = pytest.mark.gpu

MiB = 1024 * 1024


class BrokenRegisterCudart:
    """The real runtime, but ``cudaHostRegister`` really fails: it is asked to register address 0
    (``cudaErrorInvalidValue``), which leaves the error latched as the thread's last CUDA error,
    as a refused registration does. No ``cudaGetLastError`` here: the pool must clear it without
    one, as with torch's own bindings."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.codes: list[int] = []
        self.cudaHostUnregister = real.cudaHostUnregister
        self.cudaGetErrorString = real.cudaGetErrorString
        self.cudaError = real.cudaError

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        result = self.real.cudaHostRegister(0, size, flags)
        self.codes.append(int(result))
        return result


@pytest.fixture(autouse=True)
def fresh_warning() -> Iterator[None]:
    torch.zeros(1, device="cuda")  # a context exists before anything is registered
    gc.collect()
    _segments._reset_pin_fallback_warning()
    yield
    _segments._reset_pin_fallback_warning()


def _round_trip(pool: MemoryPool, nbytes: int) -> None:
    """H2D from a pool block and D2H into another through the shared copy streams."""
    streams = transfer_streams("cuda")
    source, back = pool.allocate(nbytes), pool.allocate(nbytes)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    source.tensor.copy_(payload)
    device = torch.empty(nbytes, dtype=torch.uint8, device=streams.device)
    loaded = streams.event()
    streams.copy(device, source.tensor, streams.h2d, "test")
    streams.record(loaded, streams.h2d)
    streams.wait(streams.current(), loaded)
    doubled = device * 2  # on the compute stream, after the copy
    computed = streams.event()
    streams.record(computed, streams.current())
    streams.wait(streams.d2h, computed)
    streams.copy(back.tensor, doubled, streams.d2h, "test")
    landed = streams.event()
    streams.record(landed, streams.d2h)
    streams.synchronize(landed)
    assert torch.equal(back.tensor, payload * 2)
    source.free()
    back.free()


def test_failed_registration_clears_its_error_and_copies_stay_correct(
        monkeypatch: pytest.MonkeyPatch) -> None:
    broken = BrokenRegisterCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: broken)
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    with pytest.warns(VramkitWarning, match="cudaErrorInvalidValue") as caught:
        block = pool.allocate(64 * MiB)
        more = pool.allocate(8 * MiB)  # a second failing segment: no second warning
    assert len([w for w in caught if issubclass(w.category, VramkitWarning)]) == 1
    assert broken.codes and all(code != 0 for code in broken.codes)
    # The latched cudaErrorInvalidValue was cleared: PyTorch's next kernel launch check
    # (cudaGetLastError) would otherwise raise it here.
    assert torch.ones(16, device="cuda").sum().item() == 16
    assert not block.tensor.is_pinned() and not more.tensor.is_pinned()
    stats = pool.stats()
    assert stats.pageable_bytes == stats.reserved == 72 * MiB
    block.free()
    more.free()
    _round_trip(pool, 16 * MiB)
    pool.clear()  # the fallback segments are never unregistered: no error here
    assert torch.ones(4, device="cuda").sum().item() == 4


def test_pinning_cap_falls_back_and_copies_stay_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned_pool = MemoryPool.pinned(PoolConfig(initial_size=32 * MiB))
    pinned = pinned_pool.allocate(32 * MiB)
    assert pinned.tensor.is_pinned()  # registered memory is reported pinned
    limit = _segments.pinned_bytes()  # no room left under the cap
    monkeypatch.setattr(host_module, "read_host_memory",
                        lambda **_: HostMemory(total=None, available=None, pin_limit=limit,
                                               pin_limit_source="cgroup memory.max"))
    pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
    with pytest.warns(VramkitWarning, match="pinning cap"):
        block = pool.allocate(32 * MiB)
    assert not block.tensor.is_pinned()
    assert _segments.pinned_bytes() == limit
    block.free()
    _round_trip(pool, 8 * MiB)
    pinned.free()
    _round_trip(pinned_pool, 8 * MiB)  # the registered segment, under the same cap
    assert pinned_pool.stats().pageable_bytes == 0


def test_a_failed_registration_latches_an_error_the_drain_clears() -> None:
    # Why the pool drains: torch's binding leaves the error of a failed cudaHostRegister as the
    # thread's last error, and the next kernel launch check raises it from an unrelated op.
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(0, 4096, 0)) != 0
    _segments.drain_last_cuda_error(cudart)
    assert torch.ones(8, device="cuda").sum().item() == 8  # clean after the drain
    assert int(cudart.cudaHostRegister(0, 4096, 0)) != 0
    with pytest.raises(RuntimeError):  # not drained: an innocent op reports it
        torch.ones(8, device="cuda")
    assert torch.ones(8, device="cuda").sum().item() == 8  # that launch check consumed it
