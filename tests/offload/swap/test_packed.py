"""Compressed masters (SwapConfig.compress): frozen blocks' masters are kept compressed on the
host and decoded into their slots after each copy, bit for bit; training is identical to the
uncompressed swapper. On the CPU the decode is the torch reference (the GPU runs the Triton
kernel: tests/offload/swap/test_packed_gpu.py). Beside a background fill (checkpoint=) each
block is encoded on one thread as soon as it is filled, and used raw until then."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests._toys import Stack, frozen_mlp_stack, mlp
from tests.offload.swap.test_source import CONFIG, _assert_same, _meta, _reference
from vramkit.errors import CompressionError, ConfigError, OffloadError
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap import packed as packed_module

BLOCKS = 4


def _net() -> Stack:
    # bf16 weights of 512x128: large enough that coding pays for its tables (8 KiB each)
    return frozen_mlp_stack(16, 128, 512, BLOCKS, 4).bfloat16()


def _meta_net() -> Stack:
    with torch.device("meta"):
        return _net()


def _train(net: Stack, steps: int = 2, between: Callable[[], None] | None = None
           ) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        if step and between is not None:
            between()
        x = torch.randn(3, 16, generator=gen).bfloat16()
        loss = net(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_state(net: torch.nn.Module, reference: torch.nn.Module) -> None:
    want = reference.state_dict()
    got = net.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _config(compress: str, **kw: object) -> SwapConfig:
    return SwapConfig(min_param_bytes=1024, compress=compress, **kw)  # type: ignore[arg-type]


def test_training_with_compressed_masters_is_identical() -> None:
    expected = _train(_net())
    plain = _net()
    plain_swapper = BlockSwapper(plain, config=_config("off"), device="cpu")
    assert _train(plain) == expected
    net = _net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu")
    assert _train(net) == expected
    stats, plain_stats = swapper.stats(), plain_swapper.stats()
    assert stats.compressed_blocks == BLOCKS and plain_stats.compressed_blocks == 0
    assert stats.compressed_raw_bytes == sum(b.nbytes for b in swapper._blocks)
    # the copies moved the compressed bytes, and the host holds only those
    assert stats.h2d_bytes < plain_stats.h2d_bytes
    assert stats.pinned_bytes < plain_stats.pinned_bytes
    assert stats.compress_scratch_bytes > 0
    assert all(b.master is None for b in swapper._blocks)
    swapper.detach()
    plain_swapper.detach()
    for (name, a), b in zip(net.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_only_the_named_blocks_are_compressed_and_training_is_identical() -> None:
    # a plan compresses the blocks whose saved copies repay their decode (compressed_blocks)
    expected = _train(_net())
    net = _net()
    names = ("blocks.1", "blocks.3")
    swapper = BlockSwapper(net, config=_config("on", compressed_blocks=names), device="cpu")
    assert _train(net) == expected
    assert swapper.stats().compressed_blocks == 2
    held = {b.name: swapper._host.packed.holds(b) for b in swapper._blocks}
    assert held == {f"blocks.{i}": f"blocks.{i}" in names for i in range(BLOCKS)}
    swapper.detach()


def test_compressed_blocks_are_checked_before_anything_moves() -> None:
    with pytest.raises(ConfigError, match="compress='off'"):
        SwapConfig(compressed_blocks=("blocks.0",))
    with pytest.raises(ConfigError, match="list of block names"):
        SwapConfig(compress="on", compressed_blocks="blocks.0")  # type: ignore[arg-type]
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ConfigError, match="not blocks of this swapper"):
        BlockSwapper(net, config=_config("on", compressed_blocks=("blocks.9",)), device="cpu")
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    assert not any("forward" in m.__dict__ for m in net.modules())  # no hook left behind


def test_disk_tier_blocks_outside_compressed_blocks_stay_raw(tmp_path: Path) -> None:
    nets = [frozen_mlp_stack(16, 128, 512, 6, 4).bfloat16() for _ in range(2)]
    expected = _train(nets[0])
    block = BlockSwapper.footprint(nets[1].blocks[0], _config("off")).swapped
    swapper = BlockSwapper(nets[1], config=_config(
        "on", host_budget=int(5.5 * block), disk_cache_dir=str(tmp_path),
        compressed_blocks=("blocks.0", "blocks.5")), device="cpu")
    assert _train(nets[1]) == expected
    assert swapper.stats().compressed_blocks == 2
    swapper.detach()


def test_a_decoded_slot_equals_the_raw_master_byte_for_byte() -> None:
    plain = BlockSwapper(_net(), config=_config("off"), device="cpu")
    packed = BlockSwapper(_net(), config=_config("on"), device="cpu")
    for raw, block in zip(plain._blocks, packed._blocks, strict=True):
        assert raw.master is not None
        slot = torch.full((block.nbytes,), 0xEE, dtype=torch.uint8)
        packed._host.packed.load(block, slot)  # the ring's load, into a stand-in slot
        for e in block.entries:  # every tensor's bytes (the gaps between them are unused)
            assert torch.equal(slot[e.offset:e.offset + e.nbytes],
                               raw.master[e.offset:e.offset + e.nbytes])
    plain.detach()
    packed.detach()


def test_state_dict_reads_the_compressed_masters_and_loading_is_refused() -> None:
    reference = _net()
    net = _net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu")
    state = net.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name].cpu(), value), name
    with pytest.raises(OffloadError, match="compressed"):
        net.load_state_dict(reference.state_dict())
    swapper.detach()


def test_auto_keeps_blocks_that_do_not_shrink_raw() -> None:
    net = _reference()  # float32: stored raw, nothing to gain
    swapper = BlockSwapper(net, config=_config("auto"), device="cpu")
    assert swapper.stats().compressed_blocks == 0
    assert all(b.master is not None for b in swapper._blocks)
    swapper.detach()
    net = _net()
    swapper = BlockSwapper(net, config=_config("auto"), device="cpu")
    assert swapper.stats().compressed_blocks == BLOCKS  # bf16 weights shrink
    swapper.detach()


@pytest.mark.parametrize("trainable", ["cpu", "swap"])
def test_trainable_masters_are_never_compressed(trainable: str) -> None:
    # full fine-tuning (trainable="swap"): masters the optimizer writes every step stay raw
    net = _net()
    net.blocks.requires_grad_(True)
    swapper = BlockSwapper(net, config=_config("on", trainable=trainable), device="cpu",
                           optimizer=(lambda ps: torch.optim.SGD(ps, lr=0.1))
                           if trainable == "swap" else None)
    assert swapper.stats().compressed_blocks == 0
    swapper.detach()


def test_a_corrupted_compressed_master_is_an_error() -> None:
    net = _net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu")
    block = swapper._blocks[1]
    payload = swapper._host.packed.packed[id(block)]
    plane = payload.section("plane", torch.uint8)
    plane[plane.numel() // 2] ^= 0x20
    with pytest.raises(CompressionError, match="corrupted"):
        net(torch.randn(3, 16).bfloat16())


def test_compress_is_checked() -> None:
    with pytest.raises(ConfigError, match="compress"):
        SwapConfig(compress="yes")
    assert SwapConfig().compress == "off"


def test_an_encode_out_of_device_memory_falls_back_to_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.offload.swap import packed as packed_module

    real = packed_module.encode
    calls: list[str] = []

    def encode(*args: object, device: object = None, **kw: object) -> object:
        calls.append(str(device))
        if len(calls) == 1:
            kw["alloc"](64)  # type: ignore[operator]  # a payload block taken, then given back
            raise torch.OutOfMemoryError("no room")
        return real(*args, device=device, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(packed_module, "encode", encode)
    net = _net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu")
    assert swapper.stats().compressed_blocks == BLOCKS
    assert calls[:2] == ["cpu", "cpu"] and len(calls) == BLOCKS + 1
    assert _train(net) == _train(_net())
    swapper.detach()


def test_disk_tier_blocks_are_stored_and_read_compressed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def six() -> Stack:
        return frozen_mlp_stack(16, 128, 512, 6, 4).bfloat16()

    expected = _train(six())
    block = BlockSwapper.footprint(six().blocks[0], _config("off")).swapped
    results = {}
    for mode in ("off", "on"):
        net = six()
        # 5.5 blocks of pinned memory: 4 blocks on disk, 3 staging buffers, 2 masters in RAM
        swapper = BlockSwapper(net, config=_config(mode, host_budget=int(5.5 * block),
                                                   disk_cache_dir=str(tmp_path / mode)),
                               device="cpu")
        assert _train(net) == expected
        state = {k: v.clone() for k, v in net.state_dict().items()}
        results[mode] = (swapper.stats(), state)
        swapper.detach()
    off, on = results["off"][0], results["on"][0]
    assert on.disk_blocks == off.disk_blocks == 4
    assert on.compressed_blocks == 6  # the ones in RAM and the ones on disk
    assert on.disk_read_bytes < 0.8 * off.disk_read_bytes
    for key, value in results["off"][1].items():
        assert torch.equal(results["on"][1][key], value), key


def test_compressed_masters_beside_pageable_host_memory() -> None:
    # on a CPU the payloads are read where they are, never through the staging pool (a GPU
    # copies them through it: tests/offload/swap/test_staged_gpu.py)
    expected = _train(_net())
    net = _net()
    swapper = BlockSwapper(net, config=_config("on", host_memory="pageable"), device="cpu")
    assert _train(net) == expected
    stats = swapper.stats()
    assert stats.host_memory == "pageable" and stats.compressed_blocks == BLOCKS
    assert stats.staged_copies == 0
    swapper.detach()


# -- encoding beside a background fill ------------------------------------------------------


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "net.safetensors"
    save_file(_net().state_dict(), str(path))
    return path


class _Encodes:
    """The swapper's calls of the codec's encode, patched: each must run off the attaching
    thread; call number ``hold`` (from 0) waits for ``release`` (``held`` says it started,
    ``returned`` that it has its result), call ``fail`` raises."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, hold: int | None = None,
                 fail: int | None = None) -> None:
        self.release, self.held, self.returned = (threading.Event() for _ in range(3))
        self.calls = 0
        real = packed_module.encode

        def encode(*args: Any, **kw: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                raise AssertionError("a master was encoded on the attaching thread")
            n, self.calls = self.calls, self.calls + 1
            if n == fail:
                raise RuntimeError("the encoder broke")
            if n == hold:
                self.held.set()
                assert self.release.wait(30)
            result = real(*args, **kw)
            if n == hold:
                self.returned.set()
            return result

        monkeypatch.setattr(packed_module, "encode", encode)


@pytest.fixture()
def encodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _Encodes]]:
    made: list[_Encodes] = []

    def make(**kw: Any) -> _Encodes:
        made.append(_Encodes(monkeypatch, **kw))
        return made[-1]

    yield make
    for e in made:
        e.release.set()  # a failed test never leaves the encode thread waiting
    assert not [t for t in threading.enumerate() if t.name == "vramkit-fill-encode"], \
        "an encode thread outlived its swapper"


