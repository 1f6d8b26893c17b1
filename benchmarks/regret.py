"""The planner's regret: its plan against the hand plans one change away, all measured in one
process, turn by turn.

For one model and budget, ``vramkit.plan`` (calibrated on this GPU) makes a plan and
:func:`vramkit.planning.neighbours` the plans one change away from it -- one block more or fewer
swapped (the best such block by the planner's own prediction), one more or fewer checkpointed,
a slot more or fewer, activation offload on or off -- each priced by the same simulation. Each
plan is applied with ``vramkit.fit(plan=...)`` in turn (the order reversed every other round:
ABBA), runs one untimed step (the allocator's refill after the previous plan) and ``--steps``
timed ones under the card's cap, and is detached again. Printed per plan: predicted vs measured
step and peak; and the regret = the planner's measured step / the best measured step among the
plans that ran under the budget (1.00: no neighbour beat it), with its spread over rounds, and
the same against only the plans predicted to keep the planner's headroom (those it may choose
from; a neighbour that runs under the cap by using the headroom is not a plan it would make).

Models (``--model``): ``flux`` (FLUX.1-dev, LoRA r16 on the attention, 1024 px), ``llama8b``
(Llama-3.1-8B, LoRA r16, 4096 tokens), ``demo`` (the demo's DiT xl, LoRA), ``wan`` (Wan 2.1
T2V 14B, LoRA r16 on the attention projections, 480x832 at ``--frames`` frames, default 41 here
so that a round stays within the time; ``--frames 81`` is the published default). Weights are
random (bf16), built from the published configs (``vramkit.recipes.targets``).

``--wan-infer``: Wan inference instead: one forward (no adapters, bf16, no grad) at 480x832 x
``--frames`` (default 81) under ``--budget`` (default 8 GiB with this flag), ``vramkit.fit(mode=
"infer")`` against diffusers' block-level group offloading (``enable_group_offload(
offload_type="block_level", num_blocks_per_group=1, use_stream=True)``) of the same weights,
alternating; both peaks printed (ours capped, theirs measured: ours must be at most theirs).
``--compile`` runs our blocks ``torch.compile``d (planned with their times compiled) and
``--allow fp8-w8a8`` lets the plan multiply frozen weights in 8 bits; diffusers' arm stays bf16
eager, as its offloading runs. ``--fit-budget GiB`` plans ours for less than the card's cap
(both arms still run under ``--budget``): ours at diffusers' peak or below, for the row's
"at equal or lower peak".

``--video-row`` (or ``--wan-row``): the video row instead, for ``--model wan`` at 480x832 x
``--frames`` (default 81 with this flag) or ``--model hunyuan`` (HunyuanVideo 13B from its
published config, LoRA r16 on the attention projections, 544x960 x ``--frames``, default 33): the
fitted step under ``--budget`` against the same weights resident on the GPU with every block
checkpointed and no cap, alternating; the measured peak against the prediction (target: within
3 %) and the host memory the plan pins (masters + offloaded activations) against this
process's RSS growth. When no plan fits the budget, the row says so with the planner's minimum
and runs at that minimum rounded up to 0.5 GiB. ``--compile`` / ``--allow fp8-w8a8`` as for
``--wan-infer`` (ours compiled / multiplying frozen weights in 8 bits, calibrated so; the
resident arm stays bf16 eager).

cuDNN's SDPA backend is disabled (it crashed on Hopper with torch 2.11, docs/architecture.md).

Run (H200, each within ~6 min; the figures printed at the end):
    PYTHONPATH=src python3 benchmarks/regret.py --model flux --budget 11.5
    PYTHONPATH=src python3 benchmarks/regret.py --model llama8b --budget 11.5
    PYTHONPATH=src python3 benchmarks/regret.py --model demo --budget 4
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --budget 11.5 --rounds 1
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --wan-row --budget 11.5
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --wan-row --budget 11.5 --subblock
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --wan-row --budget 11.5 --subblock \
        --allow fp8-w8a8
    PYTHONPATH=src python3 benchmarks/regret.py --model hunyuan --video-row --budget 15.5
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --wan-infer --budget 8
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --wan-infer --budget 8 --compile
    PYTHONPATH=src python3 benchmarks/regret.py --model wan --wan-infer --budget 8 --compile \
        --allow fp8-w8a8 --fit-budget 5
Run (CPU, code paths only, seconds):
    PYTHONPATH=src python3 benchmarks/regret.py --model demo --tiny --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import log
from plan import Card, copy_to, fill_random, real_inputs, sync, tiny_folder, train_arm

GIB = 1 << 30
MODELS = ("flux", "llama8b", "demo", "wan", "hunyuan")
VIDEO = ("wan", "hunyuan")  # the models of the video row (--video-row)
#: Rounds and timed steps per turn by model: each model's run stays under ~4-6 min on an H200
#: (a turn is an attach, one untimed step, the timed ones and a detach). The demo's step is
#: host-bound and its single steps spread +-12 % on an H200: more of them, so that the median
#: of each plan moves less than the 3 % the regret is judged by.
DEFAULT_ROUNDS = {"flux": 2, "llama8b": 2, "demo": 5, "wan": 1, "hunyuan": 1}
DEFAULT_STEPS = {"flux": 2, "llama8b": 2, "demo": 5, "wan": 1, "hunyuan": 1}
#: HunyuanVideo's row: 33 frames at 544x960 (18,360 video tokens), a LoRA clip length people
#: train at on 16 GB cards (its pipeline's own 129 frames at 720x1280 need a 30 GiB budget).
HUNYUAN_FRAMES, HUNYUAN_RESOLUTION = 33, (544, 960)
TINY_WAN = {
    "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 2,
    "attention_head_dim": 16, "in_channels": 4, "out_channels": 4, "text_dim": 32,
    "freq_dim": 32, "ffn_dim": 128, "num_layers": 4, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 64,
}
TINY_HUNYUAN = {
    "_class_name": "HunyuanVideoTransformer3DModel", "in_channels": 4, "out_channels": 4,
    "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "num_single_layers": 2,
    "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 2, "patch_size_t": 1,
    "qk_norm": "rms_norm", "guidance_embeds": True, "text_embed_dim": 32,
    "pooled_projection_dim": 16, "rope_theta": 256.0, "rope_axes_dim": [4, 6, 6],
}


@dataclass
class Model:
    """One model built for the run: its host copy (what ``fit`` places), real inputs, the
    planner's step, and (``--wan-row``) a resident twin on the device."""

    name: str
    host: nn.Module
    inputs: Any
    step: Any
    family: str
    shapes: str
    twin: nn.Module | None = None


