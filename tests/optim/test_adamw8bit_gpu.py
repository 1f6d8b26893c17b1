"""GPU tests of AdamW8bit: the fused Triton step matches the torch path, agrees with the CPU
path, no host syncs, real GPU bytes, offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramkit.offload.optimizer import CPUOffloadOptimizer
from vramkit.optim import adamw8bit as adamw8bit_module
from vramkit.optim._blockwise import SIGNED, UNSIGNED_NONZERO, codebook
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


# -- the fused Triton step ---------------------------------------------------------------------

SHAPES = ((1000, 257), (4099,), (3, 5, 7))  # odd sizes: padded last blocks; 105 < one block


def run_quantized_steps(fused: bool, bits: int, block_size: int, dtype: torch.dtype,
                        steps: int, monkeypatch: pytest.MonkeyPatch,
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], AdamW8bit]:
    """``steps`` AdamW8bit steps on fresh random parameters (same seed whatever ``fused``)."""
    monkeypatch.setattr(adamw8bit_module, "_FUSED_KERNEL_ENABLED", fused)
    gen = torch.Generator().manual_seed(0)
    starts = [torch.randn(shape, generator=gen).to("cuda", dtype) for shape in SHAPES]
    params = [start.clone() for start in starts]
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1, state_bits=bits, block_size=block_size,
                    min_8bit_size=0)
    for _ in range(steps):
        for p in params:
            # heavy-tailed magnitudes: values spread over many levels of the books
            grad = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen) ** 4
            p.grad = grad.to("cuda", dtype)
        opt.step()
    return starts, params, opt


@pytest.mark.parametrize(("bits", "block_size", "dtype"),
                         [(8, 256, torch.float32), (8, 256, torch.bfloat16),
                          (4, 128, torch.float32), (4, 256, torch.bfloat16),
                          (8, 96, torch.float16), (4, 6, torch.float32)])
def test_fused_step_matches_torch_path(bits: int, block_size: int, dtype: torch.dtype,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from vramkit.optim import _triton_adamw

    steps = 10
    launches = _triton_adamw.LAUNCHES
    starts, ref_params, ref_opt = run_quantized_steps(False, bits, block_size, dtype, steps,
                                                      monkeypatch)
    assert _triton_adamw.LAUNCHES == launches  # the flag forces the torch path
    _, params, opt = run_quantized_steps(True, bits, block_size, dtype, steps, monkeypatch)
    assert _triton_adamw.LAUNCHES - launches == steps * len(SHAPES)  # one launch per tensor
    torch.cuda.synchronize()
    report = []
    for start, ref_p, p in zip(starts, ref_params, params, strict=True):
        ref_state, state = ref_opt.state[ref_p], opt.state[p]
        for key in ("exp_avg_codes", "exp_avg_sq_sqrt_codes"):
            differ = (ref_state[key] != state[key]).float().mean().item()
            report.append(f"{key} differ {differ:.1e}")
            assert differ <= 1e-3, report
        for key in ("exp_avg_absmax", "exp_avg_sq_sqrt_absmax"):
            # A code flipped by an fp rounding tie changes that element's next moment by a level
            # step, which moves its block's absmax only if it is the block's largest value.
            close = torch.isclose(state[key], ref_state[key], rtol=1e-5, atol=0)
            far = 1 - close.float().mean().item()
            report.append(f"{key} not close {far:.1e}")
            assert far <= 1e-2, report
            torch.testing.assert_close(state[key], ref_state[key], rtol=0.05, atol=1e-12)
        if dtype == torch.float32:
            close = torch.isclose(p, ref_p, rtol=1e-5, atol=1e-7)
        else:  # 16-bit parameters round identically or differ by whole ulps
            close = p == ref_p
        far = 1 - close.float().mean().item()
        report.append(f"param {p.numel()} not close {far:.1e}")
        assert far <= 1e-3, report
        moved = (ref_p.float() - start.float()).norm()
        assert moved > 0
        assert ((p.float() - ref_p.float()).norm() / moved).item() < 1e-3, report
    print(f"fused vs torch, {bits} bits, block {block_size}, {dtype}: " + "; ".join(report))


def test_fused_step_no_recompile_or_sync_when_lr_changes() -> None:
    pytest.importorskip("triton")
    from vramkit.optim import _triton_adamw

    p = torch.randn(3000, 17, device="cuda", dtype=torch.bfloat16)
    opt = AdamW8bit([p], lr=1e-3, state_bits=4, block_size=128)
    p.grad = torch.randn_like(p)
    opt.step()  # compiles once and moves the code books to the GPU
    caches = getattr(_triton_adamw._adamw_quantized_kernel, "device_caches", None)
    compiled = None if caches is None else sum(len(c[0]) for c in caches.values())
    launches = _triton_adamw.LAUNCHES
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(5):  # a schedule: new lr (and bias corrections) every step
            opt.param_groups[0]["lr"] = 1e-3 * (0.5 + step)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert _triton_adamw.LAUNCHES - launches == 5
    if compiled is not None:  # scalars are runtime arguments, never compile-time constants
        assert sum(len(c[0]) for c in caches.values()) == compiled


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", [SIGNED, UNSIGNED_NONZERO])
def test_kernel_rounding_matches_bucketize_including_ties(kind: str, bits: int) -> None:
    pytest.importorskip("triton")
    from vramkit.optim import _triton_adamw

    book = codebook(kind, bits, "cuda")
    mids = book.midpoints
    up, down = torch.tensor(2.0, device="cuda"), torch.tensor(-2.0, device="cuda")
    values = torch.cat([mids, torch.nextafter(mids, up), torch.nextafter(mids, down), book.levels,
                        torch.tensor([-1.0, 0.0, 1.0, 1e-9, -1e-9], device="cuda"),
                        torch.rand(100_000, device="cuda") * 2 - 1,
                        torch.randn(100_000, device="cuda").exp() * 1e-4])
    want = torch.bucketize(values, mids, out_int32=True)
    assert torch.equal(_triton_adamw.nearest_codes(values, book), want)
