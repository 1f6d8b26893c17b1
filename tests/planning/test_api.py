"""vramkit.plan (vramkit.planning.api): one call copies the model to the meta device once and
finds its blocks once, whatever it analyzes and calibrates."""

from __future__ import annotations

import functools
import importlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.planning import test_split_plans as split
from tests.planning._models import inputs, stack
from vramkit.planning.api import plan

MiB = 1 << 20


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count ``meta_copy`` and ``find_blocks`` wherever a planning module reaches them."""
    calls: Counter[str] = Counter()

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for module_name in ("api", "analysis", "calibration"):
        module = importlib.import_module(f"vramkit.planning.{module_name}")
        for name in ("meta_copy", "find_blocks"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


def test_a_split_inference_plan_copies_and_finds_blocks_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    p = plan(split._net(), (split._x(),), 5 * MiB, **split.OPTIONS)
    assert p.split  # the whole blocks were analyzed, then their units
    assert calls == {"meta_copy": 1, "find_blocks": 1}


def test_a_calibrated_training_plan_copies_and_finds_blocks_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # hardware=None measures the machine; a CPU "machine" stands in for the GPU here
    from vramkit.planning import api
    from vramkit.planning.machine import Machine

    monkeypatch.setattr(api, "machine_for", lambda hardware, target: Machine(
        "cpu", None, 1e9, 1e9, 1e12, None, 1e11))
    monkeypatch.setattr(api, "check_device", lambda *args, **kwargs: "cpu")
    monkeypatch.setattr(api, "calibrate_blocks", functools.partial(api.calibrate_blocks,
                                                                   repeats=1))
    calls = _count_calls(monkeypatch)
    p = plan(stack(), inputs(), 6 * MiB, headroom=0, autocast=None)
    assert p.notes and "measured on cpu" in p.notes[0]
    assert calls == {"meta_copy": 1, "find_blocks": 1}
