"""Allocation stacks leave the machinery's frames out, the observe package's included."""

from __future__ import annotations

import os

import pytest

from vramkit.memory._stacks import STACK_UNKNOWN, format_frames


@pytest.mark.parametrize("package", ["memory", "observe"])
def test_frames_of_vramkit_memory_and_observe_are_machinery(package: str) -> None:
    inside = os.path.join(os.sep, "site", "vramkit", package, "leaks.py")
    user = os.path.join(os.sep, "home", "me", "train.py")
    assert format_frames([(inside, 10, "track")], depth=4) == STACK_UNKNOWN
    assert format_frames([(inside, 10, "track"), (user, 3, "step")], depth=4) == (
        f"{user}:3 in step",)
