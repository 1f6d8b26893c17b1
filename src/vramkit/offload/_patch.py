"""The one way vramkit wraps a module's method: install, restore, find, unwrap.

Checkpointing, block swapping, the CPU offload manager and VAE tiling all run their own code in
place of a module's ``forward`` (or a VAE's ``decode``/``encode``). Each does it through this
module, with a :class:`MethodWrapper` subclass:

* :func:`install` puts the wrapper in the module's instance ``__dict__`` (where attribute
  lookup finds it before the class's method) and remembers what was there, so :func:`restore`
  gives back exactly that: the class method, or the instance attribute the module had.
* Wrappers stack. Each holds the callable it replaced (``inner``) and is listed, in install
  order, in the module's ``_vramkit_wrappers``, so :func:`find` sees a wrapper even when
  something else (a user's patch) was put on top of it.
* :func:`restore` unlinks a wrapper wherever it is: on top, its predecessor comes back; under
  another vramkit wrapper, that one now calls the restored wrapper's ``inner``; under a foreign
  replacement (which holds a reference to it and cannot be rewired), the wrapper is left in
  place, switched off (``active = False``): it calls ``inner`` and nothing else.

Wrappers are objects, not closures: ``copy.deepcopy(model)`` gives the copy wrappers bound to the
copied modules, and ``torch.save(model)`` can pickle the ones that hold no live resources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

from torch import nn

__all__ = ["MethodWrapper", "find", "install", "restore", "restore_all", "unwrap", "wrappers"]

_REGISTRY = "_vramkit_wrappers"
_W = TypeVar("_W", bound="MethodWrapper")


class MethodWrapper:
    """Base class of what vramkit installs in place of a module's method.

    Subclasses set :attr:`kind` and implement ``__call__``; a call must go straight to
    ``self.inner(*args, **kwargs)`` while ``active`` is ``False``.

    Attributes:
        inner: the callable this wrapper replaced (a bound method, or another wrapper).
        name: the method's name (``"forward"``, ``"decode"``...).
        active: ``False`` once restored beneath a foreign replacement.
    """

    __slots__ = ("_had_previous", "_previous", "active", "inner", "name")

    kind: ClassVar[str] = "wrapper"

    def __init__(self) -> None:
        self.inner: Callable[..., Any] = _unset
        self.name = ""
        self.active = True
        # What the instance attribute was before (a flag, not a sentinel: copies and pickles of
        # a model keep a bool, not the identity of a sentinel object).
        self._had_previous = False
        self._previous: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<vramkit {self.kind} wrapper of {self.inner!r}>"


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this vramkit wrapper was never installed")


def wrappers(module: nn.Module, name: str = "forward") -> list[MethodWrapper]:
    """The wrappers installed on ``module``'s method ``name``, oldest first."""
    return [w for w in module.__dict__.get(_REGISTRY, ()) if w.name == name]


def install(module: nn.Module, wrapper: _W, name: str = "forward") -> _W:
    """Make ``wrapper`` what ``module.<name>`` finds, wrapping what was there.

    Args:
        module: the module (any object with a ``__dict__``).
        wrapper: a fresh :class:`MethodWrapper`.
        name: the method to wrap (default ``"forward"``).

    Returns:
        ``wrapper``, installed.

    Raises:
        ValueError: when ``wrapper`` was installed before.
    """
    if wrapper.inner is not _unset:
        raise ValueError(f"{wrapper!r} is installed already")
    wrapper.inner = getattr(module, name)
    wrapper.name = name
    wrapper._had_previous = name in module.__dict__
    wrapper._previous = module.__dict__.get(name)
    module.__dict__[name] = wrapper
    module.__dict__.setdefault(_REGISTRY, []).append(wrapper)
    return wrapper


def restore(module: nn.Module, wrapper: MethodWrapper) -> bool:
    """Take ``wrapper`` out of ``module``'s method (see the module docstring for where).

    Args:
        module: the module it was installed on.
        wrapper: the wrapper.

    Returns:
        ``True`` when the wrapper is out of the call path; ``False`` when a foreign replacement
        sits on top of it and it was only switched off.

    Raises:
        ValueError: when ``wrapper`` is not installed on ``module``.
    """
    registry: list[MethodWrapper] = module.__dict__.get(_REGISTRY, [])
    if not any(w is wrapper for w in registry):
        raise ValueError(f"{wrapper!r} is not installed on this module")
    name = wrapper.name
    unlinked = True
    if module.__dict__.get(name) is wrapper:
        if not wrapper._had_previous:
            del module.__dict__[name]
        else:
            module.__dict__[name] = wrapper._previous
    else:
        above = next((w for w in registry if w.inner is wrapper), None)
        if above is not None:
            above.inner = wrapper.inner
            above._had_previous = wrapper._had_previous
            above._previous = wrapper._previous
        else:
            wrapper.active = False
            unlinked = False
    registry[:] = [w for w in registry if w is not wrapper]
    if not registry:
        module.__dict__.pop(_REGISTRY, None)
    return unlinked


def restore_all(model: nn.Module, kind: str, name: str = "forward") -> list[str]:
    """:func:`restore` the wrapper of ``kind`` on every module of ``model`` that has one.

    Returns:
        The qualified names of the modules restored.
    """
    restored: list[str] = []
    for qualified, module in model.named_modules():
        wrapper = find(module, kind, name)
        if wrapper is not None:
            restore(module, wrapper)
            restored.append(qualified)
    return restored


def find(module: nn.Module, kind: str, name: str = "forward") -> MethodWrapper | None:
    """The most recent wrapper of ``kind`` on ``module``'s method ``name``, or ``None``."""
    for w in reversed(wrappers(module, name)):
        if w.kind == kind:
            return w
    return None


def _chain(callable_: Any) -> Iterator[Any]:
    while True:
        yield callable_
        if not isinstance(callable_, MethodWrapper):
            return
        callable_ = callable_.inner


def unwrap(module: nn.Module, kinds: tuple[str, ...], name: str = "forward") -> Callable[..., Any]:
    """What ``module.<name>`` calls once the wrappers of ``kinds`` on top are taken away.

    Walks down from the current method while it is a vramkit wrapper of one of ``kinds``;
    the first callable that is not is returned (the method itself when none matches).
    """
    for callable_ in _chain(getattr(module, name)):
        if not (isinstance(callable_, MethodWrapper) and callable_.kind in kinds):
            return callable_
    raise AssertionError("unreachable")  # _chain ends with a non-wrapper
