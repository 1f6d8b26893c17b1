"""``trainable="swap"`` on a CUDA GPU: block optimizers stepped inside backward give parameters
bit-identical to the resident model trained with the same optimizer (AdamW fused and foreach,
AdamW8bit's fused kernel), also across a save/resume; host memory is weights + state."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import Stack
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.optim import AdamW8bit

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]

D = 256


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = torch.softmax((q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / 8, -1)
        att = (a @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


FACTORIES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01,
                                                  foreach=True),
    "adamw8bit": lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=0.01),
}


def _net() -> Stack:
    return Stack(_Block, 6, inp=(D, D), out=(D, D))


def _pair(dtype: torch.dtype, keep: int, checkpointing: bool, factory: Any, num_slots: int = 2
          ) -> tuple[Stack, Stack, BlockSwapper]:
    torch.manual_seed(0)
    ref = _net().to(dtype).cuda()
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=keep, trainable="swap",
                                                    checkpointing=checkpointing,
                                                    num_slots=num_slots),
                           optimizer=factory)
    return ref, model, swapper


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], xs: list[torch.Tensor]) -> None:
    for x in xs:
        model(x).float().square().mean().backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_finetune_on_gpu_bit_identical(name: str, checkpointing: bool,
                                            dtype: torch.dtype) -> None:
    factory = FACTORIES[name]
    ref, model, swapper = _pair(dtype, 2, checkpointing, factory)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(2, 64, D, device="cuda", generator=gen, dtype=dtype) for _ in range(5)]
    _train(ref, [factory(ref.parameters())], xs)
    _train(model, [factory(swapper.optimizer_parameters()), swapper.optimizer], xs)
    stats = swapper.stats()
    assert stats.optimizer_steps == 4 * 5
    assert stats.pinned_bytes <= 1.05 * (stats.swapped_bytes + stats.state_bytes)
    swapper.detach()
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.cuda(), p_ref), n


@pytest.mark.parametrize("name", ["adamw-fused", "adamw8bit"])
def test_states_prefetched_behind_their_weights_on_gpu_bit_identical(name: str) -> None:
    """With 3 slots (3 state slots) states are prefetched in backward on the copy stream while
    write-backs run on the other: still bit-identical to the resident model."""
    factory = FACTORIES[name]
    ref, model, swapper = _pair(torch.bfloat16, 0, True, factory, num_slots=3)
    gen = torch.Generator(device="cuda").manual_seed(2)
    xs = [torch.randn(2, 64, D, device="cuda", generator=gen, dtype=torch.bfloat16)
          for _ in range(5)]
    _train(ref, [factory(ref.parameters())], xs)
    _train(model, [factory(swapper.optimizer_parameters()), swapper.optimizer], xs)
    assert swapper.stats().state_prefetched > 0
    swapper.detach()
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.cuda(), p_ref), n


@pytest.mark.parametrize("name", ["adamw-fused", "adamw8bit"])
def test_save_resume_on_gpu_bit_identical(name: str) -> None:
    factory = FACTORIES[name]
    ref, model, swapper = _pair(torch.bfloat16, 0, True, factory)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(2, 64, D, device="cuda", generator=gen, dtype=torch.bfloat16)
          for _ in range(4)]
    _train(ref, [factory(ref.parameters())], xs)
    own = factory(swapper.optimizer_parameters())
    _train(model, [own, swapper.optimizer], xs[:2])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "own": own.state_dict(),
                "swapped": swapper.optimizer.state_dict()}, buffer)
    swapper.detach()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    torch.manual_seed(5)
    fresh = _net().to(torch.bfloat16)
    fresh.load_state_dict(saved["model"])
    resumed = BlockSwapper(fresh, config=SwapConfig(max_gpu_blocks=0, trainable="swap",
                                                    checkpointing=True), optimizer=factory)
    own2 = factory(resumed.optimizer_parameters())
    own2.load_state_dict(saved["own"])
    resumed.optimizer.load_state_dict(saved["swapped"])
    _train(fresh, [own2, resumed.optimizer], xs[2:])
    resumed.detach()
    for (n, p), p_ref in zip(fresh.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.cuda(), p_ref), n


def test_clipping_and_accumulation_on_gpu() -> None:
    factory = FACTORIES["adamw-fused"]
    ref, model, swapper = _pair(torch.float32, 2, True, factory)
    swapper.detach()
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=2, trainable="swap",
                                                    accumulation_steps=2, max_grad_norm=0.5),
                           optimizer=factory)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(2, 64, D, device="cuda", generator=gen) for _ in range(4)]
    opt_ref = factory(ref.parameters())
    own = factory(swapper.optimizer_parameters())
    for i, x in enumerate(xs):
        ref(x).square().mean().backward()
        model(x).square().mean().backward()
        if i % 2 == 1:
            expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            total = swapper.clip_grad_norm_()
            torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
            opt_ref.step()
            opt_ref.zero_grad()
            own.step()
            swapper.optimizer.step()
            own.zero_grad()
    swapper.detach()
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cuda(), p_ref, atol=1e-6, rtol=0, msg=n)
