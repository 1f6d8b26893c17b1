"""The swapper's side of data parallelism, in one process: what it tells DDP to leave alone, and
the models it refuses (DDP-wrapped, FSDP-sharded before or after it attaches)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tests._toys import Stack
from tests.distributed._group import single_rank_group
from vramkit.errors import ConfigError
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap.attach import is_fsdp

CONFIG = SwapConfig(min_param_bytes=0)
IGNORE = "_ddp_params_and_buffers_to_ignore"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale


def _net() -> Stack:
    """Trainable ``inp``/``out`` around frozen blocks."""
    return Stack(Block, 3, inp=(8, 16), out=(16, 4), seed=0, frozen=True)


def _x() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def _placeholders(model: nn.Module) -> set[str]:
    """Qualified names of the tensors the swapper replaced by stride-0 placeholders."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {n for n, t in tensors if t.numel() > 1 and all(s == 0 for s in t.stride())}


@pytest.fixture()
def group() -> Iterator[None]:
    with single_rank_group():
        yield


# -- _ddp_params_and_buffers_to_ignore ---------------------------------------------------------


def test_ddp_ignores_exactly_the_swapped_tensors_while_attached() -> None:
    model = _net()
    assert not hasattr(model, IGNORE)
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    ignored = list(getattr(model, IGNORE))
    expected = {f"blocks.{i}.{name}" for i in range(3)
                for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale")}
    assert _placeholders(model) == expected  # parameters and buffers of every swapped block
    assert sorted(ignored) == sorted(expected) and len(ignored) == len(set(ignored))
    swapper.detach()
    assert not hasattr(model, IGNORE)
    assert _placeholders(model) == set()


def test_only_the_blocks_that_swap_are_ignored() -> None:
    model = _net()
    swapper = BlockSwapper(model, "blocks.*",
                           SwapConfig(min_param_bytes=0, swapped_blocks=["blocks.1"]),
                           device="cpu")
    try:
        assert set(getattr(model, IGNORE)) == {
            "blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight",
            "blocks.1.fc2.bias", "blocks.1.scale"}
    finally:
        swapper.detach()


def test_small_tensors_that_stay_resident_are_not_ignored() -> None:
    model = _net()
    # Weights (>= 2 KiB) swap; biases and the buffer stay on the device and DDP handles them.
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=2048), device="cpu")
    try:
        assert set(getattr(model, IGNORE)) == {f"blocks.{i}.fc{j}.weight"
                                               for i in range(3) for j in (1, 2)}
        assert set(getattr(model, IGNORE)) == _placeholders(model)
    finally:
        swapper.detach()


def test_a_list_the_model_had_is_merged_and_restored_exactly() -> None:
    model = _net()
    mine = ["inp.bias", "blocks.0.fc1.weight"]  # one of them also swapped: listed once
    model._ddp_params_and_buffers_to_ignore = mine  # type: ignore[assignment]
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    merged = getattr(model, IGNORE)
    assert merged[:2] == ["inp.bias", "blocks.0.fc1.weight"]  # the user's first, in order
    assert set(merged) == {"inp.bias"} | _placeholders(model)
    assert len(merged) == len(set(merged))
    assert mine == ["inp.bias", "blocks.0.fc1.weight"]  # the user's list is not modified
    swapper.detach()
    assert getattr(model, IGNORE) is mine and mine == ["inp.bias", "blocks.0.fc1.weight"]


def test_an_empty_list_the_model_had_is_restored_too() -> None:
    model = _net()
    empty: list[str] = []
    model._ddp_params_and_buffers_to_ignore = empty  # type: ignore[assignment]
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    assert set(getattr(model, IGNORE)) == _placeholders(model)
    swapper.detach()
    assert getattr(model, IGNORE) is empty and empty == []


def test_nothing_swapped_sets_nothing() -> None:
    model = _net()
    with pytest.warns(UserWarning):  # the swapper says why it swaps nothing
        swapper = BlockSwapper(model, "blocks.*",
                               SwapConfig(min_param_bytes=0, swapped_blocks=[]), device="cpu")
    try:
        assert not hasattr(model, IGNORE)
    finally:
        swapper.detach()


