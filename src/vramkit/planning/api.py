"""``vramkit.plan``: choose swapping, slots, checkpointing, storage formats and activation offload
for a model, its inputs and a memory budget, at the best predicted speed, before anything runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from vramkit._validate import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_number,
    check_size,
)
from vramkit.devices.host import HOST_MEMORY_MODES, HostMemoryChoice, choose_host_memory
from vramkit.errors import ConfigError, PlanError
from vramkit.offload.blocks import find_blocks, module_bytes, split_blocks
from vramkit.offload.swap import SwapConfig
from vramkit.offload.swap.staged import (
    measure_memcpy_bytes_per_s,
    measure_staged_bytes_per_s,
    staging_layout,
)
from vramkit.planning._compression import expected_ratio
from vramkit.planning.analysis import FORMATS, ModelCost, analyze, check_model, meta_copy
from vramkit.planning.calibration import BlockTimes, calibrate_blocks
from vramkit.planning.hardware import (
    PAGEABLE_MEMCPY_BYTES_PER_S,
    PAGEABLE_MEMCPY_SOURCE,
    HardwareProfile,
)
from vramkit.planning.machine import Machine, machine_for
from vramkit.planning.planner import search
from vramkit.planning.pricing import staged_copy_rate
from vramkit.planning.record import ADAMW_STATE_BYTES, CHECKPOINTING, Plan
from vramkit.units import format_size, format_sizes_apart

__all__ = ["DEFAULT_HEADROOM", "DEFAULT_OFFLINE_HARDWARE", "DEFAULT_SLOTS",
           "SWAP_TRAINABLE_SLOTS", "TRAINABLE_MODES", "plan", "resolve_headroom"]

#: Ring sizes a plan weighs by default.
DEFAULT_SLOTS = (1, 2, 3)
#: ... with ``trainable="swap"``: the optimizer-state slots overlap the write-backs only with
#: several (1.60x the transfer bound with 2, 1.22x with 6, 1.0x from 10:
#: ``planner.SWAP_STATE_SLOWDOWN``): up to 12 are weighed where they fit.
SWAP_TRAINABLE_SLOTS = (2, 3, 4, 6, 8, 10, 12)
#: Where trainable parameters live (``plan(trainable=)``).
TRAINABLE_MODES = ("resident", "swap")

#: The GPU a plan is made for when no ``hardware=`` is given and PyTorch sees no GPU (the CLI's
#: default too).
DEFAULT_OFFLINE_HARDWARE = "rtx4090"

logger = logging.getLogger(__name__)

#: Kept free of the budget by default: the allocator's rounding and fragmentation, cuBLAS and
#: attention workspaces, and what the meta-device estimate does not see (a share of the
#: budget) plus a fixed part for the CUDA libraries' own buffers.
DEFAULT_HEADROOM = (0.08, 256 << 20)


def resolve_headroom(budget: int, headroom: int | str | float | None) -> int:
    """Bytes kept free: ``None`` = the default (8 % of the budget + 256 MiB), a fraction in
    [0, 1) (a float), or a size (an int of bytes, or a string such as ``"2GiB"``).

    Raises:
        ConfigError: for a float of 1 or more: neither a fraction nor a size anyone means
            (``2.0`` would keep two bytes free).
    """
    if headroom is None:
        share, fixed = DEFAULT_HEADROOM
        return int(budget * share) + fixed
    if isinstance(headroom, float):
        if headroom >= 1:
            raise ConfigError(f"headroom={headroom!r} is ambiguous: a float is a fraction of "
                              "the budget, below 1",
                              hint="Pass a fraction such as headroom=0.1, or a size: "
                                   "headroom='2GiB' (or an int of bytes).")
        return int(budget * check_number("headroom", headroom, minimum=0, maximum=1,
                                         high_open=True))
    return int(check_size("headroom", headroom))


def check_budget_fits(budget: int, machine: Machine) -> None:
    """Refuse a budget above the memory of the machine planned for (its size rounded up to a
    whole GiB): a plan "on rtx4090" for 48 GiB predicts a peak no 24 GiB card holds.

    Raises:
        ConfigError: naming both sizes.
    """
    memory = machine.memory_bytes
    # Up to the card's size in whole GiB: an RTX 4090 is sold as 24 GB and reports 23.99 GiB,
    # and a budget of "24GiB" is what its users write.
    if memory is not None and budget > -(-memory // (1 << 30)) * (1 << 30):
        shown_memory, shown_budget = format_size(memory), format_size(budget)
        if shown_memory == shown_budget:
            shown_memory, shown_budget = format_sizes_apart(memory, budget)
        raise ConfigError(f"budget={shown_budget} is more than the {shown_memory} of memory "
                          f"{machine.name} has",
                          hint=f"Plan for that card's memory or less (budget="
                               f"{format_size(memory, rounding='down')} or a cap below), or "
                               "for a GPU with more memory (vramkit.planning.PROFILES, vramkit "
                               "plan --list).")


def plan(model: nn.Module, example_inputs: Any, budget: int | str, *, mode: str = "train",
         hardware: str | HardwareProfile | Machine | None = None,
         allow_formats: Sequence[str] = (), host_budget: int | str | None = None,
         headroom: int | str | float | None = None,
         step: Callable[[nn.Module, Any], torch.Tensor] | None = None,
         blocks: str | Sequence[str] = "auto", num_slots: Sequence[int] | None = None,
         activation_offload: bool = True, autocast: torch.dtype | None = torch.bfloat16,
         cost: ModelCost | None = None, block_times: BlockTimes | None = None,
         device: str | torch.device | None = None, reserved_bytes: int | str = 0,
         disk_bytes_per_s: float | None = None, checkpointing: str = "auto",
         host_memory: str = "auto", staging_pool: int | str = "2GiB",
         compile: str | None = None, trainable: str = "resident", ffn_chunks: int = 1,
         compress: str = "auto", subblock_checkpoint: bool | str = "auto",
         optimizer_state_bytes: float | None = None) -> Plan:
    """Plan a model's memory for a budget at the best predicted step time.

    Nothing is allocated or computed: the model runs on the meta device (a meta copy of a real
    model is made without copying data). The plan chooses which blocks swap and how many ring
    slots, which blocks are checkpointed (any subset, not only all or none), the storage format
    of the swapped and the resident blocks' frozen weights among ``allow_formats``, and
    activation offload; see :mod:`vramkit.planning.planner` for the model of time and memory.

    Args:
        model: the model (meta or real), with its trainable parameters marked (LoRA adapters
            added, the base frozen).
        example_inputs: a tuple of positional arguments or a dict of keyword arguments for the
            model's forward (meta tensors are enough), at the batch and resolution to plan for.
        budget: device memory the step may use (``"12GiB"``, bytes): a card's size, or the cap
            ``torch.cuda.set_per_process_memory_fraction`` enforces.
        mode: ``"train"`` (forward, backward, AdamW on the trainable parameters) or
            ``"infer"`` (forward under no_grad).
        hardware: a GPU name (``"rtx4090"``, ``"h100-pcie"``, see
            :data:`vramkit.planning.PROFILES`) to plan offline from its published figures; a
            :class:`HardwareProfile` or :class:`Machine`; ``None`` (default) measures this
            machine's GPU: its copy bandwidth, and the compute time of one block of each kind
            (:func:`~vramkit.planning.calibration.calibrate_blocks`); with no GPU in sight it
            plans offline for :data:`DEFAULT_OFFLINE_HARDWARE`, said in the plan's notes.
        allow_formats: packed storage the plan may use for frozen weights: ``"fp8"``,
            ``"int8"``, ``"nf4"``, ``"int4"`` (default none: the weights as built), and W8A8
            (``"fp8-w8a8"``, ``"int8-w8a8"``: the same bytes as fp8 / int8, the frozen
            linears' forward and input gradient as 8-bit GEMMs, activations quantized too:
            :mod:`vramkit.planning.w8a8`). A W8A8 format the GPU cannot run (fp8 below
            capability 8.9, int8 below 8.0; a profile without the 8-bit rate) is not offered,
            and the plan's notes say why.
        host_budget: pinned host memory the swapped blocks (and offloaded activations) may
            take (default: no limit). Where the swapped blocks' masters do not fit, the plan
            keeps some on disk (``Plan.disk_blocks``: the swapper's disk tier, frozen weights
            only) and predicts their reads at ``disk_bytes_per_s``.
        headroom: bytes of the budget kept free: a size, a fraction, or ``None`` (8 % + 256 MiB).
        step: ``step(model, inputs) -> loss`` (default: the mean of the float outputs).
        blocks: ``"auto"`` or block names (:func:`vramkit.offload.blocks.find_blocks`). With
            ``"auto"`` an inference plan that swaps is also made with the blocks split into
            their children (smaller ring slots), and taken where whole blocks do not fit or
            it is :data:`SPLIT_GAIN` faster (``Plan.split``); named blocks are kept as named.
        num_slots: ring sizes to consider (default 1, 2, 3; with ``trainable="swap"``
            2, 3, 4, 6, 8, 10, 12: the state slots overlap the write-backs,
            :data:`SWAP_TRAINABLE_SLOTS`).
        activation_offload: consider offloading saved activations (default ``True``).
        autocast: the dtype of autocast during the step (default bf16; ``None``: none).
        cost: a :class:`~vramkit.planning.analysis.ModelCost` from an earlier :func:`analyze` of
            the same model and inputs (skips the meta-device pass).
        block_times: measured block times from an earlier
            :func:`~vramkit.planning.calibration.calibrate_blocks` (used with any
            ``hardware``; with ``None`` they skip the timing runs).
        device: the GPU ``hardware=None`` measures (default: the current CUDA device).
        disk_bytes_per_s: the read bandwidth of the disk a disk tier reads from (default 1 GB/s,
            said in the plan's notes; ``vramkit info --disk PATH`` measures it, and
            :func:`vramkit.fit` measures its ``checkpoint``).
        reserved_bytes: device memory something else holds during the step, on top of the
            headroom: DDP's gradient buckets in a data-parallel job
            (:func:`vramkit.distributed.plan_for_rank` passes them). Default 0.
        checkpointing: ``"auto"`` (default: the planner checkpoints the fewest blocks that
            let the fastest candidate fit), ``"all"`` (every block, as trainers do at these
            sizes: the planner chooses the rest around it) or ``"none"`` (training only).
        host_memory: where the swapped masters live, as ``SwapConfig.host_memory``:
            ``"pinned"``, ``"pageable"`` (copied through a pinned staging pool of
            ``staging_pool`` bytes, priced at the slower of the host's memcpy and the pinned
            copy: :func:`~vramkit.planning.pricing.staged_copy_rate`) or ``"auto"`` (default:
            :func:`vramkit.devices.host.choose_host_memory` for the plan's masters on this
            host; offline, for a named GPU, only the platform decides: pageable on Windows and
            WSL). The choice and its reason are in ``Plan.host_memory`` and ``explain()``.
        staging_pool: the staging pool's pinned bytes with pageable masters (default 2 GiB).
        compress: ``"auto"`` (default): weigh losslessly compressed masters
            (``SwapConfig.compress``) where a decode rate is known; ``"off"``: never (masters
            in node-shared memory, which :func:`vramkit.distributed.fit_rank` plans for, are
            never compressed).
        compile: the ``torch.compile`` mode the blocks will run compiled in
            (:data:`~vramkit.offload.compiled.COMPILE_MODES`; ``vramkit.fit(...,
            compile=...)`` passes its own): a measured machine times its blocks compiled. An
            offline plan prices them as eager (the profiles state no compiled speedup), and
            its notes say so. ``None`` (default): eager.

        trainable: ``"resident"`` (default: trainable parameters, gradients and AdamW state
            on the device) or ``"swap"`` (full fine-tuning of swapped blocks:
            ``SwapConfig(trainable="swap")``, their AdamW state in pinned host memory, stepped
            on the GPU in backward through ``num_slots`` state slots; training only; counted in
            ``Plan.host_breakdown["optimizer_state"]``; :func:`vramkit.fit` then needs
            ``optimizer=`` a factory).
        optimizer_state_bytes: bytes of optimizer state per trainable parameter: on the device
            for ``trainable="resident"``, moved and held in host memory per swapped block for
            ``"swap"``. Default (``None``): AdamW's two fp32 moments (8); an 8-bit AdamW keeps
            about 2, AdamW over bf16 parameters 4. :func:`vramkit.fit` measures it from its
            ``optimizer=`` factory for ``trainable="swap"``.
        ffn_chunks: run each block's feed-forward layer (``ffn``, ``ff``, ``mlp``) over this
            many slices of its tokens, each recomputed in backward
            (:func:`vramkit.offload.chunked.chunk_feed_forwards`): at long sequences (video)
            the MLP's wide temporaries then exist for one slice at a time, for one more MLP
            forward in backward. Analyzed (and calibrated) that way; :func:`vramkit.fit`
            applies it. Default 1: as built.
        subblock_checkpoint: checkpoint each block's parts (its attentions and feed-forward
            layer, :func:`vramkit.offload.subblock.checkpoint_block_parts`) on their own, so a
            checkpointed block's backward rebuilds one part at a time (at long sequences the
            whole block's recomputation sets the peak: Wan 2.1 14B at 81 frames, 10.9 -> 6.3
            GiB a block), for one more forward of each part in backward. ``True``: analyzed
            that way (a ``cost=`` given must come from the model with its parts checkpointed);
            ``False``: never; ``"auto"`` (default): training plans that fit nowhere as built
            are planned again with it, taken where they fit (``Plan.subblock_checkpoint``;
            not with ``cost=``); other plans are unchanged. :func:`vramkit.fit` applies it.

    Returns:
        The :class:`~vramkit.planning.record.Plan`.

    Raises:
        PlanError: when no plan fits; the message names the smallest budget that would, and
            what would make it fit.
        ConfigError: for bad arguments, a budget above the memory of ``hardware`` (or of the
            GPU measured), or a model whose step cannot run on meta tensors.
        DeviceError: for ``hardware=None`` with ``device=`` a CUDA device PyTorch cannot see.
    """
    check_model(model)
    check_choice("mode", mode, ("train", "infer"))
    check_choice("checkpointing", checkpointing, CHECKPOINTING)
    if compile is not None:
        from vramkit.offload.compiled import COMPILE_MODES

        check_choice("compile", compile, COMPILE_MODES)
    check_choice("trainable", trainable, TRAINABLE_MODES)
    state_per_param = (ADAMW_STATE_BYTES if optimizer_state_bytes is None else
                       check_number("optimizer_state_bytes", optimizer_state_bytes, minimum=0))
    ffn_chunks = check_int("ffn_chunks", ffn_chunks, minimum=1)
    if subblock_checkpoint != "auto":
        check_bool("subblock_checkpoint", subblock_checkpoint,
                   hint="Pass True, False or 'auto' (the default).")
    if subblock_checkpoint is True and mode != "train":
        raise ConfigError("subblock_checkpoint=True applies to training: inference keeps no "
                          "activations for a backward",
                          hint="Leave subblock_checkpoint='auto' with mode='infer'.")
    use_parts = subblock_checkpoint is True  # read by the closures below at each call
    if trainable == "swap" and mode != "train":
        raise ConfigError("trainable='swap' steps an optimizer in backward: training only",
                          hint="Leave trainable='resident' with mode='infer'.")
    if num_slots is None:
        num_slots = SWAP_TRAINABLE_SLOTS if trainable == "swap" else DEFAULT_SLOTS
    if mode == "infer" and checkpointing != "auto":
        raise ConfigError(f"checkpointing={checkpointing!r} applies to training: inference "
                          "keeps no activations for a backward",
                          hint="Leave checkpointing='auto' with mode='infer'.")
    budget_bytes = check_size("budget", budget, minimum=1)
    host = check_size("host_budget", host_budget, allow_none=True)
    check_bool("activation_offload", activation_offload)
    if isinstance(allow_formats, str):
        allow_formats = (allow_formats,)
    for fmt in allow_formats:
        check_choice("allow_formats", fmt, FORMATS)
    slots = tuple(num_slots)
    if not slots:
        raise ConfigError("num_slots is empty", hint="Pass num_slots=(1, 2, 3) (the default).")
    for r in slots:
        check_int("num_slots", r, minimum=1)
    extra = check_size("reserved_bytes", reserved_bytes)
    disk_rate = check_number("disk_bytes_per_s", disk_bytes_per_s, minimum=0, low_open=True,
                             allow_none=True,
                             hint="Give the disk's read bandwidth in bytes per second, e.g. "
                                  "2e9 for 2 GB/s (vramkit info --disk PATH measures it).")
    check_choice("host_memory", host_memory, HOST_MEMORY_MODES)
    check_choice("compress", compress, ("auto", "off"))
    pool_bytes = check_size("staging_pool", staging_pool, minimum=1024)
    kept = resolve_headroom(budget_bytes, headroom)
    reserved = kept + extra
    if kept >= budget_bytes and headroom is not None:  # the default: PlanError below
        raise ConfigError(f"headroom {kept} bytes leaves nothing of the "
                          f"{budget_bytes}-byte budget",
                          hint="Lower headroom= (a fraction such as 0.05, or a size).")
    target = check_device("device", device, types=("cuda",), allow_none=True)
    offline_note = None
    if hardware is None and target is None and not torch.cuda.is_available():
        # As `vramkit plan` does: a machine with no GPU plans for a stated one, and says so.
        hardware = DEFAULT_OFFLINE_HARDWARE
        offline_note = (f"PyTorch sees no GPU here: planned offline for {hardware} "
                        "(hardware= names another GPU).")
    machine = machine_for(hardware, target)
    check_budget_fits(budget_bytes, machine)
    def budget_for(need: int) -> int:
        """The smallest budget whose room after this headroom rule holds ``need`` bytes."""
        low, high = need, max(need, 1) * 4 + (1 << 30)
        while low < high:
            mid = (low + high) // 2
            if mid - resolve_headroom(mid, headroom) - extra >= need:
                high = mid
            else:
                low = mid + 1
        return low

    @functools.cache
    def on_meta_with(parts: bool) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
        """The model on the meta device and its blocks there (their parts checkpointed with
        ``parts``): made once, on first need, for every analysis and calibration of this call
        (a copy of a large model takes seconds)."""
        meta = meta_copy(model)
        if (ffn_chunks > 1 or parts) and meta is model:  # a meta model is its own copy
            meta = copy.deepcopy(model)
        found = find_blocks(meta, blocks)
        if ffn_chunks > 1:
            from vramkit.offload.chunked import chunk_feed_forwards

            chunk_feed_forwards(meta, [name for name, _ in found], ffn_chunks)
        if parts:
            from vramkit.offload.subblock import checkpoint_block_parts

            checkpoint_block_parts(meta, [name for name, _ in found])
        return meta, found

    def on_meta() -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
        return on_meta_with(use_parts)

    rule = SwapConfig(trainable="swap") if trainable == "swap" else None

    def analyzed(units: list[tuple[str, nn.Module]]) -> ModelCost:
        with _no_collection(ffn_chunks > 1 or use_parts):
            return analyze(on_meta()[0], example_inputs, mode=mode, step=step, found=units,
                           formats=("bf16", *allow_formats), autocast=autocast,
                           swap_config=rule)

    def ratio_of(units: list[tuple[str, nn.Module]] | None) -> float | None:
        """What compressed masters of these blocks would keep (``None``: the model's frozen
        tensors, whose dtypes the blocks share, read without finding the blocks again)."""
        return expected_ratio([("", model)] if units is None else units)

    def planned(units: list[tuple[str, nn.Module]] | None, cost: ModelCost,
                block_times: BlockTimes | None) -> Plan:
        """The plan of ``cost``, calibrating ``units`` first where the machine is measured
        (``None``: the blocks of ``blocks``)."""
        if block_times is None and hardware is None:
            key = None if units is None else tuple(name for name, _ in units)
            if key not in calibrated:  # planned again for pageable masters: timed once
                meta, whole = on_meta()
                calibrated[key] = calibrate_blocks(meta, example_inputs, mode=mode, step=step,
                                                   found=whole if units is None else units,
                                                   autocast=autocast, device=target,
                                                   formats=allow_formats, compile=compile)
            block_times = calibrated[key]
        if block_times is not None:
            timed_compiled.append(block_times.compiled)
        if block_times is not None:
            missing = [b.name for b in cost.blocks if b.name not in block_times.forward]
            if missing:
                raise ConfigError(f"block_times has no time for {len(missing)} block(s) of "
                                  f"the model ({missing[:3]}...)",
                                  hint="Calibrate the same model with the same blocks=, or "
                                       "leave block_times=None.")
        return search(cost, machine, budget_bytes, reserved, allow_formats=allow_formats,
                      num_slots=slots, activation_offload=activation_offload,
                      host_budget=host, budget_for=budget_for, times=block_times,
                      disk_bytes_per_s=disk_rate, checkpointing=checkpointing,
                      copy_bytes_per_s=copy_rate[0],
                      compress_ratio=ratio_of(units) if compress == "auto" else None,
                      trainable_mode=trainable, optimizer_state_bytes=state_per_param)

    timed_compiled: list[str | None] = []  # the compile mode of the times each plan used
    may_split = (mode == "infer" and isinstance(blocks, str) and blocks == "auto"
                 and cost is None and block_times is None)
    given_cost = cost
    if cost is None:
        cost = analyzed(on_meta()[1])
    elif cost.mode != mode:
        raise ConfigError(f"cost= was analyzed for mode {cost.mode!r}, not {mode!r}",
                          hint="Analyze again with the same mode, or leave cost=None.")
    calibrated: dict[tuple[str, ...] | None, BlockTimes] = {}
    copy_rate: list[float | None] = [None]  # the swapped masters' rate: None = pinned

    def searched() -> Plan:
        result: Plan | None = None
        refused: PlanError | None = None
        try:
            result = planned(None, cost, block_times)
        except PlanError as exc:
            refused = exc
        # Inference that swaps: whole blocks go through slots as large as the largest block,
        # their children (attention, feed-forward, norms) through smaller ones, which leaves
        # room for more slots or resident units where the slots weigh (an H200's calibrated
        # FLUX.1-dev plan at 2 GiB kept one block resident and one 648 MiB slot).
        if may_split and (result is None or result.swapped):
            meta, whole = on_meta()
            result, refused = _finer(meta, whole, cost, result, refused, analyzed, planned)
        if result is None:
            assert refused is not None  # one of the two is always set
            raise refused
        return result

    pageable = _PageableRate.of(machine, target) if host_memory == "pageable" else None
    copy_rate[0] = pageable.rate if pageable is not None else None
    try:
        result = searched()
    except PlanError as refused:
        # Nothing fits as built: where one block's recomputation sets the peak (long
        # sequences), its parts checkpointed on their own may fit. Analyzed again, so only
        # here: every plan that fits as built stays as it was.
        if not (subblock_checkpoint == "auto" and mode == "train" and given_cost is None
                and _has_parts(on_meta()[1])):
            raise
        use_parts = True
        cost = analyzed(on_meta()[1])
        calibrated.clear()
        try:
            result = searched()
        except PlanError as finer:
            use_parts = False
            if finer.minimum_budget is None or (refused.minimum_budget is not None
                                                and refused.minimum_budget <= finer.minimum_budget):
                raise refused from None
            raise PlanError(f"{finer.message} (each block's parts checkpointed on their own: "
                            "sub-block checkpointing)", hint=finer.hint,
                            minimum_budget=finer.minimum_budget) from None
    # Offline, the host is another machine's: only the platform (Windows, WSL) decides "auto",
    # not this host's RAM or cgroup.
    choice = choose_host_memory(host_memory,
                                pinned_bytes=result.host_bytes if machine.measured else None)
    if host_memory == "auto" and not machine.measured and choice.mode == "pinned":
        choice = HostMemoryChoice("pinned", f"planned offline for {machine.name}, whose host's "
                                  "memory is not known (host_memory='pageable' plans for a "
                                  "host that cannot pin the masters)")
    if not result.swapped:
        choice = HostMemoryChoice("pinned", "nothing is swapped")
    elif choice.mode == "pageable" and pageable is None:  # "auto": price the copies again
        pageable = _PageableRate.of(machine, target)
        copy_rate[0] = pageable.rate
        result = searched()
    result = replace(result, host_memory=choice.mode, host_memory_reason=choice.reason)
    if choice.mode == "pageable" and pageable is not None:
        # the pool the swapper will pin: no more than the blocks its ring has in flight
        largest = result.peak_breakdown.get("swap_slots", 0) // max(1, result.num_slots)
        chunk, count = staging_layout(pool_bytes, largest, result.num_slots + 1)
        result = replace(result, copy_bytes_per_s=pageable.rate,
                         staging_pool_bytes=chunk * count,
                         notes=(*result.notes, pageable.note(machine)))
    if offline_note is not None:
        result = replace(result, notes=(offline_note, *result.notes))
    if compile is not None:
        result = replace(result, notes=(*result.notes, _compile_note(compile, timed_compiled)))
    if ffn_chunks > 1:
        result = replace(result, ffn_chunks=ffn_chunks)
    if use_parts:
        result = replace(result, subblock_checkpoint=True)
    logger.info("plan: %d of %d blocks swapped, %d checkpointed, predicted %.0f ms, peak %d",
                len(result.swapped), len(result.block_order), len(result.checkpointed),
                result.predicted_step_seconds * 1e3, result.predicted_peak_bytes)
    return result


def _has_parts(found: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether a block has parts sub-block checkpointing would checkpoint."""
    from vramkit.offload.subblock import parts_of

    return any(parts_of(block) for _, block in found)


