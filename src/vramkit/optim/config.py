"""One config for low-memory training: the optimizer and gradient accumulation in a chosen dtype.

:class:`Int8TrainingConfig` (the seed's ``Int8TrainingConfig { use_8bit_adam,
gradient_accumulation_dtype }``) is a frozen, validated dataclass. One verb applies it:
:func:`setup_int8_training` returns an :class:`Int8Training` holding

* the optimizer: :class:`~vramkit.optim.adamw8bit.AdamW8bit` (``use_8bit_adam=True``) or
  ``torch.optim.AdamW``;
* gradient accumulation in ``gradient_accumulation_dtype``: for parameters of another dtype
  (e.g. bf16 weights with fp32 accumulation, the usual choice when training in bf16), a
  ``post_accumulate_grad`` hook adds each backward's gradient into a buffer of that dtype and
  frees ``.grad`` at once, so micro-batch gradients are summed without bf16 rounding at each
  addition. Parameters already of that dtype accumulate natively in ``.grad`` (no hook, no copy);
* ``gradient_accumulation_steps``: :meth:`Int8Training.backward` scales the loss by
  ``1 / steps`` and :meth:`Int8Training.step` updates once every ``steps`` calls, so the update
  uses the mean gradient over the micro-batches.

Example (the seed's "Flux on 24 GB": bf16 weights, 8-bit Adam, fp32 accumulation)::

    config = Int8TrainingConfig(use_8bit_adam=True, gradient_accumulation_dtype="fp32",
                                gradient_accumulation_steps=4)
    training = setup_int8_training(model, config, lr=1e-4)
    for batch in loader:
        training.backward(loss_fn(model, batch))
        training.step()  # updates on every 4th call
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_choice, check_int, check_known_fields
from vramkit.errors import ConfigError
from vramkit.optim.adamw8bit import AdamW8bit, _check_state_settings

__all__ = ["Int8Training", "Int8TrainingConfig", "setup_int8_training"]

logger = logging.getLogger(__name__)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
_CANONICAL: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                      torch.float16: "float16"}
_ADAM8_DEFAULTS = {"state_bits": 8, "block_size": 256, "min_8bit_size": 4096}


@dataclass(frozen=True)
class Int8TrainingConfig:
    """Low-memory training settings: 8-bit AdamW and gradient accumulation dtype and steps.

    Attributes:
        use_8bit_adam: use :class:`~vramkit.optim.adamw8bit.AdamW8bit` (default ``True``);
            ``False`` uses ``torch.optim.AdamW`` (8 bytes of state per parameter).
        gradient_accumulation_dtype: dtype gradients are summed in across backward passes:
            ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` (or ``"float32"`` ..., or a
            ``torch.dtype``). Stored as its canonical name (``"float32"`` ...).
        gradient_accumulation_steps: micro-batches per optimizer update (default 1).
        state_bits: bits per stored moment value of AdamW8bit, 8 (default) or 4.
        block_size: AdamW8bit quantization block size (default 256).
        min_8bit_size: AdamW8bit keeps fp32 states for smaller tensors (default 4096).

    Raises:
        ConfigError: for an invalid value, or AdamW8bit settings given with
            ``use_8bit_adam=False`` (they would be ignored).
    """

    use_8bit_adam: bool = True
    gradient_accumulation_dtype: torch.dtype | str = "fp32"
    gradient_accumulation_steps: int = 1
    state_bits: int = 8
    block_size: int = 256
    min_8bit_size: int = 4096

    def __post_init__(self) -> None:
        check_bool("Int8TrainingConfig.use_8bit_adam", self.use_8bit_adam)
        dtype = self.gradient_accumulation_dtype
        # A name (any case) or a torch.dtype; stored as its canonical name.
        key = dtype.lower() if isinstance(dtype, str) else dtype
        check_choice("Int8TrainingConfig.gradient_accumulation_dtype", key,
                     (*_DTYPE_NAMES, *_CANONICAL))
        resolved = _DTYPE_NAMES[key] if isinstance(key, str) else key
        object.__setattr__(self, "gradient_accumulation_dtype", _CANONICAL[resolved])
        check_int("Int8TrainingConfig.gradient_accumulation_steps",
                  self.gradient_accumulation_steps, minimum=1)
        if self.use_8bit_adam:
            _check_state_settings(self.block_size, self.min_8bit_size, self.state_bits,
                                  prefix="Int8TrainingConfig.")
        else:
            changed = [name for name, default in _ADAM8_DEFAULTS.items()
                       if getattr(self, name) != default]
            if changed:
                raise ConfigError(f"{', '.join(changed)} only apply with use_8bit_adam=True",
                                  hint="Drop them, or set use_8bit_adam=True.")

    @property
    def accumulation_dtype(self) -> torch.dtype:
        """``gradient_accumulation_dtype`` as a ``torch.dtype``."""
        return _DTYPE_NAMES[str(self.gradient_accumulation_dtype)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (the dtype as its canonical name)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Int8TrainingConfig:
        """Rebuild from :meth:`to_dict` output.

        Raises:
            ConfigError: for unknown keys or invalid values.
        """
        return cls(**check_known_fields(cls, data))

    def create_optimizer(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *,
                         lr: float = 1e-3, **optimizer_kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer alone: AdamW8bit (with this config's state settings) or torch AdamW.

        Args:
            params: parameters or parameter groups.
            lr: learning rate (default ``1e-3``).
            **optimizer_kwargs: other hyperparameters (``betas``, ``eps``, ``weight_decay``; for
                torch AdamW also ``fused``/``foreach``).

        Returns:
            The optimizer.

        Raises:
            ConfigError: for invalid hyperparameters.
        """
        if self.use_8bit_adam:
            return AdamW8bit(params, lr=lr, state_bits=self.state_bits,
                             block_size=self.block_size, min_8bit_size=self.min_8bit_size,
                             **optimizer_kwargs)
        try:
            return torch.optim.AdamW(params, lr=lr, **optimizer_kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid torch.optim.AdamW arguments: {exc}",
                              hint="Check the extra keyword arguments passed through to "
                                   "torch.optim.AdamW (betas, eps, weight_decay, ...).") from exc


class Int8Training:
    """An applied :class:`Int8TrainingConfig`: the optimizer plus gradient accumulation.

    Build it with :func:`setup_int8_training`. Call :meth:`backward` once per micro-batch and
    :meth:`step` after each; the optimizer updates on every ``gradient_accumulation_steps``-th
    :meth:`step`. Do not call ``optimizer.step()`` directly while accumulation hooks are active:
    gradients of hooked parameters live in the accumulation buffers, not in ``.grad``.

    Args:
        params: the parameters to train (those with ``requires_grad``).
        config: the settings.
        optimizer: the optimizer over ``params``.
    """

    def __init__(self, params: list[torch.Tensor], config: Int8TrainingConfig,
                 optimizer: torch.optim.Optimizer) -> None:
        self.config = config
        self.optimizer = optimizer
        self._params = params
        self._dtype = config.accumulation_dtype
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._filled: set[torch.Tensor] = set()
        self._hooks: list[Any] = []
        self._micro_steps = 0
        self._updates = 0
        for param in params:
            if param.dtype != self._dtype:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulate))

    @property
    def hooked_params(self) -> int:
        """Parameters whose gradients are accumulated in a buffer of the accumulation dtype."""
        return len(self._hooks)

    @property
    def micro_steps(self) -> int:
        """Micro-batches accumulated since the last update."""
        return self._micro_steps

    @property
    def updates(self) -> int:
        """Optimizer updates made so far."""
        return self._updates

    def accumulation_buffer_bytes(self) -> int:
        """Bytes of the accumulation buffers (allocated at the first backward)."""
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def accumulated_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient summed so far for ``param`` (its buffer, or ``param.grad``)."""
        if param in self._filled:
            return self._buffers[param]
        return param.grad

    @torch.no_grad()
    def _accumulate(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        buffer = self._buffers.get(param)
        if buffer is None:
            buffer = torch.empty_like(grad, dtype=self._dtype, memory_format=torch.contiguous_format)
            self._buffers[param] = buffer
        if param in self._filled:
            buffer.add_(grad)  # in the accumulation dtype (the bf16 gradient is widened exactly)
        else:
            buffer.copy_(grad)
            self._filled.add(param)
        param.grad = None  # the buffer holds it now; do not keep both

    def backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (the update sees the mean).

        Args:
            loss: a scalar loss.
            **backward_kwargs: passed to ``Tensor.backward`` (e.g. ``retain_graph``).
        """
        steps = self.config.gradient_accumulation_steps
        (loss / steps if steps > 1 else loss).backward(**backward_kwargs)

    def step(self) -> bool:
        """Count one micro-batch; on every ``gradient_accumulation_steps``-th call, update the
        parameters with the accumulated gradients and clear them.

        Returns:
            ``True`` when the optimizer stepped.
        """
        self._micro_steps += 1
        if self._micro_steps < self.config.gradient_accumulation_steps:
            return False
        filled = {param: self._buffers[param] for param in self._params if param in self._filled}
        if isinstance(self.optimizer, AdamW8bit):
            self.optimizer.step(gradients=filled)  # any dtype: no cast, no copy
        else:
            for param, buffer in filled.items():
                param.grad = buffer.to(param.dtype)  # one rounding, after the summation
            self.optimizer.step()
        self.zero_grad()
        self._updates += 1
        return True

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (``.grad`` and buffers) and restart the count."""
        self.optimizer.zero_grad(set_to_none=True)
        for param in self._params:
            param.grad = None
        self._filled.clear()
        self._micro_steps = 0

    def close(self) -> None:
        """Remove the accumulation hooks and free the buffers (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._buffers.clear()
        self._filled.clear()


def setup_int8_training(model_or_params: nn.Module | Iterable[torch.Tensor],
                        config: Int8TrainingConfig | None = None, *, lr: float = 1e-3,
                        **optimizer_kwargs: Any) -> Int8Training:
    """Apply ``config``: build the optimizer and the gradient accumulation it asks for.

    Args:
        model_or_params: a module (its parameters with ``requires_grad``) or parameters.
        config: the settings (default ``Int8TrainingConfig()``: AdamW8bit, fp32 accumulation).
        lr: learning rate (default ``1e-3``).
        **optimizer_kwargs: other optimizer hyperparameters (see
            :meth:`Int8TrainingConfig.create_optimizer`).

    Returns:
        The :class:`Int8Training`.

    Raises:
        ConfigError: for no trainable parameters or invalid hyperparameters.
    """
    config = config if config is not None else Int8TrainingConfig()
    if isinstance(model_or_params, nn.Module):
        params = [p for p in model_or_params.parameters() if p.requires_grad]
    elif isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    else:
        params = [p for p in model_or_params if p.requires_grad]
    if not params:
        raise ConfigError("no trainable parameters (none has requires_grad=True)",
                          hint="Unfreeze the parameters to train, e.g. LoRA adapters.")
    optimizer = config.create_optimizer(params, lr=lr, **optimizer_kwargs)
    logger.debug("int8 training: %s, %d params accumulate in %s", type(optimizer).__name__,
                 len(params), config.gradient_accumulation_dtype)
    return Int8Training(params, config, optimizer)