# -- DDP around the swapper, and the swapper around DDP ----------------------------------------


def test_plain_ddp_after_attaching_constructs_and_reduces(group: None) -> None:
    """DDP broadcasts the module's state at construction, even alone: the placeholders (one
    element seen through a zero stride) would make that fail without the ignore list."""
    from torch.nn.parallel import DistributedDataParallel

    reference = _net()
    model = copy.deepcopy(reference)
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        ddp = DistributedDataParallel(model)
        reference(_x()).square().mean().backward()
        ddp(_x()).square().mean().backward()
        for (name, got), want in zip(model.named_parameters(), reference.parameters(),
                                     strict=True):
            if want.requires_grad:
                assert got.grad is not None and torch.allclose(got.grad, want.grad,
                                                               atol=1e-6), name
    finally:
        swapper.detach()


def test_without_the_ignore_list_ddp_would_fail_on_the_placeholders(group: None) -> None:
    """The regression the ignore list fixes (what a plain ``DistributedDataParallel(model)``
    raised before)."""
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    saved = getattr(model, IGNORE)
    try:
        delattr(model, IGNORE)
        with pytest.raises(RuntimeError, match="single memory location"):
            DistributedDataParallel(model)
    finally:
        model._ddp_params_and_buffers_to_ignore = saved  # type: ignore[assignment]
        swapper.detach()


def test_a_ddp_wrapped_model_is_refused_with_a_hint(group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    ddp = DistributedDataParallel(model)
    with pytest.raises(ConfigError, match="DistributedDataParallel wrapper") as info:
        BlockSwapper(ddp, "module.blocks.*", CONFIG, device="cpu")
    assert "wrap_ddp" in (info.value.hint or "")
    assert not hasattr(model, IGNORE) and _placeholders(model) == set()  # untouched


# -- FSDP --------------------------------------------------------------------------------------


def _fake_fsdp_class(name: str = "FSDPModule",
                     module: str = "torch.distributed.fsdp._fake") -> type:
    return type(name, (nn.Module,), {"__module__": module})


def test_fsdp_classes_are_recognised_by_name_in_torch_distributed_only() -> None:
    fsdp2 = _fake_fsdp_class()
    fsdp1 = _fake_fsdp_class("FullyShardedDataParallel",
                             "torch.distributed.fsdp.fully_sharded_data_parallel")
    assert is_fsdp(fsdp2()) and is_fsdp(fsdp1())
    # fully_shard re-classes a module to a subclass of (FSDPModule, its class): seen in the MRO.
    sharded = type("FSDPLinear", (fsdp2, nn.Linear), {"__module__": __name__})
    assert is_fsdp(sharded.__new__(sharded))
    # The same names elsewhere, or other torch.distributed classes, are not FSDP.
    assert not is_fsdp(_fake_fsdp_class(module="mypackage.fsdp")())
    assert not is_fsdp(_fake_fsdp_class(module="torchdistributed")())
    assert not is_fsdp(_fake_fsdp_class("FSDPModuleish")())
    assert not is_fsdp(nn.Linear(2, 2)) and not is_fsdp(_net())


def test_a_model_with_an_fsdp_sharded_module_is_refused_before_attaching() -> None:
    model = _net()
    block = model.blocks[1]
    block.__class__ = type("FSDPBlock", (_fake_fsdp_class(), Block), {})
    with pytest.raises(ConfigError, match=r"blocks\.1 is sharded by FSDP") as info:
        BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    assert "wrap_ddp" in (info.value.hint or "") and "CPUOffloadPolicy" in (info.value.hint or "")
    assert not hasattr(model, IGNORE) and _placeholders(model) == set()


def test_a_block_sharded_after_attaching_is_refused_at_its_next_call() -> None:
    model = _net()
    reference = copy.deepcopy(model)
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    block = model.blocks[2]
    block.__class__ = type("FSDPBlock", (_fake_fsdp_class(), Block), {})
    try:
        for _ in range(2):  # and again: the refusal is not a one-off
            with pytest.raises(ConfigError, match="FSDP after the swapper attached") as info:
                model(_x())
            assert "blocks.2" in str(info.value)
        block.__class__ = Block  # un-sharded: the swapper runs again
        assert torch.allclose(model(_x()), reference(_x()), atol=1e-6)
    finally:
        block.__class__ = Block
        swapper.detach()
    assert torch.equal(model.blocks[2].fc1.weight, reference.blocks[2].fc1.weight)


def test_the_model_sharded_after_attaching_is_refused_too() -> None:
    model = _net()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    model.__class__ = type("FSDPNet", (_fake_fsdp_class(), Stack), {})
    try:
        with pytest.raises(ConfigError, match="the model was sharded by FSDP after"):
            model(_x())
    finally:
        model.__class__ = Stack
        swapper.detach()


# -- the gradient hook's finish() ----------------------------------------------------------------


def _full_ft(trainable: str) -> tuple[nn.Module, BlockSwapper, dict[str, torch.Tensor]]:
    """A fully trainable Net with its blocks swapped, and its weights before attaching."""
    model = _net()
    for p in model.parameters():
        p.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    factory = None if trainable == "cpu" else (lambda ps: torch.optim.SGD(ps, lr=0.1))
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0, trainable=trainable),
                           device="cpu", optimizer=factory)
    return model, swapper, before


