"""Replay a real allocation trace: how much memory does each allocator reserve for it?

1. Record: a small transformer training step (``nn.TransformerEncoderLayer`` x N, bf16, each layer
   under ``torch.utils.checkpoint``, AdamW) runs in a fresh subprocess with
   ``torch.cuda.memory._record_memory_history``; its alloc/free sequence is saved as JSON.
2. Replay the same sequence, each in a fresh subprocess:
   * ``torch``: PyTorch's default caching allocator (``torch.empty`` / ``del``);
   * ``expandable``: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``;
   * ``arena``: a vramkit ``MemoryPool`` with default settings;
   * ``arena_tight``: a ``MemoryPool`` with ``growth_factor=1.25`` and no exact-size cache.
3. Report peak reserved / peak requested for each (requested = the trace's live bytes).

Run (GPU):  PYTHONPATH=src python benchmarks/trace_replay.py --out out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.units import format_size

MODES = ("torch", "expandable", "arena", "arena_tight")
_ALLOC_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

Event = tuple[str, int, int]  # ("a" | "f", address, bytes)


# -- recording ---------------------------------------------------------------------------------


def record_trace(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training steps under the memory recorder; return the trace and context."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    try:  # no stacks: only the alloc/free sequence is needed, and stacks slow the step down
        torch.cuda.memory._record_memory_history(enabled="all", context=None,
                                                  max_entries=5_000_000)
    except TypeError:  # older signature
        torch.cuda.memory._record_memory_history(max_entries=5_000_000)
    layers = nn.ModuleList(
        nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, batch_first=True,
                                   device=device, dtype=torch.bfloat16)
        for _ in range(args.layers))
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-4)
    for _ in range(args.steps):
        hidden = torch.randn(args.batch, args.seq, args.d_model, device=device,
                             dtype=torch.bfloat16)
        for layer in layers:
            hidden = checkpoint(layer, hidden, use_reentrant=False)
        loss = hidden.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del hidden, loss
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = extract_events(snapshot, device.index)
    return {
        "events": events,
        "model": {k: getattr(args, k) for k in ("layers", "d_model", "heads", "batch", "seq",
                                                "steps")},
        "recorded_peak_allocated": torch.cuda.max_memory_allocated(device),
        "recorded_peak_reserved": torch.cuda.max_memory_reserved(device),
    }


def extract_events(snapshot: dict[str, Any], device_index: int) -> list[Event]:
    """The alloc/free sequence of one device from a ``torch.cuda.memory._snapshot()``.

    Frees are taken at ``free_completed`` (when the memory could really be reused), or at
    ``free_requested`` when the trace has no completions.
    """
    trace = snapshot["device_traces"][device_index]
    completed = any(entry["action"] == "free_completed" for entry in trace)
    free_action = "free_completed" if completed else "free_requested"
    events: list[Event] = []
    for entry in trace:
        if entry["action"] == "alloc":
            events.append(("a", entry["addr"], entry["size"]))
        elif entry["action"] == free_action:
            events.append(("f", entry["addr"], entry["size"]))
    return events


def peak_requested(events: list[Event]) -> tuple[int, int]:
    """Peak of live bytes over the trace, and the number of allocations."""
    live: dict[int, int] = {}
    current = peak = allocations = 0
    for op, address, size in events:
        if op == "a":
            current -= live.pop(address, 0)
            live[address] = size
            current += size
            allocations += 1
            peak = max(peak, current)
        else:
            current -= live.pop(address, 0)
    return peak, allocations


# -- replay ------------------------------------------------------------------------------------


def replay(mode: str, events: list[Event], device: str) -> dict[str, Any]:
    """Replay ``events`` with one allocator in this process; return its peaks."""
    from vramkit.memory.pool import MemoryPool, PoolConfig

    on_cuda = device.startswith("cuda")
    pool = None
    if mode == "arena":
        pool = MemoryPool(device, PoolConfig(enable_memory_tracking=False))
    elif mode == "arena_tight":
        pool = MemoryPool(device, PoolConfig(growth_factor=1.25, max_cached_buffers=0,
                                             enable_memory_tracking=False))
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    live: dict[int, Any] = {}
    start = time.perf_counter()
    for op, address, size in events:
        if op == "a":
            old = live.pop(address, None)
            if old is not None and pool is not None:
                pool.free(old)
            if pool is not None:
                live[address] = pool.allocate(size)
            else:
                live[address] = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            held = live.pop(address, None)
            if held is not None and pool is not None:
                pool.free(held)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {"mode": mode, "replay_seconds": elapsed}
    if on_cuda:
        result["torch_peak_reserved"] = torch.cuda.max_memory_reserved()
    if pool is not None:
        stats = pool.stats()
        result.update(peak_reserved=stats.peak_reserved, segments=stats.segments,
                      pool_stats=stats.to_dict())
    else:
        result["peak_reserved"] = result["torch_peak_reserved"]
    return result


def run_worker(mode: str, trace_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run one replay (or the recording) in a fresh Python process."""
    env = {k: v for k, v in os.environ.items() if k not in _ALLOC_ENV_VARS}
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", mode,
               "--trace", str(trace_path), "--device", args.device,
               "--layers", str(args.layers), "--d-model", str(args.d_model),
               "--heads", str(args.heads), "--batch", str(args.batch), "--seq", str(args.seq),
               "--steps", str(args.steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"mode": mode, "error": done.stderr.strip().splitlines()[-20:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="replay device (cpu: arena modes only)")
    parser.add_argument("--trace", type=Path, help="use this recorded trace instead of recording")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated replay modes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args()

    if args.worker == "record":
        trace = record_trace(args)
        args.trace.write_text(json.dumps(trace), encoding="utf-8")
        print(json.dumps({"mode": "record", "events": len(trace["events"])}))
        return
    if args.worker:
        events = [tuple(e) for e in json.loads(args.trace.read_text(encoding="utf-8"))["events"]]
        print(json.dumps(replay(args.worker, events, args.device)))  # type: ignore[arg-type]
        return

    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.trace or args.out / "trace_replay_trace.json"
    if args.trace is None:
        recorded = run_worker("record", trace_path, args)
        if "error" in recorded:
            raise SystemExit("recording failed:\n" + "\n".join(recorded["error"]))
    trace = json.loads(trace_path.read_text(encoding="utf-8"))
    events = [tuple(e) for e in trace["events"]]
    requested, allocations = peak_requested(events)  # type: ignore[arg-type]
    results = {mode: run_worker(mode, trace_path, args) for mode in args.modes.split(",")}
    rows = []
    for mode, res in results.items():
        if "error" in res:
            rows.append({"allocator": mode, "peak reserved": "failed", "peak requested":
                         format_size(requested), "reserved / requested": "", "replay s": ""})
            continue
        res["reserved_over_requested"] = res["peak_reserved"] / requested
        rows.append({
            "allocator": mode,
            "peak reserved": format_size(res["peak_reserved"]),
            "peak requested": format_size(requested),
            "reserved / requested": res["reserved_over_requested"],
            "replay s": res["replay_seconds"],
        })
    result = {
        "trace": {"events": len(events), "allocations": allocations,
                  "peak_requested": requested, "model": trace.get("model"),
                  "recorded_peak_allocated": trace.get("recorded_peak_allocated"),
                  "recorded_peak_reserved": trace.get("recorded_peak_reserved")},
        "replays": results,
        "note": "arena peak_reserved counts the pool's segments; torch_peak_reserved in the arena "
                "rows is what PyTorch reserved underneath them (segment rounding included).",
    }
    write_result("trace_replay", result, rows, args.out)


if __name__ == "__main__":
    main()
