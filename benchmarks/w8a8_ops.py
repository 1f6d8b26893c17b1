"""Where a W8A8 layer call spends host and device time, op by op (CUDA only).

For a FLUX-shaped Linear (3072 -> 3072) at few tokens (host-bound) and at 4096 tokens
(device-bound), times each aten call of the fp8 and int8 paths of ``vramkit.quant.w8a8`` alone:
host microseconds per call (``perf_counter`` around calls enqueued without a sync) and device
microseconds per call (CUDA events), and the whole layer call eager and under ``torch.compile``.

Next to them, the Triton kernels that replace the aten quantization and int8 epilogue on CUDA
(``vramkit.quant._w8a8_triton``): the one-launch row quantizer (whole call; the launch alone,
replayed and through Triton's JIT; with the backward's column pre-scale; a few tiles at 4096
tokens), the one-pass int8 epilogue against the aten passes, and the layer call (no_grad, and
forward + backward) with the aten kernels ("before") and the Triton ones ("after").

Run (GPU): PYTHONPATH=src python3 benchmarks/w8a8_ops.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from vramkit.quant import w8a8
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


def _triton_ops(kind: str, x: torch.Tensor, layer: W8A8Linear,
                lin: torch.nn.Linear) -> dict[str, Callable[[], object]]:
    """The Triton quantizer and int8 epilogue, and the layer before / after them."""
    from vramkit.quant import _w8a8_triton as kernels

    dev, cols = x.device, x.shape[1]
    ops: dict[str, Callable[[], object]] = {}
    ops["aten quantize_rows (4 calls)"] = lambda x=x: w8a8.quantize_rows(x, kind)
    ops["torch.empty (one)"] = lambda x=x: torch.empty(x.shape, dtype=torch.int8, device=dev)
    quantizer = kernels.RowQuantizer(kind, cols)
    ops["triton quantize (whole call)"] = lambda q=quantizer, x=x: q(x)
    grid, key, args, _, _ = quantizer.prepare(x)
    quantizer(x)  # compiles, keeps the compiled kernel
    ops["triton quantize: launch replayed"] = lambda q=quantizer: q.launch(grid, key, args)
    ops["triton quantize: launch through JIT"] = lambda q=quantizer: q.launch.jit(grid, args)
    col_scale = layer.weight_scale
    pre = kernels.RowQuantizer(kind, cols, col_scaled=True)
    ops["aten g*s_w + quantize_rows"] = lambda x=x, s=col_scale: w8a8.quantize_rows(x * s, kind)
    ops["triton quantize g*s_w"] = lambda q=pre, x=x, s=col_scale: q(x, s)
    wide = torch.randn(x.shape[0], 12288, device=dev, dtype=x.dtype)
    wide_scale = torch.rand(12288, device=dev) + 0.5
    ops["aten g*s_w + quantize_rows K=12288"] = lambda g=wide, s=wide_scale: (
        w8a8.quantize_rows(g * s, kind))
    wide_pre = kernels.RowQuantizer(kind, 12288, col_scaled=True)
    ops["triton quantize g*s_w K=12288"] = lambda q=wide_pre, g=wide, s=wide_scale: q(g, s)
    if x.shape[0] >= 1024:
        for block_k, warps in ((4096, 4), (4096, 16), (1024, 4), (2048, 8)):
            tiled = kernels.RowQuantizer(kind, cols, block_k=block_k, num_warps=warps)
            ops[f"triton quantize tile k={block_k} warps={warps}"] = lambda q=tiled, x=x: q(x)
    if kind == "int8":
        acc = torch.randint(-2**20, 2**20, (x.shape[0], lin.out_features), dtype=torch.int32,
                            device=dev)
        s_x = torch.rand(x.shape[0], 1, device=dev) * 1e-3
        bias = lin.bias

        def aten_epilogue(acc: torch.Tensor = acc) -> torch.Tensor:
            scaled = torch.mul(acc, col_scale)
            return torch.addcmul(bias, scaled, s_x, out=torch.empty(
                scaled.shape, dtype=x.dtype, device=dev))

        epilogue = kernels.Int8Epilogue(lin.out_features, col_scaled=True)
        ops["aten int8 epilogue (mul, addcmul)"] = aten_epilogue
        ops["triton int8 epilogue"] = lambda e=epilogue, acc=acc: e(acc, s_x, col_scale, bias,
                                                                    x.dtype)
    before = W8A8Linear.from_linear(lin, kind, release_weight=False)
    before(x)
    before._kernel = w8a8._KERNELS[kind]  # the aten kernel (the device is checked already)
    after = W8A8Linear.from_linear(lin, kind, release_weight=False)
    after(x)
    assert after._kernel.quantizer == "triton"
    x_grad = x.detach().clone().requires_grad_()
    grad = torch.randn(x.shape[0], lin.out_features, device=dev, dtype=x.dtype)
    for name, module in (("before (aten)", before), ("after (triton)", after)):
        ops[f"layer no_grad {name}"] = lambda m=module, x=x: m(x)
        ops[f"layer fwd+bwd {name}"] = lambda m=module: m(x_grad).backward(grad)
    return ops


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(3072, 3072, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    rows = []
    for tokens in (64, 4096):
        torch.manual_seed(tokens)
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
            try:
                ops.update(_triton_ops(kind, x, layer, lin))
            except Exception as exc:  # e.g. triton missing: the aten rows still print
                rows.append((tokens, kind, f"triton ops FAILED {type(exc).__name__}: "
                             f"{str(exc)[:80]}", float("nan"), float("nan")))
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
