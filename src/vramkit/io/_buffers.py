"""Recomputing the non-persistent buffers a meta-device build leaves on meta.

Checkpoints hold parameters and persistent buffers only. A module built under
``torch.device("meta")`` and filled by ``load_into`` keeps its non-persistent buffers (rotary
``inv_freq``, ``position_ids``...) on meta: their values were computed in ``__init__`` and never
saved. Where the model offers a way to compute them again, they are recomputed here, on the
device the weights went to:

* a Hugging Face ``transformers`` model (``PreTrainedModel``) has ``_init_weights(module)``, which
  recomputes rotary frequencies (``inv_freq``, ``original_inv_freq``), position ids and the like
  for the module it is given. The nearest enclosing module that has ``_init_weights`` is used.

Anything else stays on meta and is reported by the loader (``LoadResult.still_meta`` and a
warning naming each tensor).

Safety. ``_init_weights`` also initializes parameters. While it runs, every other tensor of the
module it is given is swapped for a meta stand-in, so loaded weights are never overwritten
whatever the initializer does. A buffer counts as recomputed only when every element was
written: it starts filled with a sentinel (NaN, or an integer extreme) that must be gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["meta_non_persistent_buffers", "recompute_meta_buffers"]

logger = logging.getLogger(__name__)


def meta_non_persistent_buffers(root: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """Modules owning non-persistent buffers still on meta: owner name -> (owner, buffer names)."""
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for name, module in root.named_modules():
        attrs = [attr for attr, value in module._buffers.items()
                 if value is not None and value.is_meta
                 and attr in module._non_persistent_buffers_set]
        if attrs:
            found[name] = (module, attrs)
    return found


def recompute_meta_buffers(root: nn.Module, device: torch.device) -> list[str]:
    """Recompute the non-persistent meta buffers of ``root`` where the model offers a way.

    Args:
        root: the module ``load_into`` filled.
        device: where the recomputed buffers go (the device the weights were loaded to).

    Returns:
        The qualified names of the buffers recomputed (the others stay on meta).
    """
    owners = meta_non_persistent_buffers(root)
    if not owners:
        return []
    modules = dict(root.named_modules())
    done: list[str] = []
    for name, (owner, attrs) in owners.items():
        initializer = _initializer(modules, name)
        if initializer is None:
            continue
        for attr in _recompute(owner, attrs, initializer, device):
            done.append(f"{name}.{attr}" if name else attr)
    return done


def _initializer(modules: dict[str, nn.Module],
                 name: str) -> Callable[[nn.Module], object] | None:
    parts = name.split(".") if name else []
    for cut in range(len(parts), -1, -1):
        candidate = modules.get(".".join(parts[:cut]))
        init = getattr(candidate, "_init_weights", None)  # transformers' PreTrainedModel
        if callable(init):
            return init
    return None


def _sentinel(dtype: torch.dtype) -> float | int | None:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None  # no value a bool buffer could not legitimately hold
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return None
    return int(info.min) if info.min < 0 else int(info.max)


def _fully_written(value: torch.Tensor, sentinel: float | int) -> bool:
    if value.is_floating_point() or value.is_complex():
        return not bool(torch.isnan(value).any())
    return not bool((value == sentinel).any())


def _meta_stand_in(tensor: torch.Tensor) -> torch.Tensor:
    stand_in = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
    return stand_in


def _recompute(owner: nn.Module, attrs: list[str], initializer: Callable[[nn.Module], object],
               device: torch.device) -> list[str]:
    fresh: dict[str, tuple[torch.Tensor, float | int]] = {}
    for attr in attrs:
        meta = owner._buffers[attr]
        sentinel = None if meta is None else _sentinel(meta.dtype)
        if meta is None or sentinel is None:
            continue
        try:
            fresh[attr] = (torch.full(meta.shape, sentinel, dtype=meta.dtype, device=device),
                           sentinel)
        except (RuntimeError, TypeError):  # a dtype torch.full cannot fill on this device
            continue
    if not fresh:
        return []
    originals = {attr: owner._buffers[attr] for attr in fresh}
    # (module, "_parameters" or "_buffers", name) -> the real tensor, restored afterwards
    swapped: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    done: list[str] = []
    try:
        for module in owner.modules():
            for store in ("_parameters", "_buffers"):
                tensors = getattr(module, store)
                for key, tensor in list(tensors.items()):
                    if tensor is None or tensor.is_meta or (module is owner and key in fresh):
                        continue
                    tensors[key] = _meta_stand_in(tensor)
                    swapped.append((module, store, key, tensor))
        for attr, (value, _) in fresh.items():
            owner._buffers[attr] = value
        with torch.no_grad():
            initializer(owner)
        for attr, (value, sentinel) in fresh.items():
            current = owner._buffers.get(attr)
            if current is value and _fully_written(value, sentinel):
                done.append(attr)
            elif (current is not None and current is not value and not current.is_meta
                  and current.shape == value.shape):
                # the initializer registered a new tensor: keep it, on the weights' device
                owner._buffers[attr] = current.to(device=device, dtype=value.dtype)
                done.append(attr)
    except Exception as err:  # an initializer that cannot run on this module: leave it on meta
        logger.debug("recomputing buffers %s with %r failed: %s", list(fresh), initializer, err)
        done = []
    finally:
        for module, store, key, tensor in swapped:
            getattr(module, store)[key] = tensor
        for attr, meta in originals.items():
            if attr not in done:
                owner._buffers[attr] = meta
    return done
