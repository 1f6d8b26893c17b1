"""GGUF block decoding against the gguf package's reference, and GGUFLinear (forward,
gradients, dtype moves, swapping, LoRA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import QuantizationError
from vramkit.quant.gguf import GGUFLinear, dequantize_gguf, gguf_quant_type

gguf = pytest.importorskip("gguf")

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte ranges of each type's fp16 fields (d, dmin, m): set to finite values in random blocks.
_HALF_FIELDS = {"Q8_0": (0, 2), "Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 2), "Q5_1": (0, 4),
                "Q2_K": (80, 84), "Q3_K": (108, 110), "Q4_K": (0, 4), "Q5_K": (0, 4),
                "Q6_K": (208, 210)}


def random_blocks(name: str, blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes of ``blocks`` blocks of type ``name`` with finite fp16 scales."""
    qtype = gguf_quant_type(name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(blocks, qtype.type_size), dtype=np.uint8)
    lo, hi = _HALF_FIELDS[name]
    halves = rng.uniform(-0.05, 0.05, size=(blocks, (hi - lo) // 2)).astype(np.float16)
    raw[:, lo:hi] = halves.view(np.uint8)
    return raw


@pytest.mark.parametrize("name", TYPES)
def test_decoding_matches_the_gguf_reference_bit_for_bit(name: str) -> None:
    qtype = gguf_quant_type(name)
    rows, cols = 3, 2 * qtype.block_size
    raw = random_blocks(name, rows * 2).reshape(rows, -1)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name))
    got = dequantize_gguf(torch.from_numpy(raw), name, (rows, cols))
    assert got.shape == (rows, cols)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_to_a_half_dtype_rounds_once(name: str, dtype: torch.dtype) -> None:
    qtype = gguf_quant_type(name)
    raw = torch.from_numpy(random_blocks(name, 4, seed=2))
    full = dequantize_gguf(raw, name, (4, qtype.block_size))
    assert torch.equal(dequantize_gguf(raw, qtype.type_id, (4, qtype.block_size), dtype),
                       full.to(dtype))


@pytest.mark.parametrize("name", TYPES)
def test_bytes_at_an_odd_offset_decode_as_the_same_bytes_do_aligned(name: str) -> None:
    qtype = gguf_quant_type(name)
    raw = torch.from_numpy(random_blocks(name, 3, seed=4))
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8), raw.reshape(-1)])[1:]
    assert odd.storage_offset() == 1
    shape = (3, qtype.block_size)
    assert torch.equal(dequantize_gguf(odd, name, shape), dequantize_gguf(raw, name, shape))


def test_unknown_and_undecoded_types_are_named() -> None:
    with pytest.raises(QuantizationError, match="unknown GGUF quantization type 999"):
        gguf_quant_type(999)
    with pytest.raises(QuantizationError, match="IQ2_XXS is not decoded"):
        gguf_quant_type("IQ2_XXS")


def test_a_byte_count_that_does_not_match_the_shape_is_refused() -> None:
    raw = torch.from_numpy(random_blocks("Q8_0", 4))
    with pytest.raises(QuantizationError, match="needs 170 bytes, got 136"):
        dequantize_gguf(raw, "Q8_0", (5, 32))
    with pytest.raises(QuantizationError, match="whole blocks of 32"):
        dequantize_gguf(raw, "Q8_0", (8, 16))


def _layer(name: str = "Q4_K", out_features: int = 6, bias: bool = True) -> GGUFLinear:
    qtype = gguf_quant_type(name)
    in_features = 2 * qtype.block_size
    raw = torch.from_numpy(random_blocks(name, out_features * 2, seed=1))
    b = nn.Parameter(torch.randn(out_features)) if bias else None
    return GGUFLinear(raw, name, in_features, out_features, b, dtype=torch.float32)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_forward_and_input_gradient_match_the_dequantized_linear(name: str) -> None:
    layer = _layer(name)
    weight = layer.dequantized_weight(torch.float32)
    x = torch.randn(5, layer.in_features, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = layer(x)
    ref = F.linear(x_ref, weight, layer.bias.detach())
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert layer.bias.grad is not None  # the bias trains; the packed weight has no gradient


def test_backward_saves_the_packed_bytes_not_a_decoded_weight() -> None:
    layer = _layer("Q8_0")
    saved: list[torch.Tensor] = []
    x = torch.randn(2, layer.in_features, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert [t.dtype for t in saved] == [torch.uint8]


def test_to_dtype_keeps_the_bytes_and_changes_the_compute_dtype() -> None:
    layer = _layer("Q8_0")
    packed = layer.weight_packed.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.weight_packed, packed)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.bias.dtype == torch.bfloat16
    assert layer(torch.randn(2, layer.in_features, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_lora_trains_on_a_gguf_base() -> None:
    from vramkit.recipes.lora import LoRALinear

    base = _layer("Q4_K", bias=False)
    adapter = LoRALinear(base, rank=2)  # reads base.weight.device like an nn.Linear's
    with torch.no_grad():
        adapter.up.normal_()
    x = torch.randn(3, base.in_features)
    adapter(x).square().sum().backward()
    assert adapter.down.grad is not None and adapter.up.grad is not None
    assert not any(p.requires_grad for p in base.parameters())


def test_the_swapper_moves_the_packed_bytes() -> None:
    from vramkit.offload.swap import BlockSwapper, SwapConfig

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(_layer("Q8_0", out_features=64, bias=False),
                                           nn.Linear(64, 64)) for _ in range(3)])
    x = torch.randn(2, 64)
    want = blocks(x)
    blocks.requires_grad_(False)
    swapper = BlockSwapper(blocks, config=SwapConfig(min_param_bytes=0), device="cpu")
    try:
        names = {e.attr for b in swapper.blocks for e in b.entries}
        got = blocks(x)
    finally:
        swapper.detach()
    assert "weight_packed" in names
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(blocks(x), want)


def test_the_type_table_is_the_file_formats() -> None:
    from vramkit._gguf_types import GGUF_FLOAT_TYPES, GGUF_QUANT_TYPES

    for qtype in GGUF_QUANT_TYPES.values():
        ggml = gguf.GGMLQuantizationType(qtype.type_id)
        assert ggml.name == qtype.name
        assert gguf.GGML_QUANT_SIZES[ggml] == (qtype.block_size, qtype.type_size)
    for type_id, (name, width, _) in GGUF_FLOAT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)] == (1, width), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", TYPES)
