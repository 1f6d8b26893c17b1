"""The planner's host budget plans the swapper's disk tier: blocks whose masters do not fit stay
on disk (the swapper's own rule, ``BlockSwapper.disk_split``), their reads paced by the disk;
``vramkit.fit`` applies it and the model trains exactly as before."""

from __future__ import annotations

import pytest
import torch

import vramkit
from tests.planning._models import inputs, stack
from vramkit.errors import ConfigError, PlanError
from vramkit.offload.swap import BlockSwapper

MiB = 1 << 20
OPTIONS = {"hardware": "rtx4090", "headroom": 0, "autocast": None}
BUDGET = 6 * MiB


def _plan(**options: object) -> vramkit.Plan:
    return vramkit.plan(stack(), inputs(), BUDGET, **OPTIONS, **options)


def test_a_host_budget_that_holds_the_masters_changes_nothing() -> None:
    free = _plan()
    assert free.swapped and not free.disk_blocks
    held = _plan(host_budget=free.host_bytes)
    assert held.disk_blocks == () and held.swap_host_budget is None
    assert held.predicted_step_seconds == free.predicted_step_seconds
    text = held.explain()  # swapped, nothing on disk
    assert f"Swap {len(held.swapped)} of" in text
    assert "no swapping" not in text and "on disk" not in text


def test_a_smaller_host_budget_keeps_blocks_on_disk_as_the_swapper_would() -> None:
    free = _plan()
    plan = _plan(host_budget=free.host_bytes // 2, disk_bytes_per_s=2e9)
    assert plan.disk_blocks and set(plan.disk_blocks) <= set(plan.swapped)
    assert plan.host_bytes <= free.host_bytes // 2
    assert plan.swap_host_budget == free.host_bytes // 2  # no activation offload here
    assert plan.disk_bytes_per_s == 2e9
    # the swapper's own rule on the same sizes picks the same blocks
    sizes = [BlockSwapper.footprint(stack().get_submodule(n)).swapped for n in plan.swapped]
    split = BlockSwapper.disk_split(sizes, [True] * len(sizes), plan.swap_host_budget)
    assert split is not None
    assert tuple(plan.swapped[i] for i in split.on_disk) == plan.disk_blocks
    # the disk paces the copies: slower than the all-in-RAM plan, and it says so
    assert plan.predicted_step_seconds > free.predicted_step_seconds
    assert "on disk" in plan.explain() and "2.00 GB/s" in plan.explain()
    assert tuple(plan.to_dict()["disk_blocks"]) == plan.disk_blocks


def test_a_slower_disk_predicts_a_slower_step_and_the_default_is_said() -> None:
    host = _plan().host_bytes // 2
    fast = _plan(host_budget=host, disk_bytes_per_s=4e9)
    slow = _plan(host_budget=host, disk_bytes_per_s=0.25e9)
    assert slow.predicted_step_seconds > fast.predicted_step_seconds
    assert slow.forward.copy_seconds > fast.forward.copy_seconds
    assumed = _plan(host_budget=host)
    assert any("assumed at 1.0 GB/s" in note for note in assumed.notes)
    assert not any("assumed" in note for note in fast.notes)


def test_more_host_budget_never_keeps_more_on_disk_nor_predicts_slower() -> None:
    full = _plan().host_bytes
    plans = [_plan(host_budget=full * share // 8, disk_bytes_per_s=1e9) for share in (4, 6, 8)]
    disk = [len(p.disk_blocks) for p in plans]
    steps = [p.predicted_step_seconds for p in plans]
    assert disk == sorted(disk, reverse=True)
    assert steps == sorted(steps, reverse=True)


def test_a_host_budget_too_small_even_for_the_disk_tier_raises() -> None:
    with pytest.raises(PlanError, match="host budget") as info:
        _plan(host_budget=64 * 1024)
    assert "host_budget" in info.value.hint


def test_a_bad_disk_bandwidth_is_refused() -> None:
    for bad in (0, -1.0, "fast", float("nan")):
        with pytest.raises(ConfigError, match="disk_bytes_per_s"):
            _plan(host_budget=MiB, disk_bytes_per_s=bad)


def test_fit_applies_the_disk_tier_and_trains_exactly_like_the_unfitted_model(tmp_path) -> None:
    from safetensors.torch import save_file

    reference = stack()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    host = _plan().host_bytes // 2
    model = stack(device="meta")
    fitted = vramkit.fit(model, inputs(), BUDGET, checkpoint=path, host_budget=host,
                         device="cpu", **OPTIONS)
    plan = fitted.plan
    assert plan.disk_blocks and plan.disk_bytes_per_s is not None  # measured on the file
    assert not any("assumed" in note for note in plan.notes)
    stats = fitted.swapper.stats()
    assert stats.disk_blocks == len(plan.disk_blocks)
    assert stats.pinned_bytes <= host
    params = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    (x,) = inputs()
    for net, ps in ((model, params), (reference, ref_params)):
        opt = torch.optim.SGD(ps, lr=0.1)
        for _ in range(2):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)
    fitted.detach()
