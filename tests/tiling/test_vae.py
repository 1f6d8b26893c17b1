"""VAETiling: config validation, tile planning, blend weights, blended tiling, attach/detach."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiling._models import one_torch_thread, tiny_vae
from vramkit.errors import ConfigError, VramkitError
from vramkit.tiling import (
    SeamReport,
    VAETiling,
    blend_weights_1d,
    plan_tiles,
    seam_error,
)

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"tile_size": 0}, {"tile_size": 8.0}, {"tile_size": True}, {"overlap": -1},
    {"tile_size": 64, "overlap": 64}, {"blend": "gaussian"}, {"exact_groupnorm": 1},
    {"scale_factor": 0}, {"scale_factor": 2.5}, {"exact_storage": "disk"},
    {"exact_device_budget": "lots"}, {"exact_device_budget": -5},
])
def test_invalid_config_raises_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        VAETiling(**kwargs)


def test_config_is_frozen_and_round_trips() -> None:
    tiling = VAETiling(tile_size=256, overlap=32, blend="cosine", exact_device_budget="1KiB")
    assert tiling.exact_device_budget == 1024
    with pytest.raises(AttributeError):
        tiling.tile_size = 1  # type: ignore[misc]
    assert VAETiling(**tiling.to_dict()) == tiling
    assert "_last_exact" not in tiling.to_dict()


# --------------------------------------------------------------------------------------------
# planning and weights
# --------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300), tile=st.integers(1, 80), data=st.data())
def test_plan_tiles_covers_axis_with_min_overlap(length: int, tile: int, data: st.DataObject) -> None:
    overlap = data.draw(st.integers(0, tile - 1))
    spans = plan_tiles(length, tile, overlap)
    assert spans[0].start == 0 and spans[-1].stop == length
    for a, b in itertools.pairwise(spans):
        assert b.start > a.start
        assert a.stop - b.start >= overlap  # neighbours share at least `overlap`
        assert a.overlap_after == b.overlap_before == a.stop - b.start
    for s in spans:
        assert s.stop - s.start == min(tile, length)


@settings(max_examples=150, deadline=None)
@given(length=st.integers(1, 120), tile=st.integers(1, 40), scale=st.integers(1, 4),
       blend=st.sampled_from(["linear", "cosine", "none"]), data=st.data())
def test_blend_weights_partition_unity(length: int, tile: int, scale: int, blend: str,
                                       data: st.DataObject) -> None:
    overlap = data.draw(st.integers(0, tile - 1))
    spans = plan_tiles(length, tile, overlap)
    weights = blend_weights_1d(spans, scale, blend, torch.float64)
    total = torch.zeros(length * scale, dtype=torch.float64)
    for span, w in zip(spans, weights, strict=True):
        assert torch.isfinite(w).all() and (w >= 0).all()
        total[span.start * scale:span.stop * scale] += w
    assert torch.allclose(total, torch.ones_like(total))
    # Weight 1 at the image border: the first pixel belongs to the first tile only.
    assert weights[0][0] == 1.0 and weights[-1][-1] == 1.0
    if blend == "none":  # each pixel from exactly one tile
        for w in weights:
            assert set(w.unique().tolist()) <= {0.0, 1.0}


def test_blend_modes_shape_the_ramp() -> None:
    spans = plan_tiles(24, 16, 8)
    linear, cosine, hard = (blend_weights_1d(spans, 1, b)[0] for b in ("linear", "cosine", "none"))
    ramp = slice(8, 16)
    assert torch.all(linear[ramp][1:] < linear[ramp][:-1])  # strictly falling across the overlap
    assert not torch.allclose(linear, cosine)
    assert hard[ramp].tolist() == [1.0] * 4 + [0.0] * 4


# --------------------------------------------------------------------------------------------
# blended tiling on callables
# --------------------------------------------------------------------------------------------


class CountingUpsampler:
    """Nearest-x``scale`` upsampling plus a per-call offset: tiles are visibly different."""

    def __init__(self, scale: int = 4) -> None:
        self.scale = scale
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return F.interpolate(x, scale_factor=self.scale, mode="nearest") + len(self.shapes)


def test_pointwise_model_is_reproduced_exactly_with_odd_sizes() -> None:
    def model(z: torch.Tensor) -> torch.Tensor:
        return F.interpolate(torch.tanh(z), scale_factor=8, mode="nearest")
    z = torch.randn(2, 4, 13, 11)
    for blend in ("linear", "cosine", "none"):
        out = VAETiling(tile_size=64, overlap=16, blend=blend, scale_factor=8).decode_tiled(model, z)
        assert out.shape == (2, 4, 104, 88)
        torch.testing.assert_close(out, model(z))


def test_tile_larger_than_image_is_one_call() -> None:
    model = CountingUpsampler()
    z = torch.randn(1, 3, 5, 7)
    out = VAETiling(tile_size=512, overlap=64).decode_tiled(model, z)
    # one probe (scale detection) + one tile
    assert len(model.shapes) == 2 and model.shapes[-1] == (1, 3, 5, 7)
    torch.testing.assert_close(out, F.interpolate(z, scale_factor=4) + 2)


def test_scale_factor_given_skips_probe_and_wrong_one_raises() -> None:
    model = CountingUpsampler()
    VAETiling(tile_size=16, overlap=4, scale_factor=4).decode_tiled(model, torch.randn(1, 1, 6, 6))
    assert model.shapes[0] == (1, 1, 4, 4)  # first call is a tile, not the 8x8-capped probe
    with pytest.raises(ConfigError, match="scale factor"):
        VAETiling(tile_size=16, overlap=0, scale_factor=2).decode_tiled(model,
                                                                        torch.randn(1, 1, 6, 6))


def test_tile_size_and_overlap_change_the_tiles() -> None:
    z = torch.randn(1, 1, 12, 12)
    calls = {}
    for tile, overlap in ((16, 0), (16, 8), (32, 8)):
        model = CountingUpsampler()
        VAETiling(tile_size=tile, overlap=overlap, scale_factor=4).decode_tiled(model, z)
        calls[(tile, overlap)] = model.shapes
    assert len(calls[(16, 0)]) == 9 and calls[(16, 0)][0] == (1, 1, 4, 4)
    assert len(calls[(16, 8)]) == 25  # overlap 2 latent px: 5 tiles per axis
    assert calls[(32, 8)][0] == (1, 1, 8, 8)


def test_blend_changes_seams_and_none_is_a_hard_cut() -> None:
    z = torch.zeros(1, 1, 8, 4)
    outs = {b: VAETiling(tile_size=16, overlap=8, blend=b, scale_factor=4).decode_tiled(
        CountingUpsampler(), z) for b in ("linear", "cosine", "none")}
    # Tiles along y are offset 1, 2, 3 (one probe-free call each): blended values in between.
    column = {b: o[0, 0, :, 0] for b, o in outs.items()}
    assert set(column["none"].unique().tolist()) <= {1.0, 2.0, 3.0}
    assert not torch.allclose(column["linear"], column["cosine"])
    assert column["linear"][0] == 1.0 and column["linear"][-1] == 3.0  # weight 1 at the border
    for o in outs.values():
        assert torch.isfinite(o).all()


def test_encode_tiled_callable_and_divisibility() -> None:
    def pool(x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, 4)
    x = torch.randn(1, 3, 40, 24)
    out = VAETiling(tile_size=16, overlap=8).encode_tiled(pool, x)
    torch.testing.assert_close(out, pool(x))
    with pytest.raises(ConfigError, match="multiple"):
        VAETiling(tile_size=16, overlap=8).encode_tiled(pool, torch.randn(1, 3, 42, 24))
    with pytest.raises(ConfigError, match="multiples"):
        VAETiling(tile_size=18, overlap=8).encode_tiled(pool, x)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ConfigError):
        VAETiling().decode_tiled(lambda z: z, torch.randn(4, 4))
    with pytest.raises(ConfigError):
        VAETiling().decode_tiled(42, torch.randn(1, 4, 4, 4))
    with pytest.raises(ConfigError, match="scale factor"):
        VAETiling().decode_tiled(lambda z: z[..., :3, :], torch.randn(1, 1, 8, 8))


def test_bfloat16_output_keeps_dtype_and_accumulates_in_float() -> None:
    def model(z: torch.Tensor) -> torch.Tensor:
        return F.interpolate(z, scale_factor=2)
    z = torch.randn(1, 2, 10, 10).bfloat16()
    out = VAETiling(tile_size=8, overlap=4, scale_factor=2).decode_tiled(model, z)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, model(z))


# --------------------------------------------------------------------------------------------
# seams
# --------------------------------------------------------------------------------------------


def test_seam_error_band_and_psnr() -> None:
    ref = torch.zeros(1, 3, 100, 100)
    out = ref.clone()
    out[..., 50, 10] = 0.2  # on a seam row
    out[..., 90, 90] = 1.0  # far from every seam
    report = seam_error(out, ref, seams_y=[50], seams_x=[], band_px=8, value_range=2.0)
    assert isinstance(report, SeamReport)
    assert report.max_abs_error == pytest.approx(0.5)
    assert report.seam_max_abs_error == pytest.approx(0.1)
    band_pixels = 3 * 16 * 100
    assert report.seam_psnr_db == pytest.approx(10 * math.log10(band_pixels / (3 * 0.01)), rel=1e-5)
    assert seam_error(ref, ref, [50]).psnr_db == math.inf
    assert seam_error(out, ref, []).seam_max_abs_error is None
    with pytest.raises(ConfigError):
        seam_error(out, ref[..., :50], [1])


# --------------------------------------------------------------------------------------------
# diffusers AutoencoderKL
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae() -> Any:
    return tiny_vae()


def test_blended_vae_decode_is_close_and_reports_seams(vae: Any) -> None:
    z = torch.randn(1, 4, 12, 10, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = vae.decode(z).sample
        tiling = VAETiling(tile_size=32, overlap=16)
        out = tiling.decode_tiled(vae, z)
        report = tiling.seam_report(vae, z, reference=ref)
    assert out.shape == ref.shape == (1, 3, 48, 40)
    # Per-tile GroupNorm statistics: close, not equal (random weights make it worse than real).
    assert 0 < (out - ref).abs().mean() < 0.5 * ref.abs().mean()
    assert report.seams_y and report.seams_x and report.seam_max_abs_error > 0


def test_blended_vae_encode_matches_shape_and_tile_covering_image_is_exact(vae: Any) -> None:
    x = torch.randn(2, 3, 32, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = vae.quant_conv(vae.encoder(x))
        one_tile = VAETiling(tile_size=32, overlap=0).encode_tiled(vae, x)
        tiled = VAETiling(tile_size=16, overlap=8).encode_tiled(vae, x)
    torch.testing.assert_close(one_tile, ref)
    assert tiled.shape == ref.shape and not torch.allclose(tiled, ref)


def test_attach_makes_decode_and_encode_tiled_and_detach_restores(vae: Any) -> None:
    from diffusers.models.autoencoders.vae import DecoderOutput
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    tiling = VAETiling(tile_size=16, overlap=8)
    with torch.no_grad():
        plain = vae.decode(z).sample
        handle = tiling.attach(vae)
        try:
            with pytest.raises(ConfigError, match="already"):
                tiling.attach(vae)
            tiled = vae.decode(z)
            assert isinstance(tiled, DecoderOutput)
            torch.testing.assert_close(tiled.sample, tiling.decode_tiled(vae, z))
            assert not torch.allclose(tiled.sample, plain)
            assert vae.decode(z, return_dict=False)[0].shape == plain.shape
            posterior = vae.encode(x).latent_dist
            torch.testing.assert_close(posterior.mean, tiling.encode_tiled(vae, x)[:, :4])
            assert vae(x).sample.shape == x.shape  # forward goes through both
        finally:
            handle.detach()
        assert not handle.attached
        torch.testing.assert_close(vae.decode(z).sample, plain)
    with pytest.raises(VramkitError):
        handle.detach()
    with pytest.raises(ConfigError):
        tiling.attach(torch.nn.Linear(2, 2))


def test_attach_as_context_manager(vae: Any) -> None:
    with VAETiling(tile_size=32, overlap=8).attach(vae) as handle:
        assert "decode" in vae.__dict__
    assert not handle.attached and "decode" not in vae.__dict__


def test_attach_wraps_through_the_patching_primitive(vae: Any) -> None:
    from vramkit.offload import _patch
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    tiling = VAETiling(tile_size=16, overlap=8)
    with torch.no_grad():
        plain = vae.decode(z).sample
        # An instance attribute that was there before attach() comes back on detach().
        before = vae.decode = functools.partial(type(vae).decode, vae)
        try:
            handle = tiling.attach(vae)
            assert _patch.find(vae, "tiling", "decode") is vae.decode
            assert _patch.find(vae, "tiling", "encode") is vae.encode
            handle.detach()
            assert vae.__dict__["decode"] is before
            assert _patch.find(vae, "tiling", "decode") is None
        finally:
            del vae.__dict__["decode"]
        # A replacement put on top after attach() survives detach(); tiling inside turns off.
        handle = tiling.attach(vae)
        tiled = vae.decode
        foreign = vae.decode = lambda *args, **kwargs: tiled(*args, **kwargs)
        try:
            handle.detach()
            assert vae.decode is foreign and not tiled.active
            torch.testing.assert_close(vae.decode(z).sample, plain)
        finally:
            del vae.__dict__["decode"]
    assert "decode" not in vae.__dict__ and "encode" not in vae.__dict__
