"""The planner: which blocks to swap, how many slots, which blocks to checkpoint, which storage
formats, whether to offload activations, for the best predicted step time under a budget.

The model (:class:`~vramkit.planning.analysis.ModelCost`) gives per block FLOPs, activation bytes
and weight bytes per format; the machine (:class:`~vramkit.planning.machine.Machine`) gives copy
bandwidth and throughput. A candidate is predicted phase by phase (DESIGN.md §4):

* memory: frozen weights kept on the device + ``R`` slots of the largest swapped block +
  with packed formats, the largest packed block's weights dequantized (one buffer that every
  packed block's call fills, :mod:`vramkit.quant.dense`) +
  trainable parameters, their gradients and AdamW state + activations for the checkpointed set
  (:meth:`~vramkit.planning.activations.ActivationEstimate.bytes_with`) <= budget - headroom;
* time: forward and backward (with recomputation) are each simulated block by block
  (:func:`simulate_phase`): the host enqueues the blocks ahead of the device (a block's kernels
  start once the host began enqueueing it and end no earlier than it finished), the compute
  stream runs the blocks in order, a swapped block waits for its copy, and a copy waits for the
  copy engine and for a free slot (the slot of the swapped block ``R`` places earlier frees when
  that block's compute ends); the first ``R`` swapped blocks of a phase are already loaded
  (kept across the forward/backward turn). So a phase costs at least ``max(compute, host,
  copies)``, and more where slots are too few or swapped blocks too close together for the
  copies to hide. Plus the optimizer; the swapper's bookkeeping counts on the host. A block's
  own device and host times are measured (``times``, a calibrated machine: as built, under
  checkpointing, in each packed format) or, offline, the time model of its counted work
  (:meth:`~vramkit.planning.machine.Machine.work_sides`).

The search: for each pair of formats (swapped blocks, resident blocks) among the allowed ones,
each ``R`` and each number of swapped blocks (three candidate sets, :func:`_swap_sets`: spread
evenly by bytes, as the swapper's own schedule does; the cheapest copies first, kinds of block
in order of bytes per ms of compute; copies paced by the compute before them), the fewest
checkpointed blocks that fit (blocks in order of activation saved per recomputed FLOP; a binary
search, since checkpointing more never needs more memory; ``checkpointing="all"`` or
``"none"`` fixes the set), and activation offload with everything checkpointed wherever it
fits. The fastest candidate wins; ties go to less swapping, less recomputation and fewer
slots.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vramkit.errors import PlanError
from vramkit.offload._activation_settings import ActivationOffloadConfig
from vramkit.offload.blocks import spread_evenly
from vramkit.planning.analysis import BlockCost, ModelCost
from vramkit.planning.calibration import CHECKPOINTED, FULL, BlockTimes, CallTimes, packed_variant
from vramkit.planning.machine import SWAP_HOST_SECONDS, Machine
from vramkit.units import format_size

__all__ = ["CHECKPOINTING", "PhaseTime", "Plan", "search"]

#: What a plan may be asked to checkpoint: ``"auto"`` (the fewest blocks that fit, chosen per
#: candidate), ``"all"`` (every block: what trainers run at these sizes, the planner choosing
#: everything else) or ``"none"``.
CHECKPOINTING = ("auto", "all", "none")

#: Optimizer state bytes per trainable parameter (AdamW: two fp32 moments).
ADAMW_STATE_BYTES = 8
_OFFLOAD_DEFAULTS = ActivationOffloadConfig()  # what fit's offloader runs with
#: Activations an offloader holds on the device beyond the blocks' own: the forward's last
#: tensors still held while their copies run (``max_inflight_bytes``) and what backward has
#: already brought back ahead of use (``prefetch_bytes``).
OFFLOAD_INFLIGHT_BYTES = int(_OFFLOAD_DEFAULTS.max_inflight_bytes)
OFFLOAD_PREFETCH_BYTES = int(_OFFLOAD_DEFAULTS.prefetch_bytes)
OFFLOAD_WINDOW_BYTES = OFFLOAD_INFLIGHT_BYTES + OFFLOAD_PREFETCH_BYTES


@dataclass(frozen=True)
class PhaseTime:
    """One phase's prediction.

    Attributes:
        seconds: the phase's time, from a simulation of the host, the compute stream and the
            copy engine (a block's kernels wait for the host to enqueue them and for its copy, a
            copy for a free slot and for the engine).
        compute_seconds: the kernels alone (recomputation included in backward).
        copy_seconds: the copy engine's busy time (swapped blocks, restored activations).
        copy_bytes: the bytes those copies move.
        host_seconds: the host's time to enqueue the phase (Python, the dispatcher, the
            swapper's bookkeeping); it runs ahead of the device unless the blocks are small.
        slowed_seconds: what the compute loses to the copies running beside it (the memory
            system is shared: :meth:`~vramkit.planning.calibration.BlockTimes.copy_slowdown`),
            part of ``seconds``.
    """

    seconds: float
    compute_seconds: float
    copy_seconds: float
    copy_bytes: int
    host_seconds: float = 0.0
    slowed_seconds: float = 0.0

    @property
    def host_bound(self) -> bool:
        """Whether the host's enqueueing paces the phase (it takes 99 % of it or more, and the
        kernels less)."""
        return (self.host_seconds >= 0.99 * self.seconds
                and self.host_seconds > 1.01 * self.compute_seconds)

    @property
    def transfer_bound(self) -> bool:
        """Whether compute waits for copies for more than 1 % of the phase (and not for the
        host); compute slowed beside the copies is still compute."""
        return (not self.host_bound
                and self.seconds > 1.01 * (self.compute_seconds + self.slowed_seconds))


@dataclass(frozen=True)
class Plan:
    """What to turn on, and what it is predicted to cost (:func:`vramkit.plan`).

    Attributes:
        mode: ``"train"`` or ``"infer"``.
        machine: the machine's name (a hardware profile, or ``"measured: ..."``).
        budget_bytes / headroom_bytes: the budget and the part of it kept free.
        swapped / resident: block names in execution order.
        checkpointed: blocks recomputed in backward.
        num_slots: R, the swapper's GPU slots.
        swapped_format / resident_format: storage of the swapped / resident blocks' frozen
            weights (``"bf16"`` = as built).
        activation_offload: whether saved activations go to pinned host memory.
        predicted_peak_bytes: the predicted peak of allocated memory.
        peak_breakdown: its parts, in bytes.
        forward / backward: per-phase predictions (``backward`` is zero for inference).
        optimizer_seconds: the optimizer step.
        overhead_seconds: time outside both phases and the optimizer (0 from the search, whose
            phases include the swapper's host time; a caller may add its own, e.g. a
            data-parallel step's).
        host_bytes: pinned host memory for the swapped blocks' masters and offloaded
            activations.
        notes: remarks on the prediction (an offline machine's figures, ...).
        block_order: every block, swapped or resident, in execution order.
        disk_blocks: swapped blocks kept on disk because their masters would not fit
            ``host_budget`` (the swapper's disk tier, ``SwapConfig(host_budget=...)``), read
            ahead of use at ``disk_bytes_per_s`` through pinned staging buffers.
        swap_host_budget: the ``SwapConfig.host_budget`` that keeps exactly ``disk_blocks`` on
            disk (the host budget less the offloaded activations' pinned bytes); ``None``
            without a disk tier.
        disk_bytes_per_s: the disk read bandwidth the prediction assumed (``None`` without a
            disk tier).
        dequantize_together: whether each packed block's first call dequantizes all of its
            layers into one shared buffer (:mod:`vramkit.quant.dense`; counted in
            ``peak_breakdown["dequantized_weights"]``) instead of each layer at its own call.
        checkpointing: what the plan was asked to checkpoint: ``"auto"`` (the planner's
            choice), ``"all"`` or ``"none"`` (:data:`CHECKPOINTING`).
        split: the blocks were split into their children (attention, feed-forward, norms;
            :func:`vramkit.offload.blocks.split_blocks`): ``swapped``, ``resident`` and
            ``block_order`` name those units, and the ring's slots are as large as the largest
            unit (inference at budgets where whole blocks leave no room).
    """

    mode: str
    machine: str
    budget_bytes: int
    headroom_bytes: int
    swapped: tuple[str, ...]
    resident: tuple[str, ...]
    checkpointed: tuple[str, ...]
    num_slots: int
    swapped_format: str
    resident_format: str
    activation_offload: bool
    predicted_peak_bytes: int
    peak_breakdown: dict[str, int]
    forward: PhaseTime
    backward: PhaseTime
    optimizer_seconds: float
    overhead_seconds: float
    host_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    block_order: tuple[str, ...] = field(default_factory=tuple)
    disk_blocks: tuple[str, ...] = field(default_factory=tuple)
    swap_host_budget: int | None = None
    disk_bytes_per_s: float | None = None
    dequantize_together: bool = False
    checkpointing: str = "auto"
    split: bool = False

    @property
    def predicted_step_seconds(self) -> float:
        """Forward + backward + optimizer + overhead."""
        return (self.forward.seconds + self.backward.seconds + self.optimizer_seconds
                + self.overhead_seconds)

    @property
    def host_bound_phases(self) -> tuple[str, ...]:
        """The phases predicted host-bound (``"forward"``, ``"backward"``): the host's pace
        decides their time."""
        return tuple(name for name in ("forward", "backward") if getattr(self, name).host_bound)

    @property
    def formats(self) -> dict[str, str]:
        """Block name -> storage format of its frozen weights."""
        out = dict.fromkeys(self.resident, self.resident_format)
        out.update(dict.fromkeys(self.swapped, self.swapped_format))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data, with the derived figures."""
        data = asdict(self)
        data["predicted_step_seconds"] = self.predicted_step_seconds
        for phase in ("forward", "backward"):
            data[phase]["transfer_bound"] = getattr(self, phase).transfer_bound
            data[phase]["host_bound"] = getattr(self, phase).host_bound
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def explain(self) -> str:
        """The plan and its reasons, in plain words."""
        lines = []
        n = len(self.swapped) + len(self.resident)
        budget = (f"{format_size(self.budget_bytes)} budget "
                  f"({format_size(self.headroom_bytes)} kept free)")
        parts = ", ".join(f"{k.replace('_', ' ')} {format_size(v)}"
                          for k, v in self.peak_breakdown.items() if v)
        lines.append(f"Predicted peak {format_size(self.predicted_peak_bytes)} of a {budget}: "
                     f"{parts}.")
        if self.swapped:
            what = "units (blocks split into their children)" if self.split else "blocks"
            lines.append(f"Swap {len(self.swapped)} of {n} {what} through {self.num_slots} "
                         f"slot{'s' if self.num_slots > 1 else ''}; "
                         f"{format_size(self.host_bytes)} of pinned host memory.")
            stacks = _by_stack(self.block_order or (*self.swapped, *self.resident),
                               set(self.swapped))
            if len(stacks) > 1:
                lines.append("Swapped per stack: " + ", ".join(
                    f"{stack} {k} of {total}" for stack, (k, total) in stacks.items()) + ".")
        else:
            lines.append(f"Every one of the {n} blocks stays on the GPU: no swapping.")
        if self.disk_blocks:
            rate = (f"{self.disk_bytes_per_s / 1e9:.2f} GB/s" if self.disk_bytes_per_s
                    else "the disk's speed")
            lines.append(f"Keep {len(self.disk_blocks)} of the swapped blocks on disk (the host "
                         "budget holds the others' masters and the staging buffers), read "
                         f"ahead of use at {rate}: SwapConfig(host_budget="
                         f"{format_size(self.swap_host_budget or 0)}).")
        if self.mode == "train":
            if self.checkpointing == "all":
                lines.append(f"Checkpoint all {n} blocks (recomputed in backward), as asked "
                             "(checkpointing='all').")
            elif self.checkpointing == "none":
                lines.append("No checkpointing, as asked (checkpointing='none').")
            elif self.checkpointed:
                lines.append(f"Checkpoint {len(self.checkpointed)} of {n} blocks (recomputed "
                             "in backward) so their activations fit.")
            else:
                lines.append("No checkpointing: the activations fit.")
        formats = {self.swapped_format if self.swapped else None,
                   self.resident_format if self.resident else None} - {None}
        if formats != {"bf16"}:
            lines.append(f"Store frozen weights as {self.swapped_format} (swapped) / "
                         f"{self.resident_format} (resident).")
            if self.dequantize_together:
                scratch = self.peak_breakdown.get("dequantized_weights", 0)
                lines.append("Dequantize each packed block's layers together at its first "
                             f"call, into one buffer of {format_size(scratch)} (less host "
                             "time per layer).")
        if self.activation_offload:
            lines.append("Offload saved activations to pinned host memory.")
        for label, phase in (("forward", self.forward), ("backward", self.backward)):
            if self.mode != "train" and label == "backward":
                continue
            compute = f"{phase.compute_seconds * 1e3:.0f} ms of compute"
            if phase.host_bound:
                copies = (f", {format_size(phase.copy_bytes)} of copies "
                          f"({phase.copy_seconds * 1e3:.0f} ms)" if phase.copy_bytes else "")
                lines.append(f"{label.capitalize()} {phase.seconds * 1e3:.0f} ms, host-bound: "
                             f"the host needs {phase.host_seconds * 1e3:.0f} ms to enqueue "
                             f"{compute}{copies}.")
            elif phase.copy_bytes:
                copies = (f"{format_size(phase.copy_bytes)} of copies "
                          f"({phase.copy_seconds * 1e3:.0f} ms)")
                bound = ("transfer-bound" if phase.transfer_bound else
                         "compute-bound (the copies hide behind compute)")
                slowed = (f"; beside the copies the compute runs "
                          f"{phase.slowed_seconds * 1e3:.1f} ms slower"
                          if phase.slowed_seconds >= 5e-5 else "")
                lines.append(f"{label.capitalize()} {phase.seconds * 1e3:.0f} ms, {bound}: "
                             f"{copies} vs {compute}{slowed}.")
            else:
                lines.append(f"{label.capitalize()} {phase.seconds * 1e3:.0f} ms: {compute}, "
                             "no copies.")
        lines.append(f"Predicted step: {self.predicted_step_seconds * 1e3:.0f} ms on "
                     f"{self.machine}.")
        lines.extend(self.notes)
        return "\n".join(lines)


def _by_stack(names: Sequence[str], swapped: set[str]) -> dict[str, tuple[int, int]]:
    """Per stack of blocks (a name up to its last index: ``transformer_blocks`` for
    ``transformer_blocks.3`` and for a split block's ``transformer_blocks.3.attn``), how many of
    its blocks are swapped and how many it has, in the order the stacks first run."""
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        parts = name.split(".")
        index = max((i for i, part in enumerate(parts) if part.isdigit() and i), default=0)
        stack = ".".join(parts[:index]) if index else name  # a split block's unit: its stack
        k, total = out.get(stack, (0, 0))
        out[stack] = (k + (name in swapped), total + 1)
    return out


def _checkpoint_order(cost: ModelCost) -> list[str]:
    """Blocks in the order a planner checkpoints them: most activation bytes saved per FLOP
    recomputed first; earlier blocks first among equals (they lower every later block's
    peak). A block whose inputs weigh as much as what it saves is left out: checkpointing it
    would keep as much and cost a recomputation."""
    def gain(i: int) -> tuple[float, int]:
        block = cost.blocks[i]
        saved = block.activations - block.inputs
        return (-saved / max(block.forward_flops, 1.0), i)

    useful = [i for i, b in enumerate(cost.blocks) if b.activations > b.inputs]
    return [cost.blocks[i].name for i in sorted(useful, key=gain)]


def simulate_phase(compute: Sequence[float], copies: Sequence[float],
                   swapped: Sequence[bool], slots: int,
                   restores: Sequence[float] | None = None,
                   host: Sequence[float] | None = None,
                   slowdown: float | Sequence[float] = 0.0) -> float:
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
    """
    return _simulate(compute, copies, swapped, slots, restores, host, slowdown)[0]


def _simulate(compute: Sequence[float], copies: Sequence[float], swapped: Sequence[bool],
              slots: int, restores: Sequence[float] | None, host: Sequence[float] | None,
              slowdown: float | Sequence[float]) -> tuple[float, float]:
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
    if restores is not None and n and restores[0]:
        engine = restored[0] = restores[0]
    for i, (c, s) in enumerate(zip(compute, swapped, strict=True)):
        ready = max(t, restored[i])
        if host is not None:
            ready = max(ready, enqueued)
            enqueued += host[i]
        if s:
            ready = max(ready, arrives[i])
        if restores is not None and i + 1 < n and restores[i + 1]:
            # the next block's activations, queued as this block starts
            engine = max(engine, ready) + restores[i + 1]
            restored[i + 1] = engine
        # the copies enqueued so far run beside this block until the engine is done
        beside = min(max(0.0, engine - ready), c)
        lost += slow[i] * beside
        t = max(ready + c + slow[i] * beside, enqueued)
        if s:
            nxt = done + slots
            done += 1
            if nxt < len(order):  # its slot takes the swapped block ``slots`` places later
                engine = max(engine, t) + copies[order[nxt]]
                arrives[order[nxt]] = engine
    return t, lost


def _simulate_calls(compute: Sequence[float], copies: Sequence[float],
                    swapped: Sequence[bool], slots: int, host: Sequence[float] | None,
                    slowdown: float | Sequence[float]) -> tuple[float, float]:
    """:func:`_simulate` of one inference call in a run of back-to-back calls: the time and
    the compute lost to copies of the second of two calls simulated in a row.

    Inference has no backward turn to keep blocks across: while a call's last swapped blocks
    run, the swapper already loads the next call's first ones into the slots they free
    (``SlotRing``'s inference order wraps around), so every swapped block is copied once a
    call, its first copies beside the previous call's tail. One call simulated alone starts
    with those first blocks in place for free: FLUX.1-dev at 11.5 GiB on an H200 (43 of 57
    swapped, 3 slots, transfer-bound) was predicted 247 ms and ran 284 ms
    (``benchmarks/plan.py``, docs/benchmarks.md). When every swapped block has a slot nothing
    is copied after the first call: the call alone."""
    once = _simulate(compute, copies, swapped, slots, None, host, slowdown)
    if sum(1 for s in swapped if s) <= slots:
        return once
    slow = slowdown if isinstance(slowdown, (int, float)) else [*slowdown, *slowdown]
    twice = _simulate([*compute, *compute], [*copies, *copies], [*swapped, *swapped], slots,
                      None, None if host is None else [*host, *host], slow)
    return twice[0] - once[0], twice[1] - once[1]


def _block_sides(full: Sequence[CallTimes], as_checkpointed: Sequence[CallTimes],
                 dequant: Sequence[CallTimes], per_layer: Sequence[CallTimes],
                 swapped: Sequence[bool], checkpointed: Sequence[bool], together: bool
                 ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per block, the device's and the host's seconds of its forward, then of its backward, in
    a candidate: its own call as built (``full``) or checkpointed (``as_checkpointed``: the
    checkpoint's forward, the recomputation in backward), what its storage format adds
    (``dequant``; the recomputation dequantizes again) and the swapper's bookkeeping on the
    host. Dequantizing together, an un-checkpointed block's backward finds the shared
    buffer holding another block and dequantizes each layer (``per_layer``); a checkpointed
    one's recomputation has just filled it."""
    fwd_dev: list[float] = []
    fwd_host: list[float] = []
    bwd_dev: list[float] = []
    bwd_host: list[float] = []
    for c, ck, d, layer, s, k in zip(full, as_checkpointed, dequant, per_layer, swapped,
                                     checkpointed, strict=True):
        swap_host = SWAP_HOST_SECONDS if s else 0.0
        back = layer if together and not k else d
        call = ck if k else c
        fwd_dev.append(call.forward + d.forward)
        fwd_host.append(call.host_forward + d.host_forward + swap_host)
        bwd_dev.append(call.backward + back.backward + (d.forward if k else 0.0))
        bwd_host.append(call.host_backward + back.host_backward
                        + (d.host_forward if k else 0.0) + swap_host)
    return fwd_dev, fwd_host, bwd_dev, bwd_host


def _swap_sets(sizes: Sequence[int], compute: Sequence[float], k: int,
               bytes_per_s: float | None = None) -> list[list[int]]:
    """Which ``k`` blocks to swap: candidates for the search to simulate.

    * spread evenly over the model's bytes (:func:`~vramkit.offload.blocks.spread_evenly`, the
      swapper's own schedule);
    * the cheapest copies first: blocks grouped by kind (equal bytes and forward time), kinds
      taken in order of bytes copied per second of forward compute, the last kind taken in
      part spread evenly over its members. A model of two kinds of block (FLUX: a double block
      moves 2.7x the bytes per ms of compute of a single one) swaps the kind whose copies hide
      behind its own compute and keeps the other resident; spreading by bytes swaps both and
      leaves the copy engine behind in a run of large blocks (FLUX at 15.5 GiB on an H200,
      ``benchmarks/plan_phases.py``: double blocks 8-18 took up to 12.3 ms each in forward,
      the pace of their copies, against 4.3-5.6 ms resident).
    * with the copy bandwidth (``bytes_per_s``), copies paced by compute
      (:func:`_paced_set`): each kind swapped where the compute before it has room for its
      copy. Cheapest-first leaves a run of swapped small blocks whose copies outrun their
      compute while the large blocks before them stay resident with their copy time unused
      (FLUX with every block checkpointed at 15.5 GiB: 38 single blocks in a row, the forward
      paced by their copies whether 3 or 8 double blocks were swapped too).
    """
    if k <= 0:
        return [[]]
    sets = [spread_evenly(sizes, k)]
    if bytes_per_s:
        paced = _paced_set(sizes, compute, k, bytes_per_s)
        if paced is not None and paced not in sets:
            sets.append(paced)
    groups: dict[tuple[int, float], list[int]] = {}
    for i, size in enumerate(sizes):
        if size:
            groups.setdefault((size, compute[i]), []).append(i)
    if sum(len(g) for g in groups.values()) < k:
        return sets
    chosen: list[int] = []
    for (size, _seconds), members in sorted(
            groups.items(), key=lambda item: (item[0][0] / max(item[0][1], 1e-12), item[1][0])):
        need = k - len(chosen)
        if need <= 0:
            break
        if need >= len(members):
            chosen += members
        else:
            chosen += [members[j] for j in spread_evenly([size] * len(members), need)]
    chosen.sort()
    if chosen not in sets:
        sets.append(chosen)
    return sets


def _paced_set(sizes: Sequence[int], compute: Sequence[float], k: int,
               bytes_per_s: float) -> list[int] | None:
    """``k`` swappable blocks whose copies keep pace with the forward's compute.

    Walking the blocks in order, the copy engine earns ``pace`` seconds of copying per second
    of compute; a block is swapped when its copy fits what was earned and not spent. The
    smallest pace that swaps ``k`` blocks is found by bisection (a higher pace never swaps
    fewer). ``None`` when no pace gives exactly ``k``."""
    n = len(sizes)
    if k > sum(1 for s in sizes if s):
        return None
    copy = [s / bytes_per_s for s in sizes]

    def walk(pace: float) -> list[int]:
        credit, picked = 0.0, []
        for i in range(n):
            credit += pace * compute[i]
            if sizes[i] and copy[i] <= credit:
                picked.append(i)
                credit -= copy[i]
        return picked

    low, high = 0.0, 1.0
    while len(walk(high)) < k and high < 1e9:
        high *= 2
    for _ in range(40):
        mid = (low + high) / 2
        if len(walk(mid)) >= k:
            high = mid
        else:
            low = mid
    picked = walk(high)
    return picked if len(picked) == k else None


def search(cost: ModelCost, machine: Machine, budget: int, headroom: int, *,
           allow_formats: Sequence[str] = (), num_slots: Sequence[int] = (1, 2, 3),
           activation_offload: bool = True, host_budget: int | None = None,
           budget_for: Callable[[int], int] | None = None,
           times: BlockTimes | None = None, disk_bytes_per_s: float | None = None,
           checkpointing: str = "auto") -> Plan:
    """The fastest plan that fits (see the module docstring).

    Args:
        budget_for: the smallest budget whose room (after headroom) holds a given number of
            bytes (default ``need + headroom``); names the minimum when nothing fits.
        times: measured block times (:func:`~vramkit.planning.calibration.calibrate_blocks`)
            to use instead of FLOPs over the machine's throughput; the work outside the blocks
            then runs at the throughput the timed blocks reached.
        disk_bytes_per_s: the disk read bandwidth of a disk tier (default
            :data:`DEFAULT_DISK_BYTES_PER_S`, said in the plan's notes): a candidate whose
            masters exceed ``host_budget`` keeps blocks on disk as the swapper would
            (``BlockSwapper.disk_split``), each such block's copy paced by the disk.
        checkpointing: ``"auto"`` (default), ``"all"`` or ``"none"`` (:data:`CHECKPOINTING`;
            training only): which blocks may be checkpointed.

    Raises:
        PlanError: when nothing fits, naming the smallest budget that would, and what would
            make it fit.
    """
    train = cost.mode == "train"
    formats = ["bf16", *[f for f in allow_formats if f != "bf16" and f in cost.formats]]
    avail = budget - headroom
    n = len(cost.blocks)
    names = [b.name for b in cost.blocks]
    order = _checkpoint_order(cost) if train else []
    if train and checkpointing == "all":  # every block, the ones left out of the order last
        order += [name for name in names if name not in set(order)]
    estimate = cost.activations
    trainable = (2 * cost.trainable_bytes + ADAMW_STATE_BYTES * cost.trainable_params
                 if train else cost.trainable_bytes)
    if train:
        act_choices = [estimate.bytes_with(order[:m]) for m in range(len(order) + 1)]
        if checkpointing != "auto":  # only the asked set (its index in the order kept)
            asked = len(order) if checkpointing == "all" else 0
            act_choices = [a if m == asked else math.inf  # type: ignore[misc]
                           for m, a in enumerate(act_choices)]
    else:
        # one block at a time: what it holds while it runs (FLUX.1-dev's single block at
        # 1024 px: 432 MiB it makes beside its 27 MiB of inputs, where what autograd would save
        # priced 140 MiB and a fitted forward on an H200 peaked 3.1 % above its plan)
        act_choices = [max(estimate.largest_block
                           + max((b.inputs for b in cost.blocks), default=0),
                           estimate.inference_peak, estimate.tail)]
    least_activations = min(act_choices)
    if activation_offload and train and checkpointing != "none":
        least_activations = min(least_activations, _offloaded(estimate, train))
    flops = machine.flops_per_s
    # Each block's call, the device's and the host's seconds apart: measured where the
    # calibration timed it, else the time model of its counted work.
    full: list[CallTimes] = []
    for b in cost.blocks:
        (fwd, host_fwd), (bwd, host_bwd) = machine.block_sides(b.forward_flops,
                                                               b.backward_flops, b.work)
        full.append(CallTimes(fwd, bwd, host_fwd, host_bwd))
    measured: set[str] = set()
    if times is not None:
        measured = set(times.calls.get(FULL, {})) - set(times.fallbacks)
        full = [times.calls[FULL][b.name] if b.name in measured else c
                for b, c in zip(cost.blocks, full, strict=True)]
        flops = times.flops_per_s(cost) or flops
    # Each block's call checkpointed: measured (the lean checkpoint's forward records no graph,
    # so its host side can cost less than the call as built; its backward recomputes the
    # forward first), else the call as built with one more forward in backward.
    as_checkpointed: list[CallTimes] = []
    for b, c in zip(cost.blocks, full, strict=True):
        timed = (times.call(b.name, CHECKPOINTED)
                 if times is not None and b.name in measured else None)
        as_checkpointed.append(timed if timed is not None else CallTimes(
            c.forward, c.backward + c.forward, c.host_forward, c.host_backward + c.host_forward))
    # How much slower each block's compute runs beside the copy engine: measured where the
    # calibration timed it (GPU), else the machine's share (a hardware profile's assumed one; 0
    # on a measured machine, whose calibration times it).
    slow_fwd = [machine.copy_slowdown[0]] * n
    slow_bwd = [machine.copy_slowdown[1]] * n
    if times is not None:
        for i, b in enumerate(cost.blocks):
            if b.name in measured:
                slow_fwd[i], slow_bwd[i] = times.copy_slowdown(b.name)
    bw = machine.h2d_bytes_per_s
    disk_bw = disk_bytes_per_s if disk_bytes_per_s is not None else DEFAULT_DISK_BYTES_PER_S
    optimizer = 4 * cost.trainable_bytes / machine.memory_bandwidth_bytes_per_s if train else 0.0
    if times is None:
        outside_fwd, outside_bwd = machine.block_seconds(
            cost.outside_forward_flops, cost.outside_backward_flops, cost.outside_work)
    else:  # at the throughput the timed blocks reached
        outside_fwd = cost.outside_forward_flops / flops
        outside_bwd = cost.outside_backward_flops / flops
    # What storing a block packed adds to its forward and backward calls: measured where the
    # calibration timed the format, else the memory traffic of dequantizing.
    # Two ways to run a packed block: each layer dequantizes its own weight at its call, or
    # (``together``) the block's first call dequantizes all of its layers into one buffer shared
    # by every packed block (vramkit.quant.dense): less host time, the largest packed block's
    # weights in memory. Weighed where the calibration timed both.
    ways = [False]
    if times is not None and any(times.calls.get(packed_variant(f, True)) for f in formats):
        ways.append(True)
    dequant_by: dict[bool, dict[str, list[CallTimes]]] = {}
    for together in ways:
        dequant_by[together] = {}
        for fmt in formats:
            dequant_by[together][fmt] = []
            for b in cost.blocks:
                extra = (times.extra(packed_variant(fmt, together), b.name)
                         if times is not None and fmt != "bf16" else None)
                if extra is None:
                    modeled = _dequant(b, fmt, machine)
                    extra = CallTimes(modeled, modeled, 0.0, 0.0)
                dequant_by[together][fmt].append(extra)
    dense_of = {fmt: [b.dense.get(fmt, 0) for b in cost.blocks] for fmt in formats}
    # Activation offload is a candidate wherever it fits, not only where nothing else does:
    # the room it frees keeps more weights on the device, fewer copies in a transfer-bound
    # forward, while its own copies run on the other engine in forward and in a backward
    # whose copies hide behind compute.
    offload_too = activation_offload and train and checkpointing != "none"

    def price(k: int, chosen: list[int], flags: list[bool], r: int, sizes: list[int],
              copy_s: list[float], master_bytes: int, weights: int, slots: int, scratch: int,
              dequant: list[CallTimes], per_layer: list[CallTimes], fmt_s: str, fmt_r: str,
              together: bool, m: int, offload: bool) -> dict[str, Any] | None:
        """One candidate's predicted phases and memory (``None``: its masters cannot be split
        between host and disk under ``host_budget``)."""
        ckpt = order[:m]
        act = act_choices[m] if not offload else _offloaded(estimate, train)
        offload_bytes = _offload_bytes(estimate, ckpt) if offload else 0
        host = master_bytes + offload_bytes
        disk: tuple[int, ...] = ()
        swap_budget = None
        phase_copy_s = copy_s
        if host_budget is not None and host > host_budget:
            swap_budget = host_budget - offload_bytes
            split = _disk_split([sizes[i] for i in chosen], swap_budget)
            if split is None:
                return None
            disk = tuple(chosen[j] for j in split.on_disk)
            host = split.pinned + offload_bytes
            phase_copy_s = list(copy_s)
            for i in disk:  # read from disk, then copied: the slower one paces it
                phase_copy_s[i] = sizes[i] / min(bw, disk_bw)
        copies = int(master_bytes * max(0, k - r) / k) if k else 0
        ckpt_set = set(ckpt)
        sides = _block_sides(full, as_checkpointed, dequant, per_layer, flags,
                             [name in ckpt_set for name in names],
                             together)
        if train:
            fwd_time, fwd_lost = _simulate(sides[0], phase_copy_s, flags, r, None, sides[1],
                                           slow_fwd)
        else:  # back-to-back calls: the ring wraps around to the next call's first blocks
            fwd_time, fwd_lost = _simulate_calls(sides[0], phase_copy_s, flags, r, sides[1],
                                                 slow_fwd)
        fwd_time += outside_fwd
        if offload:  # device->host copies run on the other engine
            fwd_time = max(fwd_time, offload_bytes / machine.d2h_bytes_per_s)
        # Copy engine time: disk blocks are paced by the disk (the same share of them as of
        # all swapped blocks is copied in a phase). Training keeps the last slots' blocks
        # across the turn and the first ones between steps; inference copies every swapped
        # block once a call unless all of them have a slot.
        share = max(0, k - r) / k if k else 0.0
        if not train and k > r:
            share = 1.0
            copies = master_bytes
        copy_time = copies / bw + share * sum(
            sizes[i] * (1 / min(bw, disk_bw) - 1 / bw) for i in disk)
        fwd = PhaseTime(fwd_time, outside_fwd + sum(sides[0]), copy_time,
                        copies, outside_fwd + sum(sides[1]), fwd_lost)
        if train:
            restores = ([_kept_bytes(estimate, b.name, ckpt_set) / bw
                         for b in cost.blocks] if offload else None)
            back, bwd_lost = _simulate(sides[2][::-1], phase_copy_s[::-1], flags[::-1], r,
                                       restores[::-1] if restores else None,
                                       sides[3][::-1], slow_bwd[::-1])
            bwd = PhaseTime(outside_bwd + back, outside_bwd + sum(sides[2]),
                            copy_time + offload_bytes / bw,
                            copies + offload_bytes,
                            outside_bwd + sum(sides[3]), bwd_lost)
        else:
            bwd = PhaseTime(0.0, 0.0, 0.0, 0)
        seconds = fwd.seconds + bwd.seconds + optimizer  # the swapper's host time: in the phases
        breakdown = {"resident_weights": weights, "swap_slots": slots,
                     "trainable_and_optimizer": trainable, "activations": act}
        if scratch:
            breakdown["dequantized_weights"] = scratch
        return {
            "seconds": seconds, "k": k, "m": m, "r": r, "offload": offload,
            "fmt_rank": (formats.index(fmt_s), formats.index(fmt_r)),
            "chosen": chosen, "ckpt": ckpt, "breakdown": breakdown, "fwd": fwd,
            "bwd": bwd, "host": host, "fmt_s": fmt_s,
            "fmt_r": fmt_r, "disk": disk, "swap_budget": swap_budget,
            "together": together}

    candidates: list[dict[str, Any]] = []
    smallest = math.inf  # the least memory any candidate needs (for the error)
    for together in ways:
        dequant_of = dequant_by[together]
        for fmt_s in formats:
            sizes = [b.swapped[fmt_s] for b in cost.blocks]
            # each block's forward in this format: the compute its copy can hide behind
            ranked = [max(c.forward + d.forward, c.host_forward + d.host_forward)
                      for c, d in zip(full, dequant_of[fmt_s], strict=True)]
            swap_sets = [_swap_sets(sizes, ranked, k, bw) for k in range(n + 1)]
            for fmt_r in formats:
                if together and fmt_s == fmt_r == "bf16":
                    continue  # nothing packed: the same candidates as the other way
                resident_all = [b.resident_bytes(fmt_r) for b in cost.blocks]
                for k in range(n + 1):
                    for chosen in swap_sets[k]:
                        if k and not all(sizes[i] for i in chosen):
                            continue  # a block with nothing swappable cannot be swapped
                        swapped_set = set(chosen)
                        flags = [i in swapped_set for i in range(n)]
                        weights = cost.outside_bytes + sum(
                            cost.blocks[i].kept[fmt_s] if flags[i] else resident_all[i]
                            for i in range(n))
                        slot = max((sizes[i] for i in chosen), default=0)
                        master_bytes = sum(sizes[i] for i in chosen)
                        scratch = max((dense_of[fmt_s if flags[i] else fmt_r][i]
                                       for i in range(n)), default=0) if together else 0
                        block_fmt = [fmt_s if flags[i] else fmt_r for i in range(n)]
                        dequant = [dequant_of[f][i] for i, f in enumerate(block_fmt)]
                        per_layer = ([dequant_by[False][f][i] for i, f in enumerate(block_fmt)]
                                     if together else dequant)
                        copy_s = [sizes[i] / bw if flags[i] else 0.0 for i in range(n)]
                        for r in sorted(set(num_slots)):
                            if k and r > k:
                                continue  # slots beyond the swapped blocks would hold nothing
                            slots = r * slot if chosen else 0
                            rest = weights + slots + trainable + scratch
                            smallest = min(smallest, rest + least_activations)
                            if rest >= avail:
                                continue
                            m, offload = _fit_activations(act_choices, avail - rest, train, estimate,
                                                          offload_too)
                            if m is None:
                                continue
                            fits = [(m, offload)]
                            if (offload_too and not offload
                                    and _offloaded(estimate, train) <= avail - rest):
                                # everything checkpointed, saved tensors on the host: more room for weights
                                fits.append((len(act_choices) - 1, True))
                            for m, offload in fits:
                                candidate = price(k, chosen, flags, r, sizes, copy_s, master_bytes, weights,
                                                  slots, scratch, dequant, per_layer, fmt_s, fmt_r, together,
                                                  m, offload)
                                if candidate is not None:
                                    candidates.append(candidate)
    best = _prefer_simple(candidates)
    if best is None:
        need = (budget_for or (lambda n: n + headroom))(int(smallest)) if math.isfinite(
            smallest) else None
        raise _impossible(cost, budget, headroom, need, allow_formats, host_budget,
                          checkpointing, min(num_slots))
    chosen_set = set(best["chosen"])
    swapped = tuple(names[i] for i in best["chosen"])
    resident = tuple(name for i, name in enumerate(names) if i not in chosen_set)
    ckpt_set = set(best["ckpt"])
    notes = []
    if times is not None:
        notes.append(f"Block times measured on {times.device} ({times.kinds} kind(s) of block "
                     "timed" + (f"; {len(times.fallbacks)} block(s) from FLOP counts"
                                if times.fallbacks else "") + ").")
    if swapped and (any(slow_fwd) or any(slow_bwd)):
        share_f = (sum(s * c.forward for s, c in zip(slow_fwd, full, strict=True))
                   / (sum(c.forward for c in full) or 1.0))
        share_b = (sum(s * c.backward for s, c in zip(slow_bwd, full, strict=True))
                   / (sum(c.backward for c in full) or 1.0))
        how = ("timed with copies running beside each kind of block" if measured else
               "the share the calibration measured for FLUX.1-dev's blocks on an H200; "
               "vramkit.fit's calibration times this card's own")
        notes.append(f"Copies slow the compute beside them ({how}): forward "
                     f"+{100 * share_f:.1f} %"
                     + (f", backward +{100 * share_b:.1f} %" if train else "")
                     + " where they overlap; priced in the phases above.")
    if times is not None:
        for fmt in formats:
            for together in ways:
                timed = ([times.packed_extra(fmt, b.name, together=together)
                          for b in cost.blocks] if fmt != "bf16" else [])
                if timed and all(t is not None for t in timed):
                    extra_fwd = sum(t[0] for t in timed if t is not None)
                    base = sum(times.forward[b.name] for b in cost.blocks) or 1.0
                    how = ("each block's layers dequantized together" if together
                           else "each layer dequantized at its call")
                    notes.append(f"{fmt} storage timed on {times.device} ({how}): dequantizing "
                                 f"adds {extra_fwd * 1e3:.1f} ms to a forward pass of every "
                                 f"block ({100 * extra_fwd / base:.0f} % of their "
                                 "full-precision time).")
    if not machine.measured:
        notes.append(f"Times are estimates from {machine.name}'s published peak throughput "
                     "and copy bandwidth; vramkit.fit measures and compares after the first "
                     "steps.")
    if best["disk"] and disk_bytes_per_s is None:
        notes.append(f"The disk tier's reads are assumed at {DEFAULT_DISK_BYTES_PER_S / 1e9:.1f} "
                     "GB/s: pass disk_bytes_per_s= (vramkit info --disk PATH measures it; "
                     "vramkit.fit measures its checkpoint).")
    return Plan(
        mode=cost.mode, machine=machine.name, budget_bytes=budget, headroom_bytes=headroom,
        swapped=swapped, resident=resident,
        checkpointed=tuple(name for name in names if name in ckpt_set),
        num_slots=best["r"] if swapped else 0,
        swapped_format=best["fmt_s"], resident_format=best["fmt_r"],
        activation_offload=best["offload"],
        predicted_peak_bytes=sum(best["breakdown"].values()),
        peak_breakdown=best["breakdown"], forward=best["fwd"], backward=best["bwd"],
        optimizer_seconds=optimizer, overhead_seconds=0.0,
        host_bytes=best["host"], notes=tuple(notes), block_order=tuple(names),
        disk_blocks=tuple(names[i] for i in best["disk"]),
        swap_host_budget=best["swap_budget"] if best["disk"] else None,
        disk_bytes_per_s=disk_bw if best["disk"] else None,
        dequantize_together=best["together"], checkpointing=checkpointing)


#: Plans within this share of the fastest one count as equally fast: among them the one with
#: the least machinery wins (fewer swapped blocks, less recomputation, no activation offload,
#: fewer slots, the formats as built).
EQUAL_TIME_SHARE = 1e-6


def _prefer_simple(candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not candidates:
        return None
    fastest = min(c["seconds"] for c in candidates)
    near = [c for c in candidates if c["seconds"] <= fastest * (1 + EQUAL_TIME_SHARE)]
    return min(near, key=lambda c: (len(c["disk"]), c["k"], c["m"], c["offload"], c["r"],
                                    c["fmt_rank"], c["together"], c["seconds"]))


def _fit_activations(act_choices: list[int], room: int, train: bool, estimate: Any,
                     activation_offload: bool) -> tuple[int | None, bool]:
    """The fewest checkpointed blocks whose activations fit ``room`` (``act_choices`` falls
    as more are checkpointed), else everything checkpointed plus activation offload."""
    if not train:
        return (0, False) if act_choices[0] <= room else (None, False)
    # act_choices falls as blocks are added (each saves more than its inputs); the running
    # minimum makes the search exact even if an estimate ever broke that.
    negated = [-a for a in itertools.accumulate(act_choices, min)]
    m = bisect.bisect_left(negated, -room)
    if m < len(act_choices):
        return m, False
    if activation_offload and _offloaded(estimate, train) <= room:
        return len(act_choices) - 1, True
    return None, False


def _offloaded(estimate: Any, train: bool) -> int:
    """Activations on the device with offload on, at the largest of three moments:

    * the turn of the step: the tail (a language model's logits) with the forward's last
      tensors still held -- backward has prefetched nothing yet (counting the whole window
      there put Llama-8B's 7.5 GiB plan 0.5 GiB above its measured peak, one slot short: R=1,
      2.0x the resident step);
    * the start of backward: those held tensors, the prefetched ones, and the last block
      rebuilt by its recomputation with its temporaries (of the order of what it saves);
    * later in backward: the held tensors are used up (the first blocks of backward take them),
      so the prefetched ones, the block being recomputed and its temporaries. (Counting the
      held tensors here too put every FLUX offload plan ~256 MiB above its measured peak; a
      snapshot of the 7.5 GiB row's peak held the prefetched tensors, 285 MB, and a double
      block's recomputation and temporaries, nothing of the forward's.)"""
    if not train:
        return max(estimate.largest_block, estimate.tail)
    last = next(reversed(estimate.per_block.values()), 0)  # backward's first recomputation
    backward = max(OFFLOAD_PREFETCH_BYTES + 2 * estimate.largest_block,
                   OFFLOAD_WINDOW_BYTES + 2 * last)
    return estimate.outside + max(backward, OFFLOAD_INFLIGHT_BYTES + estimate.tail)


def _offload_bytes(estimate: Any, checkpointed: Sequence[str]) -> int:
    """Bytes an activation offloader moves each way: what the blocks keep."""
    chosen = set(checkpointed)
    return sum(_kept_bytes(estimate, n, chosen) for n in estimate.per_block)


def _dequant(block: BlockCost, fmt: str, machine: Machine) -> float:
    """Dequantizing a block's packed weights at a call: reading the packed bytes and writing
    bf16 ones (the matmul then reads them as it would the bf16 weights)."""
    if fmt == "bf16":
        return 0.0
    return (block.swapped[fmt] + block.swapped["bf16"]) / machine.memory_bandwidth_bytes_per_s


#: Disk read bandwidth a disk tier is planned with when none is given: a SATA SSD or a cloud
#: volume; the H100 machine's virtio disk read 1.28 GB/s (docs/benchmarks.md).
DEFAULT_DISK_BYTES_PER_S = 1.0e9


def _disk_split(sizes: list[int], budget: int) -> Any:
    """The swapper's disk tier for ``sizes`` under ``budget`` (``None``: impossible)."""
    from vramkit.errors import ConfigError
    from vramkit.offload.swap import BlockSwapper

    if budget <= 0:
        return None
    try:
        return BlockSwapper.disk_split(sizes, [True] * len(sizes), budget)
    except ConfigError:
        return None


def _kept_bytes(estimate: Any, name: str, checkpointed: set[str]) -> int:
    return int(estimate.inputs[name] if name in checkpointed else estimate.per_block[name])


def _impossible(cost: ModelCost, budget: int, headroom: int, need: int | None,
                allow_formats: Sequence[str], host_budget: int | None,
                checkpointing: str = "auto", slots: int = 1) -> PlanError:
    ideas = []
    if checkpointing == "none" and cost.mode == "train":
        ideas.append("checkpointing='auto' (checkpointed blocks keep only their inputs)")
    quantizable = [f for f in ("fp8", "nf4") if f not in allow_formats]
    if quantizable:
        effect = {"fp8": "halves", "nf4": "quarters"}[quantizable[0]]
        ideas.append(f"packed storage of the frozen weights (allow_formats=('{quantizable[0]}',)"
                     f" {effect} them and the bytes swapped)")
    ideas.append("a smaller batch or resolution (activations scale with them)")
    if host_budget is not None:
        ideas.append("a larger host_budget (pinned memory for the swapped blocks)")
    if need is None:
        return PlanError("no plan exists for this model: it has no block that can be swapped",
                         hint="Try " + "; ".join(ideas) + ".")
    if need <= budget and host_budget is not None:
        return PlanError(f"no plan fits the host budget of {format_size(host_budget)}: even "
                         "with swapped blocks kept on disk, the masters that stay and the "
                         "staging buffers the disk tier reads through need more pinned host "
                         "memory",
                         hint="Raise host_budget, allow packed storage (allow_formats) so the "
                              "swapped blocks take less, or raise the device budget.",
                         minimum_budget=None)
    how = f"every block swapped, {slots} slot{'s' if slots != 1 else ''}"
    if cost.mode == "train":
        how += (", no block checkpointed, as asked" if checkpointing == "none"
                else ", everything checkpointed")
    message = (f"a budget of {format_size(budget)} cannot hold this {cost.mode} step: the "
               f"smallest plan ({how}) needs a budget of {format_size(need)} (with the "
               "headroom kept free)")
    return PlanError(message, hint=f"Raise the budget to {format_size(need)} or more, or try "
                                   + "; or ".join(ideas) + ".", minimum_budget=need)
