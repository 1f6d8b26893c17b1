"""Adapters of every common shape train under swapping exactly as on the resident model.

peft (its layers registered inside the blocks), a kohya/musubi-style LoRA network (modules kept
in a network outside the blocks, each target layer's ``forward`` replaced by an instance
attribute), forward-hook adapters (a bound method and a closure) and LyCORIS LoHa/LoKr (the
installed ``lycoris`` package, same pattern as kohya's) -- with inputs that do not require grad
(the swapper's no-gradient shortcut must not drop the adapters' gradients) and inputs that do;
under a BlockSwapper (checkpointed or not) and under ``vramkit.fit``. Loss and every adapter
gradient are compared bit for bit with the model run without any of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import KohyaLoRANetwork, ProjectionBlock, Stack, hook_adapters
from vramkit.offload._reach import reached_modules
from vramkit.offload.swap import BlockSwapper, SwapConfig

D = 128
STYLES = ["peft", "kohya", "kohya-registered", "hook", "hook-closure", "loha", "lokr"]


def _block() -> nn.Module:
    return ProjectionBlock(D)


class Adapted:
    """A frozen stack with adapters of one style, and the adapters' parameters in order."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], keep: Any = None) -> None:
        self.model = model
        self.params = params
        self.keep = keep  # the network / adapters object, kept alive with the model


