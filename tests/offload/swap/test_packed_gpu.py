"""Compressed masters on a CUDA GPU: the Triton decode on the copy stream gives bit-identical
training (losses and gradients) to the uncompressed swapper, the slots hold the masters' bytes,
a corrupted payload is reported by stats(), and masters encoded on the GPU beside a background
fill from a checkpoint train bit-identically too."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests._toys import Stack, frozen_mlp_stack
from vramkit.errors import CompressionError
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap import packed as packed_module

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]


def _net() -> Stack:
    return frozen_mlp_stack(64, 1024, 4096, 6, 8).bfloat16().cuda()


def _train(net: Stack, steps: int = 4, between: Callable[[], None] | None = None
           ) -> tuple[list[float], list[torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        if step == 1 and between is not None:
            between()
        x = torch.randn(32, 64, generator=gen, device="cuda").bfloat16()
        loss = net(x).float().square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def test_compressed_swapping_trains_bit_identically() -> None:
    expected, expected_grads = _train(_net())
    results = {}
    for mode in ("off", "on"):
        net = _net()
        swapper = BlockSwapper(net, config=SwapConfig(compress=mode, num_slots=2),
                               device="cuda")
        results[mode] = (*_train(net), swapper.stats())
        swapper.detach()
    off, on = results["off"], results["on"]
    assert off[0] == expected and on[0] == expected
    for got, want in zip(on[1], expected_grads, strict=True):
        assert torch.equal(got, want)
    stats = on[2]
    assert stats.compressed_blocks == 6
    assert stats.compressed_bytes < 0.72 * stats.compressed_raw_bytes
    assert stats.h2d_bytes < 0.75 * off[2].h2d_bytes


def test_a_share_of_the_blocks_compressed_trains_bit_identically() -> None:
    # the planner's compressed_blocks: compressed and raw blocks through the same slots
    expected, expected_grads = _train(_net())
    net = _net()
    names = ("blocks.0", "blocks.2", "blocks.5")
    swapper = BlockSwapper(net, config=SwapConfig(compress="on", num_slots=2,
                                                  compressed_blocks=names), device="cuda")
    losses, grads = _train(net)
    assert swapper.stats().compressed_blocks == 3
    swapper.detach()
    assert losses == expected
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.equal(got, want)


def test_slots_hold_the_masters_bytes() -> None:
    plain = BlockSwapper(_net(), config=SwapConfig(), device="cuda")
    packed = BlockSwapper(_net(), config=SwapConfig(compress="on"), device="cuda")
    for raw, block in zip(plain._blocks, packed._blocks, strict=True):
        slot = torch.full((block.nbytes,), 0xEE, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()  # the fill (default stream) before the decode stream writes
        with torch.cuda.stream(packed.streams.h2d):
            packed._host.packed.load(block, slot)
        torch.cuda.synchronize()
        for e in block.entries:
            assert torch.equal(slot[e.offset:e.offset + e.nbytes].cpu(),
                               raw.master[e.offset:e.offset + e.nbytes])
    packed.stats()  # no decode failed
    plain.detach()
    packed.detach()


def test_a_corrupted_payload_is_reported() -> None:
    net = _net()
    swapper = BlockSwapper(net, config=SwapConfig(compress="on"), device="cuda")
    block = swapper._blocks[3]
    plane = swapper._host.packed.packed[id(block)].section("plane", torch.uint8)
    plane[plane.numel() // 2] ^= 0x20
    with pytest.raises(CompressionError, match="corrupted"):  # a later load's poll, or stats
        with torch.no_grad():
            net(torch.randn(4, 64, device="cuda").bfloat16())
        swapper.stats()


def test_training_on_a_corrupted_payload_stops_within_a_few_steps() -> None:
    """No stats() call: the loads' non-blocking poll of the decode flag stops the run."""
    net = _net()
    swapper = BlockSwapper(net, config=SwapConfig(compress="on", num_slots=2), device="cuda")
    block = swapper._blocks[2]
    plane = swapper._host.packed.packed[id(block)].section("plane", torch.uint8)
    plane[plane.numel() // 3] ^= 0x11
    with pytest.raises(CompressionError, match="corrupted"):
        _train(net, steps=6)


@pytest.mark.parametrize("host_memory", ["pinned", "pageable"])
def test_masters_encoded_beside_a_background_fill_train_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_memory: str) -> None:
    path = tmp_path / "net.safetensors"
    reference = _net()
    save_file({k: v.cpu() for k, v in reference.state_dict().items()}, str(path))
    expected, expected_grads = _train(reference)
    # block 3's encode waits until the first step is done: that step runs on three decoded and
    # three raw blocks, the later ones on six decoded blocks
    release, held = threading.Event(), threading.Event()
    devices: list[str] = []
    real = packed_module.encode

    def encode(*args: Any, device: Any = None, **kw: Any) -> Any:
        devices.append(str(device))
        if len(devices) == 4:
            held.set()
            assert release.wait(60)
        return real(*args, device=device, **kw)

    monkeypatch.setattr(packed_module, "encode", encode)
    results = {}
    try:
        for mode in ("off", "on"):
            with torch.device("meta"):
                net = frozen_mlp_stack(64, 1024, 4096, 6, 8).bfloat16()
            swapper = BlockSwapper(net, config=SwapConfig(compress=mode, num_slots=2,
                                                          host_memory=host_memory),
                                   device="cuda", checkpoint=path)
            assert swapper._host.filler.background
            between = None
            if mode == "on":
                assert held.wait(60)  # attach returned; blocks 0-2 encoded, 3 waits

                def between(swapper: BlockSwapper = swapper) -> None:
                    assert swapper.stats().compressed_blocks == 3
                    release.set()
                    swapper.wait_loaded()

            losses, grads = _train(net, between=between)
            swapper.wait_loaded()
            results[mode] = (losses, grads, swapper.stats())
            swapper.detach()
            for name, value in net.state_dict().items():  # the frozen blocks exactly
                if name.startswith("blocks."):
                    assert torch.equal(value.cuda(), reference.state_dict()[name]), name
    finally:
        release.set()
    for mode in ("off", "on"):
        losses, grads, _ = results[mode]
        assert losses == expected, mode
        for got, want in zip(grads, expected_grads, strict=True):
            assert torch.equal(got, want), mode
    stats = results["on"][2]
    assert not stats.loading and stats.compressed_blocks == 6
    assert stats.compressed_bytes < 0.72 * stats.compressed_raw_bytes
    assert stats.host_memory == host_memory
    if host_memory == "pinned":  # (pageable: only the staging pool is pinned, in both)
        assert stats.pinned_bytes < 0.8 * results["off"][2].pinned_bytes
    # encoded on the GPU, none falling back to the CPU
    assert len(devices) == 6 and all(d.startswith("cuda") for d in devices)