@pytest.mark.parametrize("trainable", ["cpu", "swap"])
def test_a_finish_the_hook_returns_runs_before_the_gradients_are_read(trainable: str) -> None:
    """The hook starts work and returns finish(); the swapper runs it before the gradients go
    to the host (cpu) or the block steps (swap): here finish() zeroes them, so nothing moves."""
    model, swapper, before = _full_ft(trainable)
    events: list[str] = []

    def hook(name: str, grads: list[torch.Tensor]) -> object:
        events.append(f"hook {name}")

        def finish() -> None:
            events.append(f"finish {name}")
            for g in grads:
                g.zero_()
        return finish

    swapper.set_gradient_hook(hook)
    model(_x()).square().mean().backward()
    names = [e.split()[1] for e in events if e.startswith("hook")]
    assert names and events == [f"{kind} {n}" for n in names for kind in ("hook", "finish")]
    if trainable == "cpu":
        swapper.sync_gradients()
        assert all(float(p.grad.abs().max()) == 0 for p in swapper.host_parameters())
    else:  # SGD stepped with zeroed gradients: the swapped weights did not move
        swapper.detach()
        after = dict(model.named_parameters())
        for n in names:
            for key, value in before.items():
                if key.startswith(n + "."):
                    assert torch.equal(after[key].detach(), value), key
        return
    swapper.detach()


def test_a_hook_returning_something_not_callable_is_an_error() -> None:
    from vramkit.errors import OffloadError

    model, swapper, _ = _full_ft("cpu")
    swapper.set_gradient_hook(lambda name, grads: 42)
    with pytest.raises(OffloadError, match="returned a int") as info:
        model(_x()).square().mean().backward()
    assert "finish" in info.value.hint or "None" in info.value.hint
    swapper.detach()


def test_masters_changed_reloads_slots_copied_before_a_write_no_counter_saw() -> None:
    """A write into the masters that bumps no version counter (a collective, numpy, C++) leaves
    slot copies looking fresh; masters_changed() makes the next use reload them."""
    model = _net()
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0, num_slots=3),
                           device="cpu")
    try:
        with torch.no_grad():
            first = model(_x())
            for block in swapper.blocks:
                block.master.numpy()[:] = 0  # behind autograd's back: no version bump
            stale = model(_x())
            swapper.masters_changed()
            fresh = model(_x())
        assert torch.equal(stale, first)  # every block was still in a slot: nothing reloaded
        assert not torch.equal(fresh, first)  # the zeroed weights are used now
    finally:
        swapper.detach()
