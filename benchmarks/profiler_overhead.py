"""Overhead of the memory profiler on a training step, measured side by side in one run.

A small transformer encoder (GPU) or a smaller one (CPU) is trained for ``--steps`` steps per
round, alternating three variants round by round so drift hits all of them alike:

- ``baseline``: no profiler;
- ``profiler``: ``MemoryProfiler`` sampling at its default interval, with ``mark()`` for the
  forward/backward/optimizer phases and ``step()`` each step (the claimed configuration);
- ``profiler+hooks``: the same plus ``attach(model)`` module hooks (reported, not the claim).

Each variant's time per step is the median over rounds; overhead is ``profiled / baseline - 1``
(target: <= 2 %). Prints one JSON object and one markdown row.

Usage: ``PYTHONPATH=src python benchmarks/profiler_overhead.py [--device cuda] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import vramkit
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import vramkit

from vramkit.observe.profiler import MemoryProfiler

TARGET_PCT = 2.0


def _build(device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    if device.type == "cuda":
        width, heads, layers, batch, seq = 1024, 16, 8, 16, 512
    else:
        width, heads, layers, batch, seq = 128, 4, 2, 8, 64
    layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, batch_first=True,
                                       dropout=0.0)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(device)
    x = torch.randn(batch, seq, width, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, x, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, n: int,
           device: torch.device, profiler: MemoryProfiler | None) -> float:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    _sync(device)
    started = time.perf_counter()
    for _ in range(n):
        if profiler is not None:
            profiler.mark("forward")
        with autocast:
            loss = model(x).float().square().mean()
        if profiler is not None:
            profiler.mark("backward")
        loss.backward()
        if profiler is not None:
            profiler.mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.step()
    _sync(device)  # once per round, outside the steps
    return (time.perf_counter() - started) / n


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--interval", type=float, default=None,
                        help="sample interval (default: MemoryProfiler's default)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    steps = args.steps or (20 if device.type == "cuda" else 10)
    model, x, opt = _build(device)
    _steps(model, x, opt, 5, device, None)  # warm-up: kernels, optimizer state, allocator cache

    kwargs: dict[str, Any] = {} if args.interval is None else {"sample_interval": args.interval}
    plain = MemoryProfiler(device, **kwargs)
    hooked = MemoryProfiler(device, **kwargs)
    interval = plain.sample_interval
    variants = ["baseline", "profiler", "profiler+hooks"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    samples = 0
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for variant in order:
            if variant == "baseline":
                times[variant].append(_steps(model, x, opt, steps, device, None))
            elif variant == "profiler":
                with plain:
                    times[variant].append(_steps(model, x, opt, steps, device, plain))
                samples += plain.report().num_samples
            else:
                hooked.attach(model, backward=False)
                try:
                    with hooked:
                        times[variant].append(_steps(model, x, opt, steps, device, hooked))
                finally:
                    hooked.detach()
    median = {v: statistics.median(t) for v, t in times.items()}
    overhead = (median["profiler"] / median["baseline"] - 1.0) * 100.0
    hooks_overhead = (median["profiler+hooks"] / median["baseline"] - 1.0) * 100.0
    result = {
        "benchmark": "profiler_overhead",
        "device": str(device), "hardware": _hardware(device),
        "torch": torch.__version__, "python": platform.python_version(),
        "vramkit": vramkit.__version__,
        "sample_interval_s": interval, "steps_per_round": steps, "rounds": args.rounds,
        "step_ms": {v: round(m * 1e3, 3) for v, m in median.items()},
        "samples_per_round": round(samples / args.rounds, 1),
        "overhead_pct": round(overhead, 2),
        "hooks_overhead_pct": round(hooks_overhead, 2),
        "target_pct": TARGET_PCT,
        "meets_target": overhead <= TARGET_PCT,
    }
    print(json.dumps(result, indent=2))
    print("| benchmark | hardware | torch | baseline ms/step | profiled ms/step | overhead "
          "| with module hooks |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| profiler overhead ({interval * 1e3:g} ms interval) | {result['hardware']} | "
          f"{torch.__version__} | {median['baseline'] * 1e3:.2f} | "
          f"{median['profiler'] * 1e3:.2f} | {overhead:+.2f}% (target <= {TARGET_PCT:g}%) | "
          f"{hooks_overhead:+.2f}% |")
    return result


if __name__ == "__main__":
    main()
