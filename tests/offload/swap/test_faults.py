"""Faults while swapping, on the CPU: the disk tier's disk full, an out-of-memory error inside a
swapped block's backward. Each ends in a clear error or a recovery, and ``detach()`` gives back
exactly the original weights (``test_faults_gpu.py``: the same on a GPU, and pinning refused)."""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import Stack
from vramkit.errors import OffloadError
from vramkit.offload import _patch
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap import disk as disk_module

DIM = 64


class _FailOnce(torch.autograd.Function):
    """Identity forward; its backward raises ``torch.OutOfMemoryError`` while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                         "(injected in a swapped block's backward)")
        return grad


class Block(nn.Module):
    """A frozen residual MLP with a trainable LoRA-like adapter; its backward can fail once."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM).requires_grad_(False)
        self.down = nn.Linear(4 * DIM, DIM).requires_grad_(False)
        self.adapter = nn.Parameter(torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _FailOnce.apply(self.down(torch.relu(self.up(x))))
        return x + h + self.adapter


def model(device: str = "cpu") -> Stack:
    net = Stack(Block, 6, seed=0)
    return net.to(device)


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}


def assert_exactly(net: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = weights(net)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert all(not _patch.wrappers(m) for m in net.modules())


def step(net: nn.Module, device: str = "cpu", seed: int = 1) -> float:
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(seed)).to(device)
    loss = net(x).square().mean()
    loss.backward()
    return loss.item()


def swap_config(**kw: Any) -> SwapConfig:
    return SwapConfig(min_param_bytes=1024, max_gpu_blocks=2, **kw)


def oom_in_backward_then_recover(device: str) -> None:
    """The scenario of the CPU and GPU tests: an OOM in a swapped block's backward."""
    reference, net = model(device), model("cpu")
    original = weights(net)
    swapper = BlockSwapper(net, config=swap_config(), device=device)
    assert swapper.swapped_names
    _FailOnce.armed = True
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        step(net, device)
    assert not _FailOnce.armed  # it did fail, inside the backward
    net.zero_grad(set_to_none=True)  # what a recovery loop frees before it tries again
    reference.zero_grad(set_to_none=True)
    # the next step works and computes what the never-failed model computes
    assert step(net, device, seed=2) == step(reference, device, seed=2)
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name
    swapper.detach()
    assert_exactly(net, original)


def disk_full_at_attach(device: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier's spill file cannot be written: a clear error, nothing lost."""
    net = model("cpu")
    original = weights(net)

    def no_space(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "pwrite", no_space)
    budget = 450 * 1024  # 3 staging buffers of a block (132 KiB, fp32): blocks on disk
    with pytest.raises(OffloadError, match="the disk is full") as raised:
        BlockSwapper(net, config=swap_config(host_budget=budget,
                                             disk_cache_dir=str(cache)), device=device)
    assert "Free disk space" in raised.value.hint
    assert_exactly(net, original)  # every tensor back, with its value, no wrapper left
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert list(cache.iterdir()) == []  # the spill file was unlinked at once
    monkeypatch.undo()
    with BlockSwapper(net, config=swap_config(host_budget=budget,
                                              disk_cache_dir=str(cache)), device=device) as again:
        assert again.stats().disk_blocks > 0  # with room again, the same swapper attaches
        step(net, device)


def test_an_oom_in_a_swapped_backward_leaves_a_swapper_that_steps_and_detaches_exactly() -> None:
    oom_in_backward_then_recover("cpu")


def test_a_full_disk_under_the_disk_tier_is_a_clear_error_that_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk_full_at_attach("cpu", tmp_path, monkeypatch)


def test_the_fault_models_are_what_they_claim() -> None:
    net = model()
    assert copy.deepcopy(net).blocks[0].up.weight.requires_grad is False
    assert [n for n, p in net.named_parameters() if p.requires_grad] == [
        f"blocks.{i}.adapter" for i in range(6)]
