"""The floors of vramkit (docs/architecture.md): every import points down, and no run-time cycles.

Each module's imports are read from its source (AST), so the test sees imports inside functions
too (the lazy ones), ``importlib.import_module("vramkit...")`` calls with a literal name, and the
targets of the packages' lazy re-exports. Imports under ``if TYPE_CHECKING:`` are left out: they
never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import vramkit

SRC = Path(vramkit.__file__).resolve().parent
ROOT = "vramkit"

#: Floors, bottom to top. A module may import from its own floor or any floor below.
FLOORS: dict[str, int] = {
    "vramkit.errors": 0, "vramkit.units": 0, "vramkit._validate": 0, "vramkit._lazy": 0,
    "vramkit._gguf_types": 0,  # GGUF's type table: quant decodes it, io reads headers with it
    "vramkit._files": 0,
    "vramkit.devices": 1,
    "vramkit.memory": 2, "vramkit.kernels": 2, "vramkit.quant": 2, "vramkit.optim": 2,
    "vramkit.compress": 2,  # lossless weight coding; offload/swap stores masters in it
    # observe (profiling, reports, leaks, OOM recovery) stands on memory beside io and offload,
    # which may never import it (test_observation_stays_above_what_it_watches)
    "vramkit.io": 3, "vramkit.offload": 3, "vramkit.observe": 3,
    "vramkit.planning": 4, "vramkit.tiling": 4, "vramkit.distributed": 4,
    "vramkit.recipes": 5,
    "vramkit.cli": 6, "vramkit.__main__": 6,
    "vramkit": 7,  # the package itself: the curated public API, re-exported lazily
}


def floor_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        floor = FLOORS.get(".".join(parts[:n]))
        if floor is not None:
            return floor
    raise KeyError(f"{module} is on no floor: add its package to FLOORS (and to the table in "
                   "docs/architecture.md)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    kind: str  # "import", "lazy export" or "importlib"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _absolute(source: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[source].name == "__init__.py"
    base = source.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_exports(package: str) -> dict[str, str]:
    """name -> defining module, for a package's ``lazy_exports`` table or vramkit's ``_export``
    calls (read from the source, not imported)."""
    tree = ast.parse(MODULES[package].read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func.endswith("lazy_exports") and len(node.args) == 2 and isinstance(
                node.args[1], ast.Dict):
            for key, value in zip(node.args[1].keys, node.args[1].values, strict=True):
                module = ast.literal_eval(key)  # type: ignore[arg-type]
                target = package + module if module.startswith(".") else module
                for name in ast.literal_eval(value):
                    out[name] = target
        elif func == "_export" and node.args:
            target = ast.literal_eval(node.args[0])
            for arg in node.args[1:]:
                out[ast.literal_eval(arg)] = target
    return out


def _resolve(package_or_module: str, name: str) -> str:
    """What ``from package_or_module import name`` depends on."""
    sub = f"{package_or_module}.{name}"
    if sub in MODULES:
        return sub
    if MODULES.get(package_or_module, Path()).name == "__init__.py":
        target = _lazy_exports(package_or_module).get(name)
        if target is not None:
            return target
    return package_or_module


def imports_of(source: str) -> Iterator[Import]:
    path = MODULES[source]
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                    yield Import(source, alias.name, node.lineno, "import")
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(source, node)
            if base == ROOT or base.startswith(ROOT + "."):
                for alias in node.names:
                    if base == ROOT and alias.name == "__version__":
                        continue  # a constant of the package, not a dependency
                    yield Import(source, _resolve(base, alias.name), node.lineno, "import")
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
              and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith(ROOT)):
            yield Import(source, str(node.args[0].value), node.lineno, "importlib")
    if path.name == "__init__.py":
        for target in _lazy_exports(source).values():
            yield Import(source, target, 0, "lazy export")


ALL_IMPORTS: list[Import] = [i for m in MODULES for i in imports_of(m)]


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES:
        floor_of(module)


def test_every_import_points_down() -> None:
    upward = [f"{i.source}:{i.line} ({floor_of(i.source)}) imports {i.target} "
              f"({floor_of(i.target)}) [{i.kind}]"
              for i in ALL_IMPORTS if floor_of(i.target) > floor_of(i.source)]
    assert not upward, "imports that point up a floor:\n" + "\n".join(upward)


def test_imports_name_existing_modules() -> None:
    missing = [f"{i.source}:{i.line} -> {i.target}" for i in ALL_IMPORTS
               if i.target not in MODULES]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in ALL_IMPORTS:
        if i.target in graph and i.target != i.source and i.kind != "lazy export":
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_run_time_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "modules that import each other at run time:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


#: Packages that observation watches or that what it watches stands on: none may import
#: ``vramkit.observe`` (io and offload share its floor number, so the floors alone allow it).
OBSERVED = ("vramkit.devices", "vramkit.memory", "vramkit.kernels", "vramkit.quant",
            "vramkit.optim", "vramkit.io", "vramkit.offload")
OBSERVE = "vramkit.observe"


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def observation_imports(imports: list[Import]) -> list[str]:
    """The imports of ``vramkit.observe`` made by a module of :data:`OBSERVED`."""
    return [f"{i.source}:{i.line} imports {i.target} [{i.kind}]" for i in imports
            if _in_package(i.target, OBSERVE)
            and any(_in_package(i.source, p) for p in OBSERVED)]


def test_observation_stays_above_what_it_watches() -> None:
    found = observation_imports(ALL_IMPORTS)
    assert not found, ("modules below observation that import vramkit.observe:\n"
                       + "\n".join(found))


@pytest.mark.parametrize("source", ["vramkit.offload.swap", "vramkit.io.loader",
                                    "vramkit.memory.pool", "vramkit.devices.env"])
def test_the_observation_rule_catches_an_import_of_observe(source: str) -> None:
    # an import the rule must refuse, though the floors alone let io and offload make it
    planted = Import(source, "vramkit.observe.profiler", 1, "import")
    assert observation_imports([planted]) == [
        f"{source}:1 imports vramkit.observe.profiler [import]"]
    allowed = Import("vramkit.cli.profile", "vramkit.observe.profiler", 1, "import")
    assert observation_imports([allowed]) == []


@pytest.mark.parametrize("source", [
    "import vramkit.memory.pool",
    "from vramkit.offload import checkpointing",
    "from vramkit import MemoryPool",
])
def test_the_walker_resolves_import_forms(source: str, tmp_path: Path) -> None:
    tree = ast.parse(source)
    node = tree.body[0]
    if isinstance(node, ast.Import):
        assert node.names[0].name in MODULES
    else:
        assert isinstance(node, ast.ImportFrom)
        target = _resolve(node.module or "", node.names[0].name)
        assert target in MODULES and target != ROOT


def _backslash_continuations(path: Path) -> list[int]:
    """Lines of ``path`` continued with a backslash outside a string literal."""
    import io
    import tokenize

    text = path.read_text()
    in_string: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            in_string.update(range(tok.start[0], tok.end[0]))
    return [n for n, line in enumerate(text.splitlines(), 1)
            if line.rstrip().endswith("\\") and n not in in_string]


def test_no_backslash_continuations() -> None:
    # PEP 8 prefers parentheses, and some tools cannot read a function defined after one.
    found = [f"{path.relative_to(SRC.parent)}:{n}" for path in MODULES.values()
             for n in _backslash_continuations(path)]
    assert not found, "backslash line continuations (use parentheses):\n" + "\n".join(found)
