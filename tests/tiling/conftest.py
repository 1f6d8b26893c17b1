"""Fixtures shared by the exact-tiling tests: a tiny diffusers VAE and latents for it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tiling._models import tiny_vae


@pytest.fixture(scope="module")
def vae() -> Any:
    return tiny_vae(seed=3)


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.randn(2, 4, 8, 10, generator=torch.Generator().manual_seed(5))
