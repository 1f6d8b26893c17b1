"""A kohya/musubi-style LoRA network against peft's LoRA, both fitted to one card: FLUX.1-dev's
transformer (published config, random bf16 weights), LoRA r16 (alpha 16, fp32) on ``to_q, to_k,
to_v, to_out.0``, 1024x1024, plain inputs (none requires grad: the first block's call only
trains through the adapters), bf16 autocast, AdamW on the adapters.

The kohya arm's network is the tests' toy (``tests/_toys.py``: ``KohyaLoRANetwork``): its
modules live in a network *beside* the model, each target layer's ``forward`` replaced by an
instance attribute, and the network is moved to the GPU by hand, as those trainers do. The peft
arm is ``build_target``'s model (peft's layers inside the blocks). Both start from the same base
weights and the same adapter values (down Kaiming-uniform from one seed, up zero). Each arm is
``vramkit.fit(model_on_host, inputs, cap)``, planned with ``hardware=None`` (this GPU measured,
its blocks calibrated -- with the kohya network's adapters), and they alternate in ABBA rounds
in one process, each under the card's cap (``benchmarks/plan.py``'s ``Card``: the process is
capped at what the other arm holds plus the card).

Printed: each arm's median step, the kohya/peft ratio with the spread of the per-round ratios,
each arm's prediction error and peak against the cap, and whether the kohya arm trained (its
loss moved, every adapter got a gradient). The target: the kohya step within 2 % of peft's,
its prediction within 5 %.

Run (GPU, ~3 min on an H200): PYTHONPATH=src python3 benchmarks/adapters.py --out out/adapters
Run (CPU, code paths only):   PYTHONPATH=src python3 benchmarks/adapters.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' toy network
from tests._toys import KohyaLoRANetwork

from _common import add_common_args, write_result
from _timing import log
from plan import (
    FLUX_LORA,
    GIB,
    Arm,
    Card,
    Settings,
    alternate,
    copy_to,
    gpu_profile_name,
    loss_of,
    materialize,
    meta_target,
    real_inputs,
    tiny_folder,
    warm,
)
from vramkit.devices.resolve import resolve_device
from vramkit.io.adapters import peft_base_key

RANK = 16


def plain_target(s: Settings) -> Any:
    """FLUX without adapters (the kohya arm's base), on meta."""
    from vramkit.recipes.targets import build_target

    name = tiny_folder("flux") if s.tiny else "flux-dev"
    options: dict[str, Any] = {"mode": "infer"}
    if s.tiny:
        options.update(resolution=64, seq_len=8)
    return build_target(name, **options)


@torch.no_grad()
def kohya_model(peft_host: nn.Module, s: Settings, device: torch.device,
                ) -> tuple[nn.Module, KohyaLoRANetwork]:
    """The plain model with ``peft_host``'s base weights on the host, and a kohya-style network
    over the same layers with peft's adapter values (down = lora_A, up = lora_B), on
    ``device``."""
    model = plain_target(s).model
    model.to_empty(device="cpu")
    theirs = {peft_base_key(n): t for n, t in [*peft_host.named_parameters(),
                                                *peft_host.named_buffers()]}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t.copy_(theirs[name])
    model.requires_grad_(False)
    targets = [t.split(".")[0] for t in FLUX_LORA]  # "to_out.0" -> the Linear "to_out.0"
    net = KohyaLoRANetwork(model, targets, rank=RANK, alpha=float(RANK), prefix="lora_unet")
    peft_state = dict(peft_host.named_parameters())
    for lora in net.loras:
        path = lora.lora_name.removeprefix("lora_unet_")
        match = [n for n in peft_state if n.endswith(".lora_A.default.weight")
                 and n.replace(".", "_").startswith(path + "_lora_A")]
        assert len(match) == 1, (lora.lora_name, match)
        lora.lora_down.weight.copy_(peft_state[match[0]])
        lora.lora_up.weight.copy_(peft_state[match[0].replace("lora_A", "lora_B")])
    net.apply_to()
    net.to(device)  # beside the model: fit does not move it, the trainer does
    return model, net


def adapter_arm(name: str, model: nn.Module, params: list[nn.Parameter],
                inputs: dict[str, Any], device: torch.device) -> Arm:
    """A LoRA training step on ``params`` (bf16 autocast, AdamW made on first use, after
    ``fit`` moved what it moves): ``plan.py``'s ``train_arm`` with the adapters named, since a
    network beside the model is not among its parameters."""
    state: dict[str, Any] = {}

    def step() -> float:
        if "opt" not in state:
            state["opt"] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, inputs, "diffusers")
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        return float(loss.detach())

    return Arm(name, step, capped=True)


