"""MemoryEfficientLoader on the CPU: prefixes, dtypes, read modes, streaming, load_into."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vramkit.errors import ConfigError
from vramkit.io.loader import MemoryEfficientLoader, load_into, stream_weights


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_file({"unet.conv.weight": torch.randn(4, 3), "unet.conv.bias": torch.randn(4),
               "vae.scale": torch.randn(2).to(torch.bfloat16),
               "vae.steps": torch.arange(3, dtype=torch.int32)}, tmp_path / "w.safetensors")
    return tmp_path / "w.safetensors"


def test_load_safetensors_prefix_and_strip(weights: Path) -> None:
    loader = MemoryEfficientLoader("cpu")
    everything = loader.load_safetensors(weights)
    assert len(everything) == 4
    unet = loader.load_safetensors(weights, prefix="unet.")
    assert sorted(unet) == ["unet.conv.bias", "unet.conv.weight"]
    stripped = loader.load_safetensors(weights, prefix="unet.", strip_prefix=True)
    assert sorted(stripped) == ["conv.bias", "conv.weight"]
    assert torch.equal(stripped["conv.weight"], everything["unet.conv.weight"])
    assert loader.last_stats is not None and loader.last_stats.tensors == 2


def test_dtype_converts_floating_tensors_only(weights: Path) -> None:
    converted = MemoryEfficientLoader("cpu").load_with_dtype_conversion(weights, torch.float16)
    assert converted["unet.conv.weight"].dtype == torch.float16
    assert converted["vae.scale"].dtype == torch.float16
    assert converted["vae.steps"].dtype == torch.int32
    plain = MemoryEfficientLoader("cpu").load_safetensors(weights)
    assert torch.equal(converted["unet.conv.weight"], plain["unet.conv.weight"].half())
    assert plain["vae.scale"].dtype == torch.bfloat16
    loaded = MemoryEfficientLoader("cpu", dtype=torch.float64).load_safetensors(weights)
    assert loaded["vae.scale"].dtype == torch.float64 and loaded["vae.steps"].dtype == torch.int32
    with pytest.raises(ConfigError):
        MemoryEfficientLoader("cpu").load_with_dtype_conversion(weights, torch.int8)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_read_modes_take_their_own_path(weights: Path, use_mmap: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.preadv

    def spy(fd: int, buffers: Any, offset: int) -> int:
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    loader = MemoryEfficientLoader("cpu", use_mmap=use_mmap)
    loaded = loader.load_safetensors(weights)
    assert loader.last_stats is not None
    assert loader.last_stats.mode == ("mmap" if use_mmap else "pread")
    assert bool(calls) is (not use_mmap)
    assert torch.equal(loaded["vae.steps"], torch.arange(3, dtype=torch.int32))


def test_stream_weights_order_and_function_form(weights: Path) -> None:
    seen: list[tuple[str, torch.dtype]] = []
    stats = stream_weights(weights, lambda name, t: seen.append((name, t.dtype)),
                           dtype=torch.float16, prefix="vae.")
    assert sorted(name for name, _ in seen) == ["vae.scale", "vae.steps"]
    assert dict(seen) == {"vae.scale": torch.float16, "vae.steps": torch.int32}
    assert stats.tensors == 2 and stats.file_bytes == 2 * 2 + 3 * 4 and not stats.staged


def test_invalid_arguments() -> None:
    for kwargs in ({"device": "mps"}, {"device": "bogus"}, {"dtype": torch.int8},
                   {"chunk_bytes": 0}, {"chunk_bytes": 24}, {"chunk_bytes": "lots"},
                   {"num_buffers": 0}, {"read_threads": 0}, {"progress": "yes"},
                   {"use_mmap": 1}):
        with pytest.raises(ConfigError):
            MemoryEfficientLoader(**kwargs)
    assert MemoryEfficientLoader("cpu", chunk_bytes="1MiB").chunk_bytes == 1 << 20


def test_progress_bar_is_shown_or_suppressed(weights: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    MemoryEfficientLoader("cpu", progress=True).load_safetensors(weights)
    assert "loading w.safetensors" in capsys.readouterr().err
    MemoryEfficientLoader("cpu", progress=False).load_safetensors(weights)
    MemoryEfficientLoader("cpu").load_safetensors(weights)  # small and not a tty: no bar
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("use_mmap", [True, False])
def test_stream_weights_keeps_host_memory_bounded(tmp_path: Path, use_mmap: bool) -> None:
    psutil = pytest.importorskip("psutil")
    path = tmp_path / "big.safetensors"
    tensor_bytes = 8 << 20
    count = 24  # 192 MiB in all
    save_file({f"t{i:02d}": torch.full((tensor_bytes // 4,), float(i)) for i in range(count)},
              path)
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = 0

    def check(name: str, tensor: torch.Tensor) -> None:
        nonlocal peak
        assert float(tensor[0]) == float(int(name[1:]))
        peak = max(peak, process.memory_info().rss - baseline)

    MemoryEfficientLoader("cpu", use_mmap=use_mmap).stream_weights(path, check)
    # holding every tensor (or every mapped page) would be 192 MiB; one at a time is ~8 MiB
    assert peak < 64 << 20, f"resident set grew by {peak >> 20} MiB"


# -- load_into ------------------------------------------------------------------------------


class TinyModel(nn.Module):
    def __init__(self, with_extra: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("position", torch.arange(4), persistent=True)
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        if with_extra:
            self.extra = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(self.norm(x))


@pytest.fixture
def model_file(tmp_path: Path) -> tuple[TinyModel, Path]:
    torch.manual_seed(1)
    reference = TinyModel()
    state = {k: v for k, v in reference.state_dict().items() if k != "head.weight"}
    save_file({f"model.{k}": v.contiguous() for k, v in state.items()},
              tmp_path / "model.safetensors")
    return reference, tmp_path / "model.safetensors"


def meta_model(**kwargs: Any) -> TinyModel:
    # .to("meta") rather than `with torch.device("meta")`: the latter imports torch._dynamo (~5 s)
    model = TinyModel(**kwargs).to("meta")
    model.head.weight = model.embed.weight  # .to() may untie across a device change
    return model


@pytest.mark.parametrize("use_mmap", [True, False])
def test_load_into_meta_module(model_file: tuple[TinyModel, Path], use_mmap: bool) -> None:
    reference, path = model_file
    model = meta_model()
    model.blocks[0].weight.requires_grad_(False)
    result = MemoryEfficientLoader("cpu", use_mmap=use_mmap).load_into(model, path,
                                                                       prefix="model.")
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert result.still_meta == ["cache"]  # non-persistent: the caller initializes it
    model.cache = torch.zeros(3)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids), reference(ids))
    assert model.head.weight is model.embed.weight  # still tied
    assert not model.blocks[0].weight.requires_grad and model.blocks[1].weight.requires_grad
    assert isinstance(model.blocks[0].weight, nn.Parameter)
    assert not isinstance(model.position, nn.Parameter)
    assert result.stats.tensors == len(result.loaded_keys) == 8


def test_load_into_uses_module_or_loader_dtype(model_file: tuple[TinyModel, Path]) -> None:
    _, path = model_file
    model = meta_model().to(torch.bfloat16)
    load_into(model, path, prefix="model.")
    assert model.blocks[0].weight.dtype == torch.bfloat16 and model.position.dtype == torch.int64
    model = meta_model()
    load_into(model, path, prefix="model.", dtype=torch.float16)
    assert model.norm.weight.dtype == torch.float16


def test_strict_refuses_before_loading_anything(model_file: tuple[TinyModel, Path]) -> None:
    _, path = model_file
    model = meta_model(with_extra=True)
    with pytest.raises(ConfigError, match=r"2 missing key\(s\): extra.weight, extra.bias"):
        load_into(model, path, prefix="model.")
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ConfigError, match="unexpected key") as info:
        load_into(meta_model(), path)  # forgot the prefix
    assert "prefix=" in (info.value.hint or "")
    result = load_into(model, path, prefix="model.", strict=False)
    assert result.missing_keys == ["extra.weight", "extra.bias"]
    assert set(result.still_meta) == {"extra.weight", "extra.bias", "cache"}
    assert not model.blocks[1].weight.is_meta


def test_shape_mismatch_is_refused(tmp_path: Path) -> None:
    save_file({"weight": torch.ones(3, 2), "bias": torch.ones(3)}, tmp_path / "l.safetensors")
    layer = nn.Linear(4, 3, device="meta")
    with pytest.raises(ConfigError, match=r"weight: checkpoint \[3, 2\], module \[3, 4\]"):
        load_into(layer, tmp_path / "l.safetensors", strict=False)


# -- load-and-quantize (fake quantizer: tests the streaming logic, with vramkit.quant's walk
# selecting the layers and fakes quantizing weights and building layers) ---------------------


class FakeQuantConfig:
    min_sqnr_db = None

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        self.skip = skip

    def weight_format(self) -> str:
        return "fake8"

    def should_quantize(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and name not in self.skip


class FakeQuantizedLinear(nn.Module):
    def __init__(self, q: dict[str, Any], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.q, self.bias = q, bias

    @classmethod
    def from_quantized(cls, q: dict[str, Any], bias: torch.Tensor | None = None) -> nn.Module:
        return cls(q, bias)


def use_fake_quantizer(monkeypatch: pytest.MonkeyPatch, quantize: Any) -> None:
    """Make load_into take FakeQuantConfig, quantize with ``quantize(tensor, format)`` and build
    FakeQuantizedLinear layers (the layers are still selected by quant's quantizable_layers)."""
    from vramkit.quant import model as quant_model

    monkeypatch.setattr(quant_model, "QuantizationConfig", FakeQuantConfig)
    monkeypatch.setattr(quant_model, "quantize_weight",
                        lambda weight, config, *, name: quantize(weight, config.weight_format()))
    monkeypatch.setattr(quant_model, "quantized_layer",
                        lambda layer, weight, bias, config, *, name:
                        FakeQuantizedLinear.from_quantized(weight, bias))


def test_quantizes_linear_layers_while_streaming(model_file: tuple[TinyModel, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = model_file
    quantized_inputs: list[tuple[torch.Size, str]] = []

    def fake_quantize(t: torch.Tensor, fmt: str) -> dict[str, Any]:
        quantized_inputs.append((t.shape, fmt))
        return {"data": t.to(torch.int8), "shape": t.shape}

    use_fake_quantizer(monkeypatch, fake_quantize)
    model = meta_model()
    result = load_into(model, path, prefix="model.", quantization=FakeQuantConfig(("blocks.1",)))
    # head is tied to the embedding, blocks.1 is excluded by the config
    assert result.quantized_modules == ["blocks.0"]
    assert quantized_inputs == [(torch.Size([8, 8]), "fake8")]
    assert isinstance(model.blocks[0], FakeQuantizedLinear)
    assert torch.equal(model.blocks[0].bias, reference.blocks[0].bias)
    assert isinstance(model.blocks[1], nn.Linear) and not model.blocks[1].weight.is_meta
    with pytest.raises(ConfigError, match="must be a FakeQuantConfig"):
        load_into(meta_model(), path, prefix="model.", quantization=object())


def real_quant() -> tuple[Any, Any]:
    """(QuantizationConfig, QuantizedLinear), as the loader uses them."""
    from vramkit.quant.linear import QuantizedLinear
    from vramkit.quant.model import QuantizationConfig

    return QuantizationConfig, QuantizedLinear


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_load_and_quantize_with_vramkit_quant(model_file: tuple[TinyModel, Path],
                                              fmt: str) -> None:
    config_type, linear_type = real_quant()
    reference, path = model_file
    model = meta_model()
    result = load_into(model, path, prefix="model.",
                       quantization=config_type(weights_dtype=fmt))
    assert set(result.quantized_modules) >= {"blocks.0", "blocks.1"}
    assert isinstance(model.blocks[0], linear_type)
    model.cache = torch.zeros(3)
    ids = torch.tensor([[1, 2, 3]])
    error = (model(ids) - reference(ids)).abs().max().item()
    assert error < 0.5
    assert not any(isinstance(m, nn.Linear) and m.weight.dtype.is_floating_point
                   for name, m in model.named_modules() if name.startswith("blocks"))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.proj = nn.Linear(16, 32)
        self.odd = nn.Linear(32, 24)  # 24 is not a multiple of 16: no fp8 GEMM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.proj(self.conv(x).mean(dim=(2, 3))))


def test_load_and_quantize_honours_the_whole_config(tmp_path: Path) -> None:
    """Same config, same model as quantize_model: convs, fp8 activations, refusing min_sqnr_db."""
    from safetensors.torch import save_file

    from vramkit.quant.linear import QuantizedConv2d, QuantizedLinear
    from vramkit.quant.model import QuantizationConfig, quantize_model

    torch.manual_seed(0)
    reference = ConvNet()
    path = tmp_path / "conv.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    config = QuantizationConfig("fp8", activations_dtype="fp8")
    with torch.device("meta"):
        model = ConvNet()
    load_into(model, path, quantization=config)
    expected = quantize_model(copy.deepcopy(reference), config)
    assert isinstance(model.conv, QuantizedConv2d) and isinstance(model.proj, QuantizedLinear)
    for name in ("conv", "proj", "odd"):
        got, want = getattr(model, name), getattr(expected, name)
        assert type(got) is type(want), name
        assert got.quantized_weight.tensors().keys() == want.quantized_weight.tensors().keys()
        for key, tensor in got.quantized_weight.tensors().items():
            other = want.quantized_weight.tensors()[key]
            if tensor.dtype.itemsize == 1:  # fp8 codes compare as bytes
                tensor, other = tensor.view(torch.uint8), other.view(torch.uint8)
            assert torch.equal(tensor, other), (name, key)
    assert model.proj.activation_fp8 and expected.proj.activation_fp8
    assert not model.odd.activation_fp8 and not expected.odd.activation_fp8
    no_conv = QuantizationConfig("int8", quantize_conv=False)
    with torch.device("meta"):
        model = ConvNet()
    load_into(model, path, quantization=no_conv)
    assert isinstance(model.conv, nn.Conv2d) and isinstance(model.proj, QuantizedLinear)
    with torch.device("meta"):
        model = ConvNet()
    with pytest.raises(ConfigError, match="min_sqnr_db"):
        load_into(model, path, quantization=QuantizationConfig("int8", min_sqnr_db=30.0))
