"""Faults while swapping on a GPU: pinning refused by the driver, the host's pinning cap reached,
the disk tier's disk full, an out-of-memory error inside a swapped block's backward. Each ends in
the documented fallback, a clear error or a recovery, and ``detach()`` gives back exactly the
original weights. The CPU versions of the last two are in ``test_faults.py``."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.offload.swap.test_faults import (
    assert_exactly,
    disk_full_at_attach,
    model,
    oom_in_backward_then_recover,
    step,
    swap_config,
    weights,
)
from vramkit.devices import host as host_module
from vramkit.devices.host import HostMemory
from vramkit.errors import VramkitWarning
from vramkit.memory import _segments
from vramkit.offload.swap import BlockSwapper

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: what cudaHostRegister returns out of RAM


class _RefusingCudart:
    """The real ``torch.cuda.cudart()`` whose ``cudaHostRegister`` fails as the driver does when
    it cannot lock the pages (the runtime's last error latched too)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._last = 0
        self.refused = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.refused += 1
        self._last = _ERROR_MEMORY_ALLOCATION
        return _ERROR_MEMORY_ALLOCATION

    def cudaGetLastError(self) -> Any:
        error, self._last = self._last, 0
        return error or self._real.cudaGetLastError()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture(autouse=True)
def fresh_pin_state() -> Any:
    gc.collect()
    torch.cuda.empty_cache()
    _segments._reset_pin_fallback_warning()
    yield
    _segments._reset_pin_fallback_warning()
    gc.collect()


def _trains_like_resident_then_detaches_exactly(expect_pinned: bool) -> None:
    reference, net = model("cuda"), model("cpu")
    original = weights(net)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        swapper = BlockSwapper(net, config=swap_config(), device="cuda")
    said = [str(r.message) for r in records if issubclass(r.category, VramkitWarning)]
    if not expect_pinned:  # the documented fallback: pageable masters, said once
        assert len(said) == 1 and "pageable memory" in said[0], said
    assert swapper.swapped_names
    for seed in (1, 2):
        assert step(net, "cuda", seed) == step(reference, "cuda", seed)
    swapper.detach()
    assert_exactly(net, original)


def test_pinning_refused_by_the_driver_falls_back_to_pageable_masters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = _RefusingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: refusing)
    _trains_like_resident_then_detaches_exactly(expect_pinned=False)
    assert refusing.refused > 0


def test_the_host_pinning_cap_reached_falls_back_to_pageable_masters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = host_module.read_host_memory()

    def capped(**kwargs: Any) -> HostMemory:
        from dataclasses import replace

        return replace(real, pin_limit=_segments.pinned_bytes() + 4096,
                       pin_limit_source="cgroup memory.max")

    monkeypatch.setattr(host_module, "read_host_memory", capped)
    _trains_like_resident_then_detaches_exactly(expect_pinned=False)


def test_a_full_disk_under_the_disk_tier_is_a_clear_error_that_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk_full_at_attach("cuda", tmp_path, monkeypatch)


def test_an_oom_in_a_swapped_backward_leaves_a_swapper_that_steps_and_detaches_exactly() -> None:
    oom_in_backward_then_recover("cuda")


def test_a_real_oom_in_a_swapped_backward_then_freeing_lets_the_next_step_run() -> None:
    """A real allocator OOM in backward (the forward ran, then the process capped just above
    what it holds, every cached block released), then the cap lifted: the swapper steps and
    detaches exactly."""
    net = model("cpu")
    original = weights(net)
    swapper = BlockSwapper(net, config=swap_config(), device="cuda")
    step(net, "cuda")  # warm: slots and caches exist
    net.zero_grad(set_to_none=True)
    # 131072 rows: each gradient the backward allocates is tens of MiB, more than the free
    # room a cached segment keeps (8192 rows fitted there on an H200: no OOM was raised)
    x = torch.randn(131072, 64, device="cuda")
    loss = net(x).square().mean()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = get_fraction(0) if get_fraction is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (torch.cuda.memory_reserved() + (1 << 20)) / total))
    try:
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()  # gradients of 8 MiB each: past the cap
    finally:
        torch.cuda.set_per_process_memory_fraction(before)
    del loss
    net.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    reference = model("cuda")
    assert step(net, "cuda", seed=3) == step(reference, "cuda", seed=3)
    swapper.detach()
    assert_exactly(net, original)
