"""Time to the first step with compressed masters loaded from a checkpoint: each block encoded
beside the background fill, against the encode after a foreground fill, side by side.

The model is ``benchmarks/compress_swap.py``'s FLUX-sized stand-in (StackBlock: hidden 3072, 24
heads, MLP 4x, LoRA r16 on the attention projections; 226 MB of bf16 per block) x ``--blocks``
(24 by default: 5.4 GB), written once as one safetensors file into ``--workdir`` (kept while its
name matches the shape). Each round attaches, in turn, a fresh copy built on meta from that file
in each arm:

* ``bg``: ``BlockSwapper(model, SwapConfig(compress="on"), checkpoint=file)``: the fill in the
  background, each block encoded on one thread as soon as it is filled (the code under test);
* ``fg``: the same with ``load_in_background=False``: everything read and encoded before the
  swapper returns (what ``compress="on"`` always did before; the baseline);
* ``raw``: ``compress="off"`` in the background (what compressing costs on top of the fill).

and times (synchronized) the attach, the first LoRA step (every block checkpointed, 4096 tokens,
batch 1) and the whole load (``wait_loaded``); it records the device peak from the attach's
return to the end of the first step (``max_memory_allocated``: a background encode shares the
card with that step) and the pinned bytes once everything is loaded. After the first round the
file is read from the page cache, so the figures are the swapper's own work (pinning, copies,
encode), not the disk's. Prints per arm the median times and the paired ratios bg/fg and bg/raw
of the time to the end of the first step (median and spread over the rounds), and checks that
the first step's loss is the same bit for bit in every arm.

Run (H200, ~3 min): PYTHONPATH=src python3 benchmarks/compress_load.py \\
    --workdir /tmp/vramkit_compress_load --out out/compress_load
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/compress_load.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _swap_models import StackBlock
from compress_swap import Stack, build
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig

GIB = 1 << 30
ARMS = ("bg", "fg", "raw")


def checkpoint(args: argparse.Namespace, device: torch.device) -> Path:
    """The model's file in ``--workdir``, written when missing (its name says its shape)."""
    path = args.workdir / f"stack_{args.blocks}x{args.hidden}_r{args.rank}.safetensors"
    if not path.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        model = build(args, device)
        start = time.perf_counter()
        partial = path.with_suffix(".partial")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(partial))
        partial.rename(path)
        print(f"wrote {path} ({path.stat().st_size / GIB:.1f} GiB) in "
              f"{time.perf_counter() - start:.0f}s", flush=True)
        del model
        gc.collect()
    return path


def on_meta(args: argparse.Namespace) -> Stack:
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        blocks = [StackBlock(args.hidden, args.heads, args.rank, generator).to(torch.bfloat16)
                  for _ in range(args.blocks)]
    return Stack(blocks)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(arm: str, path: Path, args: argparse.Namespace, device: torch.device,
            x: torch.Tensor) -> dict[str, Any]:
    model = on_meta(args)
    enable_gradient_checkpointing(model, "blocks")
    config = SwapConfig(num_slots=2, compress="off" if arm == "raw" else "on",
                        host_memory="pinned")
    gc.collect()
    sync(device)
    start = time.perf_counter()
    swapper = BlockSwapper(model, "blocks", config, device=device, checkpoint=path,
                           load_in_background=arm != "fg")
    attached = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    first_loss = loss.item()
    sync(device)
    first_step = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    swapper.wait_loaded()
    loaded = time.perf_counter() - start
    stats = swapper.stats()
    swapper.detach()
    del swapper, model, opt, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"attach_s": attached, "first_step_s": first_step, "loaded_s": loaded,
            "loss": first_loss, "peak_gib": peak / GIB, "pinned_gib": stats.pinned_bytes / GIB,
            "compressed_blocks": stats.compressed_blocks}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=None, help="default 24; tiny 4")
    parser.add_argument("--tokens", type=int, default=None, help="default 4096; tiny 32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the checkpoint is written and kept (default: a temporary "
                             "directory, written again each run)")
    parser.add_argument("--tiny", action="store_true", help="a small stack on the CPU")
    add_common_args(parser)
    args = parser.parse_args(argv)
    args.blocks = args.blocks or (4 if args.tiny else 24)
    args.tokens = args.tokens or (32 if args.tiny else 4096)
    args.hidden, args.heads, args.rank = (128, 4, 4) if args.tiny else (3072, 24, 16)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper: crashed on FLUX shapes
    scratch = None
    if args.workdir is None:
        scratch = tempfile.TemporaryDirectory(prefix="vramkit_compress_load_")
        args.workdir = Path(scratch.name)
    path = checkpoint(args, device)
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=torch.bfloat16,
                    generator=torch.Generator(device=device).manual_seed(1))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for turn in range(args.rounds):
        order = ARMS if turn % 2 == 0 else tuple(reversed(ARMS))  # alternate who goes first
        for arm in order:
            runs[arm].append(run_arm(arm, path, args, device, x))
            print(f"round {turn} {arm}: {runs[arm][-1]}", flush=True)
    if scratch is not None:
        scratch.cleanup()

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[arm])

    def ratios(a: str, b: str) -> list[float]:
        return [x["first_step_s"] / y["first_step_s"]
                for x, y in zip(runs[a], runs[b], strict=True)]

    bg_fg, bg_raw = ratios("bg", "fg"), ratios("bg", "raw")
    losses = {r["loss"] for arm in ARMS for r in runs[arm]}
    result = {
        "blocks": args.blocks, "tokens": args.tokens, "rounds": args.rounds,
        "arms": {arm: {key: median(arm, key) for key in runs[arm][0] if key != "loss"}
                 for arm in ARMS},
        "first_step_bg_over_fg": statistics.median(bg_fg),
        "first_step_bg_over_fg_range": [min(bg_fg), max(bg_fg)],
        "first_step_bg_over_raw": statistics.median(bg_raw),
        "first_step_bg_over_raw_range": [min(bg_raw), max(bg_raw)],
        "losses_identical": len(losses) == 1,
        "runs": runs,
    }
    table = [{"arm": arm, "attach s": f"{median(arm, 'attach_s'):.2f}",
              "first step done s": f"{median(arm, 'first_step_s'):.2f}",
              "loaded s": f"{median(arm, 'loaded_s'):.2f}",
              "peak GiB (first step)": f"{median(arm, 'peak_gib'):.2f}",
              "pinned GiB": f"{median(arm, 'pinned_gib'):.2f}",
              "compressed": int(median(arm, "compressed_blocks"))} for arm in ARMS]
    write_result("compress_load", result, table, args.out)
    print(f"first step bg/fg {result['first_step_bg_over_fg']:.3f} "
          f"({min(bg_fg):.3f}-{max(bg_fg):.3f}), bg/raw {result['first_step_bg_over_raw']:.3f} "
          f"({min(bg_raw):.3f}-{max(bg_raw):.3f}), losses identical: "
          f"{result['losses_identical']}")
    return result


if __name__ == "__main__":
    main()
