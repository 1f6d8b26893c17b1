"""Flattening of block arguments/outputs (vramkit.offload._tree) and garbage-free swapped calls."""

from __future__ import annotations

import gc
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from tests._toys import ResidualLinear, Stack
from vramkit.offload import _tree
from vramkit.offload.swap import BlockSwapper, SwapConfig

Pair = namedtuple("Pair", "a b")


@dataclass
class Registered:
    x: torch.Tensor
    y: int


pytree.register_pytree_node(
    Registered, lambda r: ([r.x], r.y), lambda xs, y: Registered(xs[0], y),
    serialized_type_name="tests.offload.test_tree.Registered")


def test_round_trip_nested_containers() -> None:
    t1, t2, t3 = torch.ones(1), torch.zeros(2), torch.arange(3)
    obj = ((t1, [t2, None, 3]), {"k": Pair(t3, "s"), "r": Registered(t1, 7)})
    leaves, spec = _tree.flatten(obj)
    assert all(a is b for a, b in zip(leaves, [t1, t2, None, 3, t3, "s", t1], strict=True))
    rebuilt = _tree.unflatten(leaves, spec)
    assert rebuilt[0][0] is t1 and rebuilt[0][1] == [t2, None, 3]
    assert isinstance(rebuilt[1]["k"], Pair) and rebuilt[1]["k"].a is t3
    assert isinstance(rebuilt[1]["r"], Registered) and rebuilt[1]["r"].y == 7
    assert list(rebuilt[1]) == ["k", "r"]  # dict order kept


def test_leaf_count_mismatch_is_an_error() -> None:
    leaves, spec = _tree.flatten((torch.ones(1), torch.ones(1)))
    with pytest.raises(ValueError, match="fewer"):
        _tree.unflatten(leaves[:1], spec)
    with pytest.raises(ValueError, match="more"):
        _tree.unflatten([*leaves, 1], spec)


def _cyclic_garbage_of_calls(call: Any, leaves: list[torch.Tensor],
                             times: int = 100) -> list[Any]:
    """What the collector finds of ``call``'s making after ``times`` calls with the collector
    off: vramkit's objects and functions (a closure that refers to itself), pytree's, and
    containers holding ``leaves``. Garbage other threads leave meanwhile (the suite's background
    workers) is not counted: a bare ``gc.collect() == 0`` failed on it under load."""
    import inspect

    ids = {id(t) for t in leaves}
    gc.collect()
    gc.disable()
    try:
        for _ in range(times):
            call()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        mine = []
        for o in gc.garbage:
            items = list(o.values()) if isinstance(o, dict) else (
                list(o) if isinstance(o, (list, tuple)) else [])
            module = (o.__module__ if inspect.isfunction(o) else type(o).__module__) or ""
            if (module.startswith(("vramkit", "torch.utils._pytree"))
                    or any(id(x) in ids for x in items)):
                mine.append(o)
        return mine
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_flatten_makes_no_reference_cycles() -> None:
    leaves = [torch.ones(1), torch.ones(1), torch.ones(1)]
    obj = ((leaves[0], [leaves[1]]), {"a": leaves[2]})
    assert _cyclic_garbage_of_calls(lambda: _tree.unflatten(*_tree.flatten(obj)), leaves) == []
    # the check sees a cycle when there is one (a container that holds itself and a leaf)

    def cyclic() -> None:
        box: list[Any] = [leaves[0]]
        box.append(box)

    assert _cyclic_garbage_of_calls(cyclic, leaves)


def test_swapped_training_step_leaves_no_cyclic_garbage() -> None:
    """Cyclic garbage per call made the collector run every step (host time on the hot path)."""
    model = Stack(lambda: ResidualLinear(32), 6)
    model.requires_grad_(False)
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=0, min_param_bytes=0,
                                                    checkpointing=False), device="cpu")
    x = torch.randn(2, 32, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    try:
        assert _cyclic_garbage_of_calls(lambda: model(x).sum().backward(), [x], times=5) == []
    finally:
        swapper.detach()
