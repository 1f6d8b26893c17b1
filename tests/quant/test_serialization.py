"""save_quantized / load_quantized / load_quantized_model: bit-exact round trips, declared
layout, and clear errors for files vramkit cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant.formats import QuantizedTensor, quantize_tensor
from vramkit.quant.linear import QuantizedConv2d, QuantizedLinear
from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.quant.serialization import (
    FORMAT_VERSION,
    LAYOUT_KEY,
    VERSION_KEY,
    load_quantized,
    load_quantized_model,
    quantized_state_dict,
    save_quantized,
)

FORMATS = ["int8", "int4", "nf4", "fp8"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _assert_same_record(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert a.config == b.config and a.shape == b.shape and a.dtype == b.dtype
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(_bits(ta[name]), _bits(tb[name])), name


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, stride=2)
        self.fc1 = nn.Linear(40, 96)
        self.norm = nn.LayerNorm(96)
        self.fc2 = nn.Linear(96, 10, bias=False)

    def forward(self, image: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x))) + self.conv(image).mean()


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net().to(torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip_is_bit_exact(fmt: str, tmp_path: Path) -> None:
    state = {"layer.weight": quantize_tensor(torch.randn(33, 70, dtype=torch.bfloat16), fmt),
             "layer.bias": torch.randn(33),
             "conv.weight": quantize_tensor(torch.randn(4, 3, 3, 3), fmt)}
    path = tmp_path / "q.safetensors"
    save_quantized(state, path)
    loaded = load_quantized(path)
    assert loaded.keys() == state.keys()
    _assert_same_record(state["layer.weight"], loaded["layer.weight"])
    _assert_same_record(state["conv.weight"], loaded["conv.weight"])
    assert torch.equal(loaded["layer.bias"], state["layer.bias"])
    assert torch.equal(loaded["layer.weight"].dequantize(), state["layer.weight"].dequantize())


def test_metadata_declares_the_layout(tmp_path: Path) -> None:
    q = quantize_tensor(torch.randn(16, 64, dtype=torch.float16), "nf4")
    path = tmp_path / "q.safetensors"
    save_quantized({"w.weight": q, "b": torch.ones(2)}, path, metadata={"author": "me"})
    with safe_open(path, framework="pt") as handle:
        meta = handle.metadata()
        names = set(handle.keys())
    assert meta["author"] == "me" and meta[VERSION_KEY] == FORMAT_VERSION
    entry = json.loads(meta[LAYOUT_KEY])["w.weight"]
    assert entry["format"] == "nf4" and entry["shape"] == [16, 64]
    assert entry["dtype"] == "float16"
    assert entry["config"]["block_size"] == q.config.block_size
    assert set(entry["tensors"]) == set(q.tensors())
    assert set(entry["tensors"].values()) | {"b"} == names
    assert entry["tensors"]["data"] == "w.weight:data"


def test_model_round_trip_rebuilds_quantized_layers(tmp_path: Path) -> None:
    model = quantize_model(_net(), QuantizationConfig("int4", modules_to_not_quantize=["fc2"]))
    image, x = torch.randn(1, 3, 8, 8, dtype=torch.bfloat16), torch.randn(5, 40,
                                                                           dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(image, x)
    path = tmp_path / "model.safetensors"
    save_quantized(model, path)
    fresh = _net(seed=1)
    fc2_weight = model.fc2.weight.detach().clone()
    assert load_quantized_model(fresh, path) is fresh
    assert isinstance(fresh.fc1, QuantizedLinear) and isinstance(fresh.conv, QuantizedConv2d)
    assert type(fresh.fc2) is nn.Linear and torch.equal(fresh.fc2.weight, fc2_weight)
    assert fresh.conv.stride == (2, 2)
    _assert_same_record(fresh.fc1.quantized_weight, model.fc1.quantized_weight)
    assert torch.equal(fresh.fc1.bias, model.fc1.bias)
    with torch.no_grad():
        assert torch.equal(fresh(image, x), expected)
    # Loading again into the now-quantized model replaces its quantized layers.
    load_quantized_model(fresh, path)
    with torch.no_grad():
        assert torch.equal(fresh(image, x), expected)


def test_quantized_state_dict_folds_buffers() -> None:
    model = quantize_model(_net(), QuantizationConfig("int8"))
    state = quantized_state_dict(model)
    assert isinstance(state["fc1.weight"], QuantizedTensor)
    assert not any(key.startswith("fc1.weight_") for key in state)
    assert torch.equal(state["fc1.bias"], model.fc1.bias)


def test_activation_fp8_flag_round_trips(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(32, 16))
    quantize_model(model, QuantizationConfig("fp8", activations_dtype="fp8"))
    path = tmp_path / "fp8.safetensors"
    save_quantized(model, path)
    fresh = load_quantized_model(nn.Sequential(nn.Linear(32, 16)), path)
    assert fresh[0].activation_fp8
    plain = nn.Sequential(nn.Linear(32, 16))
    quantize_model(plain, QuantizationConfig("fp8"))
    save_quantized(plain, path)
    assert not load_quantized_model(nn.Sequential(nn.Linear(32, 16)), path)[0].activation_fp8


def test_load_into_a_meta_model(tmp_path: Path) -> None:
    model = quantize_model(_net(), QuantizationConfig("nf4", quantize_conv=False))
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    with torch.device("meta"):
        skeleton = _Net().to(torch.bfloat16)
    load_quantized_model(skeleton, path)
    assert all(t.device.type == "cpu" for t in skeleton.state_dict().values())
    image, x = torch.randn(1, 3, 8, 8, dtype=torch.bfloat16), torch.randn(2, 40,
                                                                           dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(skeleton(image, x), model(image, x))


def test_strict_loading(tmp_path: Path) -> None:
    model = quantize_model(_net(), QuantizationConfig("int8"))
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    with pytest.raises(QuantizationError, match="does not match"):
        load_quantized_model(_extra_net(), path)
    loaded = load_quantized_model(_extra_net(), path, strict=False)
    assert isinstance(loaded.fc1, QuantizedLinear)
    other = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(QuantizationError, match="no layer"):
        load_quantized_model(other, path)


def _extra_net() -> nn.Module:
    net = _net()
    net.extra = nn.Linear(4, 4)
    return net


def _rewrite(path: Path, metadata: dict[str, str], drop: str | None = None) -> None:
    with safe_open(path, framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys() if k != drop}
    save_file(tensors, path, metadata=metadata)


def _saved(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "q.safetensors"
    save_quantized({"w.weight": quantize_tensor(torch.randn(8, 64), "int8")}, path)
    with safe_open(path, framework="pt") as handle:
        return path, dict(handle.metadata())


def test_unknown_version_is_refused(tmp_path: Path) -> None:
    path, meta = _saved(tmp_path)
    _rewrite(path, {**meta, VERSION_KEY: "99"})
    with pytest.raises(QuantizationError, match="version"):
        load_quantized(path)


def test_absent_layout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.randn(2, 2)}, path)
    with pytest.raises(QuantizationError, match="declares no"):
        load_quantized(path)
    with pytest.raises(QuantizationError):
        load_quantized_model(nn.Linear(2, 2), path)


@pytest.mark.parametrize("layout", ["not json", json.dumps([1, 2]),
                                    json.dumps({"w.weight": {"format": "int8"}})])
def test_unknown_layout_is_refused(tmp_path: Path, layout: str) -> None:
    path, meta = _saved(tmp_path)
    _rewrite(path, {**meta, LAYOUT_KEY: layout})
    with pytest.raises(QuantizationError):
        load_quantized(path)


def test_layout_naming_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    path, meta = _saved(tmp_path)
    _rewrite(path, meta, drop="w.weight:scales")
    with pytest.raises(QuantizationError, match="does not hold"):
        load_quantized(path)


def test_unknown_format_in_the_record_is_refused(tmp_path: Path) -> None:
    path, meta = _saved(tmp_path)
    layout = json.loads(meta[LAYOUT_KEY])
    for key in layout["w.weight"]["record"]:
        if layout["w.weight"]["record"][key] == "int8":
            layout["w.weight"]["record"][key] = "int3"
    _rewrite(path, {**meta, LAYOUT_KEY: json.dumps(layout)})
    with pytest.raises(QuantizationError):
        load_quantized(path)


def test_bad_save_arguments(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(ConfigError, match="reserved"):
        save_quantized({"a": torch.ones(1)}, path, metadata={VERSION_KEY: "2"})
    with pytest.raises(ConfigError):
        save_quantized({"a": torch.ones(1)}, path, metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError):
        save_quantized({"a": 3}, path)  # type: ignore[dict-item]
    q = quantize_tensor(torch.randn(4, 64), "int8")
    with pytest.raises(QuantizationError, match="collides"):
        save_quantized({"w": q, "w:data": torch.ones(1)}, path)


def test_device_argument(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    loaded = load_quantized(path, device="cpu")
    assert loaded["w.weight"].device == torch.device("cpu")


@pytest.mark.gpu
def test_gpu_load_to_cuda_is_bit_exact(tmp_path: Path) -> None:
    q = quantize_tensor(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16), "nf4")
    path = tmp_path / "g.safetensors"
    save_quantized({"w.weight": q}, path)
    loaded = load_quantized(path, device="cuda")
    assert loaded["w.weight"].device.type == "cuda"
    _assert_same_record(loaded["w.weight"], q)


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    path = tmp_path / "model.safetensors"
    model = quantize_model(nn.Linear(64, 64), QuantizationConfig("int8"))
    save_quantized(model, path)
    before = path.read_bytes()

    def half_written(tensors: object, target: str, metadata: object = None) -> None:
        Path(target).write_bytes(before[: len(before) // 2])
        raise OSError(28, "No space left on device")  # the disk filled up midway

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    with pytest.raises(OSError, match="No space"):
        save_quantized(model, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    monkeypatch.undo()
    save_quantized(model, path)  # and the next save works
    assert torch.equal(load_quantized(path)["weight"].tensors()["data"],
                       model.quantized_weight.tensors()["data"])
