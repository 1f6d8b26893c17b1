"""W8A8Linear under ``torch.compile`` (the traced path of vramkit.quant._w8a8_ops): no graph
break, no guard on the layer's state, no compile after the warm-up in a swapped, checkpointed,
compiled stack, and the eager layer's numbers (to a code's rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._toys import ResidualMLP, Stack, grad_step
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.compiled import compile_blocks
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.quant import w8a8
from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.quant.w8a8 import W8A8Linear

dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    dynamo.reset()
    dynamo.utils.counters.clear()


@pytest.fixture
def _aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_blocks through dynamo and AOTAutograd without inductor's code generation: the
    guards, frames and saved tensors are theirs; a CPU compile of a stack takes 1 s, not 20."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **options: compile_(fn, backend="aot_eager", **options))


def _frames() -> int:
    return int(dynamo.utils.counters["frames"]["ok"])


def _stack(kind: str | None, *, compiled: bool, method: str = "lean") -> Stack:
    """Four LoRA-like blocks (frozen MLP, trainable adapter), frozen Linears in W8A8 ``kind``,
    checkpointed with ``method``, three of four swapped through one slot on the CPU."""
    model = Stack(lambda: ResidualMLP(32, adapter=True), 4, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_("adapter" in name)
    if kind is not None:
        quantize_model(model, QuantizationConfig(kind, w8a8=True))
    if compiled:
        compile_blocks(model)
    enable_gradient_checkpointing(model, "blocks", method=method)
    BlockSwapper(model, "blocks", SwapConfig(max_gpu_blocks=1, min_param_bytes=0), device="cpu")
    return model


def _warm_frames(model: nn.Module, steps: int = 3) -> tuple[int, int, list]:
    """Frames compiled by the first two steps, frames compiled after them, and each step's
    output and gradients."""
    results, warm = [], 0
    for step in range(steps):
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(step))
        results.append(grad_step(model, x))
        if step == 1:
            warm = _frames()
    return warm, _frames() - warm, results


@pytest.mark.usefixtures("_aot_eager")
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_swapped_compiled_w8a8_stack_compiles_like_the_float_one_and_never_again(
        kind: str) -> None:
    float_warm, float_after, _ = _warm_frames(_stack(None, compiled=True))
    dynamo.reset()
    dynamo.utils.counters.clear()
    warm, after, compiled = _warm_frames(_stack(kind, compiled=True))
    # The layers add no guard of their own: as many frames as the calling contexts need.
    assert warm == float_warm > 0
    assert after == float_after == 0, "a block was compiled again after the warm-up"
    _, _, eager = _warm_frames(_stack(kind, compiled=False))
    for (out_c, grads_c), (out_e, grads_e) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
        assert len(grads_c) == len(grads_e) == 4
        for a, b in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("_aot_eager")
def test_pytorch_checkpoint_recomputes_the_same_saved_tensors() -> None:
    # PyTorch's checkpoint checks that the recomputation saves as many tensors as the forward.
    compiled = _stack("fp8", compiled=True, method="pytorch")
    eager = _stack("fp8", compiled=False, method="pytorch")
    for step in range(3):
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(step))
        out_c, grads_c = grad_step(compiled, x)
        out_e, grads_e = grad_step(eager, x)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
        assert len(grads_c) == len(grads_e) == 4
        for a, b in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _OpaqueKernel:
    """A kernel that dynamo cannot step into (as the Triton launchers): it graph-breaks."""

    def __init__(self, inner: object) -> None:
        self.inner, self.name = inner, inner.name  # type: ignore[attr-defined]

    @torch._dynamo.disable
    def forward(self, *args: object) -> torch.Tensor:
        return self.inner.forward(*args)  # type: ignore[attr-defined]

    @torch._dynamo.disable
    def grad_input(self, *args: object) -> torch.Tensor:
        return self.inner.grad_input(*args)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_untraceable_kernels_stay_out_of_the_graph_and_give_the_eager_numbers(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    chosen = w8a8._device_kernel
    monkeypatch.setattr(w8a8, "_device_kernel",
                        lambda *args: _OpaqueKernel(chosen(*args)))
    torch.manual_seed(0)
    layer = W8A8Linear.from_linear(nn.Linear(64, 48).bfloat16(), kind)
    layer.bias.requires_grad_(True)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    results = []
    for module in (compiled, layer):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, layer.bias.grad.clone()))
        layer.bias.grad = None
    (y_c, gx_c, gb_c), (y_e, gx_e, gb_e) = results
    # Inductor's generated division may put a code one step away: a few 8-bit steps at most.
    torch.testing.assert_close(y_c, y_e, rtol=0.02, atol=0.02)
    torch.testing.assert_close(gx_c, gx_e, rtol=0.02, atol=0.02)
    torch.testing.assert_close(gb_c, gb_e, rtol=0.02, atol=0.02)
    assert not dynamo.utils.counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_gpu_compiled_layer_is_one_graph_with_the_eager_numbers(kind: str) -> None:
    if torch.cuda.get_device_capability() < w8a8.W8A8_CAPABILITY[kind]:
        pytest.skip(f"{kind} W8A8 needs capability >= {w8a8.W8A8_CAPABILITY[kind]}")
    torch.manual_seed(0)
    layer = W8A8Linear.from_linear(nn.Linear(3072, 3072, device="cuda",
                                             dtype=torch.bfloat16), kind)
    layer.bias.requires_grad_(True)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(2, 512, 3072, device="cuda", dtype=torch.bfloat16)
    results = []
    for module in (compiled, layer):  # eager: the Triton kernels
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.float().square().sum().backward()
        results.append((y.detach().float(), xi.grad.float(), layer.bias.grad.float()))
        layer.bias.grad = None
    for got, want in zip(*results, strict=True):
        assert float((got - want).norm() / want.norm()) < 0.02
    assert not dynamo.utils.counters["graph_break"]
    with torch.no_grad():  # the inference graph too
        torch.testing.assert_close(compiled(x).float(), layer(x).float(), rtol=0.05, atol=0.05)
