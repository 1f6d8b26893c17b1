"""Full fine-tuning with swapped blocks: trainable="swap" (block optimizers on the GPU, inside
backward) vs trainable="cpu" (gradients to the host, a CPU optimizer) vs the resident model.

Two models:

* ``--model stack`` (default): the 906 M-parameter transformer stack of the first round
  (8 blocks, hidden 3072, 4096 tokens, bf16, every weight trainable). Variants, all alive in one
  process and stepped in alternating rounds (ABCD ABCD ...):

  - **resident**: every block on the GPU, fused AdamW on the GPU (the fast baseline that needs
    weights + gradients + state on the GPU);
  - **cpu_S/N**: S of N blocks swapped with ``trainable="cpu"``, a CPU AdamW
    (:class:`vramkit.offload.optimizer.CPUOffloadOptimizer`) over the swapped masters and the
    resident parameters;
  - **swap_S/N** / **swap8_S/N**: the same blocks swapped with ``trainable="swap"``: each block's
    own AdamW (fused) / :class:`vramkit.optim.AdamW8bit` steps on the GPU inside backward, the
    resident parameters by the same optimizer class on the GPU.

* ``--model flux``: a FLUX.1-dev-shaped transformer (11.9 B parameters, built from the published
  config with random bf16 weights), 1024x1024 (4096 image + 512 text tokens), bs 1, every block
  checkpointed, all 57 blocks swapped, under a 23.5 GiB cap (an RTX 4090's worth). One child
  process per variant (host memory: each holds weights + state + gradients pinned):

  - **swap8**: ``trainable="swap"`` with AdamW8bit (and the non-block parameters by AdamW8bit on
    the GPU), the default 2 slots; **swap8-rN**: the same with ``num_slots=N`` (N weight slots
    and N state slots, so states are prefetched behind their weights in backward);
  - **cpu8**: ``trainable="cpu"`` with AdamW8bit on the CPU over the pinned masters;
  - **planned**: ``vramkit.fit(..., trainable="swap", optimizer=AdamW8bit)`` under the cap: the
    planner chooses the swapped blocks, the slots and the checkpointing (measured on this GPU);
    printed beside the sweep, with its step against the fastest swap variant of the same run
    ("vs best") and its prediction. Run it with the sweep of the slots it weighs most:
    ``--flux-variants planned,swap8-r8,swap8-r10,swap8-r12``.

Printed per variant: step time (median), GPU peak, host pinned bytes vs weights + state, and for
the swap variants the transfer bound of the step: forward ``W / BW_h2d``, backward
``max((W + S) / BW_h2d, (W + S) / BW_d2h)`` with both directions measured running at once (W:
swapped weight bytes, S: their optimizer state bytes), plus the ratio to it. The cuDNN SDPA backend
is disabled (it crashed with an illegal memory access on Flux shapes with torch 2.11 on an H100,
even without vramkit).

Run (GPU): PYTHONPATH=src python benchmarks/swap_full_ft.py --out out
           PYTHONPATH=src python benchmarks/swap_full_ft.py --model flux --out out
Run (GPU, the planned row): PYTHONPATH=src python benchmarks/swap_full_ft.py --model flux
           --flux-variants planned,swap8-r8,swap8-r10,swap8-r12 --steps 4 --warmup 2 --out out/ftp
Run (CPU smoke test): PYTHONPATH=src python benchmarks/swap_full_ft.py --device cpu --quick
                      ... --model flux --device cpu --flux-variants planned,swap8 --cap-gib 0.03
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, fill_defaults, write_result
from _swap_models import TransformerStack
from _timing import log, synchronize
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.optimizer import CPUOffloadOptimizer
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.optim import AdamW8bit

LR = 1e-5
GIB = 2**30


def host_rss() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bandwidth(device: torch.device, nbytes: int = GIB, repeats: int = 4) -> dict[str, float]:
    """Pinned copy bandwidth host->device alone, and each direction while both run at once."""
    if device.type != "cuda":
        return {"h2d": 0.0, "h2d_duplex": 0.0, "d2h_duplex": 0.0}
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(streams: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]
              ) -> list[float]:
        torch.cuda.synchronize(device)
        marks = []
        for stream, dst, src in streams:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for _ in range(repeats):
                    dst.copy_(src, non_blocking=True)
                end.record(stream)
            marks.append((start, end))
        torch.cuda.synchronize(device)
        return [repeats * nbytes / (s.elapsed_time(e) / 1e3) for s, e in marks]

    timed([(up, dev_a, host_a)])  # warm-up
    h2d = statistics.median(timed([(up, dev_a, host_a)])[0] for _ in range(3))
    duplex = [timed([(up, dev_a, host_a), (down, host_b, dev_b)]) for _ in range(3)]
    out = {"h2d": h2d, "h2d_duplex": statistics.median(d[0] for d in duplex),
           "d2h_duplex": statistics.median(d[1] for d in duplex)}
    del host_a, host_b, dev_a, dev_b
    return out


def transfer_bound(weights: int, state: int, bw: dict[str, float]) -> float | None:
    """Seconds: forward W/BW_h2d, backward max((W+S)/BW_h2d, (W+S)/BW_d2h), both directions at
    once."""
    if not bw["h2d"]:
        return None
    return weights / bw["h2d"] + max((weights + state) / bw["h2d_duplex"],
                                     (weights + state) / bw["d2h_duplex"])


class Variant:
    """One arm: a model, its swapper (if any) and its optimizers, stepped by :meth:`step`."""

    def __init__(self, name: str, model: nn.Module, loss: Callable[[nn.Module], torch.Tensor],
                 device: torch.device, swapper: BlockSwapper | None,
                 optimizers: list[torch.optim.Optimizer], sync_host: bool = False) -> None:
        self.name = name
        self.model = model
        self.loss = loss
        self.device = device
        self.swapper = swapper
        self.optimizers = optimizers
        self.sync_host = sync_host
        self.step_ms: list[float] = []
        self.losses: list[float] = []
        self.peak = 0

    def step(self, timed: bool) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        loss = self.loss(self.model)
        loss.backward()
        if self.sync_host and self.swapper is not None:
            self.swapper.sync_gradients()
        for opt in self.optimizers:
            opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.losses.append(float(loss.detach()))
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        if timed:
            self.step_ms.append(elapsed * 1e3)

    def result(self, steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "variant": self.name, "step_ms_p50": statistics.median(self.step_ms),
            "step_ms": self.step_ms, "first_loss": self.losses[0], "last_loss": self.losses[-1],
            "peak_gib": self.peak / GIB if self.device.type == "cuda" else None}
        if self.swapper is not None:
            s = self.swapper.stats()
            out.update(swapped_gib=s.swapped_bytes / GIB, state_gib=s.state_bytes / GIB,
                       pinned_gib=s.pinned_bytes / GIB, optimizer_steps=s.optimizer_steps,
                       h2d_gib_per_step=s.h2d_bytes / steps / GIB,
                       d2h_gib_per_step=s.d2h_bytes / steps / GIB)
        return out

    def close(self) -> None:
        for opt in self.optimizers:
            close = getattr(opt, "close", None)
            if close is not None:
                close()
        if self.swapper is not None:
            self.swapper.detach()
        self.optimizers = []
        self.model = None  # type: ignore[assignment]
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _fused(device: torch.device) -> dict[str, Any]:
    return {"fused": True} if device.type == "cuda" else {}


def adamw8bit(params: Any) -> torch.optim.Optimizer:
    return AdamW8bit(params, lr=LR)


# -- the 906 M stack ------------------------------------------------------------------------


def stack_variant(kind: str, swapped: int, args: argparse.Namespace,
                  device: torch.device) -> Variant:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TransformerStack(args.blocks, args.hidden, args.heads, args.rank, dtype,
                             torch.device("cpu"))
    model.requires_grad_(True)  # full fine-tuning: every weight trains
    if args.ckpt:
        enable_gradient_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(device, dtype)

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).float().square().mean()

    n = args.blocks
    if kind == "resident":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **_fused(device))
        return Variant("resident", model, loss, device, None, [opt])
    if kind == "cpu":
        swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=n - swapped,
                                                        trainable="cpu"), device=device)
        opt = CPUOffloadOptimizer(swapper.optimizer_parameters(), torch.optim.AdamW,
                                  overlap=False, lr=LR)
        return Variant(f"cpu_{swapped}/{n}", model, loss, device, swapper, [opt], True)
    eight = kind == "swap8"

    def factory(params: Any) -> torch.optim.Optimizer:
        if eight:
            return adamw8bit(params)
        return torch.optim.AdamW(params, lr=LR, **_fused(device))

    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=n - swapped,
                                                    trainable="swap"),
                           device=device, optimizer=factory)
    own = factory(swapper.optimizer_parameters())
    return Variant(f"{kind}_{swapped}/{n}", model, loss, device, swapper,
                   [own, swapper.optimizer])


def run_stack(args: argparse.Namespace, device: torch.device) -> tuple[list[dict[str, Any]],
                                                                      dict[str, Any]]:
    n = args.blocks
    specs = [("resident", 0), ("cpu", n // 2), ("swap", n // 2), ("swap8", n // 2),
             ("cpu", n), ("swap", n), ("swap8", n)]
    variants = [stack_variant(kind, s, args, device) for kind, s in specs]
    for i in range(args.warmup + args.steps):  # alternating rounds
        for v in variants:
            v.step(timed=i >= args.warmup)
        log(f"round {i + 1}/{args.warmup + args.steps}: "
            + ", ".join(f"{v.name} {v.step_ms[-1]:.0f} ms" if v.step_ms else v.name
                        for v in variants))
    bw = bandwidth(device)
    results = []
    for v in variants:
        r = v.result(args.warmup + args.steps)
        if v.swapper is not None and v.name.startswith("swap"):
            s = v.swapper.stats()
            bound = transfer_bound(s.swapped_bytes, s.state_bytes, bw)
            r["transfer_bound_ms"] = bound * 1e3 if bound else None
        results.append(r)
        v.close()
    params = sum(p.numel() for p in TransformerStack(
        args.blocks, args.hidden, args.heads, args.rank, torch.float32,
        torch.device("meta")).parameters())
    return results, {"params": params, "bandwidth": bw}


# -- Flux-12B -------------------------------------------------------------------------------


def flux_child(kind: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from plan import fill_random, real_inputs
    from vramkit.recipes.targets import build_target

    torch.backends.cuda.enable_cudnn_sdp(False)  # illegal memory access on these shapes (2.11)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_per_process_memory_fraction(
            args.cap_gib * GIB / torch.cuda.get_device_properties(device).total_memory, device)
    tiny = device.type == "cpu"
    if tiny:
        from plan import tiny_folder

        target = build_target(tiny_folder("flux"), lora_rank=0, resolution=64, seq_len=8)
    else:
        target = build_target("flux-dev", lora_rank=0)
    model = target.model
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # Random weights drawn on the device one top-level child at a time, kept on the CPU (the
    # CPU's normal_ took 400 s for 11.9 B bf16 values; the device takes seconds).
    for child in model.children():
        child.to_empty(device=device)
        fill_random(child)
        child.to("cpu")
    model.to_empty(device=torch.device("cpu"), recurse=False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model.requires_grad_(True)
    build_s = time.perf_counter() - t0
    if kind != "planned":  # the plan chooses its own checkpointing
        enable_gradient_checkpointing(model)
    inputs = real_inputs(target.inputs, device, None, 0)
    params = sum(p.numel() for p in model.parameters())
    rss0 = host_rss()

    def loss(m: nn.Module, batch: dict[str, Any] | None = None) -> torch.Tensor:
        batch = inputs if batch is None else batch
        kind_of = next(iter(batch.values())).device.type  # the planner traces on meta
        with torch.autocast(kind_of, dtype=torch.bfloat16, enabled=kind_of == "cuda"):
            out = m(**batch, return_dict=False)[0]
        return out.float().square().mean()

    t0 = time.perf_counter()
    planned: dict[str, Any] = {}
    if kind == "planned":
        import vramkit

        options: dict[str, Any] = {} if device.type == "cuda" else {"hardware": "rtx4090"}
        fitted = vramkit.fit(model, inputs, int(args.cap_gib * GIB), device=device,
                             trainable="swap", optimizer=adamw8bit, autocast=None,
                             step=loss, **options)
        plan = fitted.plan
        planned = {"plan_swapped": len(plan.swapped), "plan_blocks": len(plan.block_order),
                   "plan_checkpointed": len(plan.checkpointed),
                   "predicted_step_ms": plan.predicted_step_seconds * 1e3,
                   "predicted_peak_gib": plan.predicted_peak_bytes / GIB,
                   "explain": plan.explain()}
        log(plan.explain())
        if fitted.swapper is None:
            raise SystemExit(f"the plan swaps nothing under {args.cap_gib} GiB: a smaller "
                             "--cap-gib")
        swapper = fitted.swapper
        optimizers: list[Any] = [adamw8bit(swapper.optimizer_parameters()), swapper.optimizer]
        sync_host = False
    elif kind.startswith("swap8"):  # "swap8" (R=2, the default) or "swap8-rN": N slots
        slots = int(kind.split("-r")[1]) if "-r" in kind else 2
        swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=0, trainable="swap",
                                                        num_slots=slots),
                               device=device, optimizer=adamw8bit)
        optimizers = [adamw8bit(swapper.optimizer_parameters()), swapper.optimizer]
        sync_host = False
    else:
        swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=0, trainable="cpu"),
                               device=device)
        resident = [p for p in swapper.optimizer_parameters()
                    if p.device.type == device.type]
        optimizers = [adamw8bit(resident), AdamW8bit(swapper.host_parameters(), lr=LR)]
        sync_host = True
    attach_s = time.perf_counter() - t0
    variant = Variant(kind, model, loss, device, swapper, optimizers, sync_host)
    steps = args.cpu_steps if kind == "cpu8" else args.steps
    for i in range(args.warmup + steps):
        variant.step(timed=i >= args.warmup)
        log(f"{kind} step {i + 1}: {variant.losses[-1]:.5f}, "
            f"{variant.step_ms[-1] if variant.step_ms else float('nan'):.0f} ms")
    result = variant.result(args.warmup + steps)
    s = swapper.stats()
    bw = bandwidth(device)
    bound = transfer_bound(s.swapped_bytes, s.state_bytes, bw)
    result.update(params=params, build_s=build_s, attach_s=attach_s, bandwidth=bw,
                  transfer_bound_ms=bound * 1e3 if bound else None,
                  host_rss_gib=host_rss() / GIB, host_rss_before_attach_gib=rss0 / GIB,
                  host_state_and_weights_gib=(s.swapped_bytes + s.state_bytes) / GIB,
                  num_slots=swapper.config.num_slots, state_prefetched=s.state_prefetched,
                  slot_gib=(s.slot_bytes + s.state_slot_bytes) / GIB, **planned)
    return result


def run_flux(args: argparse.Namespace, device: torch.device) -> tuple[list[dict[str, Any]],
                                                                     dict[str, Any]]:
    results = []
    Path(args.out or ".").mkdir(parents=True, exist_ok=True)
    for kind in args.flux_variants.split(","):
        out = Path(args.out or ".") / f"flux-{kind}.json"
        cmd = [sys.executable, __file__, "--child", kind, "--child-out", str(out),
               "--device", str(device), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--cpu-steps", str(args.cpu_steps), "--cap-gib",
               str(args.cap_gib)]
        log(f"flux {kind}: {' '.join(cmd[1:])}")
        done = subprocess.run(cmd, env=os.environ.copy(), timeout=args.child_timeout)
        if done.returncode != 0 or not out.exists():
            results.append({"variant": kind, "error": f"child exited {done.returncode}"})
            continue
        results.append(json.loads(out.read_text(encoding="utf-8")))
    return results, {"cap_gib": args.cap_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=("stack", "flux"), default="stack")
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--blocks", type=int, default=None, help="blocks (default 8)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 3072)")
    parser.add_argument("--heads", type=int, default=None, help="heads (default 24)")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank of the stack (trained too)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens (default 4096)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ckpt", action="store_true", help="gradient checkpointing on")
    parser.add_argument("--cap-gib", type=float, default=23.5, help="Flux: the simulated card")
    parser.add_argument("--cpu-steps", type=int, default=1,
                        help="Flux: timed steps of the (slow) trainable='cpu' variant")
    parser.add_argument("--flux-variants", default="swap8,cpu8",
                        help="swap8 (2 slots), swap8-rN (N slots), cpu8, planned (vramkit.fit)")
    parser.add_argument("--child-timeout", type=float, default=1800)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    small = args.quick or device.type == "cpu"
    defaults = {"blocks": 4 if small else 8, "hidden": 128 if device.type == "cpu" else 3072,
                "heads": 4 if device.type == "cpu" else 24,
                "tokens": 64 if device.type == "cpu" else 4096, "steps": 2 if small else 5}
    fill_defaults(args, defaults)
    if args.child:
        result = flux_child(args.child, args, device)
        Path(args.child_out).write_text(json.dumps(result), encoding="utf-8")
        return
    if args.model == "stack":
        results, extra = run_stack(args, device)
        base = results[0]["step_ms_p50"]
    else:
        results, extra = run_flux(args, device)
        base = None
    rows = []
    swap_steps = [r["step_ms_p50"] for r in results
                  if r["variant"].startswith("swap8") and "step_ms_p50" in r]
    cpu_by_n = {r["variant"].split("_")[-1]: r["step_ms_p50"] for r in results
                if r["variant"].startswith("cpu") and "step_ms_p50" in r}
    for r in results:
        if "error" in r:
            rows.append({"variant": r["variant"], "error": r["error"]})
            continue
        ms = r["step_ms_p50"]
        bound = r.get("transfer_bound_ms")
        cpu = cpu_by_n.get(r["variant"].split("_")[-1]) if args.model == "stack" else (
            next((x["step_ms_p50"] for x in results if x["variant"] == "cpu8"
                  and "step_ms_p50" in x), None))
        row = {"variant": r["variant"], "step ms": ms,
               "x resident": ms / base if base else None,
               "transfer bound ms": bound,
               "x transfer bound": ms / bound if bound else None,
               "slots": r.get("num_slots"), "states prefetched": r.get("state_prefetched"),
               "cpu / this": cpu / ms if cpu and not r["variant"].startswith("cpu") else None,
               # Stack variants share one process: their peak is the process's, not theirs.
               "peak GiB": r["peak_gib"] if args.model == "flux" else None,
               "pinned / (W+S)": (r["pinned_gib"] / (r["swapped_gib"] + r["state_gib"])
                                  if r.get("swapped_gib") else None),
               "loss first->last": f"{r['first_loss']:.5f}->{r['last_loss']:.5f}"}
        if r["variant"] == "planned":
            row.update({"plan": f"{r['plan_swapped']}/{r['plan_blocks']} swapped, "
                                f"{r['plan_checkpointed']} ckpt",
                        "predicted ms": r["predicted_step_ms"],
                        "step err": ms / r["predicted_step_ms"] - 1,
                        "predicted peak GiB": r["predicted_peak_gib"],
                        "vs best": ms / min(swap_steps) if swap_steps else None})
        rows.append(row)
        print(json.dumps(row), flush=True)
    document = {"config": {**vars(args), "out": str(args.out), "device": str(device), **extra},
                "results": results}
    write_result(f"swap_full_ft_{args.model}", document, rows, args.out)


if __name__ == "__main__":
    main()
