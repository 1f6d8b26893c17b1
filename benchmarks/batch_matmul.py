"""batch_matmul benchmark: one batched matmul per shape group vs a Python loop of matmuls.

For each workload (a list of independent (a, b) pairs), wall time per call, measured around the
call with a device synchronize after it (median over trials after warm-up), for:

* **batch_matmul**: ``vramkit.kernels.batch.batch_matmul(pairs)``;
* **loop**: ``[a @ b for a, b in pairs]`` (asynchronous launches, no sync inside);
* **loop + sync/8**: the seed's ``batch_matmul_optimized``: the same loop with a device
  synchronize after every group of 8 pairs.

Results are checked against the loop. Workloads: many tiny products (launch-bound), mixed shapes
(three groups), a shared right operand (broadcast, not stacked), and medium products
(compute-bound: the stacking copies show there).

Run (GPU, < 1 min):  PYTHONPATH=src python benchmarks/batch_matmul.py --out out
Run (CPU, proves the code paths only): PYTHONPATH=src python benchmarks/batch_matmul.py \
    --device cpu --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import synchronize
from vramkit.kernels.batch import batch_matmul

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def time_call(call: Callable[[], object], device: torch.device, trials: int,
              warmup: int) -> float:
    """Median wall milliseconds of ``call()`` followed by a device synchronize."""
    for _ in range(warmup):
        call()
    synchronize(device)
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        call()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def workloads(device: torch.device, dtype: torch.dtype, quick: bool) -> dict[str, Pairs]:
    generator = torch.Generator(device=device).manual_seed(0)
    scale = 4 if quick else 1

    def pairs(count: int, a_shape: tuple[int, int], b_shape: tuple[int, int]) -> Pairs:
        return [(torch.randn(a_shape, device=device, dtype=dtype, generator=generator),
                 torch.randn(b_shape, device=device, dtype=dtype, generator=generator))
                for _ in range(count)]

    shared_b = torch.randn(1024, 64, device=device, dtype=dtype, generator=generator)
    tiny, mixed, shared, medium = 1024 // scale, 128 // scale, 256 // scale, 64 // scale
    return {
        f"{tiny} x (64x64 @ 64x64)": pairs(tiny, (64, 64), (64, 64)),
        f"mixed: 3 shapes x {mixed}": (pairs(mixed, (128, 128), (128, 128))
                                       + pairs(mixed, (256, 64), (64, 256))
                                       + pairs(mixed, (32, 512), (512, 32))),
        f"{shared} x (256x1024 @ shared 1024x64)": [
            (torch.randn(256, 1024, device=device, dtype=dtype, generator=generator), shared_b)
            for _ in range(shared)],
        f"{medium} x (1024x1024 @ 1024x1024)": pairs(medium, (1024, 1024), (1024, 1024)),
    }


def loop(pairs: Pairs) -> list[torch.Tensor]:
    return [a @ b for a, b in pairs]


def loop_sync_every_8(pairs: Pairs, device: torch.device) -> list[torch.Tensor]:
    results = []
    for start in range(0, len(pairs), 8):
        results += [a @ b for a, b in pairs[start:start + 8]]
        synchronize(device)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="a quarter of the pairs")
    parser.add_argument("--trials", type=int, default=15, help="timed calls (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up calls (default 3)")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA; use --device cpu")
    if args.trials < 1 or args.warmup < 0:
        parser.error("--trials must be >= 1 and --warmup >= 0")
    torch.backends.cuda.matmul.allow_tf32 = False  # the same math on both sides
    dtype = getattr(torch, args.dtype)
    tolerance = ({"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16
                 else {"rtol": 1e-4, "atol": 1e-3})
    results: list[dict[str, Any]] = []
    rows = []
    for name, pairs in workloads(device, dtype, args.quick).items():
        batched = batch_matmul(pairs)
        reference = loop(pairs)
        correct = all(torch.allclose(x, y, **tolerance)
                      for x, y in zip(batched, reference, strict=True))
        batched_ms = time_call(lambda p=pairs: batch_matmul(p), device, args.trials,
                               args.warmup)
        loop_ms = time_call(lambda p=pairs: loop(p), device, args.trials, args.warmup)
        sync_ms = time_call(lambda p=pairs: loop_sync_every_8(p, device), device, args.trials,
                            args.warmup)
        groups = len({(tuple(a.shape), tuple(b.shape)) for a, b in pairs})
        result = {"workload": name, "pairs": len(pairs), "shape_groups": groups,
                  "batch_matmul_ms": batched_ms, "loop_ms": loop_ms,
                  "loop_sync8_ms": sync_ms, "speedup_vs_loop": loop_ms / batched_ms,
                  "speedup_vs_loop_sync8": sync_ms / batched_ms, "correct": correct}
        results.append(result)
        rows.append({"workload": name, "device": args.device, "dtype": args.dtype,
                     "batch_matmul ms": batched_ms, "loop ms": loop_ms,
                     "loop+sync/8 ms": sync_ms, "x vs loop": loop_ms / batched_ms,
                     "x vs loop+sync/8": sync_ms / batched_ms,
                     "correct": "yes" if correct else "NO"})
        del pairs, batched, reference
    write_result("batch_matmul", {"settings": vars(args) | {"out": str(args.out)},
                                  "results": results}, rows, args.out)


if __name__ == "__main__":
    main()
