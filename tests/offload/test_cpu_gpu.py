"""CPUOffloadManager on a CUDA GPU: memory really moves, copies come from pinned memory, loads
and clears are ordered by events without host synchronization, training matches a resident model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.offload._helpers import train_offloaded
from vramkit.memory.transfer import transfer_streams
from vramkit.offload.cpu import CPUOffloadConfig, CPUOffloadManager

pytestmark = pytest.mark.gpu

MiB = 1024 * 1024
# torch.cuda._sleep spins for this many GPU cycles: ~0.5 s at the H200's ~2 GHz, long enough
# that the host checks below run while the kernel is still busy.
SLEEP_CYCLES = 1_000_000_000


def _stack(count: int = 4, width: int = 1024, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(count)]).cuda()


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _warm_up(mgr: CPUOffloadManager, names: list[str], model: nn.Module,
             x: torch.Tensor) -> None:
    """Load every kernel and fill the allocator's copy-stream cache before timing-free checks:
    CUDA loads kernels lazily and that load, like a fresh cudaMalloc, can wait for the device."""
    torch.cuda._sleep(1)
    for _ in range(2):
        mgr.load_to_gpu(names)
        model(x)
        mgr.release()
        mgr.clear_inactive()
    torch.cuda.synchronize()


def test_offload_frees_device_memory_and_load_takes_it_back() -> None:
    model = _stack()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model, keep_on_gpu=["3"])
    torch.cuda.synchronize()
    offloaded = mgr.stats().offloaded_bytes
    assert offloaded == 3 * (1024 * 1024 + 1024) * 4
    dropped = before - torch.cuda.memory_allocated()
    assert offloaded - 4096 <= dropped <= offloaded  # less one placeholder (512 bytes)
    mgr.load_to_gpu(names)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - (before - dropped) == offloaded
    assert mgr.stats().resident_bytes == offloaded + (1024 * 1024 + 1024) * 4
    mgr.release()
    assert mgr.clear_inactive() == offloaded
    torch.cuda.synchronize()
    assert before - torch.cuda.memory_allocated() == dropped
    mgr.restore()


def test_host_masters_are_pinned_and_tight() -> None:
    model = _stack(3)
    reference = _snapshot(model)
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model)
    for name in names:
        master = mgr.host_tensor(name)
        assert master.device.type == "cpu" and master.is_pinned()
        assert torch.equal(master, reference[name].cpu())
    s = mgr.stats()
    assert s.pinned_bytes == s.host_bytes
    assert s.offloaded_bytes <= s.host_bytes <= 1.05 * s.offloaded_bytes
    assert s.d2h_bytes == s.offloaded_bytes
    mgr.restore()
    for name, tensor in model.state_dict().items():
        assert tensor.is_cuda and torch.equal(tensor, reference[name])


def test_load_without_wait_returns_before_the_copy_completes() -> None:
    model = _stack(2)
    reference = _snapshot(model)
    x = torch.randn(8, 1024, device="cuda")
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model)
    _warm_up(mgr, names, model, x)
    streams = transfer_streams("cuda")
    with torch.cuda.stream(streams.h2d):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copies queue behind this on the copy stream
    handle = mgr.load_to_gpu(names, wait=False)
    assert handle.event is not None
    assert not handle.done(), "load_to_gpu(wait=False) waited for its copies"
    handle.synchronize()
    assert handle.done()
    handle.wait()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name])


def test_load_with_wait_orders_the_current_stream_without_blocking_the_host() -> None:
    model = _stack(1)
    weight = model[0].weight.detach().clone()
    doubled_reference = weight * 2
    x = torch.randn(8, 1024, device="cuda")
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model)
    _warm_up(mgr, names, model, x)
    with torch.cuda.stream(transfer_streams("cuda").h2d):
        torch.cuda._sleep(SLEEP_CYCLES)
    handle = mgr.load_to_gpu("0.weight")  # wait=True: the current stream waits on the GPU
    doubled = model[0].weight * 2  # queued behind the copy, not run on unfilled memory
    assert not handle.event.query(), "load_to_gpu(wait=True) blocked the host"
    torch.cuda.synchronize()
    assert torch.equal(doubled, doubled_reference)


def test_forward_after_a_deferred_load_waits_in_the_pre_hook() -> None:
    model = _stack(2)
    x = torch.randn(8, 1024, device="cuda")
    expected = model(x).detach()
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model)
    _warm_up(mgr, names, model, x)
    with torch.cuda.stream(transfer_streams("cuda").h2d):
        torch.cuda._sleep(SLEEP_CYCLES)
    handle = mgr.load_to_gpu(names, wait=False)
    out = model(x)
    assert not handle.done()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", ["adamw_fused", "adamw_foreach", "sgd_single"])
def test_training_with_offloaded_weights_matches_resident(kind: str) -> None:
    def make(m: nn.Module) -> torch.optim.Optimizer:
        if kind == "adamw_fused":
            return torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        if kind == "adamw_foreach":
            return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, foreach=False)

    torch.manual_seed(3)
    xs = [torch.randn(16, 256, device="cuda") for _ in range(5)]
    reference = _stack(3, 256)
    ref_losses = train_offloaded(reference, make(reference), xs, None, [])
    model = _stack(3, 256)
    opt = make(model)  # built before offloading
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model, keep_on_gpu=["2.bias"])
    losses = train_offloaded(model, opt, xs, mgr, names)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert mgr.stats().writebacks == len(names) * len(xs)
    mgr.restore()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        assert a.is_cuda and torch.equal(a, b), name


def test_clear_with_writeback_does_not_block_the_host() -> None:
    model = _stack(1)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, foreach=False)
    x = torch.randn(8, 1024, device="cuda")
    mgr = CPUOffloadManager("cuda")
    names = mgr.offload_weights(model)
    train_offloaded(reference, ref_opt, [x, x], None, [])
    train_offloaded(model, opt, [x], mgr, names)  # also loads the kernels
    torch.cuda.synchronize()
    mgr.load_to_gpu(names)
    torch.cuda._sleep(SLEEP_CYCLES)  # the step below is queued behind this
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    mgr.release()
    mgr.clear_inactive()  # write-back queued behind the step on the copy stream
    assert not torch.cuda.current_stream().query(), "clear_inactive() blocked the host"
    mgr.load_to_gpu(names)  # must read the master only after the write-back lands
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_frozen_weights_travel_host_to_device_only() -> None:
    model = _stack(2).requires_grad_(False)
    x = torch.randn(8, 1024, device="cuda")
    mgr = CPUOffloadManager("cuda", config=CPUOffloadConfig(auto_load=True))
    mgr.offload_weights(model)
    d2h = mgr.stats().d2h_bytes
    for _ in range(3):
        model(x)  # loads on demand
        mgr.clear_inactive()
    s = mgr.stats()
    assert s.writebacks == 0 and s.d2h_bytes == d2h
    assert s.h2d_bytes == 3 * s.offloaded_bytes and s.loads == 3 * s.offloaded_tensors


def test_memory_is_flat_over_many_load_clear_cycles() -> None:
    model = _stack(4, 512)
    x = torch.randn(8, 512, device="cuda")
    mgr = CPUOffloadManager("cuda", config=CPUOffloadConfig(auto_load=True))
    mgr.offload_weights(model)
    offloaded = mgr.stats().offloaded_bytes
    for _ in range(5):
        model(x)
        mgr.clear_inactive()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    pinned = mgr.stats().pinned_bytes
    for _ in range(300):
        model(x)
        mgr.clear_inactive()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    # The host may run a few cycles ahead of the GPU, and memory freed for a stream still in
    # use is not handed out again, so a few extra copies may be cached; 300 cycles' worth is not.
    assert torch.cuda.memory_reserved() - reserved <= 4 * offloaded + 20 * MiB
    assert mgr.stats().pinned_bytes == pinned


def test_host_module_comes_back_to_the_host_on_restore() -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)  # on the CPU
    reference = _snapshot(model)
    mgr = CPUOffloadManager("cuda")
    assert mgr.offload_weights(model, keep_on_gpu=["bias"]) == ["weight"]
    assert model.bias.is_cuda and model.weight.is_cuda  # kept moved; offloaded a placeholder
    assert mgr.stats().d2h_bytes == 0  # copied host to host, not from the device
    mgr.load_to_gpu("weight")
    out = model(torch.randn(4, 64, device="cuda"))
    assert out.is_cuda
    mgr.restore()
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, reference[name])


def test_state_dict_and_load_state_dict_through_the_pinned_masters() -> None:
    model, other = _stack(), _stack(seed=1)
    mgr = CPUOffloadManager("cuda")
    mgr.offload_weights(model)
    mgr.load_to_gpu(["0", "1"])
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # loaded and changed: written back on clear
    want = _snapshot(model)
    mgr.release()
    mgr.clear_inactive()  # the write-back is a device->host copy the host has not waited for
    state = model.state_dict()
    assert state["0.weight"].is_pinned()  # the master, read after its copy landed
    for key, value in want.items():
        assert torch.equal(state[key].cpu(), value.cpu()), key
    model.load_state_dict(other.state_dict())  # CUDA tensors into the pinned masters
    mgr.load_to_gpu(["0", "1", "2", "3"])
    x = torch.randn(2, 1024, device="cuda")
    with torch.no_grad():
        assert torch.equal(model(x), other(x))
    mgr.restore()
