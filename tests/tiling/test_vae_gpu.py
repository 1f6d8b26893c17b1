"""VAE tiling on a CUDA GPU: pinned host planes with async copies, bf16, chunked attention."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tiling._models import sdxl_vae_config, tiny_vae
from vramkit.tiling import (
    VAETiling,
    chunked_attention,
    release_host_buffers,
    use_chunked_attention,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def vae_cuda() -> Any:
    return tiny_vae(seed=11).cuda()


@pytest.fixture(autouse=True)
def no_tf32() -> Any:
    """Exactness is tested in true fp32: with TF32, cuDNN picks different algorithms (and
    roundings) for a tile's shape than for the whole image's, which is not a tiling error."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("storage", ["device", "host"])
def test_exact_decode_on_gpu_matches_untiled_fp32(vae_cuda: Any, storage: str) -> None:
    z = torch.randn(2, 4, 40, 24, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    tiling = VAETiling(tile_size=16, exact_groupnorm=True, exact_storage=storage)
    with torch.no_grad():
        ref = vae_cuda.decode(z).sample
        out = tiling.decode_tiled(vae_cuda, z)
    stats = tiling.last_exact_stats
    assert stats.strips > stats.steps
    assert (stats.host_plane_bytes_peak > 0) is (storage == "host")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_exact_encode_on_gpu_with_host_planes(vae_cuda: Any) -> None:
    x = torch.randn(1, 3, 96, 64, device="cuda")
    tiling = VAETiling(tile_size=8, exact_groupnorm=True, exact_storage="host")
    with torch.no_grad():
        ref = vae_cuda.quant_conv(vae_cuda.encoder(x))
        out = tiling.encode_tiled(vae_cuda, x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_chunked_attention_head_dim_512_bf16() -> None:
    q, k, v = (torch.randn(1, 1, 4096, 512, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    expect = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    for chunk in (None, 1000):
        got = chunked_attention(q, k, v, query_chunk=chunk)
        torch.testing.assert_close(got.float(), expect, rtol=2e-2, atol=2e-2)


def test_sdxl_vae_1024_exact_fp32_and_blended_bf16_memory() -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**sdxl_vae_config()).cuda().eval()
    z = torch.randn(1, 4, 128, 128, device="cuda")
    # The accuracy target (2/255, 45 dB at seams) in fp32, the SDXL VAE's usual dtype
    # (in bf16 two different convolution algorithms already differ by several bf16 ulps).
    with torch.no_grad(), use_chunked_attention(vae):
        ref = vae.decode(z).sample
    exact = VAETiling(tile_size=128, exact_groupnorm=True, exact_device_budget="256MiB")
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        report = exact.seam_report(vae, z, reference=ref)
    stats = exact.last_exact_stats
    assert stats.host_plane_bytes_peak > 0
    assert report.max_abs_error <= 2 / 255 and report.seam_psnr_db >= 45
    # The cap is honest: budget (or the attention's keys+values, always on the device) + the
    # output image + a bounded strip working set (24 strips' elements, see docs/tiling.md).
    working_set = 24 * 128 * 128 * 256 * 4
    extra = torch.cuda.max_memory_allocated() - baseline
    assert extra <= max(256 << 20, stats.attention_kv_bytes) + ref.nbytes + working_set
    del ref
    vae = vae.to(torch.bfloat16)
    z = z.to(torch.bfloat16)
    with torch.no_grad(), use_chunked_attention(vae):
        ref = vae.decode(z).sample
    blended = VAETiling(tile_size=256, overlap=32)
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = blended.decode_tiled(vae, z)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    # one 256x256 tile's activations, not the 1024x1024 image's (the untiled decode needs ~5 GB)
    assert torch.cuda.max_memory_allocated() - weights < 1.5e9


def test_exact_host_breakdown_and_buffer_reuse(vae_cuda: Any) -> None:
    z = torch.randn(1, 4, 64, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    tiling = VAETiling(tile_size=8, exact_groupnorm=True, exact_storage="host")
    release_host_buffers()  # earlier tests' buffers would serve the first run
    with torch.no_grad():
        first = tiling.decode_tiled(vae_cuda, z)
        first_stats = tiling.last_exact_stats
        second = tiling.decode_tiled(vae_cuda, z)
    stats = tiling.last_exact_stats
    assert first_stats.host_bytes_newly_pinned > 0
    assert stats.host_bytes_newly_pinned == 0  # the first run's pinned buffers were reused
    assert stats.h2d_bytes == first_stats.h2d_bytes > stats.d2h_bytes > 0
    timings = stats.timings()
    assert timings is not None and len(timings["step_ms"]) == stats.steps
    assert 0 <= timings["copy_wait_ms"] <= timings["steps_ms"] + 1e-3
    torch.testing.assert_close(first, second)
