"""Tensors followed while they live, on the meta device: the storages of a step's tensors by
weak reference (a storage counts once, until its last tensor dies), and a backward followed
op by op (:class:`BackwardFollower`), for :mod:`vramkit.planning.activations`."""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BackwardFollower", "LiveStorages", "flat_tensors", "storage_key"]


class FollowedRecord(Protocol):
    """What a :class:`BackwardFollower` reads of the activation accounting's record."""

    backward_block: str | None
    param_keys: set[int]


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s StorageImpl: views of one tensor share it, so a storage counts
    once (valid while the storage lives: a freed one's address can be reused)."""
    return t.untyped_storage()._cdata  # type: ignore[no-any-return]


class LiveStorages:
    """Storages followed while their tensors live (weak references, so they die as they would
    in the step): ``changed(id, +bytes)`` when one first has a live tensor, ``changed(id,
    -bytes)`` when its last one dies; a storage met again later is a new one."""

    def __init__(self, changed: Callable[[int, int], None]) -> None:
        self._changed = changed
        self._live: dict[int, list[int]] = {}  # storage key -> [live tensors, bytes, id]
        self._ids = itertools.count()
        # id of a weak reference -> (the reference, its tensor's storage key): keyed by id, as
        # a live reference hashes and compares as its tensor
        self._refs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def ident(self, key: int) -> int | None:
        """The id of the live storage ``key``, or ``None``."""
        entry = self._live.get(key)
        return None if entry is None else entry[2]

    def follow(self, t: torch.Tensor, key: int) -> int:
        """Follow ``t``, whose storage is ``key``; returns the storage's id."""
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, t.untyped_storage().nbytes(), next(self._ids)]
            self._changed(entry[2], entry[1])
        entry[0] += 1
        ref = weakref.ref(t, self._dropped)
        self._refs[id(ref)] = (ref, key)
        return entry[2]

    def _dropped(self, ref: weakref.ref[torch.Tensor]) -> None:
        held = self._refs.pop(id(ref), None)
        entry = None if held is None else self._live.get(held[1])
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[held[1]]
            self._changed(entry[2], -entry[1])

    def clear(self) -> None:
        """Forget every storage (their deaths are no longer reported)."""
        self._live.clear()
        self._refs.clear()


def flat_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors in ``args`` and ``kwargs``, through tuples, lists and dicts."""
    out: list[torch.Tensor] = []
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return out


class BackwardFollower(TorchDispatchMode):
    """The storages alive while a backward on meta tensors runs: the forward's saved ones (by
    the block that saved them) and those the backward's ops make, each change recorded with
    the block whose backward runs."""

    def __init__(self, record: FollowedRecord) -> None:
        super().__init__()
        self.record = record
        self.recording = False
        self.owner: dict[int, str | None] = {}  # saved storage id -> the block that saved it
        self.events: list[tuple[str | None, int | None, int, bool]] = []
        self.saved = LiveStorages(functools.partial(self._changed, True))
        self.made = LiveStorages(functools.partial(self._changed, False))
        self.initial: dict[str | None, int] = {}

    def follow_saved(self, saved: Iterable[tuple[torch.Tensor, str | None]]) -> None:
        """Follow the forward's saved tensors, each with the block that saved it. (A loop in
        a frame that outlives the backward would keep its last tensor alive to the end.)"""
        for t, owner in saved:
            ident = self.saved.follow(t, storage_key(t))
            if ident not in self.owner:
                self.owner[ident] = owner
                self.initial[owner] = self.initial.get(owner, 0) + t.untyped_storage().nbytes()

    def _changed(self, saved: bool, ident: int, change: int) -> None:
        if self.recording:
            self.events.append((self.record.backward_block, ident, change, saved))

    def begins(self, name: str) -> None:
        """Block ``name``'s backward begins (nothing changes: a moment to look at)."""
        if self.recording:
            self.events.append((name, None, 0, False))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        new = not (func.is_view or func._schema.is_mutable)
        for t in flat_tensors((out,), {}):
            key = storage_key(t)
            if self.saved.ident(key) is not None:  # a view of a saved tensor keeps it alive
                self.saved.follow(t, key)
            elif self.made.ident(key) is not None or (new and key not in self.record.param_keys):
                self.made.follow(t, key)
        return out

    def peaks(self, excluded: Collection[int]) -> dict[str, int]:
        """By block, the most bytes alive at once while its backward ran: what it saved and has
        not used up, and what the backward made (leaving out the storages ``excluded``: the
        parameters' gradients)."""
        remaining = dict(self.initial)
        made = 0
        peaks: dict[str, int] = {}
        for block, ident, change, saved in self.events:
            if saved:
                owner = self.owner.get(ident)  # type: ignore[arg-type]
                remaining[owner] = remaining.get(owner, 0) + change
            elif ident not in excluded:
                made += change
            if block is not None:
                peaks[block] = max(peaks.get(block, 0), remaining.get(block, 0) + made)
        return peaks
