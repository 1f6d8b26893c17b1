"""``vramkit.distributed`` in one process: the environment, the refusals without a process group,
the swapper's gradient hook, planning one rank, and a one-rank gloo group."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import Stack, grads_of, mlp, present_grads
from tests.distributed._group import single_rank_group
from tests.planning._models import inputs, stack
from vramkit.distributed import (
    GradientAverager,
    NodeSharedMasters,
    broadcast_masters,
    ddp_bucket_bytes,
    init_from_env,
    plan_for_rank,
    shared_swapper,
    shutdown,
    wrap_ddp,
)
from vramkit.errors import ConfigError, PlanError, VramkitWarning
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.planning.analysis import analyze
from vramkit.planning.api import plan

MiB = 1 << 20
CONFIG = SwapConfig(min_param_bytes=0)
# What a launcher (torchrun, SLURM) sets; a plain ``python`` has none of it.
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Net(Stack):
    """Trainable input/output layers around residual MLP blocks (frozen unless ``full``), with
    ``lora`` a trainable matrix applied after every block."""

    def __init__(self, full: bool = False, lora: bool = False) -> None:
        super().__init__(lambda: mlp(32, 64), 3, inp=(12, 32), out=(32, 5), seed=0,
                         frozen=not full)
        self.lora = nn.Parameter(torch.randn(32, 32) * 0.1) if lora else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
            if self.lora is not None:
                x = x + x @ self.lora
        return self.out(x)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)


def _loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    x, y = _batch(seed)
    return nn.functional.mse_loss(model(x), y)


@pytest.fixture()
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture()
def group() -> Iterator[None]:
    with single_rank_group():
        yield


@pytest.fixture(autouse=True)
def _no_group_left() -> Iterator[None]:
    yield
    assert not torch.distributed.is_initialized(), "a test left a process group behind"


# -- init_from_env ------------------------------------------------------------------------------


def _expected_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def test_without_torchrun_the_job_is_this_process(no_torchrun_env: None) -> None:
    info = init_from_env()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)
    assert info.backend is None and info.is_main
    assert info.device == _expected_device()
    assert not torch.distributed.is_initialized()  # no group for a job of one


def test_world_size_1_without_a_launcher_creates_no_group(no_torchrun_env: None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    info = init_from_env(backend="gloo")
    assert (info.rank, info.world_size, info.backend, info.device) == (0, 1, None,
                                                                       torch.device("cpu"))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK", "LOCAL_RANK"])
def test_a_malformed_variable_is_a_config_error_with_a_hint(
        no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "abc")
    with pytest.raises(ConfigError, match=f"{name}='abc' is not an integer") as info:
        init_from_env()
    assert info.value.hint is not None and "torchrun" in info.value.hint


def test_an_unknown_backend_is_refused(no_torchrun_env: None) -> None:
    with pytest.raises(ConfigError, match="backend"):
        init_from_env(backend="mpi")


def test_nccl_without_a_gpu_per_rank_is_refused(no_torchrun_env: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    monkeypatch.setenv("LOCAL_RANK", str(gpus))  # one past the last GPU
    with pytest.raises(ConfigError, match="NCCL needs a GPU per local rank") as info:
        init_from_env(backend="nccl")
    assert "gloo" in (info.value.hint or "")


# -- without a process group -------------------------------------------------------------------


def test_the_explicit_collectives_need_an_initialized_group() -> None:
    assert not torch.distributed.is_initialized()
    model = Net()
    with pytest.raises(ConfigError, match="not initialized") as info:
        NodeSharedMasters()
    assert "init_process_group" in (info.value.hint or "")
    with pytest.raises(ConfigError, match=r"GradientAverager needs torch\.distributed"):
        GradientAverager()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        with pytest.raises(ConfigError, match=r"broadcast_masters needs torch\.distributed"):
            broadcast_masters(swapper)
        with pytest.raises(ConfigError, match=r"needs torch\.distributed") as info:
            wrap_ddp(model, swapper, find_unused_parameters=True)  # DDP options, no DDP
        assert "init_from_env" in (info.value.hint or "")
        assert swapper._gradient_hook is None  # nothing was installed on the way
    finally:
        swapper.detach()


def test_one_script_runs_alone_too_shared_swapper_and_wrap_ddp_without_a_group() -> None:
    """``python train.py`` (no torchrun): shared_swapper is a plain swapper, wrap_ddp gives the
    model back, and training is what it is without vramkit.distributed."""
    assert not torch.distributed.is_initialized()
    reference, model = Net(), Net()
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        assert swapper.master_memory is None and swapper.swapped_names
        assert wrap_ddp(model, swapper) is model
        x, y = _batch()
        for net in (model, reference):
            nn.functional.mse_loss(net(x), y).backward()
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            if a.requires_grad:
                assert torch.equal(a.grad, b.grad), name
    finally:
        swapper.detach()


# -- the swapper's gradient hook ---------------------------------------------------------------


def test_a_gradient_hook_must_be_callable() -> None:
    model = Net(full=True)
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0, trainable="cpu"),
                           device="cpu")
    try:
        with pytest.raises(ConfigError, match="hook must be callable") as info:
            swapper.set_gradient_hook("x")  # type: ignore[arg-type]
        assert "hook(block_name, grads)" in (info.value.hint or "")
        swapper.set_gradient_hook(None)  # None removes it: fine
    finally:
        swapper.detach()


def _full_cpu_swapper() -> tuple[nn.Module, BlockSwapper, dict[str, torch.Tensor]]:
    """A fully trainable Net with trainable="cpu" swapping, and the gradients one unswapped
    backward of the same loss gives."""
    reference = Net(full=True)
    _loss(reference).backward()
    model = Net(full=True)
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0, trainable="cpu"),
                           device="cpu")
    return model, swapper, present_grads(reference)


def test_the_gradient_hook_sees_each_swapped_blocks_complete_gradients() -> None:
    model, swapper, want = _full_cpu_swapper()
    calls: list[tuple[str, list[torch.Tensor]]] = []
    swapper.set_gradient_hook(lambda name, grads: calls.append(
        (name, [g.detach().clone() for g in grads])))
    try:
        _loss(model).backward()
        swapper.sync_gradients()
        names = [name for name, _ in calls]
        assert sorted(names) == sorted(b.name for b in swapper.blocks)
        assert len(names) == len(set(names))  # once per block and step
        for block in swapper.blocks:
            grads = next(g for n, g in calls if n == block.name)
            entries = block.trainable_entries
            assert len(grads) == len(entries)
            for e, g in zip(entries, grads, strict=True):
                qualified = next(n for n, p in model.named_parameters() if p is e.tensor)
                assert torch.allclose(g, want[qualified], atol=1e-6), qualified
        assert grads_of(model, swapper).keys() == want.keys()
    finally:
        swapper.detach()


def test_the_gradient_hook_can_change_the_gradients_in_place() -> None:
    model, swapper, want = _full_cpu_swapper()

    def zero(name: str, grads: list[torch.Tensor]) -> None:
        for g in grads:
            g.mul_(0)

    swapper.set_gradient_hook(zero)
    try:
        _loss(model).backward()
        swapper.sync_gradients()
        got = grads_of(model, swapper)
        swapped = {n for n, p in model.named_parameters()
                   if any(p is e.tensor for b in swapper.blocks for e in b.trainable_entries)}
        assert swapped and swapped < got.keys()
        for name, g in got.items():
            if name in swapped:
                assert torch.count_nonzero(g) == 0, name  # what reaches the host and optimizer
            else:
                assert torch.allclose(g, want[name], atol=1e-6), name  # resident: untouched
    finally:
        swapper.detach()


def test_a_hook_is_not_needed_in_a_job_of_one_process() -> None:
    reference = Net(full=True)
    _loss(reference).backward()
    model = Net(full=True)
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0, trainable="cpu"),
                           device="cpu")
    try:
        _loss(model).backward()  # no group: nothing to reduce, nothing refused
        swapper.sync_gradients()
        got, want = grads_of(model, swapper), present_grads(reference)
        assert got.keys() == want.keys()
        assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)
    finally:
        swapper.detach()


# -- planning one rank -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cost() -> Any:
    return analyze(stack(device="meta"), inputs(device="meta"), mode="train", autocast=None)


def _plan(cost: Any, budget: int, **kw: Any) -> Any:
    return plan(stack(device="meta"), inputs(device="meta"), budget, cost=cost,
                hardware="rtx4090", headroom=0, **kw)


def _minimum(cost: Any, **kw: Any) -> int:
    with pytest.raises(PlanError) as info:
        _plan(cost, 2 * MiB, **kw)
    assert info.value.minimum_budget is not None
    return info.value.minimum_budget


def test_reserved_bytes_raise_the_budget_a_plan_needs(cost: Any) -> None:
    reserved = MiB
    base, more = _minimum(cost), _minimum(cost, reserved_bytes=reserved)
    assert more == base + reserved
    # The named minimum works, and the reserved bytes stay free of the predicted peak.
    fitted = _plan(cost, more, reserved_bytes=reserved)
    assert fitted.predicted_peak_bytes <= more - reserved
    assert fitted.headroom_bytes == reserved
    with pytest.raises(PlanError):
        _plan(cost, base, reserved_bytes=reserved)  # enough without the reservation only
    assert _plan(cost, base).predicted_peak_bytes <= base


def test_reserved_bytes_are_kept_free_on_top_of_the_headroom(cost: Any) -> None:
    budget = 8 * MiB
    free = _plan(cost, budget)
    held = _plan(cost, budget, reserved_bytes="1MiB")
    assert held.headroom_bytes == free.headroom_bytes + MiB
    assert held.predicted_peak_bytes <= budget - MiB
    assert len(held.swapped) >= len(free.swapped)


def test_reserved_bytes_are_validated(cost: Any) -> None:
    with pytest.raises(ConfigError, match="reserved_bytes"):
        _plan(cost, 8 * MiB, reserved_bytes=-1)


def test_ddp_buckets_hold_one_copy_of_the_trainable_gradients() -> None:
    model = stack(device="meta")
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert trainable == 6 * 2 * 4 * 256 * 4  # lora_a and lora_b of six blocks, fp32
    assert ddp_bucket_bytes(model) == trainable
    tied = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tied[1].weight = tied[0].weight  # a shared parameter is reduced once
    assert ddp_bucket_bytes(tied) == (64 + 8 + 8) * 4
    tied.requires_grad_(False)
    assert ddp_bucket_bytes(tied) == 0


def test_plan_for_rank_keeps_ddps_buckets_free(cost: Any) -> None:
    model, xs = stack(device="meta"), inputs(device="meta")
    buckets = ddp_bucket_bytes(model)
    budget = 8 * MiB
    alone = _plan(cost, budget)
    rank = plan_for_rank(model, xs, budget, hardware="rtx4090", headroom=0, cost=cost)
    assert rank.headroom_bytes == alone.headroom_bytes + buckets
    assert rank.predicted_peak_bytes <= budget - buckets
    view = plan_for_rank(model, xs, budget, hardware="rtx4090", headroom=0, cost=cost,
                         gradient_as_bucket_view=True)
    assert view.headroom_bytes == alone.headroom_bytes  # the buckets are the gradients
    more = plan_for_rank(model, xs, budget, hardware="rtx4090", headroom=0, cost=cost,
                         reserved_bytes=MiB)
    assert more.headroom_bytes == alone.headroom_bytes + buckets + MiB
    with pytest.raises(ConfigError, match="gradient_as_bucket_view"):
        plan_for_rank(model, xs, budget, hardware="rtx4090", cost=cost,
                      gradient_as_bucket_view="yes")  # type: ignore[arg-type]


# -- a one-rank gloo group ---------------------------------------------------------------------


def test_alone_on_its_node_a_rank_pins_its_own_masters(group: None) -> None:
    model = Net(lora=True)
    reference = copy.deepcopy(model)
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        assert swapper.master_memory is None  # nothing to share with
        stats = swapper.stats()
        assert stats.swapped_blocks > 0 and stats.shared_bytes == 0
        assert not any(swapper.is_shared(b) for b in swapper.blocks)
        x, _ = _batch()
        assert torch.equal(model(x), reference(x))
    finally:
        swapper.detach()


def test_shared_swapper_chooses_its_master_memory(group: None) -> None:
    with pytest.raises(ConfigError, match="chooses master_memory"):
        shared_swapper(Net(), "blocks.*", CONFIG, device="cpu", master_memory=None)


def test_wrap_ddp_trains_like_the_unwrapped_model(group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    reference = Net(lora=True)
    model = copy.deepcopy(reference)
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        ddp = wrap_ddp(model, swapper)
        assert isinstance(ddp, DistributedDataParallel) and ddp.module is model
        assert swapper._gradient_hook is None  # frozen swapped weights: nothing to average
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad],
                                    lr=1e-2)
        opt = torch.optim.AdamW(swapper.optimizer_parameters(), lr=1e-2)
        for step in range(2):
            _loss(reference, step).backward()
            _loss(ddp, step).backward()
            got, want = present_grads(model), present_grads(reference)
            assert got.keys() == want.keys() and "lora" in got
            for name in want:
                assert torch.allclose(got[name], want[name], atol=1e-6), (step, name)
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
    finally:
        swapper.detach()


def test_wrap_ddp_averages_swapped_trainable_gradients_through_the_hook(group: None) -> None:
    reference = Net(full=True)
    model = copy.deepcopy(reference)
    swapper = shared_swapper(model, "blocks.*", SwapConfig(min_param_bytes=0, trainable="cpu"),
                             device="cpu")
    try:
        ddp = wrap_ddp(model, swapper)  # inp and out still reduce through DDP
        hook = swapper._gradient_hook
        assert isinstance(hook, GradientAverager) and hook.world_size == 1
        _loss(reference).backward()
        _loss(ddp).backward()
        swapper.sync_gradients()
        assert hook.calls == len(swapper.blocks)
        assert hook.bytes == sum(e.nbytes for b in swapper.blocks for e in b.trainable_entries)
        got, want = grads_of(model, swapper), present_grads(reference)
        assert got.keys() == want.keys()
        assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)
    finally:
        swapper.detach()


def test_wrap_ddp_returns_the_model_when_the_swapper_reduces_everything(group: None) -> None:
    model = Net(full=True)
    model.inp.requires_grad_(False)
    model.out.requires_grad_(False)
    swapper = shared_swapper(model, "blocks.*", SwapConfig(min_param_bytes=0, trainable="cpu"),
                             device="cpu")
    try:
        assert wrap_ddp(model, swapper) is model
        assert isinstance(swapper._gradient_hook, GradientAverager)
    finally:
        swapper.detach()


def test_wrap_ddp_refusals(group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = Net(lora=True)
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        with pytest.raises(ConfigError, match="attached to another model"):
            wrap_ddp(Net(lora=True), swapper)
        ddp = DistributedDataParallel(model)  # plain DDP after attaching: fine
        with pytest.raises(ConfigError, match="already wraps") as info:
            wrap_ddp(ddp, swapper)
        assert "swap first, then wrap" in (info.value.hint or "")
    finally:
        swapper.detach()


def test_broadcast_masters_alone_has_no_frozen_copy_to_send_and_changes_nothing(
        group: None) -> None:
    """One rank owns the only writable copy of the frozen masters: nothing to broadcast."""
    model = Net()
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        x, _ = _batch()
        before = model(x)
        assert swapper.stats().swapped_bytes > 0
        assert broadcast_masters(swapper) == 0
        assert torch.equal(model(x), before)
    finally:
        swapper.detach()


def test_gradient_averager_over_one_rank_leaves_gradients_unchanged(group: None) -> None:
    averager = GradientAverager()
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(4, 6, generator=g),                           # fp32, alone: in place
        torch.randn(3, 5, generator=g, dtype=torch.float64),      # fp64, alone
        torch.randn(7, 3, generator=g).t(),                       # fp32, non-contiguous
        torch.randn(9, generator=g).to(torch.bfloat16),           # bf16 with a strided one:
        torch.randn(6, 4, generator=g).to(torch.bfloat16)[:, ::2],  # flattened and copied back
    ]
    assert not grads[2].is_contiguous() and not grads[4].is_contiguous()
    originals = [t.clone() for t in grads]
    averager("blocks.0", grads)
    for got, want in zip(grads, originals, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    assert averager.calls == 1
    assert averager.bytes == sum(t.numel() * t.element_size() for t in originals)


def test_a_launchers_job_of_one_process_gets_a_group_of_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun --nproc_per_node 1`` sets MASTER_ADDR and WORLD_SIZE=1: the job is real (a
    group exists, so wrap_ddp and the collectives work), not a plain one-process run."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not torch.distributed.is_initialized()
    try:
        info = init_from_env(backend="gloo")
        assert torch.distributed.is_initialized()
        assert (info.rank, info.world_size, info.backend) == (0, 1, "gloo")
        assert info.device == torch.device("cpu")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_bad_arguments_are_refused_before_any_collective(group: None) -> None:
    from vramkit.distributed import NodeSharedMasters

    with pytest.raises(ConfigError, match="timeout_seconds"):
        init_from_env(timeout_seconds=0)
    with pytest.raises(ConfigError, match="directory"):
        NodeSharedMasters(directory="")
    model = Net()
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    try:
        with pytest.raises(ConfigError, match="broadcast"):
            wrap_ddp(model, swapper, broadcast="yes")
    finally:
        swapper.detach()


# -- sharded uploads, one process -----------------------------------------------------------------


def test_sharded_uploads_need_a_group_and_a_known_mode() -> None:
    from vramkit.distributed import ShardedUploads, node_uploads

    with pytest.raises(ConfigError, match="not initialized"):
        ShardedUploads(None)
    with pytest.raises(ConfigError, match="uploads"):
        shared_swapper(Net(), "blocks.*", CONFIG, device="cpu", uploads="fast")
    with pytest.raises(ConfigError, match="chooses block_loader"):
        shared_swapper(Net(), "blocks.*", CONFIG, device="cpu", block_loader=None)
    # without a group: nothing to share the copies with, whatever the mode
    assert node_uploads(torch.device("cpu"), "sharded") is None


def test_a_rank_alone_on_its_node_copies_whole_blocks(group: None) -> None:
    from vramkit.distributed import node_uploads

    assert node_uploads(torch.device("cpu"), "sharded") is None  # one rank: no one to gather
    assert node_uploads(torch.device("cpu"), "auto") is None
    swapper = shared_swapper(Net(), "blocks.*", CONFIG, device="cpu", uploads="sharded")
    try:
        assert swapper.block_loader is None
    finally:
        swapper.detach()


def test_sharded_uploads_pad_blocks_to_aligned_pieces(group: None) -> None:
    from vramkit.distributed import ShardedUploads

    loader = ShardedUploads(None, min_bytes=0)
    assert loader.world_size == 1 and loader.padded_bytes(1000) == 1000  # one rank: no padding
    loader.world_size = 3  # the arithmetic for three ranks
    padded = loader.padded_bytes(1000)
    assert padded % (3 * 256) == 0 and 1000 <= padded < 1000 + 3 * 256
    assert ShardedUploads(None).padded_bytes(1000) == 1000  # under min_bytes: whole


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _ddp_after_a_backward() -> tuple[nn.Module, BlockSwapper]:
    model = Net(lora=True)
    swapper = shared_swapper(model, "blocks.*", CONFIG, device="cpu")
    ddp = wrap_ddp(model, swapper)
    _loss(ddp, 0).backward()  # DDP's all-reduce ran on gloo's worker threads
    return ddp, swapper


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_shutdown_ends_the_group_and_gloos_threads_once_ddp_is_gone() -> None:
    """The last all-reduce of a backward must not be freed by a gloo thread at interpreter exit
    (an abort): with DDP dropped, ``shutdown`` destroys the group and its threads end then."""
    dist = torch.distributed
    assert shutdown() is False  # no group: nothing to do
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp, swapper = _ddp_after_a_backward()
    swapper.detach()
    del ddp
    before = _native_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shutdown() is True
    assert not dist.is_initialized()
    assert _native_threads() < before  # gloo's workers joined, while the interpreter is whole


def test_shutdown_warns_when_a_ddp_module_still_holds_the_group() -> None:
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp, swapper = _ddp_after_a_backward()
    try:
        with pytest.warns(VramkitWarning, match=r"1 DistributedDataParallel .*del ddp"):
            assert shutdown() is True
        assert not dist.is_initialized()
    finally:
        swapper.detach()
        del ddp
        if dist.is_initialized():
            dist.destroy_process_group()
