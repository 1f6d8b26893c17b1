"""Noticing module structure changes cheaply, for the swapper's per-pass trainable check.

A swapped block's parameter list is cached between passes; adapters added after attaching (or
weights unfrozen) must still be seen. PyTorch's global registration hooks count every module or
parameter registered anywhere (an *epoch*); a block whose list is older than the epoch lists its
parameters again. The hooks are installed while at least one swapper is attached.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["shape_key", "structure_epoch", "watch_structure"]

_STRUCTURE = {"epoch": 0, "users": 0}
_STRUCTURE_HANDLES: list[Any] = []


def structure_epoch() -> int:
    """The count of module/parameter registrations seen while a swapper was attached."""
    return _STRUCTURE["epoch"]


def shape_key(modules: list[nn.Module]) -> int:
    """Children plus parameters of ``modules``: writes that skip PyTorch's registration hooks
    (``ModuleList.insert``, ``del``) still change it."""
    return sum(len(m._modules) + len(m._parameters) for m in modules)


def _bump_structure_epoch(*_: Any) -> None:
    _STRUCTURE["epoch"] += 1


def watch_structure(on: bool) -> None:
    """One more (``on``) or one fewer swapper that needs the registration hooks."""
    from torch.nn.modules import module as torch_module

    if on:
        _STRUCTURE["users"] += 1
        if _STRUCTURE["users"] == 1:
            _STRUCTURE["epoch"] += 1  # registrations while nobody watched went uncounted
            _STRUCTURE_HANDLES.append(
                torch_module.register_module_module_registration_hook(_bump_structure_epoch))
            _STRUCTURE_HANDLES.append(
                torch_module.register_module_parameter_registration_hook(_bump_structure_epoch))
        return
    _STRUCTURE["users"] -= 1
    if _STRUCTURE["users"] == 0:
        for handle in _STRUCTURE_HANDLES:
            handle.remove()
        _STRUCTURE_HANDLES.clear()
