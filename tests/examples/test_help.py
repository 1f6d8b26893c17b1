"""Every example answers --help without loading a model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.examples._load import EXAMPLES


@pytest.mark.parametrize("name", ["train_flux_lora", "train_llm_lora_trainer", "generate_flux",
                                  "tiny_models"])
def test_help(name: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
