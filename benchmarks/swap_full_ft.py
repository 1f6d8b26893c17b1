"""Full fine-tuning with swapped blocks: trainable="cpu" + a CPU optimizer vs the resident model.

The swapper's answer to full fine-tuning of weights that do not fit is ZeRO-Offload style: with
``SwapConfig(trainable="cpu")`` a swapped block's gradients go device->host into pinned buffers
after its backward, and a CPU optimizer (here :class:`vramkit.offload.optimizer.CPUOffloadOptimizer`
over AdamW, fp32 masters on the host) steps them; the next forward loads the updated masters.
This script measures one full training step (forward, backward, ``sync_gradients``, optimizer
step) of a transformer stack (bf16, every weight trainable) for:

* **resident_gpu_adamw**: every block on the GPU, fused AdamW on the GPU (the fast baseline that
  needs weights + gradients + 8 bytes/parameter of optimizer state on the GPU);
* **resident_cpu_adamw**: every block on the GPU, optimizer state offloaded
  (``CPUOffloadOptimizer``, overlap on) -- isolates the cost of the CPU optimizer;
* **swap_S/N**: S of N blocks swapped with ``trainable="cpu"``, the same CPU optimizer over the
  resident parameters and :meth:`BlockSwapper.host_parameters` (``overlap=False``: host gradients
  land in ``sync_gradients``).

Printed: step time (median, wall clock with a device sync per step), forward+backward time, the
optimizer's share, GPU peak memory, and ratios to the GPU-AdamW baseline.

Run (GPU, ~1-2 min): PYTHONPATH=src python benchmarks/swap_full_ft.py --out out
Run (CPU smoke test): PYTHONPATH=src python benchmarks/swap_full_ft.py --device cpu --quick
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, fill_defaults, write_result
from _swap_models import TransformerStack
from _timing import synchronize
from vramkit.offload.optimizer import CPUOffloadOptimizer
from vramkit.offload.swap import BlockSwapper, SwapConfig

LR = 1e-5


def build(args: argparse.Namespace, device: torch.device) -> TransformerStack:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TransformerStack(args.blocks, args.hidden, args.heads, args.rank, dtype,
                             torch.device("cpu") if device.type == "cuda" else device)
    model.requires_grad_(True)  # full fine-tuning: every weight trains
    return model


def run_variant(name: str, swapped: int, gpu_optimizer: bool, args: argparse.Namespace,
                device: torch.device) -> dict[str, Any]:
    model = build(args, device)
    swapper = None
    if swapped:
        swapper = BlockSwapper(model, config=SwapConfig(
            max_gpu_blocks=args.blocks - swapped, trainable="cpu", checkpointing=args.ckpt),
            device=device)
        optimizer: Any = CPUOffloadOptimizer(swapper.optimizer_parameters(), torch.optim.AdamW,
                                             overlap=False, lr=LR)
    else:
        model.to(device)
        if args.ckpt:
            from vramkit.offload.checkpointing import enable_gradient_checkpointing
            enable_gradient_checkpointing(model)
        if gpu_optimizer:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR,
                                          fused=device.type == "cuda")
        else:
            optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(0)).to(
        device, next(iter(model.blocks[0].parameters())).dtype if not swapped else
        (torch.bfloat16 if device.type == "cuda" else torch.float32))
    step_ms, fb_ms, losses = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = model(x).float().square().mean()
        loss.backward()
        if swapper is not None:
            swapper.sync_gradients()
        synchronize(device)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= args.warmup:
            step_ms.append((t2 - t0) * 1e3)
            fb_ms.append((t1 - t0) * 1e3)
    result: dict[str, Any] = {
        "variant": name, "swapped": swapped, "step_ms_p50": statistics.median(step_ms),
        "fwd_bwd_ms_p50": statistics.median(fb_ms),
        "optimizer_ms_p50": statistics.median(s - f for s, f in zip(step_ms, fb_ms, strict=True)),
        "first_loss": losses[0], "last_loss": losses[-1],
        "peak_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                     if device.type == "cuda" else None),
    }
    if swapper is not None:
        result["h2d_gib_per_step"] = swapper.stats().h2d_bytes / (args.warmup + args.steps) / 2**30
        result["d2h_gib_per_step"] = swapper.stats().d2h_bytes / (args.warmup + args.steps) / 2**30
        close = getattr(optimizer, "close", None)
        if close is not None:
            close()
        swapper.detach()
    elif isinstance(optimizer, CPUOffloadOptimizer):
        optimizer.close()
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--blocks", type=int, default=None, help="blocks (default 8)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 3072)")
    parser.add_argument("--heads", type=int, default=None, help="heads (default 24)")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank of the stack (trained too)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens (default 4096)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ckpt", action="store_true", help="gradient checkpointing on")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    small = args.quick or device.type == "cpu"
    defaults = {"blocks": 4 if small else 8, "hidden": 128 if device.type == "cpu" else 3072,
                "heads": 4 if device.type == "cpu" else 24,
                "tokens": 64 if device.type == "cpu" else 4096, "steps": 2 if small else 5}
    fill_defaults(args, defaults)
    n = args.blocks
    variants = [("resident_gpu_adamw", 0, True), ("resident_cpu_adamw", 0, False),
                (f"swap_{n // 2}/{n}", n // 2, False), (f"swap_{n}/{n}", n, False)]
    results = [run_variant(name, s, gpu, args, device) for name, s, gpu in variants]
    base = results[0]
    rows = []
    for r in results:
        r["x_gpu_adamw"] = r["step_ms_p50"] / base["step_ms_p50"]
        if r["peak_gib"] is not None and base["peak_gib"]:
            r["peak_ratio"] = r["peak_gib"] / base["peak_gib"]
        rows.append({"variant": r["variant"], "step ms": r["step_ms_p50"],
                     "fwd+bwd ms": r["fwd_bwd_ms_p50"], "optimizer ms": r["optimizer_ms_p50"],
                     "x gpu_adamw": r["x_gpu_adamw"], "peak GiB": r["peak_gib"],
                     "loss first->last": f"{r['first_loss']:.4f}->{r['last_loss']:.4f}"})
        print(f"{r['variant']}: {r['step_ms_p50']:.1f} ms (fwd+bwd {r['fwd_bwd_ms_p50']:.1f}, "
              f"optimizer {r['optimizer_ms_p50']:.1f}), peak {r['peak_gib']} GiB", flush=True)
    params = sum(p.numel() for p in build(args, torch.device("cpu")).parameters())
    document = {"config": {**vars(args), "out": str(args.out), "params": params,
                           "device": str(device)}, "results": results}
    write_result("swap_full_ft", document, rows, args.out)


if __name__ == "__main__":
    main()