@dataclass(frozen=True)
class _PageableRate:
    """The rate pageable masters reach the device on ``machine`` and where its memcpy figure
    comes from (timed here for a measured machine; the stated assumption offline)."""

    rate: float
    memcpy: float
    measured: bool
    staged: bool = False  # the rate is a staged copy timed on this machine's GPU

    @classmethod
    def of(cls, machine: Machine, device: torch.device | None) -> _PageableRate:
        if device is None and machine.measured and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # the one measured
        if machine.measured and device is not None and device.type == "cuda":
            # the pipeline itself: memcpy and DMA share the host's memory bandwidth
            staged = measure_staged_bytes_per_s(device)
            return cls(min(staged, machine.h2d_bytes_per_s), staged, True, staged=True)
        memcpy = (measure_memcpy_bytes_per_s() if machine.measured
                  else PAGEABLE_MEMCPY_BYTES_PER_S)
        return cls(staged_copy_rate(machine.h2d_bytes_per_s, memcpy), memcpy, machine.measured)

    def note(self, machine: Machine) -> str:
        if self.staged:
            return (f"Pageable masters copy at {self.rate / 1e9:.1f} GB/s: a copy through a "
                    f"pinned staging pool timed here (the host's memcpy and the DMA at once; "
                    f"pinned copies {machine.h2d_bytes_per_s / 1e9:.1f} GB/s).")
        source = "measured here" if self.measured else PAGEABLE_MEMCPY_SOURCE
        return (f"Pageable masters copy at {self.rate / 1e9:.1f} GB/s, the slower of the host's "
                f"memcpy into the pinned staging pool ({self.memcpy / 1e9:.1f} GB/s, {source}) "
                f"and the pinned copy ({machine.h2d_bytes_per_s / 1e9:.1f} GB/s).")


