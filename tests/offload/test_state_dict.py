"""``state_dict``/``load_state_dict`` of modules whose tensors live in host masters
(``vramkit.offload._state_dict``), on the CPU: a model with a BlockSwapper attached (swapped
blocks read and write their masters, never the placeholders or slots) and modules held by a
CPUOffloadManager (unloaded tensors go through their masters, loaded ones through PyTorch)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.offload.swap.test_swapper import (
    MIN,
    X,
    _frozen_blocks,
    _net,
    _optimizer,
    _step,
    _swap,
)
from tests.offload.test_cpu import _mlp
from vramkit.errors import OffloadError
from vramkit.offload.cpu import CPUOffloadManager


def _placeholder(t: torch.Tensor) -> bool:
    return all(s == 0 for s in t.stride())


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key].cpu(), value.cpu()), key


def test_state_dict_reads_the_masters_of_evicted_and_loaded_blocks() -> None:
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    _step(model)  # blocks 0-1 left in the slots, 2-3 evicted (placeholders)
    assert any(_placeholder(e.tensor) for b in swapper.blocks for e in b.entries)
    _assert_same_state(model.state_dict(), ref.state_dict())
    _assert_same_state(model.blocks[3].state_dict(), ref.blocks[3].state_dict())
    _assert_same_state(model.blocks.state_dict(prefix="x."), ref.blocks.state_dict(prefix="x."))
    # keep_vars=True hands out the module's own Parameter objects, as PyTorch does.
    kept = model.state_dict(keep_vars=True)
    assert kept["blocks.3.fc1.weight"] is model.blocks[3].fc1.weight
    swapper.detach()


class TwiceBlock(nn.Module):
    """One Linear registered under two names, as state_dict then saves it twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.alias = self.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alias(x).tanh()


def test_state_dict_covers_every_name_of_a_submodule() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 32), nn.ModuleList(TwiceBlock() for _ in range(4)))
    ref.requires_grad_(False)

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(ref)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.net[1]:
                x = block(x)
            return x

    model = Wrap()
    swapper = _swap(model, max_gpu_blocks=0)
    with torch.no_grad():
        model(X)
    want = {f"net.{k}": v for k, v in ref.state_dict().items()}
    _assert_same_state(model.state_dict(), want)
    assert "net.1.3.alias.weight" in want
    swapper.detach()


def test_state_dict_sees_host_optimizer_steps() -> None:
    # trainable="cpu": the CPU optimizer steps the masters; the slots are stale until reloaded,
    # and state_dict must show the stepped values.
    ref = _net()
    model = copy.deepcopy(ref)
    swapper = _swap(model, trainable="cpu")
    opt, ref_opt = _optimizer(model, swapper), _optimizer(ref)
    for m, o in ((model, opt), (ref, ref_opt)):
        _step(m)
        if m is model:
            swapper.sync_gradients()
        o.step()
    _assert_same_state(model.state_dict(), ref.state_dict())
    swapper.detach()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_load_state_dict_writes_the_masters(checkpointing: bool) -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model, checkpointing=checkpointing)
    _step(model)  # slots hold blocks now: the load must make them reload
    other = _frozen_blocks(_net(seed=7))
    model.load_state_dict(other.state_dict())
    assert all(_placeholder(e.tensor) for b in swapper.blocks for e in b.entries)
    _assert_same_state(model.state_dict(), other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(X), other(X))
    model.zero_grad()
    _step(model)
    _step(other)
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    swapper.detach()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters(),
                                                  strict=True))


def test_partial_and_failed_loads_leave_a_working_model() -> None:
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    other = _frozen_blocks(_net(seed=7))
    part = {k: v for k, v in other.state_dict().items() if k.startswith("blocks.2.")}
    model.load_state_dict(part, strict=False)  # only block 2 changes
    ref.blocks[2].load_state_dict(other.blocks[2].state_dict())
    _assert_same_state(model.state_dict(), ref.state_dict())
    bad = dict(other.state_dict())
    bad["blocks.3.fc1.weight"] = torch.zeros(3, 3)  # wrong shape: PyTorch's loader refuses it
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad)
    # PyTorch copies every other tensor before it raises; the swapped tensors point at their
    # placeholders again, and training matches a reference loaded the same way.
    ref.load_state_dict({k: v for k, v in bad.items() if k != "blocks.3.fc1.weight"},
                        strict=False)
    assert all(_placeholder(e.tensor) for b in swapper.blocks for e in b.entries)
    assert torch.equal(_step(model), _step(ref))
    swapper.detach()


def test_assign_load_is_refused() -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model)
    with pytest.raises(OffloadError, match="assign=True"):
        model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    _step(model)  # still usable
    swapper.detach()


def _hook_counts(module: nn.Module) -> tuple[int, int, int]:
    return (len(module._state_dict_hooks), len(module._load_state_dict_pre_hooks),
            len(module._load_state_dict_post_hooks))


def test_detach_removes_the_hooks() -> None:
    model = _frozen_blocks(_net())
    before = [_hook_counts(b) for b in model.blocks]
    swapper = _swap(model, min_param_bytes=MIN)
    assert all(c == (1, 1, 1) for c in (_hook_counts(b) for b in model.blocks))
    swapper.detach()
    assert [_hook_counts(b) for b in model.blocks] == before


# -- CPUOffloadManager ------------------------------------------------------------------------


def test_manager_state_dict_reads_masters_of_unloaded_tensors_only() -> None:
    model = _mlp()
    want = copy.deepcopy(model.state_dict())
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    assert _placeholder(model[0].weight)
    _assert_same_state(model.state_dict(), want)
    mgr.load_to_gpu("2")
    with torch.no_grad():
        model[2].weight.add_(1.0)  # a loaded tensor's current value is its device copy
    want["2.weight"] = want["2.weight"] + 1.0
    _assert_same_state(model.state_dict(), want)
    assert model.state_dict(keep_vars=True)["0.weight"] is model[0].weight
    mgr.restore()


@pytest.mark.parametrize("loaded", [False, True])
def test_manager_load_state_dict_reaches_the_next_load(loaded: bool) -> None:
    model, other = _mlp(), _mlp(seed=3)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    if loaded:
        mgr.load_to_gpu("0")  # loaded: PyTorch copies into the device copy, written back later
    model.load_state_dict(other.state_dict())
    assert _placeholder(model[2].weight)  # unloaded tensors are placeholders again
    mgr.release()
    mgr.clear_inactive()
    _assert_same_state(model.state_dict(), other.state_dict())
    mgr.load_to_gpu(["0", "2"])
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), other(x))
    mgr.restore()
    _assert_same_state(model.state_dict(), other.state_dict())


def test_manager_refuses_assign_and_restore_removes_the_hooks() -> None:
    model = _mlp()
    before = [_hook_counts(m) for m in model]
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    assert _hook_counts(model[0]) == (1, 1, 1)
    with pytest.raises(OffloadError, match="assign=True"):
        model.load_state_dict(_mlp(seed=3).state_dict(), assign=True)
    mgr.restore()
    assert [_hook_counts(m) for m in model] == before
