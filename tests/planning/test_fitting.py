"""vramkit.fit on the CPU: the plan applied with the swapper, checkpointing and packed storage
trains exactly like the unfitted model, and detach gives the model back exactly."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

import vramkit
from tests.planning._models import inputs, stack
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload import _patch
from vramkit.offload.checkpointing import is_checkpointed

MiB = 1 << 20
OPTIONS = {"hardware": "rtx4090", "headroom": 0, "autocast": None, "device": "cpu"}


def _train(model: torch.nn.Module, steps: int = 3) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    (x,) = inputs()
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fit_swaps_and_trains_exactly_like_the_unfitted_model() -> None:
    reference, model = stack(), stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    assert fitted.plan.swapped and fitted.swapper is not None
    assert fitted.swapper.swapped_names == list(fitted.plan.swapped)
    assert all(is_checkpointed(model.get_submodule(n)) for n in fitted.plan.checkpointed)
    assert _train(model) == _train(reference)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        if a.requires_grad:  # the adapters were trained identically
            assert torch.equal(a, b), name
    report = fitted.report()
    assert report.steps >= 2 and report.measured_step_seconds is not None
    assert report.measured_peak_bytes is None  # the CPU measures no allocator peak
    assert "step" in report.describe()
    fitted.detach()


@pytest.mark.parametrize("checkpointing", ["all", "none"])
def test_fit_checkpoints_as_asked(checkpointing: str) -> None:
    # "all": every block checkpointed (lean), swapping planned around it; "none": nothing
    # checkpointed (the budget left room for every activation). Trains like the unfitted model.
    reference, model = stack(), stack()
    budget = 6 * MiB if checkpointing == "all" else 64 * MiB
    fitted = vramkit.fit(model, inputs(), budget, checkpointing=checkpointing, **OPTIONS)
    names = fitted.plan.block_order
    assert fitted.plan.checkpointing == checkpointing
    want = set(names) if checkpointing == "all" else set()
    assert {n for n in names if is_checkpointed(model.get_submodule(n))} == want
    assert _train(model) == _train(reference)
    fitted.detach()
    assert not any(is_checkpointed(m) for m in model.modules())


def test_detach_gives_the_model_back_exactly() -> None:
    model = stack()
    ids = [id(p) for p in model.parameters()]
    before = _state(model)
    fitted = vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    _train(model, steps=1)
    trained = _state(model)  # read through the host masters while attached
    fitted.detach()
    assert [id(p) for p in model.parameters()] == ids
    after = _state(model)
    assert after.keys() == before.keys()
    for key, value in after.items():
        assert torch.equal(value, trained[key]), key
        if "lora_" not in key:
            assert torch.equal(value, before[key]), key  # the frozen base is untouched
    assert all(not is_checkpointed(b) for b in model.blocks)
    assert all(not _patch.wrappers(m) for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(OffloadError):
        fitted.detach()


def test_packed_storage_is_applied_and_undone() -> None:
    model = stack()
    originals = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    before = _state(model)
    with vramkit.fit(model, inputs(), 4 * MiB, allow_formats=("fp8",), **OPTIONS) as fitted:
        assert "fp8" in fitted.plan.formats.values()
        quantized = [n for n, m in model.named_modules() if type(m).__name__ == "QuantizedLinear"]
        assert quantized
        assert all(float(v) == v for v in _train(model, steps=1))  # it runs
    # detach by the context manager: the very same Linear modules, the same bytes
    assert {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)} == originals
    for key, value in _state(model).items():
        if "lora_" not in key:
            assert torch.equal(value, before[key]), key


def test_a_plan_that_dequantizes_together_groups_each_packed_block() -> None:
    made = vramkit.plan(stack(device="meta"), inputs(), 4 * MiB, allow_formats=("fp8",),
                        hardware="rtx4090", headroom=0, autocast=None)
    assert not made.dequantize_together  # offline: never (see test_calibration)
    expected_model = stack()
    with vramkit.fit(expected_model, inputs(), 4 * MiB, plan=made, device="cpu"):
        expected = _train(expected_model, steps=2)
    together = dataclasses.replace(made, dequantize_together=True)
    model = stack()
    with vramkit.fit(model, inputs(), 4 * MiB, plan=together, device="cpu") as fitted:
        quantized = [m for m in model.modules() if type(m).__name__ == "QuantizedLinear"]
        assert quantized and all(m._dense is not None for m in quantized)
        assert _train(model, steps=2) == expected  # the same losses, bit for bit
        assert fitted.stats()["dense_scratch_bytes"] > 0
        scratch = quantized[0]._dense[0].scratch
    assert scratch.nbytes == 0  # detach frees the buffer
    assert not any(type(m).__name__ == "QuantizedLinear" for m in model.modules())


def test_fit_logs_the_comparison_after_the_first_steps(caplog: pytest.LogCaptureFixture) -> None:
    model = stack()
    with caplog.at_level(logging.INFO, logger="vramkit.planning.fitting"):
        fitted = vramkit.fit(model, inputs(), 6 * MiB, observe_steps=2, **OPTIONS)
        _train(model, steps=3)
    assert any("after 2 steps" in r.getMessage() and "predicted" in r.getMessage()
               for r in caplog.records)
    fitted.detach()


def test_a_plan_made_earlier_is_applied_as_is() -> None:
    model = stack()
    made = vramkit.plan(model, inputs(), 8 * MiB, hardware="rtx4090", headroom=0, autocast=None)
    fitted = vramkit.fit(model, inputs(), 8 * MiB, plan=made, device="cpu")
    assert fitted.plan is made
    fitted.detach()


def test_a_model_on_meta_needs_its_weights() -> None:
    with pytest.raises(ConfigError, match="meta"):
        vramkit.fit(stack(device="meta"), inputs(), 6 * MiB, **OPTIONS)


def test_nothing_to_swap_moves_the_model_and_back() -> None:
    model = stack()
    reference = copy.deepcopy(model)
    fitted = vramkit.fit(model, inputs(), 1 << 30, **OPTIONS)
    assert fitted.swapper is None and fitted.plan.swapped == ()
    assert _train(model) == _train(reference)
    fitted.detach()


def test_fit_reads_its_checkpoint_ahead_only_while_it_plans(tmp_path, monkeypatch) -> None:
    """fit(checkpoint=) starts the page-cache prefetch before planning (the disk reads while
    the plan is made); with a plan given there is nothing to overlap, and a disk tier's plan
    times the cold disk: no prefetch."""
    from safetensors.torch import save_file

    from vramkit.io import prefetch

    started: list[object] = []
    real = prefetch.prefetch_checkpoint
    monkeypatch.setattr(prefetch, "prefetch_checkpoint",
                        lambda path, **kw: started.append(path) or real(path, **kw))
    reference = stack()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    model = stack(device="meta")
    fitted = vramkit.fit(model, inputs(), 6 * MiB, checkpoint=path, **OPTIONS)
    assert started == [path]
    assert _train(model) == _train(reference)  # the same weights, read after the prefetch
    made = fitted.plan
    fitted.detach()
    vramkit.fit(stack(device="meta"), inputs(), 6 * MiB, plan=made, device="cpu",
                checkpoint=path).detach()
    assert started == [path]  # a plan was given: no prefetch


def test_fit_loads_a_meta_model_from_a_checkpoint_as_it_applies_the_plan(tmp_path) -> None:
    from safetensors.torch import save_file

    reference = stack()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    model = stack(device="meta")
    with pytest.raises(ConfigError, match="checkpoint="):
        vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)  # no weights and no checkpoint
    fitted = vramkit.fit(model, inputs(), 6 * MiB, checkpoint=path, **OPTIONS)
    assert fitted.plan.swapped and fitted.swapper is not None
    assert fitted.swapper.stats().checkpoint_bytes > 0
    assert not any(t.is_meta for t in model.parameters())
    assert _train(model) == _train(reference)
    trained = _state(model)
    fitted.detach()  # built on meta: materialized on the CPU, trained values kept
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(v, trained[k]) for k, v in _state(model).items())


def test_fit_from_a_checkpoint_with_nothing_swapped_loads_to_the_device(tmp_path) -> None:
    from safetensors.torch import save_file

    reference = stack()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    model = stack(device="meta")
    with vramkit.fit(model, inputs(), 1 << 30, checkpoint=path, **OPTIONS) as fitted:
        assert not fitted.plan.swapped and fitted.swapper is None
        assert _train(model) == _train(reference)


def _quantizing_plan(budget: int) -> tuple[vramkit.Plan, str]:
    made = vramkit.plan(stack(device="meta"), inputs(), budget, allow_formats=("fp8",),
                        hardware="rtx4090", headroom=0, autocast=None)
    packed = [n for n, f in made.formats.items() if f != "bf16"]
    if not packed:
        pytest.skip("the planner found a plan without quantization")
    return made, packed[0]


@pytest.mark.parametrize("budget", [4 * MiB, 1 << 30], ids=["swapped", "all-resident"])
def test_fit_from_a_checkpoint_quantizes_blocks_as_they_are_read(tmp_path, budget: int) -> None:
    """A plan with packed blocks applied to a meta model from its checkpoint: each packed block
    is read and quantized layer by layer (never whole in full precision), the rest loads as
    usual, and the model computes exactly what the same plan gives on a model that was loaded
    first; detach refills the original layers from the file."""
    from safetensors.torch import save_file

    weights = stack()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in weights.state_dict().items()}, str(path))
    made, packed = _quantizing_plan(4 * MiB)
    if budget != 4 * MiB:  # the same formats, nothing swapped (the loader's path, not the swapper's)
        made = dataclasses.replace(made, swapped=(), resident=(*made.resident, *made.swapped),
                                   resident_format=made.formats[packed], budget_bytes=budget)
    loaded = stack()  # the reference: weights first, then the same plan
    with vramkit.fit(loaded, inputs(), budget, plan=made, device="cpu"):
        expected = _train(loaded, steps=2)
    model = stack(device="meta")
    originals = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    fitted = vramkit.fit(model, inputs(), budget, plan=made, device="cpu", checkpoint=path)
    assert type(model.get_submodule(packed)).__name__ != "QuantizedLinear"  # a block
    assert any(type(m).__name__ == "QuantizedLinear"
               for m in model.get_submodule(packed).modules())
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert _train(model, steps=2) == expected
    trained = {k: v for k, v in _state(model).items() if "lora_" in k}
    fitted.detach()
    # the original Linear modules again, filled from the file (frozen: the file's values)
    assert {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)} == originals
    reference = weights.state_dict()
    for key, value in _state(model).items():
        assert value.device.type == "cpu", key
        if "lora_" in key:
            assert torch.equal(value, trained[key]), key
        else:
            assert torch.equal(value, reference[key]), key


def test_checkpoint_skip_is_checked_and_needs_a_checkpoint(tmp_path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_skip"):
        vramkit.BlockSwapper(stack(), config=vramkit.SwapConfig(min_param_bytes=0),
                             device="cpu", checkpoint_skip=["blocks.0"])
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in stack().state_dict().items()}, str(path))
    with pytest.raises(ConfigError, match="does not have"):
        vramkit.BlockSwapper(stack(device="meta"), config=vramkit.SwapConfig(min_param_bytes=0),
                             device="cpu", checkpoint=path, checkpoint_skip=["nope"])


def test_a_report_says_when_a_host_bound_plan_is_off_by_more_than_the_tolerance() -> None:
    from vramkit.planning.fitting import STEP_TOLERANCE, FitReport

    def report(measured: float | None, host_bound: tuple[str, ...]) -> FitReport:
        return FitReport(steps=5, budget_bytes=1 << 30, predicted_peak_bytes=1 << 29,
                         measured_peak_bytes=None, predicted_step_seconds=0.300,
                         measured_step_seconds=measured, host_bound=host_bound)

    off = 0.300 * (1 + 2 * STEP_TOLERANCE)
    said = report(off, ("backward",)).describe()
    assert "step 360 ms measured vs 300 ms predicted (+20.0%)" in said
    assert "the plan's backward is host-bound" in said
    assert "forward and backward are host-bound" in report(off, ("forward", "backward")).describe()
    assert "host-bound" not in report(off, ()).describe()  # the device's pace: nothing to add
    assert "host-bound" not in report(0.310, ("backward",)).describe()  # within the tolerance
    assert "host-bound" not in report(None, ("backward",)).describe()  # nothing measured yet


def test_fit_compiles_the_blocks_beneath_the_swapper_and_trains_like_compiled_resident() -> None:
    from vramkit.offload.compiled import compile_blocks, is_compiled

    torch._dynamo.reset()
    reference, model = stack(), stack()
    compile_blocks(reference, "blocks")
    fitted = vramkit.fit(model, inputs(), 6 * MiB, compile=True, **OPTIONS)
    assert fitted.plan.swapped
    assert all(is_compiled(model.get_submodule(n)) for n in fitted.plan.block_order)
    # compiled innermost: beneath the checkpoint and the swapper
    wrapped = model.get_submodule(fitted.plan.swapped[0])
    assert _patch.wrappers(wrapped)[0].kind == "compile"
    assert _train(model) == _train(reference)
    fitted.detach()
    assert all(not _patch.wrappers(m) for m in model.modules())


@pytest.mark.parametrize("value", ["reduce-overhead", 1, "yes"])
def test_fit_refuses_a_compile_it_cannot_do(value: object) -> None:
    with pytest.raises(ConfigError, match="compile"):
        vramkit.fit(stack(), inputs(), 6 * MiB, compile=value, **OPTIONS)


def test_planning_or_fitting_a_fitted_model_says_to_detach_first() -> None:
    # Re-running a notebook cell: the model still carries the first fit (its swapper's live
    # state, which no copy can take); planning it would price the fitted model anyway.
    from vramkit.errors import PlanError

    model = stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    assert fitted.swapper is not None
    plan_options = {k: v for k, v in OPTIONS.items() if k != "device"}
    for again in (lambda: vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS),
                  lambda: vramkit.plan(model, inputs(), 6 * MiB, **plan_options),
                  lambda: vramkit.fit(model, inputs(), 6 * MiB, plan=fitted.plan,
                                      device="cpu")):
        with pytest.raises(PlanError, match=r"vramkit\.fit") as caught:
            again()
        assert "fitted.detach()" in (caught.value.hint or "")
    fitted.detach()
    vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS).detach()  # detached: fits again


def test_a_fitted_model_that_swaps_nothing_is_refused_too() -> None:
    from vramkit.errors import PlanError

    model = stack()
    fitted = vramkit.fit(model, inputs(), 1 << 30, **OPTIONS)
    assert fitted.swapper is None
    with pytest.raises(PlanError, match=r"vramkit\.fit"):
        vramkit.fit(model, inputs(), 1 << 30, **OPTIONS)
    fitted.detach()


def test_fitting_a_model_a_block_swapper_holds_says_to_detach_it() -> None:
    from vramkit.errors import PlanError

    model = stack()
    swapper = vramkit.BlockSwapper(model, config=vramkit.SwapConfig(num_slots=1), device="cpu")
    with pytest.raises(PlanError, match=r"blocks\.0.*BlockSwapper") as caught:
        vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    assert "swapper.detach()" in (caught.value.hint or "")
    with pytest.raises(PlanError, match="BlockSwapper"):
        vramkit.plan(model, inputs(), 6 * MiB, hardware="rtx4090", autocast=None)
    swapper.detach()
    vramkit.plan(model, inputs(), 6 * MiB, hardware="rtx4090", headroom=0, autocast=None)


def test_checkpoint_wrappers_are_no_obstacle_to_planning() -> None:
    model = stack()
    vramkit.enable_gradient_checkpointing(model, ["blocks.0", "blocks.1"])
    vramkit.plan(model, inputs(), 6 * MiB, hardware="rtx4090", headroom=0, autocast=None)


def test_a_report_before_any_step_says_none_was_measured() -> None:
    model = stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    report = fitted.report()
    assert report.steps == 0 and "-1" not in report.describe()
    assert "no step measured yet" in report.describe()
    (x,) = inputs()
    with torch.no_grad():
        model(x)  # one forward: the first step began, none ended
    assert fitted.report().steps == 0
    assert "no step measured yet" in fitted.report().describe()
    with torch.no_grad():
        model(x)
    report = fitted.report()
    assert report.steps == 1 and report.describe().startswith("after 1 step:")
    fitted.detach()


def test_two_fitted_models_in_the_same_steps_say_their_figures_are_shared() -> None:
    """A fitted text encoder beside a fitted transformer, or two arms of a benchmark: each
    model's first steps contain the other's work, so neither report tests its plan, and says
    so (the CPU measures no peak: the over-budget warning a shared report skips is CUDA's)."""
    (x,) = inputs()
    first, second = stack(), stack()
    a = vramkit.fit(first, inputs(), 6 * MiB, observe_steps=2, **OPTIONS)
    b = vramkit.fit(second, inputs(), 6 * MiB, observe_steps=2, **OPTIONS)  # a still observes
    with torch.no_grad():
        for _ in range(3):
            first(x)
            second(x)
    for fitted in (a, b):
        report = fitted.report()
        assert report.steps == 2 and report.shared
        assert "another fitted model on this device ran in the same steps" in report.describe()
    a.detach()
    b.detach()

    # one at a time: the first's window closed before the second was fitted
    alone = vramkit.fit(first, inputs(), 6 * MiB, observe_steps=1, **OPTIONS)
    with torch.no_grad():
        for _ in range(2):
            first(x)
    later = vramkit.fit(second, inputs(), 6 * MiB, observe_steps=1, **OPTIONS)
    with torch.no_grad():
        for _ in range(2):
            second(x)
    assert not alone.report().shared and not later.report().shared
    assert "another fitted model" not in later.report().describe()
    alone.detach()
    later.detach()


def test_a_detached_model_no_longer_shares_the_next_ones_steps() -> None:
    (x,) = inputs()
    first, second = stack(), stack()
    vramkit.fit(first, inputs(), 6 * MiB, observe_steps=3, **OPTIONS).detach()  # never ran
    fitted = vramkit.fit(second, inputs(), 6 * MiB, observe_steps=1, **OPTIONS)
    with torch.no_grad():
        for _ in range(2):
            second(x)
    assert not fitted.report().shared
    fitted.detach()


def test_fit_on_the_cpu_needs_no_arguments_the_cli_does_not(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reference, model = stack(), stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, device="cpu")
    assert fitted.plan.swapped and fitted.plan.machine == "rtx4090"
    assert any("no headroom kept" in note for note in fitted.plan.notes)
    assert any("PyTorch sees no GPU" in note for note in fitted.plan.notes)
    assert _train(model) == _train(reference)
    fitted.detach()


def test_fit_applies_pageable_masters_as_planned() -> None:
    reference, model = stack(), stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, host_memory="pageable",
                         staging_pool="1MiB", **OPTIONS)
    assert fitted.plan.swapped and fitted.plan.host_memory == "pageable"
    assert fitted.swapper is not None and fitted.swapper.host_memory.mode == "pageable"
    assert _train(model) == _train(reference)  # the staged copies move the same bytes
    stats = fitted.swapper.stats()
    assert stats.staged_copies > 0 and stats.staging_pool_bytes <= 1 * MiB
    fitted.detach()


