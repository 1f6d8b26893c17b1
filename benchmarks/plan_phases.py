"""Where a fitted step's time goes: the planner's plan against the resident model, phase by phase
and block by block, with ablations that take one mechanism away at a time.

For each row (``--rows``, ``<model>:<kind>:<cap GiB>`` as in benchmarks/plan.py; default
``flux:bf16:15.5,flux:fp8:11.5``) the model is built once (benchmarks/plan.py's job: random
weights, LoRA r16, 1024 px / 4096 tokens, bf16 autocast, AdamW on the adapters), planned with
``vramkit.plan(..., hardware=None)`` for the cap, and these arms alternate in rounds (the order
reversed every other round; in each turn ``--steps-per-arm`` steps, the first untimed):

* ``resident`` -- a second copy of the weights on the GPU with the plan's checkpointing;
* ``resident+offload`` -- the same with the activation offloader ``fit`` installs (only when the
  plan offloads activations): what offloading costs without swapping;
* ``fitted`` -- ``vramkit.fit`` with the plan, under the card's cap;
* ``fitted-no-offload`` -- the same ``Fitted`` with its activation offload switched off, under
  the cap plus what the offloaded activations take (only when the plan offloads): what swapping
  costs without offloading;
* ``fp8-resident`` -- a third copy whose blocks' frozen linears are stored as fp8 (as ``fit``
  quantizes them), resident, the plan's checkpointing: what dequantizing costs without swapping
  (``--fp8-arm``, default on for ``fp8`` rows); each layer dequantizes its weight at its call;
* ``fp8-resident-together`` -- the same copy with each block's layers dequantized together at
  the block's first call (:mod:`vramkit.quant.dense`, what a plan with ``dequantize_together``
  runs).

Every step records a CUDA event and the host clock at its start, at each block's forward call,
after the loss, after backward and after the optimizer. (A checkpointed block's recomputation
in backward calls its forward without the module's hooks, so backward is timed as one phase.)
Printed per arm: the device time of forward / backward / optimizer, the host's time to enqueue
forward and backward (when it is close to the device's, the phase is host-bound), the step and
its ratio to ``resident``; then the blocks whose device time grew most against ``resident``.

``--profile ARM,...`` runs one more step of each named arm under cProfile (the host's time by
function, in the log and the JSON); ``--gc-freeze`` freezes the models' objects out of the
garbage collector once they are built; every timed step records the collector's pauses.

Run (GPU): PYTHONPATH=src python3 benchmarks/plan_phases.py --out out/phases
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/plan_phases.py --device cpu --tiny
(``VRAMKIT_PHASES_FORCE_OFFLOAD=1`` turns activation offload on in the plan, so the CPU run goes
through the offload arms too.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import log
from plan import GIB, Card, Job, Settings, copy_to, loss_of, meta_target, parse_row, sync

DEFAULT_ROWS = ("flux:bf16:15.5", "flux:fp8:11.5")
NO_OFFLOAD_EXTRA = 4 * GIB
_FORCE_OFFLOAD = os.environ.get("VRAMKIT_PHASES_FORCE_OFFLOAD") == "1"


class GcPauses:
    """Seconds the garbage collector held the host, by generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def take(self) -> list[float]:
        out, self.seconds = self.seconds, [0.0, 0.0, 0.0]
        return out


GC = GcPauses()


class Marks:
    """CUDA events (host clock on the CPU) and host times at labelled points of one step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list[tuple[str, Any, float]] = []

    def mark(self, label: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.points.append((label, event, time.perf_counter()))

    def segments(self) -> list[tuple[str, float, float]]:
        """(label, device seconds to the next point, host seconds to the next point)."""
        out = []
        for (label, ev, host), (_, ev2, host2) in zip(self.points, self.points[1:],
                                                       strict=False):
            dev = ev.elapsed_time(ev2) / 1e3 if self.cuda else host2 - host
            out.append((label, dev, host2 - host))
        return out


@dataclass
class PhaseArm:
    """One arm: a step function, the model whose blocks are marked, its cap."""

    name: str
    model: nn.Module
    extra_cap: int | None  # None: uncapped; else bytes over the card's budget
    before: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None
    steps: list[dict[str, Any]] = field(default_factory=list)
    peak: int = 0
    persistent: int = 0
    losses: list[float] = field(default_factory=list)


def profiled(fn: Callable[[], Any], top: int = 30) -> tuple[Any, str]:
    """``fn()`` under cProfile: its result and the functions that took the host's time."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        out = fn()
    finally:
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return out, text.getvalue()


