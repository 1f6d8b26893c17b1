"""The planner: which blocks to swap, how many slots, which blocks to checkpoint, which storage
formats, whether to offload activations, for the best predicted step time under a budget.

The model (:class:`~vramkit.planning.analysis.ModelCost`) gives per block FLOPs, activation bytes
and weight bytes per format; the machine (:class:`~vramkit.planning.machine.Machine`) gives copy
bandwidth and throughput. A candidate is predicted phase by phase
(:class:`~vramkit.planning.pricing.StepPricer`):

* memory: frozen weights kept on the device + ``R`` slots of the largest swapped block +
  with packed formats, the largest packed block's weights dequantized (one buffer that every
  packed block's call fills, :mod:`vramkit.quant.dense`) +
  trainable parameters, their gradients and AdamW state + activations for the checkpointed set
  (:meth:`~vramkit.planning.activations.ActivationEstimate.bytes_with`) <= budget - headroom;
* time: forward and backward (with recomputation) are each simulated block by block
  (:func:`~vramkit.planning.simulation.simulate_phase`): the host enqueues the blocks ahead of the device (a block's kernels
  start once the host began enqueueing it and end no earlier than it finished), the compute
  stream runs the blocks in order, a swapped block waits for its copy, and a copy waits for the
  copy engine and for a free slot (the slot of the swapped block ``R`` places earlier frees when
  that block's compute ends); the first ``R`` swapped blocks of a phase are already loaded
  (kept across the forward/backward turn). So a phase costs at least ``max(compute, host,
  copies)``, and more where slots are too few or swapped blocks too close together for the
  copies to hide. Plus the optimizer; the swapper's bookkeeping counts on the host. A block's
  own device and host times are measured (``times``, a calibrated machine: as built, under
  checkpointing, in each packed format) or, offline, the time model of its counted work
  (:meth:`~vramkit.planning.machine.Machine.work_sides`); the prices of a block as built,
  checkpointed and packed are :class:`~vramkit.planning.pricing.BlockPrices`.

The search: for each pair of formats (swapped blocks, resident blocks) among the allowed ones,
each ``R`` and each number of swapped blocks (three candidate sets, :func:`_swap_sets`: spread
evenly by bytes, as the swapper's own schedule does; the cheapest copies first, kinds of block
in order of bytes per ms of compute; copies paced by the compute before them), the fewest
checkpointed blocks that fit (blocks in order of activation saved per recomputed FLOP; a binary
search, since checkpointing more never needs more memory; ``checkpointing="all"`` or
``"none"`` fixes the set), and activation offload with everything checkpointed wherever it
fits. The fastest candidate wins; ties go to less swapping, less recomputation and fewer
slots. It returns a :class:`~vramkit.planning.record.Plan`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vramkit._validate import check_choice, check_number
from vramkit.errors import PlanError
from vramkit.offload.blocks import spread_evenly
from vramkit.planning._compression import MIN_GAIN, decode_rate
from vramkit.planning.analysis import ModelCost
from vramkit.planning.calibration import BlockTimes
from vramkit.planning.machine import COPY_SLOWDOWN, Machine
from vramkit.planning.pricing import (
    DEFAULT_DISK_BYTES_PER_S,
    BlockPrices,
    Candidate,
    Priced,
    StepPricer,
    _offloaded,
)
from vramkit.planning.record import ADAMW_STATE_BYTES, CHECKPOINTING, Plan
from vramkit.planning.w8a8 import accuracy_note, is_w8a8, unavailable_on_machine
from vramkit.units import format_size, format_sizes_apart

__all__ = ["CHECKPOINTING", "SWAP_SETS", "SWAP_STATE_SLOWDOWN", "Choice", "search",
           "swap_state_factor"]

#: What :func:`search` may swap: its candidate sets, or only the swapper's own schedule.
SWAP_SETS = ("search", "spread")


@dataclass(frozen=True)
class Choice:
    """One candidate named by its choices, for :func:`search` to price alone (``only=``).

    Attributes:
        chosen: the indices of the swapped blocks (in :attr:`ModelCost.blocks`).
        num_slots: R, the ring's slots (0 with nothing swapped).
        checkpoints: how many blocks of the checkpoint order are checkpointed (the order
            :func:`search` checkpoints in: most activation bytes saved per recomputed FLOP
            first).
        offload: saved activations go to pinned host memory.
        swapped_format / resident_format: storage formats.
        together: packed blocks' layers dequantized together.
    """

    chosen: tuple[int, ...]
    num_slots: int
    checkpoints: int
    offload: bool = False
    swapped_format: str = "bf16"
    resident_format: str = "bf16"
    together: bool = False


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
           checkpointing: str = "auto", copy_bytes_per_s: float | None = None,
           compress_ratio: float | None = None, only: Choice | None = None,
           trainable_mode: str = "resident", optimizer_state_bytes: float = ADAMW_STATE_BYTES,
           swap_sets: str = "search") -> Plan:
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
        copy_bytes_per_s: the rate the swapped blocks' masters reach the device (default
            the machine's pinned rate; pageable masters copy at
            :func:`~vramkit.planning.pricing.staged_copy_rate`).
        compress_ratio: what a swapped master keeps of its bytes when compressed
            (:func:`vramkit.planning._compression.expected_ratio`; ``None``: compression is not
            weighed). A candidate is compressed where that prices faster and fits, at the
            calibrated decode rate (a hardware profile's assumed one offline).
        trainable_mode: ``"resident"`` (default: the trainable parameters, their gradients
            and AdamW state stay on the device) or ``"swap"`` (full fine-tuning,
            ``SwapConfig(trainable="swap")``: a swapped block's trainable weights travel in its
            master, its AdamW state lives in pinned host memory and comes to one of ``R`` state
            slots in backward, where the block's optimizer steps; ``cost`` analyzed with
            ``swap_config=SwapConfig(trainable="swap")``). Slots below 2 are not offered then
            (the stepper keeps one state slot free for an on-demand load).
        optimizer_state_bytes: bytes of optimizer state per trainable parameter (default
            :data:`~vramkit.planning.record.ADAMW_STATE_BYTES`, AdamW's two fp32 moments; an
            8-bit AdamW keeps ``2 + 8 / 256``, AdamW over bf16 parameters 4, an optimizer
            stepped on the host 0): on the device with ``trainable_mode="resident"``; with
            ``"swap"`` what each swapped block's state moves and holds in host memory
            (:func:`vramkit.fit` measures it from its ``optimizer=`` factory).
        swap_sets: ``"search"`` (default: the candidate sets of :func:`_swap_sets`) or
            ``"spread"``: only the set the swapper's own schedule takes for a count of resident
            blocks (:func:`~vramkit.offload.blocks.spread_evenly`, what
            ``SwapConfig(max_gpu_blocks=n - k)`` swaps), for callers that apply a count of
            swapped blocks rather than a set (the SDXL / Flux memory presets).
        only: price this one :class:`Choice` instead of searching (a hand plan, a plan's
            neighbour: :func:`~vramkit.planning.neighbourhood.neighbours`), whether it fits the
            budget or not; its :attr:`Plan.predicted_peak_bytes` says.

    Raises:
        PlanError: when nothing fits, naming the smallest budget that would, and what would
            make it fit.
    """
    train = cost.mode == "train"
    formats = ["bf16", *[f for f in allow_formats if f != "bf16" and f in cost.formats]]
    # W8A8 formats the machine cannot run are not offered (never run in full precision under
    # their name); the plan's notes say why.
    refused = {f: why for f in formats if (why := _w8a8_refusal(f, machine, times)) is not None}
    formats = [f for f in formats if f not in refused]
    avail = budget - headroom
    n = len(cost.blocks)
    names = [b.name for b in cost.blocks]
    order = _checkpoint_order(cost) if train else []
    if train and checkpointing == "all":  # every block, the ones left out of the order last
        order += [name for name in names if name not in set(order)]
    estimate = cost.activations
    check_choice("swap_sets", swap_sets, SWAP_SETS)
    check_number("optimizer_state_bytes", optimizer_state_bytes, minimum=0)
    trainable = (2 * cost.trainable_bytes
                 + math.ceil(optimizer_state_bytes * cost.trainable_params)
                 if train else cost.trainable_bytes)
    swap_trainable = train and trainable_mode == "swap"
    if swap_trainable:
        num_slots = tuple(r for r in num_slots if r >= 2) or (2,)
    # per block, the trainable bytes a swap moves and their optimizer state (trainable="swap")
    per_param = (cost.trainable_bytes / cost.trainable_params
                 if cost.trainable_params and cost.trainable_bytes else 4.0)
    train_bytes = [min(b.adapters, b.swapped["bf16"]) if swap_trainable else 0
                   for b in cost.blocks]
    state_bytes = [int(optimizer_state_bytes * t / per_param) for t in train_bytes]
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
    prices = BlockPrices.of(cost, machine, times, formats)
    full, measured = prices.full, prices.measured
    slow_fwd, slow_bwd = prices.slow_forward, prices.slow_backward
    ways, dequant_by, dense_of = prices.ways, prices.dequant, prices.dense
    bw = copy_bytes_per_s or machine.h2d_bytes_per_s
    disk_bw = disk_bytes_per_s if disk_bytes_per_s is not None else DEFAULT_DISK_BYTES_PER_S
    # Activation offload is a candidate wherever it fits, not only where nothing else does:
    # the room it frees keeps more weights on the device, fewer copies in a transfer-bound
    # forward, while its own copies run on the other engine in forward and in a backward
    # whose copies hide behind compute.
    offload_too = activation_offload and train and checkpointing != "none"
    pricer = StepPricer(cost=cost, machine=machine, prices=prices, order=order,
                        act_choices=act_choices, trainable=trainable, formats=formats,
                        host_budget=host_budget, disk_bytes_per_s=disk_bw,
                        copy_bytes_per_s=copy_bytes_per_s, compress_ratio=compress_ratio,
                        decode_bytes_per_s=decode_rate(machine, times), compress_budget=avail)

    candidates: list[Priced] = []
    smallest = math.inf  # the least memory any candidate needs (for the error)
    for together in ways:
        if only is not None and together != only.together:
            continue
        dequant_of = dequant_by[together]
        for fmt_s in formats:
            if only is not None and fmt_s != only.swapped_format:
                continue
            sizes = [b.swapped[fmt_s] for b in cost.blocks]
            # each block's forward in this format: the compute its copy can hide behind
            ranked = [max(c.forward + d.forward, c.host_forward + d.host_forward)
                      for c, d in zip(full, dequant_of[fmt_s], strict=True)]
            swap_sets = ([[] for _ in range(n + 1)] if only is not None else
                         [_swap_sets(sizes, ranked, k, bw) if swap_sets == "search"
                          else [spread_evenly(sizes, k)] for k in range(n + 1)])
            if only is not None:
                swap_sets[len(only.chosen)] = [sorted(only.chosen)]
            for fmt_r in formats:
                if together and fmt_s == fmt_r == "bf16" and only is None:
                    continue  # nothing packed: the same candidates as the other way
                if only is not None and fmt_r != only.resident_format:
                    continue
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
                        moved = sum(train_bytes[i] for i in chosen)
                        held = sum(state_bytes[i] for i in chosen)
                        state_slot = max((state_bytes[i] for i in chosen), default=0)
                        grads = max((train_bytes[i] for i in chosen), default=0)
                        for r in sorted(set(num_slots) if only is None else {only.num_slots}):
                            if k and r > k:
                                continue  # slots beyond the swapped blocks would hold nothing
                            slots = r * slot if chosen else 0
                            extra: dict[str, Any] = {}
                            frozen = weights
                            rest = weights + slots + trainable + scratch
                            if swap_trainable and chosen:
                                # the swapped blocks' parameters, gradients and state leave the
                                # device; R state slots come instead, and one block's gradients
                                # (each block steps as soon as its backward is done and drops
                                # them: the stepper never holds two blocks' at once)
                                on_device = (trainable - 2 * moved - held + r * state_slot
                                             + grads)
                                # both directions copy at once in this backward: each at
                                # its duplex share (the slot factor is the step over that
                                # duplex bound, as measured); the last block's write-back
                                # follows its own step
                                factor = swap_state_factor(r)
                                up = bw * machine.duplex_share
                                down = machine.d2h_bytes_per_s * machine.duplex_share
                                extra = dict(
                                    trainable=on_device, host_state=held,
                                    backward_copy_seconds=[
                                        factor * (sizes[i] + state_bytes[i]) / up
                                        if flags[i] else 0.0 for i in range(n)],
                                    backward_copy_bytes=master_bytes + held,
                                    backward_writeback_seconds=(
                                        factor * (moved + held) + grads + state_slot) / down)
                                # the resident blocks' trainable weights are counted in
                                # on_device (weights, gradients, state), not as frozen too
                                frozen = weights - sum(
                                    train_bytes[i] for i in range(n) if not flags[i])
                                rest = frozen + slots + on_device + scratch
                            smallest = min(smallest, rest + least_activations)
                            if only is not None:
                                fits = [(min(only.checkpoints, len(act_choices) - 1),
                                         only.offload and train)]
                            elif rest >= avail:
                                continue
                            else:
                                m, offload = _fit_activations(act_choices, avail - rest, train,
                                                              estimate, offload_too)
                                if m is None:
                                    continue
                                fits = [(m, offload)]
                            if (only is None and offload_too and not offload
                                    and _offloaded(estimate, train) <= avail - rest):
                                # everything checkpointed, saved tensors on the host: more room for weights
                                fits.append((len(act_choices) - 1, True))
                            for m, offload in fits:
                                candidate = pricer.price(Candidate(
                                    chosen=chosen, flags=flags, num_slots=r, sizes=sizes,
                                    copy_seconds=copy_s, master_bytes=master_bytes,
                                    weights=frozen, slot_bytes=slots, scratch=scratch,
                                    dequant=dequant, per_layer=per_layer, swapped_format=fmt_s,
                                    resident_format=fmt_r, together=together, checkpoints=m,
                                    offload=offload, **extra))
                                if candidate is not None:
                                    candidates.append(candidate)
    best = _prefer_simple(candidates)
    if best is None:
        need = (budget_for or (lambda n: n + headroom))(int(smallest)) if math.isfinite(
            smallest) else None
        raise _impossible(cost, budget, headroom, need, allow_formats, host_budget,
                          checkpointing, min(num_slots))
    chosen_set = set(best.chosen)
    swapped = tuple(names[i] for i in best.chosen)
    resident = tuple(name for i, name in enumerate(names) if i not in chosen_set)
    ckpt_set = set(best.checkpointed)
    notes = list(refused.values())
    pytorch_ckpt = [name for name in names if name in ckpt_set and name in cost.lean_refused]
    if pytorch_ckpt:  # priced as calibrated (the fallback is what ran) or offline alike
        notes.append(f"{len(pytorch_ckpt)} checkpointed block(s) keep PyTorch's checkpoint, "
                     f"not the lean one: {pytorch_ckpt[0]} "
                     f"{cost.lean_refused[pytorch_ckpt[0]].removeprefix('it ')}.")
    for fmt in dict.fromkeys((best.swapped_format if swapped else "bf16",
                              best.resident_format if resident else "bf16")):
        note = accuracy_note(fmt)
        if note is not None:
            notes.append(note)
    if times is not None:
        notes.append(f"Block times measured on {times.device} ({times.kinds} kind(s) of block "
                     "timed" + (f"; {len(times.fallbacks)} block(s) from FLOP counts"
                                if times.fallbacks else "") + ").")
    if swapped and (any(slow_fwd) or any(slow_bwd)):
        share_f = (sum(s * c.forward for s, c in zip(slow_fwd, full, strict=True))
                   / (sum(c.forward for c in full) or 1.0))
        share_b = (sum(s * c.backward for s, c in zip(slow_bwd, full, strict=True))
                   / (sum(c.backward for c in full) or 1.0))
        # The default share was read for one model on one card: named as such, never as if
        # measured for the model planned.
        how = ("timed with copies running beside each kind of block" if measured else
               "the default share, measured on an H200 for one diffusion transformer's "
               "blocks, not timed for this model or card; vramkit.fit's calibration times "
               "its own" if machine.copy_slowdown == COPY_SLOWDOWN else
               "the share Machine.copy_slowdown gives")
        notes.append(f"Copies slow the compute beside them ({how}): forward "
                     f"+{100 * share_f:.1f} %"
                     + (f", backward +{100 * share_b:.1f} %" if train else "")
                     + " where they overlap; priced in the phases above.")
    if times is not None:
        for fmt in formats:
            for together in ways:
                timed = ([times.packed_extra(fmt, b.name, together=together)
                          for b in cost.blocks] if fmt != "bf16" and not is_w8a8(fmt) else [])
                if timed and all(t is not None for t in timed):
                    extra_fwd = sum(t[0] for t in timed if t is not None)
                    base = sum(times.forward[b.name] for b in cost.blocks) or 1.0
                    how = ("each block's layers dequantized together" if together
                           else "each layer dequantized at its call")
                    notes.append(f"{fmt} storage timed on {times.device} ({how}): dequantizing "
                                 f"adds {extra_fwd * 1e3:.1f} ms to a forward pass of every "
                                 f"block ({100 * extra_fwd / base:.0f} % of their "
                                 "full-precision time).")
    if times is not None:
        for fmt in formats:
            change = [times.extra(fmt, b.name, signed=True) for b in cost.blocks]
            if is_w8a8(fmt) and change and all(c is not None for c in change):
                forward = sum(c.forward for c in change if c is not None)
                base = sum(times.forward[b.name] for b in cost.blocks) or 1.0
                notes.append(f"{fmt} timed on {times.device}: its 8-bit GEMMs and quantization "
                             f"passes change a forward pass of every block by "
                             f"{forward * 1e3:+.1f} ms ({100 * forward / base:+.0f} %).")
    if not machine.measured:
        notes.append(f"Times are estimates from {machine.name}'s published peak throughput "
                     "and copy bandwidth; vramkit.fit measures and compares after the first "
                     "steps.")
    if best.disk and disk_bytes_per_s is None:
        notes.append(f"The disk tier's reads are assumed at {DEFAULT_DISK_BYTES_PER_S / 1e9:.1f} "
                     "GB/s: pass disk_bytes_per_s= (vramkit info --disk PATH measures it; "
                     "vramkit.fit measures its checkpoint).")
    return Plan(
        mode=cost.mode, machine=machine.name, budget_bytes=budget, headroom_bytes=headroom,
        swapped=swapped, resident=resident,
        checkpointed=tuple(name for name in names if name in ckpt_set),
        num_slots=best.r if swapped else 0,
        swapped_format=best.swapped_format, resident_format=best.resident_format,
        activation_offload=best.offload,
        predicted_peak_bytes=sum(best.breakdown.values()),
        peak_breakdown=best.breakdown, forward=best.forward, backward=best.backward,
        optimizer_seconds=prices.optimizer, overhead_seconds=0.0,
        host_bytes=best.host, notes=tuple(notes), block_order=tuple(names),
        disk_blocks=tuple(names[i] for i in best.disk),
        swap_host_budget=best.swap_budget if best.disk else None,
        disk_bytes_per_s=disk_bw if best.disk else None,
        dequantize_together=best.together, checkpointing=checkpointing,
        compress_masters=best.compress,
        compressed_blocks=tuple(names[i] for i in best.compressed),
        host_breakdown=dict(best.host_parts), host_budget_bytes=host_budget,
        trainable="swap" if swap_trainable and swapped else "resident",
        optimizer_state_bytes=float(optimizer_state_bytes))


