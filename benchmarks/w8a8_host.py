"""Host time per call of a W8A8Linear (vramkit.quant.w8a8) beside bf16 nn.Linear and the
weight-only fp8 QuantizedLinear it replaces under block swapping.

A quantized block is host-bound on a fast GPU when each layer's call costs the host more than
its kernels cost the device. For each layer and mode (``forward`` under no_grad, ``train``: the
forward of a layer whose input requires grad, i.e. through the autograd Function), the host
time per call is ``time.perf_counter`` around ``--calls`` calls enqueued back to back without a
sync (median over ``--rounds`` rounds, layers alternating within a round), and the device time
per call comes from CUDA events around the same calls. Small token counts keep the device
fast, so the host time is what is measured. On CPU there is no device to overlap with: the
script runs the int8 path and prints the CPU time per call, marked ``cpu``.

Per layer in a block (``--block-layers`` W8A8 layers chained, the shape of a block's frozen
Linears): the host time of one block call divided by its layers, eager, compiled
(``torch.compile``: the layer's traced path, inductor's generated quantization and epilogue
kernels) and, on CUDA, compiled with CUDA graphs (``mode="reduce-overhead"``: one replay per
call); ``forward`` under no_grad and ``train`` (forward and backward of an input that requires
grad). That per-layer host time is what a swapped, compiled block pays; the target is <= 30 us
per quantized layer forward on the H200 (9-20 us of host per aten call there).

Run (GPU, ~2 min): PYTHONPATH=src python3 benchmarks/w8a8_host.py --out out/w8a8_host
Run (CPU): PYTHONPATH=src python3 benchmarks/w8a8_host.py --calls 20 --rounds 3 --block-layers 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.quant.linear import QuantizedLinear
from vramkit.quant.w8a8 import W8A8_CAPABILITY, W8A8Linear


def _layers(device: torch.device, n_in: int, n_out: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = nn.Linear(n_in, n_out).to(device=device, dtype=torch.bfloat16).requires_grad_(False)

    def copy() -> nn.Linear:
        layer = nn.Linear(n_in, n_out).to(device=device, dtype=torch.bfloat16)
        layer.load_state_dict(base.state_dict())
        return layer.requires_grad_(False)

    layers: dict[str, nn.Module] = {"bf16": base}
    if device.type == "cuda":
        layers["fp8 weight-only"] = QuantizedLinear.from_linear(copy(), "fp8")
        if torch.cuda.get_device_capability(device) >= W8A8_CAPABILITY["fp8"]:
            layers["w8a8 fp8"] = W8A8Linear.from_linear(copy(), "fp8")
        if torch.cuda.get_device_capability(device) >= W8A8_CAPABILITY["int8"]:
            layers["w8a8 int8"] = W8A8Linear.from_linear(copy(), "int8")
    else:
        layers["w8a8 int8"] = W8A8Linear.from_linear(copy(), "int8")
    return layers


def _time_calls(layer: nn.Module, x: torch.Tensor, calls: int, train: bool
                ) -> tuple[float, float | None]:
    """(host us per call, device us per call or None on CPU) for ``calls`` calls."""
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    with torch.set_grad_enabled(train):
        t0 = time.perf_counter()
        for _ in range(calls):
            layer(x)
        host = (time.perf_counter() - t0) / calls * 1e6
    if not cuda:
        return host, None
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    layers = _layers(device, args.in_features, args.out_features)
    x_plain = torch.randn(args.tokens, args.in_features, device=device, dtype=torch.bfloat16)
    x_grad = x_plain.clone().requires_grad_()
    samples: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    modes = {"forward": (x_plain, False), "train": (x_grad, True)}
    for layer in layers.values():  # warm up: first-call checks, cuBLAS handles
        for x, train in modes.values():
            _time_calls(layer, x, 3, train)
    for _ in range(args.rounds):
        for mode, (x, train) in modes.items():
            for name, layer in layers.items():  # alternating within each round
                samples.setdefault((name, mode), []).append(
                    _time_calls(layer, x, args.calls, train))
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for (name, mode), values in samples.items():
        host = [v[0] for v in values]
        device_us = [v[1] for v in values if v[1] is not None]
        entry = {"layer": name, "mode": mode, "clock": device.type,
                 "host_us_median": statistics.median(host), "host_us_min": min(host),
                 "host_us_max": max(host),
                 "device_us_median": statistics.median(device_us) if device_us else None}
        results.append(entry)
        rows.append({"layer": name, "mode": mode, "clock": device.type,
                     "host us/call": entry["host_us_median"],
                     "spread": f"{min(host):.1f}-{max(host):.1f}",
                     "device us/call": entry["device_us_median"] or "-"})
    if args.block_layers:
        for entry in _per_layer_in_block(args, device):
            results.append(entry)
            rows.append({"layer": entry["layer"], "mode": entry["mode"], "clock": device.type,
                         "host us/call": entry["host_us_median"],
                         "spread": f"{entry['host_us_min']:.1f}-{entry['host_us_max']:.1f}",
                         "device us/call": "-"})
    write_result("w8a8_host", {"shape": [args.tokens, args.in_features, args.out_features],
                               "calls": args.calls, "rounds": args.rounds,
                               "block_layers": args.block_layers, "results": results},
                 rows, args.out)


class _Chain(nn.Module):
    """``n`` W8A8 layers of one shape in a row (in == out features): a block's frozen Linears."""

    def __init__(self, kind: str, n: int, features: int, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            W8A8Linear.from_linear(nn.Linear(features, features).to(device, torch.bfloat16)
                                   .requires_grad_(False), kind) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _block_call(fn: Any, x: torch.Tensor, train: bool) -> Any:
    if not train:
        def call() -> None:
            with torch.no_grad():
                fn(x)
        return call

    def step() -> None:
        fn(x).sum().backward()
    return step


def _per_layer_in_block(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Host us per W8A8 layer in a chain of ``--block-layers``: eager, compiled, CUDA graphs."""
    kinds = ["int8"] if device.type == "cpu" else [
        k for k in ("fp8", "int8")
        if torch.cuda.get_device_capability(device) >= W8A8_CAPABILITY[k]]
    n, features = args.block_layers, args.in_features
    x = torch.randn(args.tokens, features, device=device, dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_()
    calls: dict[tuple[str, str], Any] = {}
    for kind in kinds:
        chain = _Chain(kind, n, features, device)
        variants = {"eager": chain,
                    "compiled": torch.compile(chain, dynamic=False)}
        if device.type == "cuda":
            variants["compiled+cudagraphs"] = torch.compile(chain, dynamic=False,
                                                            mode="reduce-overhead")
        for variant, fn in variants.items():
            for mode, (xi, train) in {"forward": (x, False), "train": (x_grad, True)}.items():
                call = _block_call(fn, xi, train)
                for _ in range(3):  # compile, record graphs, warm up
                    call()
                calls[(f"w8a8 {kind} {variant} (per layer of {n})", mode)] = call
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():  # alternating within each round
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            samples[key].append((time.perf_counter() - t0) / args.calls / n * 1e6)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    return [{"layer": name, "mode": mode, "clock": device.type,
             "host_us_median": statistics.median(v), "host_us_min": min(v),
             "host_us_max": max(v), "device_us_median": None}
            for (name, mode), v in samples.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--in-features", type=int, default=3072)
    parser.add_argument("--out-features", type=int, default=3072)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", action="store_true", help="time on the CPU even with CUDA")
    parser.add_argument("--block-layers", type=int, default=8,
                        help="W8A8 layers chained for the per-layer block timing (0: skip it)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