@dataclass
class Measured:
    """One plan's turns."""

    label: str
    plan: Any
    seconds: list[float] = field(default_factory=list)
    by_round: list[float] = field(default_factory=list)  # the median of each round's steps
    peak: int = 0
    error: str | None = None


# -- the models ----------------------------------------------------------------------------------


def _target(model: str, args: argparse.Namespace) -> Any:
    from vramkit.recipes.targets import build_target

    if model == "flux":
        name = tiny_folder("flux") if args.tiny else "flux-dev"
        options: dict[str, Any] = {"lora_targets": ("to_q", "to_k", "to_v", "to_out.0")}
        if args.tiny:
            options.update(resolution=64, seq_len=8)
        return build_target(name, **options)
    if model == "llama8b":
        name = tiny_folder("llama") if args.tiny else "llama-3.1-8b"
        return build_target(name, seq_len=64 if args.tiny else 4096)
    # the video models
    if args.tiny:
        folder = Path(tempfile.mkdtemp(prefix=f"vramkit-regret-{model}-"))
        config = TINY_WAN if model == "wan" else TINY_HUNYUAN
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return build_target(str(folder), frames=5, resolution=(32, 48), seq_len=8,
                            mode=_mode(args))
    if model == "hunyuan":
        return build_target("hunyuanvideo", frames=args.frames, resolution=HUNYUAN_RESOLUTION,
                            mode=_mode(args))
    return build_target("wan2.1-14b", frames=args.frames, mode=_mode(args))


def _mode(args: argparse.Namespace) -> str:
    return "infer" if getattr(args, "wan_infer", False) else "train"


