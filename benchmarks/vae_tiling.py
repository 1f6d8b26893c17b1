"""VAE tiling benchmark: untiled vs blended tiles vs exact GroupNorm tiling, SDXL VAE decode.

A randomly initialised diffusers ``AutoencoderKL`` with the SDXL VAE config (built from config, no
download) decodes a random latent at each image size, in each dtype, with:

* **untiled**: ``vae.decode`` with the mid block's attention run by vramkit's
  ``ChunkedAttnProcessor`` (exact attention that fits a 512x512 latent; the same processor
  as exact mode uses, so the reference is exact);
* **blended**: ``VAETiling(tile_size=512, overlap=64)`` (per-tile GroupNorm, linear blend);
* **exact**: ``VAETiling(exact_groupnorm=True)``, intermediates on the device (default budget);
* **exact-capped**: the same with ``tile_size=--capped-tile`` (256) and ``exact_device_budget``
  derived from ``--cap`` (3e9 bytes in total, see ``capped_budget``), large intermediates in
  pinned host memory, moved by async copies. Exact rows also report bytes moved each way, strips,
  the compute stream's time stalled on uploads (CUDA events) and a per-step table (stderr).
* bf16 rows at <= 2048 are also compared with a float32 untiled decode (``err_vs_fp32``): the
  untiled bf16 row's value is bf16's own noise floor.

Per row: GPU time (CUDA events, after one warm-up run), overhead vs untiled, peak
``torch.cuda.max_memory_allocated`` after a reset (weights and latents included), and, where the
untiled reference ran, max abs error and PSNR (on the [0, 1] scale: a [-1, 1] image's error / 2)
over the image and within 32 px of seams. PASS/FAIL against the targets: at 4096x4096,
peak <= 3 GB; exact within 2/255 max abs and >= 45 dB near seams; overhead <= 1.6x.

Run (GPU, ~3-4 min):  PYTHONPATH=src python benchmarks/vae_tiling.py --out out
Run (GPU, quick):     PYTHONPATH=src python benchmarks/vae_tiling.py --sizes 2048 --dtypes bfloat16
Run (CPU, code paths only): PYTHONPATH=src python benchmarks/vae_tiling.py --device cpu
"""

from __future__ import annotations

import argparse
import copy
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
    from tests.tiling._models import sdxl_vae_config
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
        ("exact-capped", VAETiling(tile_size=args.capped_tile, exact_groupnorm=True,
                                   exact_device_budget=capped_budget(vae, dtype, size, args))),
    ]
    fp32_reference = noise_floor_reference(vae, z, size, args) if dtype != torch.float32 else None
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
                    row.update(breakdown(stats, tiling))
                    if size >= args.per_step_size and name == "exact-capped":
                        log_steps(stats)
                if reference is not None:
                    report = seam_error(out, reference, seams_y, seams_x, band_px=32)
                    row.update(max_abs_err=report.max_abs_error, psnr_db=report.psnr_db,
                               seam_max_abs_err=report.seam_max_abs_error,
                               seam_psnr_db=report.seam_psnr_db)
            if fp32_reference is not None:
                floor = seam_error(out, fp32_reference, [], [])
                row["err_vs_fp32"] = floor.max_abs_error
                row["psnr_vs_fp32_db"] = floor.psnr_db
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


def capped_budget(vae: Any, dtype: torch.dtype, size: int, args: argparse.Namespace) -> int:
    """``exact_device_budget`` that keeps the exact-capped run under ``--cap`` bytes in total.

    Peak ~= weights + output image + max(budget, attention keys+values) + strip working set,
    so budget = 0.92 * cap - weights - output - working set, where the working set is taken as
    24 strips' worth of elements (uploads in flight for _MAX_STRIPS_AHEAD strips, the float32
    normalisation copy, the padded input, the conv output, the residual, the statistics' float32
    copy, downloads in flight). The 8% margin covers the caching allocator's rounding.
    """
    weights = sum(p.numel() * p.element_size() for p in vae.parameters())
    output = 3 * size * size * dtype.itemsize
    strip_elements = args.capped_tile ** 2 * 256
    working_set = 24 * strip_elements * dtype.itemsize
    budget = int(0.92 * args.cap) - weights - output - working_set
    log(f"capped budget {budget / 1e9:.2f} GB = 0.92 * {args.cap / 1e9:.1f} GB - weights "
        f"{weights / 1e9:.2f} - output {output / 1e9:.2f} - working set {working_set / 1e9:.2f}")
    return max(budget, 0)


