"""What a model costs, block by block, measured on the meta device (nothing allocated, nothing
computed): FLOPs forward and backward, activation bytes with and without checkpointing, and
weight bytes in each storage format by the swapper's own rule.

One pass runs the step (forward and loss, then backward for training) under a FLOP counter
(``torch.utils.flop_counter``, attributed to modules), the activation accounting of
:mod:`vramkit.planning.activations` and, optionally, bf16 autocast for meta tensors. Attention is
replaced by a stand-in that saves what fused kernels save, so its FLOPs are counted there
(forward: ``q @ k^T`` and ``p @ v``; backward: 2.5x, the five matmuls of a flash-attention
backward). Storage formats are measured on quantized copies of each block built on the meta
device with the exact packed layout. The forward also counts, by block, the kernels it would
launch and the bytes its kernels other than matmuls and attention move (:class:`Work`): what
an offline plan times beside the FLOPs (:meth:`vramkit.planning.machine.Machine.work_seconds`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from vramkit._validate import check_choice
from vramkit.errors import ConfigError, PlanError
from vramkit.offload import _patch
from vramkit.offload._reach import (
    closure_tensors,
    copy_reaching,
    outside_modules,
    reached_modules,
)
from vramkit.offload.blocks import find_blocks
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.planning._meta import MetaAutocast, meta_autocast_checks, quantize_on_meta
from vramkit.planning.activations import ActivationEstimate, activation_accounting
from vramkit.planning.w8a8 import W8A8_FORMATS, LinearCall
from vramkit.quant.dense import dense_nbytes

__all__ = ["FORMATS", "BlockCost", "ModelCost", "Work", "analyze", "default_step", "meta_copy",
           "to_meta"]

logger = logging.getLogger(__name__)

#: Storage formats a plan may choose for a block's frozen weights: as built, weight-only packed
#: (dequantized at each call), or W8A8 (:mod:`vramkit.planning.w8a8`: the same bytes as fp8 /
#: int8, both matmuls of each frozen linear in 8 bits).
FORMATS = ("bf16", "fp8", "int8", "nf4", "int4", *W8A8_FORMATS)
#: Backward of fused attention over its forward (flash attention: 5 matmuls vs 2).
ATTENTION_BACKWARD_FACTOR = 2.5
_MODES = ("train", "infer")


@dataclass(frozen=True)
class Work:
    """What one forward of a block (or of everything outside the blocks) asks of the device,
    as counted on meta: the time model of an offline plan prices each part.

    Attributes:
        matmul_flops: FLOPs of matmuls and convolutions.
        attention_flops: FLOPs of fused attention (half of the pairs when causal).
        elementwise_bytes: bytes read and written by every other kernel (norms, activations,
            casts, rotary embeddings, ...): memory-bound work.
        kernels: kernels launched (view operations excluded): each costs the host its
            dispatch and the device a launch.
        convolutions: of those, convolutions (cuDNN calls: dearer for the host).
    """

    matmul_flops: float
    attention_flops: float
    elementwise_bytes: float
    kernels: int
    convolutions: int = 0


@dataclass(frozen=True)
class BlockCost:
    """One block's costs.

    Attributes:
        name: qualified module name.
        forward_flops / backward_flops: FLOPs of one call and of its backward.
        activations: bytes it saves for backward without checkpointing.
        inputs: bytes of its inputs (what it keeps when checkpointed).
        swapped: format -> bytes of its flat master (its share of a GPU slot) when swapped
            (0: nothing in it is swappable).
        kept: format -> bytes of its frozen tensors that stay on the device even when it is
            swapped (small tensors).
        adapters: bytes of its trainable parameters (always on the device).
        work: its forward's :class:`Work` (``None`` when not counted: FLOPs alone then).
        dense: format -> bytes of its quantized linears dequantized in the compute dtype (the
            share of the device buffer a packed block's call dequantizes them into,
            :mod:`vramkit.quant.dense`; absent or 0 for ``"bf16"``).
        linear_calls: the calls of its frozen linears a W8A8 format would replace, in the
            order they ran (what :func:`~vramkit.planning.w8a8.w8a8_change` prices).
    """

    name: str
    forward_flops: float
    backward_flops: float
    activations: int
    inputs: int
    swapped: Mapping[str, int]
    kept: Mapping[str, int]
    adapters: int
    work: Work | None = None
    dense: Mapping[str, int] = field(default_factory=dict)
    linear_calls: tuple[LinearCall, ...] = ()

    def resident_bytes(self, fmt: str) -> int:
        """Frozen bytes on the device when the block stays resident in ``fmt``."""
        return self.swapped[fmt] + self.kept[fmt]


@dataclass(frozen=True)
class ModelCost:
    """A model's costs for one step (see :func:`analyze`).

    Attributes:
        mode: ``"train"`` or ``"infer"``.
        blocks: the blocks in execution order.
        outside_bytes: frozen bytes outside the blocks (embedders, final layers).
        outside_forward_flops / outside_backward_flops: their FLOPs.
        trainable_params: parameters that require grad (LoRA adapters, or everything).
        trainable_bytes: their bytes.
        activations: the activation estimate by block (batch of the example inputs).
        formats: the formats measured (always ``"bf16"`` first: the model as built).
        seconds: how long the analysis took.
        outside_work: the forward :class:`Work` outside the blocks (``None``: not counted).
        foreign_reads: blocks whose tensors an op took outside the block's own call (code
            around the block reading its weight), in execution order: swapped, such a block
            would hand that op an unloaded placeholder.
        repeated_calls: blocks called more than once in the step, in execution order (a
            swapper's ring learns one call per block and pass; the time model prices one).
        lean_refused: block name -> why the lean checkpoint cannot take it (it reads a
            trainable tensor that is neither its input, its parameter nor an adapter hooked
            into it: checkpointed, it keeps PyTorch's checkpoint), from the training step.
    """

    mode: str
    blocks: tuple[BlockCost, ...]
    outside_bytes: int
    outside_forward_flops: float
    outside_backward_flops: float
    trainable_params: int
    trainable_bytes: int
    activations: ActivationEstimate
    formats: tuple[str, ...]
    seconds: float = 0.0
    block_index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    outside_work: Work | None = None
    foreign_reads: tuple[str, ...] = ()
    repeated_calls: tuple[str, ...] = ()
    lean_refused: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_index", {b.name: i for i, b in enumerate(self.blocks)})

    @property
    def forward_flops(self) -> float:
        return self.outside_forward_flops + sum(b.forward_flops for b in self.blocks)

    @property
    def backward_flops(self) -> float:
        return self.outside_backward_flops + sum(b.backward_flops for b in self.blocks)

    def weight_bytes(self, fmt: str = "bf16") -> int:
        """Frozen bytes of the whole model with every block stored in ``fmt``."""
        return self.outside_bytes + sum(b.resident_bytes(fmt) for b in self.blocks)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_model(model: Any) -> nn.Module:
    """``model``, refused unless it is an ``nn.Module`` (named by its type: a model's repr
    runs to pages).

    Raises:
        ConfigError: for anything else (``None``, a function, a preset's name, a pipeline).
    """
    if isinstance(model, nn.Module):
        return model
    hint = ("A preset's name is for the command line (vramkit plan NAME); in Python, build it: "
            "vramkit.recipes.targets.build_target(NAME).model." if isinstance(model, str)
            else "Pass the torch.nn.Module to plan: a pipeline's transformer or UNet, not the "
                 "pipeline, nor a function.")
    raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}", hint=hint)


#: Set in a model's ``__dict__`` while :func:`vramkit.fit` has a plan applied to it.
FITTED_MARK = "_vramkit_fitted"
#: Wrapper kinds that own a module's weights while attached, with what attached them and how
#: to take it off: a plan of such a model would price what they made of it, and a copy of it
#: cannot be made (their streams, threads and pinned memory are live).
_OWNING_WRAPPERS = {"swap": ("a BlockSwapper", "swapper.detach()"),
                    "cpu_offload": ("a CPUOffloadManager", "manager.restore()")}


def refuse_attached(model: nn.Module) -> None:
    """Refuse a model that a :func:`vramkit.fit` plan, a ``BlockSwapper`` or a
    ``CPUOffloadManager`` is still attached to (checkpoint and compile wrappers are fine).

    Raises:
        PlanError: naming what is attached and how to detach it.
    """
    if model.__dict__.get(FITTED_MARK):
        raise PlanError("the model has a vramkit.fit plan applied: planning or fitting it "
                        "again would stack a second plan on the first",
                        hint="Call fitted.detach() on what vramkit.fit returned first (or keep "
                             "using that Fitted model as it is).")
    for kind, (owner, detach) in _OWNING_WRAPPERS.items():
        held = [name or type(model).__name__ for name, module in model.named_modules()
                if any(w.kind == kind and w.active for w in _patch.wrappers(module))]
        if held:
            shown = ", ".join(held[:3]) + (f" (and {len(held) - 3} more)" if len(held) > 3
                                           else "")
            raise PlanError(f"{shown} {'is' if len(held) == 1 else 'are'} held by {owner} "
                            "still attached to the model: a plan would price what it made of "
                            "the model, and its live state cannot be copied",
                            hint=f"Call {detach} first, then plan or fit the model.")


def _reached_tensors(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters (closures' tensors included) and buffers a step of ``model`` reads.
    Adapters hooked in from outside the model (a kohya-style LoRA network beside it) count:
    a layer's replaced forward is bound to them."""
    holders = [model, *outside_modules(model)]
    params = list(dict.fromkeys((*(p for m in holders for p in m.parameters()),
                                 *closure_tensors(model))))
    buffers = list(dict.fromkeys(b for m in holders for b in m.buffers()))
    return params, buffers


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` itself when it is on the meta device, else a copy whose parameters and buffers
    are meta tensors of the same shapes, dtypes and ``requires_grad`` (no data is copied).

    Raises:
        ConfigError: when ``model`` is no ``nn.Module``.
        PlanError: when something that owns the model's weights is attached
            (:func:`refuse_attached`).
    """
    refuse_attached(check_model(model))
    params, buffers = _reached_tensors(model)
    if all(t.device.type == "meta" for t in (*params, *buffers)):
        return model
    memo: dict[int, Any] = {}
    for p in params:
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in buffers:
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy_reaching(model, memo)


def to_meta(value: Any) -> Any:
    """``value`` (a tensor, or lists, tuples and dicts of them) with every tensor as a meta
    tensor of the same shape and dtype (floats keep ``requires_grad``)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return value
        out = torch.empty_like(value, device="meta")
        return out.requires_grad_(value.requires_grad) if value.is_floating_point() else out
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


def default_step(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Run ``model`` on ``inputs`` (a tuple of positional arguments or a dict of keyword ones)
    and reduce its floating-point outputs to a scalar (what a loss would cost, roughly).

    Raises:
        ConfigError: for ``inputs`` neither a tuple (or list) nor a mapping: a lone tensor
            would be unpacked along its first dimension.
    """
    if not isinstance(inputs, (tuple, list, Mapping)):
        raise ConfigError(f"example inputs must be a tuple of positional arguments or a dict of "
                          f"keyword arguments for the model's forward, got "
                          f"{type(inputs).__name__}",
                          hint="Wrap a single tensor as (x,), or pass step=lambda model, "
                               "inputs: loss to feed the model other inputs.")
    out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
    tensors = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ConfigError(f"{type(model).__name__} returned no floating-point tensor",
                          hint="Pass step=lambda model, inputs: <a scalar loss> to plan().")
    total = tensors[0].float().mean()
    for t in tensors[1:]:
        total = total + t.float().mean()
    return total


def _short(exc: BaseException, model: nn.Module, limit: int = 300) -> str:
    """``exc``'s text for an error message: the model's repr (Python puts a callable's repr in
    some TypeErrors) by its type's name, and at most ``limit`` characters."""
    text = str(exc)
    if "\n" in text or len(text) > limit:
        text = text.replace(repr(model), type(model).__name__)
        text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    for attr in ("sample", "logits", "last_hidden_state"):  # diffusers / transformers outputs
        inner = getattr(value, attr, None)
        if isinstance(inner, torch.Tensor):
            return [inner]
    return []


#: Operators that launch no kernel (besides views, which ``OpOverload.is_view`` names).
_NO_KERNEL = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                        torch.ops.aten.empty_like.default, torch.ops.aten.detach.default,
                        torch.ops.aten.lift_fresh.default})
_CONVOLUTIONS = frozenset({torch.ops.aten.convolution, torch.ops.aten._convolution})


class _KernelCounter(TorchDispatchMode):
    """Kernels and the bytes of the non-matmul ones, by the block running (``saved.current``
    of the activation accounting; ``None`` outside every block)."""

    def __init__(self, saved: Any) -> None:
        super().__init__()
        self.saved = saved
        self.kernels: dict[str | None, int] = {}
        self.bytes: dict[str | None, int] = {}
        self.convolutions: dict[str | None, int] = {}
        # operator -> 0 no kernel, 1 matmul, 2 memory-bound, 3 convolution
        self._kind: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = self._kind.get(func)
        if kind is None:
            kind = self._kind[func] = (
                0 if func.is_view or func in _NO_KERNEL
                else 3 if func.overloadpacket in _CONVOLUTIONS
                else 1 if func.overloadpacket in flop_registry else 2)
        if kind == 0:
            return out
        key = self.saved.current
        self.kernels[key] = self.kernels.get(key, 0) + 1
        if kind == 3:
            self.convolutions[key] = self.convolutions.get(key, 0) + 1
        if kind == 2:  # matmuls are timed by their FLOPs
            self.bytes[key] = (self.bytes.get(key, 0) + _moved(args) + _moved(out)
                               + (_moved(tuple(kwargs.values())) if kwargs else 0))
        return out

    def work(self, key: str | None, matmul: float, attention: float) -> Work:
        return Work(matmul, attention, float(self.bytes.get(key, 0)), self.kernels.get(key, 0),
                    self.convolutions.get(key, 0))


def _moved(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a tuple or list holding some)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_moved(v) for v in value)
    return 0


def _flop_counts(counter: FlopCounterMode) -> dict[str, float]:
    return {name: float(sum(ops.values())) for name, ops in counter.get_flop_counts().items()}


def analyze(model: nn.Module, inputs: Any, *, mode: str = "train",
            step: Callable[[nn.Module, Any], torch.Tensor] | None = None,
            blocks: str | Sequence[str] = "auto", formats: Sequence[str] = ("bf16",),
            swap_config: SwapConfig | None = None,
            autocast: torch.dtype | None = torch.bfloat16,
            found: Sequence[tuple[str, nn.Module]] | None = None) -> ModelCost:
    """Measure a model's per-block costs on the meta device.

    Args:
        model: the model (on the meta device, or a real one: a meta copy is made without
            copying data).
        inputs: a tuple of positional arguments or a dict of keyword arguments (tensors on any
            device, meta included: they are only looked at).
        mode: ``"train"`` (forward, loss, backward) or ``"infer"`` (forward only).
        step: ``step(model, inputs) -> scalar loss`` (default: the mean of the float outputs).
        blocks: ``"auto"`` or names, as :func:`vramkit.offload.blocks.find_blocks` takes them.
        formats: storage formats to measure (``"bf16"`` is always included).
        swap_config: the swapper settings whose rule decides what a swapped block moves
            (default ``SwapConfig()``; ``trainable`` follows: adapters stay resident).
        autocast: the low-precision dtype of bf16-style autocast during the step (default
            bf16; ``None``: no autocast).
        found: the blocks already found, as :func:`~vramkit.offload.blocks.find_blocks`
            returns them, of ``model`` already on the meta device (``blocks`` is then not
            read): :func:`vramkit.plan` makes one meta copy and finds its blocks once for its
            analyses and its calibration.

    Returns:
        A :class:`ModelCost`.

    Raises:
        ConfigError: for an unknown mode or format, or a model whose step cannot run on meta.
    """
    check_model(model)
    check_choice("mode", mode, _MODES)
    for fmt in formats:
        check_choice("format", fmt, FORMATS)
    started = time.perf_counter()
    rule = swap_config if swap_config is not None else SwapConfig()
    if found is None:
        meta = meta_copy(model)
        found = find_blocks(meta, blocks)
    else:
        meta = model
    # A model on meta is traced as it is: its backward below must leave no gradient on it
    # (a meta .grad is carried into the weights' materialization -- to_empty -- as an
    # uninitialized one, which the first real backward would then add to).
    traced = _reached_tensors(meta)[0]
    had_grad = {id(p) for p in traced if p.grad is not None}
    found = list(found)
    names = [n for n, _ in found]
    meta_inputs = to_meta(inputs)
    run = step if step is not None else default_step
    counter = FlopCounterMode(display=False)
    linear_calls, hooks = _count_linear_calls(found, mode == "train")
    lean_refused, lean_hooks = _lean_checks(found, mode == "train")
    hooks += lean_hooks
    try:
        with counter:
            with activation_accounting(meta, names) as saved, _KernelCounter(saved) as kernels:
                context = MetaAutocast(autocast) if autocast is not None else None
                with meta_autocast_checks(context):
                    if context is not None:
                        with context:
                            loss = run(meta, meta_inputs)
                    else:
                        loss = run(meta, meta_inputs)
            forward = _flop_counts(counter)
            if mode == "train":
                if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                    raise ConfigError(
                        "the training step's loss does not require grad: nothing is trainable",
                        hint="Add LoRA adapters (peft) or unfreeze the parameters to train, or "
                             "plan with mode='infer'.")
                # The counter's module tracker puts hooks on every module call: in the
                # backward a checkpointed part (offload.subblock) runs its forward again, and
                # the hooks' closures kept each recomputed part alive in reference cycles
                # until the step's end (Wan's blocks read 4 GiB more a block, as many as had
                # gone before). Its per-module backward figures are not read (the backward
                # total is shared by the forward's, below): the hooks go before the backward.
                tracker = getattr(counter, "mod_tracker", None)
                if tracker is not None:
                    tracker.__exit__()
                # under the forward's autocast: a checkpointed part runs its forward again
                with (saved.following_backward(meta), meta_autocast_checks(context),
                      context if context is not None else contextlib.nullcontext()):
                    loss.backward()
            total = _flop_counts(counter)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise ConfigError(f"{type(model).__name__} cannot run its step on the meta device: "
                          f"{_short(exc, model)}",
                          hint="Check example_inputs against the model's forward, or pass a "
                               "step=lambda model, inputs: loss that runs it.") from exc
    finally:
        for hook in hooks:
            hook.remove()
        for p in traced:
            if id(p) not in had_grad:
                p.grad = None
    root = type(meta).__name__
    attention = saved.attention_flops
    estimate = saved.estimate()
    all_formats = ("bf16", *[f for f in dict.fromkeys(formats) if f != "bf16"])
    footprints = _footprints(meta, found, all_formats, rule, autocast)
    # The FLOP counter's per-module attribution is exact in forward; in backward it is not
    # (its module tracker can lose its place in large graphs), so the backward total (exact)
    # is shared among the blocks by their forward matmul FLOPs: a frozen layer's backward is
    # its input gradient (1x), a trainable one's adds the weight gradient (2x), the same for
    # every block of a model trained one way. Attention's backward is counted apart.
    matmul = {name: forward.get(f"{root}.{name}", 0.0) for name in names}
    matmul_total = forward.get("Global", 0.0)
    backward_matmul = (total.get("Global", 0.0) - matmul_total) if mode == "train" else 0.0
    costs = []
    modules = dict(found)
    for name in estimate.per_block:  # execution order, as the step ran the blocks
        module = modules[name]
        attn = attention.get(name, 0)
        share = matmul[name] / matmul_total if matmul_total else 0.0
        bwd = (share * backward_matmul + ATTENTION_BACKWARD_FACTOR * attn
               + saved.recomputed_attention.get(name, 0))
        swapped, kept, dense = footprints[name]
        adapters = sum(_nbytes(p) for p in dict.fromkeys(
            p for m in reached_modules(module) for p in m.parameters(recurse=False))
            if p.requires_grad)
        costs.append(BlockCost(name, matmul[name] + attn, bwd if mode == "train" else 0.0,
                               estimate.per_block[name], estimate.inputs[name], swapped, kept,
                               adapters, kernels.work(name, matmul[name], attn), dense,
                               tuple(linear_calls[name])))
    in_blocks = {id(t) for _, m in found for t in (*m.parameters(), *m.buffers())}
    outside = sum(_nbytes(t) for t in (*meta.parameters(), *meta.buffers())
                  if id(t) not in in_blocks and not t.requires_grad)
    block_fwd = sum(c.forward_flops for c in costs)
    block_bwd = sum(c.backward_flops for c in costs)
    total_fwd = matmul_total + sum(attention.values())
    total_bwd = (backward_matmul + ATTENTION_BACKWARD_FACTOR * sum(attention.values())
                 + sum(saved.recomputed_attention.values()))
    # with the adapters of a network kept beside the model (their gradients and optimizer state
    # take the same memory)
    trainable = [p for p in dict.fromkeys(
        (*meta.parameters(), *(p for m in outside_modules(meta) for p in m.parameters())))
        if p.requires_grad]
    result = ModelCost(
        mode=mode, blocks=tuple(costs), outside_bytes=outside,
        outside_forward_flops=max(0.0, total_fwd - block_fwd),
        outside_backward_flops=max(0.0, total_bwd - block_bwd) if mode == "train" else 0.0,
        trainable_params=sum(p.numel() for p in trainable),
        trainable_bytes=sum(_nbytes(p) for p in trainable),
        activations=estimate, formats=all_formats, seconds=time.perf_counter() - started,
        outside_work=kernels.work(None, max(0.0, matmul_total - sum(matmul.values())),
                                  attention.get(None, 0)),
        foreign_reads=tuple(c.name for c in costs if c.name in saved.foreign),
        repeated_calls=tuple(c.name for c in costs if c.name in saved.repeated),
        lean_refused=lean_refused)
    logger.debug("analyzed %s in %.1f s: %d blocks, %.1f TFLOP forward", root, result.seconds,
                 len(costs), result.forward_flops / 1e12)
    return result


def _count_linear_calls(found: Sequence[tuple[str, nn.Module]], train: bool
                        ) -> tuple[dict[str, list[LinearCall]], list[Any]]:
    """Hooks that note, block by block, each call of a frozen linear a W8A8 format would
    replace (the selection :func:`vramkit.fit` applies: layers owning trainable parameters
    kept), and the calls' list by block; remove the hooks after the step."""
    from vramkit.planning._meta import trainable_module_names
    from vramkit.planning.w8a8 import storage_config
    from vramkit.quant.model import quantizable_layers

    calls: dict[str, list[LinearCall]] = {name: [] for name, _ in found}
    hooks = []
    for name, block in found:
        config = storage_config("int8-w8a8", trainable_module_names(block))
        for _, layer in quantizable_layers(block, config):
            if not isinstance(layer, nn.Linear):
                continue

            def note(module: nn.Module, args: tuple[Any, ...], out: Any,
                     tally: list[LinearCall] = calls[name]) -> None:
                x = args[0] if args else None
                if not isinstance(x, torch.Tensor) or not x.dim():
                    return
                if torch._C._current_graph_task_id() != -1:
                    return  # a checkpointed part recomputed in the backward: counted once
                k = int(x.shape[-1])
                tally.append(LinearCall(x.numel() // max(k, 1), k, module.out_features,
                                        train and torch.is_grad_enabled() and x.requires_grad))

            hooks.append(layer.register_forward_hook(note))
    return calls, hooks


def _lean_checks(found: Sequence[tuple[str, nn.Module]], train: bool
                 ) -> tuple[dict[str, str], list[Any]]:
    """Hooks that walk each block's graph in the traced training step for trainable leaves the
    lean checkpoint would not hand its recomputation (as its first call does on the device,
    :func:`vramkit.offload._lean_checkpoint.foreign_leaves`), and the blocks found -> why;
    remove the hooks after the step."""
    from vramkit.offload._lean_checkpoint import foreign_leaves

    refused: dict[str, str] = {}
    hooks: list[Any] = []
    if not train:
        return refused, hooks
    for name, block in found:
        def check(module: nn.Module, args: Any, kwargs: Any, out: Any,
                  name: str = name) -> None:
            if name in refused or not torch.is_grad_enabled():
                return
            inputs = [t for t in _flatten((args, kwargs)) if isinstance(t, torch.Tensor)]
            params = [p for m in reached_modules(module) for p in m.parameters(recurse=False)
                      if p.requires_grad]
            foreign = foreign_leaves(out, inputs, params)
            if foreign:
                refused[name] = (f"it reads {len(foreign)} trainable tensor(s) that are "
                                 "neither its inputs, its parameters nor an adapter hooked "
                                 "into it")

        hooks.append(block.register_forward_hook(check, with_kwargs=True))
    return refused, hooks


def _footprints(meta: nn.Module, found: list[tuple[str, nn.Module]], formats: Sequence[str],
                rule: SwapConfig, autocast: torch.dtype | None
                ) -> dict[str, tuple[dict[str, int], dict[str, int], dict[str, int]]]:
    """name -> (swapped bytes, kept bytes, dequantized-view bytes) by format of each block."""
    out: dict[str, tuple[dict[str, int], dict[str, int], dict[str, int]]] = {
        n: ({}, {}, {}) for n, _ in found}
    for fmt in formats:
        for name, module in found:
            block = module if fmt == "bf16" else quantize_on_meta(copy.deepcopy(module), fmt)
            footprint = BlockSwapper.footprint(block, rule)
            adapters = sum(_nbytes(p) for p in block.parameters() if p.requires_grad)
            out[name][0][fmt] = footprint.swapped
            out[name][1][fmt] = max(0, footprint.resident - adapters)
            out[name][2][fmt] = 0 if fmt == "bf16" else dense_nbytes(block, autocast)
    return out
