"""Soak: many steps of LoRA training under block swapping, watched for slow growth.

A FLUX-sized transformer stack (benchmarks/_swap_models.py's TransformerStack: FLUX single-block
sized blocks, hidden 3072, 24 heads, MLP 4x, ~113 M frozen parameters each in bf16, LoRA rank 16
on the attention projections) trains at 4096 tokens, batch 1, every block checkpointed, under a
device budget of 2 slots and half the other blocks (``SwapConfig(max_gpu_bytes=...)``: about 5 of the
8 blocks swapped through 2 slots; the JSON says how many). Every ``--checkpoint-every`` steps the adapter weights and the AdamW
state are saved (``vramkit._files.atomic_path``: the previous checkpoint stays whole if the save
is interrupted) and read back.

After each step it samples device memory allocated and reserved, the swapper's pinned bytes and
the host's RSS, and prints, after a warm-up, each series' least-squares slope in bytes per step
with the leak rule's verdict (``vramkit.observe.leaks.assess_growth``: flat, or a leak at a rate
at or above its 256 KiB/step threshold). Then the same steps run again with every block resident
(same seed, same data): the losses at steps 1, N/2 and N must be equal.

The two runs are sequential, not paired: this script measures memory over time and equality of
the losses, not a step-time ratio (benchmarks/swap.py and compile_swap.py time the swapped step
against the resident one in paired rounds).

Run (GPU, H200: ~2.5 min; 8 blocks, 1000 steps swapped + 1000 resident):
    PYTHONPATH=src python3 benchmarks/soak.py --out out/soak
Run (CPU, code paths only, a few seconds):
    PYTHONPATH=src python3 benchmarks/soak.py --device cpu --tiny --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, deterministic_kernels, write_result
from _swap_models import TransformerStack
from vramkit._files import atomic_path
from vramkit.observe.leaks import assess_growth
from vramkit.observe.stats import host_rss
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig

#: The series sampled after every step (bytes).
SERIES = ("device_allocated", "device_reserved", "pinned", "host_rss")


def _model(args: argparse.Namespace, device: torch.device, *, swapped: bool
           ) -> tuple[torch.nn.Module, BlockSwapper | None]:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = TransformerStack(args.blocks, args.hidden, args.heads, args.rank, dtype,
                             torch.device("cpu"), seed=args.seed)
    if args.checkpointing:
        enable_gradient_checkpointing(model, "blocks")
    if not swapped:
        return model.to(device), None
    # A budget of the 2 slots and half of the other blocks: about half the blocks swapped.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = total * (args.blocks + 2) // (2 * args.blocks)
    small = {"min_param_bytes": 1024} if args.tiny else {}  # the tiny stack's weights swap too
    swapper = BlockSwapper(model, "blocks", SwapConfig(max_gpu_bytes=budget, num_slots=2,
                                                       **small), device=device)
    return model, swapper


def _batch(step: int, args: argparse.Namespace, device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same inputs and targets at step ``step`` of every run, drawn on ``device`` (drawn on
    the host, two 4096 x 3072 tensors took ~0.2 s a step: the 2,000 steps of a GPU run spent
    minutes there)."""
    generator = torch.Generator(device=device).manual_seed(args.seed * 100_003 + step)
    shape = (1, args.tokens, args.hidden)
    x = torch.randn(shape, generator=generator, device=device)
    target = torch.randn(shape, generator=generator, device=device)
    return x.to(dtype), target


def _sample(device: torch.device, swapper: BlockSwapper | None) -> dict[str, int]:
    cuda = device.type == "cuda"
    return {"device_allocated": int(torch.cuda.memory_allocated(device)) if cuda else 0,
            "device_reserved": int(torch.cuda.memory_reserved(device)) if cuda else 0,
            "pinned": int(swapper.stats().pinned_bytes) if swapper is not None else 0,
            "host_rss": int(host_rss() or 0)}


def _save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          step: int) -> None:
    """The adapters and the optimizer state, written atomically, then read back."""
    state = {"step": step, "optimizer": optimizer.state_dict(),
             "adapters": {n: p.detach().to("cpu", copy=True)
                          for n, p in model.named_parameters() if p.requires_grad}}
    with atomic_path(path) as temporary:
        torch.save(state, temporary)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == step and loaded["adapters"].keys() == state["adapters"].keys()


