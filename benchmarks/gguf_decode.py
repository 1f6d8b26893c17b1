"""GGUF Q8_0 decoding on the GPU: vramkit's Triton decoder against its torch decoder and
diffusers' (``diffusers.quantizers.gguf.utils.dequantize_blocks_Q8_0``), on FLUX's Linear shapes.

Per shape, every decoder turns the same random Q8_0 bytes into a bf16 weight; rounds alternate
the decoders' order (A B C, then C B A), each turn timing ``--calls`` decodes with CUDA events.
Printed per shape: device microseconds per decode (median over rounds), the effective bandwidth
(packed bytes read + bf16 bytes written), and the Triton decoder's time as a ratio of each other
decoder's with its spread over rounds. The Triton and torch decoders must agree bit for bit
(checked); diffusers' rounds the scale to bf16 first, so its values differ in the last bit at
times (not compared). Then the layer that trains on a GGUF base, ``GGUFLinear`` forward +
backward at FLUX's 4,608 tokens, with either decoder, beside ``F.linear`` on the bf16 weight.

Run (GPU): PYTHONPATH=src python3 benchmarks/gguf_decode.py --out out/gguf_decode
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from _common import add_common_args, format_markdown_row, write_result
from _timing import log
from vramkit.quant import gguf

# FLUX.1-dev's Linear weights [out, in]: attention projections, the MLPs, the single blocks'
# fused output projection.
SHAPES = ((3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360))
TOKENS = 4608  # 1024x1024: 4,096 image tokens + 512 text tokens


def q8_0_bytes(rows: int, cols: int, device: torch.device, seed: int) -> torch.Tensor:
    """Random Q8_0 bytes ``[rows, cols / 32 * 34]`` with finite fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    blocks = rows * cols // 32
    raw = torch.randint(0, 256, (blocks, 34), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(blocks, 1, generator=gen) * 0.02).to(torch.float16)
    raw[:, :2] = scales.view(torch.uint8)
    return raw.reshape(rows, -1).to(device)


def decoders(raw: torch.Tensor, rows: int, cols: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The decoders of one weight, each returning ``[rows, cols]`` bf16."""
    qtype = gguf.gguf_quant_type("Q8_0")
    blocks = raw.reshape(-1, 34)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "triton": lambda: gguf._decode(raw, qtype, (rows, cols), torch.bfloat16),
        "torch": lambda: gguf._q8_0(blocks, torch.bfloat16).reshape(rows, cols),
    }
    try:
        from diffusers.quantizers.gguf.utils import dequantize_blocks_Q8_0
    except ImportError as exc:
        log(f"diffusers' GGUF decoder not importable ({exc}); its column stays empty")
    else:
        out["diffusers"] = lambda: dequantize_blocks_Q8_0(
            blocks, 32, 34, torch.bfloat16).reshape(rows, cols)
    return out


def time_paired(ops: dict[str, Callable[[], object]], calls: int, rounds: int
                ) -> dict[str, list[float]]:
    """Microseconds per call of each op, per round, the order alternating between rounds."""
    for fn in ops.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                ops[name]()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / calls * 1e3)
    return times


def _ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, str]:
    ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return statistics.median(ratios), f"{min(ratios):.3f}-{max(ratios):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="decodes per turn")
    parser.add_argument("--rounds", type=int, default=6)
    add_common_args(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gguf_decode.py needs a CUDA GPU (the decoders it compares run there)",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows_out: list[dict[str, object]] = []
    for i, (rows, cols) in enumerate(SHAPES):
        raw = q8_0_bytes(rows, cols, dev, seed=i)
        ops = decoders(raw, rows, cols)
        if not torch.equal(ops["triton"](), ops["torch"]()):
            raise SystemExit(f"the Triton and torch decoders differ on [{rows}, {cols}]")
        times = time_paired(ops, args.calls, args.rounds)
        moved = raw.numel() + rows * cols * 2
        row: dict[str, object] = {"shape": f"{rows}x{cols}"}
        for name, ts in times.items():
            us = statistics.median(ts)
            row[f"{name} us"] = round(us, 1)
            row[f"{name} GB/s"] = round(moved / us / 1e3, 0)
        for other in ("torch", "diffusers"):
            if other in times:
                ratio, spread = _ratio(times, "triton", other)
                row[f"triton / {other}"] = round(ratio, 3)
                row[f"triton / {other} spread"] = spread
        rows_out.append(row)
        log(f"decode {row}")
    # the layer: forward + backward with each decoder, and bf16 F.linear on the same weight
    raw = q8_0_bytes(3072, 3072, dev, seed=9)
    layer = gguf.GGUFLinear(raw, "Q8_0", 3072, 3072, dtype=torch.bfloat16).to(dev)
    weight = layer.dequantized_weight()
    x = torch.randn(TOKENS, 3072, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, 3072, device=dev, dtype=torch.bfloat16)
    use_triton = gguf._triton_decodes

    def gguf_step(triton: bool) -> None:
        gguf._triton_decodes = (use_triton if triton  # type: ignore[assignment]
                                else lambda device: False)
        try:
            layer(x).backward(grad)
        finally:
            gguf._triton_decodes = use_triton  # type: ignore[assignment]

    steps: dict[str, Callable[[], object]] = {
        "GGUFLinear triton": lambda: gguf_step(True),
        "GGUFLinear torch": lambda: gguf_step(False),
        "bf16 F.linear": lambda: F.linear(x, weight).backward(grad),
    }
    times = time_paired(steps, args.calls, args.rounds)
    layer_row: dict[str, object] = {"shape": f"fwd+bwd 3072x3072, {TOKENS} tokens"}
    for name, ts in times.items():
        layer_row[f"{name} us"] = round(statistics.median(ts), 1)
    for other in ("GGUFLinear torch", "bf16 F.linear"):
        ratio, spread = _ratio(times, "GGUFLinear triton", other)
        layer_row[f"triton / {other}"] = round(ratio, 3)
        layer_row[f"triton / {other} spread"] = spread
    log(f"layer {layer_row}")
    write_result("gguf_decode", {"calls": args.calls, "rounds": args.rounds,
                                 "layer": layer_row}, rows_out, args.out)
    print(format_markdown_row(layer_row, header=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
