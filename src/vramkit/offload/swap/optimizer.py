"""The swapped blocks' optimizers seen as one ``torch.optim.Optimizer`` (``trainable="swap"``).

:class:`SwappedOptimizer` is ``swapper.optimizer``: LR schedulers and checkpoints see it like
any optimizer, while the steps themselves run inside backward
(:class:`~vramkit.offload.swap.stepper.SwapStepper`) or, when clipping defers them, in
:func:`run_pending_steps`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from vramkit.errors import ConfigError
from vramkit.offload.swap.ring import SlotRing
from vramkit.offload.swap.stepper import SwapStepper

__all__ = ["SwappedOptimizer", "run_pending_steps"]


def run_pending_steps(stepper: SwapStepper, ring: SlotRing) -> None:
    """The deferred steps (clipping): blocks in backward order, each acquired (weights), its
    state and parked gradients loaded, stepped and written back; the ring prefetches the next
    ones meanwhile."""
    pending = {id(bo.block): bo for bo in stepper.pending()}
    if not pending:
        return
    for block in reversed(ring.order):
        bo = pending.get(id(block))
        if bo is None:
            continue
        ring.acquire(block, backward=True)
        try:
            stepper.step_pending_block(bo)
        finally:
            ring.release(block, backward=True)
    stepper.finish_pending()


class SwappedOptimizer(torch.optim.Optimizer):
    """The swapped blocks' optimizers seen as one (``swapper.optimizer``).

    ``param_groups`` lists every block optimizer's groups (the same dicts), so an LR scheduler
    built over this object (``LambdaLR(swapper.optimizer, ...)``) sets every block's learning
    rate. ``step()`` runs the deferred steps of clipping mode (``SwapConfig.max_grad_norm``) and
    otherwise has nothing left to do: the blocks stepped inside backward. Call it where you call
    your resident optimizer's ``step()``. ``state_dict()``/``load_state_dict()`` go through the
    host masters (the device never holds the whole state). ``zero_grad()`` forgets gradients
    accumulated on the host.
    """

    def __init__(self, stepper: SwapStepper, run_pending: Callable[[], None]) -> None:
        # The base initializer would register the parameters as one new group; the groups here
        # are the block optimizers' own.
        self._stepper = stepper
        # Weak: the swapper holds this object; a strong reference back would keep a dropped
        # swapper (its pinned memory, its global hooks) alive until the garbage collector runs.
        self._run_pending_ref = weakref.WeakMethod(run_pending)  # type: ignore[arg-type]
        first = next(iter(stepper.by_block.values()), None)
        self.defaults = dict(first.optimizer.defaults) if first is not None else {}
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = {}
        self._optimizer_state_dict_post_hooks: dict[int, Any] = {}
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = {}
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = {}

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for bo in self._stepper.by_block.values()
                for group in bo.optimizer.param_groups]

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, Any]:
        """Per parameter state of every block optimizer (between steps, state tensors that
        travel hold placeholders; :meth:`state_dict` has their values)."""
        out: dict[torch.Tensor, Any] = {}
        for bo in self._stepper.by_block.values():
            out.update(bo.optimizer.state)
        return out

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """``{block name: its optimizer}``."""
        return {bo.block.name: bo.optimizer for bo in self._stepper.by_block.values()}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run deferred block steps (clipping mode); with in-backward steps there is nothing
        left. ``closure`` is not supported (the steps depend on the backward pass)."""
        if closure is not None:
            raise ConfigError("swapper.optimizer.step() takes no closure",
                              hint="Run forward and backward yourself, then call step().")
        run = self._run_pending_ref()
        if run is not None:
            run()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget gradients accumulated on the host and a deferred step not taken (gradients of
        swapped blocks never stay on the device: they are dropped after each step).
        ``set_to_none`` is there for the ``Optimizer`` signature: forgotten and zeroed parked
        gradients accumulate the same, so both values do the same."""
        for bo in self._stepper.by_block.values():
            bo.host_grads = [False] * len(bo.params)
            bo.micro_steps = 0
            bo.norms = {}
            bo.step_pending = False
            for p in bo.params:
                p.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("swapper.optimizer holds the swapped blocks' optimizers; it takes no "
                          "new parameter groups",
                          hint="Give other parameters to your own optimizer "
                               "(swapper.optimizer_parameters()).")

    def state_dict(self) -> dict[str, Any]:
        """``{"blocks": {block name: that block optimizer's state_dict()}}``; state tensors
        are views of the host masters (save them before the next step, as with any
        optimizer's state_dict)."""
        stepper = self._stepper
        blocks = {}
        with stepper.host_state():
            for bo in stepper.by_block.values():
                sd = bo.optimizer.state_dict()
                # torch's state_dict shares each parameter's state dict: copy it, or the
                # placeholders put back after this would show through.
                sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
                blocks[bo.block.name] = sd
        return {"blocks": blocks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (for the same model and settings)."""
        blocks = state_dict.get("blocks") if isinstance(state_dict, dict) else None
        if not isinstance(blocks, dict):
            raise ConfigError("not a state dict of swapper.optimizer (no 'blocks' entry)",
                              hint="Load what swapper.optimizer.state_dict() returned.")
        by_name = {bo.block.name: bo for bo in self._stepper.by_block.values()}
        if set(blocks) != set(by_name):
            missing = sorted(set(by_name) - set(blocks))[:3]
            extra = sorted(set(blocks) - set(by_name))[:3]
            raise ConfigError(
                f"the state dict's blocks do not match the swapped blocks (missing {missing}, "
                f"unexpected {extra})",
                hint="Swap the same blocks as when the state was saved (the same "
                     "SwapConfig or swapped_blocks).")
        for name, bo in by_name.items():
            self._stepper.load_block_state(bo, blocks[name])

    def __repr__(self) -> str:
        n = len(self._stepper.by_block)
        kind = next((type(bo.optimizer).__name__ for bo in self._stepper.by_block.values()),
                    "none")
        return f"SwappedOptimizer({n} block optimizers, {kind})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("swapper.optimizer cannot be pickled; save its state_dict()")
