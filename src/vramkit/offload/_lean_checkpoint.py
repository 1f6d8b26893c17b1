"""The lean checkpoint: a block's forward runs without autograd; backward rebuilds its graph.

PyTorch's non-reentrant checkpoint records the block's whole graph in forward -- every node, and a
saved-tensor hook call (in Python) for each tensor an op saves, only to drop what is saved -- so
its forward costs the host *more* than the block's plain forward. Training a large DiT with every
block checkpointed, the forward pass is host-bound for that reason: on an H200, FLUX.1-dev's
double block took 1.4-2.4 ms more host time per forward checkpointed than as built (the
calibration's "checkpointed" timing, ``benchmarks/plan.py``; ``benchmarks/checkpoint_method.py``
compares the methods), with ~4.6 ms of device work to hide it behind.

Here the forward is an ``autograd.Function`` whose ``forward`` runs the block with grad off: no
node is recorded and nothing is saved but the block's inputs (through the saved-tensor hooks, so
an activation offloader still moves them off the device). Its backward re-runs the block under
the forward's autocast and RNG state with grad on and differentiates it with
``torch.autograd.grad``. The block's trainable parameters are *inputs* of the Function, so their
gradients leave the backward like the inputs' and reach the parameters through the outer graph:
``torch.autograd.grad(loss, params)``, ``backward(inputs=...)``, gradient hooks and DDP's
reducer see them as they would without checkpointing (PyTorch's reentrant checkpoint instead
accumulates them inside its nested backward, which those do not see). The recomputation runs
with detached aliases in the parameters' places (as ``torch.func.functional_call`` does), so a
hook on a parameter runs once, in the outer graph, not also inside. A block whose inputs do not
require grad (the first one, under LoRA) still gets its parameters' gradients.

The gradient is the same, bit for bit, as without checkpointing where the block's inputs are read
by the block alone (a chain of blocks); where an input is also read outside the block (a skip
connection around it), its gradient is the sum of the same terms added in another order: equal to
rounding. PyTorch's checkpoint, whose nodes join the outer graph, keeps the order.

Which parameters: the block module's own, and those of the adapters hooked into it from outside
(a kohya/musubi or LyCORIS network's modules, whose ``forward`` replaced the layers' own, or a
forward hook's owner: :func:`vramkit.offload._reach.reached_modules`). A block could also read a
trainable tensor that is none of these (a weight tied to another module by reference, a
closure); that gradient would be lost. So each checkpointed block's first call in grad mode runs
PyTorch's checkpoint and walks the graph it built: if it reaches a trainable leaf beyond the
inputs and those parameters, the block keeps PyTorch's checkpoint for good (:class:`LeanState`,
whose ``reason`` says why; logged at INFO once).

Not supported (an :class:`~vramkit.errors.OffloadError` says so): double backward
(``create_graph=True``) through a lean block; pass ``method="pytorch"`` for that. A block whose
trainable parameters are tensor subclasses (DTensor under FSDP2) keeps PyTorch's checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from vramkit.errors import OffloadError
from vramkit.offload import _tree
from vramkit.offload._reach import reach_key, reached_modules
from vramkit.offload._structure import structure_epoch, watch_structure

__all__ = ["CHECKPOINT_METHODS", "LeanState", "foreign_leaves", "run_lean"]

logger = logging.getLogger(__name__)

#: Checkpoint methods: ``"lean"`` (this module) and ``"pytorch"`` (PyTorch's non-reentrant).
CHECKPOINT_METHODS = ("lean", "pytorch")


class LeanState:
    """Whether a checkpointed block may run lean: ``None`` until its first call in grad mode
    has been checked, then ``True``, or ``False`` when the block reads a trainable tensor that
    is neither its input nor its parameter.

    It also keeps where the block's parameters are registered between calls (walking a FLUX
    double block's ~60 modules at every call took 0.3-0.4 ms on an H200 host under cProfile,
    which inflates Python calls; a probe that is not kept), listed again
    when a module or parameter was registered anywhere since (PyTorch's registration hooks,
    watched while a LeanState exists) or a listed module's children or parameters were
    added or removed otherwise. Which of them require grad is read at every call.
    """

    __slots__ = ("__weakref__", "_places", "reason", "verdict")

    def __init__(self) -> None:
        self.verdict: bool | None = None
        self.reason = ""  # why PyTorch's checkpoint: set with verdict False
        self._watch()

    def _watch(self) -> None:
        # (epoch, shape key, modules, (owner, name) of every parameter slot), or None
        self._places: tuple[int, int, list[nn.Module], list[tuple[nn.Module, str]]] | None = None
        watch_structure(True)
        weakref.finalize(self, watch_structure, False)

    def __getstate__(self) -> tuple[bool | None]:
        return (self.verdict,)  # a tuple: a falsy state would skip __setstate__

    def __setstate__(self, state: tuple[bool | None]) -> None:
        (self.verdict,) = state
        self.reason = ""
        self._watch()

    def trainable(self, module: nn.Module
                  ) -> tuple[list[torch.Tensor], list[tuple[nn.Module, str, int]]]:
        """``module``'s parameters that require grad, with those of the adapters hooked into
        it (each once), and every place one is registered: (owning module, name, index in the
        list)."""
        epoch, cached = structure_epoch(), self._places
        if cached is None or cached[0] != epoch or cached[1] != reach_key(cached[2]):
            modules = reached_modules(module)
            slots = [(owner, name) for owner in modules for name in owner._parameters]
            cached = self._places = (epoch, reach_key(modules), modules, slots)
        params: list[torch.Tensor] = []
        places: list[tuple[nn.Module, str, int]] = []
        index: dict[int, int] = {}
        for owner, name in cached[3]:
            p = owner._parameters.get(name)
            if p is not None and p.requires_grad:
                i = index.get(id(p))
                if i is None:
                    i = index[id(p)] = len(params)
                    params.append(p)
                places.append((owner, name, i))
        return params, places

    def __repr__(self) -> str:
        return f"LeanState({self.verdict})"


def run_lean(module: nn.Module, state: LeanState, fn: Callable[..., Any],
             inputs: Sequence[Any], kwargs: dict[str, Any], preserve_rng_state: bool,
             fallback: Callable[[], Any]) -> Any:
    """``fn(*inputs, **kwargs)`` -- the forward of ``module`` -- through the lean checkpoint.

    ``fallback`` runs the same call through PyTorch's checkpoint: for the block's first call
    (whose graph is checked, see the module docstring) and for good when the check failed.
    Called in grad mode.
    """
    if state.verdict is False:
        return fallback()
    params, places = state.trainable(module)
    if any(type(p) not in _PLAIN for p in params):
        # A tensor subclass as a parameter (DTensor under FSDP2, ...): its owner may swap it
        # in and out of the module itself; the aliases of the recomputation would fight that.
        state.verdict = False
        state.reason = "a trainable parameter is a tensor subclass"
        return fallback()
    leaves, spec = _tree.flatten((tuple(inputs), kwargs))
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    tensors = [x for x, t in zip(leaves, is_tensor, strict=True) if t]
    if state.verdict is None:
        out = fallback()
        foreign = foreign_leaves(out, tensors, params)
        if foreign is not None:
            state.verdict = not foreign
            if foreign:
                shapes = ", ".join(str(tuple(t.shape)) for t in foreign[:3])
                state.reason = (f"it reads {len(foreign)} trainable tensor(s) that are neither "
                                f"its inputs, its parameters nor an adapter hooked into it "
                                f"(shapes {shapes})")
                logger.info("%s keeps PyTorch's checkpoint: %s", type(module).__name__,
                            state.reason)
        return out
    if not params and not any(t.requires_grad for t in tensors):
        return fn(*inputs, **kwargs)  # nothing to differentiate: no graph either way
    call = _LeanCall(fn, leaves, is_tensor, spec, len(tensors), params, places,
                     preserve_rng_state)
    outs = _LeanFunction.apply(call, *tensors, *params)
    return call.rebuild_outputs(outs)


_PLAIN = (nn.Parameter, torch.Tensor)


def foreign_leaves(out: Any, inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Trainable leaves the graph of ``out`` reaches, besides ``inputs`` and ``params``, not
    looking past the inputs' own nodes; ``None`` when ``out`` has no graph (nothing to tell)."""
    leaves, _ = _tree.flatten(out)
    stack = [x.grad_fn for x in leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None]
    if not stack:
        return None
    stops = [t.grad_fn for t in inputs if t.grad_fn is not None]  # held: ids stay unique
    stop_ids = {id(node) for node in stops}
    known = {id(t) for t in inputs} | {id(p) for p in params}
    seen: dict[int, Any] = {}  # holds the nodes so their ids are not reused
    foreign: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stop_ids:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if id(variable) not in known:
                foreign.append(variable)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return foreign


