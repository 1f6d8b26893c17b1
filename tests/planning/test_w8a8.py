"""W8A8 storage formats in plans (vramkit.planning.w8a8): their bytes on meta equal the real
W8A8 layers', offline pricing follows the profile's 8-bit GEMM rate (the H200's measured int8
ratio included), a GPU without the GEMM is not offered the format, the plan says what a W8A8
format costs in accuracy, and vramkit.fit applies it with W8A8Linear and undoes it exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import vramkit
from tests.planning._models import inputs, stack
from vramkit.errors import PlanError
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.planning import Machine, analyze, calibrate_blocks
from vramkit.planning.analysis import FORMATS
from vramkit.planning.hardware import PROFILES
from vramkit.planning.pricing import w8a8_change
from vramkit.planning.record import Plan
from vramkit.planning.w8a8 import (
    W8A8_OUTPUT_ERROR,
    LinearCall,
    unavailable_on_device,
    unavailable_on_machine,
)
from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.quant.w8a8 import W8A8Linear

MiB = 1 << 20
GiB = 1 << 30
W8A8 = ("fp8-w8a8", "int8-w8a8")
OFFLINE = {"headroom": 0, "autocast": None}


def test_the_formats_are_allowed_and_weigh_what_the_real_layers_weigh() -> None:
    assert set(W8A8) <= set(FORMATS)
    cost = analyze(stack(device="meta"), inputs(), formats=("bf16", "int8", *W8A8))
    model = stack()
    for fmt, kind in (("fp8-w8a8", "fp8"), ("int8-w8a8", "int8")):
        block = copy.deepcopy(model.blocks[0])
        quantize_model(block, QuantizationConfig(kind, w8a8=True))
        assert {type(m) for m in (block.up, block.down)} == {W8A8Linear}
        footprint = BlockSwapper.footprint(block, SwapConfig())
        measured = cost.blocks[0]
        assert measured.swapped[fmt] == footprint.swapped
        # one byte per weight, one fp32 scale per output row (small tensors stay resident)
        weights = sum(m.out_features * m.in_features for m in (block.up, block.down))
        assert footprint.swapped + footprint.resident >= weights
        assert measured.resident_bytes(fmt) < measured.resident_bytes("bf16") * 0.3
        assert measured.dense.get(fmt, 0) == 0  # nothing dequantized into a buffer


def test_the_analysis_counts_each_frozen_linear_call() -> None:
    cost = analyze(stack(device="meta"), inputs(), formats=("bf16", "int8-w8a8"))
    calls = cost.blocks[1].linear_calls
    # up (256 -> 1024) then down (1024 -> 256), 2 x 64 tokens, inputs needing grad
    assert calls == (LinearCall(128, 256, 1024, True), LinearCall(128, 1024, 256, True))
    infer = analyze(stack(device="meta"), inputs(), mode="infer", formats=("bf16",))
    assert not any(c.input_grad for c in infer.blocks[1].linear_calls)


def test_offline_pricing_follows_the_8_bit_rate() -> None:
    flux = [LinearCall(4096, 3072, 3072, True), LinearCall(4096, 3072, 12288, True)]
    h200 = Machine.from_profile(PROFILES["h200"])
    rtx3090 = Machine.from_profile(PROFILES["rtx3090"])
    # the H200's int8 GEMM ran 0.87-0.94x a bf16 one (benchmarks/w8a8.py): slower, plus
    # the quantization passes; its fp8 GEMM 1.46-1.65x: faster
    assert h200.int8_gemm_flops_per_s < h200.peak_flops_per_s < h200.fp8_gemm_flops_per_s
    int8_h200 = w8a8_change(flux, "int8-w8a8", h200)
    fp8_h200 = w8a8_change(flux, "fp8-w8a8", h200)
    assert int8_h200 is not None and fp8_h200 is not None
    assert int8_h200.forward > 0 and int8_h200.backward > 0
    assert fp8_h200.forward < 0
    # the RTX 3090: int8 tensor cores at 284 TOPS against 71 bf16 TFLOP/s
    assert rtx3090.int8_gemm_flops_per_s == PROFILES["rtx3090"].int8_flops
    int8_3090 = w8a8_change(flux, "int8-w8a8", rtx3090)
    assert int8_3090 is not None and int8_3090.forward < 0 and int8_3090.backward < 0
    # no fp8 on Ampere: not offered, and said why
    assert w8a8_change(flux, "fp8-w8a8", rtx3090) is None
    assert "fp8" in (unavailable_on_machine("fp8-w8a8", rtx3090) or "")
    assert unavailable_on_machine("int8-w8a8", rtx3090) is None
    # the backward of a frozen layer whose input needs no grad prices nothing
    no_grad = w8a8_change([LinearCall(4096, 3072, 3072, False)], "fp8-w8a8", h200)
    assert no_grad is not None and no_grad.backward == 0 and no_grad.host_backward == 0
    # a shape the GEMMs cannot take dequantizes its weight, as weight-only storage does
    odd = w8a8_change([LinearCall(4096, 3000, 3001, True)], "int8-w8a8", rtx3090)
    assert odd is not None and odd.forward > 0


def _formats_of(plan: Plan) -> set[str]:
    return set(plan.formats.values())


@pytest.mark.parametrize("allow", [("int8-w8a8",), ("fp8-w8a8",), ("fp8", "int8-w8a8"),
                                   ("nf4", "fp8-w8a8", "int8")])
@pytest.mark.parametrize("hardware", ["rtx4090", "rtx3090", "h200"])
def test_a_plan_only_uses_the_formats_it_was_allowed(allow: tuple[str, ...],
                                                     hardware: str) -> None:
    model = stack(device="meta")
    for budget in (64 * MiB, 6 * MiB, 4 * MiB):
        try:
            made = vramkit.plan(model, inputs(), budget, hardware=hardware, allow_formats=allow,
                                **OFFLINE)
        except PlanError:  # 4 MiB needs packed weights: fp8 W8A8 alone on an RTX 3090 has none
            assert budget == 4 * MiB and allow == ("fp8-w8a8",) and hardware == "rtx3090"
            continue
        assert _formats_of(made) <= {"bf16", *allow}


def test_explain_says_what_a_w8a8_format_costs_and_why_one_is_not_offered() -> None:
    made = vramkit.plan(stack(device="meta"), inputs(), 4 * MiB, hardware="rtx3090",
                        allow_formats=W8A8, **OFFLINE)
    assert "fp8-w8a8" not in _formats_of(made)  # Ampere: no fp8 tensor cores
    text = made.explain()
    assert "fp8-w8a8 is not offered: rtx3090 has no fp8 tensor-core rate" in text
    assert _formats_of(made) & {"int8-w8a8"}  # 3 MiB needs packed weights
    assert f"off by {100 * W8A8_OUTPUT_ERROR['int8-w8a8']:.2g} %" in text
    assert "10 % above bf16's final loss after 200 steps" in text
    assert "benchmarks/w8a8.py" in text


def test_a_gpu_without_the_gemm_is_not_offered_the_format(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.quant import w8a8 as quant_w8a8

    monkeypatch.setattr(quant_w8a8, "_device_capability", lambda device: (8, 6))
    cuda = torch.device("cuda", 0)
    assert "8.9" in (unavailable_on_device("fp8-w8a8", cuda) or "")  # an RTX 3090
    assert unavailable_on_device("int8-w8a8", cuda) is None
    monkeypatch.setattr(quant_w8a8, "_device_capability", lambda device: (7, 5))
    assert "8.0" in (unavailable_on_device("int8-w8a8", cuda) or "")  # a T4
    assert unavailable_on_device("int8-w8a8", torch.device("cpu")) is None


def test_calibration_times_w8a8_blocks_and_the_plan_refuses_what_the_device_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.planning import calibration

    model = stack(device="meta")
    times = calibrate_blocks(model, inputs(), device="cpu", repeats=1, autocast=None,
                             formats=("int8-w8a8",))
    assert set(times.calls["int8-w8a8"]) == {f"blocks.{i}" for i in range(6)}
    assert "int8-w8a8+together" not in times.calls  # nothing to dequantize together
    assert times.extra("int8-w8a8", "blocks.0", signed=True) is not None
    # a GPU that lacks the int8 GEMM: not timed, not offered, the plan says why
    monkeypatch.setattr(calibration, "unavailable_on_device",
                        lambda fmt, device: f"{fmt} is not offered: no int8 GEMM here")
    lacking = calibrate_blocks(model, inputs(), device="cpu", repeats=1, autocast=None,
                               formats=("int8-w8a8",))
    assert "int8-w8a8" not in lacking.calls
    assert lacking.unavailable == {"int8-w8a8": "int8-w8a8 is not offered: no int8 GEMM here"}
    made = vramkit.plan(model, inputs(), 64 * MiB, hardware="rtx3090",
                        allow_formats=("int8-w8a8",), block_times=lacking, **OFFLINE)
    assert _formats_of(made) == {"bf16"}
    assert "no int8 GEMM here" in made.explain()


def test_fit_applies_int8_w8a8_on_the_cpu_and_detach_restores_exactly() -> None:
    made = vramkit.plan(stack(device="meta"), inputs(), 4 * MiB, hardware="rtx3090",
                        allow_formats=("int8-w8a8",), **OFFLINE)
    packed = {name for name, fmt in made.formats.items() if fmt == "int8-w8a8"}
    assert packed
    model = stack()
    originals = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (x,) = inputs()
    with vramkit.fit(model, inputs(), 4 * MiB, plan=made, device="cpu"):
        for name in packed:
            block = model.get_submodule(name)
            assert isinstance(block.up, W8A8Linear) and block.up.kind == "int8"
            assert block.up.kernel == "int8"  # the 8-bit GEMM, not a dequantized matmul
            assert block.lora_a.requires_grad  # the adapters stay trainable
        loss = model(x).square().mean()
        loss.backward()
        assert all(b.lora_a.grad is not None for b in model.blocks)
    assert {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)} == originals
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.fixture(scope="module")
def flux():  # type: ignore[no-untyped-def]
    for name in ("diffusers", "peft", "transformers"):  # the FLUX.1-dev model on meta
        pytest.importorskip(name)
    from vramkit.recipes.targets import build_target

    target = build_target("flux-dev", lora_rank=16)
    cost = analyze(target.model, target.inputs, step=target.step, autocast=None,
                   formats=("bf16", "int8", *W8A8))
    return target, cost


def _flux_plan(flux, budget_gib: int, hardware: str, allow: tuple[str, ...]):  # type: ignore[no-untyped-def]
    from vramkit.planning.machine import machine_for

    target, cost = flux
    # the card's whole memory where the budget is more (a budget above the card is refused)
    budget = min(budget_gib * GiB, machine_for(hardware).memory_bytes)
    return vramkit.plan(target.model, target.inputs, budget, cost=cost,
                        hardware=hardware, allow_formats=allow)


@pytest.mark.parametrize("hardware", ["h200", "h100-sxm"])
def test_flux_on_hopper_never_picks_int8_w8a8_for_its_compute(flux, hardware: str) -> None:  # type: ignore[no-untyped-def]
    # Everything fits: the step is compute; the int8 GEMM is slower than bf16 there.
    made = _flux_plan(flux, 80, hardware, ("int8-w8a8",))
    assert _formats_of(made) == {"bf16"}
    # Swapping: weight-only int8 moves the same bytes without int8 W8A8's slower GEMMs.
    for budget in (24, 12):
        made = _flux_plan(flux, budget, hardware, ("int8", "int8-w8a8"))
        assert "int8-w8a8" not in _formats_of(made)
    # fp8 W8A8 is faster than bf16 there, and is taken
    assert "fp8-w8a8" in _formats_of(_flux_plan(flux, 80, hardware, ("fp8-w8a8",)))


def test_flux_on_an_rtx_3090_picks_int8_w8a8_where_it_predicts_a_faster_step(flux) -> None:  # type: ignore[no-untyped-def]
    for budget in (80, 24):
        plain = _flux_plan(flux, budget, "rtx3090", ())
        made = _flux_plan(flux, budget, "rtx3090", ("int8-w8a8",))
        assert "int8-w8a8" in _formats_of(made)
        assert made.predicted_step_seconds < plain.predicted_step_seconds
        # fp8 W8A8 is never offered on Ampere
        only_fp8 = _flux_plan(flux, budget, "rtx3090", ("fp8-w8a8",))
        assert _formats_of(only_fp8) == {"bf16"}
        assert "fp8-w8a8 is not offered" in only_fp8.explain()


def test_the_backward_transient_of_a_w8a8_layer_by_hand() -> None:
    from vramkit.planning.w8a8 import backward_transient_bytes

    calls = (LinearCall(128, 256, 1024, True), LinearCall(128, 1024, 256, True))
    # up: transposed 1024 x 256 codes + 128 x 1024 gradient codes + 128 fp32 scales
    up = 1024 * 256 + 128 * 1024 + 4 * 128
    down = 256 * 1024 + 128 * 256 + 4 * 128
    assert backward_transient_bytes(calls, "fp8-w8a8") == max(up, down) == 393728
    assert backward_transient_bytes(calls, "int8") == 0  # weight-only: no such copy
    no_grad = tuple(LinearCall(c.rows, c.in_features, c.out_features, False) for c in calls)
    assert backward_transient_bytes(no_grad, "int8-w8a8") == 0
    # a shape the GEMMs cannot take dequantizes: a bf16 weight
    assert backward_transient_bytes((LinearCall(8, 24, 36, True),), "fp8-w8a8") == 2 * 24 * 36


def test_the_predicted_peak_holds_the_w8a8_backward_copies() -> None:
    made = vramkit.plan(stack(device="meta"), inputs(), 4 * MiB, hardware="rtx3090",
                        allow_formats=("int8-w8a8",), **OFFLINE)
    assert "int8-w8a8" in _formats_of(made)
    assert made.peak_breakdown["w8a8_backward_copies"] == 393728  # the hand-worked case above
    assert made.predicted_peak_bytes == sum(made.peak_breakdown.values())
    bf16 = vramkit.plan(stack(device="meta"), inputs(), 64 * MiB, hardware="rtx3090",
                        **OFFLINE)
    assert "w8a8_backward_copies" not in bf16.peak_breakdown
