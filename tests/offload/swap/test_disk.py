"""The disk tier (SwapConfig(host_budget=...)): frozen blocks that do not fit in the host budget
are read from disk ahead of use, and training is identical to the all-in-RAM run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.offload.swap.test_source import Net, _meta, _reference
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload.swap import BlockSwapper, SwapConfig

BLOCK = 65536  # bytes of one Block's swapped master (two fp32 64x128 weights)


def _config(budget: str | int | None, cache: Path | None = None, **kw: object) -> SwapConfig:
    return SwapConfig(min_param_bytes=1024, host_budget=budget,
                      disk_cache_dir=str(cache) if cache else None, **kw)  # type: ignore[arg-type]


def _train(net: Net, steps: int = 3, device: str = "cpu") -> list[float]:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        x = torch.randn(3, 16, generator=gen).to(device)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_reference().state_dict(), str(path))
    return path


def test_block_bytes_constant_matches_the_swapper() -> None:
    assert BlockSwapper.footprint(_reference().blocks[0], _config(None)).swapped == BLOCK


@pytest.mark.parametrize("budget_blocks", [3, 3.5, 4])
def test_disk_tier_from_the_checkpoint_trains_identically(checkpoint: Path, tmp_path: Path,
                                                          budget_blocks: float) -> None:
    expected = _train(_reference())
    net = _meta()
    budget = int(budget_blocks * BLOCK)
    swapper = BlockSwapper(net, config=_config(budget, tmp_path / "cache"), device="cpu",
                           checkpoint=checkpoint)
    stats = swapper.stats()
    assert stats.disk_blocks >= 2 and stats.pinned_bytes <= budget
    assert swapper._host.cache is None  # the checkpoint holds the bytes as they are: no cache
    assert _train(net) == expected
    stats = swapper.stats()
    assert stats.disk_reads > 0 and stats.disk_read_bytes >= stats.disk_reads * BLOCK // 2
    assert stats.disk_hits > 0  # the last blocks of forward, first again in backward
    swapper.detach()
    assert all(p.device.type == "cpu" and not p.is_meta for p in net.parameters())


def test_disk_tier_from_model_weights_uses_a_cache_file_that_leaves_nothing(
        tmp_path: Path) -> None:
    expected = _train(_reference())
    net = _reference()
    cache = tmp_path / "cache"
    swapper = BlockSwapper(net, config=_config(3 * BLOCK, cache), device="cpu")
    assert swapper.stats().disk_blocks == 5
    assert swapper._host.cache is not None
    assert list(cache.iterdir()) == []  # unlinked as soon as it was open
    assert _train(net) == expected
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    swapper.detach()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in trained.items())


def test_checkpoint_in_another_dtype_goes_through_the_cache(tmp_path: Path) -> None:
    ref = _reference().to(torch.bfloat16)
    ref.blocks.requires_grad_(False)
    path = tmp_path / "model.safetensors"
    save_file({k: v.float() for k, v in ref.state_dict().items()}, str(path))
    net = _meta(torch.bfloat16)
    with BlockSwapper(net, config=_config(2 * BLOCK, tmp_path), device="cpu",
                      checkpoint=path) as swapper:
        assert swapper._host.cache is not None
        x = torch.randn(3, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(net(x), ref(x))
            assert torch.equal(net(x), ref(x))  # inference wraps around: again


def test_state_dict_reads_disk_blocks_and_loads_into_them_are_refused(checkpoint: Path,
                                                                      tmp_path: Path) -> None:
    ref = _reference()
    net = _meta()
    with BlockSwapper(net, config=_config(3 * BLOCK, tmp_path), device="cpu",
                      checkpoint=checkpoint):
        saved = net.state_dict()
        assert all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())
        with pytest.raises(OffloadError, match="kept on disk"):
            net.load_state_dict(ref.state_dict())


def test_a_budget_that_holds_everything_keeps_nothing_on_disk(checkpoint: Path) -> None:
    with BlockSwapper(_meta(), config=_config("1GiB"), device="cpu",
                      checkpoint=checkpoint) as swapper:
        assert swapper.stats().disk_blocks == 0 and swapper._host.disk is None


def test_a_budget_below_the_staging_buffers_names_the_smallest(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"at least 192\.0 KiB"):
        BlockSwapper(_meta(), config=_config(2 * BLOCK), device="cpu", checkpoint=checkpoint)


def test_trainable_swapped_weights_cannot_go_to_disk(tmp_path: Path) -> None:
    net = _reference()
    net.blocks.requires_grad_(True)
    with pytest.raises(ConfigError, match="frozen weights only"):
        BlockSwapper(net, config=_config(3 * BLOCK, tmp_path, trainable="cpu"), device="cpu")


def test_a_failing_read_raises_instead_of_hanging(checkpoint: Path, tmp_path: Path) -> None:
    net = _meta()
    swapper = BlockSwapper(net, config=_config(3 * BLOCK, tmp_path), device="cpu",
                           checkpoint=checkpoint)
    os.truncate(checkpoint, 4096)  # the file shrinks under the swapper
    with pytest.raises(OffloadError, match="reading a swapped block from disk failed"):
        for _ in range(3):
            with torch.no_grad():
                net(torch.randn(2, 16))
    with pytest.raises(OffloadError, match="unexpected end"):  # nothing to restore from
        swapper.detach()


def test_an_unwritable_cache_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cache directory"):
        BlockSwapper(_reference(), config=_config(3 * BLOCK, blocker / "sub"), device="cpu")


@pytest.mark.parametrize("kw", [{"host_budget": -1}, {"host_budget": "lots"},
                                {"disk_cache_dir": 3}, {"disk_cache_dir": ""}])
def test_config_validation(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SwapConfig(**kw)  # type: ignore[arg-type]


def test_disk_knobs_that_would_change_nothing_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no disk tier without host_budget"):
        SwapConfig(disk_cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="trainable='swap'"):
        SwapConfig(host_budget="8GiB", trainable="swap")
    for knob in ({"strict": False}, {"progress": True}):
        with pytest.raises(ConfigError, match="applies to checkpoint="):
            BlockSwapper(_reference(), config=_config(None), device="cpu",
                         **knob)  # type: ignore[arg-type]
