"""The most bytes of tensors alive at once while a real step runs on the CPU: what the
activation estimate predicts, measured by following every tensor an op makes."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # type: ignore[no-any-return]


class LivePeak(TorchDispatchMode):
    """Follows the storages of the tensors ops return (not those of ``existing`` tensors: the
    weights, the inputs) until their last tensor dies; ``peak`` is the most bytes alive at
    once. Storages that are still alive as gradients of ``grads_of`` at the end can be left
    out (:meth:`peak_without`)."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.skip = {_key(t) for t in existing}
        self.live: dict[int, list[int]] = {}  # key -> [tensors alive, bytes, id]
        self.refs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.events: list[tuple[int, int]] = []  # (storage id, +/- bytes)
        self._ids = 0

    def _dropped(self, ref: weakref.ref[torch.Tensor]) -> None:
        held = self.refs.pop(id(ref), None)
        if held is None:
            return
        entry = self.live.get(held[1])
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[held[1]]
            self.events.append((entry[2], -entry[1]))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            key = _key(t)
            if key in self.skip:
                continue
            entry = self.live.get(key)
            if entry is None:
                self._ids += 1
                entry = self.live[key] = [0, t.untyped_storage().nbytes(), self._ids]
                self.events.append((entry[2], entry[1]))
            entry[0] += 1
            ref = weakref.ref(t, self._dropped)
            self.refs[id(ref)] = (ref, key)
        return out

    def peak_without(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """The peak, leaving out the storages of ``tensors`` that are alive now (the
        parameters' gradients: the planner counts them with the trainable state)."""
        left_out = {self.live[k][2] for k in (_key(t) for t in tensors if t is not None)
                    if k in self.live}
        alive = peak = 0
        for ident, change in self.events:
            if ident not in left_out:
                alive += change
                peak = max(peak, alive)
        return peak


def live_peak(step: Callable[[], torch.Tensor], existing: Iterable[torch.Tensor],
              params: Iterable[torch.nn.Parameter]) -> int:
    """The live peak of ``step()`` and its backward, the parameters' gradients left out."""
    params = list(params)
    mode = LivePeak(existing)
    with mode:
        loss = step()
        loss.backward()
        del loss
    return mode.peak_without(p.grad for p in params)