@contextlib.contextmanager
def turn(card: Card, arm: PhaseArm, budget: int, own: int) -> Iterator[int]:
    """One turn of ``arm``: its cap set (the card's budget, plus ``extra_cap`` for an arm that
    keeps more on the device), its switch on; yields the bytes the other arms hold."""
    if arm.extra_cap is not None:
        card.cap = budget + arm.extra_cap
    others = card.enter(own, arm.extra_cap is not None)
    arm.before()
    try:
        yield others
    finally:
        arm.after()
        card.release()
        card.cap = budget


def phase_step(arm: PhaseArm, inputs: dict[str, Any], family: str, device: torch.device,
               optimizer: dict[str, Any], marks: Marks) -> float:
    model = arm.model
    if arm.name not in optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer[arm.name] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    marks.mark("start")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_of(model, inputs, family)
    marks.mark("fwd_end")
    loss.backward()
    marks.mark("bwd_end")
    optimizer[arm.name].step()
    optimizer[arm.name].zero_grad(set_to_none=True)
    marks.mark("opt_end")
    return float(loss.detach())


def summarize_step(marks: Marks) -> dict[str, Any]:
    """Phase totals and per-block segments of one step."""
    segs = marks.segments()
    labels = [label for label, _, _ in marks.points]
    fwd_end, bwd_end = labels.index("fwd_end"), labels.index("bwd_end")
    fwd = segs[:fwd_end]
    bwd = segs[fwd_end:bwd_end]
    out: dict[str, Any] = {
        "fwd_dev": sum(s[1] for s in fwd), "fwd_host": sum(s[2] for s in fwd),
        "bwd_dev": sum(s[1] for s in bwd), "bwd_host": sum(s[2] for s in bwd),
        "opt_dev": segs[bwd_end][1], "opt_host": segs[bwd_end][2],
        "fwd_blocks": [(s[0], s[1], s[2]) for s in fwd if s[0].startswith("block:")],
    }
    out["step_dev"] = out["fwd_dev"] + out["bwd_dev"] + out["opt_dev"]
    return out


def hook_blocks(model: nn.Module, names: list[str], holder: dict[str, Marks]) -> list[Any]:
    handles = []
    for name in names:
        def pre(module: nn.Module, args: Any, name: str = name) -> None:
            if "marks" in holder:
                holder["marks"].mark(f"block:{name}")
        handles.append(model.get_submodule(name).register_forward_pre_hook(pre))
    return handles


