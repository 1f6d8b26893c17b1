"""Lazy re-exports for packages (PEP 562).

Every vramkit package re-exports its public names without importing the modules that define
them: ``import vramkit.memory`` imports no submodule, so no package import initializes CUDA,
imports JAX or calls NVML. A name is imported on first use and cached in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for a package that re-exports lazily.

    Args:
        package: the package's ``__name__``.
        exports: module (absolute, or relative to ``package`` when it starts with ``.``) ->
            the names it defines that the package re-exports, in the order of ``__all__``.

    Returns:
        ``(__all__, __getattr__, __dir__)``, to be bound at the package's top level.

    Raises:
        ValueError: when two modules export the same name.
    """
    where: dict[str, str] = {}
    for module, names in exports.items():
        target = package + module if module.startswith(".") else module
        for name in names:
            if name in where:
                raise ValueError(f"{package}: {name!r} is exported by {where[name]} and {target}")
            where[name] = target
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return list(where), __getattr__, __dir__
