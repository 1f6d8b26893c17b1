"""Per-block compute times measured on this machine: one block of each kind, timed for real.

A plan made for ``hardware=None`` does not trust FLOP counts for the blocks, which is where a
step spends its time: attention kernels, norms and element-wise work run far from a matmul's
throughput, and differently on every GPU. :func:`calibrate_blocks` records what each block is
called with during one forward of the model on the meta device, groups the blocks into kinds
(same class, same parameter shapes, same input shapes: Flux has two, a Llama one, SDXL a few
dozen), and for each kind builds one block on the device with random weights (nothing is read
from the model's own weights) and random inputs of the recorded shapes, and times its forward
and, for training, its backward (input and adapter gradients, as inside a training step), a few
rounds after a warm-up; for training also under gradient checkpointing as ``fit`` applies it
(the lean checkpoint: a forward that records no graph, a backward that recomputes first; the
host time of both, which a small block feels), on a GPU also with host-to-device copies running
beside it (a swapped step's copies slow the compute they overlap:
:meth:`BlockTimes.copy_slowdown`), and in each packed format asked for. Every block of a kind
gets the kind's times.

Times come from CUDA events on a GPU (the host enqueues each timed region while a spin kernel
holds the stream, so the kernels run back to back as inside a step; the host's enqueue time is
kept beside it, for host-bound small blocks) and from the host clock on the CPU (which tests
use). A kind whose block cannot run on random inputs (an index input that must hold valid
values) keeps its FLOP-based time and is named in :attr:`BlockTimes.fallbacks`.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_choice, check_device, check_int
from vramkit.offload._reach import copy_reaching, reached_modules
from vramkit.offload.blocks import find_blocks
from vramkit.planning._meta import MetaAutocast, meta_autocast_checks
from vramkit.planning.analysis import FORMATS, ModelCost, default_step, meta_copy, to_meta
from vramkit.planning.w8a8 import is_w8a8, storage_config, unavailable_on_device

__all__ = ["BlockTimes", "CallTimes", "calibrate_blocks"]

logger = logging.getLogger(__name__)

_STD = 0.02  # random weights: the scale of a trained transformer's


#: The variant of a block timed as the model stores it, and timed under gradient checkpointing
#: (its backward recomputes the forward first).
FULL = "full"
CHECKPOINTED = "checkpointed"
#: The block as the model stores it, timed with host-to-device copies running beside it on
#: another stream (GPU only): what a swapped step's copy engine costs the compute it overlaps.
BESIDE_COPIES = "beside-copies"


def packed_variant(fmt: str, together: bool = False) -> str:
    """The variant name of a block stored in ``fmt`` (``"fp8"``, ``"fp8+together"``)."""
    return f"{fmt}+together" if together else fmt


@dataclass(frozen=True)
class CallTimes:
    """One block's measured call: the device's seconds and the host's (the time it takes to
    enqueue the call) of a forward and of the backward after it (0 without a backward).

    Inside a step the host runs ahead of the device, so a phase lasts the longer of the
    device's work and the host's enqueueing summed over its blocks -- not the sum of each
    block's larger side (:func:`~vramkit.planning.planner.search`). On a CPU the two are one.
    """

    forward: float
    backward: float
    host_forward: float
    host_backward: float

    @property
    def seconds(self) -> tuple[float, float]:
        """Forward and backward as one call alone takes them: the larger of device and host."""
        return max(self.forward, self.host_forward), max(self.backward, self.host_backward)

    def minus(self, other: CallTimes) -> CallTimes:
        """What this call costs over ``other``, side by side (never negative)."""
        return CallTimes(max(0.0, self.forward - other.forward),
                         max(0.0, self.backward - other.backward),
                         max(0.0, self.host_forward - other.host_forward),
                         max(0.0, self.host_backward - other.host_backward))


@dataclass(frozen=True)
class BlockTimes:
    """Measured seconds of each block's call (see :func:`calibrate_blocks`).

    Attributes:
        calls: variant -> block name -> :class:`CallTimes`. Variants: :data:`FULL` (the block
            as the model stores it), :data:`CHECKPOINTED` (the same under gradient
            checkpointing: its backward recomputes the forward; training only), and per packed
            format asked for, ``"fp8"`` (its frozen layers stored in that format, each
            dequantized at its call) and ``"fp8+together"`` (a block's layers dequantized
            together at its first call, :mod:`vramkit.quant.dense`); see
            :func:`packed_variant`; on a GPU, :data:`BESIDE_COPIES` (the full block with
            host-to-device copies running beside it, :meth:`copy_slowdown`).
        kinds: how many distinct kinds were timed.
        device: where they were timed (``"cuda:0"``, ``"cpu"``).
        fallbacks: blocks whose kind could not run on random inputs (FLOP-based times).
        seconds: how long the calibration took.
        unavailable: formats asked for that this device cannot run -> why (a W8A8 format
            whose 8-bit GEMM the GPU lacks): not timed, and a plan does not offer them.
        compiled: the ``torch.compile`` mode the blocks were timed compiled in (``None``:
            eager).
        decode_bytes_per_s: the GPU decoder's rate of compressed masters, decoded bytes per
            second (:func:`measure_decode_rate`); ``None`` where there is none (a CPU, no
            Triton): the plan then never compresses.
    """

    calls: dict[str, dict[str, CallTimes]]
    kinds: int
    device: str
    fallbacks: tuple[str, ...] = ()
    seconds: float = 0.0
    unavailable: dict[str, str] = field(default_factory=dict)
    compiled: str | None = None
    decode_bytes_per_s: float | None = None

    def call(self, name: str, variant: str = FULL) -> CallTimes | None:
        """Block ``name``'s times in ``variant``, or ``None`` when that was not timed."""
        return self.calls.get(variant, {}).get(name)

    @property
    def forward(self) -> dict[str, float]:
        """Block name -> seconds of one forward call alone (the larger of device and host)."""
        return {n: c.seconds[0] for n, c in self.calls.get(FULL, {}).items()}

    @property
    def backward(self) -> dict[str, float]:
        """Block name -> seconds of its backward alone (0 for inference)."""
        return {n: c.seconds[1] for n, c in self.calls.get(FULL, {}).items()}

    def extra(self, variant: str, name: str, *, signed: bool = False) -> CallTimes | None:
        """What a call of block ``name`` costs in ``variant`` over its :data:`FULL` call (each
        side never negative; ``signed``: negative where the variant is faster, as a W8A8
        block's 8-bit GEMMs can be), or ``None`` when that was not timed."""
        timed, full = self.call(name, variant), self.call(name)
        if timed is None or full is None:
            return None
        if signed:
            return CallTimes(timed.forward - full.forward, timed.backward - full.backward,
                             timed.host_forward - full.host_forward,
                             timed.host_backward - full.host_backward)
        return timed.minus(full)

    def packed_extra(self, fmt: str, name: str, *, together: bool = False
                     ) -> tuple[float, float] | None:
        """Seconds a call of block ``name`` alone costs on top of its full-precision call when
        its frozen layers are stored in ``fmt`` (forward, backward; never negative), or
        ``None`` when that was not timed. ``together``: with the block's layers dequantized
        together."""
        timed, full = self.call(name, packed_variant(fmt, together)), self.call(name)
        if timed is None or full is None:
            return None
        return (max(0.0, timed.seconds[0] - full.seconds[0]),
                max(0.0, timed.seconds[1] - full.seconds[1]))

    def copy_slowdown(self, name: str) -> tuple[float, float]:
        """The share by which block ``name``'s forward and backward device time grows while
        host-to-device copies run beside it (never negative; ``(0, 0)`` when not timed).

        The copy engine's writes share the GPU's memory with the kernels: in a fitted FLUX
        step on an H200 every single block, swapped or resident, ran 0.10 ms (2.8 %) slower
        than in the resident step (``benchmarks/plan_phases.py``), and this calibration read
        +3.4-4.0 % forward, +2.5-3.0 % backward (the plans' notes in
        ``benchmarks/plan.py``)."""
        timed, full = self.call(name, BESIDE_COPIES), self.call(name)
        if timed is None or full is None:
            return 0.0, 0.0
        return (max(0.0, timed.forward / full.forward - 1) if full.forward > 0 else 0.0,
                max(0.0, timed.backward / full.backward - 1) if full.backward > 0 else 0.0)

    def flops_per_s(self, cost: ModelCost) -> float | None:
        """The throughput the timed blocks reached on the device (for the work outside the
        blocks); ``None`` when nothing was timed."""
        full = self.calls.get(FULL, {})
        names = [b.name for b in cost.blocks if b.name not in self.fallbacks and b.name in full]
        spent = sum(full[n].forward + full[n].backward for n in names)
        flops = sum(cost.blocks[cost.block_index[n]].forward_flops
                    + cost.blocks[cost.block_index[n]].backward_flops for n in names)
        return flops / spent if spent > 0 and flops > 0 else None


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, Mapping):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return repr(value)


