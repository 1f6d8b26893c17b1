"""The planner on the GPU: ``vramkit.fit`` under simulated 24/16/12/8 GB cards against the resident
model, the prediction against the measurement, inference against diffusers' group offloading.

Rows (``--rows``, comma-separated; default: all of them, one child process per model so an OOM or
a crash in one model's rows does not take the others, and each row's result is written as soon as
it is measured):

* ``flux:bf16:<cap>`` -- FLUX.1-dev's transformer built from its published config
  (:data:`vramkit.planning.MODEL_PRESETS`) with random bf16 weights (11.9 B parameters), peft LoRA
  r16 on ``to_q, to_k, to_v, to_out.0`` (fp32), 1024x1024 (4096 image + 512 text tokens), batch
  1, bf16 autocast, AdamW on the adapters. ``vramkit.fit(model_on_host, inputs, cap)`` plans with
  ``hardware=None`` (this GPU's copy bandwidth and one timed block of each kind) and applies the
  plan; the resident baseline is a second copy of the same weights on the GPU with the *same*
  blocks checkpointed (and, where the plan leaves blocks un-checkpointed, that copy again with
  every block checkpointed: "vs all-ckpt", what trainers run at these sizes). The arms
  alternate (ABBA rounds, ``--steps-per-arm`` steps each, the first of each turn untimed: it
  pays the allocator's refill after the other arm ran).
* ``flux:fp8:<cap>`` -- the same with ``allow_formats=("fp8",)``; the loss deviation from the bf16
  baseline is printed beside the time.
* ``flux:bf16-all:<cap>`` / ``flux:fp8-all:<cap>`` -- the same with ``checkpointing="all"``: every
  block checkpointed, as hand-tuned trainer settings run it, the planner choosing the rest;
  the baseline is the resident model with every block checkpointed.
* ``flux:fp8w8a8:<cap>`` / ``flux:int8w8a8:<cap>`` -- ``allow_formats=("fp8-w8a8",)`` (or int8):
  frozen weights stored in 8 bits and multiplied in 8 bits (activations quantized per token);
  the planner chooses per block where it predicts a faster step.
* a ``+c`` suffix (``flux:bf16+c:23.5``, ``flux:fp8w8a8+c:11.5``) -- the same plan applied with
  ``fit(..., compile=True)``: every block ``torch.compile``d beneath checkpointing and swapping,
  planned with ``compile="default"`` (its blocks timed compiled); the baseline stays the resident
  *eager* model; the frames compiled after warm-up are counted.
* ``flux:offline:<cap>`` -- the plan made offline from this GPU's published profile
  (``hardware="h100-pcie"`` etc., picked from the device name), for the prediction error.
* ``flux:infer:<cap>`` -- one 1024x1024 forward (no adapters, bf16, no_grad): ``fit(mode="infer")``
  against diffusers' ``apply_group_offloading(offload_type="block_level",
  num_blocks_per_group=1, use_stream=True)`` on a second host copy, alternating.
* ``llama:bf16:<cap>`` / ``llama:offline:<cap>`` -- Llama-3.1-8B's config, random bf16 weights,
  LoRA r16 on ``q_proj, k_proj, v_proj, o_proj``, 4096 tokens, loss = mean of the fp32 logits
  (the planner's step for causal LMs).
* ``demo:<size>:<budget GiB>`` -- ``vramkit demo``'s own run (its DiT, LoRA, its resident
  baseline alternating with the swapped run) with ``model_size``/``budget``.
* ``plan:flux`` -- planning time on meta (offline, ``vramkit.plan(meta_model, ...,
  hardware=<profile>)``), cold and warm.

How a card is simulated with two models in one process: ``set_per_process_memory_fraction`` caps
what the allocator may reserve in the whole process, so while the fitted arm runs, the cap is set
to the bytes the *other* arm holds (its weights, adapters and optimizer state, measured) plus the
card's budget; the fitted arm's peak is the process's ``max_memory_allocated`` over its turn minus
what the other arm holds. The resident arm runs uncapped. cuDNN's SDPA backend is disabled
(``torch.backends.cuda.enable_cudnn_sdp(False)``): on torch 2.11 + H100 it crashed with an
illegal memory access on Flux shapes, even in plain diffusers (docs/architecture.md).

Run (GPU, ~5 min per model): PYTHONPATH=src python3 benchmarks/plan.py --out out/plan
Run (GPU, some rows):        ... --rows flux:bf16:23.5,flux:bf16:7.5
Run (CPU, code paths only):  PYTHONPATH=src python3 benchmarks/plan.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _snapshot import peak_report, recording
from _timing import log
from presets import fill_random as fill_weights
from vramkit.devices.resolve import resolve_device
from vramkit.observe.oom import is_oom_error

GIB = 1 << 30
FLUX_LORA = ("to_q", "to_k", "to_v", "to_out.0")
DEFAULT_ROWS = (
    "plan:flux",
    "flux:bf16:23.5", "flux:bf16:15.5", "flux:bf16:11.5", "flux:bf16:7.5",
    "flux:fp8:11.5", "flux:fp8:7.5", "flux:offline:15.5", "flux:offline:7.5",
    "flux:infer:11.5",
    "llama:bf16:11.5", "llama:bf16:7.5", "llama:offline:11.5",
    "demo:xl:4", "demo:xl:2.5",
)
KINDS = {"flux": ("bf16", "fp8", "bf16-all", "fp8-all", "offline", "infer", "fp8w8a8", "int8w8a8",
                  "bf16+c", "fp8w8a8+c", "int8w8a8+c", "bf16-all+c", "fp8w8a8-all+c"),
         "llama": ("bf16", "offline", "fp8w8a8", "fp8w8a8+c", "bf16+c"),
         "demo": None, "plan": ("flux",)}

# Tiny stand-ins for --tiny (CPU): the same classes and code paths in seconds.
TINY_FLUX = {
    "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16,
    "num_layers": 2, "num_single_layers": 3, "attention_head_dim": 64,
    "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 16,
    "guidance_embeds": True, "axes_dims_rope": [16, 24, 24],
}
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 3, "vocab_size": 256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


@dataclass
class Settings:
    """One run's choices (defaults: the full GPU run)."""

    device: str = "cuda"
    tiny: bool = False
    rounds: int = 4
    steps_per_arm: int = 2
    seed: int = 0
    snapshot: bool = False  # record where the fitted arm's first step's peak goes