class _LeanCall:
    """One call: how to rebuild its arguments and outputs, and what backward replays."""

    __slots__ = ("autocast", "cpu_state", "device_states", "device_type", "devices", "fn",
                 "is_tensor", "n_inputs", "others", "out_is_tensor", "out_others", "out_spec",
                 "params", "places", "preserve", "spec")

    def __init__(self, fn: Callable[..., Any], leaves: list[Any], is_tensor: list[bool],
                 spec: Any, n_inputs: int, params: list[torch.Tensor],
                 places: list[tuple[nn.Module, str, int]], preserve: bool) -> None:
        self.fn = fn
        self.is_tensor = is_tensor
        self.others = [None if t else x for x, t in zip(leaves, is_tensor, strict=True)]
        self.spec = spec
        self.n_inputs = n_inputs
        self.params = params
        self.places = places
        self.preserve = preserve
        self.out_spec: Any = None
        self.out_is_tensor: list[bool] = []
        self.out_others: list[Any] = []
        self.device_type = "cpu"
        self.autocast: list[tuple[str, dict[str, Any]]] = []
        self.cpu_state: torch.Tensor | None = None
        self.devices: list[int] = []
        self.device_states: list[torch.Tensor] = []

    def remember(self, tensors: Sequence[torch.Tensor]) -> None:
        """The forward's autocast and RNG state, for the recomputation to replay."""
        device_type = next((t.device.type for t in tensors
                            if t.device.type not in ("cpu", "meta")), "cpu")
        self.device_type = device_type
        cache = torch.is_autocast_cache_enabled()
        for kind in dict.fromkeys((device_type, "cpu")):
            if torch.is_autocast_enabled(kind):
                self.autocast.append((kind, {"dtype": torch.get_autocast_dtype(kind),
                                             "cache_enabled": cache}))
        if self.preserve:
            self.cpu_state = torch.get_rng_state()
            if device_type == "cuda" and torch.cuda.is_initialized():
                self.devices, self.device_states = get_device_states(*tensors)

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        merged = [next(it) if t else x for x, t in zip(self.others, self.is_tensor, strict=True)]
        args, kwargs = _tree.unflatten(merged, self.spec)
        return self.fn(*args, **kwargs)

    def output_tensors(self, out: Any) -> list[torch.Tensor]:
        leaves, self.out_spec = _tree.flatten(out)
        self.out_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.out_others = [None if t else x for x, t in zip(leaves, self.out_is_tensor,
                                                              strict=True)]
        return [x for x, t in zip(leaves, self.out_is_tensor, strict=True) if t]

    def rebuild_outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        merged = [next(it) if t else x
                  for x, t in zip(self.out_others, self.out_is_tensor, strict=True)]
        return _tree.unflatten(merged, self.out_spec)

    @contextlib.contextmanager
    def aliased(self, aliases: Sequence[torch.Tensor]) -> Any:
        """``aliases`` in the trainable parameters' places while the block recomputes."""
        for owner, name, i in self.places:
            owner._parameters[name] = aliases[i]
        try:
            yield
        finally:
            for owner, name, i in self.places:
                owner._parameters[name] = self.params[i]

    def replay(self) -> contextlib.ExitStack:
        """Grad on, the forward's autocast and RNG state, for the recomputation."""
        stack = contextlib.ExitStack()
        if self.cpu_state is not None:
            stack.enter_context(torch.random.fork_rng(devices=self.devices,
                                                      device_type=self.device_type))
            torch.set_rng_state(self.cpu_state)
            if self.devices:
                set_device_states(self.devices, self.device_states,
                                  device_type=self.device_type)
        stack.enter_context(torch.enable_grad())
        for kind, settings in self.autocast:
            stack.enter_context(torch.autocast(kind, **settings))
        return stack


