"""Compiled blocks: ``torch.compile`` each block's own forward, beneath checkpointing and swapping.

:func:`compile_blocks` installs a ``"compile"`` wrapper (through :mod:`vramkit.offload._patch`,
the one patching primitive) on each block's ``forward`` *before* anything else wraps it, so the
compiled function is the innermost callable: vramkit's checkpoint recomputes it, and the block
swapper runs it with the block's weights repointed into a ring slot. Nothing of the swapper's
machinery (slot acquisition, saved-tensor hooks, autograd boundaries) is traced.

Why this composes with swapping without recompiling. Dynamo treats a module's parameters and
buffers as graph inputs (``inline_inbuilt_nn_modules``, the default since torch 2.5): a
parameter repointed to another slot is a new input address, not a new guard, so every block of
one class shares one compiled graph per calling context (grad mode, whether the input requires
grad), step after step. ``tests/offload/test_compiled.py`` counts the frames compiled across
steps; ``dynamic=False`` keeps shapes static, as a training step's are.

CUDA graphs (:data:`CUDA_GRAPH_MODES`: ``"reduce-overhead"``, ``"max-autotune"``), for inference
only. A graph is recorded against fixed addresses; a swapped block's weights live in one of the
swapper's slots, whose addresses never change, so inductor's CUDA-graph trees record one graph per
distinct set of weight addresses (one per slot a block kind runs in, one per resident block) and
replay it for every block that occupies that slot, reading the bytes the swapper just copied
there. Each call starts a new graph generation (``torch.compiler.cudagraph_mark_step_begin``) and
returns its outputs cloned out of the graphs' memory pool, which the next replay reuses; the
swapper's copies and waits stay outside the graphs. Training is refused: a block's backward (and
the lean checkpoint's recomputation) runs with grad enabled, and a call with grad enabled raises
an :class:`~vramkit.errors.OffloadError` that says to compile with a mode of
:data:`COMPILE_MODES` for training. ``vramkit.fit`` does not offer these modes (its plans train).

:func:`uncompile_blocks` restores each forward exactly. Wrappers are objects: a copy or a pickle
of the model carries the wrapper without its compiled function, which is made again on first
call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_choice
from vramkit.errors import OffloadError
from vramkit.offload import _patch
from vramkit.offload.blocks import find_blocks

__all__ = ["COMPILE_MODES", "CUDA_GRAPH_MODES", "compile_blocks", "is_compiled",
           "uncompile_blocks"]

logger = logging.getLogger(__name__)

#: ``torch.compile`` modes accepted for blocks: the ones that record no CUDA graph.
COMPILE_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
#: ``torch.compile`` modes that record CUDA graphs: accepted for inference (grad disabled) only.
CUDA_GRAPH_MODES: tuple[str, ...] = ("reduce-overhead", "max-autotune")


def _clone_tensors(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_tensors(o) for o in out)
    if isinstance(out, dict):
        return {k: _clone_tensors(v) for k, v in out.items()}
    return out


class _CompiledForward(_patch.MethodWrapper):
    """A block's forward run through ``torch.compile`` (compiled on first call)."""

    __slots__ = ("_compiled", "options")

    kind = "compile"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        self.options = options
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.inner(*args, **kwargs)
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = torch.compile(self.inner, **self.options)
        if self.options.get("mode") in CUDA_GRAPH_MODES:
            return self._replay(compiled, args, kwargs)
        return compiled(*args, **kwargs)

    def _replay(self, compiled: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if torch.is_grad_enabled():
            raise OffloadError(
                f"this block was compiled with mode={self.options['mode']!r}, which records "
                "CUDA graphs: inference only, and this call has grad enabled (a training step, "
                "or a checkpoint's recomputation)",
                hint="Run it under torch.no_grad() or torch.inference_mode(), or compile with "
                     f"one of {', '.join(COMPILE_MODES)} to train.")
        # A new generation per call: the graphs' pool may be reused by the next replay, so the
        # outputs leave as copies.
        torch.compiler.cudagraph_mark_step_begin()
        return _clone_tensors(compiled(*args, **kwargs))

    # Copies and pickles carry the wrapper, not the compiled function (it holds caches and
    # generated code bound to this process): the copy compiles again on its first call.
    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "name": self.name, "active": self.active,
                "_had_previous": self._had_previous, "_previous": self._previous,
                "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self._compiled = None


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``'s forward."""
    return _patch.find(module, _CompiledForward.kind) is not None


def compile_blocks(model: nn.Module, blocks: str | Sequence[str] = "auto", *,
                   mode: str = "default", fullgraph: bool = False) -> list[str]:
    """Compile each block's forward with ``torch.compile`` (static shapes), beneath vramkit's
    checkpointing and block swapping.

    Call it before :func:`~vramkit.offload.checkpointing.enable_gradient_checkpointing` and
    before attaching a :class:`~vramkit.offload.swap.BlockSwapper` (``vramkit.fit(...,
    compile=True)`` does it in that order). A block compiled already is left as it is.

    Args:
        model: the model.
        blocks: ``"auto"`` (default: the repeated blocks the swapper finds) or module names /
            ``fnmatch`` patterns, as for the swapper.
        mode: a ``torch.compile`` mode from :data:`COMPILE_MODES` (default ``"default"``), or
            from :data:`CUDA_GRAPH_MODES` for inference only (see the module docstring).
        fullgraph: passed to ``torch.compile`` (default ``False``: graph breaks allowed).

    Returns:
        Qualified names of the blocks compiled by this call, in execution order.

    Raises:
        ConfigError: for a mode outside :data:`COMPILE_MODES` and :data:`CUDA_GRAPH_MODES`,
            or a non-bool ``fullgraph``.
        OffloadError: when a block is checkpointed or swapped already (its forward would be
            compiled with vramkit's machinery inside), or ``blocks`` matches nothing.
    """
    check_choice("mode", mode, COMPILE_MODES + CUDA_GRAPH_MODES,
                 hint="Use 'default' or 'max-autotune-no-cudagraphs' (training and inference), "
                      "or 'reduce-overhead' / 'max-autotune' (CUDA graphs, inference only).")
    check_bool("fullgraph", fullgraph)
    options: dict[str, Any] = {"dynamic": False, "fullgraph": fullgraph}
    if mode != "default":
        options["mode"] = mode
    found = find_blocks(model, blocks)
    names: list[str] = []
    for name, module in found:
        if is_compiled(module):
            continue
        others = [w.kind for w in _patch.wrappers(module)]
        if others:
            raise OffloadError(
                f"block {name} is wrapped already ({', '.join(others)}): compiling it now would "
                "trace vramkit's own machinery",
                hint="Compile the blocks first, then checkpoint or swap them (vramkit.fit("
                     "..., compile=True) does this), or detach the swapper / disable "
                     "checkpointing before compiling.")
        _patch.install(module, _CompiledForward(dict(options)))
        names.append(name)
    if names:
        _raise_recompile_limits(len(found))
    logger.debug("compiling %d of %d blocks (mode=%s)", len(names), len(found), mode)
    return names


#: Compiled entries each block may need: one per calling context (grad mode, whether its input
#: requires grad, checkpointed or not, the calibration's variants); dynamo's own default per
#: code object.
ENTRIES_PER_BLOCK = 8


def _raise_recompile_limits(blocks: int) -> None:
    """Let every block keep its own compiled entries. Dynamo counts entries per *code object*,
    and all blocks of a class share their forward's code: blocks that differ in a constant
    dynamo guards on (a decoder layer's ``layer_idx``) each compile once per context, and past
    the limit (8) dynamo runs the rest eagerly without an error -- a Llama-8B plan priced
    compiled ran most of its 32 layers eager (on an H200: 474 ms for a predicted 274 ms).
    Raised, never lowered (the user's own setting stands when it is higher)."""
    import torch._dynamo.config as dynamo_config

    need = ENTRIES_PER_BLOCK * blocks
    for name, floor in (("recompile_limit", need), ("cache_size_limit", need),
                        ("accumulated_recompile_limit", 2 * need),
                        ("accumulated_cache_size_limit", 2 * need)):
        current = getattr(dynamo_config, name, None)
        if isinstance(current, int) and current < floor:
            setattr(dynamo_config, name, floor)
            logger.debug("torch._dynamo.config.%s raised from %d to %d", name, current, floor)


def uncompile_blocks(model: nn.Module) -> list[str]:
    """Undo :func:`compile_blocks` on every module of ``model``.

    Returns:
        Qualified names of the modules whose forward was restored.
    """
    return _patch.restore_all(model, _CompiledForward.kind)