# -- building the models --------------------------------------------------------------------


def tiny_folder(model: str) -> str:
    folder = Path(tempfile.mkdtemp(prefix=f"vramkit-plan-{model}-"))
    config = TINY_FLUX if model == "flux" else TINY_LLAMA
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def meta_target(model: str, s: Settings, mode: str = "train") -> Any:
    from vramkit.recipes.targets import build_target

    name = tiny_folder(model) if s.tiny else {"flux": "flux-dev", "llama": "llama-3.1-8b"}[model]
    options: dict[str, Any] = {"mode": mode}
    if model == "flux":
        options["lora_targets"] = FLUX_LORA
        if s.tiny:
            options.update(resolution=64, seq_len=8)
    elif s.tiny:
        options["seq_len"] = 64
    else:
        options["seq_len"] = 4096
    return build_target(name, **options)


@torch.no_grad()
def fill_random(module: nn.Module) -> None:
    """Random weights as benchmarks/presets.py gives them (matrices N(0, 0.02), norm scales 1,
    biases 0, LoRA B 0: the adapters start as the identity); transformers' rotary tables
    (``inv_freq``) rebuilt from the model's config."""
    fill_weights(module)
    for sub in module.modules():
        if hasattr(sub, "inv_freq") and hasattr(sub, "rope_init_fn"):
            inv_freq, scaling = sub.rope_init_fn(sub.config, sub.inv_freq.device)
            sub.inv_freq.copy_(inv_freq)
            if hasattr(sub, "original_inv_freq"):
                sub.original_inv_freq = sub.inv_freq.clone()
            sub.attention_scaling = scaling


def materialize(target: Any, device: torch.device, seed: int) -> nn.Module:
    """The target's meta model with random weights on ``device``."""
    model = target.model
    model.to_empty(device=device)
    torch.manual_seed(seed)
    fill_random(model)
    return model


@torch.no_grad()
def copy_to(source: nn.Module, meta: nn.Module, device: torch.device) -> nn.Module:
    """``meta`` (the same architecture) given ``source``'s values on ``device``."""
    meta.to_empty(device=device)
    theirs = dict(source.named_parameters()) | dict(source.named_buffers())
    for name, t in [*meta.named_parameters(), *meta.named_buffers()]:
        t.copy_(theirs[name])
    for mine, other in zip(meta.modules(), source.modules(), strict=True):
        if hasattr(other, "attention_scaling"):
            mine.attention_scaling = other.attention_scaling
    return meta


