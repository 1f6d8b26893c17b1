"""quantization_report: per-layer SQNR and matmul error, captured inputs, min_sqnr_db."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant.formats import quantize_tensor
from vramkit.quant.linear import QuantizedLinear
from vramkit.quant.model import QuantizationConfig, quantize_model, sqnr_db
from vramkit.quant.report import QuantizationReport, quantization_report


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.inner = nn.Linear(64, 128)
        self.outer = nn.Linear(128, 32)
        self.skipped = nn.Linear(32, 8)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pooled = self.conv(image).mean()
        return self.skipped(self.outer(F.relu(self.inner(tokens)))) + pooled


def _model(seed: int = 0) -> _Model:
    torch.manual_seed(seed)
    return _Model()


def _outlier_weight(rows: int, cols: int) -> torch.Tensor:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    weight[:, ::32] *= 40.0
    return weight


def test_report_rows_follow_the_config() -> None:
    config = QuantizationConfig("int8", modules_to_not_quantize=["skipped"])
    report = quantization_report(_model(), config)
    assert isinstance(report, QuantizationReport)
    assert [layer.name for layer in report.layers] == ["conv", "inner", "outer"]
    inner = report.layer("inner")
    assert inner.kind == "linear" and inner.shape == (128, 64) and inner.format == "int8"
    assert inner.input_source == "random"
    assert 30 < inner.sqnr_db < 80 and 0 < inner.matmul_rel_error < 1e-2
    assert inner.quantized_bytes < inner.float_bytes
    assert report.layer("conv").kind == "conv2d"
    with pytest.raises(KeyError):
        report.layer("skipped")


def test_sqnr_and_error_match_a_direct_computation() -> None:
    model = _model()
    report = quantization_report(model, QuantizationConfig("nf4"))
    weight = model.outer.weight.detach()
    q = quantize_tensor(weight, "nf4")
    expected = sqnr_db(weight, q.dequantize(torch.float32))
    assert report.layer("outer").sqnr_db == pytest.approx(expected, rel=1e-6)


def test_sample_inputs_are_captured_and_used() -> None:
    model = _model()
    tokens = torch.randn(4, 10, 64)
    tokens[..., 0] = 500.0  # a dominant input feature: the real error differs from Gaussian's
    sample = {"image": torch.randn(2, 3, 8, 8), "tokens": tokens}
    config = QuantizationConfig("int4")
    captured = quantization_report(model, config, sample)
    random = quantization_report(model, config)
    row = captured.layer("inner")
    assert row.input_source == "captured"
    assert captured.layer("conv").input_source == "captured"
    x = tokens.reshape(-1, 64)
    q = quantize_tensor(model.inner.weight.detach(), "int4")
    ref = F.linear(x, model.inner.weight.detach())
    expected = float((ref - F.linear(x, q.dequantize(torch.float32))).norm() / ref.norm())
    assert row.matmul_rel_error == pytest.approx(expected, rel=1e-5)
    assert row.matmul_rel_error != pytest.approx(random.layer("inner").matmul_rel_error,
                                                 rel=1e-3)
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_min_sqnr_db_flags_the_outlier_layer_and_quantize_model_agrees() -> None:
    model = _model()
    with torch.no_grad():
        model.outer.weight.copy_(_outlier_weight(32, 128))
    config = QuantizationConfig("int8", min_sqnr_db=42.0, quantize_conv=False)
    report = quantization_report(model, config)
    assert report.kept_float == ["outer"]
    assert report.layer("outer").sqnr_db < 42.0 <= report.layer("inner").sqnr_db
    quantize_model(model, config)
    assert type(model.outer) is nn.Linear
    assert isinstance(model.inner, QuantizedLinear)


def test_to_dict_and_table() -> None:
    config = QuantizationConfig("fp8", min_sqnr_db=10.0)
    report = quantization_report(_model(), config)
    data = json.loads(json.dumps(report.to_dict()))
    assert [row["name"] for row in data["layers"]] == ["conv", "inner", "outer", "skipped"]
    assert data["config"]["weights_dtype"] == "fp8"
    assert data["stored_bytes"] < data["float_bytes"]
    table = str(report)
    assert "inner" in table and "SQNR" in table and "fp8" in table
    assert len(table.splitlines()) == 2 + len(report.layers)
    assert report.worst(1)[0].sqnr_db == min(layer.sqnr_db for layer in report.layers)


def test_state_dict_report() -> None:
    state = {"a.weight": torch.randn(32, 64), "a.bias": torch.randn(32),
             "b.weight": _outlier_weight(16, 128)}
    report = quantization_report(state, QuantizationConfig("int8", min_sqnr_db=42.0))
    assert [layer.name for layer in report.layers] == ["a", "b"]
    assert report.kept_float == ["b"]
    assert all(layer.input_source == "random" for layer in report.layers)


def test_bad_arguments() -> None:
    config = QuantizationConfig("int8")
    with pytest.raises(ConfigError):
        quantization_report(_model(), "int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        quantization_report(_model(), config, [torch.zeros(1)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        quantization_report({"a.weight": torch.randn(4, 4)}, config, {"x": 1})
    quantized = quantize_model(_model(), config)
    with pytest.raises(QuantizationError, match="already quantized"):
        quantization_report(quantized, config)


@pytest.mark.gpu
def test_gpu_report_on_cuda_model() -> None:
    model = _model().cuda()
    sample = {"image": torch.randn(2, 3, 8, 8, device="cuda"),
              "tokens": torch.randn(4, 10, 64, device="cuda")}
    report = quantization_report(model, QuantizationConfig("int8"), sample)
    cpu = quantization_report(_model(), QuantizationConfig("int8"),
                              {k: v.cpu() for k, v in sample.items()})
    for gpu_row, cpu_row in zip(report.layers, cpu.layers, strict=True):
        assert gpu_row.sqnr_db == pytest.approx(cpu_row.sqnr_db, rel=1e-3)


def test_seed_draws_the_random_inputs() -> None:
    model, config = _model(), QuantizationConfig("int4", quantize_conv=False)
    first = quantization_report(model, config, seed=0).layer("inner").matmul_rel_error
    again = quantization_report(model, config, seed=0).layer("inner").matmul_rel_error
    other = quantization_report(model, config, seed=1).layer("inner").matmul_rel_error
    assert first == again and first != other
