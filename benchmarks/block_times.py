"""The offline time model against the GPU: one block of each kind of the shipped model presets,
timed on this GPU the way ``calibrate_blocks`` times it (device time with the host held off by
a spin kernel, the host's enqueue time the median of warm-up rounds), beside what the offline model
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
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.planning import calibration
from vramkit.planning.analysis import analyze
from vramkit.planning.hardware import PROFILES, hardware_profile
from vramkit.planning.machine import ACHIEVED_FRACTION, Machine, phase_work
from vramkit.recipes.targets import build_target, list_presets


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


def measure(names: list[str], device: torch.device, repeats: int, tiny: bool
            ) -> list[dict[str, Any]]:
    """One record per block kind and phase: ``model``, ``block`` (its first block), ``phase``,
    ``type``, ``device_s``, ``host_s`` (as ``calibrate_blocks`` records them)."""
    records: list[dict[str, Any]] = []
    for name in names:
        target = build_target(name, **_options(name, tiny))
        times = calibration.calibrate_blocks(target.model, target.inputs, step=target.step,
                                             device=device, repeats=repeats)
        # every block of a kind shares its kind's record: the first block of each kind
        seen: set[int] = set()
        for block_name, call in times.calls["full"].items():
            if block_name in times.fallbacks or id(call) in seen:
                continue
            seen.add(id(call))
            kind = type(target.model.get_submodule(block_name)).__name__
            for phase, device_s, host_s in (("fwd", call.forward, call.host_forward),
                                            ("bwd", call.backward, call.host_backward)):
                records.append({"model": name, "block": block_name, "phase": phase,
                                "type": kind, "device_s": device_s, "host_s": host_s})
    return records


def _options(name: str, tiny: bool) -> dict[str, Any]:
    if not tiny:
        return {}
    return {"seq_len": 128} if "llama" in name else {"resolution": 256}


def evaluate(records: list[dict[str, Any]], machine: Machine, tiny: bool
             ) -> list[dict[str, Any]]:
    """Each record with the offline model's time (``model_s``, its device part
    ``model_device_s``) and the single share of the peak's (``single_share_s``), from the
    block's work counted on meta (CPU only)."""
    costs: dict[str, Any] = {}
    share = machine.peak_flops_per_s * ACHIEVED_FRACTION  # type: ignore[operator]
    results = []
    for record in records:
        name = record["model"]
        if name not in costs:
            target = build_target(name, **_options(name, tiny))
            costs[name] = analyze(target.model, target.inputs, step=target.step)
        cost = costs[name]
        block = cost.blocks[cost.block_index[record["block"]]]
        forward, backward = machine.block_seconds(block.forward_flops, block.backward_flops,
                                                  block.work)
        fwd = record["phase"] == "fwd"
        phase = phase_work(block.work, block.backward_flops)[0 if fwd else 1]
        device = machine.device_seconds(*phase[:4])
        results.append({**record, "measured_s": max(record["device_s"], record["host_s"]),
                        "model_s": forward if fwd else backward, "model_device_s": device,
                        "single_share_s": (block.forward_flops if fwd
                                           else block.backward_flops) / share})
    return results


def _err(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f} %" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(list_presets()),
                        help="comma-separated presets (default: all)")
    parser.add_argument("--profile", default=None,
                        help="the hardware profile the model is evaluated with (default: "
                             "picked from the GPU's name; h100-sxm with --measured)")
    parser.add_argument("--measured", type=Path, default=None,
                        help="evaluate the model against the records of an earlier run (its "
                             "block_times.json, or benchmarks/data/block_times_h100.json) "
                             "instead of timing: CPU only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: 256x256 images / 128 tokens")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.measured is not None:
        stored = json.loads(args.measured.read_text(encoding="utf-8"))
        records = [{k: r[k] for k in ("model", "block", "phase", "type", "device_s", "host_s")}
                   for r in stored["rows"]]
        profile = args.profile or stored.get("summary", {}).get("profile", "h100-sxm")
    else:
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + H100: illegal access
            device = torch.device("cuda", torch.cuda.current_device())
        profile = _profile_for(device, args.profile)
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        records = measure(names, device, args.repeats, args.tiny)
    machine = Machine.from_profile(hardware_profile(profile))
    results = evaluate(records, machine, args.tiny)
    rows = [{"model": r["model"], "block": r["block"], "phase": r["phase"],
             "device ms": f"{r['device_s'] * 1e3:.2f}", "host ms": f"{r['host_s'] * 1e3:.2f}",
             "measured ms": f"{r['measured_s'] * 1e3:.2f}",
             f"model ms ({profile})": f"{r['model_s'] * 1e3:.2f}",
             "model err": _err(r["model_s"], r["measured_s"]),
             "model device err": _err(r["model_device_s"], r["device_s"]),
             "single share ms": f"{r['single_share_s'] * 1e3:.2f}",
             "single share err": _err(r["single_share_s"], r["measured_s"])}
            for r in results]

    def errors(key: str, against: str, only: Any = None) -> list[float]:
        return [abs(r[key] / r[against] - 1) for r in results
                if r[against] and (only is None or only(r))]

    def large(r: dict[str, Any]) -> bool:  # blocks with > 1 ms of device work
        return r["device_s"] > 1e-3

    summary = {"profile": profile, "blocks_and_phases": len(results)}
    for label, key, against, only in (
            ("model", "model_s", "measured_s", None),
            ("single_share", "single_share_s", "measured_s", None),
            ("model_device_large_blocks", "model_device_s", "device_s", large)):
        found = errors(key, against, only)
        summary[f"{label}_mean_abs_error"] = statistics.mean(found) if found else None
        summary[f"{label}_max_abs_error"] = max(found, default=None)
    write_result("block_times", {"summary": summary, "rows": results}, rows, args.out)
    print(f"\nmodel: mean |error| {summary['model_mean_abs_error']:.1%}, max "
          f"{summary['model_max_abs_error']:.1%}; single share of the peak: mean "
          f"{summary['single_share_mean_abs_error']:.1%}, max "
          f"{summary['single_share_max_abs_error']:.1%} ({len(results)} block phases, "
          f"{profile}); the model's device part on blocks of > 1 ms: mean "
          f"{summary['model_device_large_blocks_mean_abs_error']:.1%}, max "
          f"{summary['model_device_large_blocks_max_abs_error']:.1%}")


if __name__ == "__main__":
    main()