def real_inputs(meta_inputs: dict[str, Any], device: torch.device, vocab: int | None,
                seed: int) -> dict[str, Any]:
    """Real tensors of the target's meta input shapes: noise for activations, 0.5 for
    timestep/guidance, zeros for positions, random token ids."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for key, value in meta_inputs.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
        elif not value.is_floating_point():
            out[key] = torch.randint(0, vocab or 2, tuple(value.shape), generator=g).to(device)
        elif key.endswith("_ids"):
            out[key] = torch.zeros(value.shape, dtype=value.dtype, device=device)
        elif value.numel() == value.shape[0]:
            out[key] = torch.full(value.shape, 0.5, dtype=value.dtype, device=device)
        else:
            out[key] = torch.randn(tuple(value.shape), generator=g).to(device, value.dtype)
    return out


def loss_of(model: nn.Module, inputs: dict[str, Any], family: str) -> torch.Tensor:
    """The planner's step for the family, on real tensors (autocast is the caller's)."""
    if family == "causal-lm":
        return model(**inputs).logits.float().mean()
    out = model(**inputs, return_dict=False)[0]
    return out.float().sum()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_profile_name(device: torch.device) -> str:
    """This GPU's profile in :data:`vramkit.planning.PROFILES`, found by its device name as
    ``vramkit plan --hardware`` would (the offline rows); ``rtx4090`` on the CPU."""
    from vramkit.errors import VramkitError
    from vramkit.planning import hardware_profile

    if device.type != "cuda":
        return "rtx4090"
    try:
        return hardware_profile(torch.cuda.get_device_name(device)).name
    except VramkitError:
        return "rtx4090"


# -- arms: two models alternating, each measured as if alone on its card ------------------------


@dataclass
class Arm:
    """One side of a paired comparison: a step, whether it runs under the card's cap, and the
    bytes it holds on the GPU between its steps (measured after its warm-up)."""

    name: str
    run: Callable[[], float | None]
    capped: bool
    persistent: int = 0
    seconds: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    first_loss: float | None = None  # the warm-up step's: same weights, the forward alone
    peak: int = 0


class Card:
    """A simulated card of ``cap`` bytes in a process that holds other models too."""

    def __init__(self, device: torch.device, cap: int) -> None:
        self.device, self.cap = device, cap
        self.cuda = device.type == "cuda"
        self.total = torch.cuda.get_device_properties(device).total_memory if self.cuda else 0

    def allocated(self) -> int:
        if not self.cuda:
            return 0
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(self.device)

    def enter(self, own: int, capped: bool) -> int:
        """Start a turn of an arm holding ``own`` bytes: cap the process at what the others
        hold plus the card; returns the bytes the others hold."""
        if not self.cuda:
            return 0
        others = self.allocated() - own
        fraction = min(1.0, (others + self.cap) / self.total) if capped else 1.0
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return others

    def peak_since(self, others: int) -> int:
        return torch.cuda.max_memory_allocated(self.device) - others if self.cuda else 0

    def release(self) -> None:
        if self.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)


def warm(card: Card, arm: Arm, attach: Callable[[], None] | None = None) -> None:
    """Attach (optional) and run one step under the card, then record what the arm holds."""
    before = card.allocated()
    others = card.enter(0, arm.capped)
    if attach is not None:
        attach()
    arm.first_loss = arm.run()
    sync(card.device)
    arm.peak = max(arm.peak, card.peak_since(others))
    card.release()
    arm.persistent = card.allocated() - before


def alternate(card: Card, arms: tuple[Arm, ...], s: Settings) -> None:
    """ABBA rounds (the order reversed every other round); in each turn ``steps_per_arm`` steps, all but the first timed."""
    for r in range(s.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            others = card.enter(arm.persistent, arm.capped)
            for i in range(s.steps_per_arm):
                sync(card.device)
                start = time.perf_counter()
                loss = arm.run()
                sync(card.device)
                if i > 0 or s.steps_per_arm == 1:
                    arm.seconds.append(time.perf_counter() - start)
                if loss is not None:
                    arm.losses.append(loss)
            arm.peak = max(arm.peak, card.peak_since(others))
            card.release()


def warm_more(card: Card, arm: Arm, steps: int) -> None:
    """Untimed steps after :func:`warm`'s (compiled blocks' other calling contexts)."""
    for _ in range(steps):
        others = card.enter(arm.persistent, arm.capped)
        arm.run()
        sync(card.device)
        arm.peak = max(arm.peak, card.peak_since(others))
        card.release()


def against_group_offload(card: Card, fitted: nn.Module, twin: nn.Module,
                          inputs: dict[str, Any], attach: Callable[[], None], s: Settings,
                          warmup: int = 1) -> tuple[Arm, Arm]:
    """One no-grad forward of ``fitted`` (applied by ``attach``, under the card's cap) against
    diffusers' block-level group offloading of ``twin`` (its weights on the host; one block a
    group, its copies on a stream), ``warmup`` untimed calls each, then ABBA rounds. Returns
    the two arms (seconds, peaks); the caller detaches what ``attach`` made."""
    def forward(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                model(**inputs, return_dict=False)
        return run

    mine = Arm("fitted", forward(fitted), capped=True)
    theirs = Arm("diffusers", forward(twin), capped=False)
    try:
        warm(card, mine, attach)
        warm_more(card, mine, warmup - 1)
        warm(card, theirs, lambda: twin.enable_group_offload(
            onload_device=card.device, offload_device=torch.device("cpu"),
            offload_type="block_level", num_blocks_per_group=1, use_stream=card.cuda))
        warm_more(card, theirs, warmup - 1)
        alternate(card, (mine, theirs), s)
    finally:
        card.release()
    return mine, theirs


def train_arm(name: str, model: nn.Module, inputs: dict[str, Any], family: str,
              device: torch.device, capped: bool) -> tuple[Arm, Callable[[], None]]:
    """A LoRA training step (bf16 autocast, AdamW on the trainable parameters); the optimizer is
    made on first use (after ``fit`` moved the parameters)."""
    state: dict[str, Any] = {}

    def run() -> float:
        if "opt" not in state:
            params = [p for p in model.parameters() if p.requires_grad]
            state["opt"] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, inputs, family)
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        return float(loss.detach())

    return Arm(name, run, capped), lambda: state.clear()


# -- one model's rows ---------------------------------------------------------------------------


class Job:
    """One model built once for all its rows: the host copy that ``fit`` places, and a second
    copy of the same values for the baseline (resident on the GPU for training rows)."""

    def __init__(self, model: str, s: Settings) -> None:
        self.model_name, self.s = model, s
        self.device = resolve_device(s.device, owner="benchmarks/plan.py")
        t0 = time.perf_counter()
        target = meta_target(model, s)
        self.family, self.step = target.family, target.step
        self.vocab = getattr(getattr(target.model, "config", None), "vocab_size", None)
        self.twin = materialize(target, self.device, s.seed)  # the baseline's copy
        self.host = copy_to(self.twin, meta_target(model, s).model, torch.device("cpu"))
        self.initial = {n: p.detach().to("cpu", copy=True)
                        for n, p in self.host.named_parameters() if p.requires_grad}
        self.inputs = real_inputs(target.inputs, self.device, self.vocab, s.seed + 1)
        self.meta_inputs = target.inputs
        self.build_s = time.perf_counter() - t0
        self.profile = gpu_profile_name(self.device)
        self._minimum: int | None = None

    @torch.no_grad()
    def reset_adapters(self) -> None:
        for model in (self.host, self.twin):
            for n, p in model.named_parameters():
                if n in self.initial:
                    p.copy_(self.initial[n])

    def budget(self, cap_gib: float) -> int:
        if not self.s.tiny:
            return int(cap_gib * GIB)
        # tiny: between the planner's minimum (at 7 GiB) and the whole model (at 24 GiB)
        import vramkit
        from vramkit.errors import PlanError

        if self._minimum is None:
            try:
                vramkit.plan(self.host, self.inputs, 1, **self.plan_options("bf16"))
            except PlanError as exc:
                self._minimum = int(exc.minimum_budget or 0)
        weights = sum(t.numel() * t.element_size() for t in self.host.parameters())
        low = self._minimum or 0
        return int(low + max(weights * 1.2 - low, 0) * (cap_gib - 7) / 17)

    def plan_options(self, kind: str) -> dict[str, Any]:
        options: dict[str, Any] = {"step": self.step}
        if kind.endswith("+c"):  # priced compiled; fit(..., compile=True) applies it
            options["compile"] = "default"
        kind = kind.removesuffix("+c")
        for prefix, fmt in (("fp8w8a8", "fp8-w8a8"), ("int8w8a8", "int8-w8a8"), ("fp8", "fp8")):
            if kind.startswith(prefix):
                options["allow_formats"] = (fmt,)
                break
        if kind.endswith("-all"):
            options["checkpointing"] = "all"
        if kind == "offline" or self.device.type != "cuda":
            options["hardware"] = self.profile
        if self.s.tiny:
            options["headroom"] = 0.05
        return options

    def train_row(self, kind: str, cap_gib: float) -> dict[str, Any]:
        import vramkit
        from vramkit.offload.checkpointing import (
            disable_gradient_checkpointing,
            enable_gradient_checkpointing,
        )

        budget = self.budget(cap_gib)
        card = Card(self.device, budget)
        row: dict[str, Any] = {"model": self.model_name, "kind": kind, "cap_gib": cap_gib,
                               "budget_bytes": budget}
        self.reset_adapters()
        t0 = time.perf_counter()
        options = self.plan_options(kind)
        if "hardware" not in options:  # calibrated as vramkit.plan would, kept for the record
            from vramkit.planning import calibrate_blocks

            options["block_times"] = calibrate_blocks(
                self.host, self.inputs, step=self.step, device=self.device,
                formats=options.get("allow_formats", ()), compile=options.get("compile"))
            row["block_times"] = {
                variant: {name: [c.forward, c.backward, c.host_forward, c.host_backward]
                          for name, c in calls.items()}
                for variant, calls in options["block_times"].calls.items()}
        plan = vramkit.plan(self.host, self.inputs, budget, device=self.device
                            if self.device.type == "cuda" else None, **options)
        row["plan_s"] = time.perf_counter() - t0
        row["plan"] = {"swapped": len(plan.swapped), "blocks": len(plan.swapped)
                       + len(plan.resident), "checkpointed": len(plan.checkpointed),
                       "slots": plan.num_slots, "activation_offload": plan.activation_offload,
                       "formats": sorted(set(plan.formats.values()))}
        row["explain"] = plan.explain()
        row["predicted_peak"] = plan.predicted_peak_bytes
        row["predicted_step_s"] = plan.predicted_step_seconds
        row["predicted_phases"] = {phase: plan.to_dict()[phase] for phase in ("forward",
                                                                              "backward")}
        log(f"{self.model_name} {kind} {cap_gib} GiB: {row['plan']}, planned in "
            f"{row['plan_s']:.1f} s")
        checkpointed = enable_gradient_checkpointing(self.twin, list(plan.checkpointed)) \
            if plan.checkpointed else []
        resident, reset_r = train_arm("resident", self.twin, self.inputs, self.family,
                                      self.device, capped=False)
        fitted_arm, reset_f = train_arm("fitted", self.host, self.inputs, self.family,
                                        self.device, capped=True)
        arms = [fitted_arm, resident]
        # The resident model with every block checkpointed (what trainers run at these sizes):
        # a plan that checkpoints fewer blocks and swaps more is compared with it too.
        rest = [n for n in plan.block_order if n not in set(plan.checkpointed)]
        everything, reset_a = train_arm("resident-all-ckpt", self.twin, self.inputs,
                                        self.family, self.device, capped=False)
        if rest:
            step = everything.run

            trained = [p for p in self.twin.parameters() if p.requires_grad]
            kept = [torch.empty_like(p) for p in trained]  # allocated once

            def all_checkpointed() -> float | None:
                # The twin's adapters are the resident arm's: this arm trains them and puts
                # them back, so the resident arm's losses still follow the fitted arm's (two
                # device copies of the adapters, ~0.1 ms, inside this baseline's timed step).
                torch._foreach_copy_(kept, [p.detach() for p in trained])
                done = enable_gradient_checkpointing(self.twin, rest)
                try:
                    return step()
                finally:
                    disable_gradient_checkpointing(self.twin, done)
                    with torch.no_grad():
                        torch._foreach_copy_(trained, kept)

            everything.run = all_checkpointed
            arms.append(everything)
        holder: dict[str, Any] = {}
        try:
            warm(card, resident)
            if len(arms) > 2:
                warm(card, everything)
            t1 = time.perf_counter()
            with self._recording() as recorded:
                warm(card, fitted_arm, lambda: holder.setdefault("fitted", vramkit.fit(
                    self.host, self.inputs, budget, plan=plan, device=self.device,
                    compile=kind.endswith("+c"))))
            row["attach_and_first_step_s"] = time.perf_counter() - t1
            if recorded is not None:
                row["peak_snapshot"] = peak_report(recorded, self.device)
                del recorded["snapshot"]
            frames = None
            if kind.endswith("+c"):
                from torch._dynamo.utils import counters

                # a second untimed step: compiling finishes in the recomputation and the
                # optimizer's first turn; what compiles after this is a recompile
                card.enter(fitted_arm.persistent, fitted_arm.capped)
                fitted_arm.run()
                sync(card.device)
                card.release()
                frames = counters["frames"]["ok"]
            alternate(card, tuple(arms), self.s)
            if frames is not None:
                row["frames_compiled_after_warmup"] = counters["frames"]["ok"] - frames
        finally:
            card.release()
            if "fitted" in holder:
                holder["fitted"].detach()
            if checkpointed:
                disable_gradient_checkpointing(self.twin, checkpointed)
            reset_r()
            reset_f()
            reset_a()
        row = self._finish(row, fitted_arm, resident, plan, budget)
        if everything.seconds:
            row["baseline_all_ckpt_s"] = statistics.median(everything.seconds)
            row["ratio_all_ckpt"] = row["fitted_s"] / row["baseline_all_ckpt_s"]
        return row

    def _recording(self) -> Any:
        """The allocator's history over the fitted arm's first step, with ``--snapshot``."""
        if self.s.snapshot and self.device.type == "cuda":
            return recording(self.device)
        if self.s.snapshot:
            log("--snapshot: the CPU has no allocator history; nothing recorded")
        return contextlib.nullcontext()

    def _finish(self, row: dict[str, Any], mine: Arm, other: Arm, plan: Any,
                budget: int) -> dict[str, Any]:
        row["fitted_s"] = statistics.median(mine.seconds)
        row["baseline_s"] = statistics.median(other.seconds)
        row["ratio"] = row["fitted_s"] / row["baseline_s"]
        row["fitted_all_s"], row["baseline_all_s"] = mine.seconds, other.seconds
        row["step_error"] = row["fitted_s"] / plan.predicted_step_seconds - 1
        if self.device.type == "cuda":
            row["fitted_peak"], row["baseline_peak"] = mine.peak, other.peak
            row["peak_error"] = mine.peak / plan.predicted_peak_bytes - 1
            row["under_budget"] = mine.peak <= budget
        if mine.first_loss is not None and other.first_loss is not None:
            row["first_loss"], row["baseline_first_loss"] = mine.first_loss, other.first_loss
            row["first_loss_rel_dev"] = (abs(mine.first_loss - other.first_loss)
                                         / max(abs(other.first_loss), 1e-12))
        if mine.losses and other.losses:
            pairs = list(zip(mine.losses, other.losses, strict=False))
            row["losses"], row["baseline_losses"] = mine.losses, other.losses
            row["loss_identical"] = all(a == b for a, b in pairs)
            row["loss_max_rel_dev"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
            if not all(math.isfinite(v) for v in mine.losses):
                raise RuntimeError(f"non-finite loss {mine.losses}")
        return row

    def infer_row(self, cap_gib: float) -> dict[str, Any]:
        """fit(mode="infer") vs diffusers' group offloading, both on host copies."""
        from diffusers.hooks import apply_group_offloading

        import vramkit

        budget = self.budget(cap_gib)
        card = Card(self.device, budget)
        row: dict[str, Any] = {"model": self.model_name, "kind": "infer", "cap_gib": cap_gib,
                               "budget_bytes": budget}
        for model in (self.host, self.twin):
            if hasattr(model, "peft_config"):
                model.delete_adapters(list(model.peft_config))
        self.twin.to("cpu")  # the diffusers arm's copy
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        inputs = self.inputs

        def infer(model: nn.Module) -> Callable[[], None]:
            def run() -> None:
                with torch.no_grad():
                    model(**inputs, return_dict=False)
            return run

        t0 = time.perf_counter()
        options = self.plan_options("bf16")
        options.pop("step")
        plan = vramkit.plan(self.host, inputs, budget, mode="infer", autocast=None,
                            device=self.device if self.device.type == "cuda" else None,
                            **options)
        row["plan_s"] = time.perf_counter() - t0
        row["plan"] = {"swapped": len(plan.swapped),
                       "blocks": len(plan.swapped) + len(plan.resident),
                       "slots": plan.num_slots, "split": plan.split}
        row["explain"] = plan.explain()
        row["predicted_peak"] = plan.predicted_peak_bytes
        row["predicted_step_s"] = plan.predicted_step_seconds
        mine = Arm("fitted", infer(self.host), capped=True)
        theirs = Arm("diffusers", infer(self.twin), capped=True)
        holder: dict[str, Any] = {}
        use_stream = self.device.type == "cuda"
        try:
            warm(card, mine, lambda: holder.setdefault("fitted", vramkit.fit(
                self.host, inputs, budget, plan=plan, device=self.device)))
            warm(card, theirs, lambda: apply_group_offloading(
                self.twin, onload_device=self.device, offload_type="block_level",
                num_blocks_per_group=1, use_stream=use_stream))
            alternate(card, (mine, theirs), self.s)
        finally:
            card.release()
            if "fitted" in holder:
                holder["fitted"].detach()
        row = self._finish(row, mine, theirs, plan, budget)
        row["speedup"] = 1 / row["ratio"]
        return row


