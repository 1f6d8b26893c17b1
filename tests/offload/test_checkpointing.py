"""Tests of vramkit.offload.checkpointing: block checkpointing, generic checkpoint, the seed checkpointer
and checkpoint_with_pool."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from tests._toys import ResidualMLP, Stack, assert_same_grads
from vramkit.errors import ConfigError, DeviceMismatchError, OffloadError, PoolExhaustedError
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.offload.blocks import find_blocks
from vramkit.offload.checkpointing import (
    SDXL_CHECKPOINT_BLOCKS,
    GradientCheckpointer,
    SDXLGradientCheckpoint,
    checkpoint,
    checkpoint_with_pool,
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_checkpointed,
    unwrapped_forward,
)

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class CountingMLP(ResidualMLP):
    """A residual MLP block that counts how often its forward runs."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__(dim, dropout=dropout)
        self.calls = 0

    def weight_is_not_shared(self, other: CountingMLP) -> bool:
        return self.up.weight is not other.up.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def make_model(seed: int = 0, dim: int = 16, depth: int = 6, dropout: float = 0.0) -> Stack:
    """``depth`` residual MLP blocks (counting their calls) between ``embed`` and ``head``."""
    return Stack(lambda: CountingMLP(dim, dropout), depth, inp=(dim, dim), out=(dim, 1),
                 names=("embed", "head"), seed=seed)


def train_step(model: nn.Module, x: torch.Tensor, seed: int = 1
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss, parameter gradients and input gradient of one step (fresh grads)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert x.grad is not None
    return loss.detach(), grads, x.grad.clone()


def assert_identical(a: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor],
                     b: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]) -> None:
    assert torch.equal(a[0], b[0])
    assert_same_grads(b[1], a[1])
    assert torch.equal(a[2], b[2])


def block_calls(model: Stack) -> list[int]:
    return [b.calls for b in model.blocks]


def reset_calls(model: Stack) -> None:
    for b in model.blocks:
        b.calls = 0


