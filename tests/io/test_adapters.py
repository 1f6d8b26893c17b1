"""peft LoRA added to a model on the meta device, then filled from the *base* checkpoint: by
``load_into`` and by ``BlockSwapper(checkpoint=)``. The renamed base weights
(``q.base_layer.weight``) come from the file's ``q.weight``; the adapters, which the file lacks,
are initialized peft's way; initializations that need the base weights are refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._toys import Stack

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from vramkit.errors import ConfigError  # noqa: E402
from vramkit.io.loader import load_into  # noqa: E402
from vramkit.offload.swap import BlockSwapper, SwapConfig  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.o = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(torch.tanh(self.q(x)))


def _net() -> Stack:
    return Stack(Block, 4, out=(32, 1), names=("inp", "head"))


def _x() -> torch.Tensor:
    return torch.randn(5, 32, generator=torch.Generator().manual_seed(3))


@pytest.fixture()
def base(tmp_path: Path) -> tuple[Stack, Path]:
    torch.manual_seed(0)
    model = _net()
    path = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def _meta_peft(**lora: object) -> tuple[nn.Module, Stack]:
    with torch.device("meta"):
        inner = _net()
    inner.requires_grad_(False)
    config = LoraConfig(r=4, target_modules=["q"], **lora)  # type: ignore[arg-type]
    return get_peft_model(inner, config), inner


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_load_into_fills_the_renamed_base_and_initializes_the_adapters(
        base: tuple[Stack, Path]) -> None:
    reference, path = base
    peft_model, inner = _meta_peft()
    result = load_into(inner, path)  # strict: the adapters are not "missing"
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert not any(t.is_meta for t in (*inner.parameters(), *inner.buffers()))
    state = inner.state_dict()
    for key, value in reference.state_dict().items():
        mapped = key.replace(".q.", ".q.base_layer.")
        assert torch.equal(state[mapped], value), key
    adapters = _adapters(inner)
    assert len(adapters) == 8  # A and B of 4 layers
    for key, value in adapters.items():  # peft's default: A Kaiming-uniform, B zero
        assert (value == 0).all() if "lora_B" in key else value.abs().sum() > 0, key
    assert all(p.requires_grad for n, p in inner.named_parameters() if "lora_" in n)
    # B = 0: the adapted model computes what the base computes
    torch.testing.assert_close(peft_model(_x()), reference(_x()), rtol=0, atol=0)


def test_the_swapper_loads_a_meta_peft_model_and_trains_like_a_cpu_built_one(
        base: tuple[Stack, Path]) -> None:
    reference_base, path = base
    peft_model, inner = _meta_peft()
    swapper = BlockSwapper(inner, "blocks.*", SwapConfig(min_param_bytes=0), device="cpu",
                           checkpoint=path)
    assert swapper.swapped_names == [f"blocks.{i}" for i in range(4)]
    # the same adapters on a model built on the CPU from the same base weights
    reference = get_peft_model(copy.deepcopy(reference_base).requires_grad_(False),
                               LoraConfig(r=4, target_modules=["q"]))
    reference.load_state_dict(_adapters(peft_model), strict=False)
    for model in (peft_model, reference):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for _ in range(3):
            model(_x()).square().mean().backward()
            opt.step()
            opt.zero_grad()
    trained = _adapters(peft_model)
    assert any((v != 0).any() for k, v in trained.items() if "lora_B" in k)  # it learned
    for key, value in _adapters(reference).items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-7, msg=key)
    swapper.detach()
    # built on meta: everything is on the CPU afterwards, adapters included, values kept
    assert all(t.device.type == "cpu" for t in inner.parameters())
    assert all(torch.equal(v, trained[k]) for k, v in _adapters(peft_model).items())


@pytest.mark.parametrize("lora", [{"init_lora_weights": "gaussian"},
                                  {"init_lora_weights": False}], ids=["gaussian", "false"])
def test_base_independent_initializations_are_applied(base: tuple[Stack, Path],
                                                      lora: dict[str, object]) -> None:
    _, path = base
    _, inner = _meta_peft(**lora)
    load_into(inner, path)
    adapters = _adapters(inner)
    b = [v for k, v in adapters.items() if "lora_B" in k]
    if lora["init_lora_weights"] is False:  # both as nn.Linear initializes them
        assert all(v.abs().sum() > 0 for v in b)
    else:
        assert all((v == 0).all() for v in b)
        a = torch.cat([v.flatten() for k, v in adapters.items() if "lora_A" in k])
        assert 0.1 < float(a.std()) < 0.5  # N(0, 1/r) with r = 4


@pytest.mark.parametrize("lora", [{"init_lora_weights": "pissa"}, {"use_dora": True}],
                         ids=["pissa", "dora"])
def test_initializations_that_read_the_base_weights_are_refused(
        base: tuple[Stack, Path], lora: dict[str, object]) -> None:
    _, path = base
    try:
        _, inner = _meta_peft(**lora)
    except Exception as exc:  # this peft cannot even build it on meta
        pytest.skip(f"peft refuses it on meta itself: {exc}")
    with pytest.raises(ConfigError, match="needs the base weights") as info:
        load_into(inner, path)
    assert "get_peft_model" in (info.value.hint or "")


def test_a_meta_peft_model_planned_and_fitted_from_a_checkpoint_steps_its_first_gradients_right(
        base: tuple[Stack, Path]) -> None:
    # vramkit.fit plans a model on meta by tracing its own step there (backward included):
    # no meta .grad may stay on the adapters, or materializing them (to_empty) made it an
    # uninitialized one that the first real backward added to (NaN gradients, at random).
    import vramkit

    reference_base, path = base
    peft_model, inner = _meta_peft()
    fitted = vramkit.fit(inner, (_x(),), "64MiB", device="cpu", hardware="rtx4090",
                         autocast=None, checkpoint=path)
    assert all(p.grad is None for p in peft_model.parameters())
    reference = get_peft_model(copy.deepcopy(reference_base).requires_grad_(False),
                               LoraConfig(r=4, target_modules=["q"]))
    reference.load_state_dict(_adapters(peft_model), strict=False)
    for model in (peft_model, reference):
        model(_x()).square().mean().backward()
    got = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and got
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-7, msg=name)
    fitted.detach()


def test_a_meta_gradient_on_an_adapter_is_dropped_when_it_is_materialized(
        base: tuple[Stack, Path]) -> None:
    _, path = base
    peft_model, inner = _meta_peft()
    for p in peft_model.parameters():
        if p.requires_grad:
            p.grad = torch.empty_like(p)  # meta, as a traced backward leaves it
    load_into(inner, path)
    lora = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    assert lora and all(p.device.type == "cpu" and p.grad is None for p in lora)
