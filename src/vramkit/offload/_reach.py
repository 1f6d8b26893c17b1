"""The modules a block's call reaches besides its own: adapters hooked in from outside.

Adapter libraries do not all register their modules under the layer they adapt. kohya's and
musubi-tuner's LoRA networks (and LyCORIS) keep their adapter modules in a network of their own
and replace each target layer's ``forward`` by an *instance attribute*, the adapter's bound
``forward``, which calls the layer's original forward and adds the low-rank update; other code
adds the update in a forward hook. A block's call then reads trainable parameters that
``block.parameters()`` does not list. Whoever decides from the block's parameters whether a call
needs autograd (the swapper's no-gradient shortcut) or which parameters a recomputation must
differentiate (the lean checkpoint) asks :func:`reached_modules` instead.

Followed, from every module of the block: a ``forward`` set on the instance and the forward
(pre-)hooks; from every module reached that way, also its other bound methods kept as
attributes (an adapter's ``org_forward``, which may be a second adapter stacked on the first).
A callable leads to the module it is bound to, the module it is, and the modules in its closure
or in a ``functools.partial``'s arguments (a few levels deep). A trainable tensor captured by a
closure outside any module is not found here: the swapper notices its gradient at run time
(:mod:`vramkit.offload.swap.calls`) and the lean checkpoint's first-call check refuses it.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["callable_modules", "closure_tensors", "copy_reaching", "outside_modules", "reach_key",
           "reached_modules"]

_DEPTH = 3  # closures of closures: a hook made by a factory made by a factory


def callable_modules(fn: Any, depth: int = _DEPTH) -> Iterator[nn.Module]:
    """The modules a callable (hook, replaced forward) leads to: the one it is bound to or is,
    and those in its closure or a ``functools.partial``'s arguments."""
    if depth < 0 or fn is None:
        return
    if isinstance(fn, nn.Module):
        yield fn
        return
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        if isinstance(owner, nn.Module):
            yield owner
        yield from callable_modules(fn.__func__, depth - 1)
        return
    if isinstance(fn, functools.partial):
        for value in (fn.func, *fn.args, *fn.keywords.values()):
            yield from callable_modules(value, depth - 1)
        return
    inner = getattr(type(fn), "inner", None)
    if inner is not None and not isinstance(fn, types.FunctionType):
        # a wrapper of vramkit's own (offload._patch: checkpointing, compile) over what an
        # adapter put there
        yield from callable_modules(getattr(fn, "inner", None), depth - 1)
        return
    if isinstance(fn, types.FunctionType) and fn.__closure__:
        for cell in fn.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, (nn.Module, types.MethodType, functools.partial,
                                  types.FunctionType)):
                yield from callable_modules(value, depth - 1)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, nn.Module):
                        yield item


def _hooks(module: nn.Module) -> Iterator[Any]:
    forward = module.__dict__.get("forward")
    if forward is not None:
        yield forward
    yield from module._forward_pre_hooks.values()
    yield from module._forward_hooks.values()


def _kept_methods(module: nn.Module) -> Iterator[Any]:
    """Bound methods an adapter keeps as attributes (``org_forward``) besides its hooks."""
    for value in module.__dict__.values():
        if isinstance(value, (types.MethodType, functools.partial)):
            yield value


def reached_modules(module: nn.Module) -> list[nn.Module]:
    """``module.modules()`` followed by every module outside it that its call reaches through
    replaced forwards and hooks (see the module docstring), each once."""
    own = list(module.modules())
    seen = {id(m) for m in own}
    out = list(own)
    todo: list[tuple[nn.Module, bool]] = [(m, False) for m in own]
    while todo:
        current, outside = todo.pop()
        sources = list(_hooks(current))
        if outside:
            sources += list(_kept_methods(current))
        for fn in sources:
            for found in callable_modules(fn):
                for sub in found.modules():
                    if id(sub) not in seen:
                        seen.add(id(sub))
                        out.append(sub)
                        todo.append((sub, True))
    return out


def reach_key(modules: list[nn.Module]) -> int:
    """Children, parameters, instance attributes and forward hooks of ``modules``: setting a
    layer's ``forward`` on the instance or adding a hook changes it, which PyTorch's
    registration hooks do not see."""
    return sum(len(m._modules) + len(m._parameters) + len(m.__dict__)
               + len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


def outside_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``model``'s call reaches that ``model`` does not hold (a LoRA network kept
    beside the model), each once."""
    own = sum(1 for _ in model.modules())
    return reached_modules(model)[own:]


def _rebound(fn: Any, memo: dict[int, Any]) -> Any:
    """``fn`` with its closure's modules deep-copied through ``memo`` (the copy's own), or
    ``fn`` itself when its closure holds none."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    cells = []
    changed = False
    for cell in fn.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:
            cells.append(cell)
            continue
        if isinstance(value, (nn.Module, torch.Tensor)):
            value = copy.deepcopy(value, memo)
            changed = True
        elif isinstance(value, types.FunctionType):
            new = _rebound(value, memo)
            changed = changed or new is not value
            value = new
        cells.append(types.CellType(value))
    if not changed:
        return fn
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             tuple(cells))
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def closure_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors held directly in the closures of the replaced forwards and hooks of ``model``'s
    modules and of the adapters they reach (a hook closing over a bare trainable tensor)."""
    out: dict[int, torch.Tensor] = {}
    for sub in reached_modules(model):
        for fn in _hooks(sub):
            cells = fn.__closure__ if isinstance(fn, types.FunctionType) else None
            for cell in cells or ():
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(value, torch.Tensor):
                    out[id(value)] = value
    return list(out.values())


def copy_reaching(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """``copy.deepcopy(module, memo)`` whose forward hooks and replaced forwards that are
    closures over adapters call copies of those adapters, as bound methods do (deepcopy shares
    a function, and with it the original adapter's tensors)."""
    memo = {} if memo is None else memo
    copied = copy.deepcopy(module, memo)
    for sub in reached_modules(copied):
        forward = sub.__dict__.get("forward")
        if forward is not None:
            new = _rebound(forward, memo)
            if new is not forward:
                sub.__dict__["forward"] = new
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
            for key, fn in list(hooks.items()):
                hooks[key] = _rebound(fn, memo)
    return copied
