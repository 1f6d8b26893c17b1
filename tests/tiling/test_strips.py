"""The strip runner: where planes live (device budget, pinned host), what a run moved, and the
pinned host buffers kept across runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tiling._models import one_torch_thread
from vramkit.tiling import VAETiling

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)



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
        assert stats.device_plane_bytes_peak <= (tiling.exact_device_budget
                                                 + stats.attention_kv_bytes)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

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
    from vramkit.tiling import _strips as impl

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
