"""The checkpoint-format door: single-file FLUX/SDXL, fp8_scaled and GGUF files loaded into a
diffusers model built on meta, tensor by tensor, and the errors for malformed files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.io._single_files import tiny_flux, tiny_sdxl, to_original, write_gguf
from vramkit.errors import ConfigError, SafetensorsFormatError
from vramkit.io._single_file import FLUX, LDM_PREFIX, SDXL
from vramkit.io.formats import MappedCheckpoint, detect_format, open_checkpoint
from vramkit.io.loader import load_into

pytest.importorskip("diffusers")


def _assert_state_equal(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("prefix", ["", LDM_PREFIX])
def test_single_file_flux_streams_into_the_diffusers_model(tmp_path: Path, prefix: str) -> None:
    reference = tiny_flux()
    want = reference.state_dict()
    original = to_original(FLUX, want, prefix=prefix)
    if prefix:  # a full ComfyUI checkpoint also holds the VAE and text encoders
        original["first_stage_model.decoder.conv_in.weight"] = torch.zeros(3)
        original["text_encoders.clip_l.transformer.x.weight"] = torch.zeros(3)
    path = tmp_path / "flux1.safetensors"
    save_file(original, path)
    assert detect_format(path).layout == FLUX
    model = tiny_flux("meta")
    result = load_into(model, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_state_equal(model, want)
    if prefix:  # the layout's own prefix, passed as ComfyUI users would: already mapped
        again = tiny_flux("meta")
        load_into(again, path, prefix=prefix)
        _assert_state_equal(again, want)
    # Each split piece is a byte range of its fused tensor: the whole file is read once.
    original_bytes = sum(t.numel() * t.element_size() for k, t in original.items()
                         if k.startswith(prefix) and not k.startswith(("first", "text")))
    assert result.stats.file_bytes == original_bytes


def test_single_file_sdxl_streams_into_the_unet(tmp_path: Path) -> None:
    reference = tiny_sdxl()
    want = reference.state_dict()
    path = tmp_path / "sdxl.safetensors"
    save_file(to_original(SDXL, want, prefix=LDM_PREFIX), path)
    fmt = detect_format(path)
    assert (fmt.layout, fmt.prefix) == (SDXL, LDM_PREFIX)
    model = tiny_sdxl("meta")
    load_into(model, path)
    _assert_state_equal(model, want)


def _fp8_scaled(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """ComfyUI's fp8_scaled form of a BFL-layout state dict: 2-D weights as e4m3 codes with a
    per-tensor scale."""
    out: dict[str, torch.Tensor] = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    for name, t in state.items():
        if name.endswith(".weight") and t.dim() == 2:
            scale = t.abs().max().float() / 448
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[name.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
            out[name.removesuffix(".weight") + ".scale_input"] = torch.ones(())
        else:
            out[name] = t
    return out, {}


def test_fp8_scaled_weights_are_scaled_as_they_load(tmp_path: Path) -> None:
    reference = tiny_flux()
    original, _ = _fp8_scaled(to_original(FLUX, reference.state_dict(), prefix=LDM_PREFIX))
    path = tmp_path / "flux_fp8_scaled.safetensors"
    save_file(original, path)
    assert detect_format(path).fp8_scaled
    model = tiny_flux("meta")
    load_into(model, path)
    qkv = original[f"{LDM_PREFIX}double_blocks.0.img_attn.qkv.weight"]
    scale = original[f"{LDM_PREFIX}double_blocks.0.img_attn.qkv.scale_weight"]
    full = qkv.float() * scale
    rows = full.shape[0] // 3
    got = model.transformer_blocks[0].attn.to_k.weight
    assert got.dtype == torch.float32
    assert torch.equal(got, full[rows:2 * rows])


def test_fp8_scaled_weights_stay_8_bit_under_an_fp8_config(tmp_path: Path) -> None:
    from vramkit.quant.linear import QuantizedLinear
    from vramkit.quant.model import QuantizationConfig

    reference = tiny_flux()
    original, _ = _fp8_scaled(to_original(FLUX, reference.state_dict()))
    path = tmp_path / "flux_fp8_scaled.safetensors"
    save_file(original, path)
    model = tiny_flux("meta")
    result = load_into(model, path, quantization=QuantizationConfig("fp8"))
    layer = model.single_transformer_blocks[1].proj_mlp
    assert isinstance(layer, QuantizedLinear)
    codes = original["single_blocks.1.linear1.weight"]
    hidden = model.inner_dim
    assert torch.equal(layer.weight_data.view(torch.uint8),
                       codes[3 * hidden:].view(torch.uint8))  # the file's codes, bit for bit
    scale = original["single_blocks.1.linear1.scale_weight"]
    want = codes[3 * hidden:].float() * scale
    torch.testing.assert_close(layer.dequantized_weight(torch.float32), want, rtol=0, atol=0)
    assert "single_transformer_blocks.1.proj_mlp.weight_scales" not in result.missing_keys


def _gguf_flux(tmp_path: Path, kinds: tuple[str, ...] = ("Q8_0", "Q5_0", "Q4_1")
               ) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    reference = tiny_flux()
    original = to_original(FLUX, reference.state_dict())
    quant: dict[str, str] = {}
    for i, (name, t) in enumerate(original.items()):
        if t.dim() == 2 and t.shape[1] % 32 == 0:
            quant[name] = kinds[i % len(kinds)]
    path = tmp_path / "flux1-dev-Q8_0.gguf"
    write_gguf(str(path), original, quant)
    return path, original, quant


def test_gguf_flux_keeps_its_packed_bytes_and_decodes_them(tmp_path: Path) -> None:
    import gguf

    from vramkit.quant.gguf import GGUFLinear

    path, _, quant = _gguf_flux(tmp_path)
    fmt = detect_format(path)
    assert fmt.container == "gguf" and fmt.layout == FLUX and fmt.quant_types["Q8_0"] > 0
    model = tiny_flux("meta")
    load_into(model, path)
    assert not any(t.is_meta for t in model.state_dict().values())
    layer = model.transformer_blocks[1].attn.add_v_proj
    assert isinstance(layer, GGUFLinear)
    name = "double_blocks.1.txt_attn.qkv.weight"
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == name)
    full = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    rows = full.shape[0] // 3
    assert layer.qtype.name == quant[name]
    assert torch.equal(layer.dequantized_weight(torch.float32), full[2 * rows:])
    # The model runs, close to the full-precision one (the quantization error only).
    reference = tiny_flux()
    inputs = dict(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3),
                  txt_ids=torch.zeros(4, 3), return_dict=False)
    with torch.no_grad():
        got, want = model(**inputs)[0], reference(**inputs)[0]
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_gguf_lora_trains_on_the_loaded_base(tmp_path: Path) -> None:
    from vramkit.recipes.lora import LoRALinear

    path, _, _ = _gguf_flux(tmp_path, kinds=("Q8_0",))
    model = tiny_flux("meta")
    load_into(model, path)
    model.requires_grad_(False)
    attn = model.transformer_blocks[0].attn
    attn.to_q = LoRALinear(attn.to_q, rank=2)
    with torch.no_grad():
        attn.to_q.up.normal_()
    out = model(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 32),
                pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(4, 3), return_dict=False)[0]
    out.square().mean().backward()
    assert attn.to_q.down.grad is not None and attn.to_q.down.grad.abs().sum() > 0


def test_a_prepared_model_wrapped_by_peft_loads_its_packed_bases_from_the_file(
        tmp_path: Path) -> None:
    """prepare_module first, peft's LoRA added on meta after (as a training script does, the
    adapters beside the packed bases), then the file loads: the GGUF bytes land in each
    wrapped layer's base_layer, the same bytes as without LoRA."""
    peft = pytest.importorskip("peft")

    from vramkit.io.formats import prepare_module
    from vramkit.quant.gguf import GGUFLinear
    from vramkit.quant.linear import register_peft_lora

    path, _, _ = _gguf_flux(tmp_path, kinds=("Q8_0",))
    plain = tiny_flux("meta")
    load_into(plain, path)
    model = tiny_flux("meta")
    assert prepare_module(model, path)  # GGUFLinear in place of the quantized Linear layers
    model.requires_grad_(False)
    config = register_peft_lora(peft.LoraConfig(r=2, target_modules=["to_q", "to_k"]))
    peft.inject_adapter_in_model(config, model)
    wrapped = model.transformer_blocks[0].attn.to_q
    assert isinstance(wrapped.base_layer, GGUFLinear)
    load_into(model, path)
    want = plain.transformer_blocks[0].attn.to_q.weight_packed
    assert torch.equal(wrapped.base_layer.weight_packed, want)
    assert not any(t.is_meta for t in model.state_dict().values())


