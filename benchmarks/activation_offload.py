"""Activation offload benchmark: step time and peak memory with and without offloading.

A transformer-ish stack (pre-norm attention + 4x MLP blocks, bf16, batch 1) runs forward and
backward at each token count in three modes:

* ``resident``: no offload, every saved activation stays on the GPU;
* ``torch_save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, PyTorch's own
  hooks (copies on the compute stream, loads on demand, parameters included);
* ``vramkit``: :class:`vramkit.offload.activations.ActivationOffloader` (copy streams, prefetch,
  pinned pool, parameters skipped).

For each it reports ``step ms``: the median over the measured steps of the GPU time from the
start of forward to the end of backward *with the copy streams joined* (the compute stream waits
for outstanding offload copies before the step's end event), the same definition in every mode;
``wall ms``, the wall clock per step over the whole run (throughput: above ``step ms`` when the
GPU idles between steps); forward, backward and end-of-step copy wait medians; ``host ms``, the
host time to issue one step (above the GPU step time, the host is the bottleneck); ``gap ms``,
GPU idle between steps; the peak of ``torch.cuda.max_memory_allocated`` above the memory held
before the step (the parameters), and the ratios to ``resident``. The JSON also has per-step
lists (``step_ms_each``, ``gap_ms_each``, ``host_ms_each``) and, for ``vramkit``, the pinned
pool's reserved bytes, segment count and pool allocations after each step (``pool_per_step``).
``--trace`` writes a torch.profiler trace of two steps per mode. On a machine without CUDA it
runs a tiny model on the CPU to exercise the script (no memory figures, ``vramkit`` only beside
``resident``).

Run (GPU):  PYTHONPATH=src python3 benchmarks/activation_offload.py --out out
Quick:      PYTHONPATH=src python3 benchmarks/activation_offload.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.memory.transfer import transfer_streams
from vramkit.observe.oom import is_oom_error
from vramkit.offload.activations import ActivationOffloadConfig, ActivationOffloader

GiB = float(1 << 30)
MODES = ("resident", "torch_save_on_cpu", "vramkit")


class Block(nn.Module):
    """Pre-norm transformer block: attention (SDPA) and a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, mlp_ratio * width)
        self.down = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_context(mode: str, offloader: ActivationOffloader | None
                 ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    if mode == "resident":
        return contextlib.nullcontext
    if mode == "torch_save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    assert offloader is not None
    return lambda: offloader


class StepTimer:
    """Per-step timings that mean the same thing in every mode.

    A step runs from the start of its forward pass to the end of its backward pass *including*
    the copy streams of :func:`transfer_streams` (the compute stream waits for them before the
    step's end event): offload copies still running then delay the next step. Events: start,
    forward end, backward end (compute), step end (copies joined). Host timestamps around the
    same points show whether the host (Python, hooks, pool calls, a hidden sync) is what limits
    the step: ``host_ms`` above the GPU step time means the GPU waits for the host, and that
    wait shows up as ``gap_ms`` (GPU idle between one step's end and the next one's start).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.streams = transfer_streams(device) if self.cuda else None
        self.events: list[tuple[Any, ...]] = []
        self.host: list[tuple[float, float, float]] = []  # start, forward issued, step issued

    def mark(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def join_copies(self) -> None:
        if self.streams is not None:
            compute = torch.cuda.current_stream()
            compute.wait_stream(self.streams.d2h)
            compute.wait_stream(self.streams.h2d)

    def summary(self) -> dict[str, Any]:
        """Medians, means and per-step lists (call after a synchronize)."""
        host_ms = [(end - start) * 1e3 for start, _, end in self.host]
        result: dict[str, Any] = {
            "host_ms": statistics.median(host_ms),
            "host_forward_ms": statistics.median((f - s) * 1e3 for s, f, _ in self.host),
            "host_ms_each": host_ms,
        }
        if not self.events:
            return result
        step = [a.elapsed_time(d) for a, _, _, d in self.events]
        gaps = [prev[3].elapsed_time(nxt[0]) for prev, nxt in zip(self.events, self.events[1:],
                                                                    strict=False)]
        result.update({
            "step_ms": statistics.median(step),
            "step_ms_max": max(step),
            "step_ms_each": step,
            "forward_ms": statistics.median(a.elapsed_time(b) for a, b, _, _ in self.events),
            "backward_ms": statistics.median(b.elapsed_time(c) for _, b, c, _ in self.events),
            "end_wait_ms": statistics.median(c.elapsed_time(d) for _, _, c, d in self.events),
            "gap_ms": statistics.median(gaps) if gaps else 0.0,
            "gap_ms_each": gaps,
        })
        return result


def run_mode(model: nn.Module, x: torch.Tensor, mode: str, args: argparse.Namespace,
             device: torch.device) -> dict[str, Any]:
    """Warm up, then time ``args.steps`` steps of ``mode``; returns times, peak and stats."""
    cuda = device.type == "cuda"
    offloader = None
    if mode == "vramkit":
        offloader = ActivationOffloader(
            ActivationOffloadConfig(min_bytes=args.min_bytes, prefetch=args.prefetch,
                                    prefetch_bytes=args.prefetch_bytes,
                                    max_inflight_bytes=args.inflight,
                                    max_pinned_bytes=args.max_pinned),
            device=device)
    context = make_context(mode, offloader)
    params = list(model.parameters())
    timer = StepTimer(device)
    pool_trace: list[dict[str, Any]] = []

    def step(timed: bool) -> None:
        host_start = time.perf_counter()
        for p in params:
            p.grad = None
        start = timer.mark() if timed else None
        with context():
            loss = model(x).float().square().mean()
        forward_end = timer.mark() if timed else None
        host_forward = time.perf_counter()
        loss.backward()
        if timed:
            backward_end = timer.mark()
            timer.join_copies()
            step_end = timer.mark()
            if cuda:
                timer.events.append((start, forward_end, backward_end, step_end))
            timer.host.append((host_start, host_forward, time.perf_counter()))
            if offloader is not None:
                # Lock-only reads: no event queries, nothing that changes what the pool does.
                pool = offloader.pool
                segments = pool.segment_sizes() if pool is not None else {}
                stats = offloader.stats()
                pool_trace.append({"reserved": sum(segments.values()),
                                   "segments": len(segments),
                                   "pool_allocations": stats.pool_allocations,
                                   "reused_blocks": stats.reused_blocks})

    try:
        for _ in range(args.warmup):
            step(False)
        for p in params:  # the measured peak includes the gradients each step creates
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        gc.collect()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if offloader is not None:
            offloader.reset_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(True)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        for p in params:
            p.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return {"mode": mode, "oom": True}
    result: dict[str, Any] = {"mode": mode, "oom": False, "wall_ms": wall * 1e3}
    result.update(timer.summary())
    result.setdefault("step_ms", wall * 1e3)  # CPU: no events, the wall clock is all there is
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        result["peak_gib"] = peak / GiB
        result["step_peak_gib"] = (peak - base) / GiB
    if offloader is not None:
        stats = offloader.stats()
        result["offloaded_gib_per_step"] = stats.offloaded_bytes / args.steps / GiB
        result["kept_gib_per_step"] = stats.kept_bytes / args.steps / GiB
        result["prefetch_hit_rate"] = stats.prefetch_hit_rate
        result["device_hits_per_step"] = stats.device_hits / args.steps
        result["kept_over_cap"] = stats.kept_over_cap
        result["pool_allocations_per_step"] = stats.pool_allocations / args.steps
        pool = offloader.pool
        result["pinned_pool_gib"] = pool.stats().reserved / GiB if pool is not None else 0.0
        result["pool_per_step"] = pool_trace
        result["stats"] = dataclasses.asdict(stats)
    if args.trace and cuda:
        result["trace"] = _profile(step, args.out / f"trace_{mode}_{x.shape[1]}")
    for p in params:
        p.grad = None
    return result


def _profile(step: Callable[[bool], None], stem: Path) -> str:
    """Two more steps under torch.profiler: a Chrome trace and the top host-time table."""
    from torch.profiler import ProfilerActivity, profile

    stem.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(False)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(stem.with_suffix(".json")))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    stem.with_suffix(".txt").write_text(table)
    return str(stem.with_suffix(".json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--min-bytes", default="1MiB", help="ActivationOffloadConfig.min_bytes")
    parser.add_argument("--prefetch", type=int, default=2, help="ActivationOffloadConfig.prefetch")
    parser.add_argument("--prefetch-bytes", default="256MiB",
                        help="ActivationOffloadConfig.prefetch_bytes")
    parser.add_argument("--trace", action="store_true",
                        help="also profile two steps per mode: <out>/trace_<mode>_<tokens>.json "
                             "(Chrome trace) and .txt (top host time)")
    parser.add_argument("--inflight", default="256MiB",
                        help="ActivationOffloadConfig.max_inflight_bytes")
    parser.add_argument("--max-pinned", default=None,
                        help="ActivationOffloadConfig.max_pinned_bytes (default: no cap)")
    parser.add_argument("--quick", action="store_true",
                        help="4 blocks, 2 warm-up and 3 measured steps")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.blocks, args.warmup, args.steps = min(args.blocks, 4), 2, 3
    dtype = torch.bfloat16
    modes = list(args.modes)
    if device.type == "cpu":  # exercise the script only: a tiny fp32 model, no pinned baseline
        args.width, args.heads, args.blocks, dtype = 256, 4, 2, torch.float32
        args.tokens = sorted({min(t, 512) for t in args.tokens})
        args.min_bytes = "0B"
        modes = [m for m in modes if m != "torch_save_on_cpu"]

    torch.manual_seed(0)
    model = Stack(args.blocks, args.width, args.heads).to(device=device, dtype=dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        x = torch.randn(1, tokens, args.width, device=device, dtype=dtype)
        by_mode = {mode: run_mode(model, x, mode, args, device) for mode in modes}
        resident = by_mode.get("resident", {})
        for run in by_mode.values():
            run["tokens"] = tokens
            if not run["oom"] and resident and not resident["oom"]:
                run["time_ratio"] = run["step_ms"] / resident["step_ms"]
                run["wall_ratio"] = run["wall_ms"] / resident["wall_ms"]
                if "step_peak_gib" in run and resident.get("step_peak_gib"):
                    run["peak_ratio"] = run["step_peak_gib"] / resident["step_peak_gib"]
            runs.append(run)
            rows.append(_row(run, args))
        del x
    result = {
        "config": {"blocks": args.blocks, "width": args.width, "heads": args.heads,
                   "dtype": str(dtype), "device": str(device), "steps": args.steps,
                   "warmup": args.warmup, "param_gib": param_bytes / GiB,
                   "min_bytes": args.min_bytes, "prefetch": args.prefetch,
                   "prefetch_bytes": args.prefetch_bytes,
                   "max_inflight_bytes": args.inflight, "max_pinned_bytes": args.max_pinned},
        "runs": runs,
    }
    write_result("activation_offload", result, rows, args.out)


def _row(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    def fmt(key: str, spec: str) -> str:
        value = run.get(key)
        return "-" if value is None else format(value, spec)

    if run["oom"]:
        return {"model": f"{args.blocks}x{args.width}", "tokens": run["tokens"],
                "mode": run["mode"], "step ms": "OOM"}
    return {
        "model": f"{args.blocks}x{args.width}",
        "tokens": run["tokens"],
        "mode": run["mode"],
        "step ms": fmt("step_ms", ".1f"),
        "wall ms": fmt("wall_ms", ".1f"),
        "fwd/bwd/end-wait ms": f"{fmt('forward_ms', '.1f')} / {fmt('backward_ms', '.1f')} / "
                               f"{fmt('end_wait_ms', '.1f')}",
        "host ms": fmt("host_ms", ".1f"),
        "gap ms": fmt("gap_ms", ".1f"),
        "step peak GiB": fmt("step_peak_gib", ".2f"),
        "time vs resident": fmt("time_ratio", ".2f") + "x" if "time_ratio" in run else "-",
        "peak vs resident": fmt("peak_ratio", ".2f") + "x" if "peak_ratio" in run else "-",
        "offloaded GiB": fmt("offloaded_gib_per_step", ".2f"),
        "prefetch hits": fmt("prefetch_hit_rate", ".0%"),
        "pool allocs/step": fmt("pool_allocations_per_step", ".1f"),
    }


if __name__ == "__main__":
    main()