def _train(args: argparse.Namespace, device: torch.device, *, swapped: bool,
           out: Path) -> dict[str, Any]:
    model, swapper = _model(args, device, swapped=swapped)
    dtype = next(p.dtype for p in model.parameters())
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-4)
    losses: list[float] = []
    seconds: list[float] = []
    samples: dict[str, list[int]] = {name: [] for name in SERIES}
    saves = 0
    for step in range(1, args.steps + 1):
        x, target = _batch(step, args, device, dtype)
        start = time.perf_counter()
        loss = (model(x).float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a host sync: the step is done
        seconds.append(time.perf_counter() - start)
        if swapped and step % args.checkpoint_every == 0:
            _save(out / "soak_checkpoint.pt", model, optimizer, step)
            saves += 1
        if swapped:
            for name, value in _sample(device, swapper).items():
                samples[name].append(value)
    result: dict[str, Any] = {"losses": losses,
                              "median_step_ms": statistics.median(seconds[1:] or seconds) * 1e3}
    if swapper is not None:
        stats = swapper.stats()
        result.update(samples=samples, saves=saves, swapped_blocks=stats.swapped_blocks,
                      blocks=stats.blocks, pinned_bytes=stats.pinned_bytes)
        swapper.detach()
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _slopes(samples: dict[str, list[int]], warmup: int) -> dict[str, dict[str, Any]]:
    """Each series' slope after warm-up (bytes/step) and the leak rule's verdict."""
    out = {}
    for name, values in samples.items():
        verdict = assess_growth(values, name, warmup_steps=warmup)
        out[name] = {"bytes_per_step": round(verdict.bytes_per_step, 1),
                     "verdict": "leak" if verdict.leak else "flat",
                     "threshold_bytes_per_step": verdict.threshold_bytes_per_step,
                     "first": values[warmup] if len(values) > warmup else None,
                     "last": values[-1] if values else None}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=None, help="default 8; tiny 4")
    parser.add_argument("--tokens", type=int, default=None, help="default 4096; tiny 16")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="steps between checkpoint saves (default 100; tiny 10)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="keep every block's activations (default: every block "
                             "checkpointed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a small fp32 stack (CPU code paths)")
    parser.add_argument("--nondeterministic", dest="deterministic", action="store_false",
                        help="leave PyTorch's nondeterministic kernels on (default: deterministic "
                             "algorithms, so that equal losses test the swapping alone)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    args.blocks = args.blocks or (4 if args.tiny else 8)
    args.tokens = args.tokens or (16 if args.tiny else 4096)
    args.checkpoint_every = args.checkpoint_every or (10 if args.tiny else 100)
    args.hidden, args.heads, args.rank = (32, 2, 4) if args.tiny else (3072, 24, 16)
    if args.steps < 4:
        parser.error("--steps must be 4 or more (steps 1, N/2 and N are compared)")
    device = torch.device(args.device)
    if args.deterministic:
        deterministic_kernels()
    if args.tiny:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + Hopper: crashed on FLUX shapes
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    swapped = _train(args, device, swapped=True, out=args.out)
    resident = _train(args, device, swapped=False, out=args.out)
    warmup = max(3, args.steps // 10)
    slopes = _slopes(swapped["samples"], warmup)
    n = args.steps
    compared = {str(step): {"swapped": swapped["losses"][step - 1],
                            "resident": resident["losses"][step - 1]}
                for step in (1, n // 2, n)}
    equal = all(v["swapped"] == v["resident"] for v in compared.values())
    diff = max(abs(a - b) for a, b in zip(swapped["losses"], resident["losses"], strict=True))
    result = {
        "config": {"steps": n, "blocks": args.blocks, "hidden": args.hidden,
                   "tokens": args.tokens, "rank": args.rank, "checkpointing": args.checkpointing,
                   "checkpoint_every": args.checkpoint_every, "device": str(device),
                   "deterministic": args.deterministic,
                   "swapped_blocks": swapped["swapped_blocks"], "warmup_steps": warmup},
        "slopes": slopes, "losses": compared, "losses_equal": equal,
        "max_loss_difference": diff, "checkpoint_saves": swapped["saves"],
        "median_step_ms": {"swapped": swapped["median_step_ms"],
                           "resident": resident["median_step_ms"]},
        "wall_seconds": time.perf_counter() - started,
    }
    rows = [{"series": name, "bytes/step after warm-up": s["bytes_per_step"],
             "verdict": s["verdict"], "first": s["first"], "last": s["last"]}
            for name, s in slopes.items()]
    rows.append({"series": f"loss at steps 1, {n // 2}, {n}",
                 "bytes/step after warm-up": "", "verdict": "equal" if equal else
                 f"differ (max {diff:.3g})", "first": "", "last": ""})
    write_result("soak", result, rows, args.out)
    return result


if __name__ == "__main__":
    main()