@pytest.mark.parametrize("host_memory", ["pinned", "pageable"])
def test_a_background_fill_encodes_beside_it_and_trains_identically(
        checkpoint: Path, encodes: Callable[..., _Encodes], host_memory: str) -> None:
    resident = _net()
    expected = _train(resident)
    stats = {}
    for mode in ("off", "on"):
        if mode == "on":
            encodes()  # off the attaching thread
        net = _meta_net()
        swapper = BlockSwapper(net, config=_config(mode, host_memory=host_memory),
                               device="cpu", checkpoint=checkpoint)
        assert swapper._host.filler.background  # compressed or not
        assert _train(net) == expected
        swapper.wait_loaded()
        x = torch.randn(3, 16).bfloat16()
        with torch.no_grad():  # every block decoded now (the steps may have run on raw ones)
            assert torch.equal(net(x), resident(x))
        stats[mode] = swapper.stats()
        if mode == "on":
            assert all(b.master is None for b in swapper._blocks)  # the raw masters went back
        swapper.detach()
        _assert_state(net, resident)  # the trained end layers, the frozen blocks exactly
    on, off = stats["on"], stats["off"]
    assert not on.loading and on.compressed_blocks == BLOCKS and off.compressed_blocks == 0
    assert on.compressed_raw_bytes == off.swapped_bytes
    assert on.compress_scratch_bytes > 0
    if host_memory == "pinned":
        assert on.pinned_bytes < off.pinned_bytes


