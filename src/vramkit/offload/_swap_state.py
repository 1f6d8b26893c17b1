"""``state_dict`` and ``load_state_dict`` of a model while a BlockSwapper is attached.

Between calls a swapped block's ``Parameter`` objects hold a zero-byte placeholder (or a view of
whichever slot the block was last loaded into), so PyTorch's own ``state_dict`` would save zeros
for them and ``load_state_dict`` would fail on the placeholder or write into a slot that the next
load overwrites. The truth is the block's pinned host master. Hooks on each swapped block module
make both go through it:

* ``state_dict``: each swapped tensor's entry becomes a view of its host master (on the CPU: the
  weights of a model bigger than the GPU are not copied back to it). With ``keep_vars=True`` the
  entries stay the module's own ``Parameter`` objects, as PyTorch returns them.
* ``load_state_dict``: before the block's tensors load, they are pointed at their host masters,
  so PyTorch's loader copies the incoming values there (with its usual shape and key checks);
  afterwards they are pointed back at their placeholders, and a slot holding the block is
  marked stale, so the block is loaded again on its next use.
  ``assign=True`` would replace the swapped ``Parameter`` objects and is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from vramkit.errors import OffloadError

if TYPE_CHECKING:
    from vramkit.offload.swap import SwappedBlock

__all__ = ["install_state_dict_hooks"]


def _keys(block: SwappedBlock) -> list[list[str]]:
    """Each entry's ``state_dict`` keys relative to the block module (a submodule registered
    under two names is saved under both)."""
    names: dict[int, list[str]] = {}
    for name, module in block.module.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return [[f"{n}.{e.attr}" if n else e.attr for n in names[id(e.owner)]]
            for e in block.entries]


def _register(module: nn.Module, public: str, private: str, hook: Any,
              **private_kwargs: Any) -> RemovableHandle:
    method = getattr(module, public, None)
    if method is None:  # older PyTorch: the same hook through the private registration
        return getattr(module, private)(hook, **private_kwargs)  # type: ignore[no-any-return]
    return method(hook)  # type: ignore[no-any-return]


def install_state_dict_hooks(block: SwappedBlock) -> list[RemovableHandle]:
    """Register the ``state_dict``/``load_state_dict`` hooks of one swapped block.

    Returns the handles; removing them restores PyTorch's behaviour (``detach()`` does).
    """
    keys = _keys(block)

    def save(module: nn.Module, state_dict: dict[str, Any], prefix: str,
             local_metadata: Any) -> None:
        for e, entry_keys, master in zip(block.entries, keys, block.master_views, strict=True):
            for key in entry_keys:
                full = prefix + key
                if full in state_dict and state_dict[full] is not e.tensor:  # not keep_vars
                    state_dict[full] = master

    def before_load(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                    local_metadata: dict[str, Any], strict: bool, missing: list[str],
                    unexpected: list[str], errors: list[str]) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise OffloadError(
                f"load_state_dict(assign=True) would replace the swapped tensors of "
                f"{block.name}",
                hint="Load with assign=False while the swapper is attached, or detach() first.")
        block.bound = None  # the next acquire points the tensors at their slot again
        for e, master in zip(block.entries, block.master_views, strict=True):
            e.tensor.data = master

    def after_load(module: nn.Module, incompatible: Any) -> None:
        block.bound = None
        for e in block.entries:
            e.tensor.data = e.placeholder
        if block.slot is not None:  # the copy in its slot predates the load: reload it
            block.slot.loaded_version = -1

    return [_register(block.module, "register_state_dict_post_hook",
                      "_register_state_dict_hook", save),
            _register(block.module, "register_load_state_dict_pre_hook",
                      "_register_load_state_dict_pre_hook", before_load, with_module=True),
            block.module.register_load_state_dict_post_hook(after_load)]
