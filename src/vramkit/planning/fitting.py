"""``vramkit.fit``: plan a model for a budget and apply the plan with vramkit's pieces, then check
the prediction against the first steps.

The plan's parts are applied in this order: packed storage of the blocks the plan stores in
another format (``quantize_model`` on those blocks; the original layers are kept on the host,
so :meth:`Fitted.detach` gives the model back exactly; with ``plan.dequantize_together`` each
packed block's layers are grouped so one call of the block dequantizes them together,
:mod:`vramkit.quant.dense`), gradient checkpointing of the planned
blocks, the block swapper with exactly the planned blocks and slots
(``SwapConfig(swapped_blocks=...)``), and activation offload around the model's forward. After
``observe_steps`` steps (a step is the time between two calls of the model), the measured peak
and step time are compared with the prediction, logged, and kept for :meth:`Fitted.report`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_choice, check_int
from vramkit.devices.env import prefer_expandable_segments
from vramkit.devices.resolve import resolve_device
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload import _patch
from vramkit.offload.activations import ActivationOffloader
from vramkit.offload.checkpointing import (
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_checkpointed,
)
from vramkit.offload.compiled import COMPILE_MODES, compile_blocks, uncompile_blocks
from vramkit.offload.swap import BlockLoader, BlockSwapper, MasterMemory, SwapConfig
from vramkit.planning._meta import trainable_module_names
from vramkit.planning.analysis import FITTED_MARK, check_model, refuse_attached
from vramkit.planning.api import plan as make_plan
from vramkit.planning.record import Plan
from vramkit.quant.dense import DenseScratch, group_dense, ungroup_dense
from vramkit.units import format_size

__all__ = ["FitReport", "Fitted", "fit"]

logger = logging.getLogger(__name__)

#: Fitted models still observing their first steps (their report not made yet).
_OBSERVING: weakref.WeakSet[Fitted] = weakref.WeakSet()

#: How far a measured step may be from its prediction before a report explains a host-bound
#: plan's part in it (the planner's target: within 10 %).
STEP_TOLERANCE = 0.10


@dataclass(frozen=True)
class FitReport:
    """The prediction next to what the first steps measured.

    Attributes:
        steps: steps observed (the first is left out of the step time).
        predicted_peak_bytes / measured_peak_bytes: the peak of allocated memory (measured on
            CUDA only; ``None`` on the CPU), less what other tensors held on the device when
            ``fit`` attached: the step's own, as the plan predicts it.
        predicted_step_seconds / measured_step_seconds: median step time (``None`` until two
            steps ran).
        budget_bytes: the budget.
        host_bound: the phases the plan predicted host-bound (``"forward"``, ``"backward"``):
            their time follows the host's pace, which can drift between planning and the steps
            (on a shared machine by 20-25 %, ``benchmarks/calibration_host.py``).
        planned_for: the machine the plan was made for (:attr:`Plan.machine
            <vramkit.planning.record.Plan.machine>`; ``""``: not recorded).
        runs_on: the machine the steps ran on (``"cpu"``, or the GPU's name); ``""``: the one
            planned for.
        same_machine: whether the steps ran on the machine the plan predicted them for. When not
            (a plan for an RTX 4090 run on the CPU), the measured step time is reported alone:
            it is no test of the prediction (:attr:`step_error` is ``None``).
        shared: another fitted model on the same device was attached or ran while these steps
            were observed (a fitted text encoder beside a fitted transformer, two arms of a
            benchmark): the device's peak and the time between this model's calls include its
            work, so neither is a test of this plan.
    """

    steps: int
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    predicted_step_seconds: float
    measured_step_seconds: float | None
    host_bound: tuple[str, ...] = ()
    planned_for: str = ""
    runs_on: str = ""
    same_machine: bool = True
    shared: bool = False

    @property
    def peak_error(self) -> float | None:
        """``measured / predicted - 1`` of the peak."""
        if self.measured_peak_bytes is None:
            return None
        return self.measured_peak_bytes / self.predicted_peak_bytes - 1

    @property
    def step_error(self) -> float | None:
        """``measured / predicted - 1`` of the step time (``None`` before two steps, or on a
        machine the plan did not predict the step for)."""
        if self.measured_step_seconds is None or not self.same_machine:
            return None
        return self.measured_step_seconds / self.predicted_step_seconds - 1

    def describe(self) -> str:
        if self.steps < 1:  # one step is the time between two forwards
            parts = ["no step measured yet" + (":" if self.measured_peak_bytes is not None
                                               else "")]
        else:
            parts = [f"after {self.steps} step{'s' if self.steps != 1 else ''}:"]
        if self.measured_peak_bytes is not None:
            parts.append(f"peak {format_size(self.measured_peak_bytes)} measured vs "
                         f"{format_size(self.predicted_peak_bytes)} predicted "
                         f"({self.peak_error:+.1%}), budget {format_size(self.budget_bytes)}")
        if self.measured_step_seconds is not None and not self.same_machine:
            parts.append(f"step {self.measured_step_seconds * 1e3:.0f} ms measured on "
                         f"{self.runs_on or 'this machine'}; the plan's step time "
                         f"({self.predicted_step_seconds * 1e3:.0f} ms) was predicted for "
                         f"{self.planned_for or 'another machine'}, not for this machine, so "
                         "the two are not compared")
        elif self.measured_step_seconds is not None:
            parts.append(f"step {self.measured_step_seconds * 1e3:.0f} ms measured vs "
                         f"{self.predicted_step_seconds * 1e3:.0f} ms predicted "
                         f"({self.step_error:+.1%})")
            remark = host_bound_remark(self.host_bound, self.step_error)
            if remark:
                parts.append(f"-- the plan's {remark}")
        if self.shared:
            parts.append("-- another fitted model on this device ran in the same steps: the "
                         "figures include its work")
        return " ".join(parts)


def planned_here(machine: str, device: torch.device) -> tuple[str, bool]:
    """The machine ``device`` is (``"cpu"``, or its GPU's name) and whether a plan made for
    ``machine`` (:attr:`Plan.machine <vramkit.planning.record.Plan.machine>`) predicted its
    step times: a GPU measured by ``vramkit.plan`` (``"measured: <name>"``) or the profile of
    the same card. Plans are made for GPUs: the CPU is never the machine planned for."""
    if device.type != "cuda":
        return device.type, False
    from vramkit.errors import VramkitError
    from vramkit.planning.hardware import hardware_profile

    name = torch.cuda.get_device_name(device)
    if machine in (name, f"measured: {name}"):
        return name, True
    try:
        return name, hardware_profile(machine).name == hardware_profile(name).name
    except VramkitError:  # a card without a profile, or a Machine of the user's own naming
        return name, False


def host_bound_remark(phases: tuple[str, ...], step_error: float | None) -> str | None:
    """What explains a step off its prediction by more than :data:`STEP_TOLERANCE` when the
    plan predicted ``phases`` host-bound (``"backward is host-bound: ..."``), else ``None``."""
    if not phases or step_error is None or abs(step_error) <= STEP_TOLERANCE:
        return None
    verb = "is" if len(phases) == 1 else "are"
    return (f"{' and '.join(phases)} {verb} host-bound: the host's enqueueing paces it, and "
            "that moves with the host's load and clocks")


class _OffloadingForward(_patch.MethodWrapper):
    """The model's forward with saved activations offloaded while it runs."""

    __slots__ = ("offloader",)
    kind = "activation_offload"

    def __init__(self, offloader: ActivationOffloader) -> None:
        super().__init__()
        self.offloader = offloader

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active or self.offloader.active:
            return self.inner(*args, **kwargs)
        with self.offloader:
            return self.inner(*args, **kwargs)


class Fitted:
    """A model with a plan applied (:func:`fit`). Use the model as usual.

    Attributes:
        model: the model.
        plan: the :class:`~vramkit.planning.record.Plan` applied.
        swapper: the :class:`~vramkit.offload.swap.BlockSwapper`, or ``None`` when nothing is
            swapped.
        device: where the model runs.
    """

    def __init__(self, model: nn.Module, plan: Plan, device: torch.device, *,
                 blocks: str | Sequence[str] = "auto", observe_steps: int = 3,
                 checkpoint: str | os.PathLike[str] | None = None, prefix: str | None = None,
                 strict: bool = True, master_memory: MasterMemory | None = None,
                 block_loader: BlockLoader | None = None, compile_mode: str | None = None,
                 host_memory: str = "auto",
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
                 ) -> None:
        self.model = model
        self._optimizer = optimizer
        self.plan = plan
        self.device = device
        self.swapper: BlockSwapper | None = None
        self._observe_steps = observe_steps
        self._originals: list[tuple[nn.Module, str, nn.Module,
                                    list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._checkpointed: list[str] = []
        self._compile_mode = compile_mode
        self._compiled: list[str] = []
        self._chunked: list[str] = []
        self._parts: list[str] = []
        self._moved: list[tuple[torch.Tensor, torch.device]] = []
        self._offload: _OffloadingForward | None = None
        # the dequantized weights of one packed block at a time (vramkit.quant.dense)
        self._dense = DenseScratch()
        self._marks: list[float] = []
        self._report: FitReport | None = None
        self._shared = False  # another fitted model ran within the observed steps
        # What other tensors hold on the device when fit attaches (a VAE, a text encoder,
        # another model): not part of the step the plan predicts, so not of its measured peak.
        self._others_bytes = 0
        self._hook: Any = None
        self._attached = False
        self._checkpoint = (checkpoint, prefix, strict)
        self._master_memory = master_memory
        self._block_loader = block_loader
        self._host_memory_asked = host_memory  # fit's host_memory= (see _host_memory)
        # (original layer, its checkpoint prefix): layers quantized while read from checkpoint
        self._refill: list[tuple[nn.Module, str]] = []
        try:
            self._apply(blocks)
        except BaseException:
            self._undo()
            raise
        self._attached = True

    # -- applying ---------------------------------------------------------------------------

    def _apply(self, blocks: str | Sequence[str]) -> None:
        model, plan = self.model, self.plan
        if self.device.type == "cuda":
            own = sum(t.numel() * t.element_size()
                      for t in (*model.parameters(), *model.buffers()) if t.device == self.device)
            self._others_bytes = max(0, int(torch.cuda.memory_allocated(self.device)) - own)
        checkpoint, prefix, strict = self._checkpoint
        packed = [name for name, fmt in plan.formats.items() if fmt != "bf16"]
        for name in packed:
            if checkpoint is not None:  # read and quantized one layer at a time
                self._load_quantized_block(name, plan.formats[name])
            else:
                self._quantize_block(name, plan.formats[name])
        if plan.dequantize_together:  # each block's layers dequantized at once, per call
            for name in packed:
                group_dense(model.get_submodule(name), self._dense)
        skip = packed if checkpoint is not None else []
        if self._compile_mode is not None:  # innermost: before checkpointing and swapping
            self._compiled = compile_blocks(model, list(plan.block_order) or blocks,
                                            mode=self._compile_mode)
        if plan.ffn_chunks > 1:  # the layers' own forwards: beneath checkpointing, swapping
            from vramkit.offload.chunked import chunk_feed_forwards

            self._chunked = chunk_feed_forwards(model, list(plan.block_order),
                                                plan.ffn_chunks)
        if plan.subblock_checkpoint:  # the parts' forwards: beneath the blocks' checkpoints
            from vramkit.offload.subblock import checkpoint_block_parts

            self._parts = checkpoint_block_parts(model, list(plan.block_order))
        if plan.mode == "train" and plan.checkpointed:
            todo = [n for n in plan.checkpointed if not is_checkpointed(model.get_submodule(n))]
            if todo:
                self._checkpointed = enable_gradient_checkpointing(model, todo)
        if plan.swapped:
            swap_trainable = plan.trainable == "swap"
            self.swapper = BlockSwapper(model, blocks, config=SwapConfig(
                swapped_blocks=plan.swapped, num_slots=max(1, plan.num_slots),
                host_budget=plan.swap_host_budget,
                compress="on" if plan.compress_masters else "off",
                compressed_blocks=(plan.compressed_blocks or None) if plan.compress_masters
                else None, **_host_memory(
                    plan, self._host_memory_asked, self._master_memory, self._block_loader),
                **({"trainable": "swap"} if swap_trainable else {})),
                device=self.device, checkpoint=checkpoint, prefix=prefix, strict=strict,
                master_memory=self._master_memory, block_loader=self._block_loader,
                **({"checkpoint_skip": skip} if skip else {}),
                **({"optimizer": self._optimizer} if swap_trainable else {}))
        elif checkpoint is not None:
            from vramkit.io.loader import MemoryEfficientLoader

            result = MemoryEfficientLoader(self.device).load_into(
                model, checkpoint, prefix=prefix, strict=strict, skip=skip)
            # load_into puts new tensor objects in the module: detach leaves them on the CPU.
            loaded = set(result.loaded_keys)
            state = model.state_dict(keep_vars=True)
            self._moved += [(state[k], torch.device("cpu")) for k in state if k in loaded]
            for name in skip:  # blocks quantized while read: loaded on the CPU, used here
                block = model.get_submodule(name)
                for t in (*block.parameters(), *block.buffers()):
                    if t.device != self.device:
                        self._moved.append((t, t.device))
                        t.data = t.data.to(self.device)
        else:
            for t in (*model.parameters(), *model.buffers()):
                if t.device != self.device:
                    self._moved.append((t, t.device))
                    t.data = t.data.to(self.device)
        if plan.activation_offload:
            self._offload = _patch.install(model, _OffloadingForward(ActivationOffloader(
                device=self.device)))
        others = [f for f in _OBSERVING if f is not self and f.device == self.device]
        if others:
            # another fitted model is still observing its first steps here: resetting the
            # device's peak would cut its window short, and what each does lands in the other's
            self._shared = True
            for other in others:
                other._shared = True
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        _OBSERVING.add(self)
        self._hook = model.register_forward_pre_hook(self._on_forward)
        model.__dict__[FITTED_MARK] = True

    def _load_quantized_block(self, name: str, fmt: str) -> None:
        """Fill block ``name`` (on meta) from the checkpoint, quantizing each layer as its
        weight arrives (``load_into(quantization=)``): the block never exists in full
        precision. Detach puts the original layers back, filled from the checkpoint again."""
        from vramkit.io.loader import load_into
        from vramkit.planning.w8a8 import storage_config

        checkpoint, prefix, strict = self._checkpoint
        block = self.model.get_submodule(name)
        keep = tuple(trainable_module_names(block))
        before = dict(block.named_modules())
        load_into(block, checkpoint, prefix=f"{prefix or ''}{name}.", strict=strict,
                  quantization=storage_config(fmt, keep),
                  use_mmap=False, progress=False)
        for owner, attr, qual, module in _replaced(block, before):
            # the original layer was on meta: detach refills it from the file
            self._originals.append((owner, attr, module, []))
            self._refill.append((module, f"{prefix or ''}{name}.{qual}."))

    def _quantize_block(self, name: str, fmt: str) -> None:
        from vramkit.planning.w8a8 import storage_config
        from vramkit.quant.model import quantize_model

        block = self.model.get_submodule(name)
        keep = tuple(trainable_module_names(block))
        before = dict(block.named_modules())
        # quantize_model releases a replaced layer's weights: keep their storage (no copy) so
        # detach() can put the very same bytes back.
        held = {id(m): [(t, t.data) for t in (*m._parameters.values(), *m._buffers.values())
                        if t is not None] for m in before.values()}
        # a W8A8 format: the frozen linears become W8A8Linear (no dequantizing at all)
        quantize_model(block, storage_config(fmt, keep))
        for owner, attr, _, module in _replaced(block, before):
            self._originals.append((owner, attr, module, held[id(module)]))

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        for other in _OBSERVING:
            if other is not self and other.device == self.device:
                other._shared = True  # this model's call lands in the other's window
        if self._report is not None and len(self._marks) > self._observe_steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._marks.append(time.perf_counter())
        if len(self._marks) == self._observe_steps + 1:
            self._report = self._measure()
            _OBSERVING.discard(self)
            logger.info("vramkit.fit %s", self._report.describe())
            if (self._report.measured_peak_bytes is not None and not self._report.shared
                    and self._report.measured_peak_bytes > self.plan.budget_bytes):
                logger.warning("vramkit.fit: the measured peak %s is above the budget %s",
                               format_size(self._report.measured_peak_bytes),
                               format_size(self.plan.budget_bytes))

    def _measure(self) -> FitReport:
        steps = max(0, len(self._marks) - 1)  # no forward yet: no mark to count from
        durations = [b - a for a, b in zip(self._marks, self._marks[1:], strict=False)]
        measured = statistics.median(durations[1:] or durations) if durations else None
        peak = (int(torch.cuda.max_memory_allocated(self.device)) - self._others_bytes
                if self.device.type == "cuda" else None)
        runs_on, same = planned_here(self.plan.machine, self.device)
        return FitReport(steps=steps, budget_bytes=self.plan.budget_bytes,
                         predicted_peak_bytes=self.plan.predicted_peak_bytes,
                         measured_peak_bytes=peak,
                         predicted_step_seconds=self.plan.predicted_step_seconds,
                         measured_step_seconds=measured,
                         host_bound=self.plan.host_bound_phases,
                         planned_for=self.plan.machine, runs_on=runs_on,
                         same_machine=same, shared=self._shared)

    # -- public -----------------------------------------------------------------------------

    def report(self) -> FitReport:
        """The prediction next to what was measured so far (step times need two calls of the
        model: one step is the time between two forwards)."""
        if self._report is not None:
            return self._report
        return self._measure()

    def stats(self) -> dict[str, Any]:
        """The swapper's counters (when swapping), the report so far, and the bytes of the
        buffer packed blocks are dequantized into (``dense_scratch_bytes``)."""
        out: dict[str, Any] = {"plan": self.plan.to_dict(), "report": self.report().__dict__,
                               "dense_scratch_bytes": self._dense.nbytes}
        if self.swapper is not None:
            out["swap"] = self.swapper.stats().as_dict()
        return out

    def detach(self) -> None:
        """Give the model back exactly as it was: the swapper detached, checkpointing and
        activation offload removed, the original (unquantized) layers back, tensors on their
        devices.

        Raises:
            OffloadError: when called twice.
        """
        if not self._attached:
            raise OffloadError("this Fitted model is already detached",
                               hint="Call vramkit.fit(...) again to apply a plan anew.")
        self._attached = False
        self._undo()

    def _undo(self) -> None:
        _OBSERVING.discard(self)
        self.model.__dict__.pop(FITTED_MARK, None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._offload is not None:
            _patch.restore(self.model, self._offload)
            self._offload = None
        if self.swapper is not None:
            self.swapper.detach()
            self.swapper = None
        for tensor, device in self._moved:
            tensor.data = tensor.data.to(device)
        self._moved = []
        if self._checkpointed:
            disable_gradient_checkpointing(self.model, self._checkpointed)
            self._checkpointed = []
        if self._compiled:
            uncompile_blocks(self.model)
            self._compiled = []
        if self._parts:
            from vramkit.offload.subblock import uncheckpoint_parts

            uncheckpoint_parts(self.model)
            self._parts = []
        if self._chunked:
            from vramkit.offload.chunked import unchunk_feed_forwards

            unchunk_feed_forwards(self.model)
            self._chunked = []
        ungroup_dense(self.model)
        self._dense.release()
        for owner, attr, module, tensors in reversed(self._originals):
            for tensor, data in tensors:
                tensor.data = data
            setattr(owner, attr, module)
        self._originals = []
        if self._refill:  # quantized while loading: full precision again, from the file
            from vramkit.io.loader import load_into

            checkpoint = self._checkpoint[0]
            for module, prefix in self._refill:
                load_into(module, checkpoint, prefix=prefix, strict=True, use_mmap=False,
                          progress=False)
            self._refill = []

    def __enter__(self) -> Fitted:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._attached:
            self.detach()

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (f"Fitted({len(self.plan.swapped)} swapped, {len(self.plan.checkpointed)} "
                f"checkpointed, predicted {self.plan.predicted_step_seconds * 1e3:.0f} ms, "
                f"{state})")


def fit(model: nn.Module, example_inputs: Any, budget: int | str, *,
        device: str | int | torch.device | None = None,
        plan: Plan | str | os.PathLike[str] | None = None,
        observe_steps: int = 3, checkpoint: str | os.PathLike[str] | None = None,
        prefix: str | None = None, strict: bool = True,
        master_memory: MasterMemory | None = None, block_loader: BlockLoader | None = None,
        compile: bool | str = False,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        **plan_options: Any) -> Fitted:
    """Plan ``model`` for ``budget`` and apply the plan; train or run the model as usual.

    Args:
        model: the model with its weights (on the CPU, or anywhere), trainable parameters
            marked (LoRA adapters added, the base frozen).
        example_inputs: as for :func:`vramkit.plan`.
        budget: as for :func:`vramkit.plan`.
        device: where to run (default: the current CUDA device).
        plan: a plan made earlier for this model, or the path of one saved with
            :meth:`Plan.save <vramkit.planning.record.Plan.save>`: applied as it is, without
            searching again (default: made now with ``plan_options``).
        observe_steps: steps after which the prediction is checked (logged; :meth:`Fitted.report`).
        checkpoint: a safetensors checkpoint to fill ``model`` from while the plan is applied
            (``model`` may then be on the meta device): swapped blocks are read straight into
            their pinned masters, the rest goes to ``device`` (``BlockSwapper(checkpoint=)``).
            Blocks the plan stores in a packed format (``allow_formats``) are read first, one
            layer at a time, each quantized as its weight arrives (a block never exists in
            full precision; ``detach()`` refills the original layers from the file). With a
            ``host_budget`` plan option, its disk's read speed is measured first (up to 256 MiB)
            for the disk tier's prediction (``disk_bytes_per_s``); without one, the file is
            read into the page cache on background threads while the plan is made, where it
            fits there (:func:`vramkit.io.prefetch.prefetch_checkpoint`).
        prefix: with ``checkpoint``, the prefix its names carry.
        strict: with ``checkpoint``, refuse missing or unexpected keys (default ``True``).
        master_memory: where the swapper keeps frozen masters
            (``BlockSwapper(master_memory=)``; :func:`vramkit.distributed.fit_rank` passes
            memory shared by a node's ranks). Default: the swapper's own pinned pool.
        block_loader: how the swapper fills its slots (``BlockSwapper(block_loader=)``;
            :func:`vramkit.distributed.fit_rank` passes sharded uploads over NVLink).
        compile: ``torch.compile`` each block's own forward beneath checkpointing and swapping
            (:func:`vramkit.offload.compiled.compile_blocks`): ``True`` for the default mode, or
            a mode of :data:`~vramkit.offload.compiled.COMPILE_MODES` (default ``False``). A
            plan made here times the blocks compiled on a measured GPU (``vramkit.plan(...,
            compile=)``); offline, it prices them as eager and says so in its notes.
        **plan_options: the keyword arguments of :func:`vramkit.plan` (``mode``,
            ``hardware``, ``allow_formats``, ``host_budget``, ``headroom``, ``step``, ...).

        optimizer: for a plan with ``trainable="swap"`` (full fine-tuning with swapped
            optimizer state): the factory that makes each swapped block's optimizer over its
            parameters (``BlockSwapper(optimizer=)``); the swapper then steps them in backward,
            and ``fitted.swapper.optimizer_parameters()`` are the rest, for your optimizer.

    On a GPU, fit lets PyTorch's caching allocator grow expandable segments unless its
    segment policy was chosen already (:func:`vramkit.devices.env.prefer_expandable_segments`;
    ``PYTORCH_ALLOC_CONF=expandable_segments:False`` keeps the default): the plan's headroom
    does not cover the default allocator's fragmentation around large activations. The plan's
    notes say when it did.

    Returns:
        The :class:`Fitted` model; :meth:`Fitted.detach` restores it exactly.

    Raises:
        ConfigError: for a model on the meta device (fit needs the weights).
        PlanError: when no plan fits the budget, or when a fit plan or a ``BlockSwapper`` is
            still attached to the model (detach it first).
    """
    check_int("observe_steps", observe_steps, minimum=1)
    refuse_attached(check_model(model))  # before anything is planned or applied
    compile_mode = _compile_mode(compile)
    if checkpoint is None and any(t.device.type == "meta"
                                  for t in (*model.parameters(), *model.buffers())):
        raise ConfigError("vramkit.fit needs the model's weights, and some are on the meta "
                          "device",
                          hint="Pass checkpoint=path to load them as the plan is applied, load "
                               "them first (vramkit.load_into(model, path)), or call "
                               "vramkit.plan for a plan without weights.")
    target = resolve_device(device, owner="vramkit.fit")
    if checkpoint is not None:
        _prepare_packed_layers(model, checkpoint, prefix)
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    if plan is None:
        if checkpoint is not None and plan_options.get("host_budget") is None:
            # the disk reads while the plan is made (a disk tier's plan times the cold disk)
            from vramkit.io.prefetch import prefetch_checkpoint

            prefetch_checkpoint(checkpoint)
        if target.type == "cuda" and plan_options.get("hardware") is None:
            plan_options.setdefault("device", target)  # measure the GPU it will run on
        if (checkpoint is not None and plan_options.get("host_budget") is not None
                and plan_options.get("disk_bytes_per_s") is None):
            # A host budget may keep blocks on disk, read from this checkpoint: time its disk.
            from vramkit.io.disk import measure_read_bandwidth

            read = measure_read_bandwidth(checkpoint, max_bytes="256MiB")
            plan_options["disk_bytes_per_s"] = read.bytes / max(read.seconds, 1e-9)
        cpu_headroom = target.type == "cpu" and plan_options.get("headroom") is None
        if cpu_headroom:  # the default headroom is for a GPU's allocator and context
            plan_options["headroom"] = 0
        if compile_mode is not None:  # timed (or noted) as the blocks will run
            plan_options.setdefault("compile", compile_mode)
        if (plan_options.get("trainable") == "swap" and optimizer is not None
                and plan_options.get("optimizer_state_bytes") is None):
            # the swapped blocks' state moves every step: priced at what this optimizer keeps
            per_param = optimizer_state_bytes(optimizer, model, target)
            if per_param is not None:
                plan_options["optimizer_state_bytes"] = per_param
        plan = make_plan(model, example_inputs, budget, **plan_options)
        if cpu_headroom:
            plan = dataclasses.replace(plan, notes=(
                *plan.notes, "Runs on the CPU: no headroom kept (the default headroom is for a "
                "GPU's caching allocator and CUDA context)."))
    if plan.trainable == "swap" and plan.swapped and optimizer is None:
        raise ConfigError("the plan swaps trainable blocks with their optimizer state "
                          "(trainable='swap'): fit needs the factory of their optimizers",
                          hint="Pass optimizer=lambda params: torch.optim.AdamW(params, "
                               "lr=...) (or vramkit.AdamW8bit).")
    if target.type == "cuda":  # before the slots and activations are allocated
        allocator = prefer_expandable_segments()
        if allocator is not None:
            logger.info("vramkit.fit: %s", allocator)
            plan = dataclasses.replace(plan, notes=(*plan.notes, allocator))
    # A plan of split blocks names its units: the swapper takes exactly those.
    blocks = list(plan.block_order) if plan.split else plan_options.get("blocks", "auto")
    return Fitted(model, plan, target, blocks=blocks, observe_steps=observe_steps,
                  checkpoint=checkpoint, prefix=prefix, strict=strict,
                  master_memory=master_memory, block_loader=block_loader,
                  compile_mode=compile_mode,
                  host_memory=plan_options.get("host_memory", "auto"), optimizer=optimizer)


#: Elements of the probe parameter :func:`optimizer_state_bytes` steps (large enough that a
#: block-quantized state's per-block scales count as they do on a real layer).
STATE_PROBE_ELEMENTS = 1 << 16


def optimizer_state_bytes(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                          model: nn.Module, device: torch.device) -> float | None:
    """Bytes of state ``factory``'s optimizer keeps per parameter, measured: one step over a
    probe parameter of the model's trainable dtype on ``device`` (an 8-bit AdamW about 2,
    AdamW over bf16 parameters 4, over fp32 parameters 8). ``None`` where the probe fails (an
    optimizer that needs more than a parameter and its gradient): the planner then prices
    AdamW's fp32 moments, and the log says why."""
    dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float32)
    try:
        probe = nn.Parameter(torch.zeros(STATE_PROBE_ELEMENTS, dtype=dtype, device=device))
        probe.grad = torch.zeros_like(probe)
        opt = factory([probe])
        opt.step()
        state = opt.state.get(probe, {})
        held = sum(t.numel() * t.element_size() for t in state.values()
                   if isinstance(t, torch.Tensor))
    except Exception as exc:  # an arbitrary user factory: any failure means "not measured"
        logger.info("vramkit.fit: could not measure the optimizer's state per parameter (%s); "
                    "the plan prices AdamW's fp32 moments", exc)
        return None
    return held / STATE_PROBE_ELEMENTS


def _prepare_packed_layers(model: nn.Module, checkpoint: str | os.PathLike[str],
                           prefix: str | None) -> None:
    """A GGUF checkpoint's quantized linears become :class:`~vramkit.quant.gguf.GGUFLinear`
    layers before the plan, so the planner prices (and the swapper moves) the file's packed
    bytes, not a bf16 copy of them; other formats load into the layers as they are."""
    from vramkit.io.formats import detect_format, prepare_module

    if detect_format(checkpoint).container == "gguf":
        prepare_module(model, checkpoint, prefix=prefix)


def _host_memory(plan: Plan, asked: object, master_memory: object,
                 block_loader: object) -> dict[str, Any]:
    """The swapper's ``host_memory``: pageable where the plan priced pageable masters, pinned
    where pinned was asked for, else ``"auto"`` (the swapper decides on the host it runs on,
    which an offline or saved plan did not see). Masters in shared memory or filled by a
    collective loader stay as the swapper decides (pinned)."""
    if master_memory is not None or block_loader is not None:
        return {}
    if plan.host_memory == "pageable":
        return {"host_memory": "pageable",
                "staging_pool": plan.staging_pool_bytes or SwapConfig().staging_pool}
    return {"host_memory": "pinned" if asked == "pinned" else "auto"}


def _compile_mode(compile: object) -> str | None:
    """``fit``'s ``compile`` as a ``torch.compile`` mode, or ``None`` for no compiling."""
    if isinstance(compile, bool):
        return "default" if compile else None
    if isinstance(compile, str):
        return check_choice("compile", compile, COMPILE_MODES,
                            hint="True compiles with torch.compile's default mode; CUDA-graph "
                                 "modes are refused for swapped blocks.")
    raise ConfigError(f"compile must be a bool or a mode name, got {type(compile).__name__}",
                      hint=f"compile=True, or one of {', '.join(COMPILE_MODES)}.")


def _replaced(block: nn.Module, before: dict[str, nn.Module]
              ) -> list[tuple[nn.Module, str, str, nn.Module]]:
    """``(owner, attribute, qualified name, original)`` of each submodule of ``block`` that is
    no longer where ``before`` (``dict(block.named_modules())`` earlier) had it: the layers a
    quantization replaced."""
    after = dict(block.named_modules())
    out = []
    for qual, module in before.items():
        if qual and after.get(qual) is not module:
            parent, _, attr = qual.rpartition(".")
            out.append((block.get_submodule(parent) if parent else block, attr, qual, module))
    return out