def test_a_truncated_gguf_file_names_the_tensor(tmp_path: Path) -> None:
    path, _, _ = _gguf_flux(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(SafetensorsFormatError, match="truncated GGUF file: the tensor's data"):
        open_checkpoint(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200])
    with pytest.raises(SafetensorsFormatError, match="truncated GGUF file"):
        load_into(tiny_flux("meta"), head)


def test_an_unknown_gguf_tensor_type_is_named(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    path = tmp_path / "odd.gguf"
    write_gguf(str(path), {"w": torch.zeros(2, 32)}, {})
    data = bytearray(path.read_bytes())
    at = data.index(b"w") + 1 + 4 + 16  # name, dimension count, two dimensions: the type
    data[at:at + 4] = (77).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(SafetensorsFormatError, match=r"'w'.*unknown GGML tensor type 77"):
        detect_format(path)


def test_a_file_in_no_known_layout_says_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "odd.safetensors"
    save_file({"encoder.layers.0.w": torch.zeros(2), "encoder.layers.1.w": torch.zeros(2),
               "head.w": torch.zeros(2)}, path)
    with pytest.raises(ConfigError, match=r"No tensor matched: the file holds encoder\.\* \(2\), "
                                          r"head\.\* \(1\).*original FLUX"):
        load_into(tiny_flux("meta"), path)


def test_diffusers_layout_files_open_as_they_are(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"a.weight": torch.zeros(2)}, path)
    assert not isinstance(open_checkpoint(path), MappedCheckpoint)
    assert detect_format(path).describe() == "safetensors"


