"""peft LoRA adapters on a model built on the meta device, filled from a base checkpoint.

``get_peft_model`` on a meta model renames each wrapped layer's weights (``to_q.weight`` becomes
``to_q.base_layer.weight``) and adds adapter tensors (``to_q.lora_A.default.weight``) that a base
checkpoint does not hold. Two things make such a model loadable:

* :func:`peft_base_key`: a checkpoint key without ``.base_layer.`` fills the module key with it
  when the module has no key of that name (the loader's key matching, :class:`ModuleFiller`);
* :func:`init_meta_adapters`: after loading, adapters still on meta are created on the weights'
  device and initialized peft's own way for the adapter's ``init_lora_weights`` (``True``:
  A Kaiming-uniform, B zero; ``"gaussian"``: A normal with std 1/r, B zero; ``False``: both as
  ``nn.Linear`` initializes them). Initializations that read the base weights (PiSSA, OLoRA,
  LoftQ, EVA, CorDA, DoRA's magnitude) are refused with the way out: add the adapters after
  loading. The values are peft's scheme, not the same random draws as a model built on the CPU.

Nothing here imports peft: a model holds peft layers only when peft is already imported.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from vramkit.errors import ConfigError

__all__ = ["adapter_keys", "base_layer_of", "init_meta_adapters", "peft_base_key"]

_BASE = ".base_layer."
_PLAIN_INITS = (True, False, "gaussian")


def peft_base_key(key: str) -> str:
    """The checkpoint key of a peft-renamed module key (``a.base_layer.weight`` ->
    ``a.weight``); other keys come back unchanged."""
    return key.replace(_BASE, ".")


def _lora_layer_type() -> type | None:
    """peft's ``LoraLayer``, where peft is imported already (else no module can be one)."""
    peft = sys.modules.get("peft.tuners.lora.layer") or sys.modules.get("peft.tuners.lora")
    return getattr(peft, "LoraLayer", None) if peft is not None else None


def _lora_layers(module: nn.Module) -> list[tuple[str, Any]]:
    layer_type = _lora_layer_type()
    if layer_type is None:
        return []
    return [(name, m) for name, m in module.named_modules() if isinstance(m, layer_type)]


def base_layer_of(module: nn.Module, owner: str) -> tuple[str, Any]:
    """The layer at ``owner`` in ``module`` and its path, or, where peft's LoRA wraps it, the
    wrapped layer and ``<owner>.base_layer`` (``None`` and ``owner`` for no such module)."""
    try:
        layer = module.get_submodule(owner) if owner else module
    except AttributeError:
        return owner, None
    layer_type = _lora_layer_type()
    if layer_type is not None and isinstance(layer, layer_type):
        return f"{owner}{_BASE[:-1]}" if owner else _BASE[1:-1], layer.base_layer
    return owner, layer


def _adapter_modules(layer: Any) -> list[tuple[str, str, nn.Module | nn.Parameter]]:
    """(attribute, adapter name, module or parameter) of a LoraLayer's adapter tensors."""
    out: list[tuple[str, str, Any]] = []
    for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                 "lora_magnitude_vector"):
        holder = getattr(layer, attr, None)
        if holder is None:
            continue
        for adapter, value in holder.items():
            out.append((attr, adapter, value))
    return out


def adapter_keys(module: nn.Module) -> set[str]:
    """State-dict keys of peft adapter tensors in ``module`` (empty without peft layers)."""
    keys: set[str] = set()
    for name, layer in _lora_layers(module):
        prefix = f"{name}." if name else ""
        for attr, adapter, value in _adapter_modules(layer):
            if isinstance(value, nn.Module):
                keys.update(f"{prefix}{attr}.{adapter}.{k}" for k in value.state_dict())
            else:
                keys.add(f"{prefix}{attr}.{adapter}")
    return keys


def _init_type(root: nn.Module, adapter: str) -> Any:
    for owner in (root, *root.modules()):
        configs = getattr(owner, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return getattr(configs[adapter], "init_lora_weights", True)
    return True


def init_meta_adapters(module: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Create and initialize (peft's way) the adapter tensors of ``module`` still on meta.

    Args:
        module: a model that may hold peft LoRA layers.
        device: where the adapters go (the loaded weights' device).

    Returns:
        The tensors created (parameters of the adapters).

    Raises:
        ConfigError: an adapter whose initialization needs the base weights (PiSSA, OLoRA,
            LoftQ, EVA, CorDA; DoRA's magnitude vector).
    """
    created: list[torch.Tensor] = []
    for name, layer in _lora_layers(module):
        todo = [(attr, adapter, value) for attr, adapter, value in _adapter_modules(layer)
                if any(t.is_meta for t in (value.parameters() if isinstance(value, nn.Module)
                                           else (value,)))]
        if not todo:
            continue
        for adapter in sorted({a for _, a, _ in todo}):
            init = _init_type(module, adapter)
            dora = any(attr == "lora_magnitude_vector" and a == adapter for attr, a, _ in todo)
            if dora or not any(init is choice or init == choice for choice in _PLAIN_INITS):
                what = "DoRA's magnitude vector" if dora else f"init_lora_weights={init!r}"
                raise ConfigError(
                    f"the LoRA adapter {adapter!r} of {name} was added on the meta device, and "
                    f"{what} needs the base weights to initialize",
                    hint="Load the base weights first and add the adapters after (get_peft_model "
                         "once the swapper or vramkit.fit has attached), or use "
                         "init_lora_weights=True / 'gaussian' / False.")
        for attr, adapter, value in todo:
            if isinstance(value, nn.Module):
                for p in value.parameters():
                    if p.grad is not None and p.grad.is_meta:
                        p.grad = None  # to_empty would make it real and uninitialized
                value.to_empty(device=device)
                reset = getattr(value, "reset_parameters", None)
                if callable(reset):
                    with torch.no_grad():
                        reset()
                created += list(value.parameters())
            else:  # a ParameterDict entry (embedding adapters)
                fresh = nn.Parameter(torch.empty_like(value, device=device),
                                     requires_grad=value.requires_grad)
                with torch.no_grad():
                    nn.init.normal_(fresh)
                getattr(layer, attr)[adapter] = fresh
                created.append(fresh)
        for adapter in sorted({a for _, a, _ in todo}):
            init = _init_type(module, adapter)
            if init is not False:
                with torch.no_grad():
                    layer.reset_lora_parameters(adapter, init)
    return created
