"""On a GPU: the machine and one block of each kind are measured, and vramkit.fit with a plan
made by measuring trains exactly like the unfitted model, under its budget, and detaches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import vramkit
from vramkit.planning import calibrate_blocks, measure_machine
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
from vramkit.recipes.lora import add_lora_adapters

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _dit(device: str = "cpu") -> tuple[DiT, DiTConfig]:
    config = DiTConfig.preset("base")  # bf16, 18 blocks of two kinds
    model = DiT(config, seed=0, device=device)
    names = [f"double_blocks.{i}" for i in range(config.num_double_blocks)]
    names += [f"single_blocks.{i}" for i in range(config.num_single_blocks)]
    add_lora_adapters(model, names, 4)
    return model, config


def _step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return flow_matching_loss(model, batch)


def test_the_machine_and_each_kind_of_block_are_measured() -> None:
    machine = measure_machine()
    assert machine.measured and machine.h2d_bytes_per_s > 1e9 and machine.flops_per_s > 1e12
    assert 0.3 < machine.duplex_share <= 1.0  # both directions at once, measured
    model, config = _dit("meta")
    batch = synthetic_batch(config, 2, device="meta")
    assert all(t.device.type == "meta" for t in batch.values())
    times = calibrate_blocks(model, batch, step=_step, device="cuda")
    # double and single blocks, and the first double block apart (its inputs, the step's,
    # require no grad)
    assert times.kinds == 3 and not times.fallbacks
    assert all(t > 0 for t in times.forward.values())
    assert all(t > 0 for t in times.backward.values())
    # device and host apart; the checkpointed backward recomputes the forward
    for name, call in times.calls["full"].items():
        assert min(call.forward, call.backward, call.host_forward, call.host_backward) > 0
        again = times.calls["checkpointed"][name]
        assert again.backward > call.backward + 0.5 * call.forward
    # and each kind beside copies: device times of the same order, the slowdown a share
    beside = times.calls["beside-copies"]
    assert set(beside) == set(times.forward)
    for name, call in times.calls["full"].items():
        assert 0.5 * call.forward < beside[name].forward < 2 * call.forward
        forward, backward = times.copy_slowdown(name)
        assert 0.0 <= forward < 1.0 and 0.0 <= backward < 1.0


def test_copies_beside_a_timed_region_run_while_it_runs() -> None:
    from vramkit.planning.calibration import _CopiesBeside

    copies = _CopiesBeside(torch.device("cuda"))
    assert copies.bytes_per_s > 1e9
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e8))  # the region: ~0.1 s of spinning on the current stream
    start.record()
    copies.launch(start, 0.05)
    torch.cuda._sleep(int(2e8))
    end.record()
    done = torch.cuda.Event()
    done.record(copies.stream)
    # the copies were queued behind the region's start, not before it
    assert not done.query()
    copies.drain()
    assert done.query()
    end.synchronize()


def test_packed_formats_are_timed_on_the_gpu() -> None:
    model, config = _dit("meta")
    batch = synthetic_batch(config, 2, device="meta")
    times = calibrate_blocks(model, batch, step=_step, device="cuda", formats=("fp8", "int8"))
    for variant in ("fp8", "int8", "fp8+together", "int8+together"):
        assert set(times.calls[variant]) == set(times.forward)
        assert all(c.forward > 0 and c.backward > 0 for c in times.calls[variant].values())


def test_w8a8_formats_are_timed_planned_and_fitted_on_the_gpu() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 W8A8 needs compute capability >= 8.9")
    from vramkit.quant.w8a8 import W8A8Linear

    torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper crash (docs/architecture.md)
    model, config = _dit("meta")
    batch = synthetic_batch(config, 2, device="meta")
    times = calibrate_blocks(model, batch, step=_step, device="cuda",
                             formats=("fp8-w8a8", "int8-w8a8"))
    for variant in ("fp8-w8a8", "int8-w8a8"):
        assert set(times.calls[variant]) == set(times.forward)
        assert all(c.forward > 0 and c.backward > 0 for c in times.calls[variant].values())
    model, config = _dit()
    batch = synthetic_batch(config, 2, device="cuda", generator=torch.Generator().manual_seed(0))
    with pytest.raises(vramkit.PlanError) as info:
        vramkit.plan(model, batch, 1, step=_step, hardware="h100-pcie",
                     allow_formats=("fp8-w8a8",))
    budget = info.value.minimum_budget
    fitted = vramkit.fit(model, batch, budget, step=_step, observe_steps=2,
                         allow_formats=("fp8-w8a8",))
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert (len(w8a8) > 0) == any(f == "fp8-w8a8" for f in fitted.plan.formats.values())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(3):
        loss = _step(model, batch)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    report = fitted.report()
    assert report.measured_peak_bytes is not None and report.measured_peak_bytes <= budget
    fitted.detach()
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())


def test_fit_with_a_measured_plan_trains_exactly_and_stays_under_budget() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper crash (docs/architecture.md)
    model, config = _dit()
    reference = copy.deepcopy(model).cuda()
    batch = synthetic_batch(config, 2, device="cuda",
                            generator=torch.Generator().manual_seed(0))
    # The smallest budget a plan fits (default headroom kept): everything that can swap does.
    with pytest.raises(vramkit.PlanError) as info:
        vramkit.plan(model, batch, 1, step=_step, hardware="h100-pcie")
    budget = info.value.minimum_budget
    assert budget is not None
    fitted = vramkit.fit(model, batch, budget, step=_step, observe_steps=2)
    assert fitted.plan.swapped, fitted.plan.explain()
    assert any("Block times measured on cuda" in n for n in fitted.plan.notes)
    losses, expected = [], []
    # The fused attention backwards accumulate in a varying order (run-to-run differences in
    # the last bits even without vramkit); the math backend is deterministic, so the two runs
    # must agree exactly.
    with sdpa_kernel(SDPBackend.MATH):
        for net, out in ((model, losses), (reference, expected)):
            params = [p for p in net.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-3)
            for _ in range(3):
                loss = _step(net, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
    assert losses == expected
    report = fitted.report()
    assert report.measured_peak_bytes is not None
    assert report.measured_peak_bytes <= budget
    fitted.detach()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_the_measured_peak_leaves_out_what_others_hold() -> None:
    # A VAE or a text encoder resident beside the fitted model is not part of the step the plan
    # predicts: the report's peak is the step's own.
    torch.backends.cuda.enable_cudnn_sdp(False)
    model, config = _dit()
    batch = synthetic_batch(config, 2, device="cuda",
                            generator=torch.Generator().manual_seed(0))
    others = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    fitted = vramkit.fit(model, batch, "6GiB", step=_step, hardware="h100-pcie",
                         observe_steps=2)
    try:
        for _ in range(3):
            _step(model, batch).backward()
        report = fitted.report()
        assert report.measured_peak_bytes is not None and report.measured_peak_bytes > 0
        assert (report.measured_peak_bytes
                <= torch.cuda.max_memory_allocated() - others.numel())
        assert report.measured_peak_bytes <= report.budget_bytes
    finally:
        fitted.detach()
        del others
