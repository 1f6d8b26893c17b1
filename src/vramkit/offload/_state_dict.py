"""``state_dict`` and ``load_state_dict`` of modules whose tensors live in host masters.

While a :class:`~vramkit.offload.swap.BlockSwapper` is attached (its hooks:
:mod:`vramkit.offload.swap.state_dict`), or a
:class:`~vramkit.offload.cpu.CPUOffloadManager` holds a module's tensors, those ``Parameter``
objects hold a zero-byte placeholder (or a view of a GPU slot that the next load overwrites).
PyTorch's own ``state_dict`` would save zeros for them, and ``load_state_dict`` would fail on
the placeholder or write where the next load overwrites it. The truth is the tensor's host
master. :func:`install_master_hooks` makes both go through it:

* ``state_dict``: the entry of such a tensor becomes its host master (on the CPU: the weights
  of a model bigger than the GPU are not copied back to it). With ``keep_vars=True`` the
  entries stay the module's own ``Parameter`` objects, as PyTorch returns them.
* ``load_state_dict``: before the tensors load, they are pointed at their host masters, so
  PyTorch's loader copies the incoming values there (with its usual shape and key checks);
  afterwards the owner points them back and drops what it had loaded from the old values.
  ``assign=True`` would replace the ``Parameter`` objects and is refused.

A tensor whose current value is on the device (loaded by the manager) is left to PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vramkit.errors import OffloadError

__all__ = ["MasterTensor", "install_master_hooks"]


@dataclass
class MasterTensor:
    """A tensor of a module whose value lives in a host master.

    Args:
        keys: its ``state_dict`` keys relative to the hooked module (two when a submodule is
            registered under two names).
        tensor: the module's tensor object.
        master: returns the host master to read and write now, or ``None`` when the tensor
            itself holds the current value.
        restore: points the tensor back at what it held before a load into the master.
    """

    keys: list[str]
    tensor: torch.Tensor
    master: Callable[[], torch.Tensor | None]
    restore: Callable[[], None]
    # why a load into it is refused (weights kept on disk), or what says it at the load
    read_only: str | Callable[[], str | None] | None = None


def _register(module: nn.Module, public: str, private: str, hook: Any,
              **private_kwargs: Any) -> RemovableHandle:
    method = getattr(module, public, None)
    if method is None:  # older PyTorch: the same hook through the private registration
        return getattr(module, private)(hook, **private_kwargs)  # type: ignore[no-any-return]
    return method(hook)  # type: ignore[no-any-return]


def install_master_hooks(module: nn.Module, tensors: list[MasterTensor], owner: str,
                         before_load: Callable[[], None] | None = None,
                         after_load: Callable[[], None] | None = None) -> list[RemovableHandle]:
    """Register the ``state_dict``/``load_state_dict`` hooks for ``tensors`` of ``module``.

    Args:
        module: the module the keys are relative to.
        tensors: its tensors with host masters.
        owner: what holds them, for messages (a block name, a module name).
        before_load: called before the tensors are pointed at their masters for a load.
        after_load: called after each ``load_state_dict`` through ``module``.

    Returns:
        The handles; removing them restores PyTorch's behaviour.
    """
    rebound: list[MasterTensor] = []

    def save(module: nn.Module, state_dict: dict[str, Any], prefix: str,
             local_metadata: Any) -> None:
        for t in tensors:
            keys = [prefix + key for key in t.keys  # saved, and not as-is (keep_vars=True)
                    if prefix + key in state_dict and state_dict[prefix + key] is not t.tensor]
            master = t.master() if keys else None
            if master is not None:
                for key in keys:
                    state_dict[key] = master

    def before(module: nn.Module, state_dict: dict[str, Any], prefix: str,
               local_metadata: dict[str, Any], strict: bool, missing: list[str],
               unexpected: list[str], errors: list[str]) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise OffloadError(
                f"load_state_dict(assign=True) would replace the offloaded tensors of {owner}",
                hint="Load with assign=False, or restore the model (detach()/restore()) first.")
        for t in tensors:
            if t.read_only is None or not any(prefix + key in state_dict for key in t.keys):
                continue
            reason = t.read_only() if callable(t.read_only) else t.read_only
            if reason is not None:
                raise OffloadError(f"load_state_dict cannot write {prefix + t.keys[0]} of "
                                   f"{owner}: {reason}",
                                   hint="Load the weights before attaching (checkpoint=), or "
                                        "attach without a host_budget that leaves them on "
                                        "disk.")
        if before_load is not None:
            before_load()
        for t in tensors:
            master = t.master()
            if master is not None:
                t.tensor.data = master
                rebound.append(t)

    def after(module: nn.Module, incompatible: Any) -> None:
        while rebound:
            rebound.pop().restore()
        if after_load is not None:
            after_load()

    return [_register(module, "register_state_dict_post_hook", "_register_state_dict_hook",
                      save),
            _register(module, "register_load_state_dict_pre_hook",
                      "_register_load_state_dict_pre_hook", before, with_module=True),
            module.register_load_state_dict_post_hook(after)]