def _kind(module: nn.Module, args: Any, kwargs: Any) -> Any:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in module.named_parameters())
    # adapters hooked in from outside the block (a kohya-style network) make a kind too
    params += tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in _outside_params(module))
    return (type(module).__qualname__, params, _signature(args), _signature(kwargs))


def _record_calls(meta: nn.Module, names: Sequence[str], inputs: Any,
                  step: Callable[[nn.Module, Any], torch.Tensor],
                  autocast: torch.dtype | None, train: bool) -> dict[str, tuple[Any, Any]]:
    """Each block's first call (args, kwargs), from one forward on meta -- with grad mode on
    when training, so each input tensor says whether it requires grad in the real step (a
    conditioning vector or a rotary table from frozen layers does not: timing its gradient
    would price a backward the step never runs)."""
    calls: dict[str, tuple[Any, Any]] = {}
    handles = []
    for name in names:
        def record(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            if name not in calls:
                calls[name] = (args, kwargs)
        handles.append(meta.get_submodule(name).register_forward_pre_hook(record,
                                                                          with_kwargs=True))
    try:
        context = MetaAutocast(autocast) if autocast is not None else None
        with torch.set_grad_enabled(train), meta_autocast_checks(context):
            if context is not None:
                with context:
                    step(meta, inputs)
            else:
                step(meta, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _real(value: Any, device: torch.device, train: bool, generator: torch.Generator) -> Any:
    """A meta structure made real: floats random (requiring grad when training and where the
    recorded tensor did), the rest 0."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out = torch.randn(value.shape, generator=generator, dtype=torch.float32)
            out = out.to(device=device, dtype=value.dtype)
            return out.requires_grad_(train and value.requires_grad)
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, Mapping):
        return {k: _real(v, device, train, generator) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v, device, train, generator) for v in value)
    return value


def _float_outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _float_outputs(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_outputs(v)]
    return []


class _Clock:
    """Seconds of a region: CUDA events on a GPU, the host clock on the CPU.

    On a GPU, the warm-up rounds measure how long the host takes to enqueue the region
    (Python, autocast, the dispatcher; waits the region itself makes included). In the timed
    rounds the stream is first held by a spin kernel (``torch.cuda._sleep``) for longer than
    that, so the region's kernels run back to back, as inside a step whose host runs ahead,
    and the events see device time alone. The host's time is the median of the warm-up rounds
    after the first (which pays compilation and first-call caches): a single sample swung by
    up to 2.7x between runs of one block (SD3.5's block 0: 3.69 vs 9.99 ms,
    ``benchmarks/block_times.py``). On the CPU both are the region's wall time.
    """

    #: Spin cycles per second of host enqueue time: a 2 GHz clock, doubled for margin.
    _CYCLES_PER_S = 4e9
    _MAX_LEAD_S = 0.25

    def __init__(self, device: torch.device, beside: _CopiesBeside | None = None,
                 seconds: float = 0.0) -> None:
        self.cuda = device.type == "cuda"
        self.beside = beside  # timed rounds: copies for ``seconds`` from the region's start
        self.beside_s = seconds
        self.host_samples: list[float] = []  # the warm-up rounds' enqueue times, in order
        self.busy_samples: list[float] = []  # the timed rounds', the device busy
        self.timing = False  # warm-up rounds until set

    @property
    def enqueue_s(self) -> float:
        """The host's enqueue time a plan uses: the median of every round after the first,
        with the device idle (warm-up) and busy (timed) -- inside a step the host meets both
        (a device-bound phase keeps the device busy, a host-bound one idle). A FLUX double
        block's forward enqueue read 2.75-4.76 ms across a day's H200 calibrations
        (``benchmarks/calibration_host.py`` repeats them); twice the samples steady the median within one."""
        samples = self.host_samples[1:] + self.busy_samples
        return statistics.median(samples) if samples else self.host_s

    @property
    def host_s(self) -> float:
        """The host's enqueue time: the median of the warm-up rounds after the first (the
        first alone when there is one)."""
        later = self.host_samples[1:] or self.host_samples
        return statistics.median(later) if later else 0.0

    def start(self) -> Any:
        if self.cuda:
            if self.timing and self.beside is not None:
                self.beside.drain()
            if self.timing and self.host_s > 0:
                lead = min(self.host_s, self._MAX_LEAD_S)
                torch.cuda._sleep(int(lead * self._CYCLES_PER_S))
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if self.timing and self.beside is not None:
                self.beside.launch(event, self.beside_s)
            return (event, time.perf_counter())
        return time.perf_counter()

    def stop(self, started: Any) -> float:
        """The region's device seconds (wall seconds on the CPU)."""
        if self.cuda:
            event, host_start = started
            host_s = time.perf_counter() - host_start
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            # a warm-up round: the host's enqueue time, nothing held; a timed one: held
            (self.busy_samples if self.timing else self.host_samples).append(host_s)
            return float(event.elapsed_time(end)) / 1e3
        return time.perf_counter() - started


class _CopiesBeside:
    """Host-to-device copies on a stream of their own, started with a timed region (the side
    stream waits for the region's first event) and lasting about as long as the region's
    device time alone: a swapped step's copy engine beside its compute. Pinned source and
    device destination of :attr:`CHUNK` bytes each, copied over and over."""

    CHUNK = 32 << 20

    def __init__(self, device: torch.device) -> None:
        self.source = torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True)
        self.dest = torch.empty(self.CHUNK, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.stream):
            self.dest.copy_(self.source, non_blocking=True)  # first-copy costs
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            for _ in range(4):
                self.dest.copy_(self.source, non_blocking=True)
            end.record(self.stream)
        end.synchronize()
        self.bytes_per_s = 4 * self.CHUNK / max(start.elapsed_time(end) / 1e3, 1e-9)

    def launch(self, event: Any, seconds: float) -> None:
        """Copies for ``seconds`` (one chunk more), from ``event`` on."""
        self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            for _ in range(math.ceil(seconds * self.bytes_per_s / self.CHUNK) + 1):
                self.dest.copy_(self.source, non_blocking=True)

    def drain(self) -> None:
        """Wait for the last region's copies (at most a chunk outlives it)."""
        self.stream.synchronize()


