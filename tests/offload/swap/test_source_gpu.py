"""On a GPU: a meta model loaded straight into pinned masters, the disk tier, and a swapper whose
pinning fails, all equal to the resident model."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from safetensors.torch import save_file

from tests.offload.swap.test_disk import BLOCK, _train
from tests.offload.swap.test_source import _meta, _reference
from vramkit.errors import VramkitWarning
from vramkit.offload.swap import BlockSwapper, SwapConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]

@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_reference().state_dict(), str(path))
    return path


def _expected() -> list[float]:
    return _train(_reference().cuda(), device="cuda")


@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
def test_checkpoint_into_pinned_masters_trains_like_the_resident_model(checkpoint: Path,
                                                                       background: bool) -> None:
    expected = _expected()
    net = _meta()
    with BlockSwapper(net, config=SwapConfig(min_param_bytes=1024), device="cuda",
                      checkpoint=checkpoint, load_in_background=background) as swapper:
        assert net.embed.weight.is_cuda
        losses = _train(net, device="cuda")  # in the background: blocks wait for their bytes
        swapper.wait_loaded()
        assert not swapper.stats().loading
        assert swapper.stats().pinned_bytes >= swapper.stats().swapped_bytes > 0
        assert all(b.master.is_pinned() for b in swapper.blocks)
    assert losses == expected


@pytest.mark.parametrize("source", ["checkpoint", "cache"])
def test_disk_tier_on_the_gpu_trains_identically(checkpoint: Path, tmp_path: Path,
                                                 source: str) -> None:
    expected = _expected()
    config = SwapConfig(min_param_bytes=1024, host_budget=3 * BLOCK,
                        disk_cache_dir=str(tmp_path))
    if source == "checkpoint":
        net = _meta()
        swapper = BlockSwapper(net, config=config, device="cuda", checkpoint=checkpoint)
    else:
        net = _reference()
        swapper = BlockSwapper(net, config=config, device="cuda")
    with swapper:
        stats = swapper.stats()
        assert stats.disk_blocks == 5 and stats.pinned_bytes <= 3 * BLOCK
        losses = _train(net, device="cuda")
        assert swapper.stats().disk_reads > 0
    assert losses == expected


def test_a_swapper_whose_pinning_fails_warns_once_and_trains_identically(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vramkit.memory._segments as segments

    real = segments.host_register_api()
    assert real is not None

    class Refusing:
        """The CUDA runtime, except that page-locking fails (a capped container)."""

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(segments, "host_register_api", lambda: Refusing())
    segments._reset_pin_fallback_warning()
    expected = _expected()
    net = _meta()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with BlockSwapper(net, config=SwapConfig(min_param_bytes=1024), device="cuda",
                          checkpoint=checkpoint) as swapper:
            stats = swapper.stats()
            assert stats.pageable_bytes == stats.pinned_bytes > 0
            losses = _train(net, device="cuda")
    ours = [w for w in caught if issubclass(w.category, VramkitWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert losses == expected
