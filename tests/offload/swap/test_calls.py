"""Calls of swapped blocks in training (``vramkit.offload.swap.calls``), on the CPU: the same
results as no swapping through both autograd paths (frozen weights in the outer graph,
trainable weights in their own Function), structured arguments and outputs, adapters added
after attaching, checkpointing, autocast, retain_graph.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._toys import assert_same_grads, grads_of
from tests.offload.swap.test_swapper import (
    D,
    Net,
    X,
    _frozen_blocks,
    _is_placeholder,
    _lora_only,
    _net,
    _optimizer,
    _step,
    _swap,
    _train_and_compare,
)
from vramkit.errors import OffloadError
from vramkit.offload.checkpointing import enable_gradient_checkpointing, is_checkpointed

# --------------------------------------------------------------------------------------------
# Identical results to no swapping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("keep", [0, 2, 4])
def test_training_matches_the_unswapped_model(mode: str, checkpointing: bool, keep: int) -> None:
    ref = _net(dropout=0.1, lora=mode == "lora")
    if mode == "lora":
        _lora_only(ref)
    model = copy.deepcopy(ref)
    ids = {name: id(p) for name, p in model.named_parameters()}
    swapper = _swap(model, max_gpu_blocks=keep, checkpointing=checkpointing,
                    trainable="cpu" if mode == "full" else "resident")
    assert len(swapper.swapped_names) == 4 - keep
    _train_and_compare(model, swapper, ref)
    swapper.detach()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert id(p) == ids[name]
        assert p.device == q.device and not _is_placeholder(p)
        assert torch.equal(p, q), name  # trained values come back
        assert p.requires_grad == q.requires_grad


@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradient_accumulation_of_host_gradients(set_to_none: bool) -> None:
    ref = _net()
    model = copy.deepcopy(ref)
    swapper = _swap(model, trainable="cpu")
    opt, ref_opt = _optimizer(model, swapper), _optimizer(ref)
    for _ in range(2):  # two optimizer steps of two micro-batches each
        for micro in (X, X.flip(0) * 0.5):
            model(micro).square().mean().backward()
            ref(micro).square().mean().backward()
        swapper.sync_gradients()
        assert_same_grads(grads_of(model, swapper), grads_of(ref))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
    swapper.detach()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_trainable_knob_decides_what_swaps() -> None:
    model = _net()  # every parameter trainable
    resident = _swap(model, trainable="resident")
    assert resident.stats().swapped_blocks == 0 and resident.host_parameters() == []
    resident.detach()
    cpu = _swap(model, trainable="cpu")
    assert cpu.stats().swapped_blocks == 4
    hosts = cpu.host_parameters()
    # Like any parameter, a host parameter has no gradient until a backward produces one.
    assert len(hosts) == 8 and all(h.requires_grad and h.grad is None for h in hosts)
    cpu.detach()


class TupleBlock(nn.Module):
    """Takes a kwarg tensor, returns a tuple with a dict of mixed leaves and a passthrough."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, *, t: torch.Tensor,
                tag: str = "") -> tuple[Any, ...]:
        h = self.fc2(F.silu(self.fc1(x + ctx))) * t
        return x + h, ctx, {"aux": t * 2, "n": 3, "tag": tag, "ids": x.argmax(-1)}


class TupleNet(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TupleBlock() for _ in range(n))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x, ctx, extra = block(x, ctx, t=t, tag=f"b{i}")
            assert extra["n"] == 3 and extra["tag"] == f"b{i}"
            assert extra["ids"].dtype == torch.long and not extra["ids"].requires_grad
            t = extra["aux"] / 2
        return x