def test_attach_returns_before_the_blocks_are_encoded_and_uses_them_raw_until_then(
        checkpoint: Path, encodes: Callable[..., _Encodes]) -> None:
    expected = _train(_net())
    calls = encodes(hold=2)  # blocks 0 and 1 are encoded, block 2's encode waits
    net = _meta_net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu", checkpoint=checkpoint)
    assert calls.held.wait(30)
    swapper._host.filler.wait_all()  # (the fill does not wait for the encode)
    stats = swapper.stats()
    assert stats.loading and stats.compressed_blocks == 2
    blocks = swapper._blocks
    assert [b.master is None for b in blocks] == [True, True, False, False]
    # the raw masters of blocks 0 and 1 went back to the system as soon as they were encoded
    assert swapper._host.master_pool is not None
    raw = swapper._host.master_pool.stats().reserved
    assert sum(b.nbytes for b in blocks[2:]) <= raw < sum(b.nbytes for b in blocks[1:])

    def release() -> None:  # after a step on two compressed and two raw blocks
        assert swapper.stats().compressed_blocks == 2
        calls.release.set()
        swapper.wait_loaded()
        assert swapper.stats().compressed_blocks == BLOCKS

    assert _train(net, between=release) == expected  # the second step: every block decoded
    assert not swapper.stats().loading and calls.calls == BLOCKS
    swapper.detach()


