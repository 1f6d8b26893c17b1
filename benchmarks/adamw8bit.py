"""8-bit AdamW benchmark: vramkit AdamW8bit vs torch AdamW (fused), bitsandbytes and torchao.

Two parts, each variant on a fresh model with the same initial weights:

* **Speed and memory** on a stack of residual MLP blocks (LayerNorm -> Linear 4x -> GELU ->
  Linear, bf16, ~0.8B parameters by default): optimizer state bytes per parameter (on CUDA: the
  growth of ``torch.cuda.memory_allocated`` over the first ``step()``, which creates the states;
  on the CPU: the bytes of the state tensors, inner tensors of tensor subclasses included),
  the time of ``optimizer.step()`` alone (CUDA events, median) and of a whole training step
  (forward + backward + step, to a device synchronization, median).
* **Quality** on the small preset of ``vramkit.recipes.dit`` (flow-matching loss on a fixed pool
  of synthetic batches): final loss (mean of the last 20 steps) after ``--quality-steps`` steps
  for each of ``--seeds`` seeds, and its ratio to torch AdamW's.

Variants: ``torch_adamw_fused`` (the baseline, ``torch.optim.AdamW(fused=True)``),
``vramkit_adamw8bit``, ``vramkit_adamw4bit`` (``state_bits=4, block_size=128``),
``bnb_adamw8bit`` (``bitsandbytes.optim.AdamW8bit``) and ``torchao_adamw8bit``
(``torchao.optim.AdamW8bit``). The last two run where they import and work (pyproject extra
``compare``); otherwise the row says why it was skipped. Checked for vramkit's 8-bit variant:
<= 2.1 state bytes per parameter (the target), and two goals of our own, reported but not
targets: training step <= 1.10x torch's fused AdamW, final loss within 1% of AdamW's.

Run (GPU, ~3 min):  PYTHONPATH=src python3 benchmarks/adamw8bit.py --out out
Quick (GPU):        PYTHONPATH=src python3 benchmarks/adamw8bit.py --quick --out out
CPU (smoke):        PYTHONPATH=src python3 benchmarks/adamw8bit.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, fill_defaults, parse_variants, write_result
from _mlp import build_mlp
from _timing import synchronize
from vramkit.optim.adamw8bit import AdamW8bit
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch

HYPER = {"lr": 1e-4, "weight_decay": 0.01}
QUALITY_LR = 1e-3
VARIANTS = ("torch_adamw_fused", "vramkit_adamw8bit", "vramkit_adamw4bit", "bnb_adamw8bit",
            "torchao_adamw8bit")
BASELINE = "torch_adamw_fused"
STATE_TARGET, TIME_TARGET, LOSS_TARGET = 2.1, 1.10, 0.01


class Skipped(Exception):
    """A comparison library that is not installed or cannot run here."""


def optimizer_factory(variant: str) -> Callable[..., torch.optim.Optimizer]:
    """A constructor ``(params, lr=..., weight_decay=...)`` for ``variant``.

    Raises:
        Skipped: when the variant's library does not import.
    """
    if variant == "torch_adamw_fused":
        return lambda params, **kw: torch.optim.AdamW(params, fused=True, **kw)
    if variant == "vramkit_adamw8bit":
        return lambda params, **kw: AdamW8bit(params, **kw)
    if variant == "vramkit_adamw4bit":
        return lambda params, **kw: AdamW8bit(params, state_bits=4, block_size=128, **kw)
    if variant == "bnb_adamw8bit":
        try:
            import bitsandbytes
        except Exception as exc:  # ImportError, or a broken native library
            raise Skipped(f"bitsandbytes does not import: {exc!r}") from exc
        return lambda params, **kw: bitsandbytes.optim.AdamW8bit(params, **kw)
    if variant == "torchao_adamw8bit":
        try:
            from torchao.optim import AdamW8bit as TorchaoAdamW8bit
        except Exception as exc:
            raise Skipped(f"torchao.optim does not import: {exc!r}") from exc
        return lambda params, **kw: TorchaoAdamW8bit(params, **kw)
    raise ValueError(f"unknown variant {variant!r}")


def tensor_bytes(value: Any) -> int:
    """Bytes of a state value; tensor subclasses (torchao) count their inner tensors."""
    if not isinstance(value, torch.Tensor):
        return 0
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = value.__tensor_flatten__()
        return sum(tensor_bytes(getattr(value, name)) for name in names)
    return value.nbytes


def state_tensor_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v) for state in optimizer.state.values() for v in state.values())


# -- speed and memory ---------------------------------------------------------------------------

def mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Learn a fixed linear map of the input: a task with a reachable, non-trivial optimum.
    return (model(x).float() - 0.5 * x.roll(1, dims=-1).float()).pow(2).mean()


def run_speed(variant: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    make = optimizer_factory(variant)
    model = build_mlp(args.layers, args.dim, device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, args.dim, device=device, generator=gen, dtype=torch.bfloat16)
    optimizer = make(params, **HYPER)
    mlp_loss(model, x).backward()
    synchronize(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    optimizer.step()  # creates the states
    synchronize(device)
    if device.type == "cuda":
        state_bytes = torch.cuda.memory_allocated(device) - before
        state_source = "cuda.memory_allocated growth over the first step"
    else:
        state_bytes = state_tensor_bytes(optimizer)
        state_source = "state tensor bytes"
    optimizer.zero_grad(set_to_none=True)
    for _ in range(args.warmup):
        mlp_loss(model, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)

    step_ms: list[float] = []
    for _ in range(args.steps):  # the optimizer step alone
        mlp_loss(model, x).backward()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            optimizer.step()
            end.record()
            end.synchronize()
            step_ms.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            optimizer.step()
            step_ms.append((time.perf_counter() - began) * 1e3)
        optimizer.zero_grad(set_to_none=True)
    train_ms: list[float] = []
    for _ in range(args.steps):  # forward + backward + step
        synchronize(device)
        began = time.perf_counter()
        mlp_loss(model, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        train_ms.append((time.perf_counter() - began) * 1e3)
    result = {"params": numel, "state_bytes": state_bytes,
              "state_bytes_per_param": state_bytes / numel, "state_bytes_source": state_source,
              "opt_step_ms_p50": statistics.median(step_ms),
              "train_step_ms_p50": statistics.median(train_ms)}
    del optimizer, model, params, x
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# -- quality ----------------------------------------------------------------------------------

def run_quality(variant: str, args: argparse.Namespace, device: torch.device,
                seed: int) -> float:
    """Final flow-matching loss of a small DiT (mean of the last 20 steps)."""
    make = optimizer_factory(variant)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = DiTConfig.preset("small", dtype=dtype)
    model = DiT(config, seed=seed).to(device)
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    pool = [synthetic_batch(config, 8, generator=gen, device=device) for _ in range(16)]
    optimizer = make(list(model.parameters()), lr=QUALITY_LR, weight_decay=0.01)
    losses = []
    for step in range(args.quality_steps):
        loss = flow_matching_loss(model, pool[step % len(pool)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    tail = torch.stack(losses[-20:]).mean()
    return float(tail)  # one host sync, after training


def run_variant(variant: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    result: dict[str, Any] = {"variant": variant}
    try:
        result.update(run_speed(variant, args, device))
        losses = [run_quality(variant, args, device, seed) for seed in range(args.seeds)]
        result["final_losses"] = losses
        result["final_loss_mean"] = statistics.fmean(losses)
    except Skipped as exc:
        result["skipped"] = str(exc)
    except Exception as exc:  # a comparison library failing here is a result, not a crash
        if variant.startswith("vramkit") or variant == BASELINE:
            raise
        result["skipped"] = f"failed: {exc!r}"
        result["traceback"] = traceback.format_exc(limit=3)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def compare(results: dict[str, dict[str, Any]]) -> None:
    """Ratios against the baseline and the targets for vramkit's 8-bit variant."""
    base = results.get(BASELINE)
    if base is None or "skipped" in base:
        return
    for result in results.values():
        if "skipped" in result:
            continue
        result["opt_step_ratio"] = result["opt_step_ms_p50"] / base["opt_step_ms_p50"]
        result["train_step_ratio"] = result["train_step_ms_p50"] / base["train_step_ms_p50"]
        ratios = [a / b for a, b in zip(result["final_losses"], base["final_losses"],
                                        strict=True)]
        result["final_loss_ratios"] = ratios
        result["final_loss_ratio_max_dev"] = max(abs(r - 1) for r in ratios)
    eight = results.get("vramkit_adamw8bit")
    if eight is not None and "skipped" not in eight:
        eight["targets"] = {
            "state_bytes_per_param<=2.1": eight["state_bytes_per_param"] <= STATE_TARGET,
            "train_step<=1.10x": eight["train_step_ratio"] <= TIME_TARGET,
            "final_loss_within_1%": eight["final_loss_ratio_max_dev"] <= LOSS_TARGET,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available; cpu is a smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="MLP blocks (default 24)")
    parser.add_argument("--dim", type=int, default=None,
                        help="width (default 2048: 805M params with 24 layers)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 4096)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--quality-steps", type=int, default=None,
                        help="DiT training steps per seed (default 500)")
    parser.add_argument("--seeds", type=int, default=None, help="quality seeds (default 3)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu for a smoke test")
    defaults = {"layers": 24, "dim": 2048, "tokens": 4096, "steps": 10, "quality_steps": 500,
                "seeds": 3}
    if args.quick:
        defaults.update(layers=8, dim=1024, tokens=2048, steps=5, quality_steps=200)
    if device.type == "cpu":
        defaults.update(layers=2, dim=256, tokens=128, steps=3, quality_steps=30, seeds=1)
        args.warmup = min(args.warmup, 1)
    fill_defaults(args, defaults)
    variants = parse_variants(parser, args.variants, VARIANTS)

    results = {variant: run_variant(variant, args, device) for variant in variants}
    compare(results)
    for result in results.values():
        if "skipped" in result:
            print(f"{result['variant']}: skipped: {result['skipped']}", file=sys.stderr)
    config = {"layers": args.layers, "dim": args.dim, "tokens": args.tokens,
              "dtype": "bfloat16", "steps": args.steps, "warmup": args.warmup,
              "quality_model": "DiTConfig.preset('small')", "quality_steps": args.quality_steps,
              "quality_lr": QUALITY_LR, "seeds": args.seeds, "device": str(device),
              "hyper": HYPER}
    rows = []
    for result in results.values():
        skipped = "skipped" in result
        rows.append({
            "variant": result["variant"],
            "params": "-" if skipped else f"{result['params'] / 1e6:.0f}M bf16",
            "state B/param": "-" if skipped else result["state_bytes_per_param"],
            "opt step ms": "-" if skipped else result["opt_step_ms_p50"],
            "x fused (opt)": result.get("opt_step_ratio", "-"),
            "train step ms": "-" if skipped else result["train_step_ms_p50"],
            "x fused (train)": result.get("train_step_ratio", "-"),
            "final loss": "-" if skipped else result["final_loss_mean"],
            "max loss ratio dev": result.get("final_loss_ratio_max_dev", "-"),
            "note": result["skipped"][:60] if skipped else " ".join(
                f"{k}:{'PASS' if ok else 'FAIL'}" for k, ok in result.get("targets", {}).items()),
        })
    write_result("adamw8bit", {"config": config, "results": results}, rows, args.out)


if __name__ == "__main__":
    main()
