"""The observe GPU tests read absolute device memory: each starts from a collected heap, so memory
that an earlier test (another package's, in the same process) left to the garbage collector is
not counted as this test's."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _collected_heap(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    yield
