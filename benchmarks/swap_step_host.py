"""Where the swapper's overhead goes in a host-bound training step (CUDA only).

The model is the demo's DiT ("large" preset by default) at about 2048 tokens, frozen, with a
trainable input and checkpointing on: the configuration whose swap overhead docs/benchmarks.md
discusses. Each part prints one table (``--parts``, default all):

* ``phases``: host time of the forward and of the backward (``time.perf_counter``, with a
  ``torch.cuda.synchronize`` before each step) and the tail the GPU still runs after the host
  returned, resident against ``--swapped`` of the blocks swapped. Garbage collection is off and
  the two alternate over ``--rounds``.
* ``calls``: the swapper's own functions timed inside the swapped step, per step: acquire/release
  (``SwapStats.enqueue_seconds``), the copy enqueue, the backward boundary (``BlockEntry``
  backward; the output hooks or ``BlockExit`` backward, whichever the code has), the forward
  ``BlockEntry``/``BlockExit`` applies, and the forward wrapper minus the checkpointed block
  itself. The pieces overlap (acquire/release runs inside the boundary rows and the wrapper),
  and the timing wrappers add their own cost; compare code versions with the same script.
* ``gc``: resident against swapped step time with the collector on, off, and frozen
  (``gc.freeze()``) after warm-up.
* ``dma``: the resident model with the swapped step's host->device copies enqueued by hooks and
  no swapper (``_swap_models.CopyTraffic``), against the same hooks enqueuing nothing and the
  plain resident and swapped steps: how much of the overhead is the copies' own interference
  with the host's kernel launches, which no swapper code can remove.
* ``micro``: the same operations in isolation: one copy enqueue through ``torch.cuda.stream`` and
  through ``CudaStreams.copy``, one acquire + release of a swapped block outside any step, and 300
  kernel launches with the copy engine idle and while host->device, device->host or
  device->device copies stream, or host->device copies paced to a lower rate.

Run it with another tree's ``src`` on ``PYTHONPATH`` to compare code versions.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, format_markdown_row, parse_variants, write_result
from _swap_models import CopyTraffic, tokens_to_image_size
from _timing import log
from vramkit.memory import transfer as _transfer
from vramkit.offload.blocks import find_blocks
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap import calls as calls_module
from vramkit.offload.swap import graph as graph_module

PARTS = ("phases", "calls", "gc", "micro", "dma")
# GPU cycles slept after each 1 MiB chunk of the paced copies in part micro: two rates below
# the full one (the rate reached depends on the GPU's clock and is printed).
PACE_CYCLES = (4_000, 40_000)


class Step:
    """One training step of the DiT: forward, then backward into the trainable input."""

    def __init__(self, preset: str, tokens: int, device: torch.device) -> None:
        from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch

        base = DiTConfig.preset(preset)
        config = DiTConfig.preset(preset, image_size=tokens_to_image_size(
            tokens, base.text_tokens, base.patch_size))
        self.tokens = config.num_tokens
        self.model = DiT(config, seed=0, device=device).requires_grad_(False)
        enable_gradient_checkpointing(self.model)
        self.blocks = config.num_double_blocks + config.num_single_blocks
        self.batch = synthetic_batch(config, 1, generator=torch.Generator().manual_seed(0),
                                     device=device)
        self.batch["latents"].requires_grad_(True)
        self.device = device
        self._loss = flow_matching_loss

    def forward(self) -> torch.Tensor:
        self.batch["latents"].grad = None
        return self._loss(self.model, self.batch)

    def run(self) -> None:
        self.forward().backward()

    @contextmanager
    def swapped(self, count: int) -> Iterator[BlockSwapper]:
        config = SwapConfig(max_gpu_blocks=self.blocks - count)
        with BlockSwapper(self.model, config=config, device=self.device) as swapper:
            yield swapper


    def copy_traffic(self, count: int, copies: bool = True) -> CopyTraffic:
        """The copies of ``count`` swapped blocks on the resident model (part ``dma``); with
        ``copies=False`` the same hooks enqueue nothing."""
        with self.swapped(count) as swapper:
            names = swapper.swapped_names
        defaults = SwapConfig()
        return CopyTraffic(find_blocks(self.model), names, defaults.num_slots, self.device,
                           defaults.min_param_bytes, enqueue=copies)


def timed_steps(step: Step, n: int, warmup: int = 2) -> list[float]:
    """Wall milliseconds of ``n`` steps, each synchronized, after ``warmup`` steps."""
    out = []
    for i in range(warmup + n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step.run()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append((time.perf_counter() - start) * 1e3)
    return out


@contextmanager
def gc_mode(mode: str) -> Iterator[None]:
    gc.collect()
    if mode == "off":
        gc.disable()
    elif mode == "frozen":
        gc.freeze()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def part_phases(step: Step, args: argparse.Namespace) -> list[dict[str, Any]]:
    samples: dict[str, list[tuple[float, float, float]]] = {"resident": [], "swapped": []}

    def measure(into: list[tuple[float, float, float]]) -> None:
        for i in range(args.steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step.forward()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            if i >= 2:
                into.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))

    with gc_mode("off"):
        for r in range(args.rounds):
            for arm in ("resident", "swapped") if r % 2 == 0 else ("swapped", "resident"):
                if arm == "resident":
                    measure(samples[arm])
                else:
                    with step.swapped(args.swapped):
                        measure(samples[arm])
    rows = []
    for arm, values in samples.items():
        fwd, bwd, tail = (statistics.median(v[i] for v in values) for i in range(3))
        rows.append({"model": arm, "forward host ms": fwd, "backward host ms": bwd,
                     "GPU tail ms": tail, "step ms": fwd + bwd + tail})
    base = rows[0]
    for row in rows:
        row["forward +ms"] = row["forward host ms"] - base["forward host ms"]
        row["backward +ms"] = row["backward host ms"] - base["backward host ms"]
    return rows


def _timed(name: str, fn: Callable[..., Any], totals: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    return wrapper


@contextmanager
def instrumented(totals: dict[str, float]) -> Iterator[None]:
    """Time the swapper's pieces (whichever this code version has) into ``totals``."""
    patches: list[tuple[Any, str, Any]] = [
        (calls_module, "torch_checkpoint", "checkpointed block"),
        (BlockSwapper, "_call_block", "forward wrapper"),
        (_transfer.CudaStreams, "copy", "copy enqueue"),
        (calls_module, "enter_block", "BlockEntry apply"),
        (calls_module, "exit_block", "BlockExit apply"),
        (graph_module.BlockBackward, "on_outputs", "output hooks"),
    ]
    saved = []
    for owner, attr, label in patches:
        original = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(
            owner, attr, None)
        if original is None:
            continue
        saved.append((owner, attr, original))
        setattr(owner, attr, _timed(label, original, totals))
    for cls, label in ((graph_module.BlockEntry, "BlockEntry backward"),
                       (graph_module.BlockExit, "BlockExit backward")):
        original = cls.__dict__["_on_backward"]
        saved.append((cls, "_on_backward", original))
        cls._on_backward = staticmethod(_timed(label, original.__func__, totals))
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def part_calls(step: Step, args: argparse.Namespace) -> list[dict[str, Any]]:
    totals: dict[str, float] = {}
    enqueue = 0.0
    with gc_mode("off"), instrumented(totals):
        with step.swapped(args.swapped) as swapper:
            timed_steps(step, 2, warmup=0)
            totals.clear()
            swapper.reset_stats()
            steps = timed_steps(step, args.steps * args.rounds, warmup=0)
            enqueue = swapper.stats().enqueue_seconds
    n = args.steps * args.rounds
    per_step = {k: v / n * 1e3 for k, v in totals.items()}
    wrapper = per_step.pop("forward wrapper", 0.0)
    block = per_step.pop("checkpointed block", 0.0)
    rows = [{"piece": "acquire/release (enqueue_seconds)", "ms per step": enqueue / n * 1e3}]
    rows += [{"piece": k, "ms per step": v} for k, v in sorted(per_step.items())]
    rows.append({"piece": "forward wrapper minus checkpointed block", "ms per step":
                 wrapper - block})
    rows.append({"piece": "instrumented step (median)", "ms per step": statistics.median(steps)})
    return rows


