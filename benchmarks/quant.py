"""Quantized weights: memory, matmul error and matmul speed per format, vs bf16, torchao and bnb.

Run on a GPU (the lead's H200):

    PYTHONPATH=src python3 benchmarks/quant.py --out out/quant

Prints one JSON document and markdown tables (memory/error, speed, quantize throughput). With no
GPU only the memory and error part runs (on CPU, smaller shapes with --size). Speed is CUDA-event
timing of the median of ``--iters`` runs after warm-up, never asserted.

Speed rows, per format, at the decode shape (1 x 3072 -> 12288) and the training shape
(4608 x 3072 -> 12288):
- ``dequant+cublas``: Triton dequantize to bf16 then ``F.linear`` (the weight-only path);
- ``fused``: the fused Triton dequantize-matmul (decode shape);
- ``fp8 gemm``: per-token activation quantization + ``torch._scaled_mm`` row-wise (fp8 weights),
  the activation quantization included in the time;
- torchao (``Int8WeightOnlyConfig``, ``Int4WeightOnlyConfig``, ``Float8DynamicActivationFloat8
  WeightConfig``) and bitsandbytes (``Linear8bitLt``, ``Linear4bit`` nf4) where they import and run,
  otherwise a printed reason.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.quant._weights import gaussian, matmul_error, student_t3

from _common import add_common_args, write_result
from vramkit.quant import kernels
from vramkit.quant.formats import quantize_tensor

FORMATS = ("int8", "int4", "nf4", "fp8")
MEMORY_TARGET = {"int8": 0.52, "fp8": 0.52, "int4": 0.28, "nf4": 0.27}
ERROR_TARGET = {"int8": 1e-2, "fp8": 3e-2, "int4": 0.10, "nf4": 0.10}


def _cuda_time_ms(fn: Callable[[], Any], iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def memory_and_error(size: int, device: str, seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    """Bytes vs bf16 and relative matmul error for every default format."""
    rows = []
    for kind, make in (("gaussian", gaussian), ("student_t3", student_t3)):
        for fmt in FORMATS:
            errors, ratio = [], 0.0
            for seed in seeds:
                w = make(size, size, seed).to(device)
                q = quantize_tensor(w.to(torch.bfloat16), fmt)
                ratio = q.nbytes / (q.numel * 2)
                errors.append(matmul_error(w, q.dequantize(torch.float32)))
            rows.append({"weights": kind, "format": fmt, "size": f"{size}x{size}",
                         "bytes_vs_bf16": round(ratio, 4), "memory_target": MEMORY_TARGET[fmt],
                         "matmul_error_max": round(max(errors), 5),
                         "matmul_error_min": round(min(errors), 5),
                         "error_target": ERROR_TARGET[fmt], "seeds": len(seeds)})
    return rows


def _torchao_linear(weight: torch.Tensor, which: str) -> tuple[Callable | None, str]:
    try:
        import torchao.quantization as tq
    except Exception as err:
        return None, f"torchao not importable: {type(err).__name__}"
    try:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda",
                                 dtype=torch.bfloat16)
        linear.weight.data.copy_(weight)
        config = {"int8": lambda: tq.Int8WeightOnlyConfig(),
                  "int4": lambda: tq.Int4WeightOnlyConfig(group_size=32),
                  "fp8": lambda: tq.Float8DynamicActivationFloat8WeightConfig(
                      granularity=tq.PerRow())}[which]()
        tq.quantize_(linear, config)
        return linear, "ok"
    except Exception as err:
        return None, f"torchao {which} failed: {type(err).__name__}: {err}"[:160]


def _bnb_linear(weight: torch.Tensor, which: str) -> tuple[Callable | None, str]:
    try:
        import bitsandbytes as bnb
    except Exception as err:
        return None, f"bitsandbytes not importable: {type(err).__name__}"
    try:
        n_out, n_in = weight.shape
        if which == "int8":
            linear = bnb.nn.Linear8bitLt(n_in, n_out, bias=False, has_fp16_weights=False,
                                         threshold=0.0)
            linear.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False,
                                              has_fp16_weights=False)
        else:
            linear = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16,
                                       quant_type="nf4")
            linear.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4")
        return linear.cuda(), "ok"
    except Exception as err:
        return None, f"bitsandbytes {which} failed: {type(err).__name__}: {err}"[:160]


def _speed_at_shape(label: str, tokens: int, weight: torch.Tensor,
                    quantized: dict[str, Any], iters: int, rows: list[dict[str, Any]],
                    skipped: list[str]) -> None:
    n_out, n_in = weight.shape
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
    shape = f"{label} {tokens}x{n_in}->{n_out}"
    base = _cuda_time_ms(lambda: torch.nn.functional.linear(x, weight), iters)
    rows.append({"shape": shape, "format": "bf16", "impl": "cublas", "ms": round(base, 4),
                 "bf16_ms": round(base, 4), "speedup_vs_bf16": 1.0})

    def row(impl: str, fmt: str, fn: Callable[[], Any]) -> None:
        ms = _cuda_time_ms(fn, iters)
        rows.append({"shape": shape, "format": fmt, "impl": impl, "ms": round(ms, 4),
                     "bf16_ms": round(base, 4), "speedup_vs_bf16": round(base / ms, 3)})

    for fmt, q in quantized.items():
        row("vramkit dequant+cublas", fmt,
            lambda q=q: kernels.quantized_matmul(x, q, fused=False))
        if tokens <= 16:
            row("vramkit fused", fmt, lambda q=q: kernels.quantized_matmul(x, q, fused=True))
    if kernels.has_fp8_gemm("cuda"):
        row("vramkit fp8 gemm (incl. act quant)", "fp8",
            lambda: kernels.quantized_matmul(x, quantized["fp8"], activation_fp8=True))
    else:
        skipped.append(f"{label}: fp8 gemm: GPU capability < 8.9 or no torch._scaled_mm")
    others = [("torchao", which, _torchao_linear) for which in ("int8", "int4", "fp8")]
    others += [("bitsandbytes", which, _bnb_linear) for which in ("int8", "nf4")]
    for library, which, build in others:
        linear, why = build(weight, which)
        if linear is None:
            skipped.append(f"{label}: {why}")
            continue
        try:
            with torch.no_grad():
                row(f"{library} {which}", which, lambda linear=linear: linear(x))
        except Exception as err:
            skipped.append(f"{label}: {library} {which} run failed: {type(err).__name__}: "
                           f"{err}"[:200])


def speed(iters: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Matmul time per format and path vs bf16 at the decode and training shapes."""
    weight = gaussian(12288, 3072, 1).cuda().to(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    quantized = {fmt: quantize_tensor(weight, fmt) for fmt in FORMATS}
    for label, tokens in (("decode", 1), ("training", 4608)):
        _speed_at_shape(label, tokens, weight, quantized, iters, rows, skipped)
    return rows, skipped


def quantize_throughput(iters: int) -> list[dict[str, Any]]:
    """GB/s of bf16 input quantized per format on the GPU (12288 x 3072)."""
    weight = gaussian(12288, 3072, 2).cuda().to(torch.bfloat16)
    rows = []
    for fmt in FORMATS:
        ms = _cuda_time_ms(lambda fmt=fmt: quantize_tensor(weight, fmt), max(3, iters // 10), 2)
        q = quantize_tensor(weight, fmt)
        dq_ms = _cuda_time_ms(lambda q=q: q.dequantize(), iters)
        rows.append({"format": fmt, "quantize_ms": round(ms, 3),
                     "quantize_GBps": round(weight.numel() * 2 / ms / 1e6, 1),
                     "dequantize_ms": round(dq_ms, 4),
                     "dequantize_out_GBps": round(weight.numel() * 2 / dq_ms / 1e6, 1)})
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--size", type=int, default=3072,
                        help="square weight size for memory/error (default 3072)")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per case (default 50)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "memory_error": memory_and_error(args.size, "cuda" if cuda else "cpu", (11, 12, 13)),
    }
    write_result("quant_memory_error", result, result["memory_error"], args.out)
    if not cuda:
        print("no CUDA GPU: speed and quantize-throughput parts skipped")
        return
    speed_rows, skipped = speed(args.iters)
    result = {"speed": speed_rows, "skipped": skipped}
    write_result("quant_speed", result, speed_rows, args.out)
    for reason in skipped:
        print(f"skipped: {reason}")
    throughput = quantize_throughput(args.iters)
    write_result("quant_throughput", {"throughput": throughput}, throughput, args.out)


if __name__ == "__main__":
    main()
