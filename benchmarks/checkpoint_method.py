"""Checkpoint methods on a resident FLUX.1-dev LoRA step: vramkit's lean checkpoint against
PyTorch's non-reentrant (vramkit's ``method="pytorch"``) and reentrant checkpoints.

The model is FLUX.1-dev's transformer from its published config with random bf16 weights, peft
LoRA r16 on ``to_q, to_k, to_v, to_out.0``, 1024x1024 (4096 image + 512 text tokens), batch 1,
bf16 autocast, AdamW on the adapters -- benchmarks/plan.py's job -- resident on the GPU with
every block checkpointed. Arms, alternating (ABBA rounds; ``--steps-per-arm`` steps a turn, the
first untimed):

* ``lean``: ``enable_gradient_checkpointing(model, method="lean")`` (the default);
* ``pytorch``: ``enable_gradient_checkpointing(model, method="pytorch")``
  (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``);
* ``reentrant``: ``torch.utils.checkpoint.checkpoint(use_reentrant=True)`` around each block
  (tensors passed positionally). Its outputs require grad only where an input does, and no
  input of FLUX's first block does under LoRA (they come from frozen embedders): nothing would
  train. As trainers do (peft's ``enable_input_require_grads``), a block whose inputs do not
  require grad gets a detached copy of its hidden states that does;
* ``none``: no checkpointing (the host-time reference; needs ~2x the memory).

Each step is timed in two parts with a synchronize between: the forward (its wall time and the
host's time to enqueue it) and backward + AdamW. After timing, one step of ``lean`` and two of
``pytorch`` from the same adapters are compared: the adapters' gradients, lean against pytorch
beside pytorch against itself (the GPU's run-to-run spread).

cuDNN's SDPA backend is disabled (it crashed on FLUX shapes on torch 2.11 + Hopper; docs/architecture.md,
"Performance model and physical limits").

Run (GPU, ~3 min): PYTHONPATH=src python3 benchmarks/checkpoint_method.py --out out/ckpt
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/checkpoint_method.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import log
from plan import Settings, loss_of, materialize, meta_target, real_inputs, sync
from vramkit.devices.resolve import resolve_device

ARMS = ("lean", "pytorch", "reentrant", "none")


def _reentrant(block: nn.Module) -> Callable[..., Any]:
    """``block``'s forward under PyTorch's reentrant checkpoint, tensors passed positionally."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        rest = {k: v for k, v in kwargs.items() if k not in names}

        def call(*tensors: torch.Tensor) -> Any:
            given = dict(zip(names, tensors[len(args):], strict=True))
            return forward(*tensors[:len(args)], **given, **rest)

        tensors = [*args, *(kwargs[k] for k in names)]
        if not any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor)):
            first = next(i for i, t in enumerate(tensors)
                         if isinstance(t, torch.Tensor) and t.is_floating_point())
            tensors[first] = tensors[first].detach().requires_grad_(True)
        return checkpoint(call, *tensors, use_reentrant=True)

    return run