class _LeanFunction(torch.autograd.Function):
    """``forward``: the block with grad off, only its inputs saved; ``backward``: the block
    again with grad on, differentiated for its inputs and trainable parameters."""

    @staticmethod
    def forward(ctx: Any, call: _LeanCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)
        inputs = tensors[:call.n_inputs]
        ctx.save_for_backward(*inputs)
        call.remember(inputs)
        # Detached, an output that is a view (of the block's own result or of an input) is an
        # ordinary output: the caller may change it in place, as without checkpointing.
        outs = [o.detach() for o in call.output_tensors(call.run(inputs))]
        non_diff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise OffloadError(
                "backward with create_graph=True reached a block under the lean checkpoint: "
                "double backward through it is not supported",
                hint="Checkpoint the block with enable_gradient_checkpointing(..., "
                     "method='pytorch') for higher-order gradients.")
        call: _LeanCall = ctx.call
        needs = ctx.needs_input_grad[1:]
        inputs = []
        for t, need in zip(ctx.saved_tensors, needs, strict=False):
            d = t.detach()
            inputs.append(d.requires_grad_(True) if need else d)
        aliases = [p.detach().requires_grad_(True) for p in call.params]
        with call.replay(), call.aliased(aliases):
            outs = call.output_tensors(call.run(inputs))
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad]
        sources = [*inputs, *aliases]
        wanted = [t for t, need in zip(sources, needs, strict=True) if need]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                        allow_unused=True)
        it = iter(found)
        return (None, *(next(it) if need else None for need in needs))
