"""`vramkit.recipes.demo.config`: DemoConfig's checks and canonical values."""

from __future__ import annotations

import math

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.recipes.demo import DemoConfig


@pytest.mark.parametrize("field, value", [
    ("budget", "lots"), ("budget", 0), ("budget", -5), ("model_size", "huge"),
    ("model_size", "0MiB"), ("steps", 0), ("steps", 1.5), ("steps", True), ("batch_size", 0),
    ("device", "tpu"), ("device", "banana"), ("baseline", "yes"), ("report", "out.txt"),
    ("report", 3), ("lora_rank", 0), ("learning_rate", 0.0), ("learning_rate", math.nan),
    ("num_slots", 0), ("seed", -1), ("compile", "yes"), ("compile", 1),
])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ConfigError):
        DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_config_normalizes_sizes_and_report() -> None:
    config = DemoConfig(budget="2MiB", model_size="3MiB", report="")
    assert config.budget == 2 * 2**20
    assert config.model_size == 3 * 2**20
    assert config.report is None
    assert DemoConfig(model_size="small").model_size == "small"


def test_config_stores_canonical_values() -> None:
    config = DemoConfig(device="cpu", learning_rate=1, budget=1024)
    assert config.device == torch.device("cpu")
    assert config.learning_rate == 1.0 and isinstance(config.learning_rate, float)
    assert config.budget == 1024