@pytest.mark.parametrize("checkpointing", [False, True])
def test_structured_outputs_kwargs_and_passthrough(checkpointing: bool) -> None:
    torch.manual_seed(0)
    ref = TupleNet().requires_grad_(False)
    model = copy.deepcopy(ref)
    swapper = _swap(model, min_param_bytes=0, checkpointing=checkpointing)
    assert len(swapper.swapped_names) == 4

    def leaves() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return [torch.randn(8, D, generator=g).requires_grad_(),
                torch.randn(8, D, generator=g).requires_grad_(),
                torch.rand(8, 1, generator=g).requires_grad_()]

    mine, theirs = leaves(), leaves()
    for _ in range(2):
        out = model(*mine)
        want = ref(*theirs)
        assert torch.equal(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a.grad, b.grad)  # input, passthrough context and kwarg tensor
    swapper.detach()


def test_outputs_are_hooked_unless_an_input_passes_through() -> None:
    # Backward reaches a block through pre-hooks on its output nodes (no wrapper Function, the
    # cheaper path); a block that returns an input as-is gets BlockExit wrappers instead,
    # since that input's node is not the block's and may run after the block's own nodes.
    model = _frozen_blocks(_net())
    swapper = _swap(model)
    out = model.blocks[0](X.clone().requires_grad_())
    assert "BlockExit" not in type(out.grad_fn).__name__
    swapper.detach()
    tuple_net = TupleNet().requires_grad_(False)
    swapper = _swap(tuple_net, min_param_bytes=0)
    x, ctx = (torch.randn(8, D).requires_grad_() for _ in range(2))
    y, ctx_out, _ = tuple_net.blocks[0](x, ctx, t=torch.ones(8, 1))
    assert type(ctx_out.grad_fn).__name__ == "BlockExitBackward"
    assert type(y.grad_fn).__name__ == "BlockExitBackward"
    swapper.detach()


def test_lora_gradients_reach_blocks_whose_inputs_need_no_grad() -> None:
    ref = _lora_only(_net(lora=True))
    model = copy.deepcopy(ref)
    swapper = _swap(model)  # inp is frozen: X -> block 0 carries no grad; its LoRA does
    _step(model)
    # Block 0 joined the graph although no input needed grad: re-acquired in backward like
    # the others (4 forward + 4 backward acquisitions).
    assert swapper.stats().acquisitions == 8
    _step(ref)
    assert_same_grads(grads_of(model), grads_of(ref))
    assert all(model.blocks[i].lora_a.grad.abs().sum() > 0 for i in range(4))
    swapper.detach()


def test_adapters_added_after_attaching_are_trained() -> None:
    # Everything frozen when the swapper attaches; then LoRA parameters are registered on each
    # block (as peft does after loading). The swapper's cached parameter lists follow
    # module/parameter registrations, so block 0 (whose input needs no grad) still joins the
    # graph and its adapter gets the same gradient as without swapping.
    ref = _net()
    ref.requires_grad_(False)
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    assert not model(X).requires_grad  # nothing trainable yet: parameter lists cached
    torch.manual_seed(7)
    adapters = [(torch.randn(4, D) * 0.1, torch.randn(2 * D, 4) * 0.1) for _ in range(4)]
    for net in (model, ref):
        for block, (a, b) in zip(net.blocks, adapters, strict=True):
            block.lora_a = nn.Parameter(a.clone())
            block.lora_b = nn.Parameter(b.clone())
    swapper.reset_stats()
    _step(model)
    _step(ref)
    assert swapper.stats().acquisitions == 8  # block 0 included: it joined the graph
    for mine, theirs in zip(model.blocks, ref.blocks, strict=True):
        assert mine.lora_a.grad is not None
        assert torch.equal(mine.lora_a.grad, theirs.lora_a.grad)
        assert torch.equal(mine.lora_b.grad, theirs.lora_b.grad)
    swapper.detach()


def test_parameters_written_past_the_registration_hooks_are_seen() -> None:
    # A write straight into _parameters (as ModuleList.insert does for _modules) fires no
    # registration hook; the changed parameter count still makes the swapper list again.
    ref = _net()
    ref.requires_grad_(False)
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    assert not model(X).requires_grad  # parameter lists cached
    torch.manual_seed(3)
    a, b = torch.randn(4, D) * 0.1, torch.randn(2 * D, 4) * 0.1
    for net in (model, ref):
        block = net.blocks[0]
        del block.__dict__["lora_a"], block.__dict__["lora_b"]
        block._parameters["lora_a"] = nn.Parameter(a.clone())
        block._parameters["lora_b"] = nn.Parameter(b.clone())
    _step(model)
    _step(ref)
    assert torch.equal(model.blocks[0].lora_a.grad, ref.blocks[0].lora_a.grad)
    swapper.detach()


