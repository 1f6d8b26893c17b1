"""AdamW8bit as the inner optimizer of CPUOffloadOptimizer, on the CPU (HostStreams path)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vramkit.offload.optimizer import CPUOffloadOptimizer
from vramkit.optim.adamw8bit import AdamW8bit

HYPER = {"lr": 1e-2, "weight_decay": 0.1, "min_8bit_size": 0, "block_size": 64}



def make_model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 4)).to(dtype)


def batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(dtype)


def reference_run(model: nn.Module, steps: int) -> nn.Module:
    """AdamW8bit on fp32 masters of ``model``'s params, fp32 gradients, results cast back."""
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = AdamW8bit(masters, **HYPER)
    for step in range(steps):
        model(batch(step, next(model.parameters()).dtype)).float().pow(2).mean().backward()
        for p, master in zip(model.parameters(), masters, strict=True):
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters, strict=True):
                p.copy_(master)
    return model


def offload_run(model: nn.Module, steps: int, **options: object) -> CPUOffloadOptimizer:
    opt = CPUOffloadOptimizer(model.parameters(), optimizer_class=AdamW8bit,
                              **options, **HYPER)  # type: ignore[arg-type]
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        model(batch(step, dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [True, False])
def test_offloaded_adamw8bit_matches_direct_adamw8bit(dtype: torch.dtype, overlap: bool) -> None:
    # fp32 params are stepped in place; bf16 ones go through fp32 masters, staging buffers and
    # the worker thread, as GPU parameters do.
    expected = reference_run(make_model(dtype), 6)
    model = make_model(dtype)
    opt = offload_run(model, 6, overlap=overlap)
    try:
        for got, want in zip(model.parameters(), expected.parameters(), strict=True):
            assert torch.equal(got, want)
        inner = opt.inner
        assert isinstance(inner, AdamW8bit)
        assert all("exp_avg_codes" in state for state in inner.state.values())
    finally:
        opt.close()


def test_offloaded_state_is_about_two_bytes_per_parameter() -> None:
    numel = sum(p.numel() for p in make_model(torch.bfloat16).parameters())
    opt = offload_run(make_model(torch.bfloat16), 1, overlap=True)
    plain = offload_run_plain(make_model(torch.bfloat16))
    try:
        per_param = opt.stats().state_bytes / numel
        # Tiny tensors pay for whole blocks; still about a quarter of fp32 Adam's 8 bytes.
        assert per_param < 2.6, per_param
        assert plain.stats().state_bytes / numel >= 8
    finally:
        opt.close()
        plain.close()


def offload_run_plain(model: nn.Module) -> CPUOffloadOptimizer:
    """torch AdamW (the default inner optimizer) offloaded, stepped once."""
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, overlap=True)
    model(batch(0, torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    return opt


def test_offloaded_state_dict_round_trip() -> None:
    model = make_model(torch.bfloat16)
    opt = offload_run(model, 3, overlap=False)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for step in range(3, 6):
        model(batch(step, torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    restored = make_model(torch.bfloat16, seed=5)
    restored.load_state_dict(saved_model)
    opt2 = CPUOffloadOptimizer(restored.parameters(), optimizer_class=AdamW8bit, overlap=False,
                               **HYPER)  # type: ignore[arg-type]
    opt2.load_state_dict(saved_opt)
    for step in range(3, 6):
        restored(batch(step, torch.bfloat16)).float().pow(2).mean().backward()
        opt2.step()
        opt2.zero_grad()
    try:
        for got, want in zip(restored.parameters(), model.parameters(), strict=True):
            assert torch.equal(got, want)
    finally:
        opt.close()
        opt2.close()
