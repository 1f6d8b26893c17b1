"""How steady the calibration's host times are, and which summary of its samples a plan should use.

A plan of a host-bound model (``vramkit demo``'s DiT: its blocks enqueue for about as long as the
GPU runs them) stands on the host times :func:`vramkit.planning.calibrate_blocks` measures. This
benchmark calibrates one model ``--repeats`` times in one process and keeps every host sample of
every timed call (each kind of block; as built, checkpointed; forward, backward). Each summary
-- ``median`` and ``lower-quartile`` of the same samples -- gives each calibration's host
seconds of one step (a forward and a backward over all blocks, each kind counted as often as the
model has it, checkpointed as ``--checkpointed`` says); the table prints, per summary, the
spread of those sums across the calibrations (max / min) and the per-kind spread (on the CPU,
where the calibration's clock is the wall clock and keeps no host samples, the sums are 0). With
``--step`` (demo DiT only) the real model is built on the GPU and its resident step's phases are
timed with CUDA events beside the sums: where a phase is host-bound its device time is the
host's pace.

Run (GPU): PYTHONPATH=src python3 benchmarks/calibration_host.py --step --out out/calib_host
Run (CPU, code paths only): PYTHONPATH=src python3 benchmarks/calibration_host.py --device cpu \\
    --tiny --repeats 2 --step
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import log
from vramkit.planning import calibration

SUMMARIES = ("median", "lower-quartile")


def _summary(samples: list[float], how: str) -> float:
    """The calibration's summary (``median``, what a plan takes) or the lower quartile (the
    rounds a burst of host noise leaves alone) of one call's host samples."""
    if len(samples) < 2:
        return float(samples[0]) if samples else 0.0
    if how == "median":
        return statistics.median(samples)
    return statistics.quantiles(samples, n=4, method="inclusive")[0]


class _Recorder:
    """Every ``_Clock`` the calibration makes, in order, with the variant being timed."""

    def __init__(self) -> None:
        self.clocks: list[tuple[str, Any]] = []
        self.variant = "full"

    def __enter__(self) -> _Recorder:
        recorder = self
        base = calibration._Clock

        class Recorded(base):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                recorder.clocks.append((recorder.variant, self))

        real_checkpointed = calibration._time_checkpointed

        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            recorder.variant = "checkpointed"
            try:
                return real_checkpointed(*args, **kwargs)
            finally:
                recorder.variant = "full"

        self._saved = (base, real_checkpointed)
        calibration._Clock = Recorded  # type: ignore[misc]
        calibration._time_checkpointed = checkpointed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        calibration._Clock, calibration._time_checkpointed = self._saved  # type: ignore[misc]


