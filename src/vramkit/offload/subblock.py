"""Sub-block checkpointing: a block's parts (its attentions, its feed-forward layer) each
checkpointed on their own, so a checkpointed block's backward rebuilds one part at a time.

At long sequences one block's activations dwarf its weights: Wan 2.1 14B at 480x832 x 81
frames (32,760 tokens) saves 7.45 GiB a block -- attention, LoRA paths, float32 norms and
modulations -- and its recomputation in backward holds 10.9 GiB at once, all of the block's
saves and the temporaries that make them. Checkpointing the block keeps only its input between
forward and backward, but its backward still recomputes the whole block before it
differentiates any of it.

Here each part (a child module: ``attn1``, ``attn2``, ``ffn`` ...) runs under PyTorch's
*non-reentrant* checkpoint whenever grad is on. In the block's recomputation (grad on) each
part then keeps only its inputs; the block's own code between the parts (norms, modulations,
residual sums) keeps what it saves. Backward reaches the parts in reverse order and rebuilds
each one when its saved tensors are first needed, differentiates it and frees it before the
next: the peak becomes the block's own saves, the parts' inputs and one part's saves, instead
of all of them. One more forward of each part in backward is the price (on top of the block's
recomputation when the block is checkpointed too). Where the block is not checkpointed the
same holds for its forward: it keeps the parts' inputs, not their saves.

Why non-reentrant: the block's lean checkpoint differentiates its recomputation with
``torch.autograd.grad`` over *aliases* of its trainable parameters; a reentrant checkpoint
inside would accumulate the LoRA weights' gradients into ``.grad`` through its own backward,
out of that graph. The non-reentrant one records the part's graph in the block's (with the
aliases as leaves) and only rebuilds the tensors that graph saved, so the gradients flow
where the block's checkpoint expects them; it nests under PyTorch's checkpoint as well.
Every tensor of the call goes to it positionally (``checkpointing.run_checkpointed``), so an
activation offloader's hooks see the parts' inputs.

Exactness: a part computes the same ops on the same tensors in its recomputation, so gradients
equal the block checkpointed whole, bit for bit (tested on the CPU in float32 and bf16).

:func:`checkpoint_block_parts` checkpoints the parts of named blocks (children named in
:data:`PART_NAMES`, or the names given), :func:`uncheckpoint_parts` restores them exactly,
:func:`is_part_checkpointed` tells. Wrapping goes through :mod:`vramkit.offload._patch`,
beneath the block's own checkpoint and the swapper (they wrap the block, not its children).
A feed-forward layer chunked by :mod:`vramkit.offload.chunked` already checkpoints its slices
and is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_bool
from vramkit.errors import ConfigError
from vramkit.offload import _patch
from vramkit.offload._patch import MethodWrapper
from vramkit.offload.blocks import block_named
from vramkit.offload.checkpointing import run_checkpointed
from vramkit.offload.chunked import is_chunked

#: A ``TorchFunctionMode`` with this attribute true is entered again around a part's
#: recomputation when it was active around the part's forward, as PyTorch's checkpoint does
#: for ``torch.autocast``: the planner's autocast for meta tensors
#: (:class:`vramkit.planning._meta.MetaAutocast`), which the backward would not otherwise see.
REPLAY_ATTRIBUTE = "replay_in_recompute"

__all__ = ["PART_NAMES", "REPLAY_ATTRIBUTE", "checkpoint_block_parts", "checkpoint_parts", "is_part_checkpointed",
           "parts_of", "uncheckpoint_parts"]

#: Child names of a block's parts: diffusers' ``attn1``/``attn2`` (Wan, SDXL's transformer
#: blocks), ``attn`` and ``ff``/``ff_context`` (Flux, SD3), ``ffn`` (Wan); transformers'
#: ``self_attn``/``cross_attn`` and ``mlp``; ``attention``/``feed_forward``.
PART_NAMES: tuple[str, ...] = ("attn", "attn1", "attn2", "self_attn", "cross_attn",
                               "attention", "ff", "ff_context", "ffn", "mlp", "feed_forward")


class _PartCheckpoint(MethodWrapper):
    """A part's ``forward`` under PyTorch's non-reentrant checkpoint while grad is on."""

    __slots__ = ("preserve_rng_state",)

    kind = "part_checkpoint"

    def __init__(self, preserve_rng_state: bool) -> None:
        super().__init__()
        self.preserve_rng_state = preserve_rng_state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.active and torch.is_grad_enabled():
            replayed = [m for m in _function_modes() if getattr(m, REPLAY_ATTRIBUTE, False)]
            return run_checkpointed(self.inner, args, kwargs, self.preserve_rng_state,
                                    context_fn=functools.partial(_replaying, tuple(replayed))
                                    if replayed else None)
        return self.inner(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<part checkpoint of {self.inner!r}>"


def _function_modes() -> list[Any]:
    return list(torch.overrides._get_current_function_mode_stack())  # type: ignore[attr-defined]


@contextlib.contextmanager
def _under(modes: tuple[Any, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for mode in modes:  # innermost last, as they were stacked
            stack.enter_context(mode)
        yield


def _replaying(modes: tuple[Any, ...]) -> tuple[Any, Any]:
    """PyTorch's ``context_fn``: nothing around the forward; the recomputation under
    ``modes`` again."""
    return contextlib.nullcontext(), _under(modes)


def _state_of(module: nn.Module) -> _PartCheckpoint | None:
    wrapper = _patch.find(module, _PartCheckpoint.kind)
    return wrapper if isinstance(wrapper, _PartCheckpoint) else None


def is_part_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs under a part checkpoint (:func:`checkpoint_parts`)."""
    state = _state_of(module)
    return state is not None and state.active