def _w8a8_refusal(fmt: str, machine: Machine, times: BlockTimes | None) -> str | None:
    """Why ``fmt`` (a W8A8 format) is not offered on ``machine``: the device measured lacks its
    GEMM, the profile has no 8-bit rate, or a measured machine's calibration did not time it
    (its speed would be a guess); ``None`` where it is offered (or not W8A8)."""
    if not is_w8a8(fmt):
        return None
    if times is not None and fmt in times.unavailable:
        return times.unavailable[fmt]
    if machine.measured and (times is None or not times.calls.get(fmt)):
        return (f"{fmt} is not offered: the calibration did not time it on this device "
                f"(calibrate_blocks(..., formats=('{fmt}',)) times it)")
    return unavailable_on_machine(fmt, machine)


#: How much longer a backward's copies take with ``trainable="swap"`` than the bytes over the
#: copy bandwidth, by state slots R: each refill of a slot waits for the write-back of the block
#: R places ahead, so with few slots the two copy directions take turns. Measured
#: (``benchmarks/swap_full_ft.py``, FLUX.1-dev full fine-tune under a 24 GB cap, 8-bit AdamW;
#: the step over its transfer bound, both directions at their duplex rates): 1.60x with 2
#: slots, 1.22x with 6, 1.01x with 8 and 1.00x with 10 on an H100; 1.06x and 1.056x with 8,
#: 1.01x and 0.97x with 10 on an H200 (8: the H200's, where the planner's figures are checked).
#: ``(slots, factor)`` points, linear between them, 1 from the last on.
SWAP_STATE_SLOWDOWN = ((2, 1.60), (6, 1.22), (8, 1.06), (10, 1.0))


