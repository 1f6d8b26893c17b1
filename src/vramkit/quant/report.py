"""Per-layer quantization quality: :func:`quantization_report`.

For every layer a :class:`~vramkit.quant.model.QuantizationConfig` would quantize, the report
gives the weight's SQNR (signal-to-quantization-noise ratio, dB) and the relative matmul error
``||Y - Y_q|| / ||Y||`` of the layer's output on sample inputs: the layer's real inputs, captured
by forward pre-hooks while the model runs on ``sample_inputs``, or Gaussian inputs when none are
given (or a layer was not reached). It also says which layers ``min_sqnr_db`` would keep in full
precision. The model is not modified.

Example:
    >>> report = quantization_report(model, QuantizationConfig("int4"), batch)  # doctest: +SKIP
    >>> print(report)                                                           # doctest: +SKIP
    >>> report.to_dict()["layers"][0]["sqnr_db"]                                # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant import kernels
from vramkit.quant.formats import QuantizedTensor, quantize_tensor
from vramkit.quant.linear import _QuantizedWeightModule
from vramkit.quant.model import QuantizationConfig, _selects_tensor, sqnr_db

__all__ = ["LayerQuality", "QuantizationReport", "quantization_report"]

logger = logging.getLogger(__name__)

# Rows (tokens) of captured input kept per layer: enough for a stable error estimate, bounded
# memory for long sequences.
_MAX_CAPTURED_ROWS = 1024
_RANDOM_ROWS = 256
_CONV_RANDOM_SIDE = 16
_CONV_CAPTURED_SAMPLES = 2


@dataclass(frozen=True)
class LayerQuality:
    """How well one layer survives quantization.

    Attributes:
        name: qualified module name (state dict: the weight's key without ``.weight``).
        kind: ``"linear"`` or ``"conv2d"`` (``"tensor"`` for a state dict entry).
        shape: the weight's shape.
        format: the weight format (``"int8"`` ...).
        sqnr_db: SQNR of the dequantized weight vs the original, in dB (higher is better).
        matmul_rel_error: ``||Y - Y_q|| / ||Y||`` of the layer output on ``input_source`` inputs.
        input_source: ``"captured"`` (real inputs) or ``"random"`` (Gaussian).
        float_bytes / quantized_bytes: the weight's bytes before and after (scales included).
        keep_float: True when ``min_sqnr_db`` keeps this layer in full precision.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    format: str
    sqnr_db: float
    matmul_rel_error: float
    input_source: str
    float_bytes: int
    quantized_bytes: int
    keep_float: bool


@dataclass(frozen=True)
class QuantizationReport:
    """The per-layer qualities of a model under one config (see :func:`quantization_report`)."""

    config: QuantizationConfig
    layers: tuple[LayerQuality, ...]

    @property
    def kept_float(self) -> list[str]:
        """Names of layers that ``min_sqnr_db`` keeps in full precision."""
        return [layer.name for layer in self.layers if layer.keep_float]

    def layer(self, name: str) -> LayerQuality:
        """The row of layer ``name``.

        Raises:
            KeyError: when the report has no such layer.
        """
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def worst(self, count: int = 5) -> list[LayerQuality]:
        """The ``count`` layers with the lowest SQNR (default 5)."""
        return sorted(self.layers, key=lambda layer: layer.sqnr_db)[:count]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (infinite SQNR as the string ``"inf"``)."""
        layers = []
        for layer in self.layers:
            row = asdict(layer)
            row["shape"] = list(layer.shape)
            if not math.isfinite(layer.sqnr_db):
                row["sqnr_db"] = str(layer.sqnr_db)
            layers.append(row)
        float_bytes = sum(layer.float_bytes for layer in self.layers)
        stored = sum(layer.float_bytes if layer.keep_float else layer.quantized_bytes
                     for layer in self.layers)
        return {"config": self.config.to_dict(), "layers": layers,
                "float_bytes": float_bytes, "stored_bytes": stored,
                "kept_float": self.kept_float}

    def table(self) -> str:
        """A fixed-width text table, one row per layer."""
        head = ("layer", "shape", "format", "SQNR dB", "matmul err", "inputs", "bytes", "")
        rows = [head]
        for layer in self.layers:
            rows.append((layer.name, "x".join(map(str, layer.shape)), layer.format,
                         f"{layer.sqnr_db:.1f}", f"{layer.matmul_rel_error:.2e}",
                         layer.input_source,
                         f"{layer.quantized_bytes / max(layer.float_bytes, 1):.3f}x",
                         "kept float" if layer.keep_float else ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def quantization_report(model_or_state_dict: nn.Module | Mapping[str, Any],
                        config: QuantizationConfig,
                        sample_inputs: Mapping[str, Any] | None = None, *,
                        seed: int = 0) -> QuantizationReport:
    """Measure, layer by layer, what ``config`` would do to a float model's accuracy.

    Args:
        model_or_state_dict: a float ``nn.Module`` (its layers selected by
            ``config.should_quantize``), or a state dict (its quantizable weights, as
            :func:`~vramkit.quant.model.quantize_model` selects them, measured on random
            inputs).
        config: the quantization to evaluate.
        sample_inputs: keyword arguments of the model's forward (``model(**sample_inputs)``
            runs once under ``torch.no_grad()`` and each layer's first input is captured: up to
            1024 rows for a linear layer, 2 samples for a convolution). Default None:
            Gaussian inputs for every layer.
        seed: seed of the Gaussian inputs (default 0).

    Returns:
        A :class:`QuantizationReport` in module order.

    Raises:
        ConfigError: bad argument types.
        QuantizationError: when the model already contains quantized layers (their float
            weights are gone, there is nothing to compare with).
    """
    if not isinstance(config, QuantizationConfig):
        raise ConfigError(f"config must be a QuantizationConfig, got {type(config).__name__}",
                          hint="Pass a QuantizationConfig, e.g. quantization_report(model, "
                               "QuantizationConfig(weights_dtype='nf4')).")
    if sample_inputs is not None and not isinstance(sample_inputs, Mapping):
        raise ConfigError("sample_inputs must be a dict of the model's forward keyword "
                          f"arguments, got {type(sample_inputs).__name__}",
                          hint="Pass the forward's keyword arguments as a dict, e.g. "
                               "sample_inputs={'x': x}, or None for random inputs.")
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model_or_state_dict, nn.Module):
        return _report_module(model_or_state_dict, config, sample_inputs, generator)
    if isinstance(model_or_state_dict, Mapping):
        if sample_inputs is not None:
            raise ConfigError("sample_inputs need a model to run; a state dict is measured on "
                              "random inputs",
                              hint="Pass the nn.Module to run sample_inputs through it, or drop "
                                   "sample_inputs for a state dict.")
        return _report_state_dict(model_or_state_dict, config, generator)
    raise ConfigError(f"quantization_report needs an nn.Module or a state dict, got "
                      f"{type(model_or_state_dict).__name__}",
                      hint="Pass the float model (nn.Module) or its state_dict().")


def _report_module(model: nn.Module, config: QuantizationConfig,
                   sample_inputs: Mapping[str, Any] | None,
                   generator: torch.Generator) -> QuantizationReport:
    quantized = [name for name, m in model.named_modules()
                 if isinstance(m, _QuantizedWeightModule)]
    if quantized:
        raise QuantizationError(
            f"the model is already quantized ({quantized[0]} ...): its float weights are gone",
            hint="Run quantization_report on the float model, before quantize_model.")
    layers = [(name, module) for name, module in model.named_modules()
              if name and config.should_quantize(name, module)]
    captured: dict[str, torch.Tensor] = {}
    if sample_inputs is not None:
        handles = [module.register_forward_pre_hook(_capture_hook(name, module, captured))
                   for name, module in layers]
        try:
            with torch.no_grad():
                model(**sample_inputs)
        finally:
            for handle in handles:
                handle.remove()
    rows = []
    for name, module in layers:
        kind = "conv2d" if isinstance(module, nn.Conv2d) else "linear"
        x = captured.get(name)
        source = "captured" if x is not None else "random"
        if x is None:
            x = _random_input(module, generator)
        rows.append(_measure(name, kind, module.weight.detach(), x, config, module, source))
    return QuantizationReport(config, tuple(rows))


def _report_state_dict(state: Mapping[str, Any], config: QuantizationConfig,
                       generator: torch.Generator) -> QuantizationReport:
    rows = []
    for key, value in state.items():
        if isinstance(value, QuantizedTensor):
            raise QuantizationError(f"{key} is already quantized: there is no float weight to "
                                    "compare with",
                                    hint="Report on the float state dict before quantize_model / "
                                         "save_quantized replaced it.")
        if not _selects_tensor(key, value, config):
            continue
        module_name = key.rpartition(".")[0]
        cols = math.prod(value.shape[1:])
        x = torch.randn(_RANDOM_ROWS, cols, generator=generator).to(value.device)
        weight2d = value.detach().reshape(value.shape[0], cols)
        rows.append(_measure(module_name, "tensor", weight2d, x, config, None, "random",
                             shape=tuple(value.shape)))
    return QuantizationReport(config, tuple(rows))


def _capture_hook(name: str, module: nn.Module, captured: dict[str, torch.Tensor]) -> Any:
    is_conv = isinstance(module, nn.Conv2d)

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
        if name in captured or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0].detach()
        if is_conv:
            captured[name] = x[:_CONV_CAPTURED_SAMPLES].clone()
        else:
            captured[name] = x.reshape(-1, x.shape[-1])[:_MAX_CAPTURED_ROWS].clone()

    return hook


def _random_input(module: nn.Module, generator: torch.Generator) -> torch.Tensor:
    weight = module.weight
    if isinstance(module, nn.Conv2d):
        shape: tuple[int, ...] = (2, module.in_channels, _CONV_RANDOM_SIDE, _CONV_RANDOM_SIDE)
    else:
        shape = (_RANDOM_ROWS, module.in_features)
    return torch.randn(shape, generator=generator).to(weight.device)


def _measure(name: str, kind: str, weight: torch.Tensor, x: torch.Tensor,
             config: QuantizationConfig, module: nn.Module | None, source: str, *,
             shape: tuple[int, ...] | None = None) -> LayerQuality:
    """Quantize one weight and compare it (and its layer output on ``x``) with the original."""
    q = quantize_tensor(weight, config.weight_format())
    dequantized = kernels.dequantize(q, torch.float32).reshape(weight.shape)
    reference_weight = weight.float()
    quality = sqnr_db(reference_weight, dequantized)
    x = x.to(weight.device, torch.float32)
    if isinstance(module, nn.Conv2d):
        reference = module._conv_forward(x, reference_weight, None)
        approx = module._conv_forward(x, dequantized, None)
    else:
        reference = F.linear(x, reference_weight)
        approx = F.linear(x, dequantized)
        if config.activation_fp8 and x.is_cuda and kernels.has_fp8_gemm(x.device):
            # The forward's real path: activations quantized per token too.
            approx = kernels.quantized_matmul(x.to(q.dtype), q, activation_fp8=True).float()
    ref_norm = float(torch.linalg.vector_norm(reference))
    error = float(torch.linalg.vector_norm(reference - approx))
    rel = error / ref_norm if ref_norm > 0 else (0.0 if error == 0 else math.inf)
    keep = config.min_sqnr_db is not None and quality < config.min_sqnr_db
    return LayerQuality(
        name=name, kind=kind, shape=tuple(shape if shape is not None else weight.shape),
        format=q.format.value,
        sqnr_db=quality, matmul_rel_error=rel, input_source=source,
        float_bytes=weight.numel() * weight.element_size(), quantized_bytes=int(q.nbytes),
        keep_float=keep)