def fp8_copy(job: Job, s: Settings, names: list[str]) -> nn.Module:
    """A copy of the twin on the GPU with every block's frozen linears as fp8 (fit's rule)."""
    from vramkit.planning._meta import trainable_module_names
    from vramkit.quant.model import QuantizationConfig, quantize_model

    model = copy_to(job.twin, meta_target(job.model_name, s).model, job.device)
    for name in names:
        block = model.get_submodule(name)
        keep = tuple(trainable_module_names(block))
        quantize_model(block, QuantizationConfig(weights_dtype="fp8",
                                                 modules_to_not_quantize=keep))
    gc.collect()
    if job.device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def run_row(job: Job, kind: str, cap_gib: float, s: Settings, fp8_arm: bool,
            profile_arms: tuple[str, ...] = ()) -> dict[str, Any]:
    import vramkit
    from vramkit.offload.checkpointing import (
        disable_gradient_checkpointing,
        enable_gradient_checkpointing,
    )

    device = job.device
    budget = job.budget(cap_gib)
    card = Card(device, budget)
    job.reset_adapters()
    plan = vramkit.plan(job.host, job.inputs, budget, device=device
                        if device.type == "cuda" else None, **job.plan_options(kind))
    if _FORCE_OFFLOAD:  # CPU check of the offload arms
        plan = dataclasses.replace(plan, activation_offload=True)
    names = list(plan.block_order)
    row: dict[str, Any] = {"spec": f"{job.model_name}:{kind}:{cap_gib:g}", "budget": budget,
                           "explain": plan.explain(),
                           "plan": {"swapped": len(plan.swapped), "blocks": len(names),
                                    "checkpointed": len(plan.checkpointed),
                                    "slots": plan.num_slots,
                                    "activation_offload": plan.activation_offload,
                                    "formats": sorted(set(plan.formats.values())),
                                    "together": plan.dequantize_together},
                           "predicted": {"fwd": plan.forward.seconds,
                                         "fwd_compute": plan.forward.compute_seconds,
                                         "bwd": plan.backward.seconds,
                                         "bwd_compute": plan.backward.compute_seconds,
                                         "step": plan.predicted_step_seconds}}
    log(f"{row['spec']}: {row['plan']}")
    ckpt = list(plan.checkpointed)
    undo: list[Callable[[], None]] = []
    holder: dict[str, Marks] = {}
    arms: list[PhaseArm] = []
    try:
        if ckpt:
            done = enable_gradient_checkpointing(job.twin, ckpt)
            undo.append(lambda: disable_gradient_checkpointing(job.twin, done))
        arms.append(PhaseArm("resident", job.twin, None))
        handles = hook_blocks(job.twin, names, holder)
        undo.append(lambda: [h.remove() for h in handles])
        if plan.activation_offload:
            from vramkit.offload import _patch
            from vramkit.offload.activations import ActivationOffloader
            from vramkit.planning.fitting import _OffloadingForward

            wrapper = _patch.install(job.twin, _OffloadingForward(ActivationOffloader(
                device=device)))
            wrapper.active = False
            undo.append(lambda: _patch.restore(job.twin, wrapper))

            def on() -> None:
                wrapper.active = True

            def off() -> None:
                wrapper.active = False

            arms.append(PhaseArm("resident+offload", job.twin, None, on, off))
        if fp8_arm:
            quantized = fp8_copy(job, s, names)
            if ckpt:
                enable_gradient_checkpointing(quantized, ckpt)
            hook_blocks(quantized, names, holder)
            arms.append(PhaseArm("fp8-resident", quantized, None))
            from vramkit.quant.dense import DenseScratch, group_dense, ungroup_dense

            scratch = DenseScratch()

            def group() -> None:
                for name in names:
                    group_dense(quantized.get_submodule(name), scratch)

            def ungroup() -> None:
                ungroup_dense(quantized)
                scratch.release()

            arms.append(PhaseArm("fp8-resident-together", quantized, None, group, ungroup))
        fitted = vramkit.fit(job.host, job.inputs, budget, plan=plan, device=device)
        undo.append(fitted.detach)
        host_handles = hook_blocks(job.host, names, holder)
        undo.append(lambda: [h.remove() for h in host_handles])
        arms.append(PhaseArm("fitted", job.host, 0))
        if plan.activation_offload and fitted._offload is not None:
            wrap = fitted._offload
            def f_off() -> None:
                wrap.active = False

            def f_on() -> None:
                wrap.active = True

            # the activations it no longer offloads stay on the device: its cap is raised by
            # NO_OFFLOAD_EXTRA (more than FLUX's 1.5 GiB of block inputs)
            arms.append(PhaseArm("fitted-no-offload", job.host, NO_OFFLOAD_EXTRA, f_off, f_on))
        optimizer: dict[str, Any] = {}
        def step(arm: PhaseArm, marks: Marks) -> float:
            holder["marks"] = marks
            try:
                return phase_step(arm, job.inputs, job.family, device, optimizer, marks)
            finally:
                sync(device)
                holder.pop("marks")

        for arm in arms:  # warm-up: one step each, then what it holds between steps
            before = card.allocated()
            with turn(card, arm, budget, 0) as others:
                arm.losses.append(step(arm, Marks(device)))
                arm.peak = max(arm.peak, card.peak_since(others))
            arm.persistent = card.allocated() - before
        for r in range(s.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                with turn(card, arm, budget, arm.persistent) as others:
                    for i in range(s.steps_per_arm):
                        sync(device)
                        GC.take()
                        marks = Marks(device)
                        arm.losses.append(step(arm, marks))
                        if i > 0 or s.steps_per_arm == 1:
                            arm.steps.append(summarize_step(marks) | {"gc_s": GC.take()})
                    arm.peak = max(arm.peak, card.peak_since(others))
        for arm in arms:  # one more step of each arm named, under cProfile
            if arm.name not in profile_arms:
                continue
            with turn(card, arm, budget, arm.persistent):
                sync(device)
                _, text = profiled(lambda arm=arm: step(arm, Marks(device)))
            row.setdefault("profiles", {})[arm.name] = text
            log(f"cProfile of one {arm.name} step:\n{text[:6000]}")
        row["arms"] = {arm.name: arm_summary(arm) for arm in arms}
        row["arms_vs_resident"] = compare(row["arms"])
    finally:
        card.release()
        for fn in reversed(undo):
            fn()
    return row


def arm_summary(arm: PhaseArm) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {k: med(st[k] for st in arm.steps) for k in
                           ("fwd_dev", "fwd_host", "bwd_dev", "bwd_host", "opt_dev",
                            "step_dev")}
    per: dict[str, list[tuple[float, float]]] = {}
    for st in arm.steps:
        for label, dev, host in st["fwd_blocks"]:
            per.setdefault(label.removeprefix("block:"), []).append((dev, host))
    out["fwd_blocks"] = {name: (med(v[0] for v in vals), med(v[1] for v in vals))
                         for name, vals in per.items()}
    out["gc_s"] = [st["gc_s"] for st in arm.steps]  # per timed step, by generation
    out["peak_bytes"] = arm.peak
    out["steps"] = len(arm.steps)
    out["first_loss"] = arm.losses[0] if arm.losses else None
    return out


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = arms["resident"]
    out: dict[str, Any] = {}
    for name, arm in arms.items():
        deltas = sorted(((arm["fwd_blocks"][b][0] - base["fwd_blocks"][b][0], b)
                         for b in arm["fwd_blocks"] if b in base["fwd_blocks"]), reverse=True)
        grown = [(b, d) for d, b in deltas[:8]]  # the forward's blocks that grew most
        out[name] = {"ratio": arm["step_dev"] / base["step_dev"],
                     "fwd_delta_s": arm["fwd_dev"] - base["fwd_dev"],
                     "bwd_delta_s": arm["bwd_dev"] - base["bwd_dev"], "grown": grown}
    return out


def markdown(row: dict[str, Any]) -> list[dict[str, Any]]:
    lines = []
    for name, arm in row["arms"].items():
        cmp = row["arms_vs_resident"][name]
        lines.append({
            "row": row["spec"], "arm": name,
            "fwd dev / host ms": f"{arm['fwd_dev'] * 1e3:.0f} / {arm['fwd_host'] * 1e3:.0f}",
            "bwd dev / host ms": f"{arm['bwd_dev'] * 1e3:.0f} / {arm['bwd_host'] * 1e3:.0f}",
            "opt ms": f"{arm['opt_dev'] * 1e3:.1f}",
            "step ms": f"{arm['step_dev'] * 1e3:.0f}",
            "vs resident": f"{cmp['ratio']:.3f}",
            "peak GiB": f"{arm['peak_bytes'] / GIB:.2f}",
            "gc ms/step": f"{1e3 * statistics.mean(sum(g) for g in arm['gc_s']):.1f}",
        })
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-arm", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--fp8-arm", choices=["auto", "on", "off"], default="auto",
                        help="the fp8-resident arm: on fp8 rows (auto), always, never")
    parser.add_argument("--profile", default="",
                        help="comma-separated arms to run one more step of under cProfile "
                             "(the host's time by function, printed and in the JSON)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the models are built (their objects are then "
                             "never scanned by the collector)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    s = Settings(device=args.device, tiny=args.tiny, rounds=args.rounds,
                 steps_per_arm=args.steps_per_arm)
    if s.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashes on Flux shapes (docs/architecture.md)
    specs = [parse_row(r) for r in args.rows.split(",") if r]
    rows: list[dict[str, Any]] = []
    jobs: dict[str, Job] = {}
    for model, kind, cap in specs:
        if model not in jobs:
            jobs.clear()
            gc.collect()
            jobs[model] = Job(model, s)
            log(f"{model} built in {jobs[model].build_s:.1f} s")
            if args.gc_freeze:
                gc.collect()
                gc.freeze()
        fp8 = args.fp8_arm == "on" or (args.fp8_arm == "auto" and kind == "fp8")
        rows.append(run_row(jobs[model], kind, cap, s, fp8,
                            tuple(a for a in args.profile.split(",") if a)))
        for line in markdown(rows[-1]):
            log(" | ".join(f"{k}: {v}" for k, v in line.items()))
        write_result("plan_phases", {"rows": rows},
                     [line for row in rows for line in markdown(row)], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
