"""Host time the BlockSwapper adds per swapped block and training step.

The step is made host-bound on purpose: 24 tiny blocks (four 16x16 Linear layers each, a frozen
base and a trainable input), on the CPU, with the swapper's synchronous host streams (each slot
fill is a ~2 KB memcpy). A step's time is then Python and autograd work, and the difference
between the swapped and the resident model, divided by the number of blocks, is the swapper's own
host cost per block and step: forward (acquire, release, prefetch, boundary Functions) plus
backward (re-acquire, release). Resident and swapped alternate over the rounds; each round's
median step is taken in thread CPU time, and the minimum over rounds is compared.

This is the cost that shows where a real model is host-bound (dit-large at 2089 tokens in
``benchmarks/swap.py``); with CUDA streams each slot fill also enqueues a copy and two events.

Run:  PYTHONPATH=src python benchmarks/swap_host.py --out out/swap_host
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.c, self.d = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x) * vec) + self.d(self.c(x))


class _Stack(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, vec)
        return x


def measure(step: Any, steps: int, warmup: int) -> float:
    """Median thread CPU time of one step, in microseconds."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.thread_time()
        step()
        times.append((time.thread_time() - start) * 1e6)
    return statistics.median(times)


def run(ckpt: bool, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Stack(args.blocks, 16).requires_grad_(False)
    if ckpt:
        enable_gradient_checkpointing(model)
    x = torch.randn(2, 16, requires_grad=True)
    vec = torch.randn(2, 16, requires_grad=True)

    def step() -> None:
        x.grad = vec.grad = None
        model(x, vec).sum().backward()

    config = SwapConfig(max_gpu_blocks=0, min_param_bytes=0)
    resident, swapped = [], []
    for _ in range(args.rounds):
        resident.append(measure(step, args.steps, args.warmup))
        with BlockSwapper(model, config=config, device="cpu"):
            swapped.append(measure(step, args.steps, args.warmup))
    r, s = min(resident), min(swapped)
    return {"checkpointing": ckpt, "resident_us_per_step": r, "swapped_us_per_step": s,
            "overhead_us_per_block": (s - r) / args.blocks,
            "rounds_resident": resident, "rounds_swapped": swapped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--steps", type=int, default=300, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke test)")
    add_common_args(parser)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 20, 3, 2
    for name in ("blocks", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    torch.set_num_threads(1)
    results = [run(ckpt, args) for ckpt in (True, False)]
    rows = [{"checkpointing": "on" if r["checkpointing"] else "off",
             "resident us/step": r["resident_us_per_step"],
             "swapped us/step": r["swapped_us_per_step"],
             "swapper us per block and step": r["overhead_us_per_block"]} for r in results]
    write_result("swap_host", {"settings": vars(args) | {"out": str(args.out)},
                               "results": results}, rows, args.out)


if __name__ == "__main__":
    main()
