"""Activation offload benchmark: step time and peak memory with and without offloading.

A transformer-ish stack (pre-norm attention + 4x MLP blocks, bf16, batch 1) runs forward and
backward at each token count in three modes:

* ``resident``: no offload, every saved activation stays on the GPU;
* ``torch_save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, PyTorch's own
  hooks (copies on the compute stream, loads on demand, parameters included);
* ``vramkit``: :class:`vramkit.offload.activations.ActivationOffloader` (copy streams, prefetch,
  pinned pool, parameters skipped).

For each it reports the mean step time (wall clock over the measured steps, forward and backward
medians from CUDA events), the peak of ``torch.cuda.max_memory_allocated`` above the memory held
before the step (the parameters), and the ratios to ``resident``. On a machine without CUDA it
runs a tiny model on the CPU to exercise the script (no memory figures, ``vramkit`` only beside
``resident``).

Run (GPU):  PYTHONPATH=src python3 benchmarks/activation_offload.py --out out
Quick:      PYTHONPATH=src python3 benchmarks/activation_offload.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.offload.activations import ActivationOffloadConfig, ActivationOffloader

GiB = float(1 << 30)
MODES = ("resident", "torch_save_on_cpu", "vramkit")


class Block(nn.Module):
    """Pre-norm transformer block: attention (SDPA) and a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, mlp_ratio * width)
        self.down = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_context(mode: str, offloader: ActivationOffloader | None
                 ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    if mode == "resident":
        return contextlib.nullcontext
    if mode == "torch_save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    assert offloader is not None
    return lambda: offloader


def run_mode(model: nn.Module, x: torch.Tensor, mode: str, args: argparse.Namespace,
             device: torch.device) -> dict[str, Any]:
    """Warm up, then time ``args.steps`` steps of ``mode``; returns times, peak and stats."""
    cuda = device.type == "cuda"
    offloader = None
    if mode == "vramkit":
        offloader = ActivationOffloader(
            ActivationOffloadConfig(min_bytes=args.min_bytes, prefetch=args.prefetch,
                                    max_inflight_bytes=args.inflight,
                                    max_pinned_bytes=args.max_pinned),
            device=device)
    context = make_context(mode, offloader)
    params = list(model.parameters())
    marks: list[tuple[Any, Any, Any]] = []

    def step(timed: bool) -> None:
        for p in params:
            p.grad = None
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) \
            if cuda and timed else None
        if events:
            events[0].record()
        with context():
            loss = model(x).float().square().mean()
        if events:
            events[1].record()
        loss.backward()
        if events:
            events[2].record()
            marks.append(events)

    try:
        for _ in range(args.warmup):
            step(False)
        for p in params:  # the measured peak includes the gradients each step creates
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        gc.collect()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if offloader is not None:
            offloader.reset_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(True)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    except torch.OutOfMemoryError:
        for p in params:
            p.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return {"mode": mode, "oom": True}
    result: dict[str, Any] = {"mode": mode, "oom": False, "step_ms": wall * 1e3}
    if marks:
        result["forward_ms"] = statistics.median(a.elapsed_time(b) for a, b, _ in marks)
        result["backward_ms"] = statistics.median(b.elapsed_time(c) for _, b, c in marks)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        result["peak_gib"] = peak / GiB
        result["step_peak_gib"] = (peak - base) / GiB
    if offloader is not None:
        stats = offloader.stats()
        result["offloaded_gib_per_step"] = stats.offloaded_bytes / args.steps / GiB
        result["kept_gib_per_step"] = stats.kept_bytes / args.steps / GiB
        result["prefetch_hit_rate"] = stats.prefetch_hit_rate
        result["device_hits_per_step"] = stats.device_hits / args.steps
        result["kept_over_cap"] = stats.kept_over_cap
        pool = offloader.pool
        result["pinned_pool_gib"] = pool.stats().reserved / GiB if pool is not None else 0.0
        result["stats"] = dataclasses.asdict(stats)
    for p in params:
        p.grad = None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--min-bytes", default="1MiB", help="ActivationOffloadConfig.min_bytes")
    parser.add_argument("--prefetch", type=int, default=2, help="ActivationOffloadConfig.prefetch")
    parser.add_argument("--inflight", default="256MiB",
                        help="ActivationOffloadConfig.max_inflight_bytes")
    parser.add_argument("--max-pinned", default=None,
                        help="ActivationOffloadConfig.max_pinned_bytes (default: no cap)")
    parser.add_argument("--quick", action="store_true",
                        help="4 blocks, 2 warm-up and 3 measured steps")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.blocks, args.warmup, args.steps = min(args.blocks, 4), 2, 3
    dtype = torch.bfloat16
    modes = list(args.modes)
    if device.type == "cpu":  # exercise the script only: a tiny fp32 model, no pinned baseline
        args.width, args.heads, args.blocks, dtype = 256, 4, 2, torch.float32
        args.tokens = sorted({min(t, 512) for t in args.tokens})
        args.min_bytes = "0B"
        modes = [m for m in modes if m != "torch_save_on_cpu"]

    torch.manual_seed(0)
    model = Stack(args.blocks, args.width, args.heads).to(device=device, dtype=dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        x = torch.randn(1, tokens, args.width, device=device, dtype=dtype)
        by_mode = {mode: run_mode(model, x, mode, args, device) for mode in modes}
        resident = by_mode.get("resident", {})
        for run in by_mode.values():
            run["tokens"] = tokens
            if not run["oom"] and resident and not resident["oom"]:
                run["time_ratio"] = run["step_ms"] / resident["step_ms"]
                if "step_peak_gib" in run and resident.get("step_peak_gib"):
                    run["peak_ratio"] = run["step_peak_gib"] / resident["step_peak_gib"]
            runs.append(run)
            rows.append(_row(run, args))
        del x
    result = {
        "config": {"blocks": args.blocks, "width": args.width, "heads": args.heads,
                   "dtype": str(dtype), "device": str(device), "steps": args.steps,
                   "warmup": args.warmup, "param_gib": param_bytes / GiB,
                   "min_bytes": args.min_bytes, "prefetch": args.prefetch,
                   "max_inflight_bytes": args.inflight, "max_pinned_bytes": args.max_pinned},
        "runs": runs,
    }
    write_result("activation_offload", result, rows, args.out)


def _row(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    def fmt(key: str, spec: str) -> str:
        value = run.get(key)
        return "-" if value is None else format(value, spec)

    if run["oom"]:
        return {"model": f"{args.blocks}x{args.width}", "tokens": run["tokens"],
                "mode": run["mode"], "step ms": "OOM", "fwd/bwd ms": "-", "step peak GiB": "-",
                "time vs resident": "-", "peak vs resident": "-", "offloaded GiB": "-",
                "prefetch hits": "-"}
    return {
        "model": f"{args.blocks}x{args.width}",
        "tokens": run["tokens"],
        "mode": run["mode"],
        "step ms": fmt("step_ms", ".1f"),
        "fwd/bwd ms": f"{fmt('forward_ms', '.1f')} / {fmt('backward_ms', '.1f')}",
        "step peak GiB": fmt("step_peak_gib", ".2f"),
        "time vs resident": fmt("time_ratio", ".2f") + "x" if "time_ratio" in run else "-",
        "peak vs resident": fmt("peak_ratio", ".2f") + "x" if "peak_ratio" in run else "-",
        "offloaded GiB": fmt("offloaded_gib_per_step", ".2f"),
        "prefetch hits": fmt("prefetch_hit_rate", ".0%"),
    }


if __name__ == "__main__":
    main()