def _flux_inputs() -> dict:
    torch.manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 32),
                pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(4, 3), return_dict=False)


@pytest.mark.parametrize("kind", ["bf16", "gguf", "fp8_scaled"])
def test_a_swapper_streams_the_file_into_its_masters(tmp_path: Path, kind: str) -> None:
    from vramkit.offload.swap import BlockSwapper, SwapConfig
    from vramkit.quant.gguf import GGUFLinear

    if kind == "gguf":
        path, _, _ = _gguf_flux(tmp_path, kinds=("Q8_0", "Q4_0"))
    elif kind == "bf16":
        path = tmp_path / "flux1-dev.safetensors"
        save_file(to_original(FLUX, tiny_flux().state_dict()), path)
    else:
        original, _ = _fp8_scaled(to_original(FLUX, tiny_flux().state_dict(), prefix=LDM_PREFIX))
        path = tmp_path / "flux_fp8_scaled.safetensors"
        save_file(original, path)
    loaded = tiny_flux("meta")
    load_into(loaded, path)
    with torch.no_grad():
        want = loaded(**_flux_inputs())[0]
    model = tiny_flux("meta").requires_grad_(False)
    # ComfyUI's file, with its prefix given as its users would: the mapping already took it off
    prefix = {"prefix": LDM_PREFIX} if kind == "fp8_scaled" else {}
    with BlockSwapper(model, config=SwapConfig(min_param_bytes=0), device="cpu",
                      checkpoint=path, **prefix) as swapper:
        names = {e.attr for b in swapper.blocks for e in b.entries}
        assert ("weight_packed" in names) == (kind == "gguf")
        assert isinstance(model.transformer_blocks[0].attn.to_q, GGUFLinear) == (kind == "gguf")
        with torch.no_grad():
            got = model(**_flux_inputs())[0]
    assert torch.equal(got, want)


def test_a_model_prepared_for_fp8_keeps_the_files_codes_under_a_swapper(tmp_path: Path) -> None:
    from vramkit.io.formats import prepare_module
    from vramkit.offload.swap import BlockSwapper, SwapConfig
    from vramkit.quant.linear import QuantizedLinear
    from vramkit.quant.model import QuantizationConfig

    original, _ = _fp8_scaled(to_original(FLUX, tiny_flux().state_dict(), prefix=LDM_PREFIX))
    path = tmp_path / "flux_fp8_scaled.safetensors"
    save_file(original, path)
    config = QuantizationConfig("fp8")
    loaded = tiny_flux("meta")
    load_into(loaded, path, quantization=config)
    with torch.no_grad():
        want = loaded(**_flux_inputs())[0]
    model = tiny_flux("meta").requires_grad_(False)
    replaced = prepare_module(model, path, config)
    assert "transformer_blocks.0.attn.to_q" in replaced
    with BlockSwapper(model, config=SwapConfig(min_param_bytes=0), device="cpu",
                      checkpoint=path) as swapper:
        names = {e.attr for b in swapper.blocks for e in b.entries}
        assert "weight_data" in names  # the fp8 codes are what the masters hold
        assert isinstance(model.single_transformer_blocks[0].proj_mlp, QuantizedLinear)
        with torch.no_grad():
            got = model(**_flux_inputs())[0]
    assert torch.equal(got, want)