@contextmanager
def saved_bytes_probe() -> Iterator[list[int]]:
    """Sum the bytes of every tensor autograd saves for backward inside the block."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


# --------------------------------------------------------------------------------------------
# enable / disable
# --------------------------------------------------------------------------------------------


def test_checkpointed_gradients_are_bit_identical() -> None:
    reference = make_model()
    ckpt = copy.deepcopy(reference)
    names = enable_gradient_checkpointing(ckpt)
    assert names == [f"blocks.{i}" for i in range(6)]
    x = torch.randn(8, 16)
    assert_identical(train_step(reference, x), train_step(ckpt, x))


@pytest.mark.parametrize("preserve", [True, False])
def test_dropout_needs_preserved_rng_state(preserve: bool) -> None:
    reference = make_model(dim=32, depth=3, dropout=0.5)
    ckpt = copy.deepcopy(reference)
    enable_gradient_checkpointing(ckpt, preserve_rng_state=preserve)
    x = torch.randn(16, 32)
    expected, got = train_step(reference, x), train_step(ckpt, x)
    assert torch.equal(expected[0], got[0])  # the forward pass is the same either way
    same_grads = all(torch.equal(expected[1][n], got[1][n]) for n in expected[1])
    # Without the RNG state the recomputation draws other dropout masks: wrong gradients.
    assert same_grads is preserve


@pytest.mark.parametrize(("every_n", "expected"), [(1, [0, 1, 2, 3, 4, 5]), (2, [0, 2, 4]),
                                                   (3, [0, 3]), (7, [0])])
def test_every_n_checkpoints_every_nth_block(every_n: int, expected: list[int]) -> None:
    model = make_model()
    names = enable_gradient_checkpointing(model, every_n=every_n)
    assert names == [f"blocks.{i}" for i in expected]
    reset_calls(model)
    train_step(model, torch.randn(4, 16))
    # A checkpointed block's forward runs again in backward.
    assert block_calls(model) == [2 if i in expected else 1 for i in range(6)]
    assert [is_checkpointed(b) for b in model.blocks] == [i in expected for i in range(6)]


def test_enabling_twice_does_not_wrap_twice() -> None:
    model = make_model()
    enable_gradient_checkpointing(model)
    wrapper = model.blocks[0].__dict__["forward"]
    assert enable_gradient_checkpointing(model) == [f"blocks.{i}" for i in range(6)]
    assert model.blocks[0].__dict__["forward"] is wrapper
    reset_calls(model)
    train_step(model, torch.randn(4, 16))
    assert block_calls(model) == [2] * 6


def test_second_enable_updates_preserve_rng_state() -> None:
    reference = make_model(dim=32, depth=2, dropout=0.5)
    ckpt = copy.deepcopy(reference)
    enable_gradient_checkpointing(ckpt, preserve_rng_state=False)
    enable_gradient_checkpointing(ckpt, preserve_rng_state=True)
    x = torch.randn(16, 32)
    assert_identical(train_step(reference, x), train_step(ckpt, x))


def test_disable_restores_the_model_exactly() -> None:
    model = make_model()
    params = {n: p for n, p in model.named_parameters()}
    hook_calls = []
    handle = model.blocks[1].register_forward_hook(lambda *_: hook_calls.append(1))
    enable_gradient_checkpointing(model)
    reset_calls(model)
    train_step(model, torch.randn(4, 16))
    assert len(hook_calls) == 1  # hooks run once per call; only forward is recomputed

    restored = disable_gradient_checkpointing(model)
    assert restored == [f"blocks.{i}" for i in range(6)]
    for block in model.blocks:
        assert "forward" not in block.__dict__
        assert "_vramkit_checkpoint" not in block.__dict__
        assert block.forward.__func__ is CountingMLP.forward
        assert not is_checkpointed(block)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.blocks[1]._forward_hooks  # hooks untouched
    reset_calls(model)
    train_step(model, torch.randn(4, 16))
    assert block_calls(model) == [1] * 6
    assert len(hook_calls) == 2
    handle.remove()
    assert disable_gradient_checkpointing(model) == []


def test_disable_restores_an_instance_forward() -> None:
    model = make_model()
    block = model.blocks[0]
    original = block.forward

    def patched(x: torch.Tensor) -> torch.Tensor:
        return original(x)

    block.forward = patched
    enable_gradient_checkpointing(model)
    assert block.__dict__["forward"] is not patched
    assert unwrapped_forward(block) is patched
    disable_gradient_checkpointing(model)
    assert block.__dict__["forward"] is patched


def test_disable_keeps_a_later_patch_but_stops_checkpointing() -> None:
    model = make_model()
    enable_gradient_checkpointing(model)
    block = model.blocks[0]
    wrapper = block.forward

    def later_patch(x: torch.Tensor) -> torch.Tensor:
        return wrapper(x)

    block.forward = later_patch
    disable_gradient_checkpointing(model)
    assert block.__dict__["forward"] is later_patch
    assert not is_checkpointed(block)
    reset_calls(model)
    train_step(model, torch.randn(4, 16))
    assert block_calls(model) == [1] * 6


def test_copies_of_a_checkpointed_model_run_their_own_blocks() -> None:
    reference = make_model()
    model = copy.deepcopy(reference)
    enable_gradient_checkpointing(model)
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 16)
    for other in (clone, loaded):
        reset_calls(model)
        reset_calls(other)
        assert_identical(train_step(reference, x), train_step(other, x))
        assert block_calls(other) == [2] * 6 and block_calls(model) == [0] * 6
        assert all(model.blocks[i].weight_is_not_shared(other.blocks[i]) for i in range(6))
        assert disable_gradient_checkpointing(other) == [f"blocks.{i}" for i in range(6)]
        assert "forward" not in other.blocks[0].__dict__
    assert all(is_checkpointed(b) for b in model.blocks)


def test_no_grad_calls_forward_directly() -> None:
    model = make_model()
    enable_gradient_checkpointing(model)
    x = torch.randn(4, 16)
    reset_calls(model)
    with torch.no_grad():
        out = model(x)
    assert block_calls(model) == [1] * 6
    disable_gradient_checkpointing(model)
    with torch.no_grad():
        assert torch.equal(out, model(x))


def test_unwrapped_forward_is_the_original() -> None:
    model = make_model()
    block = model.blocks[2]
    assert unwrapped_forward(block) == block.forward  # not checkpointed: the module's forward
    enable_gradient_checkpointing(model)
    forward = unwrapped_forward(block)
    assert forward.__func__ is CountingMLP.forward and forward.__self__ is block
    x = torch.randn(4, 16, requires_grad=True)
    with saved_bytes_probe() as direct:
        forward(x)
    with saved_bytes_probe() as wrapped:
        block(x)
    assert wrapped[0] < direct[0] / 4  # the unwrapped forward saves its activations itself


def test_auto_finds_the_same_blocks_as_find_blocks() -> None:
    model = make_model()
    expected = [name for name, _ in find_blocks(model, "auto")]
    assert enable_gradient_checkpointing(model, "auto") == expected


def test_names_and_patterns() -> None:
    model = make_model()
    assert enable_gradient_checkpointing(model, ["blocks.1", "blocks.3"]) == ["blocks.1",
                                                                            "blocks.3"]
    assert [is_checkpointed(b) for b in model.blocks] == [False, True, False, True, False, False]
    disable_gradient_checkpointing(model)
    assert enable_gradient_checkpointing(model, ["blocks"]) == [f"blocks.{i}" for i in range(6)]
    disable_gradient_checkpointing(model)
    assert enable_gradient_checkpointing(model, ["blocks.[0-2]"], every_n=2) == ["blocks.0",
                                                                               "blocks.2"]
    assert enable_gradient_checkpointing(model, "head") == ["head"]
    assert is_checkpointed(model.head)


@pytest.mark.parametrize("every_n", [0, -1, 1.5, True, "2", None])
def test_bad_every_n(every_n: Any) -> None:
    with pytest.raises(ConfigError, match="every_n"):
        enable_gradient_checkpointing(make_model(), every_n=every_n)


def test_bad_arguments() -> None:
    model = make_model()
    with pytest.raises(ConfigError, match="preserve_rng_state"):
        enable_gradient_checkpointing(model, preserve_rng_state=1)  # type: ignore[arg-type]
    with pytest.raises(OffloadError):
        enable_gradient_checkpointing(model, ["no_such_module"])
    with pytest.raises(ConfigError):
        enable_gradient_checkpointing(model, 5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        enable_gradient_checkpointing("not a model")  # type: ignore[arg-type]
    assert not any(is_checkpointed(m) for m in model.modules())


@pytest.mark.parametrize(("every_n", "max_share"), [(1, 0.25), (2, 0.65)])
def test_activation_memory_is_saved(every_n: int, max_share: float) -> None:
    reference = make_model(dim=64)
    ckpt = copy.deepcopy(reference)
    enable_gradient_checkpointing(ckpt, every_n=every_n)
    x = torch.randn(32, 64, requires_grad=True)
    with saved_bytes_probe() as full:
        reference(x).sum().backward()
    with saved_bytes_probe() as kept:
        ckpt(x).sum().backward()
    assert 0 < kept[0] < max_share * full[0]


# --------------------------------------------------------------------------------------------
# checkpoint()
# --------------------------------------------------------------------------------------------


class CountingFn:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.calls = 0
        self.kwargs: list[dict[str, Any]] = []

    def __call__(self, x: torch.Tensor, scale: float = 1.0, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        self.kwargs.append(kwargs)
        return torch.tanh(x @ self.weight) * scale


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpoint_enabled_flag(enabled: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    fn = CountingFn(weight)
    out = checkpoint(fn, x, enabled=enabled, scale=2.0, use_reentrant="passed to fn")
    out.sum().backward()
    assert fn.calls == (2 if enabled else 1)
    assert fn.kwargs[0] == {"use_reentrant": "passed to fn"}  # fn's kwargs do not collide
    expected_w, expected_x = torch.autograd.grad((torch.tanh(x @ weight) * 2.0).sum(),
                                                 (weight, x))
    assert torch.equal(weight.grad, expected_w) and torch.equal(x.grad, expected_x)


def test_checkpoint_without_grad_runs_once() -> None:
    fn = CountingFn(torch.randn(8, 8))
    with torch.no_grad():
        checkpoint(fn, torch.randn(4, 8))
    assert fn.calls == 1


def test_checkpoint_saves_only_its_inputs() -> None:
    weight = torch.randn(64, 256, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.relu(a @ weight).exp().sum(dim=1)

    with saved_bytes_probe() as direct:
        checkpoint(fn, x, enabled=False)
    with saved_bytes_probe() as ckpt:
        checkpoint(fn, x)
    assert ckpt[0] == x.numel() * x.element_size()
    assert direct[0] > 4 * ckpt[0]


def test_checkpoint_bad_flags() -> None:
    with pytest.raises(ConfigError, match="enabled"):
        checkpoint(torch.sin, torch.ones(2), enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="preserve_rng_state"):
        checkpoint(torch.sin, torch.ones(2), preserve_rng_state=None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# GradientCheckpointer (seed SDXLGradientCheckpoint)
# --------------------------------------------------------------------------------------------


def test_checkpointer_defaults_and_alias() -> None:
    assert SDXLGradientCheckpoint is GradientCheckpointer
    ckpt = SDXLGradientCheckpoint()
    assert ckpt.enabled and ckpt.checkpoint_blocks == SDXL_CHECKPOINT_BLOCKS
    assert ckpt.matches("down_blocks.0") and ckpt.matches("up_blocks.2.attentions.1")
    assert ckpt.matches("mid_block")
    assert not ckpt.matches("mid_block.resnets.0")
    assert not ckpt.matches("conv_in") and not ckpt.matches("Down_blocks.0")
    assert "down_blocks" in repr(ckpt)


def test_checkpointer_checkpoints_matching_names_when_enabled() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = GradientCheckpointer(["blocks.*"])
    calls: list[int] = []
    for name, enabled, recomputed in [("blocks.0", True, True), ("head", True, False),
                                      ("blocks.1", False, False)]:
        ckpt.set_enabled(enabled)
        fn = CountingFn(weight)
        ckpt.checkpoint_forward(name, fn, [x]).sum().backward()
        calls.append(fn.calls)
        assert fn.calls == (2 if recomputed else 1), name
    assert ckpt.checkpointed_calls == 1 and ckpt.direct_calls == 2
    # Gradients accumulate identically whether or not the call was checkpointed.
    expected = torch.autograd.grad(3 * torch.tanh(x @ weight).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, expected, rtol=0, atol=1e-6)
    ckpt.reset_stats()
    assert ckpt.checkpointed_calls == 0 and ckpt.direct_calls == 0


def test_checkpointer_without_grad_calls_directly() -> None:
    ckpt = GradientCheckpointer()
    fn = CountingFn(torch.randn(8, 8))
    with torch.no_grad():
        ckpt.checkpoint_forward("mid_block", fn, (torch.randn(2, 8),))
    assert fn.calls == 1 and ckpt.direct_calls == 1 and ckpt.checkpointed_calls == 0


def test_checkpointer_single_pattern_and_errors() -> None:
    assert GradientCheckpointer("layers.*").checkpoint_blocks == ("layers.*",)
    with pytest.raises(ConfigError):
        GradientCheckpointer([""])
    with pytest.raises(ConfigError):
        GradientCheckpointer([3])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        GradientCheckpointer(enabled="on")  # type: ignore[arg-type]
    ckpt = GradientCheckpointer()
    with pytest.raises(ConfigError):
        ckpt.set_enabled(0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="list or tuple"):
        ckpt.checkpoint_forward("mid_block", torch.sin, torch.ones(2))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# checkpoint_with_pool
# --------------------------------------------------------------------------------------------


def _pool_step(fn: Callable[..., torch.Tensor], weight: torch.Tensor, x: torch.Tensor,
               pool: MemoryPool | None) -> tuple[torch.Tensor, torch.Tensor]:
    weight.grad = None
    xr = x.detach().clone().requires_grad_(True)
    out = checkpoint(fn, xr) if pool is None else checkpoint_with_pool(fn, xr, pool=pool)
    out.square().sum().backward()
    assert weight.grad is not None and xr.grad is not None
    return weight.grad.clone(), xr.grad.clone()


def test_checkpoint_with_pool_matches_checkpoint_and_frees_after_backward() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 32, requires_grad=True)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ weight) * b

    pool = MemoryPool("cpu")
    x, y = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32)
    out = checkpoint_with_pool(fn, x, y, pool=pool)
    stats = pool.stats()
    assert stats.live_blocks == 2
    assert stats.requested == x.nbytes + y.nbytes
    out.square().sum().backward()
    assert pool.stats().allocated == 0 and pool.stats().live_blocks == 0

    expected = _pool_step(lambda a: fn(a, y), weight, x, None)
    got = _pool_step(lambda a: fn(a, y), weight, x, pool)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_checkpoint_with_pool_recomputes_from_the_pool_copy() -> None:
    seen: list[torch.Tensor] = []

    def fn(a: torch.Tensor) -> torch.Tensor:
        seen.append(a)
        return a.exp()

    pool = MemoryPool("cpu")
    x = torch.randn(8, 8).t().requires_grad_(True)  # transposed: a dense, non-contiguous layout
    out = checkpoint_with_pool(fn, x, pool=pool)
    out.sum().backward()
    assert len(seen) == 2
    assert seen[1].data_ptr() != x.data_ptr()  # recomputed from the pool's copy
    assert seen[1].stride() == x.stride()  # with the original layout
    assert torch.equal(seen[1], x.detach())
    assert torch.equal(x.grad, x.detach().exp())


def test_checkpoint_with_pool_packs_gapped_views_contiguously() -> None:
    seen: list[torch.Tensor] = []

    def fn(a: torch.Tensor) -> torch.Tensor:
        seen.append(a)
        return a.exp()

    pool = MemoryPool("cpu")
    base = torch.randn(8, 16, requires_grad=True)
    view = base[:, ::2]
    checkpoint_with_pool(fn, view, pool=pool).sum().backward()
    assert seen[1].is_contiguous() and torch.equal(seen[1], view.detach())
    assert pool.stats().allocated > 0  # the pool copy lives while anything references it
    seen.clear()
    assert pool.stats().allocated == 0
    expected = torch.zeros(8, 16)
    expected[:, ::2] = view.detach().exp()
    assert torch.equal(base.grad, expected)


def test_checkpoint_with_pool_drops_memory_with_the_graph() -> None:
    pool = MemoryPool("cpu")
    x = torch.randn(64, 64, requires_grad=True)
    out = checkpoint_with_pool(torch.sin, x, pool=pool)
    assert pool.stats().allocated >= x.nbytes
    del out
    assert pool.stats().allocated == 0
    assert pool.stats().leaked_frees == 0


def test_checkpoint_with_pool_retain_graph() -> None:
    pool = MemoryPool("cpu")
    x = torch.randn(8, 8, requires_grad=True)
    out = checkpoint_with_pool(torch.sin, x, pool=pool).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert torch.equal(x.grad, 2 * torch.cos(x.detach()))
    del out
    assert pool.stats().allocated == 0


def test_checkpoint_with_pool_respects_the_pool_cap() -> None:
    pool = MemoryPool("cpu", PoolConfig(max_size="4KiB"))
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB
    with pytest.raises(PoolExhaustedError):
        checkpoint_with_pool(torch.sin, x, pool=pool)
    small = torch.randn(16, 16, requires_grad=True)
    checkpoint_with_pool(torch.sin, small, pool=pool).sum().backward()
    assert torch.equal(small.grad, torch.cos(small.detach()))


def test_checkpoint_with_pool_without_grad_uses_no_pool() -> None:
    pool = MemoryPool("cpu")
    with torch.no_grad():
        out = checkpoint_with_pool(torch.sin, torch.ones(4), pool=pool)
    assert torch.equal(out, torch.sin(torch.ones(4)))
    assert pool.stats().num_allocations == 0


def test_checkpoint_with_pool_errors() -> None:
    with pytest.raises(ConfigError, match="MemoryPool"):
        checkpoint_with_pool(torch.sin, torch.ones(2), pool="cpu")  # type: ignore[arg-type]
    pool = MemoryPool("cpu")
    with pytest.raises(ConfigError):
        checkpoint_with_pool(torch.sin, torch.ones(2), pool=pool,
                             preserve_rng_state="no")  # type: ignore[arg-type]
    meta = torch.empty(4, device="meta", requires_grad=True)
    with pytest.raises(DeviceMismatchError):
        checkpoint_with_pool(torch.sin, meta, pool=pool)
    assert pool.stats().allocated == 0


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_checkpointed_gradients_are_bit_identical() -> None:
    reference = make_model(dim=256, depth=4, dropout=0.1).cuda()
    ckpt = copy.deepcopy(reference)
    enable_gradient_checkpointing(ckpt)
    x = torch.randn(64, 256, device="cuda")
    assert_identical(train_step(reference, x), train_step(ckpt, x))
    disable_gradient_checkpointing(ckpt)
    assert_identical(train_step(reference, x), train_step(ckpt, x))


def _peak_step_bytes(model: nn.Module, x: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.gpu
def test_cuda_checkpointing_lowers_peak_memory() -> None:
    model = make_model(dim=1024, depth=8).cuda()
    x = torch.randn(16384, 1024, device="cuda", requires_grad=True)
    _peak_step_bytes(model, x)  # warm-up: cuBLAS workspaces
    full = _peak_step_bytes(model, x)
    names = enable_gradient_checkpointing(model)
    assert len(names) == 8
    ckpt = _peak_step_bytes(model, x)
    # Without checkpointing each block keeps ~640 MiB of activations; with it, its 64 MiB input
    # (plus one block's activations while it is recomputed, and the weight gradients).
    assert ckpt < 0.5 * full, (ckpt, full)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["device", "pinned"])
def test_cuda_checkpoint_with_pool(kind: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(512, 512, device="cuda", requires_grad=True)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(a @ weight) @ weight

    pool = MemoryPool("cuda") if kind == "device" else MemoryPool.pinned()
    x = torch.randn(1024, 512, device="cuda")
    expected = _pool_step(fn, weight, x, None)
    got = _pool_step(fn, weight, x, pool)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])

    xr = x.clone().requires_grad_(True)
    out = checkpoint_with_pool(fn, xr, pool=pool)
    assert pool.stats().allocated >= x.nbytes
    out.sum().backward()
    torch.cuda.synchronize()
    assert pool.stats().allocated == 0


@pytest.mark.gpu
def test_cuda_pinned_pool_frees_the_device_copy() -> None:
    pool = MemoryPool.pinned()
    weight = torch.randn(1024, 1024, device="cuda", requires_grad=True)

    (torch.randn(64, 1024, device="cuda") @ weight).sum()  # warm-up: cuBLAS workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = checkpoint_with_pool(lambda a: (a @ weight).sum(),
                               torch.randn(8192, 1024, device="cuda"), pool=pool)
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator retire blocks held by record_stream
    # The 32 MiB input lives on the host now; the GPU holds only the scalar output.
    assert torch.cuda.memory_allocated() - before < 4 * 2**20
    out.backward()
    assert weight.grad is not None and pool.stats().allocated == 0


def test_disable_only_the_named_blocks() -> None:
    model = make_model()
    enable_gradient_checkpointing(model)
    assert disable_gradient_checkpointing(model, ["blocks.1", "blocks.3"]) == ["blocks.1",
                                                                              "blocks.3"]
    assert [is_checkpointed(b) for b in model.blocks] == [i not in (1, 3) for i in range(6)]
    with pytest.raises(ConfigError):
        disable_gradient_checkpointing(model, "blocks.0")  # type: ignore[arg-type]
