"""VAE tiling benchmark: untiled vs blended tiles vs exact GroupNorm tiling, SDXL VAE decode.

A randomly initialised diffusers ``AutoencoderKL`` with the SDXL VAE config (built from config, no
download) decodes a random latent at each image size, in each dtype, with:

* **untiled**: ``vae.decode`` with the mid block's attention run by vramkit's
  ``ChunkedAttnProcessor`` (exact attention that fits a 512x512 latent; the same processor
  as exact mode uses, so the reference is exact);
* **blended**: ``VAETiling(tile_size=512, overlap=64)`` (per-tile GroupNorm, linear blend);
* **exact**: ``VAETiling(exact_groupnorm=True)``, intermediates on the device (default budget);
* **exact-capped**: the same with ``exact_device_budget`` set so the run stays under the memory
  target (large intermediates go to pinned host memory, moved by async copies).

Per row: GPU time (CUDA events, after one warm-up run), overhead vs untiled, peak
``torch.cuda.max_memory_allocated`` after a reset (weights and latents included), and, where the
untiled reference ran, max abs error and PSNR (on the [0, 1] scale: a [-1, 1] image's error / 2)
over the image and within 32 px of seams. PASS/FAIL against the issue's targets: at 4096x4096,
peak <= 3 GB; exact within 2/255 max abs and >= 45 dB near seams; overhead <= 1.6x.

Run (GPU, ~3-4 min):  PYTHONPATH=src python benchmarks/vae_tiling.py --out out
Run (GPU, quick):     PYTHONPATH=src python benchmarks/vae_tiling.py --sizes 2048 --dtypes bfloat16
Run (CPU, code paths only): PYTHONPATH=src python benchmarks/vae_tiling.py --device cpu
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import add_common_args, write_result
from vramkit.tiling import VAETiling, seam_error, use_chunked_attention

PEAK_TARGET_BYTES, MAX_ERR_TARGET, SEAM_PSNR_TARGET, OVERHEAD_TARGET = 3e9, 2 / 255, 45.0, 1.6
_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def build_vae(device: torch.device, dtype: torch.dtype, tiny: bool) -> Any:
    """The SDXL VAE architecture with random weights (or a tiny one for the CPU run)."""
    try:
        from diffusers import AutoencoderKL
    except ImportError as exc:
        raise SystemExit(f"this benchmark needs diffusers ({exc}); pip install diffusers") from exc
    from tests._tiling_models import sdxl_vae_config
    config = sdxl_vae_config()
    if tiny:
        config.update(block_out_channels=[16, 32, 32, 32], layers_per_block=1, norm_num_groups=8)
    torch.manual_seed(0)
    return AutoencoderKL(**config).to(device=device, dtype=dtype).eval()


def measure(device: torch.device, fn: Callable[[], Any], warmup: bool) -> tuple[Any, float, int]:
    """Run ``fn`` (after one warm-up run) and return (result, ms, peak allocated bytes)."""
    cuda = device.type == "cuda"
    if warmup:
        fn()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end), torch.cuda.max_memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3, 0


def run_size(vae: Any, device: torch.device, dtype: torch.dtype, size: int, args: argparse.Namespace
             ) -> list[dict[str, Any]]:
    latent = size // 8  # the SDXL VAE (and the tiny CPU one) has scale factor 8
    z = torch.randn(1, 4, latent, latent, generator=torch.Generator().manual_seed(size))
    z = z.to(device=device, dtype=dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    results: list[dict[str, Any]] = []
    reference = None
    untiled_ms = None
    methods: list[tuple[str, VAETiling | None]] = [
        ("untiled", None),
        ("blended", VAETiling(tile_size=512, overlap=64)),
        ("exact", VAETiling(exact_groupnorm=True)),
        ("exact-capped", VAETiling(exact_groupnorm=True, exact_device_budget=args.capped_budget)),
    ]
    for name, tiling in methods:
        if name in args.skip:
            continue
        row: dict[str, Any] = {"dtype": dtype_name, "size": size, "method": name}
        log(f"{dtype_name} {size}x{size} {name}")
        try:
            with torch.no_grad():
                if tiling is None:
                    def untiled() -> tuple[torch.Tensor, list[int], list[int]]:
                        with use_chunked_attention(vae):
                            return vae.decode(z).sample, [], []
                    fn = untiled
                else:
                    def tiled(t: VAETiling = tiling) -> tuple[torch.Tensor, list[int], list[int]]:
                        return t.decode_with_seams(vae, z)
                    fn = tiled
                (out, seams_y, seams_x), ms, peak = measure(device, fn, warmup=not args.no_warmup)
            row.update(ms=ms, peak_gb=peak / 1e9)
            if tiling is None:
                reference, untiled_ms = out, ms
            else:
                row["overhead_vs_untiled"] = ms / untiled_ms if untiled_ms else None
                stats = tiling.last_exact_stats
                if tiling.exact_groupnorm and stats is not None:
                    row["host_planes_gb"] = stats.host_plane_bytes_peak / 1e9
                    row["device_planes_gb"] = stats.device_plane_bytes_peak / 1e9
                if reference is not None:
                    report = seam_error(out, reference, seams_y, seams_x, band_px=32)
                    row.update(max_abs_err=report.max_abs_error, psnr_db=report.psnr_db,
                               seam_max_abs_err=report.seam_max_abs_error,
                               seam_psnr_db=report.seam_psnr_db)
            del out
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # report, keep the other rows
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log(traceback.format_exc(limit=3))
        row.update(verdict(row, size, args))
        results.append(row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def verdict(row: dict[str, Any], size: int, args: argparse.Namespace) -> dict[str, str]:
    """PASS/FAIL for the issue's targets that apply to this row ("-" where none does)."""
    checks: list[bool] = []
    if "error" in row:
        return {"targets": "ERROR"}
    if size >= 4096 and row["method"] in ("blended", "exact-capped"):
        checks.append(row["peak_gb"] * 1e9 <= PEAK_TARGET_BYTES)
    if row["method"].startswith("exact") and "max_abs_err" in row:
        checks.append(row["max_abs_err"] <= MAX_ERR_TARGET)
        checks.append((row["seam_psnr_db"] or float("inf")) >= SEAM_PSNR_TARGET)
    if row.get("overhead_vs_untiled") is not None:
        checks.append(row["overhead_vs_untiled"] <= OVERHEAD_TARGET)
    if not checks:
        return {"targets": "-"}
    return {"targets": "PASS" if all(checks) else "FAIL"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--sizes", type=int, nargs="+", help="image sides (default 2048 4096; "
                                                             "cpu 128)")
    parser.add_argument("--dtypes", nargs="+", default=None,
                        help="bfloat16 and/or float32 (default both on GPU; cpu float32)")
    parser.add_argument("--capped-budget", default="1GiB",
                        help="exact_device_budget of the exact-capped rows (default 1GiB)")
    parser.add_argument("--skip", nargs="*", default=[], help="methods to skip")
    parser.add_argument("--no-warmup", action="store_true", help="time the first run")
    parser.add_argument("--time-limit", type=float, default=230.0,
                        help="skip remaining configurations after this many seconds")
    add_common_args(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    args.tiny = device.type == "cpu"
    if args.tiny:
        torch.set_num_threads(1)
    sizes = args.sizes or ([128] if args.tiny else [2048, 4096])
    dtypes = args.dtypes or (["float32"] if args.tiny else ["bfloat16", "float32"])
    rows: list[dict[str, Any]] = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        vae = build_vae(device, dtype, args.tiny)
        for size in sizes:
            if time.perf_counter() - _START > args.time_limit:
                log(f"time limit reached: skipping {dtype_name} {size}")
                continue
            rows += run_size(vae, device, dtype, size, args)
        del vae
        gc.collect()
    columns = ["dtype", "size", "method", "ms", "overhead_vs_untiled", "peak_gb", "max_abs_err",
               "seam_psnr_db", "host_planes_gb", "targets"]
    table = [{c: row.get(c, "-") if row.get(c) is not None else "-" for c in columns}
             for row in rows]
    write_result("vae_tiling", {"rows": rows, "targets": {
        "peak_bytes_at_4096": PEAK_TARGET_BYTES, "exact_max_abs": MAX_ERR_TARGET,
        "exact_seam_psnr_db": SEAM_PSNR_TARGET, "overhead": OVERHEAD_TARGET}}, table, args.out)


if __name__ == "__main__":
    main()