def run(s: Settings, cap_gib: float) -> dict[str, Any]:
    import vramkit

    device = resolve_device(s.device, owner="benchmarks/adapters.py")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashed on FLUX shapes (architecture.md)
    t0 = time.perf_counter()
    target = meta_target("flux", s)
    twin = materialize(target, device, s.seed)
    peft_host = copy_to(twin, meta_target("flux", s).model, torch.device("cpu"))
    del twin
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    kohya_host, net = kohya_model(peft_host, s, device)
    inputs = real_inputs(target.inputs, device, None, s.seed + 1)
    assert not any(t.requires_grad for t in inputs.values() if isinstance(t, torch.Tensor))
    build_s = time.perf_counter() - t0
    log(f"built both models in {build_s:.1f} s")
    options: dict[str, Any] = {"step": target.step}
    if device.type != "cuda":
        options["hardware"] = gpu_profile_name(device)
    budget = int(cap_gib * GIB)
    if s.tiny:  # the larger of the two arms' smallest budgets: both swap
        from vramkit.errors import PlanError

        budget = 0
        for model in (peft_host, kohya_host):
            try:
                vramkit.plan(model, inputs, 1, **options)
            except PlanError as exc:
                budget = max(budget, int(exc.minimum_budget or 0))
    plans, fitted = {}, {}
    card = Card(device, budget)
    arms = {}
    for name, model in (("peft", peft_host), ("kohya", kohya_host)):
        t1 = time.perf_counter()
        plans[name] = vramkit.plan(model, inputs, budget, device=device
                                   if device.type == "cuda" else None, **options)
        log(f"{name}: planned in {time.perf_counter() - t1:.1f} s; "
            f"{len(plans[name].swapped)} swapped, {len(plans[name].checkpointed)} checkpointed, "
            f"predicted {plans[name].predicted_step_seconds * 1e3:.0f} ms")
        params = (list(net.parameters()) if name == "kohya"
                  else [p for p in model.parameters() if p.requires_grad])
        arm = adapter_arm(name, model, params, inputs, device)
        arms[name] = arm

        def attach(model: nn.Module = model, name: str = name) -> None:
            fitted[name] = vramkit.fit(model, inputs, budget, plan=plans[name], device=device)

        warm(card, arm, attach)
    kohya_params = list(net.parameters())
    before = [p.detach().clone() for p in kohya_params]
    try:
        alternate(card, (arms["kohya"], arms["peft"]), s)
    finally:
        card.release()
    moved = sum(not torch.equal(a, p.detach()) for a, p in zip(before, kohya_params,
                                                                strict=True))
    row: dict[str, Any] = {"cap_gib": cap_gib, "budget_bytes": budget, "build_s": build_s}
    for name, arm in arms.items():
        plan = plans[name]
        step = statistics.median(arm.seconds)
        row[f"{name}_s"] = step
        row[f"{name}_predicted_s"] = plan.predicted_step_seconds
        row[f"{name}_step_error"] = step / plan.predicted_step_seconds - 1
        row[f"{name}_plan"] = {"swapped": len(plan.swapped), "checkpointed":
                               len(plan.checkpointed), "slots": plan.num_slots}
        row[f"{name}_explain"] = plan.explain()
        if device.type == "cuda":
            row[f"{name}_peak"] = arm.peak
            row[f"{name}_under_budget"] = arm.peak <= budget
        row[f"{name}_losses"] = arm.losses
    per_round = [k / p for k, p in zip(arms["kohya"].seconds, arms["peft"].seconds,
                                       strict=False)]
    row["ratio"] = row["kohya_s"] / row["peft_s"]
    row["ratio_spread"] = [min(per_round), max(per_round)] if per_round else None
    row["kohya_trained"] = moved == len(kohya_params) and len(set(arms["kohya"].losses)) > 1
    row["kohya_lean_blocks"] = sum(
        1 for b in getattr(fitted["kohya"].swapper, "blocks", [])
        if b.lean is not None and b.lean.verdict is True) if fitted["kohya"].swapper else None
    for handle in fitted.values():
        handle.detach()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--cap", type=float, default=11.5, help="the card, GiB (default 11.5)")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    parser.add_argument("--steps-per-arm", type=int, default=2,
                        help="steps in each turn, the first untimed (default 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny FLUX (the code paths)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    s = Settings(device=args.device, tiny=args.tiny or args.device == "cpu",
                 rounds=args.rounds, steps_per_arm=args.steps_per_arm)
    row = run(s, args.cap)
    spread = row["ratio_spread"] or [float("nan")] * 2
    md = {"cap": f"{args.cap} GiB", "peft step": f"{row['peft_s'] * 1e3:.0f} ms",
          "kohya step": f"{row['kohya_s'] * 1e3:.0f} ms",
          "kohya / peft": f"{row['ratio']:.3f} ({spread[0]:.3f}-{spread[1]:.3f})",
          "peft pred. err": f"{100 * row['peft_step_error']:+.1f} %",
          "kohya pred. err": f"{100 * row['kohya_step_error']:+.1f} %",
          "kohya trains": row["kohya_trained"], "kohya lean blocks": row["kohya_lean_blocks"]}
    if "kohya_peak" in row:
        md["kohya peak"] = f"{row['kohya_peak'] / GIB:.2f} GiB"
        md["peft peak"] = f"{row['peft_peak'] / GIB:.2f} GiB"
    write_result("adapters", {"settings": vars(args) | {"out": str(args.out)}, "row": row},
                 [md], args.out)
    ok = (row["kohya_trained"] and abs(row["ratio"] - 1) <= 0.02
          and abs(row["kohya_step_error"]) <= 0.05)
    log("target met" if ok else "target NOT met (kohya within 2 % of peft, prediction "
        "within 5 %, trains)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
