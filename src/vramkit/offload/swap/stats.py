"""Assembling a swapper's :class:`~vramkit.offload.swap.config.SwapStats` from its parts.

Each part counts what it does (the ring its loads and copies, the host store its pinned bytes
and disk reads, the stepper its steps and state); :func:`swap_stats` adds them up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vramkit.memory.layout import analyze_access_pattern
from vramkit.offload.swap.config import SwapStats
from vramkit.offload.swap.records import SwappedBlock
from vramkit.offload.swap.ring import COUNTERS, SlotRing
from vramkit.offload.swap.stepper import SwapStepper

__all__ = ["swap_stats"]


def swap_stats(*, blocks: int, swapped: Sequence[SwappedBlock], ring: SlotRing | None,
               stepper: SwapStepper | None, host: dict[str, Any], resident_block_bytes: int,
               load: dict[str, Any]) -> SwapStats:
    """The stats of a swapper with ``blocks`` blocks found, ``swapped`` of them swapped.

    Args:
        host: the host store's figures (``HostStore.stats()``: ``pinned`` and SwapStats
            fields).
        load: ``checkpoint_bytes``, ``load_seconds`` and ``loading``.
    """
    c = ring.counters if ring is not None else dict.fromkeys(COUNTERS, 0)
    host = dict(host)
    state_bytes = stepper.state_bytes() if stepper is not None else 0
    order = ring.order if ring is not None else []
    return SwapStats(
        blocks=blocks, swapped_blocks=len(swapped),
        swapped_bytes=sum(e.nbytes for b in swapped for e in b.entries),
        pinned_bytes=host.pop("pinned") + state_bytes,
        slot_bytes=ring.slot_bytes * len(ring.slots) if ring is not None else 0,
        resident_block_bytes=resident_block_bytes,
        loads=c["loads"], prefetched=c["prefetched"], on_demand=c["on_demand"],
        hits=c["hits"], h2d_bytes=c["h2d_bytes"], d2h_bytes=c["d2h_bytes"],
        acquisitions=c["acquisitions"], gathered_bytes=c["gathered_bytes"],
        state_prefetched=c["state_prefetched"],
        enqueue_seconds=ring.enqueue_seconds if ring is not None else 0.0,
        order_pattern=analyze_access_pattern([list(swapped).index(b) for b in order]),
        optimizer_steps=stepper.steps if stepper is not None else 0,
        state_bytes=state_bytes,
        state_slot_bytes=stepper.state_slot_bytes() if stepper is not None else 0,
        **host, **load)
