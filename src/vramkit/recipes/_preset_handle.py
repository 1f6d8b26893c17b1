"""The handle :func:`vramkit.recipes.presets.optimize_sdxl_memory` and
:func:`~vramkit.recipes.presets.optimize_flux_memory` return: what was applied, and its undo."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from vramkit.errors import ConfigError

logger = logging.getLogger("vramkit.recipes.presets")


class MemoryOptimization:
    """What :func:`optimize_sdxl_memory` / :func:`optimize_flux_memory` applied.

    Attributes:
        applied: option name -> what was done, in application order.
        swapper: the :class:`~vramkit.offload.swap.BlockSwapper`, when blocks are offloaded.
        vae_tiling: the VAE tiling handle (``.detach()``), when tiling is on.
        optimizer: the optimizer built for the trainable parameters (Flux), else ``None``.
        recovery: the :class:`~vramkit.observe.recovery.MemoryRecovery` that runs training steps
            at the configured micro-batch size (Flux), else ``None``.
        autocast_dtype: the autocast dtype of :meth:`autocast` (``None``: autocast off).
        device: the compute device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.applied: dict[str, str] = {}
        self.swapper: Any = None
        self.vae_tiling: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.recovery: Any = None
        self.autocast_dtype: torch.dtype | None = None
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def _record(self, option: str, what: str, undo: Callable[[], None] | None = None) -> None:
        self.applied[option] = what
        if undo is not None:
            self._undo.append((option, undo))
        logger.info("%s: %s", option, what)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A ``torch.autocast`` context for the forward pass (a no-op without mixed precision)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_step(self, step_fn: Callable[..., Any], batch: Any) -> Any:
        """One optimizer step: micro-batched forward/backward under autocast, then ``step()``.

        Args:
            step_fn: ``step_fn(micro_batch) -> mean loss`` (see
                :class:`~vramkit.observe.recovery.MemoryRecovery`).
            batch: the batch; split into ``batch_size``-row micro-batches, smaller on OOM.

        Returns:
            The :class:`~vramkit.observe.recovery.RecoveryResult`.

        Raises:
            ConfigError: when nothing is trainable (no optimizer was built).
        """
        if self.optimizer is None or self.recovery is None:
            raise ConfigError("train_step needs trainable parameters: the model had none",
                              hint="Add LoRA adapters (model.add_adapter) or unfreeze weights "
                                   "before optimize_flux_memory.")
        with self.autocast():
            result = self.recovery.step(step_fn, batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def undo(self) -> list[str]:
        """Undo what can be undone, newest first: swapping, VAE tiling, attention slicing,
        checkpointing, the optimizer's host resources. Dtype casts and quantization stay (the
        original weights are gone; reload them to start over).

        Returns:
            The options undone.
        """
        done = []
        while self._undo:
            option, undo = self._undo.pop()
            undo()
            self.applied.pop(option, None)
            done.append(option)
        return done

    def __enter__(self) -> MemoryOptimization:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"MemoryOptimization({', '.join(self.applied) or 'nothing'})"