def _randomize(params: list[nn.Parameter]) -> None:
    """Every adapter parameter nonzero (LoRA's up starts at zero: its down would get none)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def build(style: str) -> Adapted:
    base = Stack(_block, 4, out=(D, 1), seed=0)
    base.requires_grad_(False)
    if style == "peft":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q", "o"]))
        params = [p for p in model.parameters() if p.requires_grad]
        adapted = Adapted(model, params)
    elif style.startswith("kohya"):
        net = KohyaLoRANetwork(base, ["q", "o"], rank=4, alpha=2.0).apply_to()
        if style == "kohya-registered":
            base.network = net
        adapted = Adapted(base, list(net.parameters()), net)
    elif style.startswith("hook"):
        adapters = hook_adapters(base, ["q"], bound=style == "hook")
        adapted = Adapted(base, list(adapters.parameters()), adapters)
    else:
        lycoris = pytest.importorskip("lycoris")
        net = lycoris.create_lycoris(base, 1.0, linear_dim=4, linear_alpha=2.0, algo=style,
                                     warn_on_unmatched=False)
        net.apply_to()
        adapted = Adapted(base, [p for p in net.parameters() if p.requires_grad], net)
    assert adapted.params and all(p.requires_grad for p in adapted.params)
    _randomize(adapted.params)
    return adapted


def _inputs(step: int, requires_grad: bool) -> torch.Tensor:
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(step))
    return x.requires_grad_(requires_grad)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _step(model: nn.Module, inputs: tuple[torch.Tensor]) -> torch.Tensor:
    return _loss(model, *inputs)


def _train(adapted: Adapted, requires_grad: bool, steps: int = 3
           ) -> list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]]:
    """Loss, adapter gradients and input gradient of each step; SGD between steps."""
    opt = torch.optim.SGD(adapted.params, lr=0.5)
    out = []
    for step in range(steps):
        x = _inputs(step, requires_grad)
        loss = _loss(adapted.model, x)
        loss.backward()
        grads = []
        for p in adapted.params:
            assert p.grad is not None
            grads.append(p.grad.clone())
        out.append((loss.detach(), grads, None if x.grad is None else x.grad.clone()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _assert_same(got: list[Any], want: list[Any]) -> None:
    for (loss, grads, xg), (loss_w, grads_w, xg_w) in zip(got, want, strict=True):
        assert torch.equal(loss, loss_w)
        for g, w in zip(grads, grads_w, strict=True):
            assert torch.equal(g, w)
        assert (xg is None) == (xg_w is None)
        if xg is not None:
            assert torch.equal(xg, xg_w)


def _swapped(checkpointing: bool) -> Callable[[Adapted], Any]:
    def attach(adapted: Adapted) -> Any:
        swapper = BlockSwapper(adapted.model, config=SwapConfig(
            swapped_blocks=[f"blocks.{i}" for i in range(4)] if not _peft(adapted) else
            [f"base_model.model.blocks.{i}" for i in range(4)],
            min_param_bytes=0, checkpointing=checkpointing), device="cpu")
        assert len(swapper.swapped_names) == 4
        return swapper
    return attach


def _peft(adapted: Adapted) -> bool:
    return adapted.keep is None


def _fitted(adapted: Adapted) -> Any:
    import vramkit
    from vramkit.errors import PlanError

    blocks = ["base_model.model.blocks.*" if _peft(adapted) else "blocks.*"]
    options = dict(device="cpu", hardware="rtx4090", autocast=None, headroom=0,
                   blocks=blocks, step=_step)
    example = (_inputs(0, False),)
    try:
        vramkit.plan(adapted.model, example, "1KiB", **{k: v for k, v in options.items()
                                                        if k != "device"})
    except PlanError as err:
        budget = err.minimum_budget
    fitted = vramkit.fit(adapted.model, example, budget, **options)
    assert fitted.plan.swapped, fitted.plan.explain()
    return fitted


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain-inputs", "grad-inputs"])
@pytest.mark.parametrize("how", ["swap", "swap-checkpointed", "fit"])
@pytest.mark.parametrize("style", STYLES)
def test_adapters_train_bit_identically_to_the_resident_model(style: str, how: str,
                                                              requires_grad: bool) -> None:
    want = _train(build(style), requires_grad)
    adapted = build(style)
    attached = (_fitted(adapted) if how == "fit"
                else _swapped(how == "swap-checkpointed")(adapted))
    got = _train(adapted, requires_grad)
    if how == "swap-checkpointed":  # the lean checkpoint applies: the adapters are found
        assert all(b.lean.verdict is True for b in attached.blocks), [
            (b.name, b.lean.reason) for b in attached.blocks]
    attached.detach()
    _assert_same(got, want)


class BareParameterHook:
    """A forward hook closing over a bare trainable tensor (no module holds it): nothing shows
    it before the call, so the swapper learns of its gradient from the call's output."""

    def __init__(self, layer: nn.Linear) -> None:
        self.weight = nn.Parameter(torch.randn(layer.out_features, layer.in_features,
                                               generator=torch.Generator().manual_seed(3)) * 0.1)
        weight = self.weight
        layer.register_forward_hook(lambda m, args, out: out + args[0] @ weight.T)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_gradient_nothing_showed_is_kept(checkpointing: bool) -> None:
    def build_bare() -> Adapted:
        base = Stack(_block, 4, out=(D, 1), seed=0)
        base.requires_grad_(False)
        hooks = [BareParameterHook(b.q) for b in base.blocks]
        return Adapted(base, [h.weight for h in hooks], hooks)

    want = _train(build_bare(), False)
    adapted = build_bare()
    swapper = _swapped(checkpointing)(adapted)
    got = _train(adapted, False)
    if checkpointing:  # not lean: the hook's tensor is no parameter of any module
        assert all(b.lean.verdict is False and "neither its inputs" in b.lean.reason
                   for b in swapper.blocks)
    swapper.detach()
    _assert_same(got, want)


@pytest.mark.parametrize("style", ["kohya", "hook", "hook-closure", "loha"])
def test_the_adapters_a_block_reaches_are_found(style: str) -> None:
    adapted = build(style)
    block = adapted.model.blocks[0]
    own = {id(p) for p in block.parameters()}
    reached = {id(p) for m in reached_modules(block) for p in m._parameters.values()
               if p is not None}
    outside = reached - own
    assert outside and all(p.requires_grad for p in adapted.params if id(p) in outside)
    assert not any(id(p) in reached for p in adapted.model.blocks[1].parameters())


def test_adapters_under_a_wrapped_forward_are_found() -> None:
    from vramkit.offload.checkpointing import enable_gradient_checkpointing

    adapted = build("kohya")
    layer = adapted.model.blocks[0].q
    enable_gradient_checkpointing(adapted.model, ["blocks.0.q"])  # wraps the kohya forward
    reached = reached_modules(adapted.model.blocks[0])
    assert any(m is adapted.keep.loras[0] for m in reached)
    assert layer.__dict__["forward"] is not adapted.keep.loras[0].forward