def test_a_load_never_sees_a_block_half_switched(
        checkpoint: Path, encodes: Callable[..., _Encodes]) -> None:
    calls = encodes(hold=0)
    net = _meta_net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu", checkpoint=checkpoint)
    packed, block = swapper._host.packed, swapper._blocks[0]
    assert calls.held.wait(30)
    swapper._host.filler.wait_all()  # (the fill does not wait for the encode)
    with packed.guard(block):  # as a load holds it from its choice to its copy's enqueueing
        master = block.master
        calls.release.set()
        assert calls.returned.wait(30)  # encoded: the switch waits for the guard
        assert not packed.holds(block) and block.master is master
        pool = swapper._host.master_pool
        assert pool is not None  # every raw master still there: block 0's is not given back
        assert pool.stats().reserved >= sum(b.nbytes for b in swapper._blocks)
    packed.wait_encoded(block)
    assert packed.holds(block) and block.master is None and not block.master_views
    assert pool.stats().reserved < sum(b.nbytes for b in swapper._blocks)  # now it is
    swapper.wait_loaded()
    _assert_same_as_resident(net)
    swapper.detach()


def _assert_same_as_resident(net: Stack) -> None:
    x = torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        assert torch.equal(net(x), _net()(x))


def test_state_dict_during_the_background_encode_waits_for_it(
        checkpoint: Path, encodes: Callable[..., _Encodes]) -> None:
    calls = encodes(hold=1)
    net = _meta_net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu", checkpoint=checkpoint)
    assert calls.held.wait(30)
    timer = threading.Timer(0.05, calls.release.set)  # while state_dict waits for block 1
    timer.start()
    state = net.state_dict()
    timer.join()
    assert swapper.stats().compressed_blocks == BLOCKS  # it waited for each block's encode
    for name, value in _net().state_dict().items():
        assert torch.equal(state[name], value), name
    with pytest.raises(OffloadError, match="compressed"):
        net.load_state_dict(_net().state_dict())
    swapper.detach()


def test_an_encode_error_surfaces_and_detach_restores_the_exact_weights(
        checkpoint: Path, encodes: Callable[..., _Encodes]) -> None:
    encodes(fail=2)
    net = _meta_net()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu", checkpoint=checkpoint)
    with pytest.raises(OffloadError, match=r"encoding .*blocks\.2.*the encoder broke"):
        swapper.wait_loaded()
    assert swapper.stats().compressed_blocks == BLOCKS - 1  # the others were encoded
    with pytest.raises(OffloadError, match=r"blocks\.2.*the encoder broke") as info:
        net(torch.randn(3, 16).bfloat16())  # where the block is used
    assert "detach" in info.value.hint
    with pytest.raises(OffloadError, match=r"every weight restored.*blocks\.2"):
        swapper.detach()
    _assert_state(net, _net())  # block 2 from its raw master, the rest decoded


def test_auto_keeps_incompressible_blocks_raw_beside_a_background_fill(
        tmp_path: Path, encodes: Callable[..., _Encodes]) -> None:
    reference = _reference()  # float32: stored raw, nothing to gain
    path = tmp_path / "f32.safetensors"
    save_file(reference.state_dict(), str(path))
    calls = encodes()
    net = _meta()
    swapper = BlockSwapper(net, config=SwapConfig(min_param_bytes=CONFIG.min_param_bytes,
                                                  compress="auto"),
                           device="cpu", checkpoint=path)
    assert swapper._host.filler.background
    swapper.wait_loaded()
    assert calls.calls == len(swapper._blocks) > 0  # each was encoded, and kept raw
    assert swapper.stats().compressed_blocks == 0
    assert all(b.master is not None for b in swapper._blocks)
    _assert_same(net, reference)
    swapper.detach()


