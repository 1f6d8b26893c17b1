"""Int8TrainingConfig and setup_int8_training: validation and every knob's effect (CPU)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from vramkit.errors import ConfigError
from vramkit.optim.adamw8bit import AdamW8bit
from vramkit.optim.config import Int8Training, Int8TrainingConfig, setup_int8_training


def make_model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 96), nn.GELU(), nn.Linear(96, 4)).to(dtype)


def micro_batch(i: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(dtype)


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    return model(micro_batch(i, next(model.parameters()).dtype)).float().pow(2).mean()


def test_defaults_and_dtype_names() -> None:
    config = Int8TrainingConfig()
    assert config.use_8bit_adam and config.gradient_accumulation_steps == 1
    assert config.gradient_accumulation_dtype == "float32"
    assert config.accumulation_dtype is torch.float32
    assert (Int8TrainingConfig(gradient_accumulation_dtype="bf16").accumulation_dtype
            is torch.bfloat16)
    assert (Int8TrainingConfig(gradient_accumulation_dtype=torch.float16)
            .gradient_accumulation_dtype == "float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.use_8bit_adam = False  # type: ignore[misc]


def test_round_trips_through_json() -> None:
    config = Int8TrainingConfig(gradient_accumulation_dtype=torch.bfloat16,
                                gradient_accumulation_steps=4, state_bits=4)
    again = Int8TrainingConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    with pytest.raises(ConfigError, match="unknown"):
        Int8TrainingConfig.from_dict({"use_8bit_adam": True, "lr": 1.0})


@pytest.mark.parametrize("kwargs", [
    {"use_8bit_adam": 1}, {"gradient_accumulation_dtype": "int8"},
    {"gradient_accumulation_dtype": torch.int32}, {"gradient_accumulation_steps": 0},
    {"gradient_accumulation_steps": 2.0}, {"state_bits": 3}, {"block_size": 7},
    {"min_8bit_size": -1},
    # AdamW8bit settings with torch AdamW would be silently ignored: refused
    {"use_8bit_adam": False, "state_bits": 4}, {"use_8bit_adam": False, "block_size": 128},
])
def test_invalid_values_raise_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Int8TrainingConfig(**kwargs)  # type: ignore[arg-type]


def test_use_8bit_adam_selects_the_optimizer() -> None:
    params = list(make_model().parameters())
    eight = Int8TrainingConfig(state_bits=4, block_size=64, min_8bit_size=10)
    opt = eight.create_optimizer(params, lr=2e-3, weight_decay=0.0)
    assert isinstance(opt, AdamW8bit)
    group = opt.param_groups[0]
    assert ((group["lr"], group["state_bits"], group["block_size"], group["min_8bit_size"])
            == (2e-3, 4, 64, 10))
    plain = Int8TrainingConfig(use_8bit_adam=False).create_optimizer(params, lr=2e-3)
    assert type(plain) is torch.optim.AdamW
    with pytest.raises(ConfigError):
        Int8TrainingConfig(use_8bit_adam=False).create_optimizer(params, nonsense=1)


def manual_update(dtype_model: torch.dtype, accumulate_in: torch.dtype, micro: int,
                  use_8bit: bool) -> nn.Module:
    """What the config promises: the mean of ``micro`` gradients summed in ``accumulate_in``."""
    model = make_model(dtype_model)
    sums: list[torch.Tensor | None] = [None] * len(list(model.parameters()))
    for i in range(micro):
        (loss_of(model, i) / micro).backward()
        for k, p in enumerate(model.parameters()):
            # A running sum stored in ``accumulate_in``, one rounding per addition.
            sums[k] = p.grad.to(accumulate_in) if sums[k] is None else sums[k].add_(p.grad)
            p.grad = None
    params = list(model.parameters())
    if use_8bit:
        opt = AdamW8bit(params, lr=1e-2)
        opt.step(gradients={p: s for p, s in zip(params, sums, strict=True)})
    else:
        for p, s in zip(params, sums, strict=True):
            p.grad = s.to(p.dtype)
        torch.optim.AdamW(params, lr=1e-2).step()
    return model


def run_config(config: Int8TrainingConfig, dtype_model: torch.dtype, micro: int) -> nn.Module:
    model = make_model(dtype_model)
    training = setup_int8_training(model, config, lr=1e-2)
    for i in range(micro):
        training.backward(loss_of(model, i))
        assert training.step() == (i == micro - 1)
    assert training.updates == 1
    training.close()
    return model


@pytest.mark.parametrize("use_8bit", [True, False])
@pytest.mark.parametrize(("model_dtype", "accumulate_in"), [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16)])
def test_accumulation_dtype_and_steps_follow_the_config(use_8bit: bool, model_dtype: torch.dtype,
                                                        accumulate_in: torch.dtype) -> None:
    config = Int8TrainingConfig(use_8bit_adam=use_8bit, gradient_accumulation_dtype=accumulate_in,
                                gradient_accumulation_steps=4)
    got = run_config(config, model_dtype, 4)
    want = manual_update(model_dtype, accumulate_in, 4, use_8bit)
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.equal(a, b)


def test_accumulation_dtype_changes_the_result() -> None:
    # bf16 weights: 8 micro-batch gradients summed in fp32 differ from the same summed in bf16.
    sums = {}
    for name in ("fp32", "bf16"):
        model = make_model(torch.bfloat16)
        config = Int8TrainingConfig(gradient_accumulation_dtype=name,
                                    gradient_accumulation_steps=8)
        training = setup_int8_training(model, config)
        for i in range(7):
            training.backward(loss_of(model, i))
            training.step()
        grad = training.accumulated_gradient(model[0].weight)
        assert grad is not None
        sums[name] = grad.float()
        training.close()
    assert not torch.equal(sums["fp32"], sums["bf16"])
    torch.testing.assert_close(sums["fp32"], sums["bf16"], rtol=0.05, atol=1e-3)


def test_fp32_buffers_hold_the_gradients_of_bf16_weights() -> None:
    model = make_model(torch.bfloat16)
    training = setup_int8_training(model, Int8TrainingConfig(gradient_accumulation_steps=2))
    assert training.hooked_params == 4
    training.backward(loss_of(model, 0))
    assert all(p.grad is None for p in model.parameters())  # moved into the buffers
    numel = sum(p.numel() for p in model.parameters())
    assert training.accumulation_buffer_bytes() == 4 * numel
    first = model[0].weight
    buffer = training.accumulated_gradient(first)
    assert buffer is not None and buffer.dtype == torch.float32
    assert training.micro_steps == 0 and not training.step() and training.micro_steps == 1
    before = copy.deepcopy(model.state_dict())
    training.backward(loss_of(model, 1))
    assert training.step()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert training.accumulated_gradient(first) is None  # cleared after the update
    training.close()


def test_matching_dtype_accumulates_natively_without_hooks() -> None:
    model = make_model(torch.float32)
    training = setup_int8_training(model, Int8TrainingConfig(gradient_accumulation_steps=2))
    assert training.hooked_params == 0
    training.backward(loss_of(model, 0))
    assert model[0].weight.grad is not None and training.accumulation_buffer_bytes() == 0
    training.close()


def test_steps_change_how_often_the_optimizer_updates() -> None:
    model = make_model()
    training = setup_int8_training(model, Int8TrainingConfig(gradient_accumulation_steps=3))
    stepped = []
    for i in range(6):
        training.backward(loss_of(model, i))
        stepped.append(training.step())
    assert stepped == [False, False, True, False, False, True]
    assert training.updates == 2
    training.zero_grad()
    assert training.micro_steps == 0


def test_setup_takes_parameters_and_skips_frozen_ones() -> None:
    model = make_model()
    model[0].weight.requires_grad_(False)
    training = setup_int8_training(model)
    assert isinstance(training, Int8Training)
    optimized = [p for g in training.optimizer.param_groups for p in g["params"]]
    assert all(p is not model[0].weight for p in optimized) and len(optimized) == 3
    training.close()
    from_list = setup_int8_training(list(model.parameters()))
    assert len(from_list.optimizer.param_groups[0]["params"]) == 3
    with pytest.raises(ConfigError, match="trainable"):
        setup_int8_training([model[0].weight])