def test_a_dtype_cast_or_device_move_of_a_fitted_model_is_refused_before_anything_changes(
        ) -> None:
    # The swapped weights live in host masters and slots of their dtype: a cast of the model
    # reached only the placeholders and the forward failed in a matmul ("self and mat2 must
    # have the same dtype"). Refused at the call, with nothing converted, on the model and on
    # any module above a swapped tensor.
    reference, model = stack(), stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    assert fitted.plan.swapped
    block = model.get_submodule(fitted.plan.swapped[-1])
    kinds = [(n, p.dtype, p.device) for n, p in model.named_parameters()]
    for convert in (lambda: model.to(torch.float64), model.half, model.bfloat16, model.double,
                    lambda: model.to("meta"), model.blocks.half,
                    lambda: block.to(torch.float16), block.up.double):
        with pytest.raises(OffloadError, match=r"cannot be (cast|moved)") as raised:
            convert()
        assert "detach" in raised.value.hint
        assert [(n, p.dtype, p.device) for n, p in model.named_parameters()] == kinds
    model.float().to("cpu").cpu()  # conversions that change nothing go through
    assert _train(model) == _train(reference)
    fitted.detach()
    assert model.double().blocks[0].up.weight.dtype == torch.float64  # detached: converts


def test_a_report_on_another_machine_than_planned_for_compares_no_step_time() -> None:
    # fit on the CPU with a plan for an RTX 4090 said '+12595 %' and blamed a host-bound plan
    model = stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, **OPTIONS)
    _train(model, steps=3)
    report = fitted.report()
    fitted.detach()
    assert report.measured_step_seconds is not None
    assert not report.same_machine and report.step_error is None
    assert (report.planned_for, report.runs_on) == ("rtx4090", "cpu")
    said = report.describe()
    assert f"step {report.measured_step_seconds * 1e3:.0f} ms measured on cpu" in said
    assert "predicted for rtx4090, not for this machine" in said
    assert "%" not in said and "host-bound" not in said and " vs " not in said