def test_disk_tier_blocks_beside_a_background_encode(tmp_path: Path) -> None:
    def six() -> Stack:
        return frozen_mlp_stack(16, 128, 512, 6, 4).bfloat16()

    path = tmp_path / "six.safetensors"
    save_file(six().state_dict(), str(path))
    expected = _train(six())
    block = BlockSwapper.footprint(six().blocks[0], _config("off")).swapped
    with torch.device("meta"):
        net = six()
    swapper = BlockSwapper(net, config=_config("on", host_budget=int(5.5 * block),
                                               disk_cache_dir=str(tmp_path / "cache")),
                           device="cpu", checkpoint=path)
    assert swapper._host.filler.background  # the two blocks in RAM
    assert _train(net) == expected
    swapper.wait_loaded()
    stats = swapper.stats()
    assert stats.disk_blocks == 4 and stats.compressed_blocks == 6
    swapper.detach()


def test_the_scratch_grows_when_a_larger_block_is_encoded_after_the_first_loads(
        tmp_path: Path, encodes: Callable[..., _Encodes]) -> None:
    def growing() -> Stack:  # each block larger than the one before
        hidden = iter((256, 512, 1024))
        return Stack(lambda: mlp(128, next(hidden)), 3, inp=(16, 128), out=(128, 4), seed=0,
                     frozen=True).bfloat16()

    path = tmp_path / "growing.safetensors"
    save_file(growing().state_dict(), str(path))
    expected = _train(growing(), steps=3)
    calls = encodes(hold=1)  # block 0 encoded, the larger ones later
    with torch.device("meta"):
        net = growing()
    swapper = BlockSwapper(net, config=_config("on"), device="cpu", checkpoint=path)
    assert calls.held.wait(30)
    packed = swapper._host.packed
    scratch: list[int] = []

    def between() -> None:
        scratch.append(swapper.stats().compress_scratch_bytes)
        calls.release.set()
        swapper.wait_loaded()

    assert _train(net, steps=3, between=between) == expected
    scratch.append(swapper.stats().compress_scratch_bytes)
    largest = max(c.compressed_nbytes for c in packed.packed.values())
    # sized at the first load by block 0's payload, grown to the largest at a later load
    assert 0 < scratch[0] < scratch[-1] == largest
    swapper.detach()


def test_a_slot_loaded_from_a_raw_master_stays_current_after_its_switch(
        tmp_path: Path, encodes: Callable[..., _Encodes]) -> None:
    path = tmp_path / "f32.safetensors"  # read with a conversion: the masters' versions move
    save_file({k: v.float() for k, v in _net().state_dict().items()}, str(path))
    calls = encodes(hold=2)
    net = _meta_net()
    swapper = BlockSwapper(net, config=_config("on", num_slots=BLOCKS), device="cpu",
                           checkpoint=path)
    assert calls.held.wait(30)
    raw = swapper._blocks[2:]
    assert all(b.master is not None and b.master._version > 0 for b in raw)
    x = torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        first = net(x)  # blocks 2 and 3 copied from their raw masters into their slots
    calls.release.set()
    swapper.wait_loaded()
    assert all(b.master is None for b in raw)
    loads = swapper.stats().loads
    with torch.no_grad():
        assert torch.equal(net(x), first)
    assert swapper.stats().loads == loads  # every block kept its slot: nothing copied again
    swapper.detach()


def test_a_masters_alignment_gaps_are_zeroed_before_it_is_encoded() -> None:
    """The codec keeps every byte of a master: gaps between its tensors left as the pool found
    them made the same weights encode differently in two processes (sharded uploads gather one
    payload from pieces of each process's own)."""
    from vramkit.offload.swap.packed import _regions

    class Odd(torch.nn.Module):  # 100-wide layers: their tensors end off the alignment
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(16, 100), torch.nn.Linear(100, 16))
                for _ in range(3))

    model = Odd().bfloat16().requires_grad_(False)
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0), device="cpu")
    block = swapper._blocks[0]
    master = block.master
    covered = torch.zeros(block.nbytes, dtype=torch.bool)
    for e in block.entries:
        covered[e.offset:e.offset + e.nbytes] = True
    assert not covered.all()  # the entries are aligned: there are gaps
    before = master[:block.nbytes].clone()
    master[:block.nbytes][~covered] = 0xEE
    regions = _regions(block, master)
    assert len(regions) == len(block.entries)
    assert not master[:block.nbytes][~covered].any()  # gaps zeroed
    assert torch.equal(master[:block.nbytes][covered], before[covered])  # values untouched
    swapper.detach()


def test_compressing_node_shared_masters_is_refused() -> None:
    """Masters in node-shared memory stay raw (written once per node): compress="on" beside
    master_memory= would be a knob without effect."""
    with pytest.raises(ConfigError, match="node-shared") as err:
        BlockSwapper(_net(), config=_config("on"), device="cpu", master_memory=object())
    assert "compress='off'" in (err.value.hint or "")
