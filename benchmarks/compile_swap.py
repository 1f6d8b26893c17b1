"""Compiled and 8-bit blocks on the swapped path: a LoRA training step of a transformer stack,
eager vs ``torch.compile`` (vramkit.offload.compiled), bf16 vs W8A8 frozen weights
(vramkit.quant.w8a8), resident vs swapped, side by side in one process.

The stack is benchmarks/_swap_models.py's TransformerStack (FLUX-sized blocks: hidden 3072, 24
heads, MLP 4x, LoRA rank 16 on the attention projections, bf16), every block checkpointed
(vramkit's lean checkpoint), batch 1. Arms (each its own model, same weights):

* ``resident``: every block on the GPU, eager (the baseline of every ratio);
* ``resident+compile``: the same, blocks compiled;
* ``swap``: half the blocks swapped (``BlockSwapper``, 2 slots), eager;
* ``swap+compile``: the same, blocks compiled;
* ``swap+w8a8`` / ``swap+w8a8+compile``: frozen Linears as fp8 W8A8 (int8 with ``--w8a8 int8``),
  swapped as 8-bit bytes.

Paired alternating rounds: each round runs every arm for ``--steps`` steps (the first untimed),
in order, and the ratio of each arm to the resident arm of the *same round* is taken; the table
shows the median ratio and its spread over rounds. Frames compiled after the warm-up are counted
(dynamo's counters): a compiled arm that compiles again in a measured step says so.

Run (GPU, ~3 min): PYTHONPATH=src python3 benchmarks/compile_swap.py --out out/compile_swap
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/compile_swap.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _swap_models import TransformerStack
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.compiled import compile_blocks
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.quant.model import QuantizationConfig, quantize_model

ARMS = ("resident", "resident+compile", "swap", "swap+compile", "swap+w8a8",
        "swap+w8a8+compile")


def _build(arm: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    model = TransformerStack(args.blocks, args.hidden, args.heads, args.rank, torch.bfloat16,
                             device if "swap" not in arm else torch.device("cpu"), seed=0)
    if "w8a8" in arm:
        # On the device the layer will run on: the capability check and the codes are made there.
        model.to(device)
        quantize_model(model, QuantizationConfig(args.w8a8, w8a8=True))
        if "swap" in arm:
            model.to("cpu")
    if "compile" in arm:
        compile_blocks(model, "blocks")
    enable_gradient_checkpointing(model, "blocks")
    if "swap" in arm:
        BlockSwapper(model, "blocks", SwapConfig(max_gpu_blocks=args.blocks // 2,
                                                 num_slots=2), device=device)
    else:
        model.to(device)
    return model


def _frames() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0
    return int(counters["frames"]["ok"])


def _step_fn(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(x).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def _time_steps(step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    times = []
    for i in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first step of a turn is untimed
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=None, help="default 16; tiny 4")
    parser.add_argument("--tokens", type=int, default=None, help="default 4096; tiny 64")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="steps per turn, first untimed")
    parser.add_argument("--w8a8", choices=("fp8", "int8"), default="fp8")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--tiny", action="store_true", help="a small stack (CPU code paths)")
    add_common_args(parser)
    args = parser.parse_args()
    args.blocks = args.blocks or (4 if args.tiny else 16)
    args.tokens = args.tokens or (64 if args.tiny else 4096)
    args.hidden, args.heads, args.rank = (64, 4, 4) if args.tiny else (3072, 24, 16)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper: crashed on FLUX shapes
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    models: dict[str, torch.nn.Module] = {}
    errors: dict[str, str] = {}
    for arm in arms:
        try:
            models[arm] = _build(arm, args, device)
        except Exception as exc:  # an arm that cannot run is reported, the others go on
            errors[arm] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    steps = {arm: _step_fn(model, x) for arm, model in models.items()}
    warm_frames: dict[str, int] = {}
    for arm, step in list(steps.items()):  # warm-up: two steps meet every calling context
        before = _frames()
        try:
            _time_steps(step, 3, device)
        except Exception as exc:  # an arm that cannot run is reported, the others go on
            errors[arm] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            del steps[arm]
            continue
        warm_frames[arm] = _frames() - before
    frames_before = _frames()
    per_round: dict[str, list[float]] = {arm: [] for arm in steps}
    ratios: dict[str, list[float]] = {arm: [] for arm in steps}
    for _ in range(args.rounds):
        medians = {arm: statistics.median(_time_steps(step, args.steps, device))
                   for arm, step in steps.items()}
        for arm, ms in medians.items():
            per_round[arm].append(ms)
            if "resident" in medians:
                ratios[arm].append(ms / medians["resident"])
    recompiled = _frames() - frames_before
    rows = []
    for arm in arms:
        if arm not in per_round:
            rows.append({"arm": arm, "error": errors.get(arm, "not run")})
            continue
        r = ratios[arm]
        rows.append({"arm": arm, "step_ms": statistics.median(per_round[arm]),
                     "ratio": statistics.median(r) if r else None,
                     "ratio_min": min(r) if r else None, "ratio_max": max(r) if r else None,
                     "warmup_frames": warm_frames.get(arm, 0)})
    result: dict[str, Any] = {"blocks": args.blocks, "tokens": args.tokens, "w8a8": args.w8a8,
                              "rounds": args.rounds, "frames_compiled_in_measured_steps":
                              recompiled, "rows": rows}
    table = []
    for row in rows:
        if "error" in row:
            table.append({"arm": row["arm"], "step ms": "failed: " + row["error"][:90],
                          "vs resident eager": "", "spread": "", "frames at warm-up": ""})
            continue
        table.append({
            "arm": row["arm"], "step ms": f"{row['step_ms']:.1f}",
            "vs resident eager": "-" if row["ratio"] is None else f"{row['ratio']:.3f}",
            "spread": ("-" if row["ratio"] is None
                       else f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"),
            "frames at warm-up": row["warmup_frames"]})
    print(f"frames compiled during the measured rounds: {recompiled}")
    write_result("compile_swap", result, table, args.out)


if __name__ == "__main__":
    main()
