"""GPU tests of CPUOffloadOptimizer: agreement with GPU AdamW, no states or grads on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramkit.errors import ConfigError
from vramkit.memory.pool import MemoryPool
from vramkit.memory.transfer import transfer_streams
from vramkit.offload.optimizer import CPUOffloadOptimizer

pytestmark = pytest.mark.gpu

HYPER = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def make_mlp(dtype: torch.dtype, width: int = 256, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 32)).to("cuda", dtype)


def batch(step: int, dtype: torch.dtype, features: int = 64) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    return torch.randn(48, features, device="cuda", generator=gen).to(dtype)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def settled_allocated() -> int:
    """memory_allocated once freed blocks waiting on other streams are really returned."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # an allocation makes the allocator process finished events
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_gpu_adamw_on_fp32_masters(dtype: torch.dtype, overlap: bool) -> None:
    model, ref = make_mlp(dtype), make_mlp(dtype)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, fused=True, **HYPER)
    opt = CPUOffloadOptimizer(model.parameters(), overlap=overlap, **HYPER)
    try:
        for step in range(5):
            x = batch(step, dtype)
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            loss_of(ref, x).backward()
            for master, p in zip(masters, ref.parameters(), strict=True):
                master.grad = p.grad.float()
                p.grad = None
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.no_grad():
                for master, p in zip(masters, ref.parameters(), strict=True):
                    p.copy_(master)
        torch.cuda.synchronize()
        # CPU and GPU AdamW kernels round differently in the last bits; in bf16 such a bit can
        # flip a weight's rounding, which perturbs later gradients a little (lr is 1e-3).
        master_tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-3,
                                                                                    "atol": 1e-4}
        for slot, master in zip(opt._slots, masters, strict=True):
            torch.testing.assert_close(slot.master, master.cpu(), **master_tol)
        tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2,
                                                                             "atol": 1e-3}
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.device.type == "cuda" and p.dtype == dtype
            torch.testing.assert_close(p.float(), q.float(), **tol)
        stats = opt.stats()
        assert stats.device_params == 6 and stats.grads_transferred == 5 * 6
    finally:
        opt.close()


def test_overlap_modes_and_gradient_placement_agree() -> None:
    results = []
    for offload_gradients, overlap in [(True, True), (True, False), (False, True), (False, False)]:
        model = make_mlp(torch.bfloat16)
        with CPUOffloadOptimizer(model.parameters(), offload_gradients=offload_gradients,
                                 overlap=overlap, **HYPER) as opt:
            for step in range(3):
                loss_of(model, batch(step, torch.bfloat16)).backward()
                kept = [p.grad is not None for p in model.parameters()]
                assert all(kept) if not offload_gradients else not any(kept)
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
        results.append(model)
    for other in results[1:]:
        for p, q in zip(results[0].parameters(), other.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_optimizer_state_or_gradients_on_the_gpu(dtype: torch.dtype) -> None:
    width = 1024
    model = make_mlp(dtype, width=width)
    param_bytes = sum(p.nbytes for p in model.parameters())
    smallest_matrix = width * width * dtype.itemsize
    # cuBLAS keeps a workspace per (thread handle, stream), counted as allocated: create the
    # forward's and the autograd thread's before measuring.
    warm = make_mlp(dtype, width=width)
    loss_of(warm, batch(0, dtype)).backward()
    del warm
    base = settled_allocated()
    opt = CPUOffloadOptimizer(model.parameters(), **HYPER)
    try:
        x = batch(0, dtype)
        loss_of(model, x).backward()
        del x
        assert all(p.grad is None for p in model.parameters())
        # Gradients went to the host as they were produced: none is left behind on the GPU.
        assert settled_allocated() - base < smallest_matrix // 4
        opt.step()
        opt.zero_grad()
        for step in range(1, 3):
            loss_of(model, batch(step, dtype)).backward()
            opt.step()
            opt.zero_grad()
        ours = settled_allocated() - base
        stats = opt.stats()
    finally:
        opt.close()
    numel = sum(p.numel() for p in model.parameters())
    assert stats.gpu_state_bytes_saved == 2 * 4 * numel + 6 * 4  # fp32 exp_avg/exp_avg_sq, step
    assert stats.gpu_grad_bytes_saved == param_bytes

    ref = make_mlp(dtype, width=width)
    base = settled_allocated()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    for step in range(3):
        loss_of(ref, batch(step, dtype)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    theirs = settled_allocated() - base
    assert theirs >= 2 * param_bytes  # GPU AdamW keeps exp_avg and exp_avg_sq on the GPU
    assert ours <= 0.01 * theirs, (ours, theirs)


def test_masters_are_pinned_and_streams_shared() -> None:
    model = make_mlp(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters()) as opt:
        assert opt._pool.kind == "pinned"
        slot = opt._slots[0]
        assert slot.master.is_pinned() and slot.staging is not None and slot.staging.is_pinned()
        assert slot.master.dtype == torch.float32 and slot.staging.dtype == torch.bfloat16
        assert slot.streams is transfer_streams(model[0].weight.device)


def test_pageable_pool_is_refused_for_gpu_params() -> None:
    model = make_mlp(torch.bfloat16)
    with pytest.raises(ConfigError, match="pinned"):
        CPUOffloadOptimizer(model.parameters(), pool=MemoryPool("cpu"))


def test_host_and_gpu_params_in_one_optimizer() -> None:
    gpu_layer = nn.Linear(64, 64).to("cuda", torch.bfloat16)
    host_layer = nn.Linear(64, 8)  # fp32 host params: stepped in place
    host_before = host_layer.weight.detach().clone()
    with CPUOffloadOptimizer(list(gpu_layer.parameters()) + list(host_layer.parameters()),
                             **HYPER) as opt:
        for step in range(2):
            h = gpu_layer(batch(step, torch.bfloat16)).float().cpu()
            host_layer(h).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        stats = opt.stats()
        assert (stats.device_params, stats.host_params) == (2, 2)
        assert not torch.equal(host_layer.weight, host_before)
