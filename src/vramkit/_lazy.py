"""Lazy re-exports for packages (PEP 562), and aliases for modules that moved.

Every vramkit package re-exports its public names without importing the modules that define
them: ``import vramkit.memory`` imports no submodule, so no package import initializes CUDA,
imports JAX or calls NVML. A name is imported on first use and cached in the package.

:func:`install_moved_modules` keeps old import paths working after a module moved to the floor it
belongs to: ``import vramkit.checkpointing`` gives the very module object of
``vramkit.offload.checkpointing`` (not a copy), so monkeypatching and ``isinstance`` see one
module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MOVED_MODULES", "install_moved_modules", "lazy_exports"]


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


#: Old module path -> where the module lives now. The old path imports the same module object.
MOVED_MODULES: dict[str, str] = {
    "vramkit.checkpointing": "vramkit.offload.checkpointing",
    "vramkit.demo": "vramkit.recipes.demo",
    "vramkit.presets": "vramkit.recipes.presets",
    "vramkit.models": "vramkit.recipes",
    "vramkit.models.dit": "vramkit.recipes.dit",
    "vramkit.kernels.layout": "vramkit.memory.layout",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of :data:`MOVED_MODULES` with the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        # The import system is about to set the alias's spec and loader on the real module:
        # keep its own, for exec_module to put back.
        module.__dict__.setdefault("_vramkit_own_spec", (module.__spec__, module.__loader__))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        own = module.__dict__.pop("_vramkit_own_spec", None)
        if own is not None:
            module.__spec__, module.__loader__ = own


def install_moved_modules() -> None:
    """Make the old paths of moved modules importable (idempotent)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        # First in line: the new location of a moved package would otherwise let the path
        # finder load a second copy of its submodules under the old name.
        sys.meta_path.insert(0, _MovedModuleFinder())
