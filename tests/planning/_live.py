"""The most bytes of tensors alive at once while a real step runs on the CPU: what the
activation estimate predicts, measured by following every tensor an op makes (with the
estimate's own weak-reference follower, :class:`vramkit.planning._following.LiveStorages`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramkit.planning._following import LiveStorages, flat_tensors, storage_key


class LivePeak(TorchDispatchMode):
    """Follows the storages of the tensors ops return (not those of ``existing`` tensors: the
    weights, the inputs) until their last tensor dies, recording each storage's birth and
    death (:meth:`peak_without`)."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.skip = {storage_key(t) for t in existing}
        self.events: list[tuple[int, int]] = []  # (storage id, +/- bytes)
        self.live = LiveStorages(lambda ident, change: self.events.append((ident, change)))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in flat_tensors((out,), {}):
            key = storage_key(t)
            if t.device.type == "cpu" and key not in self.skip:
                self.live.follow(t, key)
        return out

    def peak_without(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """The most bytes alive at once, leaving out the storages of ``tensors`` that are
        alive now (the parameters' gradients: the planner counts them with the trainable
        state)."""
        left_out = {self.live.ident(storage_key(t)) for t in tensors if t is not None}
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
