"""Tests of the lean checkpoint (vramkit.offload._lean_checkpoint) through
enable_gradient_checkpointing: what it computes, what its forward records, and where it steps
aside for PyTorch's checkpoint."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import ResidualMLP, Stack, assert_same_grads, present_grads
from tests.offload.test_checkpointing import assert_identical, make_model, train_step
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload import CHECKPOINT_METHODS, checkpoint_method
from vramkit.offload.checkpointing import (
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
)

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def _lora(model: nn.Module) -> nn.Module:
    """Freeze everything but the blocks' ``up`` layers: no input of the first block requires
    grad (the embedding is frozen), as under LoRA."""
    for name, p in model.named_parameters():
        p.requires_grad_(".up." in name)
    return model


def _grads(model: nn.Module, x: torch.Tensor, **backward: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward(**backward)
    return present_grads(model)


def _lean_nodes(out: torch.Tensor) -> int:
    """Nodes of the lean Function reachable from ``out``."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        count += type(node).__name__ == "_LeanFunctionBackward"
        stack.extend(n for n, _ in node.next_functions)
    return count


class _Scaled(nn.Module):
    """A layer wrapped after checkpointing was enabled: a new trainable parameter in a block."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.full((inner.out_features,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.gain


def _swap_in_adapters(model: nn.Module) -> None:
    for block in model.blocks:
        block.down = _Scaled(block.down)


def test_parameters_added_or_unfrozen_after_the_first_steps_are_trained() -> None:
    # The lean checkpoint keeps where each block's parameters live between calls: a layer
    # wrapped later (an adapter injected after checkpointing) and a parameter unfrozen later
    # must still get their gradients, bit-identical to the model without checkpointing.
    ref = _lora(make_model())
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    for _ in range(2):
        _grads(model, X)
    _swap_in_adapters(ref), _swap_in_adapters(model)
    for name, p in [*ref.named_parameters(), *model.named_parameters()]:
        if name.endswith(".norm.weight"):
            p.requires_grad_(True)
    for step in range(2):
        want, got = _grads(ref, X), _grads(model, X)
        assert any(n.endswith(".gain") for n in got) and any(n.endswith("norm.weight")
                                                             for n in got)
        assert got.keys() == want.keys(), step
        for name in want:
            assert torch.equal(got[name], want[name]), (step, name)
    assert _lean_nodes(model(X)) == len(model.blocks)
    for name, p in [*ref.named_parameters(), *model.named_parameters()]:
        if ".up." in name:
            p.requires_grad_(False)  # frozen again: no gradient
    assert not any(".up." in n for n in _grads(model, X))


def test_methods_and_default() -> None:
    assert CHECKPOINT_METHODS == ("lean", "pytorch")
    model = make_model()
    enable_gradient_checkpointing(model)
    assert checkpoint_method(model.blocks[0]) == "lean"
    enable_gradient_checkpointing(model, method="pytorch")  # updates the blocks in place
    assert checkpoint_method(model.blocks[0]) == "pytorch"
    assert checkpoint_method(model.embed) == "lean"  # not checkpointed: the swapper's default
    with pytest.raises(ConfigError, match="method"):
        enable_gradient_checkpointing(model, method="reentrant")


@pytest.mark.parametrize("lora", [False, True])
def test_gradients_are_bit_identical(lora: bool) -> None:
    # Every step: the first (each block checked through PyTorch's checkpoint) and the lean ones.
    ref = make_model()
    model = copy.deepcopy(ref)
    if lora:
        _lora(ref), _lora(model)
    enable_gradient_checkpointing(model)
    for step in range(3):
        want, got = _grads(ref, X), _grads(model, X)
        assert got.keys() == want.keys() and got, step
        for name in want:
            assert torch.equal(got[name], want[name]), (step, name)
    out = model(X)
    assert _lean_nodes(out) == len(model.blocks)  # the steps after the first ran lean


def test_input_gradients_match_with_every_parameter_trainable() -> None:
    ref = make_model()
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    for _ in range(2):
        assert_identical(train_step(model, X), train_step(ref, X))


def test_forward_saves_only_the_inputs_and_records_no_block_graph() -> None:
    model = _lora(make_model())
    enable_gradient_checkpointing(model)
    model(X).sum().backward()  # the check, through PyTorch's checkpoint
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = model.embed(X)
        before = len(packed)
        block = model.blocks[1]
        out = block(h)
    assert len(packed) - before == 1 and packed[-1] == tuple(h.shape)  # the input alone
    assert type(out.grad_fn).__name__ == "_LeanFunctionBackward"
    # the block's ops are not in the graph: the node's edges go to its input and parameters
    edges = [type(n).__name__ for n, _ in out.grad_fn.next_functions if n is not None]
    assert edges.count("AccumulateGrad") == 2  # up.weight and up.bias


def test_first_block_without_grad_inputs_still_trains() -> None:
    # Nothing the first block takes requires grad: its parameters make its output require grad.
    ref = _lora(make_model())
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    for _ in range(2):
        got, want = _grads(model, X), _grads(ref, X)
        assert "blocks.0.up.weight" in got
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_autograd_grad_and_backward_inputs_see_the_parameters() -> None:
    ref = _lora(make_model())
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    _grads(model, X)  # the check
    params = [model.blocks[2].up.weight, model.blocks[0].up.bias]
    got = torch.autograd.grad(model(X).square().mean(), params)
    want = torch.autograd.grad(ref(X).square().mean(),
                               [ref.blocks[2].up.weight, ref.blocks[0].up.bias])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    only = _grads(model, X, inputs=[model.blocks[3].up.weight])
    assert list(only) == ["blocks.3.up.weight"]
    assert torch.equal(only["blocks.3.up.weight"], _grads(ref, X)["blocks.3.up.weight"])


def test_gradient_hooks_run_once_per_parameter() -> None:
    model = _lora(make_model())
    enable_gradient_checkpointing(model)
    _grads(model, X)
    seen: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, name=name: seen.append(name) or g)
    _grads(model, X)
    assert sorted(seen) == sorted(n for n, p in model.named_parameters() if p.requires_grad)


def test_dropout_replays_the_forward_rng() -> None:
    ref = make_model(dropout=0.3)
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    for seed in (1, 2, 3):
        assert_identical(train_step(model, X, seed=seed), train_step(ref, X, seed=seed))


def test_autocast_is_replayed_in_backward() -> None:
    ref = _lora(make_model())
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    for _ in range(2):
        grads = []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(X).float().square().mean()
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()
                          if p.grad is not None})
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[1])


class KwargsBlock(nn.Module):
    """Keyword tensors, a non-tensor argument, a tuple output with a view, an int tensor and a
    non-tensor leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, context: torch.Tensor, gate: float,
                ids: torch.Tensor) -> tuple[Any, ...]:
        joint = torch.cat([self.a(x), self.b(context)], dim=1) * gate
        return joint[:, :8], joint[:, 8:], ids + 1, "tag"


class KwargsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList(KwargsBlock() for _ in range(3))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(4)
        for block in self.blocks:
            x, context, ids, tag = block(x, context=context, gate=0.5, ids=ids)
            assert tag == "tag" and ids.dtype == torch.int64
            x += 1  # an output changed in place, as without checkpointing
        return x.square().mean() + context.square().mean()


def test_keyword_arguments_views_and_non_tensor_outputs() -> None:
    ref = KwargsModel()
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model, "blocks")
    ctx = torch.randn(4, 8)
    for _ in range(3):
        grads = []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
            m(x, ctx).backward()
            grads.append(({n: p.grad.clone() for n, p in m.named_parameters()}, x.grad))
        assert all(torch.equal(grads[0][0][n], grads[1][0][n]) for n in grads[1][0])
        assert torch.equal(grads[0][1], grads[1][1])


class Tied(nn.Module):
    """Reads a trainable weight it does not own (registered nowhere in it)."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.own = nn.Linear(16, 16)
        object.__setattr__(self, "shared", shared)  # not a submodule: not in parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(x) + self.shared(x)


def test_a_block_reading_a_foreign_trainable_tensor_keeps_pytorchs_checkpoint() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    ref = nn.Sequential(Tied(shared), Tied(shared))
    ref.add_module("holder", shared)
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model, ["0", "1"])
    for _ in range(3):
        assert_same_grads(_grads(model, X), _grads(ref, X))
    assert _lean_nodes(model(X)) == 0
    assert model[0].forward.lean.verdict is False


class _Subclass(torch.Tensor):
    """A tensor subclass, as DTensor is."""


def test_a_tensor_subclass_parameter_keeps_pytorchs_checkpoint() -> None:
    ref = _lora(make_model())
    model = copy.deepcopy(ref)
    up = model.blocks[1].up
    up.weight = nn.Parameter(up.weight.detach().as_subclass(_Subclass))
    enable_gradient_checkpointing(model)
    for _ in range(2):
        got, want = _grads(model, X), _grads(ref, X)
        assert all(torch.equal(got[n].as_subclass(torch.Tensor), want[n]) for n in want)
    assert model.blocks[1].forward.lean.verdict is False
    assert model.blocks[0].forward.lean.verdict is True


def test_double_backward_is_refused_with_a_hint() -> None:
    model = make_model()
    enable_gradient_checkpointing(model)
    _grads(model, X)
    x = X.clone().requires_grad_()
    loss = model(x).square().mean()
    with pytest.raises(OffloadError, match="create_graph") as info:
        torch.autograd.grad(loss, x, create_graph=True)
    assert "method='pytorch'" in info.value.hint
    disable_gradient_checkpointing(model)
    enable_gradient_checkpointing(model, method="pytorch")
    loss = model(x).square().mean()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    g.sum().backward()  # PyTorch's checkpoint supports it


def test_retain_graph_backward_twice() -> None:
    ref = _lora(make_model())
    model = copy.deepcopy(ref)
    enable_gradient_checkpointing(model)
    _grads(model, X)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        loss = m(X).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(),
                                                           strict=True) if q.grad is not None)


def test_state_survives_copy_and_pickle() -> None:
    model = _lora(make_model())
    enable_gradient_checkpointing(model)
    _grads(model, X)
    assert model.blocks[0].forward.lean.verdict is True
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.blocks[0].forward.lean.verdict is True
        assert all(torch.equal(a, b) for a, b in zip(_grads(clone, X).values(),
                                                     _grads(model, X).values(), strict=True))


def test_a_tensor_read_inside_and_outside_a_block_sums_in_another_order() -> None:
    # The lean backward adds up a block input's gradient inside the block before the outer
    # graph adds the other readers' share: equal to rounding (documented), where PyTorch's
    # checkpoint, whose nodes join the outer graph, keeps the un-checkpointed order.
    ref = Stack(lambda: ResidualMLP(16), 3, inp=(16, 16), names=("embed", "out"), seed=0,
                skip=True)
    want = _grads(ref, X)
    for method, exact in (("pytorch", True), ("lean", False)):
        model = copy.deepcopy(ref)
        enable_gradient_checkpointing(model, method=method)
        for _ in range(2):
            got = _grads(model, X)
        for name in want:
            if exact:
                assert torch.equal(got[name], want[name]), name
            else:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_cuda_lean_matches_under_autocast_and_dropout_and_saves_memory() -> None:
    reference = make_model(dim=1024, depth=6, dropout=0.1).cuda()
    peaks = {}
    for method in ("lean", "pytorch"):
        model = copy.deepcopy(reference)
        enable_gradient_checkpointing(model, method=method)
        x = torch.randn(256, 1024, device="cuda")
        for seed in (1, 2, 3):
            got, want = [], []
            for m, out in ((model, got), (reference, want)):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(x).float().square().mean()
                loss.backward()
                out.extend(p.grad.clone() for p in m.parameters())
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (method, seed)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        peaks[method] = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
    assert peaks["lean"] <= peaks["pytorch"] * 1.05, peaks