@pytest.mark.parametrize("setup", ["inputs", "lora", "checkpointed"])
def test_double_backward_through_swapped_blocks_is_refused(setup: str) -> None:
    # A second-order graph built in a block's backward would read slot memory with no slot
    # held for it: the first backward with create_graph=True that reaches a swapped block says
    # so (also when only the adapters inside the blocks are differentiated: no block input
    # requires grad there).
    model = _lora_only(_net(lora=True)) if setup == "lora" else _frozen_blocks(_net())
    if setup == "checkpointed":
        enable_gradient_checkpointing(model)
    swapper = _swap(model)
    x = X.clone().requires_grad_(setup != "lora")
    wrt = [p for p in model.parameters() if p.requires_grad] if setup == "lora" else [x]
    with pytest.raises(OffloadError, match="create_graph=True"):
        torch.autograd.grad(model(x).square().mean(), wrt, create_graph=True)
    # Nothing was acquired for the refused pass: ordinary training goes on.
    _step(model)
    assert all(not s.locked for s in swapper._ring.slots)
    swapper.detach()


def test_structure_watch_is_released_when_a_swapper_is_collected() -> None:

    from vramkit.offload import _structure as structure_module

    gc.collect()
    users = structure_module._STRUCTURE["users"]
    model = _frozen_blocks(_net())
    swapper = _swap(model)
    # the swapper, and the lean checkpoint of each checkpointed block (its parameter places)
    assert structure_module._STRUCTURE["users"] == users + 1 + sum(
        b.lean is not None for b in swapper.blocks)
    del swapper, model  # never detached
    gc.collect()
    assert structure_module._STRUCTURE["users"] == users


def test_structure_watch_hooks_are_removed_with_the_last_watcher() -> None:

    from torch.nn.modules import module as torch_module

    from vramkit.offload import _structure as structure_module

    gc.collect()
    new = 0 if structure_module._STRUCTURE["users"] else 1  # hooks another test's model still holds
    before = (len(torch_module._global_module_registration_hooks),
              len(torch_module._global_parameter_registration_hooks))
    first = _swap(_frozen_blocks(_net()), checkpointing=False)
    second = _swap(_frozen_blocks(_net(1)), checkpointing=False)
    assert len(torch_module._global_module_registration_hooks) == before[0] + new
    first.detach()
    assert len(torch_module._global_parameter_registration_hooks) == before[1] + new
    second.detach()
    assert (len(torch_module._global_module_registration_hooks),
            len(torch_module._global_parameter_registration_hooks)) == before
    checkpointed = _swap(_frozen_blocks(_net()))  # its blocks' lean states watch too
    checkpointed.detach()
    del checkpointed
    gc.collect()
    assert (len(torch_module._global_module_registration_hooks),
            len(torch_module._global_parameter_registration_hooks)) == before


def test_frozen_leading_blocks_get_no_backward() -> None:
    model = _net()
    model.requires_grad_(False)
    for block in model.blocks[2:]:
        block.requires_grad_(True)
    swapper = _swap(model, trainable="cpu")
    for b in model.blocks:
        b.calls = 0
    _step(model)
    # Blocks 0 and 1 are frozen and see no grad-requiring input: forward only.
    assert swapper.stats().acquisitions == 4 + 2
    swapper.detach()


def test_a_block_called_twice_per_forward() -> None:
    ref = _frozen_blocks(_net(order=[0, 1, 0, 2, 3, 1]))
    model = copy.deepcopy(ref)
    for checkpointing in (False, True):
        swapper = _swap(model, checkpointing=checkpointing)
        _train_and_compare(model, swapper, ref, steps=2)
        swapper.detach()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("n", [3, 4])
