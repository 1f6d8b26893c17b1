"""BlockSwapper on a CUDA GPU: bit-identical training, memory bounds, no host syncs."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from vramkit.offload.swap import BlockSwapper, SwapConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]

D = 256


class _Lora(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.05)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class _Block(nn.Module):
    def __init__(self, d: int, lora: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = _Lora(nn.Linear(d, d)) if lora else nn.Linear(d, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = 4

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = torch.softmax((q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / 8, -1)
        att = (a @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att) * scale
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self, d: int = D, n: int = 8, lora: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_Block(d, lora) for _ in range(n))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones((), device=x.device)
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, scale)
        return self.out(x)


def _frozen_base(model: _Net) -> _Net:
    for name, p in model.named_parameters():
        if name.startswith("blocks.") and not name.endswith((".a", ".b")):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("keep", [8, 4, 0])  # 0, half, all blocks swapped
def test_lora_training_bit_identical_to_resident(keep: int, checkpointing: bool) -> None:
    torch.manual_seed(0)
    ref = _frozen_base(_Net(lora=True)).cuda()
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=keep,
                                                    checkpointing=checkpointing))
    assert swapper.stats().swapped_blocks == 8 - keep
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(10):
        x = torch.randn(2, 64, D, device="cuda", generator=gen)
        loss_ref = ref(x).square().mean()
        loss_ref.backward()
        loss = model(x).square().mean()
        loss.backward()
        assert torch.equal(loss, loss_ref)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
            if p_ref.requires_grad:
                assert torch.equal(p.grad, p_ref.grad), name
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    swapper.detach()
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.cpu(), p_ref.cpu())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("keep", [4, 0])
def test_full_finetune_with_host_gradients_bit_identical(keep: int, checkpointing: bool) -> None:
    torch.manual_seed(0)
    ref = _Net(n=6).cuda()
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=keep, trainable="cpu",
                                                    checkpointing=checkpointing))
    host = {id(e.tensor): e.host_param for b in swapper.blocks for e in b.trainable_entries}
    assert host and swapper.stats().pinned_bytes >= 2 * swapper.stats().swapped_bytes
    lr = 2.0 ** -4  # a power of two: p - lr*g rounds the same on the CPU and the GPU
    gen = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(10):
        x = torch.randn(2, 32, D, device="cuda", generator=gen)
        loss_ref = ref(x).square().mean()
        loss_ref.backward()
        loss = model(x).square().mean()
        loss.backward()
        swapper.sync_gradients()
        assert torch.equal(loss, loss_ref)
        with torch.no_grad():
            for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
                hp = host.get(id(p))
                grad = hp.grad if hp is not None else p.grad
                assert torch.equal(grad.cpu(), p_ref.grad.cpu()), name
                if hp is not None:
                    hp.sub_(hp.grad * lr)
                    hp.grad = None
                else:
                    p.sub_(p.grad * lr)
                    p.grad = None
                p_ref.sub_(p_ref.grad * lr)
                p_ref.grad = None
    swapper.detach()
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.cpu(), p_ref.cpu())


def _warm(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    torch.cuda.synchronize()


def test_memory_overhead_is_r_slots_and_pinned_is_tight() -> None:
    torch.manual_seed(0)
    model = _frozen_base(_Net(d=512, n=8, lora=True))
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if not n.startswith("blocks."))
    # Garbage that earlier tests left in reference cycles must not be collected (nor its
    # memory returned) in the middle of the attach this measures.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=2))
    after = torch.cuda.memory_allocated()
    stats = swapper.stats()
    largest = max(b.nbytes for b in swapper.blocks)
    expected = other + stats.resident_block_bytes + 2 * largest
    assert stats.slot_bytes == 2 * largest
    assert largest <= block_bytes
    assert after - before <= expected * 1.02 + 64 * 1024
    assert stats.pinned_bytes <= 1.05 * stats.swapped_bytes
    swapper.detach()


def test_reserved_and_pinned_flat_over_1000_steps_without_host_sync() -> None:
    torch.manual_seed(0)
    model = _frozen_base(_Net(d=128, n=6, lora=True))
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=2, checkpointing=True))
    x = torch.randn(1, 16, 128, device="cuda")
    for _ in range(10):
        _warm(model, x)
    reserved = torch.cuda.memory_reserved()
    pinned = swapper.stats().pinned_bytes
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the swap loop raises
    try:
        for _ in range(1000):
            model(x).square().mean().backward()
            for p in model.parameters():
                p.grad = None
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    assert swapper.stats().pinned_bytes == pinned
    stats = swapper.stats()
    assert stats.on_demand <= 1  # only the very first acquisition was not prefetched
    swapper.detach()


def test_inference_wraps_around_and_matches_resident() -> None:
    torch.manual_seed(0)
    ref = _Net(n=6).cuda().eval().requires_grad_(False)
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=0, num_slots=3))
    x = torch.randn(1, 16, D, device="cuda")
    with torch.no_grad():
        expected = ref(x)
    out = swapper.forward_with_swapping(x)
    swapper.reset_stats()
    out2 = swapper.forward_with_swapping(x)
    assert torch.equal(out, expected) and torch.equal(out2, expected)
    stats = swapper.stats()
    assert stats.on_demand == 0 and stats.hits == 6  # the first blocks were prefetched
    swapper.detach()


def test_detach_restores_devices_identity_and_values() -> None:
    model = _Net(n=4)
    before = {n: (id(p), p.device, p.detach().clone()) for n, p in model.named_parameters()}
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=1))
    model(torch.randn(1, 8, D, device="cuda")).sum().backward()
    swapper.detach()
    for name, p in model.named_parameters():
        pid, device, value = before[name]
        assert id(p) == pid and p.device == device and torch.equal(p.detach(), value), name
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_state_dict_and_load_state_dict_go_through_the_pinned_masters() -> None:
    torch.manual_seed(0)
    ref = _frozen_base(_Net(n=4)).cuda()
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=0))
    x = torch.randn(1, 16, D, device="cuda")
    model(x).sum().backward()  # two blocks in the slots, two evicted
    state, want = model.state_dict(), ref.state_dict()
    assert list(state) == list(want)
    for key, value in want.items():
        assert torch.equal(state[key].cpu(), value.cpu()), key
    assert state["blocks.3.fc1.weight"].is_pinned()  # the master itself, not a GPU copy
    torch.manual_seed(1)
    other = _frozen_base(_Net(n=4)).cuda()
    model.load_state_dict(other.state_dict())  # CUDA tensors into the pinned masters
    with torch.no_grad():
        assert torch.equal(model(x), other(x))  # slots loaded before were reloaded
    swapper.detach()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p.cpu(), q.cpu())  # detach() kept the loaded values


def test_swap_copies_are_counted_in_performance_stats() -> None:
    from vramkit.kernels.stats import performance_stats

    torch.manual_seed(0)
    model = _frozen_base(_Net(d=256, n=6, lora=True))
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=2, trainable="resident"))
    x = torch.randn(2, 16, 256, device="cuda")
    _warm(model, x)
    stats = performance_stats()
    stats.reset()
    swapper.reset_stats()
    model(x).square().mean().backward()
    torch.cuda.synchronize()
    snap = stats.snapshot(torch.cuda.current_device())
    assert snap.bytes_h2d == swapper.stats().h2d_bytes > 0
    swapper.detach()
