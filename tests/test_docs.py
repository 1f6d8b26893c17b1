"""Every Python block of README.md and docs/*.md runs as written.

Each page's ```python blocks run in order in one fresh namespace (a block may use what an
earlier block of the same page defined), in a subprocess with a timeout and a temporary working
directory (files the examples write land there). Blocks run with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``), except blocks marked by an HTML comment on the line before the
fence::

    <!-- gpu -->
    ```python
    x = torch.randn(4, device="cuda")
    ```

Those need a GPU: the ``gpu`` test runs every block of their page (CPU ones included, in
order) on the GPU machine. Output that is not Python to run (console output, JSON) is fenced
with another language (``text``, ``console``, ``json``). Placeholders (``...`` for code, calls
to functions the page never defines) fail: a failure names the page, the block, its line and
the traceback, whose line numbers are the page's.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})
PAGE_TIMEOUT_S = 300  # a page takes a few seconds; the limit only catches a hang

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_GPU_MARK = re.compile(r"^<!--\s*gpu\b.*-->$")
_GPU_EXAMPLE = "<!-- gpu -->"
_BEGIN = "[vramkit-docs] begin "
_FAILED = "[vramkit-docs] failed "


@dataclass(frozen=True)
class Block:
    """One ```python block of a page."""

    page: Path
    index: int    # 1-based among the page's Python blocks
    line: int     # line of the block's first code line, 1-based
    source: str
    gpu: bool

    @property
    def where(self) -> str:
        return f"{_relative(self.page)} block {self.index} (line {self.line})"


def _relative(page: Path) -> str:
    try:
        return str(page.relative_to(ROOT))
    except ValueError:
        return str(page)


def parse_blocks(page: Path, text: str | None = None) -> list[Block]:
    """The Python blocks of a markdown page, in order.

    A fence is ``` or ~~~ (three or more), possibly indented (a block inside a list item); it
    closes at a fence of the same character, at least as long, with nothing after it. The
    language is the first word of the info string. A block is a GPU block when the line before
    its fence (blank lines skipped) is an HTML comment starting ``<!-- gpu``.

    Raises:
        ValueError: for a fence that is never closed (the rest of the page would be code).
    """
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        words = opened["info"].split()
        language = words[0].lower() if words else ""
        start = i
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        i += 1
        while i < len(lines) and close.match(lines[i]) is None:
            i += 1
        if i == len(lines):
            raise ValueError(f"{_relative(page)}:{start + 1}: the fence {fence}{language} is "
                             "never closed")
        if language in PYTHON_LANGUAGES:
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                    for line in lines[start + 1:i]]
            before = next((lines[j].strip() for j in range(start - 1, -1, -1)
                           if lines[j].strip()), "")
            blocks.append(Block(page, len(blocks) + 1, start + 2, "\n".join(body) + "\n",
                                _GPU_MARK.match(before) is not None))
        i += 1
    return blocks


def placeholders(source: str) -> list[int]:
    """Lines where ``...`` stands for code: an Ellipsis anywhere but inside a subscript
    (``x[..., 0]`` is indexing, ``f(...)`` or a bare ``...`` line is a placeholder)."""
    tree = ast.parse(source)
    in_subscript: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            in_subscript.update(id(n) for n in ast.walk(node.slice))
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value is Ellipsis
                  and id(node) not in in_subscript)


def undefined_names(blocks: list[Block]) -> dict[str, str]:
    """Names the blocks of a page read but neither the page nor Python's builtins define, each
    with where it is first read. Checked without running, so it covers the GPU blocks on a
    machine without a GPU too (order is not checked: running the blocks does that)."""
    bound = set(dir(builtins)) | {"__name__", "__file__"}
    read: dict[str, str] = {}
    for block in blocks:
        for node in ast.walk(ast.parse(block.source)):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    read.setdefault(node.id, f"{block.where}, line {block.line + node.lineno - 1}")
                else:
                    bound.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
    return {name: where for name, where in read.items() if name not in bound}


# The child: runs the blocks of one page in one namespace, says which block starts, and on an
# error prints the traceback (its file and line numbers are the page's) and which block failed.
_RUNNER = f"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {{"__name__": "__main__"}}
for block in blocks:
    print({_BEGIN!r} + block["where"], flush=True)
    try:
        code = compile("\\n" * (block["line"] - 1) + block["source"], block["path"], "exec")
        exec(code, namespace)
    except BaseException as exc:
        # the page's frames only: the first frame is this runner's exec
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        print({_FAILED!r} + block["where"], flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(1)
"""


