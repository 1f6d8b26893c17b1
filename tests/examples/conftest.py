"""Tiny models written to disk once per test session, in the layouts the examples read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples._load import example


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("tiny")
    example("tiny_models").main(["--out", str(root)])
    return root