def swap_state_factor(slots: int) -> float:
    """The factor on a swapped trainable block's backward copies with ``slots`` state slots
    (:data:`SWAP_STATE_SLOWDOWN`, interpolated; 2 slots at least)."""
    points = SWAP_STATE_SLOWDOWN
    if slots <= points[0][0]:
        return points[0][1]
    for (r0, f0), (r1, f1) in itertools.pairwise(points):
        if slots <= r1:
            return f0 + (f1 - f0) * (slots - r0) / (r1 - r0)
    return points[-1][1]


#: Plans within this share of the fastest one count as equally fast: among them the one with
#: the least machinery wins (fewer swapped blocks, less recomputation, no activation offload,
#: fewer slots, the formats as built).
EQUAL_TIME_SHARE = 1e-6


def _prefer_simple(candidates: list[Priced]) -> Priced | None:
    if not candidates:
        return None
    raw = [c.seconds for c in candidates if not c.compress]
    if raw:  # compressed masters must beat the fastest raw plan by the margin, not only
        # their own candidate's raw price (a raw plan with more room to spare may be faster)
        candidates = [c for c in candidates
                      if not c.compress or c.seconds <= min(raw) * (1 - MIN_GAIN)]
    fastest = min(c.seconds for c in candidates)
    near = [c for c in candidates if c.seconds <= fastest * (1 + EQUAL_TIME_SHARE)]
    return min(near, key=lambda c: (len(c.disk), c.k, c.m, c.offload, c.r, c.fmt_rank,
                                    c.together, c.seconds))


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
    shown_budget, shown_need = format_sizes_apart(budget, need)
    message = (f"a budget of {shown_budget} cannot hold this {cost.mode} step: the "
               f"smallest plan ({how}) needs a budget of {shown_need} (with the "
               "headroom kept free)")
    return PlanError(message, hint=f"Raise the budget to {shown_need} or more, or try "
                                   + "; or ".join(ideas) + ".", minimum_budget=need)
