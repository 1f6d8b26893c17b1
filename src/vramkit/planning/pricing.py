"""What the planner prices a candidate at: per block, the device's and the host's seconds of its
calls, and per candidate, its phases and its memory.

* :class:`BlockPrices`: one search's per-block figures. A block's call is measured where the
  calibration timed it (:class:`~vramkit.planning.calibration.BlockTimes`), else the time model
  of its counted work (:meth:`~vramkit.planning.machine.Machine.block_sides`); checkpointed, the
  lean checkpoint's measured call, else the call as built with one more forward in backward;
  beside the copy engine, the measured slowdown, else the machine's share; stored packed, the
  measured cost of dequantizing, else its memory traffic; stored W8A8, the measured change,
  else :func:`w8a8_change` (its frozen linears' GEMMs at the 8-bit rate, the quantization
  passes as memory traffic).
* :class:`StepPricer`: one candidate (:class:`Candidate`: which blocks swap, through how many
  slots, in which formats, how many checkpointed, with or without activation offload) priced
  into its phases (:func:`~vramkit.planning.simulation.simulate_phase`) and its peak
  (:class:`Priced`); ``None`` where its masters cannot be split between host and disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vramkit.offload._activation_settings import ActivationOffloadConfig
from vramkit.planning._compression import MIN_GAIN, compressed, compressed_subsets
from vramkit.planning.analysis import BlockCost, ModelCost
from vramkit.planning.calibration import CHECKPOINTED, FULL, BlockTimes, CallTimes, packed_variant
from vramkit.planning.machine import (
    DEVICE_SECONDS_PER_KERNEL,
    HOST_SECONDS_PER_KERNEL,
    MATMUL_FRACTION,
    MEMORY_FRACTION,
    SWAP_HOST_SECONDS,
    Machine,
)
from vramkit.planning.record import PhaseTime
from vramkit.planning.simulation import _simulate, _simulate_calls
from vramkit.planning.w8a8 import (
    DEQUANTIZE_BYTES,
    EXTRA_KERNELS,
    INT8_EPILOGUE_BYTES,
    QUANTIZE_BYTES,
    TRANSPOSE_BYTES,
    W8A8_FORMATS,
    LinearCall,
    backward_transient_bytes,
    is_w8a8,
)
from vramkit.quant.w8a8 import w8a8_fits

__all__ = ["BlockPrices", "Candidate", "Priced", "StepPricer", "staged_copy_rate", "w8a8_change"]

_OFFLOAD_DEFAULTS = ActivationOffloadConfig()  # what fit's offloader runs with
#: Activations an offloader holds on the device beyond the blocks' own: the forward's last
#: tensors still held while their copies run (``max_inflight_bytes``) and what backward has
#: already brought back ahead of use (``prefetch_bytes``).
OFFLOAD_INFLIGHT_BYTES = int(_OFFLOAD_DEFAULTS.max_inflight_bytes)
OFFLOAD_PREFETCH_BYTES = int(_OFFLOAD_DEFAULTS.prefetch_bytes)
OFFLOAD_WINDOW_BYTES = OFFLOAD_INFLIGHT_BYTES + OFFLOAD_PREFETCH_BYTES


#: Disk read bandwidth a disk tier is planned with when none is given: a SATA SSD or a cloud
#: volume; a virtio disk of the H100 machine read 1.28 GB/s
#: (``vramkit.io.disk.measure_read_bandwidth``, as ``benchmarks/swap_load.py`` prints it).
DEFAULT_DISK_BYTES_PER_S = 1.0e9


@dataclass(frozen=True)
class BlockPrices:
    """One search's per-block prices, each list in the blocks' order
    (:attr:`ModelCost.blocks`).

    Attributes:
        full: each block's call as built (device and host, forward and backward).
        as_checkpointed: each block's call checkpointed (its backward recomputes the forward).
        slow_forward / slow_backward: the share by which each block's compute is slower while
            the copy engine runs beside it.
        dequant: ``dequant[together][fmt]``: what storing each block in ``fmt`` adds to its
            calls, its layers dequantized each at its call (``together=False``) or all at the
            block's first call into one shared buffer (``True``). A W8A8 format dequantizes
            nothing (both ways alike): what its 8-bit GEMMs and quantization passes change,
            negative where they win.
        dense: ``dense[fmt]``: each block's weights dequantized from ``fmt`` (the shared
            buffer's size when they are dequantized together).
        ways: the ways of dequantizing weighed (``[False]``, plus ``True`` where the
            calibration timed both).
        measured: the blocks whose calls were timed (the others: the time model).
        outside_forward / outside_backward: the seconds of the work outside the blocks.
        optimizer: the optimizer step's seconds.
    """

    full: list[CallTimes]
    as_checkpointed: list[CallTimes]
    slow_forward: list[float]
    slow_backward: list[float]
    dequant: dict[bool, dict[str, list[CallTimes]]]
    dense: dict[str, list[int]]
    ways: list[bool]
    measured: frozenset[str]
    outside_forward: float
    outside_backward: float
    optimizer: float

    @classmethod
    def of(cls, cost: ModelCost, machine: Machine, times: BlockTimes | None,
           formats: Sequence[str]) -> BlockPrices:
        """The prices of ``cost``'s blocks on ``machine``, measured where ``times`` has them,
        in the storage ``formats`` the search weighs."""
        train = cost.mode == "train"
        n = len(cost.blocks)
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
        # Each block's call checkpointed: measured (the lean checkpoint's forward records no
        # graph, so its host side can cost less than the call as built; its backward recomputes
        # the forward first), else the call as built with one more forward in backward.
        as_checkpointed: list[CallTimes] = []
        for b, c in zip(cost.blocks, full, strict=True):
            timed = (times.call(b.name, CHECKPOINTED)
                     if times is not None and b.name in measured else None)
            as_checkpointed.append(timed if timed is not None else CallTimes(
                c.forward, c.backward + c.forward, c.host_forward,
                c.host_backward + c.host_forward))
        # How much slower each block's compute runs beside the copy engine: measured where the
        # calibration timed it (GPU), else the machine's share (a hardware profile's assumed
        # one; 0 on a measured machine, whose calibration times it).
        slow_fwd = [machine.copy_slowdown[0]] * n
        slow_bwd = [machine.copy_slowdown[1]] * n
        if times is not None:
            for i, b in enumerate(cost.blocks):
                if b.name in measured:
                    slow_fwd[i], slow_bwd[i] = times.copy_slowdown(b.name)
        optimizer = (4 * cost.trainable_bytes / machine.memory_bandwidth_bytes_per_s
                     if train else 0.0)
        if times is None:
            outside_fwd, outside_bwd = machine.block_seconds(
                cost.outside_forward_flops, cost.outside_backward_flops, cost.outside_work)
        else:  # at the throughput the timed blocks reached
            outside_fwd = cost.outside_forward_flops / flops
            outside_bwd = cost.outside_backward_flops / flops
        # What storing a block packed adds to its forward and backward calls: measured where
        # the calibration timed the format, else the memory traffic of dequantizing.
        # Two ways to run a packed block: each layer dequantizes its own weight at its call, or
        # (``together``) the block's first call dequantizes all of its layers into one buffer
        # shared by every packed block (vramkit.quant.dense): less host time, the largest
        # packed block's weights in memory. Weighed where the calibration timed both.
        ways = [False]
        if times is not None and any(times.calls.get(packed_variant(f, True)) for f in formats):
            ways.append(True)
        dequant_by: dict[bool, dict[str, list[CallTimes]]] = {}
        for together in ways:
            dequant_by[together] = {}
            for fmt in formats:
                dequant_by[together][fmt] = []
                for b in cost.blocks:
                    if is_w8a8(fmt):
                        dequant_by[together][fmt].append(_w8a8_extra(b, fmt, machine, times))
                        continue
                    extra = (times.extra(packed_variant(fmt, together), b.name)
                             if times is not None and fmt != "bf16" else None)
                    if extra is None:
                        modeled = _dequant(b, fmt, machine)
                        extra = CallTimes(modeled, modeled, 0.0, 0.0)
                    dequant_by[together][fmt].append(extra)
        dense_of = {fmt: [b.dense.get(fmt, 0) for b in cost.blocks] for fmt in formats}
        return cls(full=full, as_checkpointed=as_checkpointed, slow_forward=slow_fwd,
                   slow_backward=slow_bwd, dequant=dequant_by, dense=dense_of, ways=ways,
                   measured=frozenset(measured), outside_forward=outside_fwd,
                   outside_backward=outside_bwd, optimizer=optimizer)


@dataclass(frozen=True)
class Candidate:
    """One point of the search, as :meth:`StepPricer.price` takes it.

    Attributes:
        chosen: the indices of the swapped blocks; ``flags``: per block, whether it swaps.
        num_slots: R, the ring's slots.
        sizes: per block, the bytes a swap moves in the swapped format.
        copy_seconds: per block, its copy's seconds (0 for a resident block).
        master_bytes: the swapped blocks' masters (pinned host memory).
        weights / slot_bytes / scratch: device bytes of the resident weights, of the ring's
            slots, and of the shared buffer packed blocks dequantize into.
        dequant / per_layer: per block, what its format adds to its calls (the chosen way, and
            layer by layer: the backward of an un-checkpointed block dequantized together).
        swapped_format / resident_format: the formats of the swapped / resident blocks.
        together: the packed blocks' layers are dequantized together.
        checkpoints: how many blocks of the checkpoint order are checkpointed.
        offload: saved activations go to pinned host memory.
        trainable: device bytes of the trainable parameters, their gradients and optimizer
            state in this candidate (``None``: :attr:`StepPricer.trainable`, all resident);
            swapped trainable blocks (``trainable="swap"``) keep theirs in host memory.
        backward_copy_seconds / backward_copy_bytes: what each block's backward copies take
            when they differ from its forward copies (a swapped trainable block's optimizer
            state travels with its weights in backward and both are written back).
        backward_writeback_seconds: how long the backward's device->host writes take on the
            other copy engine (a swapped trainable block's updated weights and optimizer
            state, every step, at the device->host rate and the slots' slowdown): the backward
            takes at least that.
        host_state: pinned host bytes of the swapped blocks' optimizer state.
        decode_seconds: per block, the device seconds of decoding its compressed master after
            each copy (``None``: masters raw; ``copy_seconds`` are then the compressed
            bytes'): the phase simulation charges each decode to the compute it runs beside
            (:func:`~vramkit.planning.simulation.simulate_phase`).
    """

    chosen: list[int]
    flags: list[bool]
    num_slots: int
    sizes: list[int]
    copy_seconds: list[float]
    master_bytes: int
    weights: int
    slot_bytes: int
    scratch: int
    dequant: list[CallTimes]
    per_layer: list[CallTimes]
    swapped_format: str
    resident_format: str
    together: bool
    checkpoints: int
    offload: bool
    trainable: int | None = None
    backward_copy_seconds: list[float] | None = None
    backward_copy_bytes: int | None = None
    backward_writeback_seconds: float = 0.0
    host_state: int = 0
    decode_seconds: list[float] | None = None


@dataclass(frozen=True)
class Priced:
    """A candidate's prediction: the step's seconds, its phases, its peak by part, and what
    the search ranks it by.

    Attributes:
        seconds: forward + backward + optimizer (the swapper's host time is in the phases).
        k / m / r: swapped blocks, checkpointed blocks, slots.
        fmt_rank: the formats' places among those weighed (the ones as built first).
        checkpointed: the names of the checkpointed blocks.
        breakdown: the predicted peak by part, in bytes.
        host: pinned host bytes (masters on the host, offloaded activations).
        disk: the indices of the swapped blocks kept on disk; ``swap_budget`` the
            ``SwapConfig.host_budget`` that keeps them there (``None`` without a disk tier).
        compress: the swapped masters are compressed (``SwapConfig.compress``);
            ``compressed``: the indices of those compressed when only some are (empty: all).
        host_parts: ``host`` by part (``"masters"``, ``"offloaded_activations"``).
    """

    seconds: float
    k: int
    m: int
    r: int
    offload: bool
    fmt_rank: tuple[int, int]
    chosen: list[int]
    checkpointed: list[str]
    breakdown: dict[str, int]
    forward: PhaseTime
    backward: PhaseTime
    host: int
    swapped_format: str
    resident_format: str
    disk: tuple[int, ...]
    swap_budget: int | None
    together: bool
    compress: bool = False
    compressed: tuple[int, ...] = ()
    host_parts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPricer:
    """Prices candidates of one search (:meth:`price`).

    Attributes:
        cost / machine / prices: the model, the machine and its blocks' prices.
        order: the blocks in the order they are checkpointed.
        act_choices: the activation bytes with the first ``m`` of ``order`` checkpointed.
        trainable: bytes of the trainable parameters, their gradients and optimizer state.
        formats: the formats weighed, the ones as built first.
        host_budget: pinned host memory the swapped blocks and offloaded activations may take.
        disk_bytes_per_s: the disk tier's read bandwidth.
        compress_ratio / decode_bytes_per_s / compress_budget: compressed masters
            (:mod:`vramkit.planning._compression`): the bytes a master keeps, the device's
            decode rate and the device bytes a compressed candidate must fit in; any ``None``:
            not weighed.
        copy_bytes_per_s: the rate a swapped block's master reaches the device (``None``:
            the machine's pinned copy rate; pageable masters: :func:`staged_copy_rate`).
            Offloaded activations are pinned whatever the masters are: they keep the pinned
            rate.
    """

    cost: ModelCost
    machine: Machine
    prices: BlockPrices
    order: list[str]
    act_choices: list[int]
    trainable: int
    formats: list[str]
    host_budget: int | None
    disk_bytes_per_s: float
    compress_ratio: float | None = None
    decode_bytes_per_s: float | None = None
    compress_budget: int | None = None
    copy_bytes_per_s: float | None = None

    def price(self, candidate: Candidate) -> Priced | None:
        """``candidate``'s predicted phases and memory (``None``: its masters cannot be split
        between host and disk under ``host_budget``), with compressed masters -- all of the
        swapped blocks' or an even share of them, whichever prices fastest -- where that
        prices at least ``MIN_GAIN`` faster and fits (frozen swapped blocks in RAM only: a
        disk tier keeps raw masters)."""
        plain = self._price(candidate)
        ratio, rate, room = self.compress_ratio, self.decode_bytes_per_s, self.compress_budget
        if (plain is None or plain.disk or not candidate.chosen or ratio is None
                or rate is None or room is None or candidate.swapped_format != "bf16"):
            return plain
        best = plain
        for which in compressed_subsets(candidate):
            variant, scratch = compressed(candidate, ratio, rate, which)
            packed = self._price(variant)
            if packed is None or packed.disk:
                continue
            breakdown = {**packed.breakdown, "compress_scratch": scratch}
            if (sum(breakdown.values()) > room
                    or packed.seconds > plain.seconds * (1 - MIN_GAIN)
                    or packed.seconds >= best.seconds):
                continue
            best = replace(packed, breakdown=breakdown, compress=True,
                           compressed=() if which is None else tuple(which))
        return best

    def _price(self, candidate: Candidate) -> Priced | None:
        c, p, cost = candidate, self.prices, self.cost
        train = cost.mode == "train"
        estimate = cost.activations
        pinned_bw, disk_bw = self.machine.h2d_bytes_per_s, self.disk_bytes_per_s
        bw = self.copy_bytes_per_s or pinned_bw  # the swapped blocks' masters
        k, r, m, offload, chosen, sizes = (len(c.chosen), c.num_slots, c.checkpoints,
                                           c.offload, c.chosen, c.sizes)
        ckpt = self.order[:m]
        act = self.act_choices[m] if not offload else _offloaded(estimate, train)
        offload_bytes = _offload_bytes(estimate, ckpt) if offload else 0
        host = c.master_bytes + offload_bytes
        disk: tuple[int, ...] = ()
        swap_budget = None
        phase_copy_s = c.copy_seconds
        if c.host_state and self.host_budget is not None and (
                host + c.host_state > self.host_budget):
            return None  # trainable masters and their state never go to the disk tier
        if self.host_budget is not None and host > self.host_budget:
            swap_budget = self.host_budget - offload_bytes
            split = _disk_split([sizes[i] for i in chosen], swap_budget)
            if split is None:
                return None
            disk = tuple(chosen[j] for j in split.on_disk)
            host = split.pinned + offload_bytes
            phase_copy_s = list(c.copy_seconds)
            for i in disk:  # read from disk, then copied: the slower one paces it
                phase_copy_s[i] = sizes[i] / min(bw, disk_bw)
        host += c.host_state
        copies = int(c.master_bytes * max(0, k - r) / k) if k else 0
        ckpt_set = set(ckpt)
        decodes = c.decode_seconds
        sides = _block_sides(p.full, p.as_checkpointed, c.dequant, c.per_layer, c.flags,
                             [b.name in ckpt_set for b in cost.blocks], c.together)
        if train:
            fwd_time, fwd_lost = _simulate(sides[0], phase_copy_s, c.flags, r, None, sides[1],
                                           p.slow_forward, decodes)
        else:  # back-to-back calls: the ring wraps around to the next call's first blocks
            fwd_time, fwd_lost = _simulate_calls(sides[0], phase_copy_s, c.flags, r, sides[1],
                                                 p.slow_forward, decodes)
        fwd_time += p.outside_forward
        if offload:  # device->host copies run on the other engine
            fwd_time = max(fwd_time, offload_bytes / self.machine.d2h_bytes_per_s)
        # Copy engine time: disk blocks are paced by the disk (the same share of them as of
        # all swapped blocks is copied in a phase). Training keeps the last slots' blocks
        # across the turn and the first ones between steps; inference copies every swapped
        # block once a call unless all of them have a slot.
        share = max(0, k - r) / k if k else 0.0
        if not train and k > r:
            share = 1.0
            copies = c.master_bytes
        copy_time = copies / bw + share * sum(
            sizes[i] * (1 / min(bw, disk_bw) - 1 / bw) for i in disk)
        fwd = PhaseTime(fwd_time, p.outside_forward + sum(sides[0]), copy_time,
                        copies, p.outside_forward + sum(sides[1]), fwd_lost)
        if train:
            restores = ([_kept_bytes(estimate, b.name, ckpt_set) / pinned_bw
                         for b in cost.blocks] if offload else None)
            back_copy_s, back_copy_time, back_copies = phase_copy_s, copy_time, copies
            if c.backward_copy_seconds is not None:
                back_copy_s = c.backward_copy_seconds
                back_copy_time = share * sum(back_copy_s[i] for i in chosen)
                back_copies = int(share * (c.backward_copy_bytes or 0))
            back, bwd_lost = _simulate(sides[2][::-1], back_copy_s[::-1], c.flags[::-1], r,
                                       restores[::-1] if restores else None,
                                       sides[3][::-1], p.slow_backward[::-1],
                                       decodes[::-1] if decodes is not None else None)
            # the write-backs pace a backward that would outrun them
            back = max(back, c.backward_writeback_seconds)
            bwd = PhaseTime(p.outside_backward + back, p.outside_backward + sum(sides[2]),
                            back_copy_time + offload_bytes / pinned_bw,
                            back_copies + offload_bytes,
                            p.outside_backward + sum(sides[3]), bwd_lost)
        else:
            bwd = PhaseTime(0.0, 0.0, 0.0, 0)
        # the swapper's host time: in the phases
        seconds = fwd.seconds + bwd.seconds + p.optimizer
        trainable = self.trainable if c.trainable is None else c.trainable
        breakdown = {"resident_weights": c.weights, "swap_slots": c.slot_bytes,
                     "trainable_and_optimizer": trainable, "activations": act}
        if c.scratch:
            breakdown["dequantized_weights"] = c.scratch
        if train and (is_w8a8(c.swapped_format) or is_w8a8(c.resident_format)):
            # a W8A8 backward's transposed weight and gradient codes, one layer at a time
            w8a8 = max((backward_transient_bytes(b.linear_calls, c.swapped_format
                                                 if c.flags[i] else c.resident_format)
                        for i, b in enumerate(cost.blocks)), default=0)
            if w8a8:
                breakdown["w8a8_backward_copies"] = w8a8
        return Priced(
            seconds=seconds, k=k, m=m, r=r, offload=offload,
            fmt_rank=(self.formats.index(c.swapped_format),
                      self.formats.index(c.resident_format)),
            chosen=chosen, checkpointed=ckpt, breakdown=breakdown, forward=fwd, backward=bwd,
            host=host, swapped_format=c.swapped_format, resident_format=c.resident_format,
            disk=disk, swap_budget=swap_budget, together=c.together,
            host_parts={k: v for k, v in (("masters", host - offload_bytes - c.host_state),
                                          ("offloaded_activations", offload_bytes),
                                          ("optimizer_state", c.host_state)) if v})


def staged_copy_rate(pinned_bytes_per_s: float, memcpy_bytes_per_s: float) -> float:
    """The rate pageable masters reach the device (``SwapConfig(host_memory="pageable")``):
    each chunk is copied pageable->pinned by the host (``memcpy_bytes_per_s``) while the chunk
    before it goes pinned->device (``pinned_bytes_per_s``); the two overlap through the staging
    pool's chunks, so the slower of them paces the copy."""
    return min(pinned_bytes_per_s, memcpy_bytes_per_s)


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
        # a W8A8 format's change may be negative (faster GEMMs), never below nothing
        fwd_dev.append(max(0.0, call.forward + d.forward))
        fwd_host.append(max(0.0, call.host_forward + d.host_forward) + swap_host)
        bwd_dev.append(max(0.0, call.backward + back.backward + (d.forward if k else 0.0)))
        bwd_host.append(max(0.0, call.host_backward + back.host_backward
                            + (d.host_forward if k else 0.0)) + swap_host)
    return fwd_dev, fwd_host, bwd_dev, bwd_host


def _offloaded(estimate: Any, train: bool) -> int:
    """Activations on the device with offload on, at the largest of three moments:

    * the turn of the step: the tail (a language model's logits) with the forward's last
      tensors still held -- backward has prefetched nothing yet (counting the whole window
      there put Llama-8B's 7.5 GiB plan 0.5 GiB above its measured peak, one slot short: R=1,
      2.0x the resident step);
    * the start of backward: those held tensors, the prefetched ones, and the last block
      rebuilt by its recomputation with its temporaries (:func:`recompute_peak`);
    * later in backward: the held tensors are used up (the first blocks of backward take them),
      so the prefetched ones and the block being recomputed with its temporaries. (Counting the
      held tensors here too put every FLUX offload plan ~256 MiB above its measured peak; a
      snapshot of the 7.5 GiB row's peak held the prefetched tensors, 285 MB, and a double
      block's recomputation and temporaries, nothing of the forward's.)"""
    if not train:
        return max(estimate.largest_block, estimate.tail)
    names = list(estimate.per_block)
    largest = max((recompute_peak(estimate, n) for n in names), default=0)
    last = recompute_peak(estimate, names[-1]) if names else 0  # backward's first
    backward = max(OFFLOAD_PREFETCH_BYTES + largest, OFFLOAD_WINDOW_BYTES + last)
    return estimate.outside + max(backward, OFFLOAD_INFLIGHT_BYTES + estimate.tail)


def recompute_peak(estimate: Any, name: str) -> int:
    """What block ``name`` holds at once while backward rebuilds and differentiates it, its
    inputs brought back: the most of its recomputed forward (inputs + what it makes while it
    runs, :attr:`~vramkit.planning.activations.ActivationEstimate.transient`) and of its
    backward (:attr:`~vramkit.planning.activations.ActivationEstimate.backward_peak`), as the
    meta step followed them; where the backward was not followed, twice what it saves (its
    saved tensors and temporaries of their order).

    At long sequences the followed figure is what a plan fits or not: Wan 2.1 14B at
    480x832 x 81 frames saves 7.4 GiB a block and holds 10.9 GiB at once while it is
    recomputed, where twice its saved bytes read 14.9 GiB."""
    if name in estimate.backward_peak:
        return int(max(estimate.inputs[name] + estimate.transient.get(name, 0),
                       estimate.backward_peak[name]))
    return 2 * int(estimate.per_block[name])


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


def _w8a8_extra(block: BlockCost, fmt: str, machine: Machine, times: BlockTimes | None
                ) -> CallTimes:
    """What storing a block in a W8A8 format changes in its call: measured where the
    calibration timed it (the difference may be negative: the 8-bit GEMMs can be faster),
    else the offline model (:func:`~vramkit.planning.w8a8.w8a8_change`), else nothing (a block
    the calibration could not run keeps its FLOP-based time either way)."""
    timed = (times.extra(packed_variant(fmt), block.name, signed=True)
             if times is not None else None)
    if timed is not None:
        return timed
    modeled = w8a8_change(block.linear_calls, fmt, machine)
    return modeled if modeled is not None else CallTimes(0.0, 0.0, 0.0, 0.0)


def w8a8_change(calls: Sequence[LinearCall], fmt: str, machine: Machine) -> CallTimes | None:
    """What storing a block in ``fmt`` changes in its call by the offline time model, device
    and host side apart, forward and backward (negative where the 8-bit GEMMs win), from the
    frozen linears' ``calls`` (:attr:`~vramkit.planning.analysis.BlockCost.linear_calls`).

    Per call that the 8-bit GEMMs take (:func:`~vramkit.quant.w8a8.w8a8_fits`): the forward
    GEMM and, with ``input_grad``, the backward's input-gradient GEMM run at the machine's
    8-bit rate instead of bf16 (a frozen layer has no weight-gradient GEMM either way); the
    forward quantizes its input (:data:`~vramkit.planning.w8a8.QUANTIZE_BYTES` per element), the backward its gradient
    and makes one transposed copy of the weight (:data:`TRANSPOSE_BYTES` per weight element);
    int8 adds its epilogue (:data:`INT8_EPILOGUE_BYTES` per output element); each adds
    :data:`EXTRA_KERNELS`. A call the GEMMs cannot take dequantizes its weight
    (:data:`DEQUANTIZE_BYTES`), as weight-only storage does.

    Returns:
        The change, or ``None`` where the machine has no peak throughput or no 8-bit rate
        (a measured machine: its calibration times the format).
    """
    kind = W8A8_FORMATS[fmt]
    peak = machine.peak_flops_per_s
    rate = machine.fp8_gemm_flops_per_s if kind == "fp8" else machine.int8_gemm_flops_per_s
    if peak is None or rate is None:
        return None
    epilogue = INT8_EPILOGUE_BYTES if kind == "int8" else 0
    extra_fwd, extra_bwd = EXTRA_KERNELS[kind]
    flops = [0.0, 0.0]
    moved = [0.0, 0.0]
    kernels = [0, 0]
    for c in calls:
        m, k, n = c.rows, c.in_features, c.out_features
        phases = (0, 1) if c.input_grad else (0,)
        if not w8a8_fits(kind, k, n):
            for p in phases:
                moved[p] += DEQUANTIZE_BYTES * n * k
                kernels[p] += 1
            continue
        flops[0] += 2.0 * m * k * n
        moved[0] += QUANTIZE_BYTES * m * k + epilogue * m * n
        kernels[0] += extra_fwd
        if c.input_grad:
            flops[1] += 2.0 * m * k * n
            moved[1] += QUANTIZE_BYTES * m * n + TRANSPOSE_BYTES * n * k + epilogue * m * k
            kernels[1] += extra_bwd
    bandwidth = machine.memory_bandwidth_bytes_per_s * MEMORY_FRACTION
    device = [f * (1 / (rate * MATMUL_FRACTION) - 1 / (peak * MATMUL_FRACTION))
              + b / bandwidth + n * DEVICE_SECONDS_PER_KERNEL
              for f, b, n in zip(flops, moved, kernels, strict=True)]
    host = [n * HOST_SECONDS_PER_KERNEL for n in kernels]
    return CallTimes(device[0], device[1], host[0], host[1])


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

