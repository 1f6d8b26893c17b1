"""Attaching a swapper to a model and giving the model back.

Plain functions over the model and the swapped blocks' records, used by
:class:`~vramkit.offload.swap.swapper.BlockSwapper` when it attaches and detaches: which tensors
of the scheduled blocks are swapped, what goes to the device, how DDP is told to leave the
swapped tensors alone, why nothing was swapped, which models are refused, how a dtype cast or a
device move of the model is refused while attached, and how every tensor gets its value back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from vramkit.errors import ConfigError, OffloadError
from vramkit.offload import _patch
from vramkit.offload.blocks import BlockScheduleEntry, module_bytes
from vramkit.offload.swap.config import SwapConfig
from vramkit.offload.swap.records import (
    SwapEntry,
    SwappedBlock,
    SwapRule,
    block_tensors,
    is_swappable,
    layout_entries,
)
from vramkit.offload.swap.source import CheckpointSource
from vramkit.units import format_size

__all__ = [
    "ConversionGuard",
    "Countdown",
    "DDPIgnored",
    "collect_swapped",
    "guard_conversions",
    "ignore_in_ddp",
    "is_fsdp",
    "module_names",
    "move_to_device",
    "nothing_swapped_reason",
    "refuse_wrapped",
    "release_guards",
    "restore_ddp_ignored",
    "restore_entry",
    "restore_moved",
    "shared_tensor_ids",
]

#: What ``model._ddp_params_and_buffers_to_ignore`` was before :func:`ignore_in_ddp`: (whether
#: the model had the attribute, its value).
DDPIgnored = tuple[bool, Any]


def collect_swapped(model: nn.Module, found: list[tuple[str, nn.Module]],
                    schedule: Sequence[BlockScheduleEntry], rule: SwapRule
                    ) -> tuple[list[SwappedBlock], int]:
    """The records of the scheduled blocks' swappable tensors, and the bytes of blocks (and
    tensors) that stay resident. A scheduled block with nothing worth swapping stays
    resident."""
    shared = shared_tensor_ids(model, found)
    blocks: list[SwappedBlock] = []
    resident = 0
    for entry in schedule:
        name, module = found[entry.index]
        if not entry.swapped:
            resident += module_bytes(module)
            continue
        entries: list[SwapEntry] = []
        for owner, attr, tensor, is_param in block_tensors(module):
            if id(tensor) in shared or not is_swappable(tensor, rule, is_param=is_param):
                resident += tensor.numel() * tensor.element_size()
                continue
            nbytes = tensor.numel() * tensor.element_size()
            # A tensor built on meta comes back to the CPU at detach, with its values.
            home = torch.device("cpu") if tensor.is_meta else tensor.device
            entries.append(SwapEntry(owner, attr, is_param, tensor, 0, nbytes,
                                     tensor.shape, tuple(tensor.stride()), tensor.dtype,
                                     home, bool(tensor.requires_grad)))
        if entries:
            blocks.append(SwappedBlock(entry.index, name, module, entries,
                                       layout_entries(entries)))
    return blocks, resident


def move_to_device(model: nn.Module, swapped_ids: set[int], source: CheckpointSource | None,
                   device: torch.device
                   ) -> tuple[list[tuple[torch.Tensor, torch.device]], list[torch.Tensor]]:
    """Move every tensor of ``model`` that is not swapped to ``device``, except those the
    checkpoint holds: returns the moved tensors with their home devices (for detach), and the
    tensors to load from ``source``."""
    moved: list[tuple[torch.Tensor, torch.device]] = []
    from_file: list[torch.Tensor] = []
    seen: set[int] = set()
    for owner in model.modules():
        for tensors in (owner._parameters, owner._buffers):
            for t in tensors.values():
                if t is None or id(t) in swapped_ids or id(t) in seen:
                    continue
                seen.add(id(t))
                if source is not None and source.entry(t) is not None:
                    from_file.append(t)
                elif t.is_meta:
                    continue  # a non-persistent buffer recomputed below, or an error
                elif t.device != device:
                    moved.append((t, t.device))
                    t.data = t.data.to(device)
    return moved, from_file


def restore_moved(moved: list[tuple[torch.Tensor, torch.device]]) -> None:
    """Put tensors moved by :func:`move_to_device` (and the checkpoint's) back home, with their
    gradients."""
    for tensor, device in moved:
        grad = tensor.grad
        if grad is not None:
            tensor.grad = None
        tensor.data = tensor.data.to(device)
        if grad is not None:
            tensor.grad = grad.to(device)


def restore_entry(e: SwapEntry, view: torch.Tensor | None) -> None:
    """Give a swapped tensor its value back from its master's ``view``, on its original device
    (no view: built on meta and never read, a failed load: meta again)."""
    e.host_param = None
    if view is None:
        _back_to_meta(e)
        return
    restored = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=e.original_device)
    restored.copy_(view)
    e.tensor.data = restored


def ignore_in_ddp(model: nn.Module, blocks: list[SwappedBlock]) -> DDPIgnored | None:
    """List the swapped tensors in ``model._ddp_params_and_buffers_to_ignore`` (DDP's own
    way to leave tensors out): their placeholders must not be broadcast (they alias one
    element) nor reduced (vramkit.distributed reduces swapped trainable gradients). Returns
    what :func:`restore_ddp_ignored` puts back (``None``: nothing was changed)."""
    swapped = {id(e.tensor) for b in blocks for e in b.entries}
    if not swapped:
        return None
    names = [n for n, t in (*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False))
             if id(t) in swapped]
    had = hasattr(model, "_ddp_params_and_buffers_to_ignore")
    before = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    merged = list(before or []) + [n for n in names if n not in set(before or [])]
    model._ddp_params_and_buffers_to_ignore = merged  # type: ignore[assignment]
    return had, before


def restore_ddp_ignored(model: nn.Module, saved: DDPIgnored) -> None:
    """Undo :func:`ignore_in_ddp`."""
    had, before = saved
    if had:
        model._ddp_params_and_buffers_to_ignore = before  # type: ignore[assignment]
    elif hasattr(model, "_ddp_params_and_buffers_to_ignore"):
        del model._ddp_params_and_buffers_to_ignore


def nothing_swapped_reason(config: SwapConfig, schedule: Sequence[BlockScheduleEntry],
                           found: list[tuple[str, nn.Module]]) -> str:
    """Why an attached swapper swaps no block, in words a user can act on."""
    chosen = [found[e.index] for e in schedule if e.swapped]
    prefix = f"BlockSwapper swaps none of the {len(found)} blocks it found: "
    if not chosen:
        if config.swapped_blocks is not None:
            return prefix + "SwapConfig.swapped_blocks is empty."
        limit = (f"max_gpu_bytes={format_size(config.max_gpu_bytes)}"  # type: ignore[arg-type]
                 if config.max_gpu_bytes is not None
                 else f"max_gpu_blocks={config.max_gpu_blocks}")
        return (prefix + f"{limit} holds every block "
                f"({format_size(sum(e.nbytes for e in schedule))}), so the model runs "
                "resident. Lower the limit if the GPU cannot hold it.")
    tensors = [(t, is_param) for _, module in chosen
               for _, _, t, is_param in block_tensors(module)]
    largest = max((t.numel() * t.element_size() for t, _ in tensors), default=0)
    if largest < max(1, config.min_param_bytes):
        return (prefix + f"every tensor of the {len(chosen)} blocks the schedule chose is "
                f"below min_param_bytes={format_size(config.min_param_bytes)} (the largest "
                f"is {format_size(largest)}). Lower SwapConfig.min_param_bytes to swap "
                "small blocks.")
    big = [t for t, _ in tensors
           if t.numel() * t.element_size() >= max(1, config.min_param_bytes)]
    if config.trainable == "resident" and all(t.requires_grad for t in big):
        return (prefix + "the large tensors of the blocks it chose are trainable and "
                "trainable='resident' keeps them on the GPU. Freeze the base weights "
                "(LoRA), or use SwapConfig(trainable='swap') (optimizer on the GPU) or "
                "trainable='cpu' for full fine-tuning.")
    return (prefix + "the tensors of the blocks it chose are shared with other blocks, "
            "buffers with swap_buffers=False, or not dense, so they stay resident.")


def shared_tensor_ids(model: nn.Module, found: list[tuple[str, nn.Module]]) -> set[int]:
    """Tensors used by more than one block, or by a block and the rest of the model: tied
    weights stay resident, because a swapped copy would diverge from its twin."""
    owners: dict[int, set[int]] = {}
    prefixes = [(name + ".", i) for i, (name, _) in enumerate(found)]
    names = {name: i for i, (name, _) in enumerate(found)}
    # remove_duplicate=False: a submodule shared by two blocks is listed under both names.
    for qual, sub in model.named_modules(remove_duplicate=False):
        where = names.get(qual, -1)
        if where < 0:
            where = next((i for prefix, i in prefixes if qual.startswith(prefix)), -1)
        for t in list(sub._parameters.values()) + list(sub._buffers.values()):
            if t is not None:
                owners.setdefault(id(t), set()).add(where)
    return {k for k, v in owners.items() if len(v) > 1}


def _back_to_meta(e: SwapEntry) -> None:
    # A meta tensor cannot take another device's data, nor the reverse: a new object.
    meta = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device="meta")
    tensor = (nn.Parameter(meta, requires_grad=e.tensor.requires_grad) if e.is_param
              else meta)
    (e.owner._parameters if e.is_param else e.owner._buffers)[e.attr] = tensor
    e.tensor = tensor


class Countdown:
    """Calls ``action`` once, on the ``count``-th :meth:`release` (from any thread)."""

    def __init__(self, count: int, action: Callable[[], None]) -> None:
        self._count = count
        self._action = action
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._action()


#: Wrapper kinds whose owner holds a module's weights while attached, with how to let go: a
#: second owner would find its tensors already replaced (a swapper: placeholders shared with
#: the first one's masters), swap nothing and leave both attached.
_HOLDERS = {"swap": ("swapped by another BlockSwapper", "Detach the first swapper "
                     "(swapper.detach(), or fitted.detach() for vramkit.fit) before attaching "
                     "another, or keep using the first."),
            "cpu_offload": ("offloaded by a CPUOffloadManager", "Call manager.restore() "
                            "before attaching a BlockSwapper to the model.")}


def refuse_held(model: nn.Module) -> None:
    """Refuse a model whose modules another swapper or a CPU offload manager holds.

    Raises:
        OffloadError: naming the first module held and how to detach its holder.
    """
    for name, module in model.named_modules():
        for w in _patch.wrappers(module):
            if w.active and w.kind in _HOLDERS:
                how, hint = _HOLDERS[w.kind]
                raise OffloadError(f"{name or type(model).__name__} is already {how}: a "
                                   "second swapper would find its weights taken",
                                   hint=hint)


def refuse_wrapped(model: nn.Module, *, attached: bool = False) -> None:
    """Refuse a model wrapped by DDP or sharded by FSDP (``attached``: it happened after the
    swapper attached, seen at the next call of a swapped block)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ConfigError(
            "BlockSwapper cannot attach to a DistributedDataParallel wrapper: DDP has already "
            "registered the weights it would swap (and broadcast them)",
            hint="Attach to the plain model first, then wrap it: swapper = BlockSwapper(model, "
                 "...); ddp = vramkit.distributed.wrap_ddp(model, swapper).")
    sharded = [name or "the model" for name, m in model.named_modules() if is_fsdp(m)]
    if sharded:
        when = ("was sharded by FSDP after the swapper attached" if attached
                else "is sharded by FSDP")
        raise ConfigError(
            f"{sharded[0]} {when}: FSDP and BlockSwapper both own the storage of the same "
            "parameters (FSDP shards and all-gathers them, the swapper streams them from host "
            "masters), so they cannot manage one module",
            hint="Use BlockSwapper with DistributedDataParallel (vramkit.distributed.wrap_ddp), "
                 "or FSDP with its own CPUOffloadPolicy, not both on the same module "
                 "(docs/distributed.md has the compatibility matrix).")


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is managed by FSDP (FSDP2's ``fully_shard`` or FSDP1's wrapper), by
    its classes' names and modules: FSDP itself is never imported to ask."""
    for cls in type(module).__mro__:
        if cls.__name__ in ("FSDPModule", "FullyShardedDataParallel") and cls.__module__.startswith(
                "torch.distributed"):
            return True
    return False


def module_names(model: nn.Module, names: Sequence[str]) -> list[str]:
    """``names`` checked to be submodules of ``model`` (``checkpoint_skip``)."""
    if isinstance(names, str):
        names = [names]
    known = dict(model.named_modules())
    unknown = [n for n in names if not isinstance(n, str) or n not in known or not n]
    if unknown:
        raise ConfigError(f"checkpoint_skip names modules the model does not have: {unknown[:5]}",
                          hint="Pass qualified names from model.named_modules(), such as "
                               "'transformer_blocks.3'.")
    return list(names)


class ConversionGuard(_patch.MethodWrapper):
    """A module's ``_apply`` (what ``.to()``, ``.half()``, ``.float()``, ``.double()``,
    ``.cuda()``, ``.cpu()`` and ``.type()`` all call) refusing a conversion the swapped tensors
    beneath it cannot follow.

    A swapped tensor's bytes live in its block's host master and in the device slots, sized and
    typed when the swapper attached; ``_apply`` would convert only the placeholder, and the next
    call would bind the old dtype's (or device's) slot views again ("self and mat2 must have the
    same dtype"). A conversion that changes nothing (``model.to(device)`` where the model
    already runs) goes through.

    Attributes:
        kinds: the ``(dtype, device)`` of the swapped tensors beneath the module.
    """

    __slots__ = ("kinds",)
    kind = "swap_conversion"

    def __init__(self, kinds: tuple[tuple[torch.dtype, torch.device], ...]) -> None:
        super().__init__()
        self.kinds = kinds

    def __call__(self, fn: Callable[[torch.Tensor], Any], *args: Any, **kwargs: Any) -> Any:
        if self.active:
            for dtype, device in self.kinds:
                # What the conversion does to an empty tensor like the swapped ones (the probe
                # quantized layers use for their recorded dtype): no element is copied.
                probe = fn(torch.empty(0, dtype=dtype, device=device))
                if isinstance(probe, torch.Tensor) and (probe.dtype, probe.device) != (dtype,
                                                                                         device):
                    change = (f"cast to {probe.dtype}" if probe.dtype != dtype
                              else f"moved to {probe.device}")
                    raise OffloadError(
                        f"a model with swapped blocks cannot be {change}: the swapped weights "
                        f"live in host masters and {device} slots of {dtype}, which a "
                        "conversion of the module does not reach; nothing was converted",
                        hint="Detach first (fitted.detach(), or swapper.detach()), convert "
                             "the model, then call vramkit.fit (or BlockSwapper) again; or "
                             "convert the model before fitting it.")
        return self.inner(fn, *args, **kwargs)


def guard_conversions(model: nn.Module, blocks: Sequence[SwappedBlock], device: torch.device
                      ) -> list[tuple[nn.Module, ConversionGuard]]:
    """Install a :class:`ConversionGuard` on every module with swapped tensors beneath it (the
    model, each swapped block, the layers between): ``_apply`` converts the modules it walks
    one by one, so the refusal must come from the first module the call reaches, before
    anything is converted. Returns what :func:`release_guards` takes back."""
    owned: dict[int, set[torch.dtype]] = {}
    for block in blocks:
        for e in block.entries:
            owned.setdefault(id(e.owner), set()).add(e.dtype)
    guards: list[tuple[nn.Module, ConversionGuard]] = []
    seen: set[int] = set()

    def beneath(module: nn.Module) -> set[torch.dtype]:
        dtypes = set(owned.get(id(module), ()))
        for child in module.children():
            dtypes |= beneath(child)
        if dtypes and id(module) not in seen:
            seen.add(id(module))
            kinds = tuple((d, device) for d in sorted(dtypes, key=str))
            guards.append((module, _patch.install(module, ConversionGuard(kinds), "_apply")))
        return dtypes

    beneath(model)
    return guards


def release_guards(guards: list[tuple[nn.Module, ConversionGuard]]) -> None:
    """Take the guards of :func:`guard_conversions` out of the modules' ``_apply``."""
    for module, guard in reversed(guards):
        _patch.restore(module, guard)