def plan_time_row(s: Settings) -> dict[str, Any]:
    """Planning Flux-12B on meta, offline: cold (first call: imports, tracing) and warm."""
    import vramkit

    row: dict[str, Any] = {"model": "flux", "kind": "plan-time"}
    t0 = time.perf_counter()
    target = meta_target("flux", s)
    row["build_s"] = time.perf_counter() - t0
    times = []
    for _ in range(2):
        t1 = time.perf_counter()
        plan = vramkit.plan(target.model, target.inputs, "11.5GiB" if not s.tiny else "64MiB",
                            step=target.step, hardware="h100-pcie",
                            headroom=0.05 if s.tiny else None)
        times.append(time.perf_counter() - t1)
    row["plan_cold_s"], row["plan_warm_s"] = times
    row["plan"] = {"swapped": len(plan.swapped), "blocks": len(plan.swapped)
                   + len(plan.resident)}
    return row


def demo_row(size: str, budget_gib: float, s: Settings) -> dict[str, Any]:
    from vramkit.recipes.demo import DemoConfig, plan_demo, run_demo

    config = DemoConfig(budget=f"{budget_gib}GiB" if not s.tiny else f"{budget_gib * 12}MiB",
                        model_size=size if not s.tiny else "small", steps=10 if not s.tiny
                        else 3, device=s.device, report=None)
    t0 = time.perf_counter()
    plan = plan_demo(config)
    plan_s = time.perf_counter() - t0
    retries = _alloc_retries(s.device)
    result = run_demo(config, plan=plan)
    retries = _alloc_retries(s.device) - retries
    row: dict[str, Any] = {"model": f"demo-{size}", "kind": "bf16", "cap_gib": budget_gib,
                           "budget_bytes": plan.budget_bytes, "plan_s": plan_s,
                           "plan": {"swapped": result.swapped_blocks,
                                    "blocks": result.total_blocks,
                                    "checkpointed": len(result.checkpointed_blocks),
                                    "slots": plan.num_slots},
                           "predicted_peak": plan.predicted_peak_bytes,
                           "predicted_step_s": plan.predicted_step_seconds,
                           "fitted_s": result.median_step_seconds,
                           "baseline_s": result.baseline_median_step_seconds,
                           "ratio": result.slowdown,
                           "fitted_peak": result.peak_bytes,
                           "under_budget": result.under_budget,
                           "loss_identical": result.losses == result.baseline_losses
                           if result.baseline_losses else None,
                           # what a host-bound or allocator-bound demo row needs to be read
                           "timing": result.timing,
                           "step_seconds": result.step_seconds,
                           "baseline_step_seconds": result.baseline_step_seconds,
                           "peak_reserved": result.peak_reserved_bytes,
                           "transfers": result.transfers,
                           "alloc_retries": retries,
                           "explain": plan.plan_explanation}
    if plan.predicted_step_seconds:
        row["step_error"] = result.median_step_seconds / plan.predicted_step_seconds - 1
    if plan.predicted_peak_bytes:
        row["peak_error"] = result.peak_bytes / plan.predicted_peak_bytes - 1
    return row


