"""Gradient checkpointing: trade recomputation for activation memory.

A checkpointed region keeps only its inputs during the forward pass and runs again in backward to
rebuild the activations its gradients need. Two methods:

* ``"lean"`` (the default for a model's blocks, :mod:`vramkit.offload._lean_checkpoint`): the
  forward runs with grad off -- no graph recorded, only the inputs saved -- and backward rebuilds
  and differentiates the block; its trainable parameters' gradients leave through the outer
  graph (``torch.autograd.grad``, DDP and gradient hooks see them). Cheaper on the host than
  PyTorch's in forward, where a checkpointed DiT is host-bound. No double backward.
* ``"pytorch"``: PyTorch's *non-reentrant* checkpoint (``use_reentrant=False``), which also
  supports double backward. The generic :func:`checkpoint` and :class:`GradientCheckpointer`,
  which do not know a module's parameters, always use it.

Both work with ``torch.autograd.grad``, with inputs that do not require grad, with keyword
arguments, and with modules whose parameters are the only leaves.

* :func:`enable_gradient_checkpointing` marks a model's repeated blocks (found as the block
  swapper finds them) by giving each block an instance ``forward`` that checkpoints the original.
  :func:`disable_gradient_checkpointing` restores the model exactly; :func:`unwrapped_forward`
  hands the block swapper the original forward, so swapping and checkpointing compose.
* :func:`checkpoint` is the seed's generic ``checkpoint(fn, inputs, enabled)``.
* :class:`GradientCheckpointer` is the seed's ``SDXLGradientCheckpoint``: an on/off switch plus
  name patterns for code that checkpoints by hand (``checkpoint_forward(name, fn, inputs)``).
* :func:`checkpoint_with_pool` (seed FLAME) keeps the checkpoint's saved inputs in planned memory
  of a :class:`vramkit.memory.pool.MemoryPool`: a device arena, or a pinned host pool that moves
  them off the GPU until backward needs them.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from vramkit._validate import check_bool, check_choice, check_int
from vramkit.errors import ConfigError, DeviceMismatchError, InvalidBlockError
from vramkit.memory.layout import is_dense
from vramkit.memory.pool import Block, MemoryPool
from vramkit.memory.transfer import transfer_streams
from vramkit.offload import _patch, _tree
from vramkit.offload._lean_checkpoint import CHECKPOINT_METHODS, LeanState, run_lean
from vramkit.offload._patch import MethodWrapper
from vramkit.offload.blocks import find_blocks

__all__ = [
    "CHECKPOINT_METHODS",
    "SDXL_CHECKPOINT_BLOCKS",
    "GradientCheckpointer",
    "SDXLGradientCheckpoint",
    "checkpoint",
    "checkpoint_method",
    "checkpoint_with_pool",
    "disable_gradient_checkpointing",
    "enable_gradient_checkpointing",
    "is_checkpointed",
    "unwrapped_forward",
]

logger = logging.getLogger(__name__)

#: Default patterns of :class:`GradientCheckpointer`: the stages of an SDXL-like UNet.
SDXL_CHECKPOINT_BLOCKS: tuple[str, ...] = ("down_blocks.*", "mid_block", "up_blocks.*")

def run_checkpointed(fn: Callable[..., Any], inputs: Sequence[Any], kwargs: dict[str, Any],
                     preserve_rng_state: bool, *, module: nn.Module | None = None,
                     lean: LeanState | None = None,
                     context_fn: Callable[[], tuple[Any, Any]] | None = None) -> Any:
    """``fn(*inputs, **kwargs)`` checkpointed: the lean way when ``module`` (whose forward
    ``fn`` runs) and its ``lean`` state are given, else under PyTorch's non-reentrant
    checkpoint, every tensor of the call passed to it positionally.

    The checkpoint saves its positional tensors for the recomputation through the saved-tensor
    hooks (so an activation offloader moves them off the device until backward), but holds
    anything else it is given -- keyword arguments, tensors inside tuples or lists, a partial's
    bound arguments -- by reference until backward. diffusers calls its transformer blocks with
    keyword arguments, so under activation offload every checkpointed block's hidden states
    stayed on the GPU (1.5 GiB at FLUX.1-dev's peak at 1024 px, measured on an H100 with
    ``benchmarks/plan.py --snapshot``). The call is
    flattened instead: each tensor leaf goes positionally, the rest is rebuilt inside (which
    also keeps a function's own ``use_reentrant`` or ``preserve_rng_state`` parameter apart
    from the checkpoint's options). ``context_fn`` is PyTorch's (the contexts of the forward
    and of the recomputation; PyTorch's checkpoint only).
    """
    options: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    if module is not None and lean is not None:
        return run_lean(module, lean, fn, inputs, kwargs, preserve_rng_state,
                        lambda: run_checkpointed(fn, inputs, kwargs, preserve_rng_state))
    if not kwargs and all(isinstance(x, torch.Tensor) for x in inputs):
        return _torch_checkpoint(fn, *inputs, use_reentrant=False,
                                 preserve_rng_state=preserve_rng_state, **options)
    leaves, spec = _tree.flatten((tuple(inputs), kwargs))
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    others = [None if t else x for x, t in zip(leaves, is_tensor, strict=True)]
    tensors = [x for x, t in zip(leaves, is_tensor, strict=True) if t]
    del leaves

    def run(*given: torch.Tensor) -> Any:
        it = iter(given)
        merged = [next(it) if t else x for x, t in zip(others, is_tensor, strict=True)]
        args, named = _tree.unflatten(merged, spec)
        return fn(*args, **named)

    return _torch_checkpoint(run, *tensors, use_reentrant=False,
                             preserve_rng_state=preserve_rng_state, **options)


# --------------------------------------------------------------------------------------------
# Generic checkpoint (seed API)
# --------------------------------------------------------------------------------------------


def checkpoint(fn: Callable[..., Any], *inputs: Any, enabled: bool = True,
               preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run ``fn(*inputs, **kwargs)``, keeping only its inputs for backward (non-reentrant).

    Args:
        fn: the function to checkpoint; it must compute the same thing when run again.
        *inputs: its positional arguments (tensors and other values).
        enabled: checkpoint when ``True`` (default); when ``False`` just call ``fn``.
        preserve_rng_state: restore the RNG state before recomputing, so dropout draws the same
            mask twice (default ``True``; ``False`` saves a little time for RNG-free functions).
        **kwargs: keyword arguments of ``fn``.

    Returns:
        What ``fn`` returns. Without grad mode ``fn`` is called directly (nothing to save).

    Raises:
        ConfigError: when ``enabled`` or ``preserve_rng_state`` is not a bool.
    """
    check_bool("enabled", enabled)
    check_bool("preserve_rng_state", preserve_rng_state)
    if not enabled or not torch.is_grad_enabled():
        return fn(*inputs, **kwargs)
    return run_checkpointed(fn, inputs, kwargs, preserve_rng_state)


# --------------------------------------------------------------------------------------------
# Checkpointing a model's blocks
# --------------------------------------------------------------------------------------------


class _CheckpointedForward(MethodWrapper):
    """A checkpointed block's ``forward``: runs what it wraps through a checkpoint.

    Installed with :func:`vramkit.offload._patch.install`, so ``copy.deepcopy(model)`` gives the
    copy a forward bound to the copied block and ``torch.save(model)`` can pickle it. It reads
    its settings at call time: switching it off (``active = False``) works even where another
    patch wrapped it.
    """

    __slots__ = ("lean", "method", "preserve_rng_state")

    kind = "checkpoint"

    def __init__(self, preserve_rng_state: bool, method: str) -> None:
        super().__init__()
        self.preserve_rng_state = preserve_rng_state
        self.method = method
        self.lean = LeanState()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.active and torch.is_grad_enabled():
            module = _owner(self.inner) if self.method == "lean" else None
            return run_checkpointed(self.inner, args, kwargs, self.preserve_rng_state,
                                    module=module, lean=self.lean)
        return self.inner(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<checkpointed {self.inner!r}>"


def _owner(inner: Callable[..., Any]) -> nn.Module | None:
    """The module whose bound forward ``inner`` calls (beneath other wrappers), if any."""
    while isinstance(inner, MethodWrapper):
        inner = inner.inner
    owner = getattr(inner, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _state_of(module: nn.Module) -> _CheckpointedForward | None:
    wrapper = _patch.find(module, _CheckpointedForward.kind)
    return wrapper if isinstance(wrapper, _CheckpointedForward) else None


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`enable_gradient_checkpointing` checkpoints ``module``'s forward.

    Args:
        module: any ``nn.Module``.

    Returns:
        ``True`` when the module's forward runs through a checkpoint in grad mode.
    """
    state = _state_of(module)
    return state is not None and state.active


def checkpoint_method(module: nn.Module) -> str:
    """The method :func:`enable_gradient_checkpointing` checkpoints ``module`` with
    (``"lean"`` when it did not: the block swapper's default for blocks it checkpoints).

    Args:
        module: any ``nn.Module``.

    Returns:
        ``"lean"`` or ``"pytorch"`` (:data:`CHECKPOINT_METHODS`).
    """
    state = _state_of(module)
    return state.method if state is not None else "lean"


def unwrapped_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward to run without checkpointing (the block swapper recomputes by itself).

    Args:
        module: any ``nn.Module``.

    Returns:
        The original forward of a checkpointed module, otherwise ``module.forward``.
    """
    state = _state_of(module)
    return state.inner if state is not None else module.forward


def enable_gradient_checkpointing(model: nn.Module, blocks: str | Sequence[str] = "auto",
                                  every_n: int = 1, *, preserve_rng_state: bool = True,
                                  method: str = "lean") -> list[str]:
    """Checkpoint every ``every_n``-th block of ``model``.

    Each chosen block gets an instance attribute ``forward`` that runs the original forward
    through a checkpoint when grad mode is on, and calls it directly otherwise (evaluation,
    ``torch.no_grad``). Forward hooks keep running once per call: only the forward itself is
    recomputed. Calling this again never wraps a block twice; it updates
    ``preserve_rng_state`` and ``method`` of blocks already checkpointed.

    Args:
        model: the model.
        blocks: ``"auto"`` (default) finds the repeated blocks as the block swapper does
            (:func:`vramkit.offload.blocks.find_blocks`); otherwise a sequence of module names
            or ``fnmatch`` patterns (a container's name means its children).
        every_n: checkpoint blocks ``0, n, 2n, ...`` of the execution order (default ``1``: all).
            Larger values keep more activations and recompute less.
        preserve_rng_state: restore the RNG state before recomputing, so dropout masks match
            (default ``True``).
        method: ``"lean"`` (default: the forward records no graph; the block's trainable
            parameters' gradients flow through the outer graph; no double backward) or
            ``"pytorch"`` (PyTorch's non-reentrant checkpoint); see the module docstring.

    Returns:
        Qualified names of the blocks checkpointed, in execution order.

    Raises:
        ConfigError: for an ``every_n`` that is not an int >= 1, a non-bool
            ``preserve_rng_state``, an unknown ``method`` or a malformed ``blocks``.
        OffloadError: when ``blocks`` matches nothing.
    """
    check_int("every_n", every_n, minimum=1,
              hint="every_n=1 checkpoints every block, 2 every other block.")
    check_bool("preserve_rng_state", preserve_rng_state)
    check_choice("method", method, CHECKPOINT_METHODS)
    found = find_blocks(model, blocks)
    names: list[str] = []
    for index, (name, module) in enumerate(found):
        if index % every_n:
            continue
        state = _state_of(module)
        if state is not None:
            state.preserve_rng_state = preserve_rng_state
            state.method = method
            state.active = True
        else:
            _patch.install(module, _CheckpointedForward(preserve_rng_state, method))
        names.append(name)
    logger.debug("checkpointing %d of %d blocks (every_n=%d, %s)", len(names), len(found),
                 every_n, method)
    return names


def disable_gradient_checkpointing(model: nn.Module,
                                   blocks: Sequence[str] | None = None) -> list[str]:
    """Undo :func:`enable_gradient_checkpointing` on every module of ``model`` (or on the
    modules named in ``blocks``).

    A block's ``forward`` becomes exactly what it was before (the class method, or the instance
    attribute it had); hooks and parameters are untouched. When something replaced the block's
    forward after it was checkpointed, that replacement is kept and the checkpoint inside it
    turns into a plain call.

    Args:
        model: the model.
        blocks: qualified names of the modules to restore (default ``None``: every one).

    Returns:
        Qualified names of the modules restored.

    Raises:
        ConfigError: for ``blocks`` that is not a sequence of names.
    """
    if blocks is not None and (isinstance(blocks, str) or not all(
            isinstance(b, str) for b in blocks)):
        raise ConfigError(f"blocks must be a list of module names, got {blocks!r}",
                          hint="Pass the names enable_gradient_checkpointing returned.")
    wanted = None if blocks is None else set(blocks)
    restored: list[str] = []
    for name, module in model.named_modules():
        if wanted is not None and name not in wanted:
            continue
        state = _state_of(module)
        if state is None:
            continue
        if not _patch.restore(module, state):
            logger.warning("%s: forward was replaced after checkpointing; leaving the "
                           "replacement in place with checkpointing turned off", name or "model")
        restored.append(name)
    return restored


# --------------------------------------------------------------------------------------------
# Seed SDXLGradientCheckpoint
# --------------------------------------------------------------------------------------------


class GradientCheckpointer:
    """Checkpoint hand-written forward passes by name (seed ``SDXLGradientCheckpoint``).

    Args:
        checkpoint_blocks: ``fnmatch`` patterns of the names to checkpoint (default
            :data:`SDXL_CHECKPOINT_BLOCKS`: ``down_blocks.*``, ``mid_block``, ``up_blocks.*``).
        enabled: whether checkpointing is on (default ``True``).
        preserve_rng_state: restore the RNG state before recomputing (default ``True``).

    Raises:
        ConfigError: for empty or non-string patterns or non-bool flags.

    Example:
        >>> ckpt = GradientCheckpointer()
        >>> h = ckpt.checkpoint_forward("down_blocks.0", block, [h, temb])  # doctest: +SKIP
    """

    def __init__(self, checkpoint_blocks: Sequence[str] = SDXL_CHECKPOINT_BLOCKS, *,
                 enabled: bool = True, preserve_rng_state: bool = True) -> None:
        if isinstance(checkpoint_blocks, str):
            checkpoint_blocks = (checkpoint_blocks,)
        if not isinstance(checkpoint_blocks, Sequence) or not all(
                isinstance(p, str) and p for p in checkpoint_blocks):
            raise ConfigError("checkpoint_blocks must be a sequence of non-empty name patterns, "
                              f"got {checkpoint_blocks!r}",
                              hint="Pass fnmatch patterns as strings, e.g. "
                                   "checkpoint_blocks=['down_blocks.*', 'mid_block'].")
        self._patterns: tuple[str, ...] = tuple(checkpoint_blocks)
        self._enabled = check_bool("enabled", enabled)
        self._preserve_rng_state = check_bool("preserve_rng_state", preserve_rng_state)
        self._checkpointed_calls = 0
        self._direct_calls = 0

    @property
    def checkpoint_blocks(self) -> tuple[str, ...]:
        """The name patterns (read-only; make a new checkpointer to change them)."""
        return self._patterns

    @property
    def enabled(self) -> bool:
        """Whether checkpointing is on (change it with :meth:`set_enabled`)."""
        return self._enabled

    @property
    def checkpointed_calls(self) -> int:
        """Calls of :meth:`checkpoint_forward` that ran through a checkpoint."""
        return self._checkpointed_calls

    @property
    def direct_calls(self) -> int:
        """Calls of :meth:`checkpoint_forward` that ran ``fn`` directly."""
        return self._direct_calls

    def set_enabled(self, enabled: bool) -> None:
        """Turn checkpointing on or off.

        Raises:
            ConfigError: when ``enabled`` is not a bool.
        """
        self._enabled = check_bool("enabled", enabled)

    def matches(self, name: str) -> bool:
        """Whether ``name`` matches one of the patterns (``fnmatch``, case-sensitive)."""
        return any(fnmatch.fnmatchcase(name, p) for p in self._patterns)

    def checkpoint_forward(self, name: str, fn: Callable[..., Any],
                           inputs: Sequence[Any]) -> Any:
        """Run ``fn(*inputs)``, checkpointed when enabled, in grad mode and ``name`` matches.

        Args:
            name: the block's name, matched against the patterns.
            fn: the block's forward.
            inputs: its positional arguments, a list or tuple.

        Returns:
            What ``fn`` returns.

        Raises:
            ConfigError: when ``inputs`` is not a list or tuple (a single tensor must be
                wrapped: ``[x]``).
        """
        if not isinstance(inputs, (list, tuple)):
            raise ConfigError(f"inputs must be a list or tuple, got {type(inputs).__name__}",
                              hint="Wrap a single tensor: checkpoint_forward(name, fn, [x]).")
        if self._enabled and torch.is_grad_enabled() and self.matches(name):
            self._checkpointed_calls += 1
            return run_checkpointed(fn, inputs, {}, self._preserve_rng_state)
        self._direct_calls += 1
        return fn(*inputs)

    def reset_stats(self) -> None:
        """Set both call counters to zero."""
        self._checkpointed_calls = 0
        self._direct_calls = 0

    def __repr__(self) -> str:
        return (f"GradientCheckpointer(checkpoint_blocks={self._patterns!r}, "
                f"enabled={self._enabled})")


#: The seed's name for :class:`GradientCheckpointer`.
SDXLGradientCheckpoint = GradientCheckpointer


# --------------------------------------------------------------------------------------------
# Checkpoint with the saved inputs in a MemoryPool (seed FLAME checkpoint_with_pool)
# --------------------------------------------------------------------------------------------


def _layout(tensor: torch.Tensor) -> tuple[int, ...]:
    # Keep the strides of dense layouts (channels_last, transposes) so recomputation sees the
    # same memory format as the first pass; pack gapped or overlapping views contiguously.
    if is_dense(tensor):
        return tuple(tensor.stride())
    strides = []
    step = 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _PinnedInput:
    """A checkpoint input copied to pinned host memory; the block is freed with this object."""

    __slots__ = ("block", "copied", "device", "dtype", "host", "shape", "stride")

    def __init__(self, block: Block, host: torch.Tensor, copied: Any,
                 device: torch.device) -> None:
        self.block = block
        self.host = host
        self.copied = copied  # event on the d2h stream after the copy
        self.device = device
        self.shape = host.shape
        self.stride = host.stride()
        self.dtype = host.dtype

    def __del__(self) -> None:
        block = getattr(self, "block", None)
        if block is not None and not block.freed:
            try:
                block.free()
            except InvalidBlockError:  # the pool was cleared with force=True
                pass


class _PooledInputHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move what the checkpoint keeps (its inputs) into ``pool``.

    Non-reentrant checkpoint installs its own hooks for the tensors saved *inside* the region, so
    hooks active around the ``checkpoint`` call see exactly the inputs the checkpoint saves.
    """

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.numel() == 0:
            return tensor
        pool = self.pool
        if pool.kind == "pinned" and tensor.device.type == "cuda":
            return self._pack_to_host(tensor)
        if tensor.device != pool.device:
            raise DeviceMismatchError(
                pool.device, tensor.device, what="checkpoint input",
                hint="Use a pool on the inputs' device, or MemoryPool.pinned() to keep CUDA "
                     "inputs in page-locked host memory.")
        stride = _layout(tensor)
        flat = pool.tensor((tensor.numel(),), tensor.dtype)  # returns its block when collected
        copy = flat.as_strided(tensor.shape, stride)
        with torch.no_grad():
            copy.copy_(tensor)
        return copy

    def _pack_to_host(self, tensor: torch.Tensor) -> _PinnedInput:
        streams = transfer_streams(tensor.device)
        block = self.pool.allocate(tensor.numel() * tensor.element_size())
        try:
            host = block.view((tensor.numel(),), tensor.dtype).as_strided(tensor.shape,
                                                                          _layout(tensor))
            produced = streams.event()
            streams.record(produced, streams.current())
            streams.wait(streams.d2h, produced)
            # The copy stream reads the tensor and writes the block after the caller may have
            # dropped both: keep the allocator and the pool from reusing them too early.
            tensor.record_stream(streams.d2h)
            block.record_stream(streams.d2h)
            streams.copy(host, tensor.detach(), streams.d2h, "checkpoint input d2h")
            copied = streams.event()
            streams.record(copied, streams.d2h)
        except BaseException:
            block.free()
            raise
        return _PinnedInput(block, host, copied, tensor.device)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _PinnedInput):
            return packed
        streams = transfer_streams(packed.device)
        device_copy = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype,
                                          device=packed.device)
        allocated = streams.event()  # the fresh buffer may still be read by earlier work
        streams.record(allocated, streams.current())
        streams.wait(streams.h2d, allocated)
        streams.wait(streams.h2d, packed.copied)
        packed.block.record_stream(streams.h2d)
        streams.copy(device_copy, packed.host, streams.h2d, "checkpoint input h2d")
        loaded = streams.event()
        streams.record(loaded, streams.h2d)
        streams.wait(streams.current(), loaded)
        return device_copy


def checkpoint_with_pool(fn: Callable[..., Any], *inputs: Any, pool: MemoryPool,
                         preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Checkpoint ``fn`` with the inputs it keeps for backward held in ``pool`` (seed FLAME).

    The tensors a non-reentrant checkpoint saves are its inputs; they are copied into pool
    memory, so activation memory is planned (capped, counted in ``pool.stats()``):

    * a pool on the inputs' device (device arena, or a host pool for CPU inputs): the copy lives
      in the arena until autograd releases it (after the block's backward, or when the graph is
      dropped);
    * a pinned host pool with CUDA inputs: the inputs go device->host on the shared copy stream
      (:func:`vramkit.memory.transfer.transfer_streams`), so the GPU copy can be freed; in
      backward they come back host->device on the copy stream and the compute stream waits for
      them on the GPU (no host sync). The host block is freed when autograd releases the saved
      input (kept until then so ``retain_graph=True`` can run backward again).

    Gradients are identical to :func:`checkpoint`.

    Args:
        fn: the function to checkpoint.
        *inputs: its positional arguments.
        pool: the :class:`~vramkit.memory.pool.MemoryPool` for the saved inputs.
        preserve_rng_state: restore the RNG state before recomputing (default ``True``).
        **kwargs: keyword arguments of ``fn`` (their tensors are copied to the pool as the
            positional inputs are).

    Returns:
        What ``fn`` returns. Without grad mode ``fn`` is called directly.

    Raises:
        ConfigError: when ``pool`` is not a MemoryPool or ``preserve_rng_state`` not a bool.
        DeviceMismatchError: when an input is on a device the pool cannot hold (a CUDA input
            with a plain host pool, or a pool on another device).
        PoolExhaustedError: when the pool's ``max_size`` cannot hold the inputs.
    """
    if not isinstance(pool, MemoryPool):
        raise ConfigError(f"pool must be a vramkit MemoryPool, got {type(pool).__name__}",
                          hint="Create one with MemoryPool('cuda') or MemoryPool.pinned().")
    check_bool("preserve_rng_state", preserve_rng_state)
    if not torch.is_grad_enabled():
        return fn(*inputs, **kwargs)
    with _PooledInputHooks(pool):
        return run_checkpointed(fn, inputs, kwargs, preserve_rng_state)
