"""Shared checks of the `vramkit` command's errors, in this process and in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"


def run_vramkit(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m vramkit ARGV`` in a fresh interpreter (this checkout's sources first)."""
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), environment.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "vramkit", *argv], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def json_error(out: str) -> dict[str, Any]:
    """The one JSON object on ``out`` (fails on anything else there), with error and hint."""
    assert out.lstrip().startswith("{"), out
    data = json.loads(out)  # raises on a second document or any other text
    assert isinstance(data, dict), data
    # besides the text, only figures an error carries, as numbers
    assert {"error", "hint"} <= set(data) <= {"error", "hint", "minimum_budget_bytes"}, data
    assert all(isinstance(data[k], int) for k in set(data) - {"error", "hint"}), data
    assert isinstance(data["error"], str) and data["error"]
    assert isinstance(data["hint"], str) and data["hint"]
    return data


def check_error(code: int, out: str, err: str, *, sub: str, exit_code: int,
                as_json: bool = False, says: tuple[str, ...] = (),
                not_says: tuple[str, ...] = ()) -> str:
    """Assert a user error ended as the CLI promises; returns the error's text (message and
    hint) for further checks.

    Args:
        code / out / err: the exit code, stdout and stderr.
        sub: the sub-command (the prefix must read ``vramkit <sub>: error:``).
        exit_code: 2 for usage errors, 1 for runtime failures.
        as_json: ``--json`` was given: stdout is exactly one ``{"error", "hint"}`` object.
        says / not_says: texts the error must (not) contain.
    """
    assert code == exit_code, (code, out, err)
    assert "Traceback" not in out and "Traceback" not in err, err
    if as_json:
        data = json_error(out)
        text = f"{data['error']}\n{data['hint']}"
    else:
        lines = [line for line in err.splitlines() if ": error: " in line]
        assert lines, err
        assert all(line.startswith(f"vramkit {sub}: error: ") for line in lines), err
        assert "  hint: " in err, err
        text = err
    for part in says:
        assert part in text, (part, text)
    for part in not_says:
        assert part not in text, (part, text)
    return text
