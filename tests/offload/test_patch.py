"""vramkit.offload._patch: the one way vramkit wraps a module's method."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from vramkit.offload import _patch
from vramkit.offload.checkpointing import enable_gradient_checkpointing, is_checkpointed
from vramkit.offload.cpu import CPUOffloadConfig, CPUOffloadManager


class Scale(_patch.MethodWrapper):
    """Multiplies what the wrapped method returns (picklable: no live references)."""

    __slots__ = ("factor",)
    kind = "scale"

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        return out * self.factor if self.active else out


class Shift(_patch.MethodWrapper):
    __slots__ = ()
    kind = "shift"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        return out + 1 if self.active else out


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


X = torch.ones(2, 4)


def test_install_on_top_and_restore_gives_the_class_method_back() -> None:
    layer = _linear()
    plain = layer(X)
    wrapper = _patch.install(layer, Scale(2.0))
    assert layer.__dict__["forward"] is wrapper
    assert torch.equal(layer(X), plain * 2)
    assert _patch.restore(layer, wrapper)
    assert "forward" not in layer.__dict__ and "_vramkit_wrappers" not in layer.__dict__
    assert layer.forward.__func__ is nn.Linear.forward
    assert torch.equal(layer(X), plain)


def test_restore_gives_back_an_instance_attribute() -> None:
    layer = _linear()
    original = layer.forward

    def own(x: torch.Tensor) -> torch.Tensor:
        return original(x) - 1

    layer.forward = own
    wrapper = _patch.install(layer, Scale(3.0))
    assert torch.equal(layer(X), (original(X) - 1) * 3)
    _patch.restore(layer, wrapper)
    assert layer.__dict__["forward"] is own


def test_wrappers_stack_and_the_lower_one_can_leave_first() -> None:
    layer = _linear()
    plain = layer(X)
    scale = _patch.install(layer, Scale(2.0))
    shift = _patch.install(layer, Shift())
    assert torch.equal(layer(X), plain * 2 + 1)
    assert _patch.wrappers(layer) == [scale, shift]
    assert _patch.restore(layer, scale)  # beneath a vramkit wrapper: spliced out
    assert shift.inner is not scale
    assert torch.equal(layer(X), plain + 1)
    _patch.restore(layer, shift)
    assert "forward" not in layer.__dict__
    assert torch.equal(layer(X), plain)


def test_a_foreign_patch_on_top_is_kept_and_the_wrapper_switched_off() -> None:
    layer = _linear()
    plain = layer(X)
    wrapper = _patch.install(layer, Scale(2.0))
    below = layer.forward

    def foreign(x: torch.Tensor) -> torch.Tensor:
        return below(x) + 10

    layer.forward = foreign
    assert torch.equal(layer(X), plain * 2 + 10)
    assert not _patch.restore(layer, wrapper)
    assert layer.__dict__["forward"] is foreign and not wrapper.active
    assert torch.equal(layer(X), plain + 10)
    assert _patch.find(layer, "scale") is None


def test_find_and_unwrap() -> None:
    layer = _linear()
    scale = _patch.install(layer, Scale(2.0))
    shift = _patch.install(layer, Shift())
    assert _patch.find(layer, "scale") is scale and _patch.find(layer, "shift") is shift
    assert _patch.find(layer, "scale", name="decode") is None
    assert _patch.unwrap(layer, ("shift",)) is scale
    bound = _patch.unwrap(layer, ("shift", "scale"))
    assert bound.__func__ is nn.Linear.forward  # type: ignore[attr-defined]


def test_restore_all_takes_one_kind_out_of_every_module() -> None:
    model = nn.Sequential(_linear(), _linear(), _linear())
    for layer in model[:2]:
        _patch.install(layer, Scale(2.0))
    shift = _patch.install(model[1], Shift())
    assert _patch.restore_all(model, "scale") == ["0", "1"]
    assert all(_patch.find(layer, "scale") is None for layer in model)
    assert _patch.find(model[1], "shift") is shift  # other kinds stay
    assert _patch.restore_all(model, "scale") == []
    assert "forward" not in model[0].__dict__  # the class method is back


def test_other_method_names() -> None:
    class Codec(nn.Module):
        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return z * 0.5

    codec = Codec()
    wrapper = _patch.install(codec, Scale(4.0), name="decode")
    assert torch.equal(codec.decode(X), X * 2)
    assert _patch.wrappers(codec) == [] and _patch.wrappers(codec, "decode") == [wrapper]
    _patch.restore(codec, wrapper)
    assert torch.equal(codec.decode(X), X * 0.5)


def test_misuse_raises() -> None:
    layer = _linear()
    wrapper = _patch.install(layer, Scale(2.0))
    with pytest.raises(ValueError, match="installed already"):
        _patch.install(_linear(), wrapper)
    with pytest.raises(ValueError, match="not installed"):
        _patch.restore(_linear(), wrapper)
    with pytest.raises(RuntimeError, match="never installed"):
        Scale(1.0)(X)


def test_copies_and_pickles_call_their_own_module() -> None:
    layer = _linear()
    _patch.install(layer, Scale(2.0))
    clone = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(layer))
    with torch.no_grad():
        layer.weight.zero_()
    for other in (clone, loaded, unpickled):
        assert torch.equal(other(X), _linear()(X) * 2)
        wrapper = _patch.find(other, "scale")
        assert wrapper is not None and wrapper.inner.__self__ is other  # type: ignore[attr-defined]
        _patch.restore(other, wrapper)
        assert "forward" not in other.__dict__


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


def test_cpu_offload_composes_with_checkpointing_in_either_order() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(*[_Block() for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    expected = reference(x).square().sum()
    expected.backward()
    expected_grads = [p.grad.clone() for p in reference.parameters()]  # type: ignore[union-attr]
    for checkpoint_first in (True, False):
        model = copy.deepcopy(reference)
        model.zero_grad()
        manager = CPUOffloadManager("cpu", config=CPUOffloadConfig(auto_load=True))
        if checkpoint_first:
            enable_gradient_checkpointing(model, blocks=["0", "1", "2"])
        manager.offload_weights(model)
        if not checkpoint_first:
            enable_gradient_checkpointing(model, blocks=["0", "1", "2"])
        assert all(is_checkpointed(b) for b in model)
        x.grad = None
        loss = model(x).square().sum()
        loss.backward()
        assert torch.equal(loss, expected)
        manager.restore()
        assert all(_patch.find(m, "cpu_offload") is None for m in model.modules())
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.allclose(g, e)
                   for g, e in zip(grads, expected_grads, strict=True))