def test_a_block_loads_alone_from_a_gguf_file(tmp_path: Path) -> None:
    from vramkit.quant.gguf import GGUFLinear

    path, _, _ = _gguf_flux(tmp_path, kinds=("Q8_0",))
    whole = tiny_flux("meta")
    load_into(whole, path)
    block = tiny_flux("meta").transformer_blocks[1]
    load_into(block, path, prefix="transformer_blocks.1.", strict=True)
    assert isinstance(block.attn.to_k, GGUFLinear)
    want = {f"transformer_blocks.1.{k}": v for k, v in block.state_dict().items()}
    got = {k: v for k, v in whole.state_dict().items() if k.startswith("transformer_blocks.1.")}
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_gguf_sdxl_with_flattened_convolutions_decodes_them_as_they_load(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from vramkit.quant.gguf import GGUFLinear

    state = tiny_sdxl().state_dict()
    original = to_original(SDXL, state)  # a UNet saved alone: no prefix
    path = tmp_path / "sdxl-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "sdxl")
    q8 = gguf.GGMLQuantizationType.Q8_0
    flattened = []
    for name, t in original.items():
        array = t.float().numpy()
        if t.dim() == 4 and t[0].numel() % 32 == 0:  # ComfyUI-GGUF: rows of whole blocks
            writer.add_array(f"comfy.gguf.orig_shape.{name}", list(t.shape))
            writer.add_tensor(name, gguf.quants.quantize(array.reshape(t.shape[0], -1), q8),
                              raw_dtype=q8)
            flattened.append(name)
        elif t.dim() == 2 and t.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert flattened
    model = tiny_sdxl("meta")
    load_into(model, path)
    conv = model.down_blocks[1].resnets[0].conv1
    reader = gguf.GGUFReader(str(path))
    stored = next(t for t in reader.tensors if t.name == "input_blocks.4.0.in_layers.2.weight")
    want = gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(conv.weight.shape)
    assert torch.equal(conv.weight, torch.from_numpy(np.ascontiguousarray(want)))
    assert isinstance(model.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q,
                      GGUFLinear)


def test_fit_plans_and_trains_a_model_prepared_for_a_gguf_file(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    import vramkit
    from tests.planning._models import inputs, stack
    from vramkit.io.formats import prepare_module
    from vramkit.quant.gguf import GGUFLinear

    path = tmp_path / "stack-Q8_0.gguf"
    state = stack().state_dict()
    write_gguf(str(path), state, {name: "Q8_0" for name, value in state.items()
                                  if value.dim() == 2 and "lora_" not in name})
    model = stack(device="meta")
    assert prepare_module(model, path)  # the planner then prices the packed layers
    with vramkit.fit(model, inputs(), 6 << 20, checkpoint=path, hardware="rtx4090", headroom=0,
                     autocast=None, device="cpu") as fitted:
        assert fitted.plan.swapped and isinstance(model.blocks[0].up, GGUFLinear)
        (x,) = inputs()
        model(x).square().mean().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        prepared_host = fitted.plan.host_bytes
    # fit prepares the packed layers itself: the same plan without the manual step
    unprepared = stack(device="meta")
    with vramkit.fit(unprepared, inputs(), 6 << 20, checkpoint=path, hardware="rtx4090",
                     headroom=0, autocast=None, device="cpu") as fitted:
        assert isinstance(unprepared.blocks[0].up, GGUFLinear)
        assert fitted.plan.host_bytes == prepared_host
        (x,) = inputs()
        unprepared(x).square().mean().backward()
        assert all(p.grad is not None for p in unprepared.parameters() if p.requires_grad)