#: Untimed rounds before the timed ones: kernel selection, caches, the GPU's clocks; the host's
#: enqueue time is the median of all but the first.
_WARMUP_ROUNDS = 6


def _time_block(block: nn.Module, args: Any, kwargs: Any, device: torch.device, train: bool,
                autocast: torch.dtype | None, repeats: int,
                before_round: Callable[[], None] | None = None,
                beside: tuple[_CopiesBeside, CallTimes] | None = None) -> CallTimes:
    """Median device seconds of ``block``'s forward and backward over ``repeats`` rounds
    (after warm-up rounds) and the host's enqueue seconds (see :class:`_Clock`).
    ``before_round`` runs before each round's forward, untimed. ``beside``: copies running
    beside each timed forward and backward, as long as the given times (the block alone)."""
    copies, alone = beside if beside is not None else (None, CallTimes(0.0, 0.0, 0.0, 0.0))
    forward_clock = _Clock(device, copies, alone.forward)
    backward_clock = _Clock(device, copies, alone.backward)
    context = (torch.autocast(device.type, dtype=autocast) if autocast is not None and train
               else None)
    forwards, backwards = [], []
    for round_ in range(repeats + _WARMUP_ROUNDS):
        forward_clock.timing = backward_clock.timing = round_ >= _WARMUP_ROUNDS
        if before_round is not None:
            before_round()
        with torch.set_grad_enabled(train):
            started = forward_clock.start()
            if context is not None:
                with context:
                    out = block(*args, **kwargs)
            else:
                out = block(*args, **kwargs)
            forward = forward_clock.stop(started)
        backward = 0.0
        if train:
            outputs = _float_outputs(out)
            if outputs:
                grads = [torch.ones_like(t) for t in outputs]
                started = backward_clock.start()
                torch.autograd.backward(outputs, grads)
                backward = backward_clock.stop(started)
            for p in _call_params(block):
                p.grad = None
        del out
        if round_ >= _WARMUP_ROUNDS:
            forwards.append(forward)
            backwards.append(backward)
    if copies is not None:
        copies.drain()
    fwd, bwd = statistics.median(forwards), statistics.median(backwards)
    if not forward_clock.cuda:
        return CallTimes(fwd, bwd, fwd, bwd)
    return CallTimes(fwd, bwd, forward_clock.enqueue_s,
                     backward_clock.enqueue_s if train else 0.0)


