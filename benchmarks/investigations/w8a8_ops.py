"""Where a W8A8 layer call spends host and device time, op by op (CUDA only).

For a FLUX-shaped Linear (3072 -> 3072) at few tokens (host-bound) and at 4096 tokens
(device-bound), times each aten call of the fp8 and int8 paths of ``vramkit.quant.w8a8`` alone:
host microseconds per call (``perf_counter`` around calls enqueued without a sync) and device
microseconds per call (CUDA events), and the whole layer call eager and under ``torch.compile``.

Run (GPU): PYTHONPATH=src python3 benchmarks/investigations/w8a8_ops.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from vramkit.quant.w8a8 import W8A8Linear


def _time(fn: Callable[[], object], calls: int = 200, rounds: int = 5) -> tuple[float, float]:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    hosts, devs = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        hosts.append((t1 - t0) / calls * 1e6)
        devs.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(hosts), statistics.median(devs)


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(3072, 3072, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    rows = []
    for tokens in (64, 4096):
        x = torch.randn(tokens, 3072, device=dev, dtype=torch.bfloat16)
        for kind in ("fp8", "int8"):
            layer = W8A8Linear.from_linear(lin, kind, release_weight=False)
            w, s, b = layer.weight, layer.weight_scale, layer.bias
            amax = torch.linalg.vector_norm(x, float("inf"), -1, True, dtype=torch.float32)
            scale = amax / 448.0
            codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=dev)
            xi = torch.randint(-127, 127, x.shape, dtype=torch.int8, device=dev)
            ops: dict[str, Callable[[], object]] = {
                "bf16 F.linear": lambda x=x: torch.nn.functional.linear(x, lin.weight, lin.bias),
                "vector_norm inf": lambda x=x: torch.linalg.vector_norm(
                    x, float("inf"), -1, True, dtype=torch.float32),
                "amax (abs().amax)": lambda x=x: x.abs().amax(-1, keepdim=True),
                "add cpu scalar": lambda amax=amax: torch.add(
                    torch.tensor(1e-30), amax, alpha=1 / 448.0),
                "div out=fp8": lambda x=x, scale=scale, codes=codes: torch.div(
                    x, scale, out=codes),
                "layer no_grad": lambda x=x, layer=layer: layer(x),
            }
            if kind == "fp8":
                c = codes
                ops["_scaled_mm rowwise+bias"] = lambda c=c, w=w, s=s, b=b, scale=scale: (
                    torch._scaled_mm(c, w.t(), scale_a=scale, scale_b=s.view(1, -1), bias=b,
                                     out_dtype=torch.bfloat16))
                ops["_scaled_mm tensorwise"] = lambda c=c, w=w: torch._scaled_mm(
                    c, w.t(), scale_a=torch.ones((), device=dev),
                    scale_b=torch.ones((), device=dev), out_dtype=torch.bfloat16)
            else:
                wt = w.t()
                ops["_int_mm"] = lambda xi=xi, wt=wt: torch._int_mm(xi, wt)
            comp = torch.compile(lambda x, layer=layer: layer(x), dynamic=False)
            ops["layer compiled"] = lambda x=x, comp=comp: comp(x)
            for name, fn in ops.items():
                try:
                    host, devt = _time(fn)
                    rows.append((tokens, kind, name, host, devt))
                except Exception as exc:
                    rows.append((tokens, kind, f"{name} FAILED {type(exc).__name__}: "
                                 f"{str(exc)[:80]}", float("nan"), float("nan")))
    print("| tokens | kind | op | host us/call | device us/call |")
    print("| --- | --- | --- | --- | --- |")
    for tokens, kind, name, host, devt in rows:
        print(f"| {tokens} | {kind} | {name} | {host:.1f} | {devt:.1f} |")


if __name__ == "__main__":
    main()
