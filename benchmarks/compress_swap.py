"""Swapping compressed masters (``SwapConfig(compress="on")``) against raw masters, side by side.

The model is a FLUX-sized stand-in: ``benchmarks/_swap_models.py``'s StackBlock (hidden 3072, 24
heads, MLP 4x, LoRA r16 on the attention projections; 226 MB of bf16 per block) x ``--blocks``
(104 by default: 23.5 GB, FLUX.1-dev's transformer bytes), weights drawn like torch's default
init would scale them (normal, std 1/sqrt(fan_in)). Two copies of it are attached, one per arm
(``off``: raw pinned masters, ``on``: compressed); under a card cap the swapper gets
``max_gpu_bytes = cap - headroom`` (``--headroom-gib``, what the step's activations and the
adapters take), and the compressed arm gives its decode scratch (two buffers of the largest
compressed block) back out of that figure, so both arms fit the same card.

Rows (``--rows``, comma-separated):

* ``train:<cap GiB>``: a LoRA step (every block checkpointed, 4096 tokens, batch 1).
* ``infer:<cap GiB>``: one no-grad forward.
* ``train-x8:<cap GiB>``: the LoRA step with every host->device copy paced to ``--x8-gbps``
  (12.5 GB/s, a PCIe 4.0 x8 card): after each copy the copy stream runs a GPU sleep
  (``torch.cuda._sleep``, calibrated here) that stretches the copy to ``bytes / rate``, so the
  copies queue and overlap compute exactly as on a slower link.

``--share F`` compresses only an even share ``F`` of the blocks in the compressed arm
(``SwapConfig.compressed_blocks``, what a plan chooses where only some copies bound the step).

Each row alternates the arms (``--rounds`` rounds of ``--steps`` steps each, the first of every
turn untimed, PyTorch's default kernels) and prints the median ratio on/off with its spread;
before the timed rounds each row runs ``--check-steps`` steps per arm from their identical
starting weights with deterministic kernels and checks that the losses are bit-identical; it
prints the pinned bytes of each arm.

Run (H200, ~3-4 min a row): PYTHONPATH=src python3 benchmarks/compress_swap.py \\
    --rows train:7.5,infer:2,train-x8:11.5 --out out/compress_swap
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/compress_swap.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, deterministic_kernels, write_result
from _swap_models import StackBlock
from vramkit.offload.blocks import spread_evenly
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig

GIB = 1 << 30


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(args: argparse.Namespace, device: torch.device) -> Stack:
    """The stack on the host, each block initialised on ``device`` (fast) and moved back."""
    generator = torch.Generator().manual_seed(0)
    blocks = []
    gen = torch.Generator(device=device).manual_seed(0)
    for _ in range(args.blocks):
        with torch.device("meta"):
            block = StackBlock(args.hidden, args.heads, args.rank, generator)
        block.to_empty(device=device)
        with torch.no_grad():
            for name, p in block.named_parameters():
                if p.dim() == 2:
                    std = 0.01 if name.endswith("lora_b") else p.shape[1] ** -0.5
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
        blocks.append(block.to(torch.bfloat16).to("cpu"))
    return Stack(blocks)


class Pacer:
    """Stretches every host->device copy on the swapper's copy stream to ``gbps``."""

    def __init__(self, gbps: float) -> None:
        self.gbps = gbps
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        cycles = 200_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_s = cycles / (start.elapsed_time(end) / 1e3)
        self.h2d_gbps = self._copy_rate()

    @staticmethod
    def _copy_rate() -> float:
        host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        return 3 * host.numel() / (time.perf_counter() - t) / 1e9

    def install(self, streams: Any) -> Callable[[], None]:
        plain = streams.copy

        def copy(dst: torch.Tensor, src: torch.Tensor, stream: Any, what: str = "") -> None:
            plain(dst, src, stream, what)
            if src.device.type == "cpu" and dst.device.type == "cuda":
                extra = src.numel() * src.element_size() * (1 / self.gbps - 1 / self.h2d_gbps)
                if extra > 0:
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(int(extra / 1e9 * self.cycles_per_s))

        streams.copy = copy

        def remove() -> None:
            streams.copy = plain
        return remove


def attach(model: Stack, mode: str, budget: int, device: torch.device, train: bool,
           share: float = 1.0) -> BlockSwapper:
    if train:
        enable_gradient_checkpointing(model, "blocks")
    if mode == "on":  # the decode scratch comes out of the same card
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters()
                    if not p.requires_grad)
        budget -= int(2 * 0.72 * block)
    # pinned masters in both arms (host_memory="auto" could pick pageable for one of them)
    names = None
    if mode == "on" and share < 1.0:  # an even share of the blocks, as a plan may choose
        n = len(model.blocks)
        names = tuple(f"blocks.{i}" for i in spread_evenly([1] * n, round(n * share)))
    swapper = BlockSwapper(model, "blocks", SwapConfig(max_gpu_bytes=budget, num_slots=2,
                                                       compress=mode, host_memory="pinned",
                                                       compressed_blocks=names),
                           device=device)
    return swapper


def step_fn(model: Stack, x: torch.Tensor, train: bool) -> Callable[[], float]:
    if train:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5)

        def step() -> float:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        return step

    def forward() -> float:
        with torch.no_grad():
            return float(model(x).float().mean().item())
    return forward