def _outside(block: nn.Module) -> list[nn.Module]:
    """The modules outside ``block`` that its call reaches (adapters hooked into it)."""
    return reached_modules(block)[sum(1 for _ in block.modules()):]


def _outside_params(block: nn.Module) -> list[torch.Tensor]:
    return list(dict.fromkeys(p for m in _outside(block) for p in m.parameters(recurse=False)))


def _call_params(block: nn.Module) -> list[torch.Tensor]:
    """The parameters ``block``'s call uses: its own and those of adapters hooked into it."""
    return list(dict.fromkeys(p for m in reached_modules(block)
                              for p in m.parameters(recurse=False)))


def _call_tensors(block: nn.Module) -> list[torch.Tensor]:
    return list(dict.fromkeys(t for m in reached_modules(block)
                              for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))))


def _on_device(meta_block: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``meta_block`` with empty tensors on ``device``, the adapters its layers call
    from outside it (a kohya-style network's modules, copied with the block: a replaced
    ``forward`` is bound to them) included: left on meta, their backward would hand meta
    gradients to the device's graph."""
    block = copy_reaching(meta_block).to_empty(device=device)
    for module in _outside(block):
        module.to_empty(device=device, recurse=False)
    return block


class _Call(nn.Module):
    """A block behind one more call: checkpointing it checkpoints the block as
    :func:`~vramkit.offload.checkpointing.enable_gradient_checkpointing` does a model's (which
    takes a container's name for its children)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


def _time_checkpointed(block: nn.Module, args: Any, kwargs: Any, device: torch.device,
                       autocast: torch.dtype | None, repeats: int) -> CallTimes:
    """:func:`_time_block` of ``block`` under gradient checkpointing, as a plan checkpoints
    it (the lean checkpoint, the default: the warm-up rounds include the first call's check):
    its forward records no graph, its backward runs the recomputation first (with its host
    time: the forward enqueued again)."""
    from vramkit.offload.checkpointing import (
        disable_gradient_checkpointing,
        enable_gradient_checkpointing,
    )

    holder = nn.Module()
    holder.call = _Call(block)
    enable_gradient_checkpointing(holder, ["call"])
    try:
        return _time_block(holder.call, args, kwargs, device, True, autocast, repeats)
    finally:
        disable_gradient_checkpointing(holder, ["call"])


def _warm_up_clocks(device: torch.device, seconds: float = 0.3) -> None:
    """Keep the GPU busy for ``seconds`` before anything is timed: an idle GPU runs its first
    kernels at lower clocks, and the first kind timed would be priced higher than a step's
    blocks run."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(device)
    del a


def calibrate_blocks(model: nn.Module, inputs: Any, *, mode: str = "train",
                     step: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                     blocks: str | Sequence[str] = "auto",
                     autocast: torch.dtype | None = torch.bfloat16,
                     device: str | torch.device | None = None, repeats: int = 5,
                     seed: int = 0, formats: Sequence[str] = (),
                     found: Sequence[tuple[str, nn.Module]] | None = None,
                     compile: str | None = None) -> BlockTimes:
    """Time one block of each kind on ``device`` (see the module docstring).

    Args:
        model: the model (meta or real: only its structure and shapes are used).
        inputs: the step's example inputs (meta tensors are enough).
        mode: ``"train"`` (forward under ``autocast`` and backward) or ``"infer"`` (forward
            without grad).
        step: ``step(model, inputs)`` as for :func:`vramkit.plan` (its forward is what is
            recorded).
        blocks: ``"auto"`` or block names.
        autocast: the autocast dtype of a training step (``None``: none).
        device: where to time (default: the current CUDA device).
        repeats: timed rounds per kind after six warm-up rounds (the median is kept).
        seed: the random weights' and inputs' seed.
        formats: packed storage formats (``"fp8"``, ``"int8"``, ``"int4"``, ``"nf4"``) to time
            each kind in as well: the block's frozen layers quantized as
            :func:`vramkit.fit` stores a packed block (``quantize_model``, layers that own
            trainable parameters kept), so a plan prices dequantizing on the fly by what it
            costs on this device (:meth:`BlockTimes.extra`); and W8A8 formats
            (``"fp8-w8a8"``, ``"int8-w8a8"``: the block built with
            :class:`~vramkit.quant.w8a8.W8A8Linear` layers), except where the GPU lacks their
            8-bit GEMM (:attr:`BlockTimes.unavailable` says why).
        found: the blocks already found, as :func:`~vramkit.offload.blocks.find_blocks`
            returns them, of ``model`` already on the meta device (``blocks`` is then not
            read; :func:`vramkit.plan` passes the ones its analysis used).
        compile: a ``torch.compile`` mode of
            :data:`~vramkit.offload.compiled.COMPILE_MODES` to time each block compiled in, as
            ``vramkit.fit(..., compile=...)`` runs it (:func:`~vramkit.offload.compiled.
            compile_blocks`: the block's own forward compiled, beneath the checkpoint); every
            variant is then the compiled block's, and the warm-up rounds include compiling.
            ``None`` (default): eager.

    Returns:
        :class:`BlockTimes` for every block.

    Raises:
        ConfigError: for bad arguments.
    """
    check_choice("mode", mode, ("train", "infer"))
    repeats = check_int("repeats", repeats, minimum=1)
    if compile is not None:
        from vramkit.offload.compiled import COMPILE_MODES

        check_choice("compile", compile, COMPILE_MODES)
    if isinstance(formats, str):
        formats = (formats,)
    formats = tuple(dict.fromkeys(formats))
    for fmt in formats:
        check_choice("formats", fmt, tuple(f for f in FORMATS if f != "bf16"))
    target = check_device("device", device if device is not None else "cuda")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    # A W8A8 format whose GEMM this GPU lacks is not timed, and not offered: never a block
    # timed (or run) in full precision under its name.
    unavailable = {fmt: why for fmt in formats
                   if (why := unavailable_on_device(fmt, target)) is not None}
    formats = tuple(fmt for fmt in formats if fmt not in unavailable)
    started = time.perf_counter()
    train = mode == "train"
    if found is None:
        meta = meta_copy(model)
        found = find_blocks(meta, blocks)
    else:
        meta = model
    names = [n for n, _ in found]
    calls_of = _record_calls(meta, names, to_meta(inputs), step or default_step, autocast,
                             train)
    kinds: dict[Any, list[str]] = {}
    for name in names:
        if name in calls_of:
            args, kwargs = calls_of[name]
            kinds.setdefault(_kind(meta.get_submodule(name), args, kwargs), []).append(name)
    generator = torch.Generator().manual_seed(seed)
    calls: dict[str, dict[str, CallTimes]] = {}
    fallbacks: list[str] = [n for n in names if n not in calls_of]
    copies: _CopiesBeside | None = None
    if target.type == "cuda" and kinds:
        _warm_up_clocks(target)
    for members in kinds.values():
        first = members[0]
        block = _on_device(meta.get_submodule(first), target)
        with torch.no_grad():
            for tensor in _call_tensors(block):
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * _STD)
                else:
                    tensor.zero_()
        args, kwargs = _real(calls_of[first], target, train, generator)
        if compile is not None:
            _compile_block(block, compile)
        try:
            timed = {FULL: _time_block(block, args, kwargs, target, train, autocast, repeats)}
            if target.type == "cuda":
                copies = copies or _CopiesBeside(target)
                timed[BESIDE_COPIES] = _time_block(block, args, kwargs, target, train,
                                                   autocast, repeats,
                                                   beside=(copies, timed[FULL]))
            if train:
                timed[CHECKPOINTED] = _time_checkpointed(block, args, kwargs, target, autocast,
                                                         repeats)
            for fmt in formats:
                # a W8A8 block dequantizes nothing: no together variant
                for together in (False,) if is_w8a8(fmt) else (False, True):
                    timed[packed_variant(fmt, together)] = _time_packed(
                        block, fmt, args, kwargs, target, train, autocast, repeats,
                        together=together)
        except (RuntimeError, IndexError, ValueError) as err:  # e.g. an index input of zeros
            logger.warning("calibration: %s (%s) cannot run on random inputs (%s); its %d "
                           "block(s) keep FLOP-based times", first, type(block).__name__, err,
                           len(members))
            fallbacks.extend(members)
            continue
        finally:
            del block, args, kwargs
            if target.type == "cuda":
                torch.cuda.empty_cache()
        for variant, times in timed.items():
            of_variant = calls.setdefault(variant, {})
            for name in members:
                of_variant[name] = times
    full = calls.setdefault(FULL, {})
    for name in fallbacks:
        full.setdefault(name, CallTimes(0.0, 0.0, 0.0, 0.0))
    seconds = time.perf_counter() - started
    logger.info("calibrated %d block kind(s) on %s in %.1f s", len(kinds), target, seconds)
    return BlockTimes(calls=calls, kinds=len(kinds), device=str(target),
                      fallbacks=tuple(dict.fromkeys(fallbacks)), seconds=seconds,
                      unavailable=unavailable, compiled=compile,
                      decode_bytes_per_s=measure_decode_rate(target))


def _compile_block(block: nn.Module, mode: str) -> None:
    """Compile ``block``'s own forward in place, as ``fit(..., compile=mode)`` compiles a
    model's blocks (:func:`~vramkit.offload.compiled.compile_blocks`); a packed copy of it
    compiles again on its first call."""
    from vramkit.offload.compiled import compile_blocks

    holder = nn.Module()
    holder.block = block
    compile_blocks(holder, ["block"], mode=mode)


def measure_decode_rate(device: torch.device, nbytes: int = 64 << 20) -> float | None:
    """Decoded bytes per second of compressed masters on ``device`` (``SwapConfig.compress``):
    ``nbytes`` of normal bf16 weights encoded there, the median of five timed decodes; ``None``
    without a GPU decoder (a CPU, or no Triton)."""
    from vramkit.compress import decode_into, encode_tensor, triton_decoder_available

    if not triton_decoder_available(device):
        return None
    weights = (torch.randn(nbytes // 2, device=device) * 0.02).bfloat16()
    packed = encode_tensor(weights, device=device, crc=False)
    packed = packed.to(packed.payload.to(device))
    out = torch.empty(packed.nbytes, dtype=torch.uint8, device=device)
    decode_into(packed, out)  # compiles the kernel
    times = []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        decode_into(packed, out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return packed.nbytes / sorted(times)[2]


def _time_packed(block: nn.Module, fmt: str, args: Any, kwargs: Any, device: torch.device,
                 train: bool, autocast: torch.dtype | None, repeats: int, *,
                 together: bool = False) -> CallTimes:
    """:func:`_time_block` of a copy of ``block`` whose frozen layers are stored in ``fmt``
    (as :class:`vramkit.planning.fitting.Fitted` stores a packed block), with its layers
    dequantized together (``together``, as a plan with ``dequantize_together`` runs it: its
    backward priced for a checkpointed block, whose recomputation has just filled the buffer)
    or each at its call."""
    from vramkit.planning._meta import trainable_module_names
    from vramkit.quant.dense import DenseScratch, group_dense
    from vramkit.quant.model import quantize_model

    packed = copy.deepcopy(block)
    try:
        quantize_model(packed, storage_config(fmt, trainable_module_names(packed)))
        if not together:
            return _time_block(packed, args, kwargs, device, train, autocast, repeats)
        # Each round's forward fills the buffer anew, as a step's does (the buffer holds other
        # blocks between a block's calls); its backward finds the block still there, as a
        # checkpointed block's does after its recomputation. (Kept from round to round, the
        # forward measured no dequantizing at all: +0.9 ms over a FLUX forward pass in one run.)
        scratch = DenseScratch()
        group_dense(packed, scratch)
        return _time_block(packed, args, kwargs, device, train, autocast, repeats,
                           before_round=scratch.invalidate)
    finally:
        del packed