def build(model: str, args: argparse.Namespace, device: torch.device) -> Model:
    """The model with random weights: made on the device (fast), copied to the host; the
    device copy kept only as the video row's resident baseline."""
    if model == "demo":
        return _demo(args, device)
    target = _target(model, args)
    target.model.to_empty(device=device)
    torch.manual_seed(args.seed)
    fill_random(target.model)
    twin = target.model
    host = copy_to(twin, _target(model, args).model, torch.device("cpu"))
    vocab = getattr(getattr(host, "config", None), "vocab_size", None)
    inputs = real_inputs(target.inputs, device, vocab, args.seed + 1)
    if not (args.wan_row or args.wan_infer):
        twin = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return Model(model, host, inputs, target.step, target.family, target.shapes, twin)


def _demo(args: argparse.Namespace, device: torch.device) -> Model:
    from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
    from vramkit.recipes.lora import add_lora_adapters

    config = DiTConfig.preset("tiny" if args.tiny else "xl")
    blocks = [f"double_blocks.{i}" for i in range(config.num_double_blocks)] + [
        f"single_blocks.{i}" for i in range(config.num_single_blocks)]
    torch.manual_seed(args.seed)
    host = DiT(config)  # in the preset's dtype (xl: bf16)
    add_lora_adapters(host, blocks, rank=16)
    batch = synthetic_batch(config, 1 if not args.tiny else 2, device=device)
    return Model("demo", host, batch, flow_matching_loss, "demo", f"DiT {config}")


# -- planning --------------------------------------------------------------------------------


