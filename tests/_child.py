"""Run test code in a fresh Python interpreter (backends that start once per process).

The child sees ``src/`` on ``PYTHONPATH`` and must print one JSON object as its last line of
output; :func:`run_child` returns it and fails the test with the child's output otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"


def run_child(code: str, *, env: Mapping[str, str] | None = None, drop: Iterable[str] = (),
              timeout: float = 180, cwd: str | Path | None = None) -> Any:
    """Run ``code`` (dedented) in a new interpreter; return the JSON on its last stdout line.

    Args:
        code: the program; its last line of output must be JSON.
        env: variables to set in the child (on top of this process's environment).
        drop: variables removed from the inherited environment first.
        timeout: seconds before the child is killed (the test then fails).
        cwd: working directory of the child.
    """
    dropped = set(drop)
    child_env = {k: v for k, v in os.environ.items() if k not in dropped}
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), child_env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the child printed nothing; stderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])
