"""Finding a model's repeated blocks and choosing which of them to swap.

Shared by :class:`vramkit.offload.swap.BlockSwapper` and
:func:`vramkit.offload.checkpointing.enable_gradient_checkpointing`: both work on *blocks*, the repeated
units of a network (transformer blocks, UNet stages) that sit in ``nn.ModuleList`` or
``nn.Sequential`` containers.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vramkit._validate import check_int
from vramkit.errors import ConfigError, OffloadError
from vramkit.units import format_size

__all__ = [
    "BlockScheduleEntry",
    "BlockSpec",
    "as_block_specs",
    "block_named",
    "choose_swapped",
    "find_blocks",
    "module_bytes",
    "named_schedule",
    "natural_key",
    "split_blocks",
    "spread_evenly",
    "unet_blocks",
]

_CONTAINERS = (nn.ModuleList, nn.Sequential)
_MIN_SHARE = 0.01  # a container holding less than 1% of the model's bytes is not a block stack


def block_named(model: nn.Module, name: str) -> nn.Module:
    """The module ``name`` of ``model``, for functions that take block names.

    Raises:
        ConfigError: when ``model`` has no module of that name.
    """
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ConfigError(f"the model has no block {name!r}",
                          hint="Pass names from vramkit.offload.blocks.find_blocks(model)."
                          ) from None


def natural_key(name: str) -> tuple[object, ...]:
    """A sort key that orders ``"blocks.2"`` before ``"blocks.10"`` (numbers compare as numbers).

    Example:
        >>> sorted(["blocks.10", "blocks.2", "blocks.1"], key=natural_key)
        ['blocks.1', 'blocks.2', 'blocks.10']
    """
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", name) if part)


def module_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in _tensors(module):
        key = id(tensor)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


@dataclass(frozen=True)
class BlockSpec:
    """A block as the scheduler sees it: its qualified name and size in bytes."""

    name: str
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a block needs a non-empty name, got {self.name!r}",
                              hint="Use the block's qualified module name from "
                                   "model.named_modules(), e.g. 'layers.0'.")
        check_int(f"block {self.name!r}: nbytes", self.nbytes, minimum=0)


@dataclass(frozen=True)
class BlockScheduleEntry:
    """One block of a swap schedule (seed ``BlockScheduleEntry``).

    Attributes:
        index: position in execution order.
        name: qualified module name (``"transformer_blocks.3"``).
        nbytes: bytes of the block's parameters and buffers.
        swapped: whether the block lives on the host and is streamed into a GPU slot.
    """

    index: int
    name: str
    nbytes: int
    swapped: bool


def find_blocks(model: nn.Module,
                blocks: str | Sequence[str] = "auto") -> list[tuple[str, nn.Module]]:
    """The model's blocks as ``(qualified name, module)`` pairs in execution order.

    Args:
        model: any ``nn.Module``.
        blocks: ``"auto"`` (default) finds the stacks of repeated blocks: the model itself
            when it is an ``nn.Sequential`` / ``nn.ModuleList`` of blocks of one class
            (children named ``"0"``, ``"1"``...); a diffusers UNet's resnets and attention
            transformers (:func:`unet_blocks`); otherwise the outermost containers inside it
            with at least two children of one class that hold at least 1% of the model's bytes;
            every child with parameters becomes a block. Containers are taken in registration order (diffusers' Flux:
            ``transformer_blocks`` then ``single_transformer_blocks``) and children by index.
            Otherwise a sequence of names or ``fnmatch`` patterns: a name of a container means
            its children, a name of any other module means that module; results are ordered
            by registration order of the model (numbers compare as numbers).

    Returns:
        A list of ``(name, module)``; the same module never appears twice.

    Raises:
        OffloadError: when nothing matches (the message lists candidate containers).
        ConfigError: for a ``blocks`` argument of the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be an nn.Module, got {type(model).__name__}",
                          hint="Pass the model itself (an nn.Module), e.g. "
                               "find_blocks(pipe.transformer), not a pipeline or a state dict.")
    if isinstance(blocks, str) and blocks == "auto":
        found = _auto_blocks(model)
        if not found:
            raise OffloadError(
                f"found no stack of repeated blocks in {type(model).__name__}",
                hint="Name the blocks yourself, e.g. blocks=['layers'] or ['blocks.*'].")
        return found
    if isinstance(blocks, str):
        blocks = [blocks]
    if not isinstance(blocks, Sequence) or not all(isinstance(b, str) for b in blocks):
        raise ConfigError(f"blocks must be 'auto' or a sequence of names/patterns, got {blocks!r}",
                          hint="Pass blocks='auto', a name such as 'layers', or a list of patterns "
                               "such as ['blocks.*'].")
    return _named_blocks(model, list(blocks))


