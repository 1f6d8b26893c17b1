"""Timing and logging shared by the benchmark scripts."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

__all__ = ["START", "Timer", "log", "synchronize"]

START = time.perf_counter()  # when the benchmark process imported this module


def log(message: str) -> None:
    """A progress line on stderr with the seconds since the run started."""
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
