"""MemoryPool benchmarks: cache-hit allocation latency and pinned-pool copy bandwidth.

(1) Latency: p50/p99 of ``block = pool.allocate(n); block.free()`` per operation (warm, the
    exact-size cache hits every time), beside ``t = torch.empty(n, device=...); del t`` measured
    in the same harness and run. Targets: p50 <= 3 µs, p99 <= 10 µs.
(2) Pinned pool (CUDA only): host->device copy bandwidth from pool memory vs a plain
    ``torch.empty(pin_memory=True)`` buffer vs pageable memory. Target: pool >= 90% of pinned.

Run (GPU):  PYTHONPATH=src python benchmarks/pool.py --out out
Run (CPU):  PYTHONPATH=src python benchmarks/pool.py --device cpu --out out
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, summarize_ns, write_result
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.units import parse_size

P50_TARGET_US, P99_TARGET_US, PINNED_TARGET_RATIO = 3.0, 10.0, 0.9


def time_ops(op: Callable[[], None], iterations: int, warmup: int) -> list[int]:
    """Per-call wall time (ns) of ``op``; the collector is paused so both sides see no GC."""
    for _ in range(warmup):
        op()
    samples = [0] * iterations
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for i in range(iterations):
            start = clock()
            op()
            samples[i] = clock() - start
    finally:
        gc.enable()
    return samples


def latency(device: str, nbytes: int, iterations: int) -> dict[str, object]:
    pool = MemoryPool(device, PoolConfig(enable_memory_tracking=False))
    torch_device = torch.device(device)

    def pool_op() -> None:
        pool.allocate(nbytes).free()

    def torch_op() -> None:
        t = torch.empty(nbytes, dtype=torch.uint8, device=torch_device)
        del t

    warmup = max(100, iterations // 10)
    # Interleave the two so drift (clocks, other load) affects both sides alike.
    pool_samples: list[int] = []
    torch_samples: list[int] = []
    for _ in range(5):
        pool_samples += time_ops(pool_op, iterations // 5, warmup)
        torch_samples += time_ops(torch_op, iterations // 5, warmup)
    ours, theirs = summarize_ns(pool_samples), summarize_ns(torch_samples)
    stats = pool.stats()
    return {
        "nbytes": nbytes, "device": device,
        "pool": ours, "torch_empty": theirs,
        "p50_ratio": ours["p50_us"] / theirs["p50_us"],
        "p99_ratio": ours["p99_us"] / theirs["p99_us"],
        "cache_hit_rate": stats.hit_rate,
        "meets_p50_target": ours["p50_us"] <= P50_TARGET_US,
        "meets_p99_target": ours["p99_us"] <= P99_TARGET_US,
    }


def copy_bandwidth(nbytes: int, repeats: int) -> dict[str, object]:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pool = MemoryPool.pinned(PoolConfig(max_cached_buffers=0))
    block = pool.allocate(nbytes)
    sources = {
        "pool_pinned": block.tensor,
        "torch_pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(nbytes, dtype=torch.uint8),
    }
    for source in sources.values():
        source.fill_(1)
    results: dict[str, float] = {}
    for _ in range(2):  # the second round is the measurement; the first warms up every path
        for name, source in sources.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                device.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            results[name] = nbytes * repeats / (time.perf_counter() - start) / 1e9
    assert block.tensor.is_pinned()
    block.free()
    return {
        "nbytes": nbytes, "repeats": repeats,
        "gb_per_s": results,
        "pool_vs_pinned": results["pool_pinned"] / results["torch_pinned"],
        "pool_vs_pageable": results["pool_pinned"] / results["pageable"],
        "meets_target": results["pool_pinned"] / results["torch_pinned"] >= PINNED_TARGET_RATIO,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--size", default="1MiB", help="allocation size for the latency test")
    parser.add_argument("--iterations", type=int, default=50_000)
    parser.add_argument("--copy-size", default="256MiB", help="bytes per host->device copy")
    parser.add_argument("--copy-repeats", type=int, default=20)
    add_common_args(parser)
    args = parser.parse_args()

    result: dict[str, object] = {"latency": latency(args.device, parse_size(args.size),
                                                    args.iterations)}
    lat = result["latency"]
    assert isinstance(lat, dict)
    ours, theirs = lat["pool"], lat["torch_empty"]
    rows = [{
        "test": f"allocate+free {args.size} ({args.device}), cache hit",
        "vramkit": f"p50 {ours['p50_us']:.2f} µs, p99 {ours['p99_us']:.2f} µs",
        "baseline": f"torch.empty+del: p50 {theirs['p50_us']:.2f} µs, p99 {theirs['p99_us']:.2f} µs",
        "ratio": f"{lat['p50_ratio']:.2f}x (p50)",
        "target": f"p50<={P50_TARGET_US} µs {'met' if lat['meets_p50_target'] else 'missed'}, "
                  f"p99<={P99_TARGET_US} µs {'met' if lat['meets_p99_target'] else 'missed'}",
    }]
    if args.device.startswith("cuda"):
        copy = copy_bandwidth(parse_size(args.copy_size), args.copy_repeats)
        result["pinned_copy"] = copy
        gbps = copy["gb_per_s"]
        assert isinstance(gbps, dict)
        rows.append({
            "test": f"host->device copy {args.copy_size} from pinned pool",
            "vramkit": f"{gbps['pool_pinned']:.1f} GB/s",
            "baseline": f"torch pinned {gbps['torch_pinned']:.1f} GB/s, pageable "
                        f"{gbps['pageable']:.1f} GB/s",
            "ratio": f"{copy['pool_vs_pinned']:.2f}x pinned, {copy['pool_vs_pageable']:.1f}x "
                     "pageable",
            "target": f">= {PINNED_TARGET_RATIO:.0%} of pinned "
                      f"{'met' if copy['meets_target'] else 'missed'}",
        })
    write_result("pool", result, rows, args.out)


if __name__ == "__main__":
    main()