@dataclass(frozen=True)
class Run:
    ok: bool
    report: str  # which block failed or hung, and the output


def run_blocks(blocks: list[Block], workdir: Path, *, hide_cuda: bool,
               timeout: float = PAGE_TIMEOUT_S) -> Run:
    """Run ``blocks`` in order in one namespace in a fresh interpreter, in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir.parent / f"{workdir.name}.blocks.json"
    spec.write_text(json.dumps([{"where": b.where, "path": str(b.page), "line": b.line,
                                 "source": b.source} for b in blocks]), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg",
                "PYTHONUNBUFFERED": "1", "VRAMKIT_CACHE_DIR": str(workdir / ".cache")})
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        done = subprocess.run([sys.executable, "-c", _RUNNER, str(spec)], cwd=workdir, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                              text=True, errors="replace")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(
            errors="replace")
        started = [line[len(_BEGIN):] for line in out.splitlines() if line.startswith(_BEGIN)]
        where = started[-1] if started else "before the first block"
        return Run(False, f"{where} did not finish within {timeout:g} s\n{out[-6000:]}")
    out = done.stdout
    if done.returncode == 0:
        return Run(True, out)
    failed = [line[len(_FAILED):] for line in out.splitlines() if line.startswith(_FAILED)]
    where = failed[-1] if failed else f"the runner (exit status {done.returncode})"
    return Run(False, f"{where} failed:\n{out[-6000:]}")


# -- the pages ---------------------------------------------------------------------------------

def _parse_all() -> tuple[dict[Path, list[Block]], dict[Path, str]]:
    blocks: dict[Path, list[Block]] = {}
    errors: dict[Path, str] = {}
    for page in PAGES:
        try:
            blocks[page] = parse_blocks(page)
        except ValueError as exc:  # reported by test_page_parses, not as a collection error
            blocks[page], errors[page] = [], str(exc)
    return blocks, errors


_ALL, _PARSE_ERRORS = _parse_all()
_BLOCKS = [block for blocks in _ALL.values() for block in blocks]
_CPU_PAGES = [page for page, blocks in _ALL.items() if any(not b.gpu for b in blocks)]
_GPU_PAGES = [page for page, blocks in _ALL.items() if any(b.gpu for b in blocks)]


def _id(page: Path) -> str:
    return _relative(page)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_parses(page: Path) -> None:
    assert page not in _PARSE_ERRORS, _PARSE_ERRORS.get(page)


@pytest.mark.parametrize("block", _BLOCKS, ids=lambda b: f"{_relative(b.page)}:{b.index}")
def test_block_is_python_without_placeholders(block: Block) -> None:
    try:
        found = placeholders(block.source)
    except SyntaxError as exc:
        pytest.fail(f"{block.where} is not Python (fence output as text or console): {exc}")
    lines = [block.line + n - 1 for n in found]
    assert not lines, f"{block.where}: `...` stands for code at line(s) {lines}; show real code"


@pytest.mark.parametrize("page", [page for page in PAGES if _ALL[page]], ids=_id)
def test_page_defines_every_name_it_uses(page: Path) -> None:
    try:
        missing = undefined_names(_ALL[page])
    except SyntaxError:
        pytest.skip("a block is not Python: test_block_is_python_without_placeholders says which")
    assert not missing, "names used but never defined (placeholders?): " + "; ".join(
        f"{name!r} at {where}" for name, where in missing.items())


#: The optional extras a page may import (pyproject's ``integration``/``jax`` extras); a page
#: whose blocks import one that is not installed is skipped, not failed (the GPU machine's image,
#: for one, has no diffusers or peft unless carried).
OPTIONAL = ("diffusers", "peft", "transformers", "jax")


def imported_extras(blocks: list[Block]) -> list[str]:
    """The optional top-level modules ``blocks`` import, in :data:`OPTIONAL` order."""
    found: set[str] = set()
    for block in blocks:
        try:
            tree = ast.parse(block.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return [name for name in OPTIONAL if name in found]


def _skip_without_extras(blocks: list[Block]) -> None:
    import importlib.util

    missing = [name for name in imported_extras(blocks)
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the page imports {', '.join(missing)}, not installed here")


@pytest.mark.parametrize("page", _CPU_PAGES, ids=_id)
def test_page_runs_on_cpu(page: Path, tmp_path: Path) -> None:
    _skip_without_extras([b for b in _ALL[page] if not b.gpu])
    run = run_blocks([b for b in _ALL[page] if not b.gpu], tmp_path / "work", hide_cuda=True)
    if not run.ok:
        pytest.fail(f"{run.report}\n(A block that needs a GPU has `{_GPU_EXAMPLE}` on the line "
                    "before its fence.)", pytrace=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page", _GPU_PAGES, ids=_id)
def test_page_runs_on_gpu(page: Path, tmp_path: Path) -> None:
    _skip_without_extras(_ALL[page])
    run = run_blocks(_ALL[page], tmp_path / "work", hide_cuda=False)
    if not run.ok:
        pytest.fail(run.report, pytrace=False)


def test_the_pages_are_found_and_hold_python() -> None:
    assert ROOT / "README.md" in PAGES and ROOT / "docs" / "quantization.md" in PAGES
    assert len(_ALL[ROOT / "README.md"]) >= 4
    for name in ("quantization", "tiling", "optimizers", "kernels"):
        assert any(not b.gpu for b in _ALL[ROOT / "docs" / f"{name}.md"]), name


# -- the harness itself --------------------------------------------------------------------------

_PAGE = """# A page

