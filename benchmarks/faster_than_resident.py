"""Faster than resident: a FLUX.1-dev LoRA step fitted under a card's cap with 8-bit compute
(W8A8) and/or compiled blocks, against the resident bf16 model, in one process.

FLUX.1-dev's transformer from its published config (diffusers ``FluxTransformer2DModel``, 11.9 B
parameters, random bf16 weights), peft LoRA rank 16 on ``to_q``/``to_k``/``to_v``/``to_out.0``,
1024x1024 (4096 image tokens + 512 text tokens), batch 1, AdamW on the adapters, bf16 autocast;
models built as benchmarks/plan.py builds them (its ``Job``: one host copy that ``fit`` places, one
twin of the same values for the baseline).

Rows (one per run, chosen by flags):

* training (default): ``--budget 23.5 --mode M`` with M one of ``bf16-compile`` (blocks compiled,
  bf16), ``fp8`` / ``int8`` (every block's frozen linears as W8A8 layers, quantized before
  planning, so the planner times and places W8A8 blocks), ``fp8-compile`` / ``int8-compile``
  (both). ``vramkit.fit`` plans under the cap (calibrated on
  this GPU, compiled when the mode compiles) and runs capped (``set_per_process_memory_fraction``:
  it cannot go over). The baseline is the resident bf16 model, eager, checkpointed as the
  planner checkpoints it at an uncapped budget (this GPU's whole memory, planned offline from its
  profile). Warm-up: ``--warmup`` untimed steps per arm (compiling happens there), then
  ``--rounds`` paired rounds alternating the arms (ABBA), two steps a turn, the second timed.
  Printed: the median ratio fitted / resident and its spread over rounds (< 1: faster than
  resident), predicted vs measured step and peak, and whether the peak stayed under the cap.
* ``--infer``: one FLUX forward (no adapters, bf16, no_grad) at an 8 GiB cap (``--budget``),
  fitted as ``--mode`` says (default fp8 W8A8 blocks + compiled blocks:
  ``fit(mode="infer", compile=True)``; ``--mode bf16``: bf16 eager, the planner choosing whether
  to compress the swapped masters) against diffusers' block-level group offloading (``enable_group_offload(onload_device,
  offload_device="cpu", offload_type="block_level", num_blocks_per_group=1, use_stream=True)``),
  paired rounds; printed: ratio, both peaks (ours capped, theirs measured: ours must be at most
  theirs).
* ``--accuracy``: the first step's loss and the adapters' gradient of fp8 and int8 W8A8 against
  bf16 (resident, same weights and inputs): relative loss deviation and gradient cosine. The
  blocks' frozen Linears are converted (what a plan's 8-bit format converts); the model's
  edges (embedders, final norm and projection) stay bf16.

cuDNN's SDPA is disabled on CUDA (torch 2.11 + Hopper crashed on FLUX shapes).

Run (H200, each row ~2-4 min; one row per process):
  PYTHONPATH=src python3 benchmarks/faster_than_resident.py --budget 23.5 --mode fp8-compile
  PYTHONPATH=src python3 benchmarks/faster_than_resident.py --infer --budget 8
  PYTHONPATH=src python3 benchmarks/faster_than_resident.py --infer --budget 2 --mode bf16
  PYTHONPATH=src python3 benchmarks/faster_than_resident.py --accuracy
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/faster_than_resident.py --tiny
  --device cpu --mode fp8 --rounds 1 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan as plan_bench
from _common import add_common_args, write_result
from _timing import log

MODES = ("bf16", "bf16-compile", "fp8", "fp8-compile", "int8", "int8-compile")
GIB = 1 << 30


def _kind(mode: str) -> str | None:
    kind = mode.split("-")[0]
    return kind if kind in ("fp8", "int8") else None


def _quantize_blocks(job: plan_bench.Job, kind: str) -> int:
    """The host copy's blocks' frozen Linears as W8A8 ``kind`` layers (LoRA kept), each block
    quantized on the device and brought back: every block runs W8A8, whatever the planner would
    choose. Returns the layers replaced."""
    return _quantize_block_linears(job.host, kind, job.device, home=torch.device("cpu"))


def _quantize_block_linears(model: nn.Module, kind: str, device: torch.device,
                            home: torch.device | None = None) -> int:
    """``model``'s blocks' frozen Linears as W8A8 ``kind`` layers, quantized on ``device``
    (and moved back to ``home`` if given): what a plan's 8-bit format converts. The model's
    edges (embedders, final norm and projection) stay bf16, as in a fitted model."""
    from vramkit.offload.blocks import find_blocks
    from vramkit.quant.model import QuantizationConfig, quantize_model
    from vramkit.quant.w8a8 import W8A8Linear

    config = QuantizationConfig(kind, w8a8=True)
    for _, block in find_blocks(model):
        block.to(device)
        quantize_model(block, config)
        if home is not None:
            block.to(home)
    return sum(isinstance(m, W8A8Linear) for m in model.modules())


def _spread(mine: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    ratios = [a / b for a, b in zip(mine, theirs, strict=False)]
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": len(ratios)}


def _job(args: argparse.Namespace) -> plan_bench.Job:
    settings = plan_bench.Settings(device=args.device, tiny=args.tiny, rounds=args.rounds,
                                   steps_per_arm=2)
    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper: crashed on FLUX
    # Each block class's forward is compiled once per calling context, by the calibration's
    # copies too (timed eager-shaped variants, checkpointed, beside copies): more entries than
    # dynamo's default of 8 per code object, past which it would run the block eager unsaid.
    from torch._dynamo import config as dynamo_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
    t0 = time.perf_counter()
    job = plan_bench.Job("flux", settings)
    log(f"built FLUX ({'tiny' if args.tiny else 'FLUX.1-dev'}) in {time.perf_counter() - t0:.0f} s")
    return job


def _device_total(job: plan_bench.Job) -> int:
    if job.device.type == "cuda":
        return int(torch.cuda.get_device_properties(job.device).total_memory)
    return job.budget(24.0)  # the CPU plans for job.profile's card: at most its memory


def train_row(job: plan_bench.Job, args: argparse.Namespace) -> dict[str, Any]:
    import vramkit
    from vramkit.offload.checkpointing import (
        disable_gradient_checkpointing,
        enable_gradient_checkpointing,
    )

    budget = job.budget(args.budget)
    compile_mode = "default" if args.mode.endswith("compile") else None
    kind = _kind(args.mode)
    card = plan_bench.Card(job.device, budget)
    row: dict[str, Any] = {"mode": args.mode, "cap_gib": args.budget, "budget_bytes": budget}
    cuda = job.device.type == "cuda"
    # The baseline: resident, eager, checkpointed as planned for this GPU's whole memory.
    uncapped = vramkit.plan(job.host, job.inputs, _device_total(job), step=job.step,
                            hardware=job.profile, headroom=0.05 if args.tiny else None)
    base_ckpt = (enable_gradient_checkpointing(job.twin, list(uncapped.checkpointed))
                 if uncapped.checkpointed else [])
    row["baseline_checkpointed"] = len(base_ckpt)
    if kind is not None:
        row["w8a8_layers"] = _quantize_blocks(job, kind)
    t0 = time.perf_counter()
    options: dict[str, Any] = {"step": job.step, "compile": compile_mode}
    if not cuda:
        options["hardware"] = job.profile
    if args.tiny:
        options["headroom"] = 0.05
    planned = vramkit.plan(job.host, job.inputs, budget, device=job.device if cuda else None,
                           **options)
    row["plan_s"] = time.perf_counter() - t0
    row["plan"] = {"swapped": len(planned.swapped),
                   "blocks": len(planned.swapped) + len(planned.resident),
                   "checkpointed": len(planned.checkpointed), "slots": planned.num_slots,
                   "formats": sorted(set(planned.formats.values()))}
    row["explain"] = planned.explain()
    log(f"{args.mode} at {args.budget} GiB: {row['plan']}, planned in {row['plan_s']:.0f} s")
    resident, reset_r = plan_bench.train_arm("resident", job.twin, job.inputs, job.family,
                                             job.device, capped=False)
    fitted, reset_f = plan_bench.train_arm("fitted", job.host, job.inputs, job.family,
                                           job.device, capped=True)
    holder: dict[str, Any] = {}
    try:
        plan_bench.warm(card, resident)
        plan_bench.warm_more(card, resident, args.warmup - 1)
        t1 = time.perf_counter()
        plan_bench.warm(card, fitted, lambda: holder.setdefault("fitted", vramkit.fit(
            job.host, job.inputs, budget, plan=planned, device=job.device,
            compile=compile_mode or False)))
        plan_bench.warm_more(card, fitted, args.warmup - 1)
        row["attach_and_warmup_s"] = time.perf_counter() - t1
        plan_bench.alternate(card, (fitted, resident), job.s)
    finally:
        card.release()
        if "fitted" in holder:
            holder["fitted"].detach()
        if base_ckpt:
            disable_gradient_checkpointing(job.twin, base_ckpt)
        reset_r()
        reset_f()
    row.update(_spread(fitted.seconds, resident.seconds))
    row["fitted_s"] = statistics.median(fitted.seconds)
    row["resident_s"] = statistics.median(resident.seconds)
    row["predicted_step_s"] = planned.predicted_step_seconds
    row["predicted_peak"] = planned.predicted_peak_bytes
    row["fitted_peak"], row["resident_peak"] = fitted.peak, resident.peak
    row["under_cap"] = fitted.peak <= budget if cuda else None
    row["first_loss"], row["resident_first_loss"] = fitted.first_loss, resident.first_loss
    return row


def infer_row(job: plan_bench.Job, args: argparse.Namespace) -> dict[str, Any]:
    import vramkit

    budget = job.budget(args.budget)
    card = plan_bench.Card(job.device, budget)
    cuda = job.device.type == "cuda"
    kind = _kind(args.mode)
    compile_mode = "default" if args.mode.endswith("compile") else None
    row: dict[str, Any] = {"mode": f"infer {args.mode} vs diffusers group offload",
                           "cap_gib": args.budget, "budget_bytes": budget}
    for model in (job.host, job.twin):
        if hasattr(model, "peft_config"):
            model.delete_adapters(list(model.peft_config))
    job.twin.to("cpu")  # the diffusers arm's copy
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    inputs = job.inputs
    if kind is not None:
        row["w8a8_layers"] = _quantize_blocks(job, kind)
    options: dict[str, Any] = {"compile": compile_mode}
    if not cuda:
        options["hardware"] = job.profile
    if args.tiny:
        options["headroom"] = 0.05
    t0 = time.perf_counter()
    planned = vramkit.plan(job.host, inputs, budget, mode="infer", autocast=None,
                           device=job.device if cuda else None, **options)
    row["plan_s"] = time.perf_counter() - t0
    row["plan"] = {"swapped": len(planned.swapped),
                   "blocks": len(planned.swapped) + len(planned.resident),
                   "slots": planned.num_slots, "split": planned.split,
                   "compressed": bool(planned.compress_masters),
                   "formats": sorted(set(planned.formats.values()))}
    row["explain"] = planned.explain()
    holder: dict[str, Any] = {}
    try:
        mine, theirs = plan_bench.against_group_offload(
            card, job.host, job.twin, inputs, lambda: holder.setdefault("fitted", vramkit.fit(
                job.host, inputs, budget, plan=planned, device=job.device,
                compile=compile_mode or False)), job.s, warmup=args.warmup)
    finally:
        if "fitted" in holder:
            holder["fitted"].detach()
    row.update(_spread(mine.seconds, theirs.seconds))
    row["fitted_s"], row["diffusers_s"] = (statistics.median(mine.seconds),
                                           statistics.median(theirs.seconds))
    row["predicted_step_s"] = planned.predicted_step_seconds
    row["predicted_peak"] = planned.predicted_peak_bytes
    row["fitted_peak"], row["diffusers_peak"] = mine.peak, theirs.peak
    row["peak_at_most_diffusers"] = mine.peak <= theirs.peak if cuda else None
    row["under_cap"] = mine.peak <= budget if cuda else None
    return row


def _adapter_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for n, p in model.named_parameters()
                      if p.requires_grad and p.grad is not None])


def accuracy_row(job: plan_bench.Job, args: argparse.Namespace) -> dict[str, Any]:
    import copy

    def first_step(model: nn.Module) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(job.device.type, dtype=torch.bfloat16):
            loss = plan_bench.loss_of(model, job.inputs, job.family)
        loss.backward()
        grads = _adapter_grads(model)
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), grads

    row: dict[str, Any] = {"mode": "accuracy"}
    # LoRA B starts at zero: the adapters' A gets no gradient. Give B small values first, the
    # same in every copy, so both factors have gradients to compare.
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in job.twin.named_parameters():
            if p.requires_grad and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p) * 1e-3)
    loss_bf16, grads_bf16 = first_step(job.twin)
    row["loss_bf16"] = loss_bf16
    for kind in ("fp8", "int8"):
        quantized = copy.deepcopy(job.twin)
        row[f"w8a8_layers_{kind}"] = _quantize_block_linears(quantized, kind, job.device)
        loss, grads = first_step(quantized)
        row[f"loss_{kind}"] = loss
        row[f"loss_rel_dev_{kind}"] = abs(loss - loss_bf16) / max(abs(loss_bf16), 1e-12)
        row[f"grad_cosine_{kind}"] = float(torch.nn.functional.cosine_similarity(
            grads, grads_bf16, dim=0))
        row[f"grad_rel_error_{kind}"] = float((grads - grads_bf16).norm()
                                             / grads_bf16.norm().clamp_min(1e-30))
        del quantized
        gc.collect()
        if job.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _table(row: dict[str, Any]) -> list[dict[str, Any]]:
    if row["mode"] == "accuracy":
        return [{"kind": k, "first loss rel dev": f"{row[f'loss_rel_dev_{k}']:.2e}",
                 "adapter grad cosine": f"{row[f'grad_cosine_{k}']:.5f}",
                 "grad rel error": f"{row[f'grad_rel_error_{k}']:.3f}"} for k in ("fp8", "int8")]
    mib = 1 << 20
    theirs = "diffusers_s" if "diffusers_s" in row else "resident_s"
    their_peak = "diffusers_peak" if "diffusers_peak" in row else "resident_peak"
    return [{"row": row["mode"], "cap GiB": row["cap_gib"],
             "ours ms": f"{row['fitted_s'] * 1e3:.0f}",
             "baseline ms": f"{row[theirs] * 1e3:.0f}",
             "ratio (spread)": f"{row['ratio']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
             "predicted ms": f"{row['predicted_step_s'] * 1e3:.0f}",
             "peak MiB (predicted)": f"{row['fitted_peak'] / mib:.0f} "
                                     f"({row['predicted_peak'] / mib:.0f})",
             "baseline peak MiB": f"{row[their_peak] / mib:.0f}",
             "under cap": row.get("under_cap")}]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, default=None,
                        help="the cap in GiB (default 23.5 training, 8 --infer)")
    parser.add_argument("--mode", choices=MODES, default="fp8-compile")
    parser.add_argument("--infer", action="store_true", help="the inference row")
    parser.add_argument("--accuracy", action="store_true", help="the accuracy row")
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first")
    parser.add_argument("--tiny", action="store_true", help="a tiny FLUX (CPU code paths)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.infer and args.accuracy:
        parser.error("--infer and --accuracy are separate rows: run one per process")
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup take 1 or more")
    if args.budget is None:
        args.budget = 8.0 if args.infer else 23.5
    job = _job(args)
    if args.accuracy:
        row = accuracy_row(job, args)
    elif args.infer:
        row = infer_row(job, args)
    else:
        row = train_row(job, args)
    name = "faster_than_resident" + ("_accuracy" if args.accuracy else
                                     "_infer" if args.infer else f"_{args.mode}")
    write_result(name, {"row": row, "tiny": args.tiny}, _table(row), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
