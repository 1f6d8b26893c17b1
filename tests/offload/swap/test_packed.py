"""Compressed masters (SwapConfig.compress): frozen blocks' masters are kept compressed on the
host and decoded into their slots after each copy, bit for bit; training is identical to the
uncompressed swapper. On the CPU the decode is the torch reference (the GPU runs the Triton
kernel: tests/offload/swap/test_packed_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests._toys import Stack, frozen_mlp_stack
from tests.offload.swap.test_source import _reference
from vramkit.errors import CompressionError, ConfigError, OffloadError
from vramkit.offload.swap import BlockSwapper, SwapConfig

BLOCKS = 4


def _net() -> Stack:
    # bf16 weights of 512x128: large enough that coding pays for its tables (8 KiB each)
    return frozen_mlp_stack(16, 128, 512, BLOCKS, 4).bfloat16()


def _train(net: Stack, steps: int = 2) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        x = torch.randn(3, 16, generator=gen).bfloat16()
        loss = net(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


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


def test_trainable_masters_are_never_compressed() -> None:
    net = _net()
    net.blocks.requires_grad_(True)
    swapper = BlockSwapper(net, config=_config("on", trainable="cpu"), device="cpu")
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
