"""A kohya/musubi-style LoRA network (modules beside the model, the target layers' ``forward``
replaced) trains on CUDA under a BlockSwapper and under ``vramkit.fit`` bit-identically to the
resident model, with inputs that do not require grad and inputs that do, under bf16 autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._toys import KohyaLoRANetwork, Stack
from vramkit.offload.swap import BlockSwapper, SwapConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]

D = 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q = nn.Linear(D, D)
        self.o = nn.Linear(D, D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.o(torch.tanh(self.q(h)))
        return x + self.out(torch.nn.functional.gelu(self.fc(x)))


def _build(device: str) -> tuple[nn.Module, KohyaLoRANetwork]:
    model = Stack(Block, 6, out=(D, 1), seed=0).requires_grad_(False)
    net = KohyaLoRANetwork(model, ["q", "o", "fc"], rank=8, alpha=8.0).apply_to()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lora in net.loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=g) * 0.02)
    return model, net.to(device)


def _train(model: nn.Module, net: nn.Module, requires_grad: bool) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 64, D, generator=g).cuda().requires_grad_(requires_grad)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in net.parameters())]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain-inputs", "grad-inputs"])
@pytest.mark.parametrize("how", ["swap", "swap-checkpointed", "fit"])
def test_a_kohya_network_trains_bit_identically_on_cuda(how: str, requires_grad: bool) -> None:
    model, net = _build("cuda")
    want = _train(model.cuda(), net, requires_grad)
    model, net = _build("cuda")  # the model on the host: the swapper moves it
    if how == "fit":
        import vramkit
        from vramkit.errors import PlanError

        example = (torch.randn(4, 64, D),)
        options = dict(hardware="h200", autocast=torch.bfloat16, blocks=["blocks.*"], headroom=0,
                       step=lambda m, inputs: m(*inputs).float().square().mean())
        try:  # the smallest budget: as much swapped as a plan can
            vramkit.plan(model, example, "1KiB", **options)
        except PlanError as err:
            budget = err.minimum_budget
        attached = vramkit.fit(model, example, budget, device="cuda", **options)
        assert attached.plan.swapped, attached.plan.explain()
    else:
        attached = BlockSwapper(model, config=SwapConfig(
            swapped_blocks=[f"blocks.{i}" for i in range(1, 5)],
            checkpointing=how == "swap-checkpointed"), device="cuda")
    got = _train(model, net, requires_grad)
    attached.detach()
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
