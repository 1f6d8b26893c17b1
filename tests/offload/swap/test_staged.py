"""Pageable masters copied through a pinned staging pool (``offload/swap/staged.py``).

On a CPU device the copier runs its real worker thread, chunking and error paths with the
synchronous stand-in streams; the GPU test compares it with pinned masters on CUDA."""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
import time

import pytest
import torch

from tests.offload.swap.test_swapper import (
    X,
    _frozen_blocks,
    _lora_only,
    _net,
    _swap,
    _train_and_compare,
)
from vramkit.devices.host import HostMemory
from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.transfer import HostStreams, StreamOp
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap import staged as staged_module
from vramkit.offload.swap.staged import StagedCopies, staging_layout


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vramkit-staged-copies"]


def _copier(chunk: int = 1024, chunks: int = 2, log: list[StreamOp] | None = None
            ) -> StagedCopies:
    return StagedCopies(torch.device("cpu"), HostStreams(log=log), chunk_bytes=chunk,
                        chunks=chunks)


def test_layout_is_bounded_and_has_two_chunks() -> None:
    assert staging_layout(2 << 30, 648 << 20, 3) == (64 << 20, 31)  # FLUX: 3 blocks in flight
    assert staging_layout(2 << 30, 10_000, 3) == (10_240, 3)  # a small model pins little
    chunk, count = staging_layout(4096, 1 << 20, 3)  # a tiny pool still gets two chunks
    assert count >= 2 and chunk * count <= 4096


def test_copy_in_through_chunks_is_exact() -> None:
    log: list[StreamOp] = []
    copier = _copier(log=log)
    src = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    dst = torch.zeros(5000, dtype=torch.uint8)
    streams = copier.streams
    free, loaded = streams.event(), streams.event()
    copier.copy_in(dst, src, loaded, waits=(free,), what="b0")
    copier.settle(loaded)
    assert torch.equal(dst, src)
    kinds = [(op.kind, op.event) for op in log if op.stream == "h2d"]
    # the wait first, then chunk copies, the loaded event recorded behind the last one
    assert kinds[0] == ("wait", free.id) and kinds[-1] == ("record", loaded.id)
    assert sum(k == "copy" for k, _ in kinds) == 5  # 5000 bytes in chunks of 1024
    assert copier.counters()["staged_copy_bytes"] == 5000
    copier.close()
    assert not _workers()


def test_worker_error_is_raised_on_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    copier = _copier()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(copier.streams, "copy", broken)
    event = copier.streams.event()
    copier.copy_in(torch.zeros(10, dtype=torch.uint8), torch.ones(10, dtype=torch.uint8), event,
                   what="b0")
    with pytest.raises(OffloadError, match="copy engine on fire"):
        copier.settle(event)
    with pytest.raises(OffloadError, match="copy engine on fire"):  # and every later use
        copier.copy_in(torch.zeros(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8),
                       event)
    copier.close()
    assert not _workers()


def test_a_worker_that_cannot_select_its_device_fails_each_job_with_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the worker's device setup ran outside its error handling: the thread died, and the main
    # thread could only say it "stopped without an error" (seen with torch.device("cuda"))
    def refuse(device: object) -> None:
        raise ValueError("no device with that index")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    chunks = [torch.empty(8, dtype=torch.uint8) for _ in range(2)]
    state = staged_module._State(HostStreams(), chunks, torch.device("cuda", 0))
    job = staged_module._Job(torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8),
                             (), None, "b0")
    state.jobs.put(job)
    state.jobs.put(None)
    staged_module._worker(state)
    assert job.enqueued.is_set()
    assert isinstance(job.error, ValueError) and "no device with that index" in str(job.error)


def test_close_with_pending_copies_does_not_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    copier = _copier()
    gate = threading.Event()
    original = copier.streams.copy

    def slow(*args: object, **kwargs: object) -> None:
        gate.wait(5)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(copier.streams, "copy", slow)
    events = [copier.streams.event() for _ in range(5)]
    for e in events:
        copier.copy_in(torch.zeros(10, dtype=torch.uint8), torch.ones(10, dtype=torch.uint8), e)
    gate.set()
    copier.close(timeout=20)
    assert not _workers()
    with pytest.raises(OffloadError, match="closed"):
        copier.copy_in(torch.zeros(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8),
                       events[0])


