"""GPU tests: the memory strategy is really enforced by PyTorch and by JAX.

Each test runs in a fresh interpreter, because a memory fraction and JAX's allocator settings
are per process and fixed once CUDA / the JAX backend started. Uses the real default detector.

Run on a GPU machine::

    PYTHONPATH=src python -m pytest tests/devices/test_manager_gpu.py -v
"""

from __future__ import annotations

import importlib.util
import textwrap
from typing import Any

import pytest

from tests._child import run_child

pytestmark = pytest.mark.gpu


_CLEARED = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS",
            "XLA_FLAGS", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_PRELUDE = """
import json, os, sys
import torch
from vramkit.devices.manager import DeviceConfiguration, DeviceManager
result = {}
"""


def run_script(body: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``body`` after the prelude in a fresh interpreter; return its ``result`` dict."""
    script = _PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    return run_child(script, drop=_CLEARED, timeout=timeout)  # type: ignore[no-any-return]


_TORCH_FRACTION_BODY = """
dm = DeviceManager(DeviceConfiguration(memory_strategy="custom", memory_fraction=0.05),
                   apply={apply})
result["has_gpu"] = dm.has_gpu
device = torch.device("cuda", dm.gpu_ids[0])
total = torch.cuda.get_device_properties(device).total_memory
small = torch.empty(int(total * 0.03), dtype=torch.uint8, device=device)
del small
torch.cuda.empty_cache()
try:
    big = torch.empty(int(total * 0.08), dtype=torch.uint8, device=device)
    result["big"] = "allocated"
    del big
except torch.OutOfMemoryError:
    result["big"] = "oom"
"""


def test_pytorch_enforces_custom_fraction() -> None:
    result = run_script(_TORCH_FRACTION_BODY.format(apply=True))
    assert result["has_gpu"] is True
    # 3% of the GPU fits under the 5% cap (the script got that far); 8% must not.
    assert result["big"] == "oom"


def test_pytorch_without_apply_is_not_capped() -> None:
    # Control for the test above: the same 8% allocation succeeds when nothing is applied.
    result = run_script(_TORCH_FRACTION_BODY.format(apply=False))
    assert result["big"] == "allocated"


_JAX_BODY = """
dm = DeviceManager(DeviceConfiguration(memory_strategy="custom", memory_fraction={fraction},
                                       preallocate={preallocate}))
device_index = dm.gpu_ids[0]
free_before, total = torch.cuda.mem_get_info(device_index)
import jax, jax.numpy as jnp
devices = jax.devices()
result["platform"] = devices[0].platform
if result["platform"] == "gpu":
    jax.device_put(jnp.ones(1024), devices[0]).block_until_ready()
    stats = devices[0].memory_stats() or {{}}
    result["bytes_limit"] = stats.get("bytes_limit")
    free_after, _ = torch.cuda.mem_get_info(device_index)
    result["used_by_jax"] = free_before - free_after
result["total"] = total
"""


def _jax_gpu_result(fraction: float, preallocate: bool) -> dict[str, Any]:
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed")
    result = run_script(_JAX_BODY.format(fraction=fraction, preallocate=preallocate))
    if result["platform"] != "gpu":
        pytest.skip(f"JAX has no GPU backend here (platform {result['platform']})")
    return result


def test_jax_bytes_limit_follows_fraction() -> None:
    result = _jax_gpu_result(0.25, preallocate=False)
    assert result["bytes_limit"] is not None, "JAX's allocator reports no bytes_limit"
    ratio = result["bytes_limit"] / result["total"]
    assert 0.25 * 0.97 <= ratio <= 0.25 * 1.03, ratio
    # Preallocation off: JAX took far less than its limit.
    assert result["used_by_jax"] < 0.10 * result["total"]


def test_jax_preallocates_when_asked() -> None:
    result = _jax_gpu_result(0.3, preallocate=True)
    ratio = result["bytes_limit"] / result["total"]
    assert 0.3 * 0.97 <= ratio <= 0.3 * 1.03, ratio
    assert result["used_by_jax"] >= 0.27 * result["total"]
