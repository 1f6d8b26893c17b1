"""Masters filled in the background (``BlockSwapper(..., checkpoint=path)``): the swapper returns
before the swapped blocks are read, each block's first use waits for its own bytes, read errors
surface where a block is needed, and detach / state_dict / a failed attach never lose values."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.offload.swap.test_source import CONFIG, Net, _assert_same, _meta, _reference
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap.source import CheckpointSource


@pytest.fixture()
def reference() -> Net:
    return _reference()


@pytest.fixture()
def path(tmp_path: Path, reference: Net) -> Path:
    file = tmp_path / "model.safetensors"
    save_file(reference.state_dict(), str(file))
    return file


def _fill_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("vramkit-fill")]


@pytest.fixture()
def patch_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., list[str]]]:
    """``patch_reads(fail=prefix, delay=s)``: checkpoint reads of tensors whose name starts
    with ``fail`` raise OSError, every read first sleeps ``delay``; returns the names of the
    tensors in the order their reads started."""
    started: list[str] = []
    real = CheckpointSource.scatter_jobs

    def install(fail: str | None = None, delay: float = 0.0) -> list[str]:
        def scatter_jobs(self: CheckpointSource, targets: Any, piece: int
                         ) -> list[Callable[[], None]]:
            def wrapped(name: str, job: Callable[[], None]) -> Callable[[], None]:
                def run() -> None:
                    started.append(name)
                    time.sleep(delay)
                    if fail is not None and name.startswith(fail):
                        raise OSError(5, "Input/output error")
                    job()
                return run
            # one tensor at a time, so each read is known by its tensor's name
            return [wrapped(entry.name, job) for entry, dst in targets
                    for job in real(self, [(entry, dst)], piece)]

        monkeypatch.setattr(CheckpointSource, "scatter_jobs", scatter_jobs)
        return started

    yield install
    assert not _fill_threads(), "a fill thread outlived its swapper"


def test_the_swapper_returns_before_the_masters_are_read_and_the_forward_waits(
        path: Path, reference: Net, patch_reads: Callable[..., list[str]]) -> None:
    started = patch_reads(delay=0.05)
    net = _meta()
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    assert swapper.stats().loading  # 10 reads of 50 ms on 8 threads: still under way
    _assert_same(net, reference)  # each block waited for its own bytes
    swapper.wait_loaded()
    stats = swapper.stats()
    assert not stats.loading and stats.load_seconds > 0
    # Filled in execution order: a block's reads start after the ones before it.
    blocks = [int(name.split(".")[1]) for name in started if name.startswith("blocks.")]
    assert blocks == sorted(blocks) and set(blocks) == set(range(5))
    swapper.detach()


def test_a_read_error_surfaces_where_the_block_is_needed(
        path: Path, reference: Net, patch_reads: Callable[..., list[str]]) -> None:
    patch_reads(fail="blocks.3.")
    net = _meta()
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    with pytest.raises(OffloadError, match=r"blocks\.3.*Input/output error") as info:
        net(torch.randn(2, 16))
    assert "checkpoint" in info.value.hint
    with pytest.raises(OffloadError, match=r"blocks\.3"):
        swapper.wait_loaded()
    # Detach still undoes everything; the block never read goes back to meta, the rest has
    # its values.
    with pytest.raises(OffloadError, match="meta"):
        swapper.detach()
    lost = {"blocks.3.up.weight", "blocks.3.down.weight"}  # its swapped tensors
    ref = reference.state_dict()
    for name, value in net.state_dict().items():
        if name in lost:
            assert value.is_meta, name
        else:
            assert value.device.type == "cpu" and torch.equal(value, ref[name]), name


def test_a_failed_foreground_load_gives_a_materialized_model_its_values_back(
        path: Path, reference: Net, patch_reads: Callable[..., list[str]]) -> None:
    patch_reads(fail="blocks.2.")
    net = _reference(seed=1)  # on the CPU with other values: the checkpoint's would win
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(OffloadError, match=r"blocks\.2"):
        BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path,
                     load_in_background=False)
    # What was read has the checkpoint's values; the swapped tensors of the block whose read
    # failed keep the model's own (so may later blocks', the fill stopped at the error);
    # nothing is left on meta or as a placeholder.
    after, ref = net.state_dict(), reference.state_dict()
    for name, value in after.items():
        assert value.device.type == "cpu", name
        swapped = name.endswith(("up.weight", "down.weight"))
        if swapped and name.startswith("blocks.2."):
            assert torch.equal(value, before[name]), name
        elif swapped and name.startswith(("blocks.3.", "blocks.4.")):
            assert torch.equal(value, before[name]) or torch.equal(value, ref[name]), name
        else:
            assert torch.equal(value, ref[name]), name


def test_detach_and_state_dict_during_the_load_wait_for_it(
        path: Path, reference: Net, patch_reads: Callable[..., list[str]]) -> None:
    patch_reads(delay=0.05)
    ref = reference.state_dict()
    net = _meta()
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    saved = net.state_dict()  # reads each master as it is filled
    assert all(torch.equal(saved[k], v) for k, v in ref.items())
    net2 = _meta()
    swapper2 = BlockSwapper(net2, config=CONFIG, device="cpu", checkpoint=path)
    assert swapper2.stats().loading
    swapper2.detach()  # waits: the weights come back with their values
    assert all(torch.equal(net2.state_dict()[k], v) for k, v in ref.items())
    swapper.detach()


def test_trainable_swapped_weights_load_before_the_constructor_returns(
        path: Path, reference: Net) -> None:
    net = _meta()
    net.blocks.requires_grad_(True)
    swapper = BlockSwapper(net, config=SwapConfig(min_param_bytes=1024, trainable="cpu"),
                           device="cpu", checkpoint=path)
    assert not swapper.stats().loading  # host_parameters() are the masters: filled already
    ref = reference.state_dict()
    host = swapper.host_parameters()
    assert host and all(not p.is_meta for p in host)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in ref.items())
    swapper.detach()


def test_load_in_background_is_checked(path: Path, reference: Net) -> None:
    with pytest.raises(ConfigError, match="load_in_background"):
        BlockSwapper(reference, config=CONFIG, device="cpu", load_in_background=False)
    with pytest.raises(ConfigError, match="load_in_background"):
        BlockSwapper(_meta(), config=CONFIG, device="cpu", checkpoint=path,
                     load_in_background="yes")  # type: ignore[arg-type]


def test_scatter_jobs_merge_neighbouring_tensors_into_large_reads(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(100 + i, generator=g).to(torch.bfloat16) for i in range(6)}
    tensors["wide"] = torch.randn(50, generator=g)  # fp32 in the file, read into bf16
    file = tmp_path / "t.safetensors"
    save_file(tensors, str(file))
    source = CheckpointSource(_ScatterNet(tensors), file)
    try:
        def targets() -> list[tuple[Any, torch.Tensor]]:
            return [(source.checkpoint.entry(name), torch.empty(t.shape, dtype=torch.bfloat16))
                    for name, t in reversed(list(tensors.items()))]  # any order in memory

        merged = targets()
        jobs = source.scatter_jobs(merged, 1 << 20)
        # the six bf16 tensors follow each other in the file: one read; the fp32 one converts
        assert len(jobs) == 2
        small = targets()
        split = source.scatter_jobs(small, 64)  # 64-byte requests: tensors split across reads
        assert len(split) > 20
        for done in (merged, small):
            for job in jobs if done is merged else split:
                job()
            for entry, dst in done:
                assert torch.equal(dst, tensors[entry.name].to(torch.bfloat16)), entry.name
    finally:
        source.close()


class _ScatterNet(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, torch.empty(t.shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("lead_blocks", [0, 2.5])
def test_masters_are_pinned_no_further_ahead_of_the_reads_than_the_lead(
        path: Path, reference: Net, patch_reads: Callable[..., list[str]],
        monkeypatch: pytest.MonkeyPatch, lead_blocks: float) -> None:
    # LEAD blocks ahead at least, more while they hold less than LEAD_BYTES (here 0 bytes:
    # the block rule alone, or two and a half blocks' bytes: one block more).
    from vramkit.offload.swap import fill as fill_module
    from vramkit.offload.swap import host as host_module

    patch_reads(delay=0.02)
    ahead: list[tuple[int, int]] = []  # unread blocks before the one pinned, their bytes
    real = host_module.HostStore._give_master

    def give_master(self: Any, block: Any) -> torch.Tensor:
        fill = self.filler
        if fill is not None and fill.covers(block):
            earlier = fill.blocks[:fill.blocks.index(block)]
            unread = [b for b in earlier if not fill._pending[id(b)].event.is_set()]
            ahead.append((len(unread), sum(b.nbytes for b in unread)))
        return real(self, block)

    monkeypatch.setattr(host_module.HostStore, "_give_master", give_master)
    net = _meta()
    block_bytes = BlockSwapper.footprint(reference.blocks[0], CONFIG).swapped  # 5 equal
    monkeypatch.setattr(fill_module, "LEAD_BYTES", int(lead_blocks * block_bytes))
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    swapper.wait_loaded()
    most = max(count for count, _ in ahead)
    assert len(ahead) >= 3 and fill_module.LEAD == 2
    # A block is pinned while fewer than LEAD are unread, or they hold under LEAD_BYTES.
    assert all(count < 2 or nbytes < fill_module.LEAD_BYTES for count, nbytes in ahead)
    assert most == (1 if lead_blocks == 0 else 2)  # the lead was used, not more
    _assert_same(net, reference)
    figures = swapper._host.filler.figures()
    assert figures["mean_in_flight"] > 0 and len(figures["blocks"]) == len(ahead)
    assert all(0 <= pinned <= filled for _, _, pinned, filled in figures["blocks"])
    swapper.detach()


def test_few_fill_reads_run_while_the_resident_tensors_load(
        path: Path, reference: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.offload.swap import host as host_module

    monkeypatch.setattr(host_module, "_fill_threads", lambda: 6)
    lock = threading.Lock()
    running = [0]
    peak = {"resident": 0, "after": 0}
    phase = ["resident"]
    real_scatter = CheckpointSource.scatter_jobs
    real_load = CheckpointSource.load_to_device

    def scatter_jobs(self: CheckpointSource, targets: Any, piece: int
                     ) -> list[Callable[[], None]]:
        def counted(job: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                with lock:
                    running[0] += 1
                    peak[phase[0]] = max(peak[phase[0]], running[0])
                time.sleep(0.1)
                job()
                with lock:
                    running[0] -= 1
            return run
        return [counted(job) for entry, dst in targets
                for job in real_scatter(self, [(entry, dst)], piece)]

    def load_to_device(self: CheckpointSource, tensors: Any, device: Any) -> Any:
        time.sleep(0.15)  # the fill runs meanwhile
        placed = real_load(self, tensors, device)
        with lock:
            phase[0] = "after"
        return placed

    monkeypatch.setattr(CheckpointSource, "scatter_jobs", scatter_jobs)
    monkeypatch.setattr(CheckpointSource, "load_to_device", load_to_device)
    net = _meta()
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    swapper.wait_loaded()
    assert 1 <= peak["resident"] <= host_module.RESIDENT_LOAD_FILL_JOBS
    assert peak["after"] > host_module.RESIDENT_LOAD_FILL_JOBS  # the limit is lifted after it
    _assert_same(net, reference)
    swapper.detach()


def test_a_resident_load_that_fails_beside_the_background_fill_stops_it(
        path: Path, reference: Net, patch_reads: Callable[..., list[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The fill starts before the resident tensors load and runs throttled beside them: when
    # that load fails, the attach must stop the fill (no thread left: the fixture checks), close
    # the checkpoint once, and give a materialized model its own values back.
    patch_reads(delay=0.02)

    def broken(self: CheckpointSource, tensors: Any, device: Any) -> Any:
        time.sleep(0.05)  # the fill is under way
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(CheckpointSource, "load_to_device", broken)
    closes: list[int] = []
    real_close = CheckpointSource.close

    def close(self: CheckpointSource) -> None:
        closes.append(1)
        real_close(self)

    monkeypatch.setattr(CheckpointSource, "close", close)
    net = _reference(seed=1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(OSError, match="Input/output"):
        BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    assert closes == [1]
    after = net.state_dict()
    for name, value in after.items():
        assert value.device.type == "cpu", name
        # swapped tensors: the model's own values or (read before the stop) the checkpoint's
        assert torch.equal(value, before[name]) or torch.equal(value, reference.state_dict()[name])
