"""Per-module attribution for :class:`~vramkit.observe.profiler.MemoryProfiler`: the hooks that take
a reading at the entry and exit of every module, and the figures they keep per module.

The profiler owns the readings (its sampler, peaks and history); this part owns the hooks, the
module names, the per-thread stack of modules being run and the per-module figures. It reaches the
profiler only through the ``read`` callable it is given, so either side can change its insides
alone.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from vramkit.errors import ConfigError
from vramkit.observe.report import ModuleMemory

__all__ = ["BACKWARD_SUFFIX", "ModuleAttribution"]

#: Appended to a module's name while its backward runs (the label of a backward interval).
BACKWARD_SUFFIX = " [backward]"


class _ModuleStat:
    __slots__ = ("act_max", "act_total", "bwd_max", "calls", "peak_hits", "type_name")

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        self.calls = self.act_max = self.act_total = self.bwd_max = self.peak_hits = 0


class ModuleAttribution:
    """Module hooks that attribute memory to the modules that run.

    Args:
        read: takes one reading and returns the profiler's metric, or ``None`` when the profiler
            is not running (the hooks then do nothing). Called from the hooks, so from the thread
            that runs the model.
    """

    def __init__(self, read: Callable[[], int | None]) -> None:
        self._read = read
        # Guards the per-module figures, which the profiler's sampler thread and report read.
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._local = threading.local()  # each thread runs its own stack of modules
        self._stats: dict[str, _ModuleStat] = {}
        self._current: str | None = None

    @property
    def current(self) -> str | None:
        """The label of the module being run (``"<name> [backward]"`` in its backward), if any."""
        return self._current

    @property
    def hook_count(self) -> int:
        """Hooks currently installed by :meth:`attach`."""
        return len(self._handles)

    def reset(self) -> None:
        """Forget the per-module figures (a new profiling session); hooks stay installed."""
        with self._lock:
            self._stats = {}

    def note_peak(self, label: str | None) -> None:
        """Count a new peak of the metric against the module labelled ``label`` (if known)."""
        if label is None:
            return
        with self._lock:
            stat = self._stats.get(label.removesuffix(BACKWARD_SUFFIX))
            if stat is not None:
                stat.peak_hits += 1

    def top(self, count: int) -> tuple[ModuleMemory, ...]:
        """The ``count`` modules that kept the most activation memory, most first."""
        with self._lock:
            ranked = sorted(self._stats.items(), key=lambda kv: kv[1].act_max, reverse=True)
            return tuple(ModuleMemory(name, s.type_name, s.calls, s.act_max, s.act_total,
                                      s.bwd_max, s.peak_hits)
                         for name, s in ranked[:count])

    def attach(self, model: Any = None, *, backward: bool = True) -> None:
        """Add the hooks; see :meth:`~vramkit.observe.profiler.MemoryProfiler.attach`."""
        import torch.nn as nn
        from torch.nn.modules import module as module_api

        if model is None:
            self._handles += [
                module_api.register_module_forward_pre_hook(self._global_pre),
                module_api.register_module_forward_hook(self._global_post, always_call=True)]
            if backward:
                self._handles += [
                    module_api.register_module_full_backward_pre_hook(self._global_bwd_pre),
                    module_api.register_module_full_backward_hook(self._global_bwd_post)]
            return
        if not isinstance(model, nn.Module):
            raise ConfigError(f"attach() needs a torch.nn.Module, got {type(model).__name__}",
                              hint="Pass the model (a torch.nn.Module) to attach(), or call "
                                   "attach() with no model to hook every module.")
        for name, module in model.named_modules():
            label = name or type(model).__name__
            self._names[module] = label
            enter = functools.partial(self._enter, label, type(module).__name__)
            leave = functools.partial(self._leave, label, False)
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _a, _enter=enter: _enter(False)))
            self._handles.append(module.register_forward_hook(
                lambda _m, _a, _o, _leave=leave: _leave(), always_call=True))
            if backward:
                self._handles.append(module.register_full_backward_pre_hook(
                    lambda _m, _g, _enter=enter: _enter(True)))
                self._handles.append(module.register_full_backward_hook(
                    lambda _m, _gi, _go, _label=label: self._leave(_label, True)))

    def detach(self) -> None:
        """Remove every hook added by :meth:`attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _stack(self) -> list[tuple[str, int]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _name_of(self, module: Any) -> tuple[str, str]:
        name = self._names.get(module)
        if name is None and not self._stack():
            # an outermost module: name its whole tree once
            root = type(module).__name__
            for sub_name, sub in module.named_modules():
                self._names.setdefault(sub, sub_name or root)
            name = self._names.get(module)
        return name or type(module).__name__, type(module).__name__

    def _global_pre(self, module: Any, _args: Any) -> None:
        self._enter(*self._name_of(module), False)

    def _global_post(self, module: Any, _args: Any, _out: Any) -> None:
        self._leave(self._name_of(module)[0], False)

    def _global_bwd_pre(self, module: Any, _grad_out: Any) -> None:
        self._enter(*self._name_of(module), True)

    def _global_bwd_post(self, module: Any, _grad_in: Any, _grad_out: Any) -> None:
        self._leave(self._name_of(module)[0], True)

    def _enter(self, name: str, type_name: str, backward: bool) -> None:
        value = self._read()  # closes the interval of the enclosing module
        if value is None:
            return
        label = f"{name}{BACKWARD_SUFFIX}" if backward else name
        with self._lock:
            if name not in self._stats:
                self._stats[name] = _ModuleStat(type_name)
            if not backward:
                self._stats[name].calls += 1
        self._stack().append((label, value))
        self._current = label

    def _leave(self, name: str, backward: bool) -> None:
        value = self._read()  # closes this module's own interval
        if value is None:
            return
        label = f"{name}{BACKWARD_SUFFIX}" if backward else name
        stack = self._stack()
        for depth in range(len(stack) - 1, -1, -1):
            if stack[depth][0] == label:
                entry_value = stack[depth][1]
                del stack[depth:]  # children that raised without an exit hook go too
                break
        else:
            return
        delta = value - entry_value
        with self._lock:
            stat = self._stats.get(name)
            if stat is not None:
                if backward:
                    stat.bwd_max = max(stat.bwd_max, delta)
                else:
                    stat.act_max = max(stat.act_max, delta)
                    stat.act_total += max(delta, 0)
        self._current = stack[-1][0] if stack else None
