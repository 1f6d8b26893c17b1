"""Small diffusers VAEs for the tiling tests (random weights, built from config, no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def tiny_vae(seed: int = 0, groups: int = 8, levels: int = 3) -> Any:
    """An AutoencoderKL of scale factor ``2 ** (levels - 1)`` with a mid-block attention.

    Args:
        seed: weight seed (default 0).
        groups: GroupNorm groups (default 8).
        levels: number of down/up blocks (default 3: scale factor 4).

    Returns:
        The model in eval mode, float32, on the CPU.
    """
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(seed)
    channels = (16, 32, 32, 32)[:levels]
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=channels,
        layers_per_block=1, latent_channels=4, norm_num_groups=groups, sample_size=64).eval()


def sdxl_vae_config() -> dict[str, Any]:
    """The SDXL VAE's architecture (stabilityai/sdxl-vae config.json), for building from config."""
    return {
        "in_channels": 3, "out_channels": 3, "latent_channels": 4,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
        "norm_num_groups": 32, "act_fn": "silu", "sample_size": 1024,
        "scaling_factor": 0.13025,
    }


@pytest.fixture(scope="module", autouse=False)
def one_torch_thread() -> Any:
    """Run a module's tests on one intra-op thread (restored after).

    The many small, differently shaped convolutions of tiled runs are dominated by OpenMP
    hand-offs on a shared 2-core CI machine: one thread is 10-40x faster there.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