def test_a_barrier_from_another_thread_returns_after_the_copies_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a background encode gives a raw master back only once the worker no longer reads it
    copier = _copier()
    gate = threading.Event()
    original = copier.streams.copy
    copied: list[int] = []

    def slow(*args: object, **kwargs: object) -> None:
        assert gate.wait(20)
        original(*args, **kwargs)  # type: ignore[arg-type]
        copied.append(1)

    monkeypatch.setattr(copier.streams, "copy", slow)
    src = torch.ones(10, dtype=torch.uint8)
    copier.copy_in(torch.zeros(10, dtype=torch.uint8), src, copier.streams.event())
    seen: list[int] = []
    waiter = threading.Thread(target=lambda: (copier.barrier(), seen.append(len(copied))))
    waiter.start()
    waiter.join(0.1)  # (a barrier that did not wait would have returned by now)
    gate.set()
    waiter.join(20)
    assert seen == [1]  # the copy queued before the barrier was done when it returned
    copier.close()
    copier.barrier()  # a stopped worker reads nothing: at once
    assert not _workers()


def test_a_dropped_copier_stops_its_worker() -> None:
    copier = _copier()
    thread = _workers()[0]
    del copier
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("prepare", [_lora_only, _frozen_blocks])
def test_pageable_swapper_matches_pinned_bit_for_bit(prepare: object) -> None:
    model = prepare(_net(lora=True))  # type: ignore[operator]
    ref = copy.deepcopy(model)
    swapper = _swap(model, max_gpu_blocks=1, host_memory="pageable", staging_pool=4096)
    assert swapper.host_memory.mode == "pageable"
    _train_and_compare(model, swapper, ref)
    stats = swapper.stats()
    assert stats.host_memory == "pageable" and stats.staged_copies == stats.loads > 0
    assert stats.staged_copy_bytes == stats.h2d_bytes
    # nothing but the staging pool is "pinned": the masters are ordinary memory
    assert 0 < stats.pinned_bytes == stats.staging_pool_bytes <= 4096
    swapper.detach()
    assert not _workers()
    assert torch.equal(model(X), ref(X))


def test_pageable_with_cpu_optimizer_matches() -> None:
    model, ref = _net(), _net()
    swapper = _swap(model, max_gpu_blocks=1, host_memory="pageable", trainable="cpu")
    _train_and_compare(model, swapper, ref)  # host steps write masters the worker reads
    swapper.detach()


def test_state_dict_round_trip_waits_for_the_worker() -> None:
    model = _lora_only(_net(lora=True))
    swapper = _swap(model, max_gpu_blocks=1, host_memory="pageable")
    model(X).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["blocks.1.fc1.weight"].mul_(2)
    model.load_state_dict(state)
    out = model(X)
    swapper.detach()
    assert torch.equal(model.blocks[1].fc1.weight, state["blocks.1.fc1.weight"])
    assert torch.equal(out, model(X))