def _compile_note(mode: str, timed: list[str | None]) -> str:
    """What a plan for compiled blocks (``compile=mode``) priced them by."""
    if timed and all(t == mode for t in timed):
        return (f"Blocks run compiled (torch.compile mode={mode!r}): their times were measured "
                "compiled.")
    if not timed:
        why = "offline profiles state no compiled speedup or host time per launch"
    elif all(t is None for t in timed):
        why = "the block times given were measured eager"
    else:
        why = "the block times given were measured compiled in another mode"
    return (f"Blocks run compiled (torch.compile mode={mode!r}), priced as eager: {why}; "
            "the step may be faster than predicted.")


@contextlib.contextmanager
def _no_collection(active: bool) -> Iterator[None]:
    """The garbage collector paused while the meta step runs (``active``): with chunked
    feed-forward layers, tensors a first call leaves in reference cycles died whenever the
    collector happened to run, and the estimate moved from run to run (the tiny video model's
    least budget by up to 8 %); paused, they live to the end of the step: the same estimate
    each time, the highest of those seen."""
    if not active or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


#: A plan of split blocks replaces the plan of whole blocks only when predicted this much
#: faster: each unit is a swapper call more and a smaller copy (the prediction prices the
#: call's host time, not what finer interleaving may cost beyond it), and whole blocks are
#: the form the benchmarks measured.
SPLIT_GAIN = 0.05


