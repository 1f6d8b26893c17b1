"""Exact mode: GroupNorm statistics merged across tiles, chunked attention, exact decode/encode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.tiling._models import one_torch_thread, tiny_vae
from vramkit.errors import ConfigError
from vramkit.tiling import (
    ChunkedAttnProcessor,
    VAETiling,
    chunked_attention,
    group_stats,
    merge_group_stats,
    use_chunked_attention,
)

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(data=st.data(), groups=st.sampled_from([1, 2, 4]), per_group=st.integers(1, 3),
       width=st.integers(1, 6), cuts=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_chan_merge_of_strips_equals_full_statistics(data: st.DataObject, groups: int,
                                                     per_group: int, width: int,
                                                     cuts: list[int]) -> None:
    channels = groups * per_group
    height = sum(cuts)
    values = data.draw(arrays(np.float32, (2, channels, height, width),
                              elements=st.floats(-1e3, 1e3, width=32)))
    x = torch.from_numpy(values) + 100.0  # an offset: naive sum-of-squares would lose digits
    merged = None
    row = 0
    for rows in cuts:
        merged = merge_group_stats(merged, group_stats(x[:, :, row:row + rows], groups))
        row += rows
    flat = x.double().reshape(2, groups, -1)
    assert torch.allclose(merged.count, torch.full_like(merged.count, flat.shape[-1]))
    torch.testing.assert_close(merged.mean, flat.mean(-1), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(merged.variance(), flat.var(-1, unbiased=False),
                               rtol=1e-4, atol=1e-3)


def test_group_stats_channels_last_and_bad_groups() -> None:
    x = torch.randn(1, 8, 5, 7)
    a = group_stats(x, 4)
    b = group_stats(x.to(memory_format=torch.channels_last), 4)
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close(a.m2, b.m2)
    with pytest.raises(ConfigError):
        group_stats(x, 3)


# --------------------------------------------------------------------------------------------
# chunked attention
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 7, 100])
def test_chunked_attention_is_exact(chunk: int | None) -> None:
    q, k, v = (torch.randn(2, 3, 50, 16) for _ in range(3))
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # a tiny score budget forces many blocks on the default (math) path
    got = chunked_attention(q, k, v, query_chunk=chunk, max_score_bytes=2 * 50 * 4 * 6)
    torch.testing.assert_close(got, expect)


def test_chunked_processor_matches_diffusers_attention() -> None:
    vae = tiny_vae()
    attn = vae.decoder.mid_block.attentions[0]
    h = torch.randn(1, 32, 9, 11)
    with torch.no_grad():
        expect = attn(h)
        with use_chunked_attention(vae.decoder) as switched:
            assert switched == 1 and isinstance(attn.processor, ChunkedAttnProcessor)
            got = attn(h)
        assert not isinstance(attn.processor, ChunkedAttnProcessor)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError):
        ChunkedAttnProcessor(query_chunk=0)


# --------------------------------------------------------------------------------------------
# exact decode / encode
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae() -> Any:
    return tiny_vae(seed=3)


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.randn(2, 4, 8, 10, generator=torch.Generator().manual_seed(5))


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


@pytest.mark.parametrize(("storage", "budget", "device_used", "host_used"), [
    ("device", None, True, False),
    ("host", None, False, True),
    ("auto", 0, False, True),
    ("auto", "16KiB", True, True),
    ("auto", "1GiB", True, False),
])
def test_exact_storage_and_budget_place_planes(vae: Any, latents: torch.Tensor, storage: str,
                                               budget: object, device_used: bool,
                                               host_used: bool) -> None:
    tiling = VAETiling(tile_size=32, exact_groupnorm=True, exact_storage=storage,
                       exact_device_budget=budget)
    with torch.no_grad():
        out = tiling.decode_tiled(vae, latents[:1])
        ref = vae.decode(latents[:1]).sample
    stats = tiling.last_exact_stats
    placed = stats.step_records[:-1]  # the last step writes the result tensor
    assert any(not r.out_on_host for r in placed) is device_used
    assert any(r.out_on_host for r in placed) is host_used
    assert (stats.host_plane_bytes_peak > 0) is host_used
    # the mid block's keys and values always live on the device, counted against the budget
    assert stats.attention_kv_bytes > 0
    if budget is not None:
        assert stats.device_plane_bytes_peak <= tiling.exact_device_budget + \
            stats.attention_kv_bytes
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("storage", ["host", "device"])
def test_exact_stats_add_up(vae: Any, latents: torch.Tensor, storage: str) -> None:
    tiling = VAETiling(tile_size=4, exact_groupnorm=True, exact_storage=storage)
    with torch.no_grad():
        tiling.decode_tiled(vae, latents[:1])
    stats = tiling.last_exact_stats
    records = stats.step_records
    assert stats.steps == len(records) and stats.strips == sum(r.strips for r in records)
    assert stats.h2d_bytes == sum(r.h2d_bytes for r in records)
    assert stats.d2h_bytes == sum(r.d2h_bytes for r in records)
    names = [r.name for r in records]
    assert names[0] == "conv_in" and names[-1] == "conv_out"
    assert "mid_block.attentions.0" in names  # the attention runs as a step, not untiled
    # every pixel of a host plane is downloaded exactly once ...
    downloaded = sum(c * h * w * 4 for r in records if r.out_on_host
                     for c, h, w in [r.out_shape])
    assert stats.d2h_bytes == downloaded
    if storage == "device":
        assert stats.h2d_bytes == 0 and stats.host_plane_bytes_peak == 0
    else:
        # ... and uploaded at least once per reader (more with halos and residuals)
        assert stats.h2d_bytes > stats.d2h_bytes > 0
    assert stats.timings() is None  # CUDA events only


def test_host_buffers_are_reused_best_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.tiling import _exact as impl

    class FakePinnedPool:
        def tensor(self, shape: tuple[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype)

        def trim(self) -> int:
            return 0

    monkeypatch.setattr(impl, "_PINNED_POOL", FakePinnedPool())
    monkeypatch.setattr(impl, "_HOST_FREE", [])
    big, new_big = impl._take_host_buffer(1000, pinned=True)
    small, new_small = impl._take_host_buffer(100, pinned=True)
    assert (new_big, new_small) == (1000, 100)
    impl._return_host_buffer(big, pinned=True)
    impl._return_host_buffer(small, pinned=True)
    again, new = impl._take_host_buffer(80, pinned=True)  # best fit: the 100-byte one
    assert new == 0 and again.numel() == 100
    bigger, new = impl._take_host_buffer(2000, pinned=True)  # nothing fits: a new buffer
    assert new == 2000 and bigger.numel() == 2000
    assert impl.release_host_buffers() == 1000
    _, new = impl._take_host_buffer(1000, pinned=True)
    assert new == 1000


def test_attention_step_keys_values_count_against_budget(vae: Any,
                                                         latents: torch.Tensor) -> None:
    # A budget of exactly one latent plane: the planes before the attention fit, but while the
    # keys and values are alive the attention's output plane must go to the host.
    plane = 32 * latents.shape[2] * latents.shape[3] * 4
    tiling = VAETiling(tile_size=4, exact_groupnorm=True, exact_device_budget=plane)
    with torch.no_grad():
        out = tiling.decode_tiled(vae, latents[:1])
        ref = vae.decode(latents[:1]).sample
    records = {r.name: r for r in tiling.last_exact_stats.step_records}
    assert not records["conv_in"].out_on_host
    assert records["mid_block.attentions.0"].out_on_host
    assert tiling.last_exact_stats.attention_kv_bytes == 2 * plane
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
