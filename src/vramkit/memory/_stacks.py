"""Python allocation stacks: capture them cheaply, format them when a report asks.

Shared by the pool's allocation tracking (:mod:`vramkit.memory._arena`) and the leak detector
(:mod:`vramkit.observe.leaks`), so neither imports the other. A stack is kept unformatted, as
``(filename, line, function)`` per frame, innermost first; frames of the machinery (torch,
vramkit's memory and observe packages, contextlib, runpy) are left out, so what remains points at
user code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from types import FrameType

__all__ = ["STACK_UNKNOWN", "format_frames", "python_stack"]

#: What a stack reads as when none was recorded (or every frame was machinery).
STACK_UNKNOWN = ("<stack not recorded>",)
# Frames from these trees are the machinery, not the code that allocates (or leaks).
# The leak detector and profiler (vramkit/observe) capture stacks through this module too, so their
# own frames are machinery as well.
_SKIP_PATH_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}vramkit{os.sep}memory{os.sep}",
                    f"{os.sep}vramkit{os.sep}observe{os.sep}", f"{os.sep}contextlib.py",
                    f"{os.sep}runpy.py")

_machinery_cache: dict[str, bool] = {}


def _is_machinery(filename: str) -> bool:
    known = _machinery_cache.get(filename)
    if known is None:
        known = _machinery_cache[filename] = any(part in filename for part in _SKIP_PATH_PARTS)
    return known


def format_frames(frames: Iterable[tuple[str, int, str]], depth: int) -> tuple[str, ...]:
    """Innermost-first ``(filename, line, name)`` frames -> up to ``depth`` user frames."""
    out: list[str] = []
    for filename, line, name in frames:
        if _is_machinery(filename):
            continue
        out.append(f"{filename}:{line} in {name}")
        if len(out) >= depth:
            break
    return tuple(out) or STACK_UNKNOWN


def python_stack(depth: int) -> tuple[tuple[str, int, str], ...]:
    """The caller's user frames, innermost first, unformatted (formatting waits for a report)."""
    frame: FrameType | None = sys._getframe(2)
    frames = []
    # Walk a bounded number of frames: deep framework stacks would make every op slow.
    for _ in range(depth + 32):
        if frame is None or len(frames) >= depth:
            break
        code = frame.f_code
        if not _is_machinery(code.co_filename):
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(frames)