def _unclean(cost: ModelCost) -> set[str]:
    """Units that would not swap cleanly: weights an op reads outside the unit's call (a
    placeholder there), or called twice in one step (the ring learns one call per pass)."""
    return {*cost.foreign_reads, *cost.repeated_calls}


def _finer(meta: nn.Module, found: list[tuple[str, nn.Module]], cost: ModelCost,
           whole: Plan | None, refused: PlanError | None,
           analyzed: Callable[[list[tuple[str, nn.Module]]], ModelCost],
           planned: Callable[[list[tuple[str, nn.Module]], ModelCost, None], Plan]
           ) -> tuple[Plan | None, PlanError | None]:
    """The plan of the blocks ``found`` in ``meta`` (the model on the meta device) split into
    their children (:func:`~vramkit.offload.blocks.split_blocks`) where it fits when whole
    blocks do not, or is :data:`SPLIT_GAIN` faster; otherwise ``whole`` (or ``refused``) as
    they were. ``cost`` is the whole blocks' analysis: what a whole block holds while it runs
    bounds the split plan's activations (the block's own code keeps tensors between its
    children's calls)."""
    parts = {name: split_blocks([(name, block)]) for name, block in found}
    # units in the model's order of registration, as find_blocks orders named blocks
    position = {name: i for i, (name, _) in enumerate(meta.named_modules())}
    finer_cost = None
    for _ in range(2):  # again with whole blocks where units do not swap cleanly
        units = [unit for name, _ in found for unit in parts[name]]
        if len(units) == len(found):
            return whole, refused  # no block splits
        units.sort(key=lambda unit: position.get(unit[0], math.inf))
        finer_cost = analyzed(units)
        unclean = _unclean(finer_cost)
        if not unclean:
            break
        for name, block in found:
            if any(unit in unclean for unit, _ in parts[name]):
                parts[name] = [(name, block)]
        logger.info("plan: %d unit(s) have weights read outside their own call or are "
                    "called twice (%s...): their blocks stay whole", len(unclean),
                    sorted(unclean)[:3])
    if finer_cost is None or _unclean(finer_cost):
        return whole, refused
    finer_cost = replace(finer_cost, activations=replace(
        finer_cost.activations, enclosing_peak=cost.activations.inference_peak))
    try:
        finer = planned(units, finer_cost, None)
    except PlanError as exc:
        if refused is not None and (exc.minimum_budget or math.inf) < (
                refused.minimum_budget or math.inf):
            refused = exc  # the smaller minimum budget is the one to name
        return whole, refused
    if whole is not None and (finer.predicted_step_seconds
                              >= whole.predicted_step_seconds * (1 - SPLIT_GAIN)):
        return whole, refused
    largest = max(module_bytes(m) for _, m in found)
    unit = max(module_bytes(m) for _, m in units)
    than = (f"{whole.predicted_step_seconds * 1e3:.0f} ms with whole blocks" if whole
            is not None else "whole blocks do not fit")
    note = (f"Blocks split into their children ({len(units)} units for {len(found)} blocks, "
            f"the largest {format_size(unit)} against a block's {format_size(largest)}): the "
            f"ring's slots shrink with them; predicted {finer.predicted_step_seconds * 1e3:.0f}"
            f" ms, {than}.")
    return replace(finer, split=True, notes=(note, *finer.notes)), None
