"""Step timing shared by the training-step benchmarks (swap.py, quant_block.py)."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Timer"]


class Timer:
    """CUDA events on a GPU (GPU time, no host sync while recording); wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