def _target(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The meta model, inputs, step and block names to calibrate."""
    if args.model == "demo-xl":
        from vramkit.recipes.demo.plan import block_names
        from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
        from vramkit.recipes.lora import add_lora_adapters

        config = DiTConfig.preset("small" if args.tiny else "xl")
        meta = DiT(config, device="meta")
        names = block_names(meta)
        add_lora_adapters(meta, names, 16)
        return {"model": meta, "inputs": synthetic_batch(config, 1, device="meta"),
                "step": flow_matching_loss, "blocks": names, "autocast": None,
                "config": config}
    from vramkit.recipes.targets import build_target

    options: dict[str, Any] = {"resolution": 256, "seq_len": 128} if args.tiny else {}
    target = build_target(args.model, **{k: v for k, v in options.items()
                                         if k in _accepted(args.model)})
    return {"model": target.model, "inputs": target.inputs, "step": target.step,
            "blocks": "auto", "autocast": torch.bfloat16, "config": None}


def _accepted(model: str) -> set[str]:
    return {"seq_len"} if "llama" in model else {"resolution"}


def _calibrate(target: dict[str, Any], device: torch.device, repeats: int
               ) -> tuple[Any, dict[tuple[str, str], dict[str, list[float]]]]:
    """One calibration: its BlockTimes and, per (first block of a kind, variant), the host
    samples of the forward and the backward."""
    with _Recorder() as recorder:
        times = calibration.calibrate_blocks(
            target["model"], target["inputs"], step=target["step"], blocks=target["blocks"],
            autocast=target["autocast"], device=device, repeats=repeats)
    # _time_block makes a forward clock and a backward clock per call, kinds in order; the
    # beside-copies variant's pair follows the full one on a GPU
    firsts = list(dict.fromkeys(
        min((n for n, c in times.calls["full"].items() if c is call), default="")
        for call in times.calls["full"].values()))
    per_kind = 2 if device.type != "cuda" else 3  # full, (beside copies), checkpointed
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    pairs = [recorder.clocks[i:i + 2] for i in range(0, len(recorder.clocks), 2)]
    for k, first in enumerate(firsts):
        for fwd_bwd in pairs[k * per_kind:(k + 1) * per_kind]:
            variant = fwd_bwd[0][0]
            if variant == "full" and (first, "full") in samples:
                continue  # the beside-copies pair: not a host figure a plan uses
            samples[(first, variant)] = {
                side: clock.host_samples[1:] + clock.busy_samples
                if device.type == "cuda" else list(clock.host_samples)
                for side, (_, clock) in zip(("forward", "backward"), fwd_bwd, strict=True)}
    return times, samples


def _step_phases(target: dict[str, Any], device: torch.device, checkpointed: set[str],
                 rounds: int) -> dict[str, float]:
    """The demo DiT resident on ``device``, its named blocks checkpointed: the median device
    seconds of forward, backward and the optimizer step."""
    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.recipes.dit import DiT, flow_matching_loss, synthetic_batch
    from vramkit.recipes.lora import add_lora_adapters

    config = target["config"]
    model = DiT(config, seed=0, device=device)
    adapters = add_lora_adapters(model, target["blocks"], 16)
    if checkpointed:
        enable_gradient_checkpointing(model, blocks=sorted(checkpointed))
    optimizer = torch.optim.AdamW(adapters, lr=1e-4)
    batch = synthetic_batch(config, 1, device=device)
    cuda = device.type == "cuda"
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for round_ in range(rounds + 2):
        marks = []
        for phase in (None, "forward", "backward", "optimizer"):
            if phase == "forward":
                loss = flow_matching_loss(model, batch)
            elif phase == "backward":
                loss.backward()
            elif phase == "optimizer":
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            marks.append(_mark(cuda))
        if cuda:
            torch.cuda.synchronize(device)
        if round_ >= 2:
            for phase, start, end in zip(phases, marks, marks[1:], strict=False):
                phases[phase].append(_elapsed(start, end, cuda))
    return {phase: statistics.median(values) for phase, values in phases.items()}


def _mark(cuda: bool) -> Any:
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    import time

    return time.perf_counter()


def _elapsed(start: Any, end: Any, cuda: bool) -> float:
    return start.elapsed_time(end) / 1e3 if cuda else end - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="demo-xl",
                        help="demo-xl (vramkit demo's DiT) or a preset name (flux-dev, ...)")
    parser.add_argument("--repeats", type=int, default=6, help="calibrations (default 6)")
    parser.add_argument("--timed", type=int, default=5, help="timed rounds per calibration")
    parser.add_argument("--checkpointed", default="all", choices=("all", "none"),
                        help="which blocks the step sums count as checkpointed (default all)")
    parser.add_argument("--step", action="store_true",
                        help="also time the demo DiT's real resident step (demo-xl only)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + H100: illegal access
        device = torch.device("cuda", torch.cuda.current_device())
    target = _target(args, device)
    sums: dict[str, list[dict[str, float]]] = {how: [] for how in SUMMARIES}
    kinds: dict[str, dict[str, list[float]]] = {how: {} for how in SUMMARIES}
    counts: dict[str, int] = {}
    for repeat in range(args.repeats):
        times, samples = _calibrate(target, device, args.timed)
        if not counts:
            for call in times.calls["full"].values():
                first = min(n for n, c in times.calls["full"].items() if c is call)
                counts[first] = counts.get(first, 0) + 1
        ckpt = args.checkpointed == "all"
        for how in SUMMARIES:
            total = {"forward": 0.0, "backward": 0.0}
            for (first, variant), sides in samples.items():
                if (variant == "checkpointed") != ckpt:
                    continue
                for side, values in sides.items():
                    value = _summary(values, how)
                    total[side] += counts.get(first, 0) * value
                    kinds[how].setdefault(f"{first} {variant} {side}", []).append(value)
            sums[how].append(total)
        log(f"calibration {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{how} fwd {sums[how][-1]['forward'] * 1e3:.1f} / bwd "
            f"{sums[how][-1]['backward'] * 1e3:.1f} ms" for how in SUMMARIES))
    rows = []
    for how in SUMMARIES:
        row: dict[str, Any] = {"summary": how}
        for side in ("forward", "backward"):
            values = [s[side] * 1e3 for s in sums[how]]
            row[f"{side} host ms"] = f"{min(values):.1f}..{max(values):.1f}"
            row[f"{side} spread"] = round(max(values) / max(min(values), 1e-12), 3)
        spreads = [max(v) / max(min(v), 1e-12) for v in kinds[how].values()]
        row["per-kind spread mean / max"] = (f"{statistics.fmean(spreads):.3f} / "
                                             f"{max(spreads):.3f}")
        rows.append(row)
    result: dict[str, Any] = {
        "model": args.model, "checkpointed": args.checkpointed, "repeats": args.repeats,
        "sums_ms": {how: [{k: round(v * 1e3, 2) for k, v in s.items()} for s in sums[how]]
                    for how in SUMMARIES},
        "kinds_ms": {how: {k: [round(x * 1e3, 3) for x in v] for k, v in kinds[how].items()}
                     for how in SUMMARIES}}
    if args.step and args.model == "demo-xl":
        names = set(target["blocks"]) if args.checkpointed == "all" else set()
        result["step_ms"] = {k: round(v * 1e3, 2) for k, v in
                             _step_phases(target, device, names, 6).items()}
        log(f"resident step, device ms: {result['step_ms']}")
    write_result("calibration_host", result, rows, args.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
