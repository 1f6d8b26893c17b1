"""Pageable masters on a CUDA GPU: the staged copies give bit-identical training and inference,
the masters are not page-locked, and pinned memory stays within the staging pool."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from tests.offload.swap.test_swapper_gpu import _Net
from vramkit.offload.swap import BlockSwapper, SwapConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]


def _lora_net() -> _Net:
    torch.manual_seed(0)
    net = _Net(lora=True)
    for name, p in net.named_parameters():
        p.requires_grad_(name.endswith((".a", ".b")))
    return net


def _train(model: _Net, swapper: BlockSwapper, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(4, 64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    with torch.no_grad():
        losses.append(model(x).sum())  # inference after training: the wrap-around prefetch
    torch.cuda.synchronize()
    return losses


def test_pageable_equals_pinned_bit_for_bit() -> None:
    pinned_model, pageable_model = _lora_net(), _lora_net()
    pinned = BlockSwapper(pinned_model, config=SwapConfig(num_slots=2, host_memory="pinned"),
                          device="cuda")
    pageable = BlockSwapper(pageable_model, device="cuda", config=SwapConfig(
        num_slots=2, host_memory="pageable", staging_pool="4MiB"))
    assert pageable.host_memory.mode == "pageable"
    assert not any(b.master.is_pinned() for b in pageable._blocks)  # ordinary memory
    assert all(b.master.is_pinned() for b in pinned._blocks)
    a, b = _train(pinned_model, pinned), _train(pageable_model, pageable)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    stats = pageable.stats()
    assert stats.staged_copies == stats.loads > 0
    assert stats.pinned_bytes == stats.staging_pool_bytes <= 4 << 20
    assert stats.pinned_bytes < pinned.stats().pinned_bytes
    for s in (pinned, pageable):
        s.detach()
    assert not [t for t in threading.enumerate() if t.name == "vramkit-staged-copies"]
    for (name, x), y in zip(pinned_model.state_dict().items(),
                            pageable_model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_pageable_with_a_cpu_optimizer_equals_pinned() -> None:
    torch.manual_seed(0)
    ref = _Net(n=4)
    model = copy.deepcopy(ref)
    swappers = [BlockSwapper(m, device="cuda", config=SwapConfig(
        trainable="cpu", host_memory=mode)) for m, mode in ((ref, "pinned"), (model, "pageable"))]
    x = torch.randn(2, 32, 256, device="cuda")
    opts = [torch.optim.SGD(s.optimizer_parameters(), lr=0.1) for s in swappers]
    for _ in range(3):
        for m, s, opt in zip((ref, model), swappers, opts, strict=True):
            m(x).square().mean().backward()
            s.sync_gradients()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        assert torch.equal(ref(x), model(x))
    for s in swappers:
        s.detach()


def test_pageable_compressed_masters_stay_pageable_and_train_like_pinned() -> None:
    """With compress="on" the payloads are pageable too: the worker copies each one through
    the staging pool, then launches its decode; the slots get the same bytes."""
    pinned_model, pageable_model = _lora_net(), _lora_net()
    pinned = BlockSwapper(pinned_model, device="cuda", config=SwapConfig(
        num_slots=2, host_memory="pinned", compress="on"))
    pageable = BlockSwapper(pageable_model, device="cuda", config=SwapConfig(
        num_slots=2, host_memory="pageable", staging_pool="4MiB", compress="on"))
    a, b = _train(pinned_model, pinned), _train(pageable_model, pageable)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    stats = pageable.stats()
    assert stats.compressed_blocks > 0 and stats.staged_copies == stats.loads > 0
    assert stats.pinned_bytes == stats.staging_pool_bytes <= 4 << 20
    assert pinned.stats().pinned_bytes > stats.pinned_bytes
    assert not any(c.payload.is_pinned() for c in pageable._host.packed.packed.values())
    for s in (pinned, pageable):
        s.detach()
    for (name, x), y in zip(pinned_model.state_dict().items(),
                            pageable_model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_the_staged_copy_probe_times_a_real_copy() -> None:
    from vramkit.offload.swap.staged import measure_staged_bytes_per_s

    rate = measure_staged_bytes_per_s(torch.device("cuda"), nbytes=64 << 20, chunks=2)
    assert 1e8 < rate < 1e12  # bytes per second through the pool
    assert not [t for t in threading.enumerate() if t.name == "vramkit-staged-copies"]