def _alloc_retries(device: str) -> int:
    """The CUDA caching allocator's retries so far in this process (each one freed cached
    blocks and synchronized to make room under the cap); 0 off CUDA."""
    if device != "cuda":
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


# -- driver: one child process per model ----------------------------------------------------------


def parse_row(spec: str) -> tuple[str, str, float]:
    parts = spec.split(":")
    if len(parts) == 2 and parts[0] == "plan":
        return "plan", parts[1], 0.0
    if len(parts) != 3 or parts[0] not in KINDS:
        raise ValueError(f"bad row {spec!r}: use model:kind:cap (e.g. flux:bf16:11.5)")
    model, kind, cap = parts
    if KINDS[model] is not None and kind not in KINDS[model]:
        raise ValueError(f"bad row {spec!r}: {model} rows are {', '.join(KINDS[model])}")
    return model, kind, float(cap)


def child_main(specs: list[str], result_file: Path, s: Settings) -> int:
    """Run one model's rows in this process, appending each row's JSON as it finishes."""
    if s.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashes on Flux shapes (docs/architecture.md)
    torch.manual_seed(s.seed)
    job: Job | None = None

    def record(row: dict[str, Any]) -> None:
        with result_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")

    for spec in specs:
        model, kind, cap = parse_row(spec)
        log(f"row {spec} ...")
        try:
            if model == "plan":
                row = plan_time_row(s)
            elif model == "demo":
                row = demo_row(kind, cap, s)
            else:
                if job is None:
                    job = Job(model, s)
                    log(f"{model} built in {job.build_s:.1f} s")
                row = job.infer_row(cap) if kind == "infer" else job.train_row(kind, cap)
            row["status"] = "ok"
        except BaseException as exc:  # recorded, not fatal: the next row goes on
            oom = is_oom_error(exc)
            row = {"model": model, "kind": kind, "cap_gib": cap,
                   "status": "OOM" if oom else "error",
                   "error": f"{type(exc).__name__}: {str(exc)[:800]}",
                   "traceback": traceback.format_exc()[-3000:]}
            if isinstance(exc, KeyboardInterrupt):
                record(row | {"spec": spec})
                raise
        row["spec"] = spec
        log(f"row {spec}: {row['status']}" + (f" ratio {row['ratio']:.3f}"
                                              if row.get("ratio") else "")
            + (f" ({row['error'][:300]})" if row.get("error") else ""))
        record(row)
        if s.device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
    return 0