```bash
echo not python
```

Text.

```python
x = 1
```

<!-- gpu -->

```python
import torch
y = torch.ones(1, device="cuda")
```

1. In a list:

   ```py
   if x:
       z = x + 1
   ```

~~~json
{"a": 1}
~~~

````python
s = '''
```
'''
````
"""


def test_parse_blocks_finds_python_fences_the_gpu_mark_and_lines(tmp_path: Path) -> None:
    blocks = parse_blocks(tmp_path / "page.md", _PAGE)
    assert [(b.index, b.line, b.gpu) for b in blocks] == [
        (1, 10, False), (2, 16, True), (3, 23, False), (4, 32, False)]
    assert blocks[0].source == "x = 1\n"
    assert blocks[2].source == "if x:\n    z = x + 1\n"  # the list indent is removed
    assert blocks[3].source == "s = '''\n```\n'''\n"  # a longer fence holds a shorter one
    with pytest.raises(ValueError, match="never closed"):
        parse_blocks(tmp_path / "bad.md", "```python\nx = 1\n")


def test_imported_extras_are_found_in_import_statements_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = ("```python\nimport torch, peft.tuners as t\nfrom diffusers.models import X\n"
            "from . import jax\nx = 'import transformers'\n```\n")
    assert imported_extras(parse_blocks(page, text)) == ["diffusers", "peft"]


def test_placeholders_are_found_but_indexing_with_an_ellipsis_is_not() -> None:
    assert placeholders("model = build()\n...\nrun(...)\nx[..., 0]\n") == [2, 3]
    assert placeholders("def f() -> None:\n    ...\n") == [2]
    assert placeholders("y = x[..., 1:]\n") == []


def test_undefined_names_are_found_across_a_page(tmp_path: Path) -> None:
    page = ("```python\nimport torch as T\nfrom os import path\nx = T.ones(1)\n"
            "def f(a):\n    return a + x + len(path.sep)\n```\n\n<!-- gpu -->\n"
            "```python\ntry:\n    y = f(x).cuda()\nexcept RuntimeError as err:\n"
            "    print(err, [k for k in range(2)])\nop.launch(cfg, y)\n```\n")
    blocks = parse_blocks(tmp_path / "page.md", page)
    where = f"{tmp_path / 'page.md'} block 2 (line 11), line 15"
    assert undefined_names(blocks) == {"op": where, "cfg": where}


def test_a_failing_block_is_reported_by_page_block_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = ("```python\nimport os\nvalue = 41\n```\n\n```python\nvalue += 1\n"
            "open('written.txt', 'w').write(os.environ['CUDA_VISIBLE_DEVICES'] + '|')\n```\n\n"
            "```python\nassert value == 42\nmodel = build_model()\n```\n")
    page.write_text(text)
    run = run_blocks(parse_blocks(page), tmp_path / "work", hide_cuda=True)
    assert not run.ok
    assert run.report.startswith(f"{page} block 3 (line 12) failed"), run.report
    assert "NameError" in run.report and "build_model" in run.report
    assert f'File "{page}", line 13' in run.report  # the traceback points into the page
    # the blocks shared one namespace, ran in the temporary directory, with CUDA hidden
    assert (tmp_path / "work" / "written.txt").read_text() == "|"


def test_a_hanging_block_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nimport time\ntime.sleep(60)\n```\n")
    run = run_blocks(parse_blocks(page), tmp_path / "work", hide_cuda=True, timeout=8)
    assert not run.ok
    assert run.report.startswith(f"{page} block 2 (line 6) did not finish"), run.report
