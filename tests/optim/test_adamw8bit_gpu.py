"""GPU tests of AdamW8bit: agrees with the CPU path, no host syncs, real GPU bytes, offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramkit.offload.optimizer import CPUOffloadOptimizer
from vramkit.optim.adamw8bit import AdamW8bit
from vramkit.optim.config import Int8TrainingConfig, setup_int8_training

pytestmark = pytest.mark.gpu


def make_mlp(dtype: torch.dtype, device: str = "cuda", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 32)).to(device, dtype)


def batch(step: int, dtype: torch.dtype, device: str = "cuda") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(48, 64, generator=gen).to(device, dtype)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_step_agrees_with_cpu_step(bits: int) -> None:
    shape = (1000, 257)  # odd sizes: a padded last block
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=gen)
    p_cpu = start.clone().requires_grad_()
    p_gpu = start.cuda().requires_grad_()
    opt_cpu = AdamW8bit([p_cpu], lr=1e-2, state_bits=bits, min_8bit_size=0)
    opt_gpu = AdamW8bit([p_gpu], lr=1e-2, state_bits=bits, min_8bit_size=0)
    for _ in range(4):
        grad = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen)
        p_cpu.grad, p_gpu.grad = grad, grad.cuda()
        opt_cpu.step()
        opt_gpu.step()
    # Codes may differ where a value sits on a rounding boundary (fma vs not); rarely, slightly.
    moved = (p_cpu.detach() - start).norm()
    assert (p_gpu.detach().cpu() - p_cpu.detach()).norm() / moved < 1e-2
    state = opt_gpu.state[p_gpu]
    assert state["exp_avg_codes"].is_cuda and state["step"].device.type == "cpu"


def test_step_does_not_synchronize_the_host() -> None:
    model = make_mlp(torch.bfloat16)
    opt = AdamW8bit(model.parameters(), lr=1e-3)
    loss_of(model, batch(0, torch.bfloat16)).backward()
    opt.step()  # first step: builds states and moves the code books to the GPU once
    opt.zero_grad()
    loss_of(model, batch(1, torch.bfloat16)).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_gpu_state_bytes_per_parameter() -> None:
    params = [torch.zeros(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for _ in range(4)]
    numel = sum(p.numel() for p in params)
    opt = AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before  # temporaries are freed: states only
    assert grown == opt.state_bytes() or abs(grown - opt.state_bytes()) < 64 * 1024
    assert grown / numel <= 2.1


def test_tracks_fused_adamw_in_bf16() -> None:
    model, ref = make_mlp(torch.bfloat16), make_mlp(torch.bfloat16)
    opt = AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    target = batch(999, torch.bfloat16)[:, :32].float()
    losses = {}
    for name, m, o in (("8bit", model, opt), ("fused", ref, ref_opt)):
        for step in range(150):
            ((m(batch(step % 20, torch.bfloat16)).float() - target) ** 2).mean().backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            losses[name] = float(((m(batch(0, torch.bfloat16)).float() - target) ** 2).mean())
    assert losses["8bit"] / losses["fused"] < 1.1, losses


def test_inner_optimizer_of_cpu_offload_with_gpu_params() -> None:
    model = make_mlp(torch.bfloat16)
    ref = make_mlp(torch.bfloat16)
    masters = [p.detach().float().cpu().requires_grad_() for p in ref.parameters()]
    ref_opt = AdamW8bit(masters, lr=1e-3, min_8bit_size=0)
    opt = CPUOffloadOptimizer(model.parameters(), optimizer_class=AdamW8bit, lr=1e-3,
                              min_8bit_size=0)
    try:
        for step in range(4):
            x = batch(step, torch.bfloat16)
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            loss_of(ref, x).backward()
            for master, p in zip(masters, ref.parameters(), strict=True):
                master.grad = p.grad.float().cpu()
                p.grad = None
            ref_opt.step()
            with torch.no_grad():
                for master, p in zip(masters, ref.parameters(), strict=True):
                    p.copy_(master)
        torch.cuda.synchronize()
        for got, want in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(got, want)
        numel = sum(p.numel() for p in model.parameters())
        assert opt.stats().state_bytes / numel <= 2.1
    finally:
        opt.close()


def test_int8_training_on_gpu_with_fp32_accumulation() -> None:
    model = make_mlp(torch.bfloat16)
    training = setup_int8_training(model, Int8TrainingConfig(gradient_accumulation_steps=2),
                                   lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(4):
        training.backward(loss_of(model, batch(step, torch.bfloat16)))
        training.step()
    assert training.updates == 2
    assert training.accumulation_buffer_bytes() == 4 * sum(p.numel() for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    training.close()
