"""The planner's phase simulation: one forward or backward, block by block, over the host
(enqueueing ahead of the device), the compute stream and the copy engine with its ring of slots.

:func:`simulate_phase` is the model of time the planner's prices rest on
(:mod:`vramkit.planning.pricing`); :func:`_simulate_calls` is its form for back-to-back
inference calls.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["simulate_phase"]


def simulate_phase(compute: Sequence[float], copies: Sequence[float],
                   swapped: Sequence[bool], slots: int,
                   restores: Sequence[float] | None = None,
                   host: Sequence[float] | None = None,
                   slowdown: float | Sequence[float] = 0.0,
                   decodes: Sequence[float] | None = None) -> float:
    """The time of one phase over blocks in their order of execution.

    The compute stream runs the blocks one after another. A swapped block waits for its copy;
    the copy starts when the copy engine is free and a slot is: the slot of the swapped block
    ``slots`` places earlier frees when that block's compute ends (the swapper prefetches at
    release). The first ``slots`` swapped blocks are in their slots when the phase starts (kept
    across the forward/backward turn and between steps). ``restores`` are copies a block needs
    before it runs whatever its slot (offloaded activations coming back), on the same engine:
    the offloader's prefetch window issues them ahead of use, so a block's restore is queued
    when the block before it starts, ahead of the weight copy that block's end queues (the
    first block's at the start of the phase).
    ``host``: each block's enqueue time on the host, which runs ahead of the device (nothing in
    a step waits for the device on the host): a block's kernels start no earlier than the host
    began enqueueing it and end no earlier than it finished. ``slowdown``: the share by which a
    block's compute is slower while the copy engine runs beside it (one figure, or one per
    block; :meth:`~vramkit.planning.calibration.BlockTimes.copy_slowdown`).
    ``decodes``: per block, the device seconds of decoding its compressed master once its
    copy has landed (``SwapConfig.compress``; ``copies`` are then the compressed bytes'). A
    decode takes the SMs the step's kernels use: one that lands while a block computes makes
    that block's compute longer by the decode; a block waiting for its own copy starts once
    its decode has run after the copy.
    """
    return _simulate(compute, copies, swapped, slots, restores, host, slowdown, decodes)[0]


def _simulate(compute: Sequence[float], copies: Sequence[float], swapped: Sequence[bool],
              slots: int, restores: Sequence[float] | None, host: Sequence[float] | None,
              slowdown: float | Sequence[float],
              decodes: Sequence[float] | None = None) -> tuple[float, float]:
    """:func:`simulate_phase`'s time, and the seconds its compute lost to copies beside it."""
    n = len(compute)
    slow = ([float(slowdown)] * n if isinstance(slowdown, (int, float))
            else list(slowdown))
    order = [i for i, s in enumerate(swapped) if s]
    arrives = {i: 0.0 for i in order[:slots]}  # when each swapped block's copy has landed
    t = 0.0
    engine = 0.0  # when the copy engine has done everything enqueued on it so far
    enqueued = 0.0
    done = 0  # swapped blocks whose compute has ended
    lost = 0.0
    restored = [0.0] * n  # when each block's offloaded activations are back
    pending: list[int] = []  # blocks whose copy is queued and whose decode has not run yet
    if restores is not None and n and restores[0]:
        engine = restored[0] = restores[0]
    for i, (c, s) in enumerate(zip(compute, swapped, strict=True)):
        ready = max(t, restored[i])
        if host is not None:
            ready = max(ready, enqueued)
            enqueued += host[i]
        if s:
            ready = max(ready, arrives[i])
            if i in pending:  # landed while nothing ran: decoded before it starts
                pending.remove(i)
                ready += decodes[i] if decodes is not None else 0.0
        if restores is not None and i + 1 < n and restores[i + 1]:
            # the next block's activations, queued as this block starts
            engine = max(engine, ready) + restores[i + 1]
            restored[i + 1] = engine
        # the copies enqueued so far run beside this block until the engine is done
        beside = min(max(0.0, engine - ready), c)
        lost += slow[i] * beside
        t = ready + c + slow[i] * beside
        while decodes is not None and pending and arrives[pending[0]] < t:
            t += decodes[pending.pop(0)]  # landed during this compute: decoded beside it
        t = max(t, enqueued)
        if s:
            nxt = done + slots
            done += 1
            if nxt < len(order):  # its slot takes the swapped block ``slots`` places later
                engine = max(engine, t) + copies[order[nxt]]
                arrives[order[nxt]] = engine
                if decodes is not None:
                    pending.append(order[nxt])
    return t, lost


def _simulate_calls(compute: Sequence[float], copies: Sequence[float],
                    swapped: Sequence[bool], slots: int, host: Sequence[float] | None,
                    slowdown: float | Sequence[float],
                    decodes: Sequence[float] | None = None) -> tuple[float, float]:
    """:func:`_simulate` of one inference call in a run of back-to-back calls: the time and
    the compute lost to copies of the second of two calls simulated in a row.

    Inference has no backward turn to keep blocks across: while a call's last swapped blocks
    run, the swapper already loads the next call's first ones into the slots they free
    (``SlotRing``'s inference order wraps around), so every swapped block is copied once a
    call, its first copies beside the previous call's tail. One call simulated alone starts
    with those first blocks in place for free: FLUX.1-dev at 11.5 GiB on an H200 (43 of 57
    swapped, 3 slots, transfer-bound) was predicted 247 ms and ran 284 ms
    (``benchmarks/plan.py``). When every swapped block has a slot nothing
    is copied after the first call: the call alone."""
    once = _simulate(compute, copies, swapped, slots, None, host, slowdown, decodes)
    if sum(1 for s in swapped if s) <= slots:
        return once
    slow = slowdown if isinstance(slowdown, (int, float)) else [*slowdown, *slowdown]
    twice = _simulate([*compute, *compute], [*copies, *copies], [*swapped, *swapped], slots,
                      None, None if host is None else [*host, *host], slow,
                      None if decodes is None else [*decodes, *decodes])
    return twice[0] - once[0], twice[1] - once[1]
