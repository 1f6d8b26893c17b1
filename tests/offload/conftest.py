"""Fixtures shared by the offload tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture()
def deterministic_cuda() -> Iterator[None]:
    """GPU comparisons in full fp32 (no TF32), and no kernel left running into the next test."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.cuda.synchronize()