def test_two_forwards_then_one_backward(checkpointing: bool, n: int) -> None:
    # The second forward puts blocks in other slots than the first did (n=3): backward must
    # read each call's weights from wherever its block is now, not from the slot it ran in.
    ref = _frozen_blocks(_net(n=n))
    model = copy.deepcopy(ref)
    swapper = _swap(model, checkpointing=checkpointing)
    for m in (model, ref):
        (m(X).square().mean() + m(X.flip(0)).abs().mean()).backward()
    assert_same_grads(grads_of(model), grads_of(ref))
    swapper.detach()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_autocast_matches(checkpointing: bool) -> None:
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    swapper = _swap(model, checkpointing=checkpointing)
    for m in (model, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(X)
        out.float().square().mean().backward()
    assert_same_grads(grads_of(model), grads_of(ref))
    swapper.detach()


def test_checkpointing_knob_recomputes_swapped_blocks() -> None:
    def calls_per_step(model: Net, **config: Any) -> list[int]:
        swapper = _swap(model, **config)
        for b in model.blocks:
            b.calls = 0
        _step(model)
        swapper.detach()
        return [b.calls for b in model.blocks]

    model = _frozen_blocks(_net())
    assert calls_per_step(model, checkpointing=True) == [2, 2, 2, 2]
    assert calls_per_step(model, checkpointing=False) == [1, 1, 1, 1]
    assert calls_per_step(model) == [1, 1, 1, 1]  # None follows the blocks: not marked
    probe = _swap(model, max_gpu_blocks=2)
    swapped = [e.swapped for e in probe.schedule]
    probe.detach()
    assert sum(swapped) == 2  # only swapped blocks go through the swapper's recompute
    assert calls_per_step(model, checkpointing=True, max_gpu_blocks=2) == [
        2 if s else 1 for s in swapped]
    enable_gradient_checkpointing(model)
    assert calls_per_step(model) == [2, 2, 2, 2]  # None: marked blocks recompute
    assert calls_per_step(model, checkpointing=False) == [1, 1, 1, 1]
    assert all(is_checkpointed(b) for b in model.blocks)  # the marks survive detach


def test_composes_with_enable_gradient_checkpointing() -> None:
    ref = _lora_only(_net(dropout=0.2, lora=True))
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    wrappers = [b.__dict__["forward"] for b in model.blocks]
    swapper = _swap(model, max_gpu_blocks=2)
    _train_and_compare(model, swapper, ref, steps=2)
    swapper.detach()
    assert [b.__dict__["forward"] for b in model.blocks] == wrappers


def test_preserve_rng_state_replays_dropout() -> None:
    ref = _lora_only(_net(dropout=0.5, lora=True))
    model = copy.deepcopy(ref)
    swapper = _swap(model, checkpointing=True, preserve_rng_state=False)
    torch.manual_seed(7)
    loss = _step(model)
    torch.manual_seed(7)
    ref_loss = _step(ref)
    assert torch.equal(loss, ref_loss)  # forward masks are the same...
    got, want = grads_of(model), grads_of(ref)
    assert any(not torch.equal(got[n], want[n]) for n in want)  # ...recomputed ones are not
    swapper.detach()


def test_retain_graph_backs_up_twice_through_frozen_swapped_blocks() -> None:
    """Frozen swapped blocks join the outer graph: a second backward re-acquires each slot."""
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    swapper = _swap(model, checkpointing=False)
    loss, ref_loss = model(X).sum(), ref(X).sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        ref_loss.backward(retain_graph=True)
    got, want = grads_of(model), grads_of(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    swapper.detach()


def test_retain_graph_through_swapped_trainable_weights_is_an_error() -> None:
    model = _net()  # every weight trainable: trainable="cpu" blocks use the Function path
    swapper = _swap(model, checkpointing=False, trainable="cpu")
    loss = model(X).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(OffloadError) as info:
        loss.backward()
    assert "retain_graph" in info.value.hint
    swapper.detach()
