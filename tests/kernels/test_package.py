"""The vramkit.kernels package: lazy re-exports of its public modules, and a free import."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import vramkit.kernels as package


def test_import_loads_no_submodule() -> None:
    probe = ("import sys, vramkit.kernels; "
             "print(sorted(m for m in sys.modules if m.startswith('vramkit.kernels.')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "[]"


def test_every_public_name_is_exported_from_where_it_lives() -> None:
    exported = set(package.__all__)
    for module_info in pkgutil.iter_modules(package.__path__):
        if module_info.name.startswith("_"):
            continue  # private modules are reached through the public ones
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for name in getattr(module, "__all__", ()):
            assert name in exported, f"{module.__name__}.{name} is not re-exported"
            assert getattr(package, name) is getattr(module, name)


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018
