"""Where a step's peak of GPU memory goes: what is alive at the peak, grouped by who made it.

:func:`recording` records the CUDA caching allocator's history (Python stacks) while a step
runs; :func:`peak_report` replays the recorded allocations and frees, finds the moment the
most bytes were allocated, and groups what was alive then by the innermost frame in vramkit,
diffusers, transformers or peft (else the innermost frame). Allocations made before the
recording began are reported as one sum (``before_bytes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["peak_report", "recording"]

_OWNERS = ("vramkit/", "diffusers/", "transformers/", "peft/")


@contextlib.contextmanager
def recording(device: torch.device, max_entries: int = 1_000_000) -> Iterator[dict[str, Any]]:
    """Record the allocator's history in the block; the yielded dict gets ``"snapshot"`` (the
    allocator snapshot at the end) and ``"before_bytes"`` (allocated when it began)."""
    out: dict[str, Any] = {"before_bytes": torch.cuda.memory_allocated(device)}
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries, device=device)
    try:
        yield out
        out["snapshot"] = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def _owner(frames: list[dict[str, Any]]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(owner in name for owner in _OWNERS) or "benchmarks/" in name:
            tail = name.split("site-packages/")[-1].split("src/")[-1]
            return f"{tail}:{frame.get('line')} {frame.get('name')}"
    if frames:
        frame = frames[0]
        name = frame.get("filename", "?").split("/")[-1]
        return f"{name}:{frame.get('line')} {frame.get('name')}"
    return "(no stack)"


def peak_report(recorded: dict[str, Any], device: torch.device, top: int = 25
                ) -> dict[str, Any]:
    """The recorded peak: ``peak_bytes`` (before + the most allocated during recording),
    ``groups`` (the ``top`` largest owners of what was alive then: bytes and count) and
    ``trace_entries``."""
    snapshot = recorded["snapshot"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    trace = snapshot["device_traces"][index]
    live: dict[int, int] = {}
    total = best = best_at = 0
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > best:
                best, best_at = total, i
        elif action == "free_completed":
            total -= live.pop(event["addr"], 0)
    alive: dict[int, dict[str, Any]] = {}
    for event in trace[:best_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in alive.values():
        group = groups.setdefault(_owner(event.get("frames", [])), [0, 0])
        group[0] += event["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"before_bytes": recorded["before_bytes"], "recorded_peak_bytes": best,
            "peak_bytes": recorded["before_bytes"] + best, "trace_entries": len(trace),
            "groups": [{"owner": k, "bytes": v[0], "count": v[1]} for k, v in ranked[:top]],
            "other_bytes": sum(v[0] for _, v in ranked[top:])}