def plan_with_neighbours(m: Model, budget: int, args: argparse.Namespace,
                         device: torch.device) -> tuple[Any, list[Any], dict[str, Any]]:
    """The planner's plan (this GPU measured and its blocks timed; offline on the CPU) and
    its neighbours, all priced on the same machine and block times."""
    import vramkit
    from vramkit.planning import analyze, calibrate_blocks, machine_for, meta_copy, neighbours

    t0 = time.perf_counter()
    options: dict[str, Any] = {"step": m.step}
    if m.family == "demo":
        options["autocast"] = None  # the DiT runs in bf16 as built
    if args.tiny:
        options["headroom"] = 0.05
    if args.ffn_chunks > 1:
        options["ffn_chunks"] = args.ffn_chunks
    if args.subblock:
        options["subblock_checkpoint"] = True
    formats = tuple(f for f in args.allow.split(",") if f)
    if formats:  # --wan-row: the plan may multiply frozen weights in 8 bits
        options["allow_formats"] = formats
    if args.compile:  # --wan-row: its blocks timed compiled, as fit will run them
        options["compile"] = "default"
    cuda = device.type == "cuda"
    machine = machine_for(None if cuda else "rtx4090", device if cuda else None)
    meta = meta_copy(m.host)
    if args.ffn_chunks > 1:  # as plan(ffn_chunks=) analyzes it
        from vramkit.offload.blocks import find_blocks
        from vramkit.offload.chunked import chunk_feed_forwards

        chunk_feed_forwards(meta, [n for n, _ in find_blocks(meta)], args.ffn_chunks)
    if args.subblock:  # as plan(subblock_checkpoint=True) analyzes and calibrates it
        from vramkit.offload.blocks import find_blocks
        from vramkit.offload.subblock import checkpoint_block_parts, uncheckpoint_parts

        checkpoint_block_parts(meta, [n for n, _ in find_blocks(meta)])
        checkpoint_block_parts(m.host, [n for n, _ in find_blocks(m.host)])
    cost = analyze(meta, m.inputs, mode="train", step=m.step,
                   autocast=options.get("autocast", torch.bfloat16))
    try:
        times = (calibrate_blocks(m.host, m.inputs, step=m.step, device=device,
                                  autocast=options.get("autocast", torch.bfloat16),
                                  formats=formats, compile=options.get("compile"))
                 if cuda else None)
    finally:
        if args.subblock:  # fit applies them as the plan says
            uncheckpoint_parts(m.host)
    if args.tiny:
        budget = _tiny_budget(m, cost, machine, options)
    try:
        plan = vramkit.plan(m.host, m.inputs, budget, hardware=machine, cost=cost,
                            block_times=times, **options)
        refused = None
    except vramkit.PlanError as exc:
        if not args.wan_row or exc.minimum_budget is None:
            raise
        refused = {"budget_bytes": budget, "minimum_budget_bytes": exc.minimum_budget,
                   "error": str(exc)}
        budget = math.ceil(exc.minimum_budget / (GIB // 2)) * (GIB // 2)
        log(f"no plan fits: {exc}; running at {budget / GIB:.1f} GiB instead")
        plan = vramkit.plan(m.host, m.inputs, budget, hardware=machine, cost=cost,
                            block_times=times, **options)
    found = [] if args.wan_row else neighbours(plan, cost, machine, times=times)
    info = {"plan_s": time.perf_counter() - t0, "machine": machine.name,
            "budget_bytes": budget, "refused": refused}
    return plan, found, info


def _tiny_budget(m: Model, cost: Any, machine: Any, options: dict[str, Any]) -> int:
    """--tiny: halfway between the planner's minimum and the whole model's bytes."""
    import vramkit

    weights = sum(t.numel() * t.element_size() for t in m.host.parameters())
    try:
        vramkit.plan(m.host, m.inputs, 1, hardware=machine, cost=cost, **options)
        low = 0
    except vramkit.PlanError as exc:
        low = int(exc.minimum_budget or 0)
    return int(low + max(weights * 1.5 - low, 0) / 2)


# -- measuring --------------------------------------------------------------------------------


def turn(m: Model, entry: Measured, budget: int, card: Card, steps: int,
         device: torch.device) -> None:
    """Apply ``entry``'s plan, one untimed step, ``steps`` timed, detach."""
    import vramkit
    from vramkit.observe.oom import is_oom_error

    arm, reset = train_arm(entry.label, m.host, m.inputs,
                           "causal-lm" if m.family == "causal-lm" else "diffusers", device,
                           capped=True)
    if m.family == "demo":
        arm.run = _demo_step(m, arm)
    others = card.enter(0, True)
    fitted = None
    times: list[float] = []
    try:
        fitted = vramkit.fit(m.host, m.inputs, budget, plan=entry.plan, device=device)
        arm.run()
        for _ in range(steps):
            sync(device)
            start = time.perf_counter()
            arm.run()
            sync(device)
            times.append(time.perf_counter() - start)
        entry.peak = max(entry.peak, card.peak_since(others))
    except Exception as exc:  # an OOM is a result: the plan does not fit this card
        if not is_oom_error(exc):
            raise
        entry.error = "out of memory"
        log(f"{entry.label}: out of memory")
    finally:
        card.release()
        if fitted is not None:
            fitted.detach()
        reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if times:
        entry.seconds += times
        entry.by_round.append(statistics.median(times))
        p = entry.plan  # the whole row in the log too: a run cut by its time box keeps it
        log(f"{entry.label}: {1e3 * statistics.median(times):.0f} ms (predicted "
            f"{1e3 * p.predicted_step_seconds:.0f}; {len(p.swapped)}/{len(p.checkpointed)}/"
            f"{p.num_slots}/{'y' if p.activation_offload else 'n'}; peak "
            f"{entry.peak / GIB:.2f} GiB, predicted {p.predicted_peak_bytes / GIB:.2f})")


def _demo_step(m: Model, arm: Any) -> Any:
    state: dict[str, Any] = {}

    def run() -> float:
        if "opt" not in state:
            state["opt"] = torch.optim.AdamW(
                [p for p in m.host.parameters() if p.requires_grad], lr=1e-4)
        loss = m.step(m.host, m.inputs)
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        return float(loss.detach())

    return run


def regret_run(m: Model, args: argparse.Namespace, device: torch.device
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from vramkit.planning import fits

    budget = int(args.budget * GIB)
    plan, found, info = plan_with_neighbours(m, budget, args, device)
    budget = info["budget_bytes"]
    entries = [Measured("planner", plan)] + [Measured(n.label, n.plan) for n in found]
    log(f"{m.name}: planned in {info['plan_s']:.1f} s; {len(found)} neighbours: "
        + ", ".join(n.label for n in found))
    card = Card(device, budget)
    rounds = args.rounds or (1 if args.tiny else DEFAULT_ROUNDS[m.name])
    steps = args.steps or (1 if args.tiny else DEFAULT_STEPS[m.name])
    for r in range(rounds):
        for entry in entries if r % 2 == 0 else entries[::-1]:
            if entry.error is None:
                turn(m, entry, budget, card, steps, device)
    ran = [e for e in entries if e.seconds and (device.type != "cuda" or e.peak <= budget)]
    mine = entries[0]
    rows, detail = [], []
    best = min((statistics.median(e.seconds) for e in ran), default=math.nan)
    for e in entries:
        measured = statistics.median(e.seconds) if e.seconds else math.nan
        row = {"plan": e.label,
               "swapped/ckpt/R/offload": f"{len(e.plan.swapped)}/{len(e.plan.checkpointed)}/"
                                         f"{e.plan.num_slots}/{'y' if e.plan.activation_offload else 'n'}",
               "predicted ms": e.plan.predicted_step_seconds * 1e3,
               "measured ms": measured * 1e3,
               "err %": 100 * (measured / e.plan.predicted_step_seconds - 1),
               "vs best": measured / best,
               "predicted GiB": e.plan.predicted_peak_bytes / GIB,
               "peak GiB": e.peak / GIB if device.type == "cuda" else math.nan,
               "fits (pred)": fits(e.plan),
               "note": e.error or ("" if e in ran else "over budget")}
        rows.append(row)
        detail.append({**row, "seconds": e.seconds, "by_round": e.by_round,
                       "explain": e.plan.explain()})
    regret = (statistics.median(mine.seconds) / best) if mine.seconds else math.nan
    # against the plans that keep the headroom the planner keeps (what it may choose from)
    kept = [statistics.median(e.seconds) for e in ran if fits(e.plan)]
    regret_kept = (statistics.median(mine.seconds) / min(kept)
                   if mine.seconds and kept else math.nan)
    # the regret's spread: per round, the planner's step over that round's best
    per_round = []
    for r in range(len(mine.by_round)):
        bests = [e.by_round[r] for e in ran if len(e.by_round) > r]
        if bests:
            per_round.append(mine.by_round[r] / min(bests))
    print(f"\n{m.name} ({m.shapes}) under {budget / GIB:.1f} GiB on {info['machine']}: "
          f"regret {regret:.3f} (per round {', '.join(f'{x:.3f}' for x in per_round)}), "
          f"{regret_kept:.3f} among the plans that keep the planner's headroom; "
          f"{len(ran)} of {len(entries)} plans ran under the budget")
    return {"model": m.name, "shapes": m.shapes, "budget_bytes": budget, "regret": regret,
            "regret_within_headroom": regret_kept, "regret_by_round": per_round,
            "plans": detail, **info}, rows


def wan_row(m: Model, args: argparse.Namespace, device: torch.device
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fitted under the budget vs the resident model with every block checkpointed, no cap."""
    import vramkit
    from plan import alternate, warm
    from vramkit.devices.host import read_host_memory
    from vramkit.offload.checkpointing import enable_gradient_checkpointing

    budget = int(args.budget * GIB)
    plan, _, info = plan_with_neighbours(m, budget, args, device)
    budget = info["budget_bytes"]
    log(plan.explain())
    assert m.twin is not None
    enable_gradient_checkpointing(m.twin)
    card = Card(device, budget)
    resident, reset_r = train_arm("resident-all-ckpt", m.twin, m.inputs, "diffusers", device,
                                  capped=False)
    fitted_arm, reset_f = train_arm("fitted", m.host, m.inputs, "diffusers", device,
                                    capped=True)
    holder: dict[str, Any] = {}
    rss_before = read_host_memory().process_rss
    try:
        warm(card, resident)
        warm(card, fitted_arm, lambda: holder.setdefault("fitted", vramkit.fit(
            m.host, m.inputs, budget, plan=plan, device=device, compile=args.compile)))
        rss_fitted = read_host_memory().process_rss
        settings = argparse.Namespace(rounds=args.rounds or 2, steps_per_arm=args.steps or 2)
        alternate(card, (fitted_arm, resident), settings)
    finally:
        card.release()
        if "fitted" in holder:
            holder["fitted"].detach()
        reset_r()
        reset_f()
    mine, theirs = (statistics.median(a.seconds) for a in (fitted_arm, resident))
    title = "Wan 2.1 14B" if m.name == "wan" else "HunyuanVideo 13B"
    row = {"row": f"{title} LoRA {m.shapes}", "budget GiB": budget / GIB,
           "plan": f"{len(plan.swapped)}/{len(plan.block_order)} swapped, "
                   f"{len(plan.checkpointed)} ckpt, R={plan.num_slots}, "
                   f"offload {'on' if plan.activation_offload else 'off'}"
                   + (", compiled" if args.compile else "")
                   + "".join(f", {f}" for f in sorted(set(plan.formats.values()))
                             if f != "bf16"),
           "step s": mine, "resident all-ckpt s": theirs, "ratio": mine / theirs,
           "predicted s": plan.predicted_step_seconds,
           "peak GiB": fitted_arm.peak / GIB, "predicted GiB": plan.predicted_peak_bytes / GIB,
           "peak err %": 100 * (fitted_arm.peak / plan.predicted_peak_bytes - 1),
           "host GiB (plan)": plan.host_bytes / GIB,
           "host RSS growth GiB": (rss_fitted - rss_before) / GIB
           if rss_fitted is not None and rss_before is not None else math.nan}
    print(f"\nvideo row: {row}")
    result = {**row, **info, "explain": plan.explain(), "fitted_s": fitted_arm.seconds,
              "resident_s": resident.seconds,
              "peak_within_3pct": abs(row["peak err %"]) <= 3,
              "resident_peak_gib": resident.peak / GIB}
    return result, [row]


def wan_infer_row(m: Model, args: argparse.Namespace, device: torch.device
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One Wan forward fitted under the budget vs diffusers' block-level group offloading."""
    import vramkit
    from plan import Settings, against_group_offload

    assert m.twin is not None
    cap = int(args.budget * GIB)  # the card: both arms run under it
    budget = int((args.fit_budget or args.budget) * GIB)  # what ours is planned for
    cuda = device.type == "cuda"
    m.twin.to("cpu")  # diffusers' arm offloads from the host
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    options: dict[str, Any] = {} if cuda else {"hardware": "rtx4090", "headroom": 0.05}
    if args.tiny:
        cap = budget = _tiny_infer_budget(m)
    started = time.perf_counter()
    if args.compile:  # its blocks timed compiled, as fit will run them
        options["compile"] = "default"
    if args.allow:
        options["allow_formats"] = tuple(args.allow.split(","))
    planned = vramkit.plan(m.host, m.inputs, budget, mode="infer", autocast=None,
                           device=device if cuda else None, **options)
    plan_s = time.perf_counter() - started
    log(planned.explain())

    card = Card(device, cap)
    holder: dict[str, Any] = {}
    try:
        mine, theirs = against_group_offload(
            card, m.host, m.twin, m.inputs, lambda: holder.setdefault("fitted", vramkit.fit(
                m.host, m.inputs, budget, plan=planned, device=device, mode="infer",
                compile=args.compile)),
            Settings(device=device.type, tiny=args.tiny, rounds=args.rounds or 2,
                     steps_per_arm=args.steps or 2))
    finally:
        if "fitted" in holder:
            holder["fitted"].detach()
    ratios = [a / b for a, b in zip(mine.seconds, theirs.seconds, strict=False)]
    ours, diffusers = statistics.median(mine.seconds), statistics.median(theirs.seconds)
    row = {"row": f"Wan 2.1 14B inference {m.shapes}", "cap GiB": cap / GIB,
           "budget GiB": budget / GIB,
           "plan": f"{len(planned.swapped)}/{len(planned.block_order)} swapped, "
                   f"R={planned.num_slots}"
                   + (", compressed" if planned.compress_masters else "")
                   + (", compiled" if args.compile else "")
                   + "".join(f", {f}" for f in sorted(set(planned.formats.values()))
                             if f != "bf16"),
           "ours s": ours, "diffusers s": diffusers,
           "speed-up": diffusers / ours,
           "speed-up spread": f"{1 / max(ratios):.3f}-{1 / min(ratios):.3f}",
           "predicted s": planned.predicted_step_seconds,
           "peak GiB": mine.peak / GIB, "predicted GiB": planned.predicted_peak_bytes / GIB,
           "diffusers peak GiB": theirs.peak / GIB,
           "peak at most diffusers'": mine.peak <= theirs.peak if cuda else None}
    print(f"\nWan inference row: {row}")
    result = {**row, "plan_s": plan_s, "explain": planned.explain(),
              "fitted_s": mine.seconds, "diffusers_s": theirs.seconds}
    return result, [row]


def _tiny_infer_budget(m: Model) -> int:
    """A tiny model's budget: about half its weights (the CPU run only exercises the code)."""
    return max(1 << 20, sum(p.numel() * p.element_size() for p in m.host.parameters()) // 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="flux")
    parser.add_argument("--budget", type=float, default=None,
                        help="GiB (default 11.5; 8 with --wan-infer)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds over the plans (default by model: " + ", ".join(
                            f"{k} {v}" for k, v in DEFAULT_ROUNDS.items()) + ")")
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps per turn (default by model: " + ", ".join(
                            f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    parser.add_argument("--frames", type=int, default=0,
                        help="Wan's frames (default 41; 81 with --wan-row)")
    parser.add_argument("--ffn-chunks", type=int, default=1,
                        help="plan with each block's feed-forward over N token slices")
    parser.add_argument("--subblock", action="store_true",
                        help="plan with each block's parts (attentions, feed-forward) "
                             "checkpointed on their own (plan(subblock_checkpoint=True))")
    parser.add_argument("--video-row", "--wan-row", dest="wan_row", action="store_true",
                        help="the video row (wan, hunyuan): fitted vs resident with every "
                             "block checkpointed")
    parser.add_argument("--wan-infer", action="store_true",
                        help="Wan inference: fitted vs diffusers' block-level group offloading")
    parser.add_argument("--compile", action="store_true",
                        help="--wan-infer/--video-row: blocks torch.compiled (planned timed "
                             "compiled)")
    parser.add_argument("--allow", default="",
                        help="--wan-infer/--video-row: 8-bit formats the plan may use, e.g. "
                             "fp8-w8a8")
    parser.add_argument("--fit-budget", type=float, default=0.0,
                        help="--wan-infer: GiB ours is planned for (default: --budget, the "
                             "card's cap for both arms)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models: code paths only")
    parser.add_argument("--seed", type=int, default=0)
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.wan_infer and args.model != "wan":
        parser.error("--wan-infer is a row of --model wan")
    if args.wan_row and args.model not in VIDEO:
        parser.error(f"--video-row is a row of the video models: {', '.join(VIDEO)}")
    if args.model == "hunyuan" and not args.wan_row:
        parser.error("--model hunyuan runs the video row only: add --video-row")
    if (args.compile or args.allow) and not (args.wan_infer or args.wan_row):
        parser.error("--compile and --allow are options of --wan-infer and --video-row")
    if args.fit_budget and not args.wan_infer:
        parser.error("--fit-budget is an option of --wan-infer")
    if args.wan_row and args.wan_infer:
        parser.error("--video-row and --wan-infer are separate rows: run one per process")
    if args.fit_budget and args.budget is not None and args.fit_budget > args.budget:
        parser.error("--fit-budget is at most --budget (the card's cap)")
    args.frames = args.frames or (HUNYUAN_FRAMES if args.model == "hunyuan" else
                                  81 if args.wan_row or args.wan_infer else 41)
    if args.budget is None:
        args.budget = 8.0 if args.wan_infer else 11.5
    from vramkit.devices.resolve import resolve_device

    device = resolve_device(args.device, owner="benchmarks/regret.py")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashes on Hopper (architecture.md)
    started = time.perf_counter()
    m = build(args.model, args, device)
    log(f"built {m.name} ({m.shapes}) in {time.perf_counter() - started:.1f} s")
    run = wan_row if args.wan_row else wan_infer_row if args.wan_infer else regret_run
    result, rows = run(m, args, device)
    result["total_s"] = time.perf_counter() - started
    name = (f"regret_{args.model}_row" if args.wan_row else "regret_wan_infer" if args.wan_infer
            else f"regret_{args.model}")
    write_result(name + ("_tiny" if args.tiny else ""), result, rows, args.out)
    print(f"total {result['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
