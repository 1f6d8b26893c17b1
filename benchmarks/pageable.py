"""Pageable masters (``host_memory="pageable"``) against pinned ones: FLUX.1-dev LoRA under a
simulated 12 GB card, each mode with the plan made for it, alternating rounds in one process.

Target row: "pageable mode, pinned pool 2 GiB, FLUX LoRA 11.5 GiB: step <= 1.10x the pinned
mode; pinned bytes <= 2 GiB + slots".

What runs: FLUX.1-dev's transformer from its published config (random bf16 weights, 11.9 B
parameters), peft LoRA r16 on ``to_q, to_k, to_v, to_out.0``, 1024x1024, batch 1, bf16
autocast, AdamW on the adapters (the model and step of ``benchmarks/plan.py``). It is built once
on the GPU and copied to two host models. ``vramkit.plan`` plans each for the cap (this GPU
calibrated once): the first with ``host_memory="pinned"``, the second with
``host_memory="pageable"`` and a ``--pool`` staging pool, whose slower copies the planner prices
(fewer blocks swapped, or compressed ones) -- what a user of each mode gets; ``--same-plan``
applies the pinned plan to both instead (only where the masters live differs). ``vramkit.fit``
applies them; both stay attached; the arms alternate in ABBA rounds (``--steps`` steps per turn,
the first of each turn untimed), each under the card's cap (``set_per_process_memory_fraction``
to what the other arm holds plus the cap, as ``benchmarks/plan.py`` simulates a card).

The timed rounds run PyTorch's default (fast, nondeterministic) kernels. After them, both arms'
adapters are set back to the same values and each runs ``--check-steps`` steps with
deterministic kernels: the losses must be equal (swapping, checkpointing and staging never change
the math; with the default kernels the attention backward's atomics make two runs of one model
differ in the last bits).

Printed: the median step of each arm, pageable / pinned with the spread of the per-round ratios,
each arm's predicted step against its measured one, the pageable arm's pinned bytes against pool
+ slots, whether the checked losses are equal, and the host memcpy rate.

cuDNN's SDPA backend is disabled (it crashed on FLUX shapes with torch 2.11 on Hopper:
docs/architecture.md).

Run (GPU, ~3 min on an H200):  PYTHONPATH=src python3 benchmarks/pageable.py --out out/pageable
Run (CPU, code paths only):    PYTHONPATH=src python3 benchmarks/pageable.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, deterministic_kernels, write_result
from _timing import log
from plan import (
    GIB,
    Arm,
    Card,
    Settings,
    alternate,
    copy_to,
    materialize,
    meta_target,
    real_inputs,
    train_arm,
    warm,
)
from vramkit.devices.resolve import resolve_device

TARGET_RATIO = 1.10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny FLUX (CPU code paths)")
    parser.add_argument("--cap", type=float, default=11.5, help="the card, GiB (default 11.5)")
    parser.add_argument("--pool", default="2GiB", help="pinned staging pool (default 2GiB)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    parser.add_argument("--check-steps", type=int, default=2,
                        help="deterministic steps per arm for the loss check (default 2)")
    parser.add_argument("--same-plan", action="store_true",
                        help="run the pinned plan in both arms (default: each mode's own plan)")
    args = parser.parse_args(argv)

    import vramkit
    from vramkit.offload.swap.staged import measure_memcpy_bytes_per_s
    from vramkit.planning import calibrate_blocks

    torch.backends.cuda.enable_cudnn_sdp(False)
    deterministic_kernels(False)  # cuBLAS's workspace fixed now, for the later loss check
    s = Settings(device=args.device, tiny=args.tiny, rounds=args.rounds,
                 steps_per_arm=args.steps)
    device = resolve_device(s.device, owner="benchmarks/pageable.py")
    t0 = time.perf_counter()
    target = meta_target("flux", s)
    step = target.step
    twin = materialize(target, device, s.seed)
    hosts = [copy_to(twin, meta_target("flux", s).model, torch.device("cpu")) for _ in range(2)]
    inputs = real_inputs(target.inputs, device, None, s.seed + 1)
    del twin
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"built FLUX and two host copies in {time.perf_counter() - t0:.1f} s")

    options: dict[str, Any] = {"step": step}
    if device.type != "cuda":
        options["hardware"] = "rtx4090"
    else:
        options["block_times"] = calibrate_blocks(hosts[0], inputs, step=step, device=device)
    if args.tiny:
        weights = sum(t.numel() * t.element_size() for t in hosts[0].parameters())
        budget = int(weights * 0.6)
        options["headroom"] = 0.05
    else:
        budget = int(args.cap * GIB)
    plan = vramkit.plan(hosts[0], inputs, budget, host_memory="pinned", **options)
    priced = vramkit.plan(hosts[0], inputs, budget, host_memory="pageable",
                          staging_pool=args.pool, **options)
    pool = vramkit.parse_size(args.pool)
    pageable_plan = priced
    if args.same_plan:
        pageable_plan = dataclasses.replace(
            plan, host_memory="pageable", staging_pool_bytes=pool,
            host_memory_reason="the benchmark compares it with pinned")
    for name, p in (("pinned", plan), ("pageable", pageable_plan)):
        log(f"{name} plan: {describe(p)}")
    initial = {n: t.detach().to("cpu", copy=True)
               for n, t in hosts[0].named_parameters() if t.requires_grad}

    card = Card(device, budget)
    pinned_arm, reset_a = train_arm("pinned", hosts[0], inputs, target.family, device, True)
    pageable_arm, reset_b = train_arm("pageable", hosts[1], inputs, target.family, device, True)
    fitted: dict[str, Any] = {}
    try:
        t1 = time.perf_counter()
        warm(card, pinned_arm, lambda: fitted.setdefault("pinned", vramkit.fit(
            hosts[0], inputs, budget, plan=plan, device=device, host_memory="pinned")))
        attach_pinned = time.perf_counter() - t1
        t1 = time.perf_counter()
        warm(card, pageable_arm, lambda: fitted.setdefault("pageable", vramkit.fit(
            hosts[1], inputs, budget, plan=pageable_plan, device=device)))
        attach_pageable = time.perf_counter() - t1
        swappers = {k: f.swapper for k, f in fitted.items()}
        assert swappers["pageable"].host_memory.mode == "pageable"
        for sw in swappers.values():
            sw.reset_stats()
        alternate(card, (pageable_arm, pinned_arm), s)
        stats = {k: sw.stats() for k, sw in swappers.items()}
        checked = check_losses(card, ((pinned_arm, hosts[0], reset_a),
                                      (pageable_arm, hosts[1], reset_b)),
                               initial, args.check_steps)
    finally:
        card.release()
        for f in fitted.values():
            f.detach()
        reset_a()
        reset_b()

    per_round = [statistics.median(pageable_arm.seconds[i:i + s.steps_per_arm - 1]) /
                 statistics.median(pinned_arm.seconds[i:i + s.steps_per_arm - 1])
                 for i in range(0, len(pinned_arm.seconds), max(1, s.steps_per_arm - 1))]
    pinned_s = statistics.median(pinned_arm.seconds)
    pageable_s = statistics.median(pageable_arm.seconds)
    ratio = pageable_s / pinned_s
    pg = stats["pageable"]
    bound = pool + pg.slot_bytes
    memcpy = measure_memcpy_bytes_per_s()
    row = {
        "model": "flux-tiny" if args.tiny else "flux-dev", "cap_gib": args.cap,
        "plan": describe(plan), "pageable_plan": describe(pageable_plan),
        "same_plan": args.same_plan,
        "pinned_step_s": pinned_s, "pageable_step_s": pageable_s, "ratio": ratio,
        "ratio_min": min(per_round), "ratio_max": max(per_round),
        "target_ratio": TARGET_RATIO, "meets_ratio": ratio <= TARGET_RATIO,
        "pageable_pinned_bytes": pg.pinned_bytes, "staging_pool_bytes": pg.staging_pool_bytes,
        "slot_bytes": pg.slot_bytes, "pinned_bound_bytes": bound,
        "meets_pinned_bound": pg.pinned_bytes <= bound,
        "pinned_arm_pinned_bytes": stats["pinned"].pinned_bytes,
        "staged_copies": pg.staged_copies, "staged_copy_bytes": pg.staged_copy_bytes,
        "staged_chunk_waits": pg.staged_chunk_waits,
        "losses_equal": checked[0] == checked[1], "checked_losses": checked,
        "memcpy_gb_s": memcpy / 1e9,
        "predicted_pinned_s": plan.predicted_step_seconds,
        "predicted_pageable_s": pageable_plan.predicted_step_seconds,
        "predicted_ratio": (pageable_plan.predicted_step_seconds
                            / plan.predicted_step_seconds),
        # measured / predicted - 1, as benchmarks/plan.py reports it (+: slower than predicted)
        "pinned_prediction_error": pinned_s / plan.predicted_step_seconds - 1,
        "pageable_prediction_error": pageable_s / pageable_plan.predicted_step_seconds - 1,
        "attach_pinned_s": attach_pinned, "attach_pageable_s": attach_pageable,
    }
    print(f"pageable / pinned step: {ratio:.3f}x (rounds {min(per_round):.3f}-"
          f"{max(per_round):.3f}; target <= {TARGET_RATIO:.2f}x: "
          f"{'met' if row['meets_ratio'] else 'NOT met'}); "
          f"pinned {pinned_s * 1e3:.0f} ms, pageable {pageable_s * 1e3:.0f} ms")
    print(f"pageable arm pins {vramkit.format_size(pg.pinned_bytes)} <= pool "
          f"{vramkit.format_size(pool)} + slots {vramkit.format_size(pg.slot_bytes)}: "
          f"{row['meets_pinned_bound']} (pinned arm: "
          f"{vramkit.format_size(stats['pinned'].pinned_bytes)}); losses equal: "
          f"{row['losses_equal']} ({args.check_steps} deterministic steps per arm); "
          f"predicted ratio {row['predicted_ratio']:.3f}x; prediction errors pinned "
          f"{row['pinned_prediction_error']:+.1%}, pageable {row['pageable_prediction_error']:+.1%}")
    markdown = {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()
                if k in ("model", "cap_gib", "plan", "pageable_plan", "pinned_step_s",
                         "pageable_step_s", "ratio", "ratio_min", "ratio_max",
                         "pageable_pinned_bytes", "pinned_bound_bytes", "losses_equal",
                         "pinned_prediction_error", "pageable_prediction_error")}
    write_result("pageable", {"row": row, "pinned_seconds": pinned_arm.seconds,
                              "pageable_seconds": pageable_arm.seconds,
                              "explain": pageable_plan.explain(),
                              "pageable_plan_explain": priced.explain()}, [markdown], args.out)
    return 0 if row["losses_equal"] and row["meets_pinned_bound"] else 1


def describe(plan: Any) -> str:
    return (f"{len(plan.swapped)} of {len(plan.block_order)} swapped, "
            f"{len(plan.checkpointed)} ckpt, {plan.num_slots} slots"
            + (", compressed" if plan.compress_masters else ""))


def check_losses(card: Card, arms: tuple[tuple[Arm, torch.nn.Module, Any], ...],
                 initial: dict[str, torch.Tensor], steps: int) -> list[list[float]]:
    """Each arm from the same adapter values and a new optimizer, ``steps`` steps with
    deterministic kernels: their losses (equal when the two modes compute the same thing)."""
    deterministic_kernels(True)
    try:
        out = []
        for arm, model, reset in arms:
            with torch.no_grad():
                for n, t in model.named_parameters():
                    if n in initial:
                        t.copy_(initial[n])
            reset()  # the optimizer's state goes: a new one on the next step
            card.enter(arm.persistent, arm.capped)
            try:
                out.append([arm.run() for _ in range(steps)])
            finally:
                card.release()
        return out
    finally:
        deterministic_kernels(False)


if __name__ == "__main__":
    sys.exit(main())