def noise_floor_reference(vae: Any, z: torch.Tensor, size: int, args: argparse.Namespace
                          ) -> torch.Tensor | None:
    """The untiled decode of ``z`` by a float32 copy of ``vae`` (TF32 off): the bf16 rows are
    also compared with it, so bf16 rounding (the untiled bf16 row's error) is told apart from
    tiling error."""
    if size > args.noise_floor_size or z.device.type != "cuda":
        return None
    log(f"float32 reference at {size} (noise floor of the lower-precision rows)")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        vae32 = copy.deepcopy(vae).float()
        with torch.no_grad(), use_chunked_attention(vae32):
            reference = vae32.decode(z.float()).sample
        del vae32
        return reference
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def breakdown(stats: Any, tiling: VAETiling) -> dict[str, Any]:
    """Where an exact run's time and memory went (syncs: after the timed run only)."""
    row = {"host_planes_gb": stats.host_plane_bytes_peak / 1e9,
           "device_planes_gb": stats.device_plane_bytes_peak / 1e9,
           "kv_gb": stats.attention_kv_bytes / 1e9,
           "budget_gb": (tiling.exact_device_budget or 0) / 1e9,
           "h2d_gb": stats.h2d_bytes / 1e9, "d2h_gb": stats.d2h_bytes / 1e9,
           "steps": stats.steps, "strips": stats.strips,
           "newly_pinned_gb": stats.host_bytes_newly_pinned / 1e9}
    timings = stats.timings()
    if timings is not None:
        row.update(steps_ms=timings["steps_ms"], copy_wait_ms=timings["copy_wait_ms"])
    return row


def log_steps(stats: Any) -> None:
    """Per-step table (stderr): which steps are copy-bound."""
    timings = stats.timings()
    step_ms = timings["step_ms"] if timings else [float("nan")] * len(stats.step_records)
    log("step | out C x H x W | out on host | strips | h2d GB | d2h GB | ms | GB/s h2d")
    for record, ms in zip(stats.step_records, step_ms, strict=True):
        c, h, w = record.out_shape
        rate = record.h2d_bytes / 1e6 / ms if ms > 0 else float("nan")
        log(f"{record.name} | {c}x{h}x{w} | {record.out_on_host} | {record.strips} | "
            f"{record.h2d_bytes / 1e9:.2f} | {record.d2h_bytes / 1e9:.2f} | {ms:.1f} | {rate:.1f}")


def verdict(row: dict[str, Any], size: int, args: argparse.Namespace) -> dict[str, str]:
    """PASS/FAIL for the targets that apply to this row ("-" where none does)."""
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
    parser.add_argument("--cap", type=float, default=PEAK_TARGET_BYTES,
                        help="total peak bytes the exact-capped rows aim at (default 3e9); "
                             "their exact_device_budget is derived from it (capped_budget)")
    parser.add_argument("--capped-tile", type=int, default=256,
                        help="tile_size (strip work size) of the exact-capped rows (default 256)")
    parser.add_argument("--noise-floor-size", type=int, default=2048,
                        help="largest size at which lower-precision rows are also compared "
                             "with a float32 untiled decode (default 2048)")
    parser.add_argument("--per-step-size", type=int, default=4096,
                        help="print a per-step breakdown of exact-capped runs from this size "
                             "(default 4096)")
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
               "seam_psnr_db", "err_vs_fp32", "budget_gb", "kv_gb", "host_planes_gb", "h2d_gb",
               "d2h_gb", "strips", "steps_ms", "copy_wait_ms", "newly_pinned_gb", "targets"]
    table = [{c: row.get(c, "-") if row.get(c) is not None else "-" for c in columns}
             for row in rows]
    write_result("vae_tiling", {"rows": rows, "targets": {
        "peak_bytes_at_4096": PEAK_TARGET_BYTES, "exact_max_abs": MAX_ERR_TARGET,
        "exact_seam_psnr_db": SEAM_PSNR_TARGET, "overhead": OVERHEAD_TARGET}}, table, args.out)


if __name__ == "__main__":
    main()
