"""Planning a model whose adapters live outside it (a kohya/musubi-style LoRA network, forward
hooks): the meta trace (``analysis.meta_copy``, ``analyze``), the calibration
(``calibration.calibrate_blocks``, timed on the CPU here), the layers kept from quantization
(``_meta.trainable_module_names``) and adapter code that asks autocast about ``"meta"``
(``_meta.meta_autocast_checks``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import KohyaLoRANetwork, ProjectionBlock, Stack, hook_adapters
from vramkit.planning import analyze, calibrate_blocks
from vramkit.planning._meta import MetaAutocast, meta_autocast_checks, trainable_module_names
from vramkit.planning.analysis import meta_copy

D = 64


def _block() -> nn.Module:
    return ProjectionBlock(D)


def _base() -> Stack:
    base = Stack(_block, 3, out=(D, 1), seed=0)
    return base.requires_grad_(False)


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 8, D),)


@pytest.mark.parametrize("registered", [False, True])
def test_a_network_beside_the_model_is_traced_and_counted(registered: bool) -> None:
    model = _base()
    net = KohyaLoRANetwork(model, ["q", "o"], rank=4).apply_to()
    if registered:
        model.network = net
    cost = analyze(model, _inputs(), autocast=None, blocks=["blocks.*"])
    adapter_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    assert cost.trainable_bytes == adapter_bytes
    assert all(b.adapters == adapter_bytes // 3 for b in cost.blocks)
    assert all(b.backward_flops > 0 for b in cost.blocks)
    # the model and its network are left as they were: real tensors, the network's forwards
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert model.blocks[0].q.forward.__self__ is net.loras[0]


def test_the_meta_copy_takes_closure_hooks_to_meta_too() -> None:
    model = _base()
    adapters = hook_adapters(model, ["q"], bound=False)
    meta = meta_copy(model)
    out = meta(torch.empty(2, 8, D, device="meta"))
    assert out.device.type == "meta" and out.requires_grad
    assert all(p.device.type == "cpu" for p in adapters.parameters())  # originals untouched


@pytest.mark.parametrize("style", ["kohya", "hook"])
def test_blocks_with_outside_adapters_are_calibrated(style: str) -> None:
    model = _base()
    if style == "kohya":
        keep = KohyaLoRANetwork(model, ["q"], rank=4).apply_to()
    else:
        keep = hook_adapters(model, ["q"], bound=True)
    times = calibrate_blocks(model, _inputs(), device="cpu", autocast=None, repeats=1,
                             blocks=["blocks.*"])
    assert times.fallbacks == ()  # every kind ran: the adapters came to the device with it
    assert times.kinds == 2  # the first block (plain inputs) and the others
    assert all(times.calls["full"][f"blocks.{i}"].backward > 0 for i in range(3))
    assert keep is not None


def test_layers_an_outside_adapter_hooks_into_are_kept_from_quantization() -> None:
    model = _base()
    KohyaLoRANetwork(model, ["q"], rank=4).apply_to()
    hook_adapters(model, ["o"], bound=False)
    names = trainable_module_names(model)
    assert names == [n for i in range(3) for n in (f"blocks.{i}.q", f"blocks.{i}.o")]
    assert "out" not in names


class AutocastAware(nn.Module):
    """An adapter-style layer that asks autocast about its input's device, and computes its
    update in float32 with autocast off."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(torch.is_autocast_enabled(x.device.type), bool)
        assert torch.get_autocast_dtype(x.device.type).is_floating_point
        with torch.autocast(x.device.type, enabled=False):
            return self.fc(x.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_autocast_checks_on_meta(dtype: torch.dtype | None) -> None:
    layer = AutocastAware().to("meta")
    x = torch.empty(4, D, device="meta")
    with pytest.raises(RuntimeError):
        layer(x)  # PyTorch knows no autocast for "meta"
    active = MetaAutocast(dtype) if dtype is not None else None
    with meta_autocast_checks(active):
        if active is not None:
            with active:
                assert torch.is_autocast_enabled("meta")
                out = layer(x)
                assert nn.Linear(D, D, device="meta")(x).dtype == dtype  # still cast outside
        else:
            assert not torch.is_autocast_enabled("meta")
            out = layer(x)
    assert out.dtype == torch.float32  # autocast off inside the layer's region
    with pytest.raises(RuntimeError):
        torch.is_autocast_enabled("meta")  # PyTorch's own again
    assert not torch.is_autocast_enabled("cpu")


def test_a_model_with_autocast_checks_is_analyzed() -> None:
    model = Stack(AutocastAware, 3, seed=0)
    model.blocks[0].requires_grad_(False)
    cost = analyze(model, (torch.randn(2, D),), blocks=["blocks.*"])
    assert len(cost.blocks) == 3 and cost.trainable_params > 0


def _bare_hooks(model: nn.Module) -> list[nn.Parameter]:
    """A forward hook on each block's ``q`` closing over a bare trainable tensor."""
    def closing_over(weight: nn.Parameter) -> Any:
        return lambda m, args, out: out + args[0] @ weight.T

    weights = [nn.Parameter(torch.randn(D, D) * 0.1) for _ in model.blocks]
    for block, weight in zip(model.blocks, weights, strict=True):
        block.q.register_forward_hook(closing_over(weight))
    return weights


@pytest.mark.parametrize("style", ["kohya", "bare"])
def test_the_plan_says_which_checkpointed_blocks_cannot_be_lean(style: str) -> None:
    import vramkit

    model = _base()
    if style == "kohya":
        KohyaLoRANetwork(model, ["q"], rank=4).apply_to()
    else:
        _bare_hooks(model)
    cost = analyze(model, _inputs(), autocast=None, blocks=["blocks.*"])
    plan = vramkit.plan(model, _inputs(), "1GiB", hardware="rtx4090", checkpointing="all",
                        autocast=None, blocks=["blocks.*"], cost=cost)
    notes = [n for n in plan.notes if "keep PyTorch's checkpoint" in n]
    if style == "kohya":  # the network's adapters are found: lean
        assert cost.lean_refused == {} and notes == []
    else:
        assert sorted(cost.lean_refused) == [f"blocks.{i}" for i in range(3)]
        assert len(notes) == 1 and notes[0].startswith("3 checkpointed block(s)")
        assert "keep PyTorch's checkpoint" in plan.explain()


def test_a_network_beside_a_meta_model_keeps_no_gradient_from_the_trace() -> None:
    # On meta the model (and its network) is traced as it is: the trace's backward must not
    # leave .grad on the network's parameters either (materialized, it is uninitialized).
    with torch.device("meta"):
        model = _base()
        net = KohyaLoRANetwork(model, ["q", "o"], rank=4).apply_to()
    analyze(model, (torch.empty(2, 8, D, device="meta"),), autocast=None, blocks=["blocks.*"])
    params = list(net.parameters())
    assert params and all(p.requires_grad and p.grad is None for p in params)