class Bench:
    """The model once; each arm switches the blocks' checkpointing before its turn."""

    def __init__(self, s: Settings) -> None:
        from vramkit.offload.blocks import find_blocks

        self.device = resolve_device(s.device, owner="benchmarks/checkpoint_method.py")
        target = meta_target("flux", s)
        self.family = target.family
        self.model = materialize(target, self.device, s.seed)
        self.inputs = real_inputs(target.inputs, self.device, None, s.seed + 1)
        self.blocks = find_blocks(self.model, "auto")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0)
        self.current = ""

    def use(self, arm: str) -> None:
        from vramkit.offload.checkpointing import (
            disable_gradient_checkpointing,
            enable_gradient_checkpointing,
        )

        if arm == self.current:
            return
        disable_gradient_checkpointing(self.model)
        if self.current == "reentrant":
            for _, block in self.blocks:
                del block.forward  # the reentrant arm's instance forward
        if arm in ("lean", "pytorch"):
            enable_gradient_checkpointing(self.model, method=arm)
        elif arm == "reentrant":
            for _, block in self.blocks:
                block.forward = _reentrant(block)
        self.current = arm

    def step(self, arm: str, timed: dict[str, list[float]] | None) -> float:
        self.use(arm)
        sync(self.device)
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = loss_of(self.model, self.inputs, self.family)
        t1 = time.perf_counter()
        sync(self.device)
        t2 = time.perf_counter()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        t3 = time.perf_counter()
        if timed is not None:
            timed["forward_host"].append(t1 - t0)
            timed["forward"].append(t2 - t0)
            timed["backward"].append(t3 - t2)
            timed["step"].append(t3 - t0)
        return float(loss.detach())

    def gradients(self, arm: str) -> list[torch.Tensor]:
        self.use(arm)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = loss_of(self.model, self.inputs, self.family)
        loss.backward()
        grads = [p.grad.detach().clone() for p in self.params if p.grad is not None]
        self.opt.zero_grad(set_to_none=True)
        return grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    parser.add_argument("--steps-per-arm", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny FLUX (CPU code paths)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    if args.rounds < 1 or args.steps_per_arm < 2:
        parser.error("--rounds must be >= 1 and --steps-per-arm >= 2 (the first is untimed)")
    s = Settings(device=args.device, tiny=args.tiny)
    if s.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashes on Flux shapes (docs/architecture.md)
    t0 = time.perf_counter()
    bench = Bench(s)
    log(f"FLUX built in {time.perf_counter() - t0:.1f} s; arms {arms}")
    times = {a: {k: [] for k in ("forward_host", "forward", "backward", "step")} for a in arms}
    peaks: dict[str, int] = {}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            if bench.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(bench.device)
            for i in range(args.steps_per_arm):
                bench.step(arm, times[arm] if i else None)
            if bench.device.type == "cuda":
                peaks[arm] = max(peaks.get(arm, 0), torch.cuda.max_memory_allocated(bench.device))
        log(f"round {r + 1}/{args.rounds} done")
    medians = {a: {k: statistics.median(v) for k, v in t.items()} for a, t in times.items()}
    result: dict[str, Any] = {"arms": arms, "medians_s": medians, "all_s": times,
                              "peak_bytes": peaks, "tiny": args.tiny}
    if "lean" in arms and "pytorch" in arms:
        # against the run-to-run spread of one method (GPU kernels such as attention's backward
        # add in a varying order): two pytorch steps from the same adapters
        a, b, c = bench.gradients("lean"), bench.gradients("pytorch"), bench.gradients("pytorch")

        def differ(x: list[torch.Tensor], y: list[torch.Tensor]) -> float:
            return max((float((u.float() - v.float()).abs().max())
                        for u, v in zip(x, y, strict=True)), default=0.0)

        result["gradients_identical"] = len(a) == len(b) and all(
            torch.equal(x, y) for x, y in zip(a, b, strict=True))
        result["gradient_max_abs_diff"] = differ(a, b)
        result["gradient_noise_max_abs_diff"] = differ(b, c)
        result["gradient_max_abs"] = max((float(x.abs().max()) for x in b), default=0.0)
    base = medians.get("pytorch")
    rows = []
    for arm in arms:
        m = medians[arm]
        rows.append({
            "arm": arm, "forward host ms": f"{m['forward_host'] * 1e3:.1f}",
            "forward ms": f"{m['forward'] * 1e3:.1f}", "backward ms": f"{m['backward'] * 1e3:.1f}",
            "step ms": f"{m['step'] * 1e3:.1f}",
            "step vs pytorch": f"{m['step'] / base['step']:.3f}" if base else "-",
            "peak GiB": f"{peaks[arm] / 2**30:.2f}" if arm in peaks else "-"})
    write_result("checkpoint_method", result, rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
