"""Host time of quantized layers: the replayed Triton launch against Triton's JIT launch.

A block of quantized layers is host-bound on a fast GPU when each layer's call costs the host
more than its kernels cost the device. Two parts, each timing vramkit's replayed launch
(``vramkit.quant._triton.Dequantizer``: the compiled kernel called directly after the first
launch) against the JIT launch it replaces (``kernel[grid](...)`` at every call, what every
call did before), in alternating rounds of one run:

* **launch**: host microseconds per dequantize of one fp8 3072 x 12288 weight (FLUX's MLP),
  launches enqueued back to back (median over rounds; the device time of the kernel beside
  it);
* **blocks**: one block of each kind of a preset (default ``flux-dev``: its double and single
  blocks, LoRA r16 on ``to_q, to_k, to_v, to_out.0``, 1024 x 1024), forward + backward under
  bf16 autocast, as the planner's calibration times it (device time with the host held off,
  the host's enqueue time apart), in bf16 and with its frozen layers stored as fp8, each layer
  dequantized at its call or the block's layers together (``vramkit.quant.dense``, whose
  batched fp8 dequantize and one-token decode kernels replay their launches the same way).
  Prints per block and phase the device and host ms of bf16, fp8 and fp8 together (replayed
  and JIT), and their host and device time over bf16's.

Run (GPU): PYTHONPATH=src python3 benchmarks/quant_host.py --out out/quant_host
           (needs diffusers for flux-dev, peft for the adapters)
Run (CPU, code path only: no Triton there): PYTHONPATH=src python3 benchmarks/quant_host.py
           --device cpu --tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.planning import calibration
from vramkit.quant import kernels
from vramkit.quant.formats import quantize_tensor
from vramkit.recipes.targets import build_target

FLUX_LORA = ["to_q", "to_k", "to_v", "to_out.0"]


def _set_replay(on: bool) -> None:
    """Replayed launches on (vramkit) or off (every launch through Triton's JIT)."""
    if kernels.triton_available("cuda"):
        from vramkit.quant import _triton

        _triton._FAST_LAUNCH[0] = on


def launch_part(device: torch.device, rounds: int, calls: int) -> dict[str, Any]:
    """Host us per dequantize call of a 3072 x 12288 fp8 weight, replayed vs JIT."""
    weight = torch.randn(3072, 12288, device=device, dtype=torch.bfloat16)
    q = quantize_tensor(weight, "fp8")
    plan = kernels.DequantPlan(q.config, q.shape, tuple(q.tensors()))
    packed = list(q.tensors().values())
    host: dict[str, list[float]] = {"replay": [], "jit": []}
    for _ in range(2):  # compile, and the first replay
        plan(packed, torch.bfloat16)
    for _ in range(rounds):
        for arm in ("replay", "jit"):
            _set_replay(arm == "replay")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda._sleep(int(2e9 * 0.05))  # the device busy: launches only queue
            started = time.perf_counter()
            for _ in range(calls):
                plan(packed, torch.bfloat16)
            host[arm].append((time.perf_counter() - started) / calls * 1e6)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    _set_replay(True)
    device_us = 0.0
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            plan(packed, torch.bfloat16)
        end.record()
        end.synchronize()
        device_us = start.elapsed_time(end) * 1e3 / calls
    replay, jit = statistics.median(host["replay"]), statistics.median(host["jit"])
    return {"replay_host_us": replay, "jit_host_us": jit, "jit_over_replay": jit / replay,
            "device_us": device_us, "rounds": host}


def blocks_part(model: str, device: torch.device, rounds: int, repeats: int,
                tiny: bool) -> list[dict[str, Any]]:
    """Per block kind and phase: bf16, fp8 replayed and fp8 JIT device and host seconds
    (medians over ``rounds`` alternating calibrations)."""
    options: dict[str, Any] = {"lora_targets": FLUX_LORA} if "flux" in model else {}
    if tiny:
        options.update({"seq_len": 128} if "llama" in model else {"resolution": 256})
    target = build_target(model, **options)
    samples: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    kinds: list[str] = []
    for _ in range(rounds):
        for arm in ("replay", "jit"):
            _set_replay(arm == "replay")
            times = calibration.calibrate_blocks(target.model, target.inputs, step=target.step,
                                                 device=device, repeats=repeats,
                                                 formats=("fp8",))
            seen: set[int] = set()  # the first block of each kind (a kind shares its record)
            for name, call in times.calls["full"].items():
                if name in times.fallbacks or id(call) in seen:
                    continue
                seen.add(id(call))
                kind = type(target.model.get_submodule(name)).__name__
                if kind not in kinds:
                    kinds.append(kind)
                for storage, timed in (("bf16", call), ("fp8", times.calls["fp8"][name]),
                                       ("together", times.calls["fp8+together"][name])):
                    label = storage if storage == "bf16" else f"{storage} {arm}"
                    for phase, sides in (("fwd", (timed.forward, timed.host_forward)),
                                         ("bwd", (timed.backward, timed.host_backward))):
                        samples.setdefault((kind, phase, label), []).append(sides)
    _set_replay(True)
    rows = []
    for kind in kinds:
        for phase in ("fwd", "bwd"):
            row: dict[str, Any] = {"block": kind, "phase": phase}
            for label in ("bf16", "fp8 replay", "fp8 jit", "together replay", "together jit"):
                got = samples[(kind, phase, label)]
                row[f"{label} device_s"] = statistics.median(d for d, _ in got)
                row[f"{label} host_s"] = statistics.median(h for _, h in got)
                row[f"{label} rounds"] = got  # (device, host) of each round, in the JSON
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="flux-dev", help="the preset whose blocks are timed")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per part")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per calibration")
    parser.add_argument("--calls", type=int, default=200, help="launches per launch round")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: small inputs")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + H100: illegal access
        device = torch.device("cuda", torch.cuda.current_device())
    launch = launch_part(device, args.rounds, args.calls if not args.tiny else 5)
    print(f"launch: replayed {launch['replay_host_us']:.1f} us, JIT {launch['jit_host_us']:.1f}"
          f" us of host per dequantize ({launch['jit_over_replay']:.2f}x); the kernel "
          f"{launch['device_us']:.1f} us on the device", flush=True)
    rows = blocks_part(args.model, device, args.rounds, args.repeats, args.tiny)

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    table = []
    for r in rows:
        table.append({
            "block": r["block"], "phase": r["phase"],
            "bf16 device / host ms": f"{ms(r['bf16 device_s'])} / {ms(r['bf16 host_s'])}",
            "fp8 device / host ms": (f"{ms(r['fp8 replay device_s'])} / "
                                     f"{ms(r['fp8 replay host_s'])}"),
            "fp8 JIT-launch device / host ms": (f"{ms(r['fp8 jit device_s'])} / "
                                                f"{ms(r['fp8 jit host_s'])}"),
            "fp8 / bf16 host": f"{r['fp8 replay host_s'] / r['bf16 host_s']:.2f}",
            "fp8 JIT / bf16 host": f"{r['fp8 jit host_s'] / r['bf16 host_s']:.2f}",
            "fp8 / bf16 device": f"{r['fp8 replay device_s'] / r['bf16 device_s']:.2f}",
            "fp8 together device / host ms": (f"{ms(r['together replay device_s'])} / "
                                              f"{ms(r['together replay host_s'])}"),
            "together JIT-launch device / host ms": (f"{ms(r['together jit device_s'])} / "
                                                     f"{ms(r['together jit host_s'])}"),
            "together / bf16 host": f"{r['together replay host_s'] / r['bf16 host_s']:.2f}",
        })
    write_result("quant_host", {"launch": launch, "blocks": rows}, table, args.out)


if __name__ == "__main__":
    main()
