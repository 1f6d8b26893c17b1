"""Launch-configuration benchmark: the chosen LaunchConfig vs a sweep, for two runtime-compiled
CUDA kernels (vramkit.kernels.KernelManager, NVRTC through cuda-core).

(1) Element-wise ``out[i] = in[i] * 2`` over n floats (memory-bound): the block size of
    ``LaunchConfig.for_elements(n, dev, kernel)`` (occupancy API) and of the compute-capability
    default (``kernel=None``) against blocks of 32..1024 threads.
(2) A tiled shared-memory SGEMM ``C = A @ B`` (one thread per output element, A/B tiles in
    dynamic shared memory, tile depth passed at run time): the tile of
    ``calculate_optimal_launch_params(m, n, k, dev, kernel=kernel)`` against square and
    rectangular tiles from 8x8 to 32x32.

The host time to enqueue one element-wise launch through KernelManager is reported too.
Each configuration is timed with CUDA events (median over trials of ``--reps`` back-to-back
launches after warm-up) and its output checked against torch. Target: chosen time <= 1.05 x the
best configuration in the sweep.

Run (GPU, ~1 min):  PYTHONPATH=src python benchmarks/kernels.py --out out
Run (GPU, quick):   PYTHONPATH=src python benchmarks/kernels.py --quick --out out
Needs an NVIDIA GPU and the kernels extra (pip install 'vramkit[kernels]').
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.kernels.examples import TILED_MATMUL_SOURCE
from vramkit.kernels.launch import LaunchConfig, calculate_optimal_launch_params
from vramkit.kernels.manager import KernelManager, is_available

TARGET_RATIO = 1.05
BLOCK_SWEEP = (32, 64, 128, 256, 512, 1024)
TILE_SWEEP = ((8, 8), (16, 16), (32, 32), (16, 32), (32, 16), (8, 32), (32, 8), (8, 64),
              (64, 8), (16, 64), (64, 16))

ELEMENTWISE = r"""
extern "C" __global__ void scale_by_two(float* output, const float* input, int n) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) { output[idx] = input[idx] * 2.0f; }
}
"""


def time_interleaved(launches: list[Callable[[], None]], reps: int, trials: int,
                     warmup: int) -> list[float]:
    """Median milliseconds per launch of each callable, timed in interleaved rounds."""
    for launch in launches:
        for _ in range(warmup):
            launch()
    torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in launches]
    for _ in range(trials):
        for i, launch in enumerate(launches):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                launch()
            end.record()
            end.synchronize()
            samples[i].append(start.elapsed_time(end) / reps)
    return [statistics.median(s) for s in samples]


def time_launches(launch: Callable[[], None], reps: int, trials: int, warmup: int) -> float:
    """Median milliseconds per launch (CUDA events around ``reps`` back-to-back launches)."""
    return time_interleaved([launch], reps, trials, warmup)[0]


def describe(config: LaunchConfig) -> str:
    bx, by, _ = config.block  # type: ignore[misc]
    return f"{bx}" if by == 1 else f"{by}x{bx}"


def elementwise(manager: KernelManager, n: int, args: argparse.Namespace) -> dict[str, Any]:
    device = manager.device
    kernel = manager.ensure_kernel("scale_by_two", ELEMENTWISE, options=())
    source = torch.randn(n, device=device)
    output = torch.empty_like(source)
    expected = source * 2

    # Short launches (n = 1M: ~15 us) are noisy run to run: enough launches per trial for
    # ~2 ms of GPU time, and every configuration timed in the same interleaved rounds, so the
    # chosen one is compared with the sweep under the same conditions.
    reps = max(args.reps, int(2e-3 / max(8 * n / 2.5e12, 1e-7)))

    def check(config: LaunchConfig) -> bool:
        output.fill_(float("nan"))
        kernel.launch(config, output, source, n)
        return bool(torch.equal(output, expected))

    sweep_configs = [LaunchConfig(grid=-(-n // b), block=b).validate(manager.limits, kernel)
                     for b in BLOCK_SWEEP]
    config = LaunchConfig.for_elements(n, device, kernel)
    default_config = LaunchConfig.for_elements(n, device)
    configs = [*sweep_configs, config, default_config]
    times = time_interleaved([lambda c=c: kernel.launch(c, output, source, n) for c in configs],
                             reps, args.trials, args.warmup)
    rows = [{"block": c.block[0], "grid": c.grid[0], "ms": ms,  # type: ignore[index]
             "gbps": 2 * 4 * n / ms / 1e6, "correct": check(c)}
            for c, ms in zip(configs, times, strict=True)]
    sweep, chosen, default = rows[:len(sweep_configs)], rows[-2], rows[-1]
    best = min(sweep, key=lambda row: row["ms"])
    # Host time to enqueue one launch (argument checks, packing, cuda-core launch); no sync
    # inside the loop, so this is what a Python caller pays per kernel.
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.reps):
        kernel.launch(config, output, source, n)
    enqueue_us = (time.perf_counter() - start) / args.reps * 1e6
    torch.cuda.synchronize()
    return {"workload": f"elementwise n={n}", "sweep": sweep, "chosen": chosen,
            "cc_default": default, "best": best, "ratio": chosen["ms"] / best["ms"],
            "default_ratio": default["ms"] / best["ms"], "host_enqueue_us": enqueue_us}


def matmul(manager: KernelManager, m: int, n: int, k: int,
           args: argparse.Namespace) -> dict[str, Any]:
    device = manager.device
    kernel = manager.ensure_kernel("tiled_matmul", TILED_MATMUL_SOURCE, options=())
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=generator)
    b = torch.randn(k, n, device=device, generator=generator)
    c = torch.empty(m, n, device=device)
    expected = (a.double() @ b.double()).float()

    def measure(config: LaunchConfig) -> dict[str, Any]:
        tile_n, tile_m, _ = config.block  # type: ignore[misc]
        depth = config.shared_mem // ((tile_m + tile_n) * 4)
        c.fill_(float("nan"))
        kernel.launch(config, a, b, c, m, n, k, depth)
        correct = bool(torch.allclose(c, expected, rtol=1e-3, atol=1e-3 * k ** 0.5))
        ms = time_launches(lambda: kernel.launch(config, a, b, c, m, n, k, depth),
                           max(1, args.reps // 20), args.trials, args.warmup)
        return {"tile": f"{tile_m}x{tile_n}x{depth}", "blocks": config.num_blocks,
                "shared_mem": config.shared_mem, "ms": ms, "tflops": 2 * m * n * k / ms / 1e9,
                "correct": correct}

    sweep = []
    for tile_m, tile_n in TILE_SWEEP:
        try:
            config = calculate_optimal_launch_params(m, n, k, device, tile_m=tile_m,
                                                     tile_n=tile_n, kernel=kernel)
        except ValueError:  # ConfigError: the tile does not fit this device/kernel
            continue
        sweep.append(measure(config))
    chosen = measure(calculate_optimal_launch_params(m, n, k, device, kernel=kernel))
    best = min(sweep, key=lambda row: row["ms"])
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_ms = time_launches(lambda: torch.mm(a, b, out=c), max(1, args.reps // 20),
                                 args.trials, args.warmup)
    return {"workload": f"tiled sgemm {m}x{n}x{k}", "sweep": sweep, "chosen": chosen,
            "best": best, "ratio": chosen["ms"] / best["ms"], "torch_mm_fp32_ms": reference_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller problems, fewer reps")
    parser.add_argument("--reps", type=int, help="launches per element-wise trial (default 100; "
                                                 "matmul uses reps/20)")
    parser.add_argument("--trials", type=int, default=5, help="timed trials (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up launches (default 3)")
    add_common_args(parser)
    args = parser.parse_args()
    if not is_available():
        parser.error("needs an NVIDIA GPU and the kernels extra: pip install 'vramkit[kernels]'")
    args.reps = args.reps or (40 if args.quick else 100)
    if min(args.reps, args.trials, args.warmup) < 1:
        parser.error("--reps, --trials and --warmup must be >= 1")
    manager = KernelManager.get(torch.cuda.current_device())
    sizes = [1 << 24] if args.quick else [1 << 20, 1 << 24, (1 << 28) + 1]
    shapes = ([(2048, 2048, 2048), (512, 512, 512)] if args.quick else
              [(4096, 4096, 4096), (2048, 2048, 2048), (512, 512, 512), (1024, 8192, 1024),
               (257, 1000, 4099)])
    results = [elementwise(manager, n, args) for n in sizes]
    results += [matmul(manager, m, n, k, args) for m, n, k in shapes]
    rows = []
    for result in results:
        chosen, best = result["chosen"], result["best"]
        label = "block" if "block" in chosen else "tile"
        passed = result["ratio"] <= TARGET_RATIO and chosen["correct"] and all(
            row["correct"] for row in result["sweep"])
        result["pass"] = passed
        rows.append({"workload": result["workload"], "chosen": chosen[label],
                     "chosen ms": chosen["ms"], "best in sweep": best[label],
                     "best ms": best["ms"], "chosen / best": result["ratio"],
                     "target": f"<= {TARGET_RATIO}", "result": "PASS" if passed else "FAIL"})
    summary = {"target_ratio": TARGET_RATIO, "results": results,
               "all_pass": all(r["pass"] for r in results),
               "device_limits": asdict(manager.limits)}
    write_result("kernels", summary, rows, args.out)


if __name__ == "__main__":
    main()
