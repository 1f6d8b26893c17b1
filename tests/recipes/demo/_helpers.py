"""What the demo's tests share: a tiny CPU configuration that writes no report."""

from __future__ import annotations

from vramkit.recipes.demo import DemoConfig

TINY = dict(model_size="tiny", device="cpu", report=None)


def tiny_config(**overrides: object) -> DemoConfig:
    """The tiny CPU demo, with ``overrides``."""
    return DemoConfig(**{**TINY, **overrides})  # type: ignore[arg-type]
