"""The W8A8 storage formats a plan may choose: ``"fp8-w8a8"`` and ``"int8-w8a8"``.

A block stored in one of them has its frozen ``nn.Linear`` layers replaced by
:class:`~vramkit.quant.w8a8.W8A8Linear` (``QuantizationConfig(kind, w8a8=True)``): the same bytes
as weight-only fp8 / int8 with one fp32 scale per output row, but no dequantizing at all: the
forward and the backward's input gradient run as 8-bit GEMMs, after each call quantizes its
input (forward) or its gradient (backward) per row.

This module holds what the planner needs beyond the weight-only formats:

* which quantization config applies a format (:func:`storage_config`, one place for the
  analysis, the calibration and :func:`vramkit.fit`);
* whether a machine or a device can run a format (:func:`unavailable_on_machine`,
  :func:`unavailable_on_device`): a GPU without the 8-bit GEMM is not offered the format, and
  the plan says why (never a silent full-precision fallback);
* what the offline time model of a W8A8 block reads
  (:func:`vramkit.planning.pricing.w8a8_change`): the frozen layers' calls the analysis
  counted (:class:`LinearCall`) and the memory traffic and kernels each adds;
* what each format costs in accuracy (:data:`W8A8_OUTPUT_ERROR`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from vramkit.planning.machine import Machine

__all__ = ["W8A8_FORMATS", "W8A8_OUTPUT_ERROR", "W8A8_TRAINING_DEVIATION", "LinearCall", "accuracy_note", "is_w8a8",
           "storage_config", "unavailable_on_device", "unavailable_on_machine"]

#: Plan format -> the W8A8 kind (:class:`~vramkit.quant.w8a8.W8A8Linear`'s ``kind``).
W8A8_FORMATS: dict[str, str] = {"fp8-w8a8": "fp8", "int8-w8a8": "int8"}

#: Relative error of one W8A8 layer's output against the bf16 layer
#: (``||y_w8a8 - y|| / ||y||``), measured by ``benchmarks/w8a8.py`` on an H200 on FLUX-shaped
#: linears (4096 tokens, 3072 -> 3072 and 3072 -> 12288; docs/benchmarks.md, "Against torchao").
#: Weights and activations are both quantized, so it is larger than weight-only storage's.
FP8_W8A8_OUTPUT_ERROR = 0.037
INT8_W8A8_OUTPUT_ERROR = 0.0097
W8A8_OUTPUT_ERROR: dict[str, float] = {"fp8-w8a8": FP8_W8A8_OUTPUT_ERROR,
                                       "int8-w8a8": INT8_W8A8_OUTPUT_ERROR}
#: How far above the bf16 run a LoRA training's final loss ends with the format's blocks:
#: ``benchmarks/w8a8_quality.py`` on an H200 (the demo's task, 200 steps, the worse of two
#: seeds, where the loss falls to under 1 % of its start; the CPU measured 16 % / 2.2 %, and a
#: bf16 run with every frozen weight one rounding step off moved 1.5 % there; docs/benchmarks.md,
#: "Training quality, 200 steps"). The worst measured is what a plan states.
W8A8_TRAINING_DEVIATION: dict[str, float] = {"fp8-w8a8": 0.308, "int8-w8a8": 0.104}

# Memory traffic of the offline model, bytes per element (module docstring of
# vramkit.quant.w8a8 for the passes):
#: quantizing a row-major operand per row: read it in bf16, write 8-bit codes.
QUANTIZE_BYTES = 2 + 1
#: int8's epilogue (``acc * s_w * s_x + b``, the Triton one-pass kernel): read the int32
#: sums, write bf16. fp8's ``_scaled_mm`` applies its scales itself.
INT8_EPILOGUE_BYTES = 4 + 2
#: the backward's transposed 8-bit copy of the weight: read and write one byte per element.
TRANSPOSE_BYTES = 1 + 1
#: a layer the GEMMs cannot take (``kernel == "dequantize"``) dequantizes its weight at each
#: call, as weight-only storage does: read the 8-bit codes, write bf16.
DEQUANTIZE_BYTES = 1 + 2
#: Kernels a W8A8 call launches beyond the bf16 layer's one GEMM (the Triton quantizer:
#: one launch per quantization): forward the quantizer (+ int8's epilogue), backward the
#: quantizer of the gradient and the weight's transposed copy (+ int8's epilogue).
EXTRA_KERNELS: dict[str, tuple[int, int]] = {"fp8": (1, 2), "int8": (2, 3)}


def is_w8a8(fmt: str) -> bool:
    """Whether ``fmt`` is one of :data:`W8A8_FORMATS`."""
    return fmt in W8A8_FORMATS


def storage_config(fmt: str, keep: Sequence[str] = ()) -> Any:
    """The :class:`~vramkit.quant.model.QuantizationConfig` that stores a block's frozen layers
    in ``fmt`` (a weight-only format, or a W8A8 one: ``w8a8=True`` of its kind), the modules
    named in ``keep`` (those owning trainable parameters) left as they are."""
    from vramkit.quant.model import QuantizationConfig

    kind = W8A8_FORMATS.get(fmt)
    if kind is not None:
        return QuantizationConfig(weights_dtype=kind, w8a8=True,
                                  modules_to_not_quantize=tuple(keep))
    return QuantizationConfig(weights_dtype=fmt, modules_to_not_quantize=tuple(keep))


def unavailable_on_machine(fmt: str, machine: Machine) -> str | None:
    """Why ``machine`` cannot run ``fmt``'s GEMMs (``None``: it can, or ``fmt`` is not W8A8).

    A hardware profile without the 8-bit rate (no fp8 tensor cores before Ada, no int8 figure)
    cannot. A measured machine is asked through its calibration
    (:func:`unavailable_on_device`); without one, its 8-bit rate is not known either."""
    kind = W8A8_FORMATS.get(fmt)
    if kind is None:
        return None
    rate = machine.fp8_gemm_flops_per_s if kind == "fp8" else machine.int8_gemm_flops_per_s
    if rate is None and not machine.measured:
        return (f"{fmt} is not offered: {machine.name} has no {kind} tensor-core rate "
                + ("(fp8 GEMMs need compute capability 8.9: Ada, Hopper or newer)"
                   if kind == "fp8" else "in its hardware profile"))
    return None


def unavailable_on_device(fmt: str, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``fmt``'s GEMMs (``None``: it can, or ``fmt`` is not W8A8):
    fp8 needs CUDA capability 8.9, int8 8.0 (:func:`vramkit.quant.w8a8.check_w8a8_device`)."""
    from vramkit.errors import QuantizationError
    from vramkit.quant.w8a8 import check_w8a8_device

    kind = W8A8_FORMATS.get(fmt)
    if kind is None:
        return None
    try:
        check_w8a8_device(kind, device)
    except QuantizationError as err:
        return f"{fmt} is not offered: {err.message} ({err.hint})"
    return None


