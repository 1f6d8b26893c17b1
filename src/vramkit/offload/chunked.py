"""Token-chunked feed-forward layers: a block's MLP run over slices of its tokens, each slice
recomputed in backward, so the MLP's wide temporaries exist for one slice at a time.

At long sequences a transformer block's memory is its temporaries, not its weights: Wan 2.1 at
480x832 x 81 frames feeds 32,760 tokens through an FFN of width 13,824, whose up-projection and
GELU output are 0.9 GB each in bf16 (the hidden state is 0.33 GB). A feed-forward layer treats
every token alone, so it can run over ``chunks`` slices of the token dimension and concatenate:

* in a forward without grad (a checkpointed block's forward, inference) each slice's
  temporaries die before the next slice starts, and the slices' outputs are written into one
  preallocated output;
* with grad, each slice runs under PyTorch's reentrant checkpoint (no reference cycles),
  so autograd keeps only the slice's input -- a view of the layer's input, whose storage the
  caller holds anyway -- instead of the up-projection and activation of every token; backward
  rebuilds one slice at a time. One more forward of the MLP in backward is the price.

Exactness: every output row is computed from the same row with the same weights and the same
reduction (over the hidden width), so the outputs and the input's gradient equal the
unchunked layer's bit for bit where the matmul kernel's per-row result does not depend on the
number of rows (tested on the CPU in float32 and bf16). The weights' own gradients sum over
tokens, slice by slice: equal to rounding, not bit for bit, when the MLP's weights train (they
are frozen under LoRA on the attention projections).

:func:`chunk_feed_forwards` chunks the feed-forward child of each named block (found by name:
``ffn``, ``ff``, ``mlp``, ``feed_forward``); :func:`unchunk_feed_forwards` restores them
exactly (the forwards as they were); :func:`is_chunked` tells. Wrapping goes through
:mod:`vramkit.offload._patch`, innermost before checkpointing and swapping wrap the block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from vramkit._validate import check_bool, check_int
from vramkit.errors import ConfigError
from vramkit.offload import _patch
from vramkit.offload._patch import MethodWrapper
from vramkit.offload.blocks import block_named

__all__ = ["FEED_FORWARD_NAMES", "chunk_feed_forwards", "chunk_tokens", "feed_forward_of",
           "is_chunked", "token_chunks", "unchunk_feed_forwards"]

#: Child names of a block's feed-forward layer: diffusers' ``ffn`` (Wan) and ``ff`` (Flux,
#: SD3, Qwen-Image, BasicTransformerBlock), transformers' ``mlp`` (Llama), ``feed_forward``.
FEED_FORWARD_NAMES: tuple[str, ...] = ("ffn", "ff", "mlp", "feed_forward")


class _ChunkedForward(MethodWrapper):
    """A feed-forward layer's ``forward`` over slices of its first argument's token dimension."""

    __slots__ = ("checkpoint", "chunks", "dim")

    kind = "chunk"

    def __init__(self, chunks: int, dim: int, checkpoint: bool) -> None:
        super().__init__()
        self.chunks = chunks
        self.dim = dim
        self.checkpoint = checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active or self.chunks < 2 or not args or not isinstance(
                args[0], torch.Tensor):
            return self.inner(*args, **kwargs)
        x, rest = args[0], args[1:]
        dim = self.dim % x.dim()
        if x.shape[dim] < 2:
            return self.inner(*args, **kwargs)
        pieces = x.tensor_split(min(self.chunks, x.shape[dim]), dim)
        if not torch.is_grad_enabled():
            return self._into_one_output(pieces, rest, kwargs, dim)
        if self.checkpoint and x.requires_grad and not kwargs and all(
                not isinstance(a, torch.Tensor) or not a.requires_grad for a in rest):
            # PyTorch's reentrant checkpoint: an autograd Function that recomputes the slice
            # and back-propagates it with torch.autograd.backward. The non-reentrant one keeps
            # each slice's recomputed tensors in reference cycles (its frame and holders)
            # until the garbage collector runs, so what a backward held depended on when it
            # ran (the planner's meta estimate moved by 20 % from run to run); the lean one's
            # autograd.grad cannot run beneath the module tracker of torch's FLOP counter.
            # Reentrant needs an input that requires grad (else parameters get no gradient):
            # without one, the slices run unchecked.
            outs = [_torch_checkpoint(self._slice, piece, *rest, use_reentrant=True,
                                      preserve_rng_state=True) for piece in pieces]
        else:
            outs = [self._slice(piece, *rest, **kwargs) for piece in pieces]
        return torch.cat(outs, dim)

    def _slice(self, piece: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        # A slice of a batched input is strided; CPU bf16 matmuls of strided rows round
        # differently from the whole tensor's (contiguous slices equal it bit for bit). The
        # checkpoint saves the view, so the copy exists only while the slice runs.
        return self.inner(piece.contiguous(), *rest, **kwargs)

    def _into_one_output(self, pieces: Sequence[torch.Tensor], rest: tuple[Any, ...],
                         kwargs: dict[str, Any], dim: int) -> torch.Tensor:
        """Without grad: each slice's output goes into one preallocated tensor and dies, so
        the outputs are never held twice (once in slices, once concatenated)."""
        first = self._slice(pieces[0], *rest, **kwargs)
        if not isinstance(first, torch.Tensor) or first.dim() != pieces[0].dim() or any(
                first.shape[d] != pieces[0].shape[d] for d in range(first.dim()) if d != dim):
            raise ConfigError(f"a chunked layer must return one tensor of its input's tokens, "
                              f"got {type(first).__name__}",
                              hint="Chunk only token-wise layers (a block's MLP).")
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in pieces)
        out = first.new_empty(shape)
        start = 0
        for i, piece in enumerate(pieces):
            y = first if i == 0 else self._slice(piece, *rest, **kwargs)
            out.narrow(dim, start, piece.shape[dim]).copy_(y)
            start += piece.shape[dim]
            del y
            first = None  # type: ignore[assignment]
        return out

    def __repr__(self) -> str:
        return f"<{self.chunks} token chunks of {self.inner!r}>"


def _state_of(module: nn.Module) -> _ChunkedForward | None:
    wrapper = _patch.find(module, _ChunkedForward.kind)
    return wrapper if isinstance(wrapper, _ChunkedForward) else None


def chunk_tokens(module: nn.Module, chunks: int, *, dim: int = -2,
                 checkpoint: bool = True) -> nn.Module:
    """Run ``module`` (a token-wise layer: an MLP) over ``chunks`` slices of its first
    argument's dimension ``dim`` (module docstring). Chunking a module again updates its
    settings.

    Args:
        module: the layer; it must treat each token alone and return one tensor of its
            input's tokens.
        chunks: slices (>= 1; 1 runs the layer as built).
        dim: the token dimension of the layer's input (default -2: ``(batch, tokens, width)``).
        checkpoint: with grad, recompute each slice in backward (default ``True``; ``False``
            keeps every slice's activations: only the forward's temporaries shrink).

    Returns:
        ``module``.
    """
    chunks = check_int("chunks", chunks, minimum=1)
    dim = check_int("dim", dim)
    check_bool("checkpoint", checkpoint)
    state = _state_of(module)
    if state is not None:
        state.chunks, state.dim, state.checkpoint, state.active = chunks, dim, checkpoint, True
    else:
        _patch.install(module, _ChunkedForward(chunks, dim, checkpoint))
    return module


def token_chunks(module: nn.Module) -> int:
    """The slices :func:`chunk_tokens` runs ``module`` over (1: not chunked)."""
    state = _state_of(module)
    return state.chunks if state is not None and state.active else 1


def is_chunked(module: nn.Module) -> bool:
    """Whether ``module`` runs over token slices (:func:`chunk_tokens`)."""
    return token_chunks(module) > 1


def feed_forward_of(block: nn.Module) -> tuple[str, nn.Module] | None:
    """The feed-forward child of ``block`` (:data:`FEED_FORWARD_NAMES`), or ``None``."""
    children = dict(block.named_children())
    for name in FEED_FORWARD_NAMES:
        child = children.get(name)
        if isinstance(child, nn.Module) and any(True for _ in child.parameters()):
            return name, child
    return None


def chunk_feed_forwards(model: nn.Module, blocks: Sequence[str], chunks: int, *,
                        checkpoint: bool = True) -> list[str]:
    """Chunk the feed-forward layer of each block named in ``blocks``
    (:func:`chunk_tokens`); blocks without one are left as they are.

    Returns:
        The qualified names of the layers chunked.

    Raises:
        ConfigError: for a name that is not a module of ``model``.
    """
    done: list[str] = []
    for name in blocks:
        block = block_named(model, name)
        found = feed_forward_of(block)
        if found is None:
            continue
        chunk_tokens(found[1], chunks, checkpoint=checkpoint)
        done.append(f"{name}.{found[0]}" if name else found[0])
    return done


def unchunk_feed_forwards(model: nn.Module) -> list[str]:
    """Restore every chunked layer of ``model`` to the forward it had.

    Returns:
        The qualified names of the layers restored.
    """
    return _patch.restore_all(model, _ChunkedForward.kind)