def run_child(specs: list[str], s: Settings, timeout_s: float,
              out_dir: Path) -> list[dict[str, Any]]:
    """Run one model's rows in a child; its rows are in ``<out>/rows-<model>.jsonl`` as they
    finish (kept when this process is killed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = out_dir / f"rows-{specs[0].split(':')[0]}.jsonl"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rows", ",".join(specs),
           "--child", "--result-file", str(result), "--device", s.device,
           "--rounds", str(s.rounds), "--steps-per-arm", str(s.steps_per_arm)]
    if s.tiny:
        cmd.append("--tiny")
    if s.snapshot:
        cmd.append("--snapshot")
    try:
        proc = subprocess.run(cmd, text=True, timeout=timeout_s, env=os.environ.copy(),
                              stdout=subprocess.PIPE)
        failure = None if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"no end within {timeout_s:.0f} s"
    rows = [json.loads(line) for line in result.read_text(encoding="utf-8").splitlines()] \
        if result.exists() else []
    done = {r["spec"] for r in rows}
    rows += [{"spec": spec, "model": spec.split(":")[0], "kind": spec.split(":")[1],
              "status": "crashed", "error": failure or "no result"}
             for spec in specs if spec not in done]
    return rows


def markdown_row(row: dict[str, Any]) -> dict[str, Any]:
    def gib(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value / GIB:.2f}"

    def pct(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:+.1%}"

    def ms(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value * 1e3:.0f}"

    plan = row.get("plan") or {}
    chosen = (f"{plan.get('swapped')}/{plan.get('blocks')} "
              f"{'units (split) ' if plan.get('split') else ''}swapped, "
              f"{plan.get('checkpointed', '-')} ckpt, R={plan.get('slots', '-')}"
              + (", act offload" if plan.get("activation_offload") else "")
              + (f", {'+'.join(plan['formats'])}" if plan.get("formats") else "")
              + (f", compiled ({row['frames_compiled_after_warmup']} recompiles)"
                 if "frames_compiled_after_warmup" in row else "")) if plan else "-"
    first, dev = row.get("first_loss_rel_dev"), row.get("loss_max_rel_dev")
    loss = "-" if first is None else ("1st equal" if first == 0 else f"1st {first:.1e}")
    if row.get("loss_identical"):
        loss += ", all equal"
    elif dev is not None:
        loss += f", max {dev:.1e}"
    cap = row.get("cap_gib")
    return {
        "row": row.get("spec", "-"), "cap GiB": "-" if not cap else f"{cap:g}", "plan": chosen,
        "plan s": "-" if row.get("plan_s") is None else f"{row['plan_s']:.1f}",
        "step ms": ms("fitted_s"), "baseline ms": ms("baseline_s"),
        "ratio": "-" if row.get("ratio") is None else f"{row['ratio']:.3f}",
        "vs all-ckpt": "-" if row.get("ratio_all_ckpt") is None else
        f"{row['ratio_all_ckpt']:.3f} ({row['baseline_all_ckpt_s'] * 1e3:.0f} ms)",
        "predicted ms": ms("predicted_step_s"), "step err": pct("step_error"),
        "peak GiB": gib("fitted_peak"), "predicted GiB": gib("predicted_peak"),
        "peak err": pct("peak_error"),
        "under cap": {True: "yes", False: "NO", None: "-"}[row.get("under_budget")],
        "loss": loss,
        "status": row["status"] if row["status"] != "ok" else
        (f"ok (plan {row['plan_cold_s']:.1f} s cold, {row['plan_warm_s']:.1f} s warm)"
         if "plan_cold_s" in row else "ok"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help="comma-separated rows (see the module docstring)")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    parser.add_argument("--steps-per-arm", type=int, default=2,
                        help="steps in each turn, the first untimed (default 2)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models (for --device cpu: the code paths, not the numbers)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before a model's process is given up (default 900)")
    parser.add_argument("--snapshot", action="store_true",
                        help="record the fitted arm's first step on the GPU and report what "
                             "is alive at its peak, by owner (row['peak_snapshot'])")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args(argv)
    specs = [r.strip() for r in args.rows.split(",") if r.strip()]
    try:
        for spec in specs:
            parse_row(spec)
    except ValueError as exc:
        parser.error(str(exc))
    s = Settings(device=args.device, tiny=args.tiny or args.device == "cpu",
                 rounds=args.rounds, steps_per_arm=args.steps_per_arm, snapshot=args.snapshot)
    if args.child:
        return child_main(specs, args.result_file, s)
    groups: dict[str, list[str]] = {}
    for spec in specs:
        groups.setdefault(spec.split(":")[0], []).append(spec)
    rows: list[dict[str, Any]] = []
    for model, group in groups.items():
        log(f"{model}: {len(group)} row(s) in one process ...")
        rows += run_child(group, s, args.timeout, args.out)
    order = {spec: i for i, spec in enumerate(specs)}
    rows.sort(key=lambda r: order.get(r.get("spec", ""), len(order)))
    write_result("plan", {"settings": dataclasses.asdict(s), "rows": rows},
                 [markdown_row(r) for r in rows], args.out)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