def accuracy_note(fmt: str) -> str | None:
    """What storing blocks in ``fmt`` costs in accuracy, for a plan's notes (``None``: not
    W8A8)."""
    error = W8A8_OUTPUT_ERROR.get(fmt)
    if error is None:
        return None
    training = W8A8_TRAINING_DEVIATION[fmt]
    return (f"{fmt} quantizes the activations and gradients as well as the weights: each "
            f"replaced layer's output is off by {100 * error:.2g} % (relative error, measured "
            "by benchmarks/w8a8.py on an H200 on FLUX-shaped layers), and a LoRA run of the "
            f"demo's task ended {100 * training:.2g} % above bf16's final loss after 200 steps "
            "on an H200, where that loss is under 1 % of its start (benchmarks/w8a8_quality.py).")


@dataclass(frozen=True)
class LinearCall:
    """One call of a frozen ``nn.Linear`` a W8A8 format would replace, as the analysis counted
    it: ``rows`` tokens of ``in_features`` into ``out_features``; ``input_grad`` whether its
    backward computes the input's gradient (a training step, an input that requires grad)."""

    rows: int
    in_features: int
    out_features: int
    input_grad: bool


def backward_transient_bytes(calls: Sequence[LinearCall], fmt: str) -> int:
    """Device bytes a W8A8 layer's backward holds beyond the step's tensors, at most, over
    ``calls``: the weight's transposed 8-bit copy (``out * in`` bytes), the output gradient's
    8-bit codes (``rows * out``) and their fp32 row scales, all alive at the input-gradient
    GEMM (one layer at a time: each is freed after it). 0 for a format that is not W8A8 or
    calls without an input gradient; a layer the GEMMs cannot take dequantizes instead (a
    bf16 weight, ``2 * out * in``)."""
    from vramkit.quant.w8a8 import w8a8_fits

    kind = W8A8_FORMATS.get(fmt)
    if kind is None:
        return 0
    most = 0
    for c in calls:
        if not c.input_grad:
            continue
        n, k = c.out_features, c.in_features
        if w8a8_fits(kind, k, n):
            need = n * k + c.rows * n + 4 * c.rows
        else:
            need = 2 * n * k
        most = max(most, need)
    return most
