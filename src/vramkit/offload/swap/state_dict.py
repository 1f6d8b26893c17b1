"""``state_dict`` and ``load_state_dict`` of a model while a swapper is attached.

A swapped block's ``Parameter`` objects hold placeholders or views of a GPU slot; its host
master is the truth. :func:`install_swap_hooks` describes one block's tensors to
:func:`vramkit.offload._state_dict.install_master_hooks` (shared with
:class:`~vramkit.offload.cpu.CPUOffloadManager`), which routes both through the masters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from vramkit.offload._state_dict import MasterTensor, install_master_hooks
from vramkit.offload.swap.records import SwappedBlock

__all__ = ["install_swap_hooks"]

#: ``reader(block, offset, nbytes)``: bytes of a block that has no master to view.
Reader = Callable[[SwappedBlock, int, int], torch.Tensor]


def install_swap_hooks(block: SwappedBlock, sync: Callable[[], None] | None = None, *,
                       reader: Callable[[], Reader | None] | None = None
                       ) -> list[RemovableHandle]:
    """The hooks of one swapped block: its masters are always the truth (a slot copy is at
    best equal, and stale after a host optimizer step); after a load the block's slot copy is
    marked stale, so the next use reloads it. ``sync`` is called before a master is read or
    written (device->host write-backs of ``trainable="swap"`` land first). A block kept on
    disk or compressed has no master: ``reader()`` returns what reads its bytes for
    ``state_dict`` (a :data:`Reader`), and loads into it are refused (its weights are frozen
    there); ``reader()`` returns ``None`` for a block with a master. It is asked at each use:
    a block compressed in the background has its raw master until it is encoded (``reader``
    waits for that)."""
    names: dict[int, list[str]] = {}
    for name, module in block.module.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    def read_only() -> str | None:
        if reader is None or reader() is None:
            return None
        return ("the block's weights are kept on disk (host_budget)" if block.on_disk
                else "the block's weights are kept compressed (SwapConfig.compress)")

    tensors = []
    for i, e in enumerate(block.entries):
        keys = [f"{n}.{e.attr}" if n else e.attr for n in names[id(e.owner)]]

        def restore(e: Any = e) -> None:
            e.tensor.data = e.placeholder

        def current(i: int = i, e: Any = e) -> torch.Tensor:
            read = reader() if reader is not None else None
            if read is not None:
                raw = read(block, e.offset, e.nbytes)
                return raw.view(e.dtype).view(e.shape)
            if sync is not None:
                sync()
            return block.master_views[i]  # looked up late: a master may still be filling

        tensors.append(MasterTensor(keys, e.tensor, current, restore,
                                    read_only=None if reader is None else read_only))

    def unbind() -> None:
        block.bound = None  # the next acquire points the tensors at their slot again

    def after_load() -> None:
        unbind()
        if block.slot is not None:  # the copy in its slot predates the load: reload it
            block.slot.loaded_version = -1

    return install_master_hooks(block.module, tensors, f"swapped block {block.name}",
                                unbind, after_load)
