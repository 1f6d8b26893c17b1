"""vramkit's W8A8Linear against torchao's dynamic-activation configs on FLUX-shaped linears.

Layers: 3072 -> 3072 and 3072 -> 12288 (FLUX's attention projections and MLP), 4096 tokens,
bf16 activations. Per kind (fp8 on capability >= 8.9, int8 on >= 8.0) and shape, the forward of
``W8A8Linear`` and of an ``nn.Linear`` quantized by ``torchao.quantization.quantize_`` with
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` /
``Int8DynamicActivationInt8WeightConfig()``, plus bf16 ``nn.Linear`` for scale, are timed in
paired rounds that alternate which one runs first (device time with CUDA events over
``--calls`` calls). Prints each median, vramkit / torchao ratios (median and min-max over the
rounds) and vramkit's forward + 8-bit backward beside bf16's (torchao's inference configs give
the input no gradient, so it has no backward to compare).

Skips (prints why, exits 0) without CUDA or without torchao (not a vramkit dependency:
``pip install torchao``).

Run (GPU): PYTHONPATH=src python3 benchmarks/w8a8.py --out out/w8a8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.quant.w8a8 import W8A8_CAPABILITY, W8A8Linear

SHAPES = [(3072, 3072), (3072, 12288)]


def _torchao_layer(linear: nn.Linear, kind: str) -> nn.Module:
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
        quantize_,
    )

    config: Any = (Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
                   if kind == "fp8" else Int8DynamicActivationInt8WeightConfig())
    holder = nn.Sequential(linear)
    quantize_(holder, config)
    return holder[0]


def _device_us(fn: Callable[[], Any], calls: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def _paired(candidates: dict[str, Callable[[], Any]], rounds: int, calls: int
            ) -> dict[str, list[float]]:
    for fn in candidates.values():  # warm up
        _device_us(fn, 3)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]  # alternate who runs first
        for name in order:
            times[name].append(_device_us(candidates[name], calls))
    return times


def _copy(base: nn.Linear) -> nn.Linear:
    layer = nn.Linear(base.in_features, base.out_features, device=base.weight.device,
                      dtype=base.weight.dtype)
    layer.load_state_dict(base.state_dict())
    return layer.requires_grad_(False)


def _no_grad_call(layer: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    def call() -> Any:
        with torch.no_grad():
            return layer(x)
    return call


def _train_call(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], Any]:
    """Forward + the input gradient (the frozen layer's whole backward)."""
    def call() -> Any:
        return torch.autograd.grad(layer(x), x, grad)
    return call


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    capability = torch.cuda.get_device_capability(device)
    kinds = [k for k in ("fp8", "int8") if capability >= W8A8_CAPABILITY[k]]
    results: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for n_in, n_out in SHAPES:
        torch.manual_seed(0)
        base = nn.Linear(n_in, n_out, device=device, dtype=torch.bfloat16).requires_grad_(False)
        x = torch.randn(args.tokens, n_in, device=device, dtype=torch.bfloat16)
        x_grad = x.clone().requires_grad_()
        grad = torch.randn(args.tokens, n_out, device=device, dtype=torch.bfloat16)
        for kind in kinds:
            ours = W8A8Linear.from_linear(_copy(base), kind)
            theirs = _torchao_layer(_copy(base), kind)
            with torch.no_grad():
                reference = base(x).float()
                errors = {name: float((layer(x).float() - reference).norm() / reference.norm())
                          for name, layer in (("vramkit", ours), ("torchao", theirs))}
            no_grad = {name: _no_grad_call(layer, x)
                       for name, layer in (("vramkit", ours), ("torchao", theirs), ("bf16", base))}
            forward = _paired(no_grad, args.rounds, args.calls)
            backward = _paired({"vramkit": _train_call(ours, x_grad, grad),
                                "bf16": _train_call(base, x_grad, grad)},
                               args.rounds, args.calls)
            entry = {"shape": [args.tokens, n_in, n_out], "kind": kind,
                     "forward_us": {k: statistics.median(v) for k, v in forward.items()},
                     "forward_backward_us": {k: statistics.median(v)
                                             for k, v in backward.items()},
                     "vramkit_over_torchao": _ratio(forward["vramkit"], forward["torchao"]),
                     "vramkit_over_bf16": _ratio(forward["vramkit"], forward["bf16"]),
                     "train_vramkit_over_bf16": _ratio(backward["vramkit"], backward["bf16"]),
                     "relative_error": errors}
            results.append(entry)
            spread = entry["vramkit_over_torchao"]
            rows.append({"shape": f"{args.tokens}x{n_in}->{n_out}", "kind": kind,
                         "vramkit fwd us": entry["forward_us"]["vramkit"],
                         "torchao fwd us": entry["forward_us"]["torchao"],
                         "bf16 fwd us": entry["forward_us"]["bf16"],
                         "vramkit/torchao": spread["median"],
                         "spread": f"{spread['min']:.3f}-{spread['max']:.3f}",
                         "fwd+bwd vramkit/bf16": entry["train_vramkit_over_bf16"]["median"],
                         "rel err vramkit": errors["vramkit"],
                         "rel err torchao": errors["torchao"]})
    write_result("w8a8", {"capability": list(capability), "rounds": args.rounds,
                          "calls": args.calls, "results": results}, rows, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("w8a8: skipped, needs a CUDA GPU")
        return
    try:
        import torchao  # noqa: F401
    except ImportError:
        print("w8a8: skipped, torchao is not installed (pip install torchao)")
        return
    if torch.cuda.get_device_capability() < W8A8_CAPABILITY["int8"]:
        print("w8a8: skipped, needs compute capability >= 8.0")
        return
    run(args)


if __name__ == "__main__":
    main()
