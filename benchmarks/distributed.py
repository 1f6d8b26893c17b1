"""Data-parallel Flux-12B LoRA training with swapping: weak scaling and host memory.

The job: FLUX.1-dev's transformer from its published config with random bf16 weights (11.9 B
parameters; benchmarks/plan.py builds it the same way), peft LoRA r16 on ``to_q, to_k, to_v,
to_out.0``, 1024x1024 (4096 image + 512 text tokens), batch 1 per GPU, bf16 autocast, AdamW on
the adapters, loss = the sum of the output. Every GPU is capped at ``--cap-gib`` (default 11.5
GiB: a 12 GB card) with ``torch.cuda.set_per_process_memory_fraction`` once the model is placed.

Arms (one ``torchrun`` job each, ``--nproc_per_node`` = the GPUs):

* ``vramkit``: ``vramkit.distributed.fit_rank`` (each rank plans its GPU with DDP's buckets
  counted, the ranks agree on one plan, the frozen masters live once per node in shared memory)
  then ``wrap_ddp``.
* ``vramkit-per-rank``: the same with every rank pinning its own masters (``shared=False``): the
  host memory that the shared masters save.
* ``vramkit-whole``: ``vramkit`` with every GPU copying whole blocks from the host
  (``uploads="whole"``), where ``vramkit`` (``uploads="auto"``) shares each block's copy
  between NVLink-linked GPUs and all-gathers the pieces (:mod:`vramkit.distributed.uploads`).
* ``fsdp2``: PyTorch's FSDP2, ``fully_shard`` per transformer block and the root with
  ``CPUOffloadPolicy()`` (sharded parameters in pinned host memory, all-gathered per block) and
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, every block checkpointed
  (``checkpoint_wrapper`` inside each FSDP unit) -- FSDP's answer to "the model does not fit
  one GPU".

Each job writes one JSON row: images/s over the job (the slowest rank's median step, the first
``--warmup`` steps left out), every rank's peak allocated bytes, and host memory: the swapped
bytes, the node-shared bytes, the sum of the ranks' proportional set sizes and of their
page-locked bytes. The driver (``--driver``) runs the arms for each GPU count in one invocation
on one machine and prints weak-scaling efficiency: images/s with N GPUs over N times images/s
with one.

Usage (on the GPU machine; cuDNN SDPA is off, see docs/architecture.md)::

    PYTHONPATH=src python3 benchmarks/distributed.py --driver --gpus 1,2,4 --arms vramkit,fsdp2 \
        --out $OUT/dist
    # CPU smoke test (gloo, tiny Flux):
    PYTHONPATH=src python3 benchmarks/distributed.py --driver --gpus 1,2 --tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

GIB = 1 << 30


def log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[distributed] {message}", file=sys.stderr, flush=True)


def _pinned_now() -> int:
    from vramkit.memory._segments import pinned_bytes

    return pinned_bytes()


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any, dict]:
    """The Flux target with random weights (the same on every rank), placed on ``device`` for
    the vramkit arm (fit copies the swapped blocks into host masters) or the CPU (FSDP2's
    offload policy shards from host memory)."""
    from plan import Settings, fill_random, meta_target, real_inputs

    s = Settings(device=str(device), tiny=args.tiny, seed=0)
    target = meta_target("flux", s)
    model = target.model
    # Drawn on the GPU when there is one (12 B random numbers take minutes on the CPU).
    local = int(os.environ.get("LOCAL_RANK", "0"))
    init = (torch.device("cuda", local) if torch.cuda.is_available() and not args.tiny
            else torch.device("cpu"))
    model.to_empty(device=init)
    torch.manual_seed(0)
    fill_random(model)
    if device.type != init.type:
        model.to(device)
    rank = int(os.environ.get("RANK", "0"))
    inputs = real_inputs(target.inputs, device, None, 1 + rank)  # each rank its own sample
    return model, target, inputs


def loss_of(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    out = model(**inputs, return_dict=False)[0]
    return out.float().sum()


def cap(device: torch.device, cap_bytes: int) -> None:
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    torch.cuda.reset_peak_memory_stats(device)


def arm_vramkit(args: argparse.Namespace, info: Any) -> dict[str, Any]:
    import vramkit.distributed as vd

    device = info.device
    t0 = time.perf_counter()
    model, target, inputs = build(args, device)
    built = time.perf_counter() - t0
    budget = int(args.cap_gib * GIB) if not args.tiny else None
    options: dict[str, Any] = {"step": target.step}
    if device.type != "cuda":
        options["hardware"] = "rtx4090"
    if args.tiny:
        options["headroom"] = 0.05
    if budget is None:  # tiny: above the planner's minimum by a third of the weights
        import vramkit
        from vramkit.errors import PlanError

        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        try:
            vramkit.plan(model, inputs, 1, **{"hardware": "rtx4090", **options})
            minimum = 0
        except PlanError as exc:
            minimum = int(exc.minimum_budget or 0)
        budget = minimum + weights // 3
    t1 = time.perf_counter()
    shared = args.arm != "vramkit-per-rank"  # that one: each rank pins its own masters
    uploads = "whole" if args.arm == "vramkit-whole" else "auto"
    fitted = vd.fit_rank(model, inputs, budget, device=device, shared=shared, uploads=uploads,
                         **options)
    fit_s = time.perf_counter() - t1
    plan = fitted.plan
    swapper = fitted.swapper
    if swapper is not None:
        ddp = vd.wrap_ddp(model, swapper)
    else:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index]
                                      if device.type == "cuda" else None)
    params = (swapper.optimizer_parameters() if swapper is not None
              else [p for p in model.parameters() if p.requires_grad])
    row = train(args, info, ddp, params, inputs, budget)
    stats = swapper.stats() if swapper is not None else None
    row.update({
        "arm": args.arm, "build_s": built, "fit_s": fit_s,
        "plan": {"swapped": len(plan.swapped), "blocks": len(plan.swapped) + len(plan.resident),
                 "checkpointed": len(plan.checkpointed), "slots": plan.num_slots,
                 "activation_offload": plan.activation_offload},
        "predicted_step_s": plan.predicted_step_seconds,
        "predicted_peak": plan.predicted_peak_bytes,
        "swapped_bytes": stats.swapped_bytes if stats is not None else 0,
        "shared_bytes": stats.shared_bytes if stats is not None else 0,
        "uploads": type(swapper.block_loader).__name__ if swapper is not None else None,
        "h2d_bytes": stats.h2d_bytes if stats is not None else 0,
        "gathered_bytes": stats.gathered_bytes if stats is not None else 0,
    })
    # No detach: the process ends here, and restoring the model to the GPU would not fit the cap.
    return row


def arm_fsdp2(args: argparse.Namespace, info: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = info.device
    t0 = time.perf_counter()
    model, _, inputs = build(args, torch.device("cpu") if device.type == "cuda" else device)
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    built = time.perf_counter() - t0
    # Activation checkpointing inside each FSDP unit (torch's checkpoint_wrapper, then
    # fully_shard, the order torchtitan uses); diffusers' own checkpointing around FSDP2 blocks
    # failed on the GPU with "Recomputed values ... have different metadata".
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for i in range(len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i])
    mesh = init_device_mesh(device.type, (info.world_size,))
    options: dict[str, Any] = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if device.type == "cuda":
        options["offload_policy"] = CPUOffloadPolicy()
    t1 = time.perf_counter()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        fully_shard(block, **options)
    fully_shard(model, **options)
    shard_s = time.perf_counter() - t1
    params = [p for p in model.parameters() if p.requires_grad]
    budget = int(args.cap_gib * GIB)
    row = train(args, info, model, params, inputs, budget)
    row.update({"arm": "fsdp2", "build_s": built, "fit_s": shard_s})
    return row


def train(args: argparse.Namespace, info: Any, model: nn.Module, params: list[nn.Parameter],
          inputs: dict[str, Any], budget: int) -> dict[str, Any]:
    import vramkit.distributed as vd

    device = info.device
    cap(device, budget)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    seconds: list[float] = []
    losses: list[float] = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    for _ in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        with autocast:
            loss = loss_of(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - begin)
        losses.append(float(loss.detach()))
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    slowest = times.cpu().tolist()
    median = statistics.median(slowest[args.warmup:])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    mine = {"peak": int(peak), "pss": vd.process_pss_bytes(), "pinned": _pinned_now(),
            "loss_first": losses[0]}
    ranks: list[Any] = [None] * info.world_size
    torch.distributed.all_gather_object(ranks, mine)
    pss = [r["pss"] for r in ranks]
    return {
        "gpus": info.world_size, "backend": info.backend, "cap_gib": args.cap_gib,
        "step_s": slowest, "median_step_s": median,
        "images_per_s": info.world_size * args.batch / median,
        "peak_bytes": [r["peak"] for r in ranks], "under_cap": all(
            r["peak"] <= budget for r in ranks) if device.type == "cuda" else None,
        "pss_bytes_sum": sum(pss) if all(p is not None for p in pss) else None,
        "pinned_bytes_sum": sum(r["pinned"] for r in ranks),
        "loss_first": [r["loss_first"] for r in ranks],
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def rank_main(args: argparse.Namespace) -> int:
    import vramkit.distributed as vd

    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper crash (docs/architecture.md)
    info = vd.init_from_env(backend="gloo" if args.device == "cpu" else None)
    try:
        row = arm_fsdp2(args, info) if args.arm == "fsdp2" else arm_vramkit(args, info)
        if info.is_main:
            Path(args.result).write_text(json.dumps(row))
    finally:
        vd.shutdown()
    return 0


def driver(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"),
               PYTHONUNBUFFERED="1")
    # GPU counts outer, arms inner: the arms of one count run back to back.
    for gpus in (int(g) for g in args.gpus.split(",")):
        for arm in args.arms.split(","):
            result = out / f"{arm}-{gpus}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={gpus}", __file__, "--arm", arm, "--result",
                       str(result), "--cap-gib", str(args.cap_gib), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--device", args.device]
            if args.tiny:
                command.append("--tiny")
            log(f"{arm} on {gpus}: {' '.join(command[3:])}")
            t0 = time.perf_counter()
            done = subprocess.run(command, env=env, timeout=args.timeout, check=False)
            if done.returncode != 0 or not result.exists():
                rows.append({"arm": arm, "gpus": gpus, "error": f"exit {done.returncode}"})
                log(f"{arm} on {gpus} failed (exit {done.returncode})")
                continue
            row = json.loads(result.read_text())
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            (out / "rows.json").write_text(json.dumps(rows, indent=1))
            log(json.dumps({k: row[k] for k in ("arm", "gpus", "median_step_s", "images_per_s",
                                                "peak_bytes", "pss_bytes_sum", "uploads",
                                                "h2d_bytes", "gathered_bytes",
                                                "pinned_bytes_sum") if k in row}))
    one = {r["arm"]: r["images_per_s"] for r in rows if r.get("gpus") == 1 and "images_per_s" in r}
    print("| arm | GPUs | step ms | images/s | weak scaling | peak GiB (max rank) | swapped GiB "
          "| shared GiB | pinned GiB (node) | PSS GiB (node) | host->device GB / rank / step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['arm']} | {r['gpus']} | failed: {r['error']} | | | | | | | | |")
            continue
        # SwapStats.h2d_bytes counts every step run, warm-up included
        h2d = (f"{r['h2d_bytes'] / len(r['step_s']) / 1e9:.1f}" if r.get("h2d_bytes")
               else "-")
        # one GPU has nothing to share: vramkit-whole scales against vramkit's one-GPU row
        base = one.get(r["arm"]) or (one.get("vramkit") if r["arm"] == "vramkit-whole" else None)
        scaling = (f"{r['images_per_s'] / (r['gpus'] * base):.3f}" if base else "-")
        pss = r.get("pss_bytes_sum")
        print(f"| {r['arm']} | {r['gpus']} | {r['median_step_s'] * 1e3:.0f} | "
              f"{r['images_per_s']:.3f} | {scaling} | {max(r['peak_bytes']) / GIB:.2f} | "
              f"{r.get('swapped_bytes', 0) / GIB:.2f} | {r.get('shared_bytes', 0) / GIB:.2f} | "
              f"{r['pinned_bytes_sum'] / GIB:.2f} | "
              f"{'-' if pss is None else f'{pss / GIB:.2f}'} | {h2d} |")
    # vramkit against its baselines on the same GPU count (the arms of a count ran back to back)
    for gpus in sorted({r["gpus"] for r in rows if "error" not in r}):
        ours = next((r for r in rows if r["gpus"] == gpus and r["arm"] == "vramkit"
                     and "error" not in r), None)
        for other in (r for r in rows if r["gpus"] == gpus and r["arm"] != "vramkit"
                      and "error" not in r):
            if ours is None:
                continue
            line = (f"{gpus} GPU(s): vramkit / {other['arm']}: images/s "
                    f"{ours['images_per_s'] / other['images_per_s']:.2f}x")
            if ours.get("pss_bytes_sum") and other.get("pss_bytes_sum"):
                line += f", host memory (PSS) {ours['pss_bytes_sum'] / other['pss_bytes_sum']:.2f}x"
            print(line)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--driver", action="store_true", help="run the arms with torchrun")
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts (driver)")
    parser.add_argument("--arms", default="vramkit,fsdp2", help="arms (driver)")
    parser.add_argument("--out", default="out/distributed", help="results folder (driver)")
    parser.add_argument("--arm", choices=("vramkit", "vramkit-per-rank", "vramkit-whole", "fsdp2"),
                        default="vramkit")
    parser.add_argument("--result", default="distributed.json")
    parser.add_argument("--cap-gib", type=float, default=11.5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny Flux config (CPU smoke)")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    return driver(args) if args.driver else rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
