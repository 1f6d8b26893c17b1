"""One block timed as the planner's calibration times it, the device and host times kept apart.

``calibration._time_block`` returns one number per phase: the larger of the device time (CUDA
events around a region enqueued while a spin kernel holds the stream) and the host's enqueue
time (a warm-up round). :func:`time_block_apart` runs the same rounds and returns both sides:
the device time's median over the timed rounds and every warm-up round's host time, so a
benchmark can take the calibration's sample (the median of all but the first) or another.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from vramkit.planning import calibration

__all__ = ["time_block_apart"]


def time_block_apart(block: torch.nn.Module, args: Any, kwargs: Any, device: torch.device,
                     train: bool, autocast: torch.dtype | None, repeats: int,
                     warmup_rounds: int = calibration._WARMUP_ROUNDS) -> dict[str, Any]:
    """``type``, and per phase (``fwd``, ``bwd``): ``<phase>_device_s`` (median of the timed
    rounds) and ``<phase>_host_samples`` (the warm-up rounds' enqueue seconds, in order)."""
    cuda = device.type == "cuda"
    context = (torch.autocast(device.type, dtype=autocast) if autocast is not None and train
               else None)
    clocks = {"fwd": calibration._Clock(device), "bwd": calibration._Clock(device)}
    device_s: dict[str, list[float]] = {"fwd": [], "bwd": []}
    host_s: dict[str, list[float]] = {"fwd": [], "bwd": []}

    def region(phase: str, timing: bool, fn: Any) -> Any:
        clock = clocks[phase]
        clock.timing = timing
        started = clock.start()
        out = fn()
        host = time.perf_counter() - (started[1] if cuda else started)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            dev = started[0].elapsed_time(end) / 1e3
        else:
            dev = host
        if timing:
            device_s[phase].append(dev)
        else:
            clock.host_samples.append(host)  # the spin kernel's lead in the timed rounds
            host_s[phase].append(host)
        return out

    for round_ in range(repeats + warmup_rounds):
        timing = round_ >= warmup_rounds
        with torch.set_grad_enabled(train):
            def forward() -> Any:
                if context is not None:
                    with context:
                        return block(*args, **kwargs)
                return block(*args, **kwargs)
            out = region("fwd", timing, forward)
        if train:
            outputs = calibration._float_outputs(out)
            if outputs:
                grads = [torch.ones_like(t) for t in outputs]
                region("bwd", timing, lambda o=outputs, g=grads: torch.autograd.backward(o, g))
            for p in block.parameters():
                p.grad = None
        del out
    record: dict[str, Any] = {"type": type(block).__name__}
    for phase in ("fwd", "bwd"):
        record[f"{phase}_device_s"] = (statistics.median(device_s[phase]) if device_s[phase]
                                       else 0.0)
        record[f"{phase}_host_samples"] = host_s[phase]
    return record