def split_blocks(found: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Finer swap units: each block replaced by its children that hold tensors.

    A ring's slots are as large as its largest unit, so a model of large blocks swapped whole
    keeps R copies of the largest on the GPU: FLUX.1-dev's double block is 648 MiB in bf16, its
    children (the attention, the two feed-forwards, the two modulation norms) at most 144 MiB.
    A child that is a ``ModuleList``/``Sequential`` gives its own children instead (Qwen-Image's
    modulation ``Sequential(SiLU, Linear)`` gives the ``Linear``: a container's name would mean
    its children). Tensors of the block itself (Wan's ``scale_shift_table``) are left out of
    every unit: they stay with the model, resident. A block stays whole where it would give
    fewer than two units, or where its units share tensors.

    Args:
        found: blocks as :func:`find_blocks` returns them.

    Returns:
        ``(name, module)`` pairs: a block's units (``"transformer_blocks.0.attn"``,
        ``"transformer_blocks.0.img_mod.1"``) in registration order in place of the block, or
        the block itself.
    """
    out: list[tuple[str, nn.Module]] = []
    for name, block in found:
        units = list(_units(name, block))
        own = sum(t.numel() * t.element_size() for t in (
            *block.parameters(recurse=False), *block.buffers(recurse=False)))
        if len(units) < 2 or own + sum(module_bytes(m) for _, m in units) != module_bytes(block):
            out.append((name, block))
        else:
            out.extend(units)
    return out


def _units(name: str, module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    for child_name, child in module.named_children():
        if not module_bytes(child):
            continue
        if isinstance(child, _CONTAINERS):
            yield from _units(f"{name}.{child_name}", child)
        else:
            yield f"{name}.{child_name}", child


def unet_blocks(unet: nn.Module) -> list[str]:
    """The container names of a diffusers UNet's resnet and attention stacks.

    A UNet stage (``down_blocks.1``) is too coarse to swap (SDXL's largest is ~1.4 GB in bf16)
    and its nesting of ``ModuleList``s misleads the generic rule, so a UNet's blocks are each
    stage's ``resnets`` and ``attentions`` children (``find_blocks`` expands the names).

    Returns:
        Names such as ``"down_blocks.1.resnets"``, ``"mid_block.attentions"``; empty when the
        model has no such stages.
    """
    names = []
    for stage_name in ("down_blocks", "mid_block", "up_blocks"):
        stage = getattr(unet, stage_name, None)
        if not isinstance(stage, nn.Module):
            continue
        stages = (list(stage.named_children()) if isinstance(stage, nn.ModuleList)
                  else [("", stage)])
        for index, module in stages:
            prefix = f"{stage_name}.{index}" if index else stage_name
            for part in ("resnets", "attentions"):
                stack = getattr(module, part, None)
                if isinstance(stack, nn.ModuleList) and len(stack):
                    names.append(f"{prefix}.{part}")
    return names


def _auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    total = module_bytes(model)
    root = _root_stack(model)
    if root:
        return root
    unet = unet_blocks(model)
    if unet:
        return _named_blocks(model, unet)
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    adapters = _hooked_in(model)
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS) or not name:
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        children = [(n, c) for n, c in module.named_children() if module_bytes(c) > 0]
        if len(children) < 2:
            continue
        if all(id(c) in adapters for _, c in children):
            continue  # a LoRA network registered on the model: its modules run inside blocks
        counts = Counter(type(c) for _, c in children)
        if counts.most_common(1)[0][1] < 2:
            continue
        if total and module_bytes(module) < _MIN_SHARE * total:
            continue
        taken.append(name)
        found.extend((f"{name}.{n}", c) for n, c in children)
    return found


def _hooked_in(model: nn.Module) -> set[int]:
    """Ids of the modules that another module's replaced ``forward`` or hooks call (a
    kohya-style network's adapters, forward-hook adapters): never blocks of their own."""
    from vramkit.offload._reach import callable_modules

    out: set[int] = set()
    for module in model.modules():
        sources = [module.__dict__.get("forward"), *module._forward_pre_hooks.values(),
                   *module._forward_hooks.values()]
        for fn in sources:
            out.update(id(m) for m in callable_modules(fn) if m is not module)
    return out


def _root_stack(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's own children when the model itself is the stack: a bare ``nn.Sequential`` or
    ``nn.ModuleList`` whose children with parameters are two or more of one class (a model that
    mixes an embedding, a stack and a head is searched inside instead)."""
    if not isinstance(model, _CONTAINERS):
        return []
    children = [(n, c) for n, c in model.named_children() if module_bytes(c) > 0]
    if len(children) < 2 or len({type(c) for _, c in children}) != 1:
        return []
    return children


def _named_blocks(model: nn.Module, patterns: list[str]) -> list[tuple[str, nn.Module]]:
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    modules = dict(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    for pattern in patterns:
        if pattern and pattern in modules and not any(c in pattern for c in "*?["):
            matched = [pattern]  # an exact name (a split plan names hundreds of units)
        else:
            matched = [n for n in modules
                       if n and (n == pattern or fnmatch.fnmatchcase(n, pattern))]
        if not matched:
            containers = [n for n, m in modules.items() if isinstance(m, _CONTAINERS) and n]
            raise OffloadError(f"no module matches {pattern!r}",
                               hint=f"Containers in this model: {containers[:12]}")
        for name in matched:
            module = modules[name]
            if isinstance(module, _CONTAINERS):
                for child_name, child in module.named_children():
                    chosen[f"{name}.{child_name}"] = child
            else:
                chosen[name] = module
    # A block nested inside another chosen block would be swapped twice: keep the outer one.
    names = sorted(chosen, key=lambda n: (order.get(n, math.inf), natural_key(n)))
    kept: list[str] = []
    for name in names:
        if not any(name.startswith(k + ".") for k in kept):
            kept.append(name)
    seen: set[int] = set()
    result = []
    for name in kept:
        module = chosen[name]
        if id(module) not in seen:
            seen.add(id(module))
            result.append((name, module))
    return result


def spread_evenly(sizes: Sequence[int], count: int) -> list[int]:
    """Indices of ``count`` blocks spread evenly over the cumulative bytes of ``sizes``.

    The targets are ``count`` evenly spaced points from the first block's byte midpoint to the
    last one's, and each picks the free block whose midpoint is nearest, so swapped bytes are
    spread among resident ones (which hide their transfers) rather than bunched together. With
    two or more picks the first and the last block are among them: a swapped block at each end
    lets the copy stream start one block into the forward pass and run until one block before
    the end of backward, where a resident end block would leave it idle for that block's
    compute (with R slots the pipeline cannot fill earlier or drain later; measured on the
    2048-token stack of ``benchmarks/swap.py``). One pick takes the middle. Returns sorted indices.
    """
    n = len(sizes)
    if count <= 0:
        return []
    if count >= n:
        return list(range(n))
    weights = list(sizes) if sum(sizes) else [1] * n
    # Integer arithmetic on doubled midpoints (2*acc_i + w_i), so exact ties break the same way
    # every time: target k sits at first + k * (last - first) / (count - 1), compared after
    # multiplying through by (count - 1).
    mids2 = []
    acc = 0
    for w in weights:
        mids2.append(2 * acc + w)
        acc += w
    if count == 1:
        scale, targets = 1, [acc]  # the doubled midpoint of the whole: half the total bytes
    else:
        scale = count - 1
        targets = [mids2[0] * scale + k * (mids2[-1] - mids2[0]) for k in range(count)]
    chosen: list[int] = []
    free = set(range(n))
    for target in targets:
        best = min(free, key=lambda i: (abs(mids2[i] * scale - target), i))
        free.discard(best)
        chosen.append(best)
    return sorted(chosen)


def as_block_specs(blocks: Sequence[BlockSpec | tuple[str, int] | nn.Module | str]
                   ) -> list[BlockSpec]:
    """Read the blocks a schedule is asked for: an ``nn.ModuleList`` / ``nn.Sequential`` of
    blocks, :class:`BlockSpec`, ``(name, nbytes)`` pairs, modules (named ``"0"``, ``"1"``... and
    weighed by :func:`module_bytes`) or plain names (equal-sized, ordered numerically:
    ``"blocks.2"`` before ``"blocks.10"``).

    Raises:
        ConfigError: for anything else.
    """
    if isinstance(blocks, _CONTAINERS):
        # The seed's form: the container of blocks itself (children named "0", "1"...).
        return [BlockSpec(name, module_bytes(child)) for name, child in blocks.named_children()]
    if isinstance(blocks, (str, nn.Module)) or not isinstance(blocks, Sequence):
        raise ConfigError(f"blocks must be a sequence of blocks, got {type(blocks).__name__}",
                          hint="Pass an nn.ModuleList / nn.Sequential of blocks, or a list of "
                               "modules, names, (name, nbytes) pairs or BlockSpec.")
    if blocks and all(isinstance(b, str) for b in blocks):
        return [BlockSpec(name, 1) for name in sorted(blocks, key=natural_key)]  # type: ignore[arg-type]
    specs = []
    for i, b in enumerate(blocks):
        if isinstance(b, BlockSpec):
            specs.append(b)
        elif isinstance(b, nn.Module):
            specs.append(BlockSpec(str(i), module_bytes(b)))
        elif isinstance(b, tuple) and len(b) == 2:
            specs.append(BlockSpec(b[0], b[1]))
        else:
            raise ConfigError(f"cannot read block {b!r}: expected BlockSpec, (name, nbytes), "
                              "a module or a name",
                              hint="For example [('blocks.0', 2**30), ('blocks.1', 2**30)].")
    return specs


def choose_swapped(specs: Sequence[BlockSpec], *, max_gpu_blocks: int | None,
                   max_gpu_bytes: int | None, num_slots: int) -> list[BlockScheduleEntry]:
    """The swap schedule: the smallest swapped set that meets the limits, spread evenly.

    Takes values already validated (a :class:`~vramkit.offload.swap.SwapConfig`'s fields).

    Args:
        specs: the blocks in execution order.
        max_gpu_blocks: blocks that may stay resident (``None``: no count limit).
        max_gpu_bytes: bytes for resident blocks plus ``num_slots`` slots of the largest
            swapped block (``None``: no byte limit).
        num_slots: R.

    Returns:
        One :class:`BlockScheduleEntry` per block; with neither limit every block is swapped.

    Raises:
        OffloadError: when even swapping every block does not fit ``max_gpu_bytes``.
    """
    n = len(specs)
    sizes = [s.nbytes for s in specs]
    if max_gpu_blocks is None and max_gpu_bytes is None:
        count = n
    else:
        count = 0 if max_gpu_blocks is None else max(0, n - max_gpu_blocks)
        if max_gpu_bytes is not None:
            while count <= n:
                chosen = spread_evenly(sizes, count)
                resident = sum(sizes) - sum(sizes[i] for i in chosen)
                slots = num_slots * max((sizes[i] for i in chosen), default=0)
                if resident + slots <= max_gpu_bytes:
                    break
                count += 1
            else:
                need = num_slots * max(sizes, default=0)
                raise OffloadError(
                    f"max_gpu_bytes={format_size(max_gpu_bytes)} cannot hold even {num_slots} "
                    f"slots of the largest block ({format_size(need)} with every block "
                    f"swapped)",
                    hint="Raise the budget, lower num_slots, or split the largest blocks.")
    swapped = set(spread_evenly(sizes, count))
    return [BlockScheduleEntry(i, s.name, s.nbytes, i in swapped) for i, s in enumerate(specs)]


def named_schedule(specs: Sequence[BlockSpec], names: Sequence[str]) -> list[BlockScheduleEntry]:
    """The schedule that swaps exactly the blocks ``names`` (a plan's choice).

    Raises:
        ConfigError: for a name that is not one of ``specs``.
    """
    known = {s.name for s in specs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"SwapConfig.swapped_blocks names blocks the model does not have: "
                          f"{unknown[:4]}",
                          hint=f"The blocks found: {[s.name for s in specs][:8]}...")
    chosen = set(names)
    return [BlockScheduleEntry(i, s.name, s.nbytes, s.name in chosen)
            for i, s in enumerate(specs)]

