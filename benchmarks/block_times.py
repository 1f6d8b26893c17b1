"""The offline time model against the GPU: one block of each kind of the shipped model presets,
timed on this GPU the way ``calibrate_blocks`` times it (device time with the host held off by
a spin kernel, the host's enqueue time from a warm-up round), beside what the offline model
predicts for the same block from its counted work (``Machine.work_seconds`` on this GPU's
profile, e.g. ``h100-sxm``) and what the older single share of the peak (``ACHIEVED_FRACTION``)
predicted. Prints per block and phase: device ms, host ms, measured = max(device, host), the
model's ms and its error, the single share's ms and its error.

The model's coefficients (``vramkit.planning.machine``) were fitted on these rows; rerun this on
another GPU to see how far they carry.

Run (GPU): PYTHONPATH=src python3 benchmarks/block_times.py --out out/block_times
           (models: --models flux-dev,llama-3.1-8b,... ; default all presets; needs diffusers,
           transformers, peft)
Run (CPU, code path): PYTHONPATH=src python3 benchmarks/block_times.py --device cpu
                      --models flux-dev --tiny
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
from vramkit.planning.analysis import analyze
from vramkit.planning.hardware import PROFILES, hardware_profile
from vramkit.planning.machine import ACHIEVED_FRACTION, Machine
from vramkit.planning.models import build_target, list_presets
from vramkit.planning.planner import _work_seconds

_RECORDS: list[dict[str, Any]] = []


def _timed_block(block: torch.nn.Module, args: Any, kwargs: Any, device: torch.device,
                 train: bool, autocast: torch.dtype | None, repeats: int
                 ) -> tuple[float, float]:
    """calibration._time_block with the device and host times kept apart (recorded)."""
    cuda = device.type == "cuda"
    context = torch.autocast(device.type, dtype=autocast) if autocast is not None and train else None
    clocks = {"fwd": calibration._Clock(device), "bwd": calibration._Clock(device)}
    times: dict[str, list[tuple[float, float]]] = {"fwd": [], "bwd": []}

    def region(phase: str, timing: bool, fn: Any) -> Any:
        clock = clocks[phase]
        clock.timing = timing
        started = clock.start()
        out = fn()
        host_start = started[1] if cuda else started
        host = time.perf_counter() - host_start
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            dev = started[0].elapsed_time(end) / 1e3
        else:
            dev = host
        if not timing:
            clock.host_s = host
        else:
            times[phase].append((dev, clock.host_s))
        return out

    for round_ in range(repeats + calibration._WARMUP_ROUNDS):
        timing = round_ >= calibration._WARMUP_ROUNDS
        with torch.set_grad_enabled(train):
            def forward() -> Any:
                if context is not None:
                    with context:
                        return block(*args, **kwargs)
                return block(*args, **kwargs)
            out = region("fwd", timing, forward)
        if train:
            outputs = calibration._float_outputs(out)
            if outputs:
                grads = [torch.ones_like(t) for t in outputs]
                region("bwd", timing, lambda o=outputs, g=grads: torch.autograd.backward(o, g))
            for p in block.parameters():
                p.grad = None
        del out
    record: dict[str, Any] = {"type": type(block).__name__}
    for phase, rows in times.items():
        record[f"{phase}_device_s"] = statistics.median(r[0] for r in rows) if rows else 0.0
        record[f"{phase}_host_s"] = rows[-1][1] if rows else 0.0
    _RECORDS.append(record)
    return (max(record["fwd_device_s"], record["fwd_host_s"]),
            max(record["bwd_device_s"], record["bwd_host_s"]))


def _profile_for(device: torch.device, name: str | None) -> str:
    if name:
        return name
    if device.type != "cuda":
        return "h100-sxm"
    gpu = torch.cuda.get_device_name(device).lower()
    for key, profile in (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
                         ("a100", "a100-80gb"), ("l4", "l4"), ("4090", "rtx4090")):
        if key in gpu and profile in PROFILES:
            return profile
    return "h100-sxm"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(list_presets()),
                        help="comma-separated presets (default: all)")
    parser.add_argument("--profile", default=None,
                        help="the hardware profile the model is evaluated with (default: "
                             "picked from the GPU's name)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: 256x256 images / 128 tokens")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + H100: illegal memory access
        device = torch.device("cuda", torch.cuda.current_device())
    profile = _profile_for(device, args.profile)
    machine = Machine.from_profile(hardware_profile(profile))
    calibration._time_block = _timed_block  # keep device and host apart
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        options: dict[str, Any] = {}
        if args.tiny:
            options = ({"seq_len": 128} if "llama" in name else {"resolution": 256})
        target = build_target(name, **options)
        cost = analyze(target.model, target.inputs, step=target.step)
        _RECORDS.clear()
        times = calibration.calibrate_blocks(target.model, target.inputs, step=target.step,
                                             device=device, repeats=args.repeats)
        # one record per kind, in the order calibrate_blocks timed them: its first block
        seen: list[str] = []
        for block_name in times.forward:
            if block_name in times.fallbacks:
                continue
            key = (times.forward[block_name], times.backward[block_name])
            if any((times.forward[n], times.backward[n]) == key for n in seen):
                continue
            seen.append(block_name)
        for block_name, record in zip(seen, _RECORDS, strict=False):
            block = cost.blocks[cost.block_index[block_name]]
            model_fwd, model_bwd = _work_seconds(machine, block.forward_flops,
                                                 block.backward_flops, block.work)
            share = machine.peak_flops_per_s * ACHIEVED_FRACTION  # type: ignore[operator]
            for phase, predicted, flops in (("fwd", model_fwd, block.forward_flops),
                                            ("bwd", model_bwd, block.backward_flops)):
                measured = max(record[f"{phase}_device_s"], record[f"{phase}_host_s"])
                old = flops / share
                result = {"model": name, "block": block_name, "type": record["type"],
                          "phase": phase, "device_s": record[f"{phase}_device_s"],
                          "host_s": record[f"{phase}_host_s"], "measured_s": measured,
                          "model_s": predicted, "single_share_s": old}
                results.append(result)
                rows.append({
                    "model": name, "block": block_name, "phase": phase,
                    "device ms": f"{result['device_s'] * 1e3:.2f}",
                    "host ms": f"{result['host_s'] * 1e3:.2f}",
                    "measured ms": f"{measured * 1e3:.2f}",
                    f"model ms ({profile})": f"{predicted * 1e3:.2f}",
                    "model err": f"{(predicted / measured - 1) * 100:+.1f} %" if measured else "-",
                    "single share ms": f"{old * 1e3:.2f}",
                    "single share err": f"{(old / measured - 1) * 100:+.1f} %" if measured else "-",
                })
    errors = [abs(r["model_s"] / r["measured_s"] - 1) for r in results if r["measured_s"]]
    old_errors = [abs(r["single_share_s"] / r["measured_s"] - 1) for r in results
                  if r["measured_s"]]
    summary = {"profile": profile, "blocks_and_phases": len(errors),
               "model_mean_abs_error": statistics.mean(errors) if errors else None,
               "model_max_abs_error": max(errors, default=None),
               "single_share_mean_abs_error": statistics.mean(old_errors) if old_errors else None,
               "single_share_max_abs_error": max(old_errors, default=None)}
    write_result("block_times", {"summary": summary, "rows": results}, rows, args.out)
    print(f"\nmodel: mean |error| {summary['model_mean_abs_error']:.1%}, max "
          f"{summary['model_max_abs_error']:.1%}; single share of the peak: mean "
          f"{summary['single_share_mean_abs_error']:.1%}, max "
          f"{summary['single_share_max_abs_error']:.1%} ({len(errors)} block phases, {profile})")


if __name__ == "__main__":
    main()
