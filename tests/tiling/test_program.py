"""Exact decode/encode: the VAE as a program of strip-wise steps equals the untiled VAE."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tiling._models import one_torch_thread
from vramkit.errors import ConfigError
from vramkit.tiling import VAETiling

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)



def test_exact_decode_matches_untiled(vae: Any, latents: torch.Tensor) -> None:
    with torch.no_grad():
        ref = vae.decode(latents).sample
        exact = VAETiling(tile_size=4, exact_groupnorm=True)
        out = exact.decode_tiled(vae, latents)
        blended = VAETiling(tile_size=16, overlap=8).decode_tiled(vae, latents)
    stats = exact.last_exact_stats
    assert stats is not None and stats.strips > stats.steps  # really split into strips
    assert len(stats.seam_rows) > 3
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (blended - ref).abs().max() > 100 * (out - ref).abs().max()


def test_exact_seam_report_is_near_zero(vae: Any, latents: torch.Tensor) -> None:
    with torch.no_grad():
        report = VAETiling(tile_size=8, exact_groupnorm=True).seam_report(vae, latents[:1])
    assert report.seams_y and report.seam_max_abs_error < 1e-5 and report.seam_psnr_db > 100


def test_exact_tile_size_sets_strip_count(vae: Any, latents: torch.Tensor) -> None:
    small, large = VAETiling(tile_size=2, exact_groupnorm=True), VAETiling(tile_size=64,
                                                                           exact_groupnorm=True)
    with torch.no_grad():
        a = small.decode_tiled(vae, latents[:1])
        b = large.decode_tiled(vae, latents[:1])
    assert small.last_exact_stats.strips > large.last_exact_stats.strips
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

def test_exact_encode_matches_untiled(vae: Any) -> None:
    x = torch.randn(1, 3, 32, 24, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = vae.quant_conv(vae.encoder(x))
        tiling = VAETiling(tile_size=4, exact_groupnorm=True)
        out = tiling.encode_tiled(vae, x)
        with tiling.attach(vae):
            posterior = vae.encode(x).latent_dist
    assert tiling.last_exact_stats.strips > tiling.last_exact_stats.steps
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(posterior.mean, ref[:, :4], rtol=1e-5, atol=1e-5)


def test_exact_odd_latent_and_bare_decoder(vae: Any) -> None:
    z = torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = vae.decoder(z)
        out = VAETiling(tile_size=4, exact_groupnorm=True).decode_tiled(vae.decoder, z)
    assert out.shape == (1, 3, 28, 20)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_exact_mode_rejects_unsupported_models(vae: Any) -> None:
    with pytest.raises(ConfigError, match="AutoencoderKL"):
        VAETiling(exact_groupnorm=True).decode_tiled(lambda z: z, torch.randn(1, 4, 8, 8))
    with pytest.raises(ConfigError, match="AutoencoderKL"):
        VAETiling(exact_groupnorm=True).encode_tiled(lambda x: x, torch.randn(1, 3, 8, 8))
    saved = vae.decoder.conv_act
    vae.decoder.conv_act = torch.nn.Softmax(dim=1)  # not pointwise: cannot be tiled
    try:
        with pytest.raises(ConfigError, match="pointwise"):
            VAETiling(exact_groupnorm=True).decode_tiled(vae, torch.randn(1, 4, 8, 8))
    finally:
        vae.decoder.conv_act = saved