def test_gpu_decoding_equals_the_cpu_reference(name: str) -> None:
    qtype = gguf_quant_type(name)
    rows, cols = 64, 4 * qtype.block_size
    raw = torch.from_numpy(random_blocks(name, rows * 4, seed=3)).reshape(rows, -1)
    cpu = dequantize_gguf(raw, name, (rows, cols))
    gpu = dequantize_gguf(raw.cuda(), name, (rows, cols))
    assert torch.equal(gpu.cpu(), cpu)
    want = gguf.quants.dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, name))
    assert torch.equal(cpu, torch.from_numpy(np.ascontiguousarray(want)))
    # and the layer on the GPU, in bf16 as training runs it
    layer = GGUFLinear(raw, name, cols, rows, dtype=torch.bfloat16).cuda()
    x = torch.randn(8, cols, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, cpu.cuda().bfloat16()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("blocks", [1, 17, 64 * 3 + 5])
def test_the_triton_q8_0_decoder_gives_the_torch_decoders_bits(dtype: torch.dtype,
                                                              blocks: int) -> None:
    from vramkit.quant import gguf as gguf_module
    from vramkit.quant._gguf_triton import decode_q8_0

    raw = torch.from_numpy(random_blocks("Q8_0", blocks, seed=blocks)).cuda()
    triton_out = decode_q8_0(raw, dtype)
    assert triton_out is not None  # contiguous, even address: the Triton path
    torch_out = gguf_module._q8_0(raw.reshape(blocks, 34), dtype)
    assert torch.equal(triton_out, torch_out)
    # Row slices as a fused qkv is split: an even offset decodes in place, an odd one falls
    # back to torch; both through dequantize_gguf give the reference's values.
    two = torch.from_numpy(random_blocks("Q8_0", 2 * blocks, seed=7)).cuda().reshape(2, -1)
    assert decode_q8_0(two[1], dtype) is not None
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8, device="cuda"), two.reshape(-1)])[1:]
    assert decode_q8_0(odd, dtype) is None
    want = dequantize_gguf(two.cpu(), "Q8_0", (2, 32 * blocks), dtype)
    assert torch.equal(dequantize_gguf(two, "Q8_0", (2, 32 * blocks), dtype).cpu(), want)
    assert torch.equal(dequantize_gguf(odd, "Q8_0", (2, 32 * blocks), dtype).cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_q8_0_layer_matches_the_eager_one() -> None:
    raw = torch.from_numpy(random_blocks("Q8_0", 64 * 4, seed=5)).reshape(64, -1)
    layer = GGUFLinear(raw, "Q8_0", 128, 64, dtype=torch.bfloat16).cuda()
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = layer(x)
    (grad_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(layer)(x)
    (grad_compiled,) = torch.autograd.grad(compiled.sum(), x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad_compiled, grad_eager)


def test_peft_lora_adapts_a_gguf_layer() -> None:
    peft = pytest.importorskip("peft")

    from vramkit.quant.linear import register_peft_lora

    model = nn.Sequential(_layer("Q8_0", out_features=8))
    config = register_peft_lora(peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    peft.inject_adapter_in_model(config, model)
    x = torch.randn(3, model[0].in_features)
    out = model(x)
    base = model[0].base_layer(x)
    assert not torch.allclose(out, base)  # the adapter adds its update
    out.sum().backward()
    assert model[0].lora_A["default"].weight.grad is not None