def parts_of(block: nn.Module, names: Sequence[str] | None = None
             ) -> list[tuple[str, nn.Module]]:
    """The parts of ``block``: its children named in ``names`` (default :data:`PART_NAMES`)
    that hold parameters, in the block's registration order; a feed-forward layer chunked
    by :mod:`vramkit.offload.chunked` (its slices checkpointed already) is left out."""
    wanted = PART_NAMES if names is None else tuple(names)
    return [(name, child) for name, child in block.named_children()
            if name in wanted and any(True for _ in child.parameters())
            and not is_chunked(child)]


def checkpoint_parts(block: nn.Module, names: Sequence[str] | None = None, *,
                     preserve_rng_state: bool = True) -> list[str]:
    """Checkpoint each part of ``block`` (:func:`parts_of`) on its own (module docstring).
    A part checkpointed already keeps its wrapper (its settings updated).

    Args:
        block: the block (any module).
        names: child names of the parts (default :data:`PART_NAMES`).
        preserve_rng_state: restore the RNG state before a part is recomputed (default
            ``True``: dropout draws the same mask twice).

    Returns:
        The names of the children checkpointed.

    Raises:
        ConfigError: for ``names`` that is not a sequence of strings, or a non-bool flag.
    """
    if names is not None and (isinstance(names, str) or not all(
            isinstance(n, str) for n in names)):
        raise ConfigError(f"names must be a list of child names, got {names!r}",
                          hint="Pass the children to checkpoint, e.g. ['attn1', 'attn2', "
                               "'ffn'].")
    check_bool("preserve_rng_state", preserve_rng_state)
    done = []
    for name, child in parts_of(block, names):
        state = _state_of(child)
        if state is not None:
            state.preserve_rng_state, state.active = preserve_rng_state, True
        else:
            _patch.install(child, _PartCheckpoint(preserve_rng_state))
        done.append(name)
    return done


def checkpoint_block_parts(model: nn.Module, blocks: Sequence[str],
                           names: Sequence[str] | None = None) -> list[str]:
    """Checkpoint the parts of each block named in ``blocks`` (:func:`checkpoint_parts`);
    blocks without parts are left as they are.

    Returns:
        The qualified names of the parts checkpointed.

    Raises:
        ConfigError: for a name that is not a module of ``model``.
    """
    done: list[str] = []
    for name in blocks:
        block = block_named(model, name)
        done += [f"{name}.{part}" if name else part for part in checkpoint_parts(block, names)]
    return done


def uncheckpoint_parts(model: nn.Module) -> list[str]:
    """Restore every part of ``model`` checkpointed by :func:`checkpoint_parts` to the
    forward it had.

    Returns:
        The qualified names of the modules restored.
    """
    return _patch.restore_all(model, _PartCheckpoint.kind)