def run_row(row: str, args: argparse.Namespace, device: torch.device,
            pacer: Pacer | None) -> dict[str, Any]:
    kind, cap = row.split(":")
    train = kind.startswith("train")
    headroom = args.headroom_gib * GIB if train else args.headroom_gib * GIB / 3
    budget = int(float(cap) * GIB - headroom) if not args.tiny else 3 << 19  # ~4 tiny blocks
    arms: dict[str, tuple[BlockSwapper, Callable[[], float]]] = {}
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=torch.bfloat16,
                    generator=torch.Generator(device=device).manual_seed(1))
    for mode in ("off", "on"):
        model = build(args, device)
        start = time.perf_counter()
        swapper = attach(model, mode, budget, device, train, args.share)
        attach_s = time.perf_counter() - start
        arms[mode] = (swapper, step_fn(model, x, train))
        print(f"{row} {mode}: attached in {attach_s:.1f}s, {swapper.stats().swapped_blocks} "
              "blocks swapped", flush=True)
    removers = []
    if kind == "train-x8" and pacer is not None:  # every copy stream the arms use
        streams = {id(s.streams): s.streams for s, _ in arms.values()}
        removers = [pacer.install(s) for s in streams.values()]
    # The loss check first, from the arms' identical starting weights, with deterministic
    # kernels (the attention backward's atomics would make two runs of one model differ in the
    # last bits); the timed rounds after it run PyTorch's default kernels.
    losses: dict[str, list[float]] = {"off": [], "on": []}
    deterministic_kernels(True)
    try:
        for mode in ("off", "on"):
            losses[mode] = [arms[mode][1]() for _ in range(args.check_steps)]
    finally:
        deterministic_kernels(False)
    times: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    for _ in range(args.rounds):
        medians = {}
        for mode in ("off", "on"):
            step = arms[mode][1]
            turn = []
            for i in range(args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    turn.append((time.perf_counter() - t) * 1e3)
            medians[mode] = statistics.median(turn)
            times[mode].append(medians[mode])
        ratios.append(medians["on"] / medians["off"])
    for remove in removers:
        remove()
    stats = {mode: arms[mode][0].stats() for mode in arms}
    out = {
        "row": row, "off_ms": statistics.median(times["off"]),
        "on_ms": statistics.median(times["on"]), "ratio": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        "losses_identical": losses["off"] == losses["on"],
        "pinned_off_gib": stats["off"].pinned_bytes / GIB,
        "pinned_on_gib": stats["on"].pinned_bytes / GIB,
        "pinned_ratio": stats["on"].pinned_bytes / max(stats["off"].pinned_bytes, 1),
        "h2d_ratio": stats["on"].h2d_bytes / max(stats["off"].h2d_bytes, 1),
        "swapped_off": stats["off"].swapped_blocks, "swapped_on": stats["on"].swapped_blocks,
        "scratch_mib": stats["on"].compress_scratch_bytes / 2**20,
    }
    print(out, flush=True)
    for swapper, _ in arms.values():
        swapper.detach()
    del arms
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="train:7.5,infer:2,train-x8:11.5")
    parser.add_argument("--blocks", type=int, default=None, help="default 104; tiny 4")
    parser.add_argument("--tokens", type=int, default=None, help="default 4096; tiny 32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="per turn, the first untimed")
    parser.add_argument("--headroom-gib", type=float, default=1.5)
    parser.add_argument("--x8-gbps", type=float, default=12.5)
    parser.add_argument("--share", type=float, default=1.0,
                        help="compress an even share of the blocks (default 1: all), as a "
                             "plan's compressed_blocks may")
    parser.add_argument("--check-steps", type=int, default=2,
                        help="deterministic steps per arm whose losses must be equal (default 2)")
    parser.add_argument("--tiny", action="store_true", help="a small stack on the CPU")
    add_common_args(parser)
    args = parser.parse_args()
    args.blocks = args.blocks or (4 if args.tiny else 104)
    args.tokens = args.tokens or (32 if args.tiny else 4096)
    args.hidden, args.heads, args.rank = (128, 4, 4) if args.tiny else (3072, 24, 16)
    device = torch.device("cpu" if args.tiny else "cuda")
    deterministic_kernels(False)  # cuBLAS's workspace fixed before CUDA starts, for the check
    pacer = None
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper: crashed on FLUX shapes
        pacer = Pacer(args.x8_gbps)
        print(f"pinned host->device {pacer.h2d_gbps:.1f} GB/s; x8 rows paced to "
              f"{args.x8_gbps} GB/s", flush=True)
    rows = [run_row(r.strip(), args, device, pacer) for r in args.rows.split(",") if r.strip()]
    table = [{"row": r["row"], "raw ms": f"{r['off_ms']:.1f}",
              "compressed ms": f"{r['on_ms']:.1f}",
              "ratio": f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
              "bytes copied": f"{r['h2d_ratio']:.3f}", "pinned": f"{r['pinned_ratio']:.3f}",
              "same losses": r["losses_identical"]} for r in rows]
    write_result("compress_swap", {"blocks": args.blocks, "tokens": args.tokens,
                                   "rows": rows}, table, args.out)


if __name__ == "__main__":
    main()