def test_a_report_names_the_machine_and_blames_nothing_when_it_is_not_the_planned_one() -> None:
    from vramkit.planning.fitting import FitReport

    off = FitReport(steps=5, budget_bytes=1 << 30, predicted_peak_bytes=1 << 29,
                    measured_peak_bytes=1 << 29, predicted_step_seconds=0.3,
                    measured_step_seconds=3.0, host_bound=("backward",), planned_for="h200",
                    runs_on="NVIDIA GeForce RTX 4090", same_machine=False)
    said = off.describe()
    assert "peak 512.0 MiB measured vs 512.0 MiB predicted (+0.0%)" in said  # memory compares
    assert "step 3000 ms measured on NVIDIA GeForce RTX 4090" in said
    assert "+900" not in said and "host-bound" not in said
    same = dataclasses.replace(off, same_machine=True)
    assert "(+900.0%)" in same.describe() and "host-bound" in same.describe()


def test_the_machine_planned_for_is_the_gpu_measured_or_the_profile_of_the_same_card(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.planning.fitting import planned_here

    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: "NVIDIA GeForce RTX 4090")
    gpu = torch.device("cuda", 0)
    assert planned_here("rtx4090", gpu) == ("NVIDIA GeForce RTX 4090", True)
    assert planned_here("measured: NVIDIA GeForce RTX 4090", gpu)[1]
    assert not planned_here("h200", gpu)[1]
    assert not planned_here("measured: NVIDIA H200", gpu)[1]
    assert not planned_here("my own box", gpu)[1]  # a Machine of the user's naming
    assert planned_here("rtx4090", torch.device("cpu")) == ("cpu", False)
