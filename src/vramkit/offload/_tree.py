"""Flatten a block call's arguments and outputs into leaves, without making garbage cycles.

``torch.utils._pytree.tree_flatten`` defines a recursive local function on every call; the
function's closure refers to itself, so each call leaves a reference cycle behind for the garbage
collector. A swapped block flattens its inputs and its outputs on every call, and those cycles
made the collector run about once per training step (measured: ~100 cyclic objects per step on a
24-block model), which costs host time exactly where the swapper is host-bound. This module
handles the containers blocks actually take and return (tuples, lists, dicts, named tuples) with
plain recursion, and hands any other container type registered with PyTorch's pytree (for example
diffusers' ``BaseOutput``) to ``pytree`` for that node only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["TreeSpec", "flatten", "unflatten"]

_LEAF = 0
_TUPLE = 1
_LIST = 2
_DICT = 3
_NAMEDTUPLE = 4
_PYTREE = 5


class TreeSpec:
    """The structure of a flattened object: a kind, its context and the children's specs."""

    __slots__ = ("children", "context", "kind")

    def __init__(self, kind: int, context: Any = None,
                 children: tuple[TreeSpec, ...] = ()) -> None:
        self.kind = kind
        self.context = context
        self.children = children


_LEAF_SPEC = TreeSpec(_LEAF)


def flatten(obj: Any) -> tuple[list[Any], TreeSpec]:
    """The leaves of ``obj`` in depth-first order and a spec that :func:`unflatten` inverts."""
    leaves: list[Any] = []
    spec = _flatten_into(obj, leaves)
    return leaves, spec


def _flatten_into(obj: Any, leaves: list[Any]) -> TreeSpec:
    cls = type(obj)
    if cls is tuple:
        return TreeSpec(_TUPLE, None, tuple(_flatten_into(x, leaves) for x in obj))
    if cls is list:
        return TreeSpec(_LIST, None, tuple(_flatten_into(x, leaves) for x in obj))
    if cls is dict:
        keys = tuple(obj)
        return TreeSpec(_DICT, keys, tuple(_flatten_into(obj[k], leaves) for k in keys))
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        return TreeSpec(_NAMEDTUPLE, cls, tuple(_flatten_into(x, leaves) for x in obj))
    if cls in pytree.SUPPORTED_NODES:
        sub_leaves, sub_spec = pytree.tree_flatten(obj)
        leaves.extend(sub_leaves)
        return TreeSpec(_PYTREE, (sub_spec, len(sub_leaves)))
    leaves.append(obj)
    return _LEAF_SPEC


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Rebuild the object that :func:`flatten` turned into ``leaves`` and ``spec``."""
    it = iter(leaves)
    out = _build(it, spec)
    if next(it, _END) is not _END:
        raise ValueError("unflatten: more leaves than the spec holds")
    return out


_END = object()


def _build(it: Iterator[Any], spec: TreeSpec) -> Any:
    kind = spec.kind
    if kind == _LEAF:
        value = next(it, _END)
        if value is _END:
            raise ValueError("unflatten: fewer leaves than the spec holds")
        return value
    if kind == _TUPLE:
        return tuple(_build(it, c) for c in spec.children)
    if kind == _LIST:
        return [_build(it, c) for c in spec.children]
    if kind == _DICT:
        return {k: _build(it, c) for k, c in zip(spec.context, spec.children, strict=True)}
    if kind == _NAMEDTUPLE:
        return spec.context(*(_build(it, c) for c in spec.children))
    sub_spec, count = spec.context
    return pytree.tree_unflatten([next(it) for _ in range(count)], sub_spec)
