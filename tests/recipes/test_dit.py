"""Tests of the shipped diffusion transformer (vramkit.recipes.dit)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.offload.blocks import find_blocks
from vramkit.recipes.dit import (
    DiT,
    DiTConfig,
    DoubleStreamBlock,
    SingleStreamBlock,
    flow_matching_loss,
    rotary_embedding,
    synthetic_batch,
)

TINY = DiTConfig.preset("tiny")


def _batch(config: DiTConfig, seed: int = 0, batch_size: int = 2) -> dict[str, torch.Tensor]:
    return synthetic_batch(config, batch_size, generator=torch.Generator().manual_seed(seed))


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- shapes and forward ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"patch_size": 1}, {"patch_size": 4, "image_size": 8},
                                       {"num_double_blocks": 0}, {"num_single_blocks": 0}])
def test_forward_keeps_latent_shape(overrides: dict[str, object]) -> None:
    config = dataclasses.replace(TINY, **overrides)
    model = DiT(config)
    batch = _batch(config, batch_size=3)
    out = model(batch["latents"], batch["timesteps"], batch["text"])
    assert out.shape == (3, config.in_channels, config.image_size, config.image_size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16),
                                                ("float16", torch.float16)])
def test_half_precision_forward_and_backward_on_cpu(dtype: str, torch_dtype: torch.dtype) -> None:
    config = dataclasses.replace(TINY, dtype=dtype)
    model = DiT(config)
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    batch = _batch(config)
    assert batch["latents"].dtype == torch_dtype and batch["timesteps"].dtype == torch.float32
    out = model(batch["latents"], batch["timesteps"], batch["text"])
    assert out.dtype == torch_dtype and torch.isfinite(out.float()).all()
    loss = flow_matching_loss(model, batch)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch_dtype for p in model.parameters())
    # Same seed, same init values (drawn in float32, then rounded): close to the float32 model.
    reference = DiT(TINY)
    for (name, half), full in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(half.float(), full, rtol=1e-2, atol=1e-2, msg=name)


def test_wrong_input_shapes_raise() -> None:
    model = DiT(TINY)
    batch = _batch(TINY)
    latents, timesteps, text = batch["latents"], batch["timesteps"], batch["text"]
    with pytest.raises(ConfigError, match="latents"):
        model(latents[:, :1], timesteps, text)
    with pytest.raises(ConfigError, match="timesteps"):
        model(latents, timesteps[:1], text)
    with pytest.raises(ConfigError, match="text"):
        model(latents, timesteps, text[:, :3])


def test_every_parameter_gets_a_nonzero_gradient() -> None:
    model = DiT(TINY)
    flow_matching_loss(model, _batch(TINY)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().max() > 0, name


def test_image_positions_matter_through_rope() -> None:
    # Without positions every op is equivariant to permuting image tokens, so transposing the
    # latents would transpose the output; the 2-D rotary embedding breaks that symmetry.
    model = DiT(TINY)
    batch = _batch(TINY)
    latents, timesteps, text = batch["latents"], batch["timesteps"], batch["text"]
    out = model(latents, timesteps, text)
    out_of_transposed = model(latents.transpose(2, 3).contiguous(), timesteps, text)
    assert not torch.allclose(out_of_transposed, out.transpose(2, 3), atol=1e-4)


def test_rotary_table_leaves_text_unrotated_and_turns_rows_and_columns() -> None:
    table = rotary_embedding(text_tokens=3, grid_size=4, head_dim=16)
    assert table.shape == (3 + 16, 8, 2)
    torch.testing.assert_close(table[:3, :, 0], torch.ones(3, 8))
    torch.testing.assert_close(table[:3, :, 1], torch.zeros(3, 8))
    # Image token 1 is row 0, column 1: only the column half turns.
    torch.testing.assert_close(table[3 + 1, :4, 1], torch.zeros(4))
    assert (table[3 + 1, :, 1][4:].abs() > 0).all()
    # Image token 4 is row 1, column 0: only the row half turns.
    torch.testing.assert_close(table[3 + 4, 4:, 1], torch.zeros(4))


def test_qk_norm_knob() -> None:
    with_norm = DiT(TINY)
    without_norm = DiT(dataclasses.replace(TINY, qk_norm=False))
    blocks = TINY.num_double_blocks * 4 + TINY.num_single_blocks * 2
    assert _count(with_norm) - _count(without_norm) == blocks * TINY.head_dim
    # The norm scales take part in the forward: changing one changes the output.
    batch = _batch(TINY)
    before = with_norm(batch["latents"], batch["timesteps"], batch["text"])
    with torch.no_grad():
        with_norm.single_blocks[0].norm.query.weight.mul_(3.0)
    after = with_norm(batch["latents"], batch["timesteps"], batch["text"])
    assert not torch.allclose(before, after)


# -- parameter counts --------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    TINY,
    DiTConfig.preset("small"),
    dataclasses.replace(TINY, qk_norm=False),
    dataclasses.replace(TINY, mlp_ratio=2.5, patch_size=1, text_dim=48),
    dataclasses.replace(TINY, num_double_blocks=0, num_single_blocks=3, in_channels=16),
])
def test_parameter_formula_matches_built_model(config: DiTConfig) -> None:
    model = DiT(config)
    assert _count(model) == config.num_parameters()
    if config.num_double_blocks:
        assert _count(model.double_blocks[0]) == config.double_block_parameters()
    if config.num_single_blocks:
        assert _count(model.single_blocks[0]) == config.single_block_parameters()
    itemsize = config.torch_dtype.itemsize
    assert sum(p.numel() * itemsize for p in model.parameters()) == config.weight_bytes()


@pytest.mark.parametrize("name", DiTConfig.preset_names())
def test_parameter_formula_matches_every_preset_on_meta(name: str) -> None:
    config = DiTConfig.preset(name)
    model = DiT(config, device="meta")  # structure only: counts the xl model without 6 GB
    assert all(p.device.type == "meta" for p in model.parameters())
    assert _count(model) == config.num_parameters()


def test_presets_span_one_million_to_three_billion() -> None:
    counts = [DiTConfig.preset(name).num_parameters() for name in DiTConfig.preset_names()]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    assert DiTConfig.preset_names()[0] == "tiny" and counts[0] < 2_000_000
    xl = DiTConfig.preset("xl")
    assert xl.dtype == "bfloat16"
    assert 2.8e9 < xl.num_parameters() < 3.2e9
    assert 5.5e9 < xl.weight_bytes() < 6.5e9


def test_blocks_hold_most_bytes_in_linear_weights() -> None:
    model = DiT(DiTConfig.preset("small"))
    for block in (model.double_blocks[0], model.single_blocks[0]):
        linear = sum(m.weight.numel() for m in block.modules()
                     if isinstance(m, torch.nn.Linear))
        assert linear / _count(block) > 0.99


# -- training and determinism ------------------------------------------------------------------


def test_optimizer_steps_reduce_the_loss_on_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = DiT(TINY, seed=1)
    batch = _batch(TINY, seed=2, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for _ in range(8):
        optimizer.zero_grad(set_to_none=True)
        loss = flow_matching_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_same_seed_same_model_and_output() -> None:
    first, second, other = DiT(TINY, seed=3), DiT(TINY, seed=3), DiT(TINY, seed=4)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters(),
                                                    strict=True))
    batch = _batch(TINY)
    out = first(batch["latents"], batch["timesteps"], batch["text"])
    assert torch.equal(out, second(batch["latents"], batch["timesteps"], batch["text"]))
    # init_weights restores the seeded values after training changed them.
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)
    first.init_weights(3)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_init_is_random_not_zero_and_scaled_by_fan_in() -> None:
    model = DiT(DiTConfig.preset("small"))
    weight = model.single_blocks[0].linear2.weight
    assert abs(weight.std().item() - weight.shape[1] ** -0.5) < 0.05 * weight.shape[1] ** -0.5
    assert model.final_layer.linear.weight.abs().min() >= 0 and model.final_layer.linear.weight.std() > 0
    assert torch.equal(model.double_blocks[0].img_attn.norm.query.weight,
                       torch.ones(DiTConfig.preset("small").head_dim))


def test_meta_model_cannot_be_initialized() -> None:
    model = DiT(TINY, device="meta")
    with pytest.raises(ConfigError, match="meta"):
        model.init_weights(0)
    with pytest.raises(ConfigError, match="DiTConfig"):
        DiT("tiny")  # type: ignore[arg-type]


# -- synthetic data ----------------------------------------------------------------------------


def test_synthetic_batch_is_a_rectified_flow_batch() -> None:
    batch = _batch(TINY, seed=5, batch_size=3)
    size = TINY.image_size
    assert batch["latents"].shape == (3, TINY.in_channels, size, size)
    assert batch["target"].shape == batch["latents"].shape
    assert batch["text"].shape == (3, TINY.text_tokens, TINY.text_dim)
    t = batch["timesteps"]
    assert t.shape == (3,) and ((t >= 0) & (t < 1)).all()
    # x_t = (1 - t) x0 + t noise and target = noise - x0 give x0 = x_t - t * target.
    x0 = batch["latents"] - t[:, None, None, None] * batch["target"]
    torch.testing.assert_close(x0[..., 0::2, :], x0[..., 1::2, :])  # smooth 2x2 structure
    torch.testing.assert_close(x0[..., 0::2], x0[..., 1::2])
    again = _batch(TINY, seed=5, batch_size=3)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(batch["latents"], _batch(TINY, seed=6, batch_size=3)["latents"])


def test_synthetic_batch_validates_batch_size_and_places_tensors() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        synthetic_batch(TINY, 0)
    batch = synthetic_batch(TINY, 1, device="cpu")
    assert {v.device.type for v in batch.values()} == {"cpu"}


# -- block discovery ---------------------------------------------------------------------------


def test_find_blocks_returns_double_then_single_blocks_in_numeric_order() -> None:
    config = dataclasses.replace(TINY, num_double_blocks=3, num_single_blocks=12)
    model = DiT(config)
    found = find_blocks(model)
    expected = ([f"double_blocks.{i}" for i in range(3)]
                + [f"single_blocks.{i}" for i in range(12)])
    assert [name for name, _ in found] == expected
    assert all(isinstance(m, DoubleStreamBlock) for _, m in found[:3])
    assert all(isinstance(m, SingleStreamBlock) for _, m in found[3:])
    assert found[3][1] is model.single_blocks[0]


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": 96.0}, "hidden_size"),
    ({"num_heads": True}, "num_heads"),
    ({"num_heads": 5}, "divisible"),
    ({"num_heads": 16}, "multiple of 4"),  # head_dim 6 is even but not a multiple of 4
    ({"num_double_blocks": -1}, "num_double_blocks"),
    ({"num_double_blocks": 0, "num_single_blocks": 0}, "at least one block"),
    ({"mlp_ratio": 0.0}, "mlp_ratio"),
    ({"mlp_ratio": float("nan")}, "mlp_ratio"),
    ({"mlp_ratio": 0.001}, "empty MLP"),
    ({"image_size": 9}, "multiple of\\s+patch_size"),
    ({"patch_size": 0}, "patch_size"),
    ({"dtype": "float64"}, "dtype"),
    ({"qk_norm": 1}, "qk_norm"),
    ({"text_tokens": 0}, "text_tokens"),
])
def test_config_validation(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(TINY, **overrides)


def test_config_is_frozen_and_round_trips_through_json() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.hidden_size = 8  # type: ignore[misc]
    data = json.loads(json.dumps(TINY.to_dict()))
    assert DiTConfig.from_dict(data) == TINY
    with pytest.raises(ConfigError, match="unknown"):
        DiTConfig.from_dict({**data, "layers": 3})


def test_presets_and_overrides() -> None:
    assert DiTConfig.preset("tiny", dtype="bfloat16").dtype == "bfloat16"
    assert DiTConfig.preset("base").torch_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="unknown DiT preset"):
        DiTConfig.preset("huge")
    with pytest.raises(ConfigError, match="invalid override"):
        DiTConfig.preset("tiny", depth=3)
    with pytest.raises(ConfigError, match="num_heads"):
        DiTConfig.preset("tiny", num_heads=0)


@pytest.mark.parametrize("target", ["100MB", "1GiB", "3GiB", "6GiB", "24GiB"])
def test_for_bytes_lands_within_five_percent(target: str) -> None:
    from vramkit.units import parse_size

    config = DiTConfig.for_bytes(target)
    assert config.dtype == "bfloat16"
    assert abs(config.weight_bytes() / parse_size(target) - 1) <= 0.05
    # Both block stacks exist with >= 2 blocks each, so swapping has units to work with.
    assert config.num_double_blocks >= 2 and config.num_single_blocks >= 4


def test_for_bytes_grows_with_the_target_and_honours_dtype_and_overrides() -> None:
    sizes = [DiTConfig.for_bytes(n).weight_bytes() for n in (10**8, 10**9, 10**10)]
    assert sizes == sorted(sizes)
    fp32 = DiTConfig.for_bytes(2 * 10**9, dtype="float32", image_size=64)
    assert fp32.dtype == "float32" and fp32.image_size == 64
    assert abs(fp32.num_parameters() * 4 / 2e9 - 1) <= 0.05
    # Half the parameters for the same bytes in bfloat16 as in float32.
    bf16 = DiTConfig.for_bytes(2 * 10**9)
    assert fp32.num_parameters() < 0.6 * bf16.num_parameters()
    with pytest.raises(ConfigError, match="chooses hidden_size"):
        DiTConfig.for_bytes("1GiB", hidden_size=128)
    with pytest.raises(ConfigError, match="> 0"):
        DiTConfig.for_bytes(0)
    with pytest.raises(ConfigError, match="for_bytes"):
        DiTConfig.for_bytes("lots")
    with pytest.raises(ConfigError, match="dtype"):
        DiTConfig.for_bytes("1GiB", dtype="int8")


def test_importing_the_model_does_not_initialize_cuda() -> None:
    probe = ("import torch, vramkit.recipes.dit as d; d.DiT(d.DiTConfig.preset('tiny')); "
             "print(torch.cuda.is_initialized())")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "False"


# -- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_model_matches_cpu_init_and_trains_in_bf16() -> None:
    config = DiTConfig.preset("small", dtype="bfloat16")
    on_gpu = DiT(config, seed=7, device="cuda")
    on_cpu = DiT(config, seed=7)
    for a, b in zip(on_gpu.parameters(), on_cpu.parameters(), strict=True):
        assert torch.equal(a.cpu(), b)
    batch = synthetic_batch(config, 2, generator=torch.Generator().manual_seed(0), device="cuda")
    assert {v.device.type for v in batch.values()} == {"cuda"}
    loss = flow_matching_loss(on_gpu, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in on_gpu.parameters())
    reference = flow_matching_loss(on_cpu, {k: v.cpu() for k, v in batch.items()})
    assert abs(loss.item() - reference.item()) < 0.05 * reference.item()