def part_gc(step: Step, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mode in ("on", "off", "frozen"):
        times: dict[str, list[float]] = {"resident": [], "swapped": []}
        with gc_mode(mode):
            for r in range(args.rounds):
                for arm in ("resident", "swapped") if r % 2 == 0 else ("swapped", "resident"):
                    if arm == "resident":
                        times[arm] += timed_steps(step, args.steps)
                    else:
                        with step.swapped(args.swapped):
                            times[arm] += timed_steps(step, args.steps)
        res, swp = (statistics.median(times[a]) for a in ("resident", "swapped"))
        rows.append({"gc": mode, "resident ms": res, "swapped ms": swp, "ratio": swp / res})
    return rows


def _best_us(fn: Callable[[], Any], n: int, rounds: int = 5) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return best


def part_micro(step: Step, args: argparse.Namespace) -> list[dict[str, Any]]:
    device = step.device
    streams = _transfer.transfer_streams(device)
    nbytes = 25 << 20
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    slot = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def through_context() -> None:
        with torch.cuda.stream(streams.h2d):
            slot.copy_(host, non_blocking=True)

    rows = [{"operation": "copy enqueue (25 MB) through torch.cuda.stream",
             "us": _best_us(through_context, 20)},
            {"operation": "copy enqueue (25 MB) through CudaStreams.copy",
             "us": _best_us(lambda: streams.copy(slot, host, streams.h2d), 20)}]
    with step.swapped(step.blocks) as swapper:
        blocks = swapper.blocks
        ring = swapper._ring

        def sweep() -> None:
            for b in blocks:
                ring.release(b, backward=False, stream=ring.acquire(b, backward=False))

        step.run()  # the swapper learns the block order
        rows.append({"operation": "acquire + release of one block, outside a step",
                     "us": _best_us(sweep, 20) / len(blocks)})
    x = torch.zeros(16, device=device)
    other = torch.empty_like(slot)
    copies = {"h2d": (slot, host), "d2h": (host, slot), "d2d": (other, slot)}

    chunk = 1 << 20

    def paced(cycles: int) -> None:
        """Host->device copies in 1 MiB chunks, each followed by a GPU sleep on the copy stream:
        the same bytes at a lower rate."""
        with torch.cuda.stream(streams.h2d):
            for offset in range(0, nbytes, chunk):
                slot[offset:offset + chunk].copy_(host[offset:offset + chunk], non_blocking=True)
                torch.cuda._sleep(cycles)

    def launches(direction: str | int | None) -> float:
        samples = []
        for _ in range(9):
            if isinstance(direction, int):  # paced, with this many cycles of sleep per chunk
                for _ in range(8):  # more than the launches take even at full rate
                    paced(direction)
            elif direction is not None:  # ~0.5 s of copies queued: they outlast the launches
                dst, src = copies[direction]
                with torch.cuda.stream(streams.h2d):
                    for _ in range(40 if direction != "d2d" else 400):
                        dst.copy_(src, non_blocking=True)
            start = time.perf_counter()
            for _ in range(300):
                x.add_(1)
            samples.append((time.perf_counter() - start) * 1e6)
            torch.cuda.synchronize()
        return statistics.median(samples)

    def paced_gbps(cycles: int) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record(streams.h2d)
        for _ in range(4):
            paced(cycles)
        end.record(streams.h2d)
        end.synchronize()
        return 4 * nbytes / begin.elapsed_time(end) / 1e6

    rates = {cycles: paced_gbps(cycles) for cycles in PACE_CYCLES}
    for _ in range(2):  # the set twice: the second shows the spread
        rows.append({"operation": "300 launches, copy engine idle", "us": launches(None)})
        for direction, label in (("h2d", "pinned host->device"), ("d2h", "device->pinned host"),
                                 ("d2d", "device->device")):
            rows.append({"operation": f"300 launches, {label} copies streaming",
                         "us": launches(direction)})
        for cycles, gbps in rates.items():
            rows.append({"operation": f"300 launches, host->device copies paced to "
                                      f"{gbps:.1f} GB/s", "us": launches(cycles)})
    return rows


def part_dma(step: Step, args: argparse.Namespace) -> list[dict[str, Any]]:
    arms = ("resident", "hooks, no copy", "hooks + copies", "swapped")
    times: dict[str, list[float]] = {a: [] for a in arms}
    with gc_mode("off"):
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else tuple(reversed(arms)):
                if arm == "swapped":
                    with step.swapped(args.swapped):
                        times[arm] += timed_steps(step, args.steps)
                elif arm == "resident":
                    times[arm] += timed_steps(step, args.steps)
                else:
                    traffic = step.copy_traffic(args.swapped, copies=arm == "hooks + copies")
                    try:
                        times[arm] += timed_steps(step, args.steps)
                    finally:
                        traffic.detach()
    base = statistics.median(times["resident"])
    return [{"arm": a, "step ms": statistics.median(times[a]),
             "ratio": statistics.median(times[a]) / base} for a in arms]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}")
    parser.add_argument("--dit", default="large", help="DiT preset (default large)")
    parser.add_argument("--tokens", type=int, default=2048, help="image+text tokens (default "
                        "2048; the DiT rounds to its patch grid)")
    parser.add_argument("--swapped", type=int, help="swapped blocks (default: all)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    add_common_args(parser)
    args = parser.parse_args()
    parts = parse_variants(parser, args.parts, PARTS)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    if not torch.cuda.is_available():
        parser.error("this benchmark measures CUDA streams and needs a GPU")
    step = Step(args.dit, args.tokens, torch.device("cuda"))
    if args.swapped is None:
        args.swapped = step.blocks
    if not 1 <= args.swapped <= step.blocks:
        parser.error(f"--swapped must be in 1..{step.blocks}")
    log(f"dit-{args.dit}, {step.tokens} tokens, {args.swapped}/{step.blocks} swapped")
    run = {"phases": part_phases, "calls": part_calls, "gc": part_gc, "micro": part_micro,
           "dma": part_dma}
    results: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        log(f"part {part}")
        results[part] = run[part](step, args)
    for part, rows in results.items():  # one table per part (write_result prints the last)
        print(f"\n{part}:")
        for i, row in enumerate(rows):
            print(format_markdown_row(row, header=i == 0))
    last = parts[-1]
    write_result("swap_step_host", {"settings": vars(args) | {"out": str(args.out)},
                                    "tokens": step.tokens, "results": results},
                 results[last], args.out)


if __name__ == "__main__":
    main()
