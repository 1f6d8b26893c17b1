"""Training quality with 8-bit compute: the demo's task (a LoRA fine-tune of vramkit's DiT on one
fixed synthetic batch, flow-matching loss) trained with bf16 frozen weights and with the same
weights as fp8 / int8 W8A8 layers, from identical starting values.

Per seed: the ``small`` DiT preset (``--dtype``, bf16 by default), LoRA rank 16 on every
block (``vramkit.recipes.lora``, the demo's adapters), AdamW at the demo's learning rate on the
demo's fixed batch (``fixed_batch``, batch 2), ``--steps`` steps. The W8A8 arms quantize each
frozen base Linear with ``QuantizationConfig(kind, w8a8=True)`` (forward and input gradient in
8 bits; the adapters stay float32). Printed per kind: the first step's loss and the final loss
(mean of the last 20 steps) and their relative deviation from the bf16 run, worst over seeds.
Target: final loss within 3 % of the bf16 run.

The control ``bf16-ulp`` (``--kinds bf16-ulp``) trains the bf16 model with every frozen weight
moved by one bf16 step up or down at random (a 0.4-0.8 % change of each weight, far below an
8-bit code's error): how far this task's final loss moves for a perturbation that small, i.e.
the deviation the 3 % target can resolve here at all.

The numerics do not depend on the device: the CPU runs the same 8-bit codes and scales (its fp8
products through ``torch._scaled_mm`` or, where the CPU build takes no row-wise scales, in
fp32 from the same codes), so the CPU measures the same quality, slowly.

Run (GPU, ~2-3 min on an H200, eager 8-bit layers are host-bound on a model this small):
    PYTHONPATH=src python3 benchmarks/w8a8_quality.py --out out/w8a8q
Run (CPU, ~19 min on 2 busy cores): PYTHONPATH=src python3 benchmarks/w8a8_quality.py
    --device cpu --out out/w8a8q
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.quant.model import QuantizationConfig, quantize_model
from vramkit.recipes.demo.config import DemoConfig
from vramkit.recipes.demo.harness import fixed_batch
from vramkit.recipes.demo.plan import block_names
from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss
from vramkit.recipes.lora import add_lora_adapters

KINDS = ("bf16", "fp8", "int8", "bf16-ulp")
TARGET = 0.03


def train(kind: str, args: argparse.Namespace, device: torch.device, seed: int
          ) -> tuple[float, float]:
    """(first loss, mean of the last 20 losses) of one run."""
    config = DiTConfig.preset(args.preset, dtype=args.dtype)
    model = DiT(config, seed=seed, device="cpu")
    adapters = add_lora_adapters(model, block_names(model), DemoConfig().lora_rank, seed=seed)
    model.to(device)
    if kind == "bf16-ulp":
        nudge_frozen(model, seed)
    elif kind != "bf16":
        quantize_model(model, QuantizationConfig(kind, w8a8=True))
    batch = fixed_batch(config, 2, seed, device)
    optimizer = torch.optim.AdamW(adapters, lr=DemoConfig().learning_rate, weight_decay=0.0)
    losses = []
    for _ in range(args.steps):
        loss = flow_matching_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    tail = torch.stack(losses[-20:]).mean()
    return float(losses[0]), float(tail)


def nudge_frozen(model: torch.nn.Module, seed: int) -> None:
    """Move every frozen floating-point weight one step of its dtype up or down, at random."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not p.is_floating_point():
                continue
            up = torch.rand(p.shape, generator=g).to(p.device) < 0.5
            inf = torch.full_like(p, float("inf"))
            p.copy_(torch.nextafter(p, torch.where(up, inf, -inf)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--preset", default="small", help="DiT preset (default small)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the frozen weights' and activations' dtype (default bfloat16)")
    parser.add_argument("--kinds", default="fp8,int8",
                        help="comma-separated: fp8, int8, bf16-ulp (the control); bf16 always "
                             "runs (default bf16,fp8,int8)")
    add_common_args(parser)
    args = parser.parse_args()
    if args.steps < 20 or args.seeds < 1:
        parser.error("--steps takes 20 or more, --seeds 1 or more")
    device = torch.device(args.device)
    kinds = ["bf16"] + [k for k in args.kinds.split(",") if k and k != "bf16"]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {KINDS}")
    runs: dict[str, list[tuple[float, float]]] = {
        k: [train(k, args, device, seed) for seed in range(args.seeds)] for k in kinds}
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        firsts = [abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(runs[kind], runs["bf16"],
                                                                 strict=True)]
        finals = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(runs[kind], runs["bf16"],
                                                                 strict=True)]
        rows.append({"kind": kind,
                     "first loss": " / ".join(f"{r[0]:.4f}" for r in runs[kind]),
                     "final loss": " / ".join(f"{r[1]:.4f}" for r in runs[kind]),
                     "first dev (worst)": f"{max(firsts):.2%}",
                     "final dev (worst)": f"{max(finals):.2%}",
                     "within 3 %": max(finals) <= TARGET})
    write_result("w8a8_quality", {"steps": args.steps, "seeds": args.seeds,
                                  "preset": args.preset, "runs": runs, "target": TARGET},
                 rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
