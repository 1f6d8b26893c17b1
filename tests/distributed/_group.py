"""A one-process gloo group, for what needs ``torch.distributed`` initialized but no peers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def single_rank_group() -> Iterator[None]:
    """``init_process_group("gloo")`` with this process as rank 0 of 1 (an in-memory store, no
    port), destroyed on the way out; skips where gloo is missing."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