def _within(seconds: float, fn: object) -> None:
    """Run ``fn`` on a thread and fail (instead of hanging the suite) if it takes longer."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if errors:
        raise errors[0]


def test_exception_in_forward_then_detach_is_clean() -> None:
    model = _lora_only(_net(lora=True))
    swapper = _swap(model, max_gpu_blocks=1, host_memory="pageable")
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5))  # wrong width: fails inside the first block
    _within(30, swapper.detach)
    assert not _workers()


def test_a_worker_error_reaches_the_forward_and_detach_still_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lora_only(_net(lora=True))
    swapper = _swap(model, max_gpu_blocks=1, host_memory="pageable")
    model(X).sum().backward()  # the copier works
    staged = swapper._host.staged

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("host memory gone")

    monkeypatch.setattr(staged.streams, "copy", broken)

    def forward() -> None:
        with pytest.raises(OffloadError, match="host memory gone"):
            for _ in range(3):  # the next loads fail on the worker, the main thread hears it
                model(X).sum().backward()

    _within(30, forward)
    monkeypatch.undo()
    _within(30, swapper.detach)
    assert not _workers()


def test_auto_on_a_cpu_device_pins_and_says_why() -> None:
    swapper = _swap(_lora_only(_net(lora=True)), max_gpu_blocks=1)
    assert swapper.host_memory.mode == "pinned"
    assert "CPU" in swapper.host_memory.reason and swapper._host.staged is None
    swapper.detach()


def test_auto_resolves_with_the_masters_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    host = HostMemory(total=64 << 30, available=60 << 30, pin_limit=10_000,
                      pin_limit_source="cgroup memory.max")
    calls = []
    real = staged_module.choose_host_memory

    def choose(requested: str, **kw: object) -> object:
        calls.append(kw["pinned_bytes"])
        return real(requested, host=host, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(staged_module, "choose_host_memory", choose)
    choice = staged_module.resolve_host_memory(SwapConfig(), torch.device("cuda", 0),
                                               [_Sized(9_000)], shared=False, loader=False)
    assert calls == [9_000] and choice.mode == "pageable" and "cgroup" in choice.reason


class _Sized:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"host_memory": "pagable"}, "host_memory"),
    ({"host_memory": "pageable", "trainable": "swap"}, "trainable='swap'"),
    ({"host_memory": "pinned", "staging_pool": "1GiB"}, "staging_pool"),
    ({"staging_pool": 100}, "staging_pool"),
])
def test_config_refuses(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SwapConfig(**kwargs)  # type: ignore[arg-type]


def test_pageable_refuses_shared_masters() -> None:
    with pytest.raises(ConfigError, match="master_memory"):
        staged_module.resolve_host_memory(SwapConfig(host_memory="pageable"),
                                          torch.device("cpu"), [_Sized(10)], shared=True)


def test_copy_out_lands_in_pageable_memory_and_frees_the_source() -> None:
    copier = _copier()
    src = torch.randint(0, 256, (3000,), dtype=torch.uint8)
    dst = torch.zeros(3000, dtype=torch.uint8)
    key = object()
    copier.copy_out(dst, src, key, what="grads")
    copier.settle(key)
    assert torch.equal(dst, src)
    assert copier._pending == {}  # settled
    assert copier.counters()["staged_out_bytes"] == 3000
    copier.close()


def test_cpu_optimizer_gradients_come_back_through_staging_unpinned() -> None:
    model = _net()
    swapper = _swap(model, max_gpu_blocks=1, host_memory="pageable", trainable="cpu",
                    staging_pool=8192)
    model(X).square().mean().backward()
    swapper.sync_gradients()
    stats = swapper.stats()
    # the gradient buffers are pageable too: nothing pinned but the pool
    assert stats.pinned_bytes == stats.staging_pool_bytes <= 8192
    assert swapper._host.staged.counters()["staged_out_copies"] > 0
    swapper.detach()


@pytest.mark.parametrize("slots", [1, 2])
def test_pageable_masters_beside_a_disk_tier_train_identically(tmp_path, slots) -> None:  # type: ignore[no-untyped-def]
    from tests.offload.swap.test_disk import BLOCK, _config, _reference
    from tests.offload.swap.test_disk import _train as train_disk

    expected = train_disk(_reference())
    net = _reference()
    # one slot: disk blocks (copied at once) and staged blocks (copied by the worker, later)
    # take turns in the same slot, and the copies must land in the order they were asked for
    config = dataclasses.replace(_config(4 * BLOCK, tmp_path / "cache"), num_slots=slots,
                                 host_memory="pageable", staging_pool=4 * BLOCK)
    swapper = BlockSwapper(net, config=config, device="cpu")
    staged = swapper._host.staged
    staged._state.streams = _SlowCopies(staged._state.streams)  # the worker lags behind
    stats = swapper.stats()
    assert stats.disk_blocks >= 2 and stats.host_memory == "pageable"
    assert train_disk(net) == expected  # disk blocks through their staging, the rest staged
    stats = swapper.stats()
    assert stats.disk_reads > 0 and stats.staged_copies > 0
    swapper.detach()


class _SlowCopies:
    """The copier's streams, each copy 20 ms late (a worker behind the main thread)."""

    def __init__(self, streams: HostStreams) -> None:
        self._streams = streams

    def copy(self, *args: object, **kwargs: object) -> None:
        time.sleep(0.02)
        self._streams.copy(*args, **kwargs)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self._streams, name)


def test_the_staged_copy_probe_on_a_cpu_is_the_memcpy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vramkit.offload.swap import staged

    monkeypatch.setattr(staged, "measure_memcpy_bytes_per_s", lambda: 7e9)
    assert staged.measure_staged_bytes_per_s(torch.device("cpu")) == 7e9
