"""Shared test set-up: hardware gates for the `gpu` and `multigpu` markers."""

from __future__ import annotations

import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_gpu = [i for i in items if "gpu" in i.keywords or "multigpu" in i.keywords]
    if not needs_gpu:
        return
    count = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in needs_gpu:
        if count == 0:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and count < 2:
            item.add_marker(skip_multi)
