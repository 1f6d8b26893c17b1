"""Optimizer state offload benchmark: plain GPU AdamW vs CPUOffloadOptimizer.

A stack of residual MLP blocks (LayerNorm -> Linear 4x -> GELU -> Linear, bf16, ~0.8B parameters
by default) trains on random data. For each variant, on a fresh model with the same weights:
step time (forward + backward + optimizer step, timed to a device synchronization), peak GPU
memory over the timed steps, and the GPU bytes left after a step beyond the parameters (the
optimizer's footprint). Variants:

* ``gpu_adamw`` -- the baseline, ``torch.optim.AdamW(fused=True)`` on the GPU parameters;
* ``offload_overlap`` -- ``CPUOffloadOptimizer`` stepping each parameter during backward;
* ``offload_no_overlap`` -- the same, every parameter stepped in ``step()``;
* ``offload_grads_on_gpu`` -- gradients kept on the GPU until ``step()`` (overlap on);
* ``compute_only`` -- forward + backward without any optimizer, the floor for the step time.

Ratios are against ``gpu_adamw``: step time ratio (>1 is slower) and peak GPU memory saved.

Run (GPU):   PYTHONPATH=src python3 benchmarks/optimizer_offload.py --out out
Quick:       PYTHONPATH=src python3 benchmarks/optimizer_offload.py --quick
CPU (smoke): PYTHONPATH=src python3 benchmarks/optimizer_offload.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, fill_defaults, parse_variants, write_result
from _mlp import build_mlp
from _timing import synchronize
from vramkit.offload.optimizer import CPUOffloadOptimizer

GIB = 2**30
HYPER = {"lr": 1e-4, "weight_decay": 0.01}
VARIANTS = ("compute_only", "gpu_adamw", "offload_overlap", "offload_no_overlap",
            "offload_grads_on_gpu")


def make_optimizer(variant: str, model: nn.Module) -> torch.optim.Optimizer | None:
    params = list(model.parameters())
    if variant == "compute_only":
        return None
    if variant == "gpu_adamw":
        return torch.optim.AdamW(params, fused=True, **HYPER)
    options = {"offload_overlap": {"overlap": True},
               "offload_no_overlap": {"overlap": False},
               "offload_grads_on_gpu": {"overlap": True, "offload_gradients": False}}[variant]
    return CPUOffloadOptimizer(params, **options, **HYPER)  # type: ignore[arg-type]


def run_variant(variant: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = build_mlp(args.layers, args.dim, device, torch.bfloat16)
    param_bytes = sum(p.nbytes for p in model.parameters())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, args.dim, device=device, generator=gen, dtype=torch.bfloat16)
    built = time.perf_counter()
    optimizer = make_optimizer(variant, model)
    setup_s = time.perf_counter() - built

    for _ in range(args.warmup):
        train_step(model, x, optimizer)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = timed(model, x, optimizer, args.steps, device)
    result: dict[str, Any] = {
        "variant": variant,
        "step_ms_p50": statistics.median(times) * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "param_gib": param_bytes / GIB,
        "setup_s": setup_s,
    }
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        del x
        gc.collect()
        torch.empty(1, device=device)  # lets the allocator return blocks held for other streams
        result["after_step_beyond_params_gib"] = (
            torch.cuda.memory_allocated(device) - param_bytes) / GIB
    if isinstance(optimizer, CPUOffloadOptimizer):
        stats = optimizer.stats()
        n = max(stats.steps, 1)
        result.update({
            "cpu_step_ms_per_step": stats.cpu_step_seconds / n * 1e3,
            "step_wait_ms_per_step": stats.step_wait_seconds / n * 1e3,
            "d2h_gb_per_step": stats.d2h_bytes / n / 1e9,
            "h2d_gb_per_step": stats.h2d_bytes / n / 1e9,
            "host_state_gib": stats.state_bytes / GIB,
            "pinned_gib": stats.pinned_bytes / GIB,
            "gpu_state_gib_saved": stats.gpu_state_bytes_saved / GIB,
            "gpu_grad_gib_saved": stats.gpu_grad_bytes_saved / GIB,
        })
        optimizer.close()
    del optimizer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def train_step(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> None:
    """One forward, backward and update (gradients dropped when there is no optimizer)."""
    model(x).float().pow(2).mean().backward()
    if optimizer is None:
        for p in model.parameters():
            p.grad = None
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def timed(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer | None,
          steps: int, device: torch.device) -> list[float]:
    """Wall time of each step, each ending at a device synchronization."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(model, x, optimizer)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available; cpu is a smoke test)")
    parser.add_argument("--layers", type=int, default=None,
                        help="MLP blocks (default 24, quick 8)")
    parser.add_argument("--dim", type=int, default=None,
                        help="model width (default 2048: 805M params with 24 layers; quick 1024)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per batch (default 8192, quick 2048)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--quick", action="store_true",
                        help="small model and few steps (a few seconds)")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu for a smoke test")
    small = args.quick or device.type == "cpu"
    defaults = {"layers": 8 if small else 24, "dim": 1024 if args.quick else 2048,
                "tokens": 2048 if args.quick else 8192, "steps": 3 if args.quick else 10}
    if device.type == "cpu" and args.quick:
        defaults.update(dim=128, tokens=64, layers=4)
    fill_defaults(args, defaults)
    variants = parse_variants(parser, args.variants, VARIANTS)

    results = {variant: run_variant(variant, args, device) for variant in variants}
    baseline = results.get("gpu_adamw")
    for result in results.values():
        if baseline is not None:
            result["step_time_ratio"] = result["step_ms_p50"] / baseline["step_ms_p50"]
            if "peak_gib" in result:
                result["peak_saved_gib"] = baseline["peak_gib"] - result["peak_gib"]
                result["peak_ratio"] = result["peak_gib"] / baseline["peak_gib"]

    params = sum(p.numel() for p in build_mlp(args.layers, args.dim, torch.device("meta"),
                                                torch.bfloat16).parameters())
    document = {
        "config": {"layers": args.layers, "dim": args.dim, "tokens": args.tokens,
                   "params": params, "dtype": "bfloat16", "steps": args.steps,
                   "warmup": args.warmup, "device": str(device),
                   "cpu_threads": torch.get_num_threads(), "hyper": HYPER},
        "results": results,
    }
    rows = []
    for result in results.values():
        row: dict[str, Any] = {
            "variant": result["variant"],
            "params": f"{params / 1e6:.0f}M bf16",
            "step ms (p50)": result["step_ms_p50"],
            "x gpu_adamw": result.get("step_time_ratio", "-"),
            "peak GiB": result.get("peak_gib", "-"),
            "peak saved GiB": result.get("peak_saved_gib", "-"),
            "GPU beyond params after step GiB": result.get("after_step_beyond_params_gib", "-"),
            "CPU step ms": result.get("cpu_step_ms_per_step", "-"),
            "step() wait ms": result.get("step_wait_ms_per_step", "-"),
        }
        rows.append(row)
    write_result("optimizer_offload", document, rows, args.out)


if __name__ == "__main__":
    main()
