"""CPU tests of activation offload: the mechanics run on the host with logged, synchronous streams."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._toys import Stack, assert_all_equal, frozen_mlp_stack
from vramkit.errors import ConfigError, DeviceError, OffloadError
from vramkit.memory.transfer import HostStreams, StreamOp
from vramkit.offload.activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    ActivationOffloadStats,
    offload_activations,
)

# Every tensor of the small models below is at least this big; parameters are too.
BIG = 4096


def make_offloader(log: list[StreamOp] | None = None, **config: Any) -> ActivationOffloader:
    config.setdefault("min_bytes", 0)
    config.setdefault("max_inflight_bytes", 0)  # everything goes through the host
    config.setdefault("prefetch_bytes", 0)  # the window counts tensors unless a test says so
    return ActivationOffloader(ActivationOffloadConfig(**config), device="cpu",
                               streams=HostStreams(log=log))


class Block(nn.Module):
    """MLP block with a tensor saved twice (``h * h``), views and a transpose."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.mix = nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        h = h * h  # the same tensor saved twice
        half = h.view(x.shape[0], 2, -1)[:, 0]  # a view with gaps
        y = self.down(h) + half @ self.mix.t()  # a transposed view of a parameter
        return x + y.tanh() * x.t().t()  # a view of the input, dense


def make_model(blocks: int = 3, width: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def train_step(model: nn.Module, x: torch.Tensor,
               ctx: contextlib.AbstractContextManager[Any]) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    inp = x.clone().requires_grad_(True)
    with ctx:
        loss = model(inp).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return [*grads, inp.grad.clone(), loss.detach()]


class Save(torch.autograd.Function):
    """Identity on ``x`` that saves ``keep`` and, in backward, records what came back."""

    seen: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(keep)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (kept,) = ctx.saved_tensors
        Save.seen.append(kept)
        return grad, None


@pytest.fixture(autouse=True)
def _clear_seen() -> Iterator[None]:
    Save.seen.clear()
    yield
    Save.seen.clear()


# -- log helpers ---------------------------------------------------------------------------------


def copy_events(log: list[StreamOp]) -> tuple[dict[int, int], dict[int, int]]:
    """``(stored, loaded)``: tensor index -> id of the event recorded right after its copy."""
    stored: dict[int, int] = {}
    loaded: dict[int, int] = {}
    for i, op in enumerate(log):
        if op.kind == "copy":
            direction, index = op.what.split(":")
            after = log[i + 1]
            assert after.kind == "record" and after.stream == op.stream
            (stored if direction == "d2h" else loaded)[int(index)] = after.event  # type: ignore
    return stored, loaded


def position(log: list[StreamOp], match: Callable[[StreamOp], bool]) -> int:
    hits = [i for i, op in enumerate(log) if match(op)]
    assert len(hits) == 1, hits
    return hits[0]


def sin_chain(offloader: ActivationOffloader, n: int, size: int = 256) -> torch.Tensor:
    """``n`` sin ops in a row: each saves its input, so backward unpacks in reverse order."""
    x = torch.randn(size, requires_grad=True)
    with offloader:
        h = x
        for _ in range(n):
            h = torch.sin(h)
    h.sum().backward()
    return x.grad  # type: ignore[return-value]


# -- gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("inflight", [0, 3 * BIG, None])
def test_gradients_bit_identical(inflight: int | None) -> None:
    model = make_model()
    x = torch.randn(8, 32)
    reference = train_step(model, x, contextlib.nullcontext())
    config: dict[str, Any] = {} if inflight is None else {"max_inflight_bytes": inflight}
    offloader = ActivationOffloader(ActivationOffloadConfig(min_bytes=0, **config), device="cpu")
    assert_all_equal(reference, train_step(model, x, offloader))
    stats = offloader.stats()
    assert stats.offloaded_tensors > 0
    assert stats.deduplicated >= 3  # h * h in each block, and views equal to their base
    assert stats.kept_parameters > 0
    first_unpacks = stats.prefetch_hits + stats.on_demand_loads + stats.device_hits
    assert first_unpacks == stats.offloaded_tensors
    if inflight == 0:
        assert stats.device_hits == 0 and stats.released == stats.offloaded_tensors
    if inflight is None:  # the default window holds this whole small model
        assert stats.device_hits == stats.offloaded_tensors and stats.loaded_bytes == 0
    if inflight == 3 * BIG:
        assert 0 < stats.device_hits < stats.offloaded_tensors
    assert stats.pinned_bytes == 0


def test_layouts_come_back_with_their_strides() -> None:
    offloader = make_offloader()
    x = torch.randn(64, requires_grad=True)
    dense_t = torch.randn(32, 48).t()  # dense, permuted
    expanded = torch.randn(1, 48).expand(32, 48)  # overlapping (stride 0)
    gaps = torch.randn(32, 96)[:, ::2]  # a view with gaps
    with offloader:
        y = Save.apply(x, dense_t)
        y = Save.apply(y, expanded)
        y = Save.apply(y, gaps)
    y.sum().backward()
    back_gaps, back_expanded, back_dense = Save.seen
    assert torch.equal(back_dense, dense_t) and back_dense.stride() == dense_t.stride()
    assert torch.equal(back_expanded, expanded) and back_expanded.stride() == (0, 1)
    assert torch.equal(back_gaps, gaps) and back_gaps.is_contiguous()
    stats = offloader.stats()
    assert stats.offloaded_tensors == 3
    # The expanded tensor costs its storage span (48 floats), not its 32 x 48 elements.
    assert stats.offloaded_bytes == (32 * 48 + 48 + 32 * 48) * 4


def test_small_tensors_stay_on_the_device() -> None:
    x = torch.randn(64, requires_grad=True)
    small, big = torch.randn(16), torch.randn(1024)  # 64 B and 4 KiB
    offloader = make_offloader(min_bytes=1024)
    with offloader:
        y = Save.apply(Save.apply(x, small), big)
    y.sum().backward()
    stats = offloader.stats()
    assert (stats.kept_small, stats.offloaded_tensors) == (1, 1)
    assert stats.kept_bytes == 64 and stats.offloaded_bytes == 4096
    assert Save.seen[1] is small  # kept tensors come back as themselves

    lower = make_offloader(min_bytes=64)  # the knob decides: now both go
    with lower:
        y = Save.apply(Save.apply(x, small), big)
    y.sum().backward()
    assert lower.stats().kept_small == 0 and lower.stats().offloaded_tensors == 2


def test_empty_tensors_stay() -> None:
    x = torch.randn(64, requires_grad=True)
    offloader = make_offloader(min_bytes=0)
    with offloader:
        y = Save.apply(x, torch.empty(0, 8))
    y.sum().backward()
    assert offloader.stats().kept_small == 1 and offloader.stats().offloaded_tensors == 0


def test_parameters_and_their_views_stay() -> None:
    weight = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, requires_grad=True)
    offloader = make_offloader()
    with offloader:
        y = Save.apply(Save.apply(x, weight), weight.t())
    y.sum().backward()
    stats = offloader.stats()
    assert stats.kept_parameters == 2 and stats.offloaded_tensors == 0
    assert stats.kept_bytes == 2 * 64 * 64 * 4
    assert offloader.pool is None  # nothing was worth a pool


def test_tensors_of_another_device_stay() -> None:
    x = torch.randn(128, device="meta", requires_grad=True)
    offloader = make_offloader()
    with offloader:
        y = torch.sin(x)
    assert y.grad_fn is not None
    assert offloader.stats().kept_unsupported == 1


def test_the_same_tensor_saved_twice_is_copied_once() -> None:
    x = torch.randn(256, requires_grad=True)
    log: list[StreamOp] = []
    offloader = make_offloader(log)
    with offloader:
        h = torch.sin(x)
        y = h * h  # mul saves both operands: the same tensor
    y.sum().backward()
    stats = offloader.stats()
    assert stats.deduplicated == 1
    assert stats.offloaded_tensors == 2  # x (by sin) and h (by mul, once)
    assert sum(op.what.startswith("d2h") for op in log) == 2
    assert torch.equal(x.grad, 2 * torch.sin(x) * torch.cos(x))


# -- ordering ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_backward_prefetches_ahead_of_use(prefetch: int) -> None:
    n = 8
    log: list[StreamOp] = []
    offloader = make_offloader(log, prefetch=prefetch)
    grad = sin_chain(offloader, n)
    stats = offloader.stats()
    assert (stats.on_demand_loads, stats.prefetch_hits) == (1, n - 1)
    stored, loaded = copy_events(log)
    assert sorted(stored) == sorted(loaded) == list(range(n))

    def unpacked(k: int) -> int:  # where backward took tensor k: the compute stream waits on it
        return position(log, lambda op: op.kind == "wait" and op.stream == "compute"
                        and op.event == loaded[k])

    def h2d(k: int) -> int:
        return position(log, lambda op: op.kind == "copy" and op.what == f"h2d:{k}")

    # Backward asks in reverse order; every copy but the first was issued while backward was
    # still using a later tensor.
    assert [unpacked(k) for k in reversed(range(n))] == sorted(unpacked(k) for k in range(n))
    for k in range(n - 1):
        assert h2d(k) < unpacked(k + 1)
    # The first unpack issues its own copy and `prefetch` more before it waits.
    assert sum(op.what.startswith("h2d") for op in log[:unpacked(n - 1)]) == 1 + prefetch
    # Each host->device copy waits for that tensor's device->host copy.
    for k in range(n):
        assert log[h2d(k) - 1] == StreamOp("wait", "h2d", stored[k])
    assert grad is not None


def test_prefetch_zero_loads_on_demand() -> None:
    n = 6
    log: list[StreamOp] = []
    offloader = make_offloader(log, prefetch=0)
    sin_chain(offloader, n)
    stats = offloader.stats()
    assert (stats.on_demand_loads, stats.prefetch_hits) == (n, 0)
    _, loaded = copy_events(log)
    for k in range(n - 1):  # each copy is issued only after backward finished the later tensor
        issued = position(log, lambda op, k=k: op.what == f"h2d:{k}")
        previous = position(log, lambda op, k=k: op.kind == "wait" and op.stream == "compute"
                            and op.event == loaded[k + 1])
        assert issued > previous


def test_device_to_host_copies_wait_for_the_compute_stream() -> None:
    log: list[StreamOp] = []
    sin_chain(make_offloader(log), 4)
    for i, op in enumerate(log):
        if op.kind == "copy" and op.stream == "d2h":
            record, wait = log[i - 2], log[i - 1]
            assert record.kind == "record" and record.stream == "compute"
            assert wait == StreamOp("wait", "d2h", record.event)


def test_inflight_window_bounds_what_is_held() -> None:
    n, size = 6, 256  # each saved tensor is 1 KiB
    log: list[StreamOp] = []
    offloader = make_offloader(log, max_inflight_bytes=2 * size * 4)
    sin_chain(offloader, n, size)
    stats = offloader.stats()
    # The oldest four were let go after the compute stream waited for their copies; the last
    # two were still held when backward came and were used without a copy back.
    assert (stats.released, stats.device_hits) == (n - 2, 2)
    stored, loaded = copy_events(log)
    assert sorted(loaded) == list(range(n - 2))
    waits = [op.event for op in log if op.kind == "wait" and op.stream == "compute"]
    assert waits[:n - 2] == [stored[k] for k in range(n - 2)]

    everything = make_offloader(max_inflight_bytes=10 * size * 4)
    sin_chain(everything, n, size)
    assert everything.stats().device_hits == n and everything.stats().loaded_bytes == 0


def test_trim_lets_go_of_held_tensors() -> None:
    log: list[StreamOp] = []
    offloader = make_offloader(log, max_inflight_bytes=1 << 30)
    x = torch.randn(256, requires_grad=True)
    with offloader:
        y = torch.sin(torch.sin(torch.sin(x)))
    assert offloader.stats().released == 0
    offloader.trim()  # the compute stream waits for the three copies; the tensors are let go
    stored, _ = copy_events(log)
    waits = [op.event for op in log if op.kind == "wait" and op.stream == "compute"]
    assert waits == [stored[0], stored[1], stored[2]]
    y.sum().backward()
    stats = offloader.stats()
    assert (stats.released, stats.device_hits, stats.on_demand_loads) == (3, 0, 1)
    assert torch.equal(x.grad, torch.cos(torch.sin(torch.sin(x))) * torch.cos(torch.sin(x))
                       * torch.cos(x))


# -- memory --------------------------------------------------------------------------------------


def test_host_blocks_are_reused_across_steps_without_the_pool() -> None:
    model = make_model()
    x = torch.randn(8, 32)
    offloader = make_offloader()
    reserved, allocations = [], []
    for _ in range(5):
        train_step(model, x, offloader)
        pool = offloader.pool
        assert pool is not None
        stats, ours = pool.stats(), offloader.stats()
        reserved.append(stats.reserved)
        allocations.append(stats.num_allocations)
        assert ours.pinned_bytes == 0
        # Every block is kept as a spare for the next step, none went back to the pool.
        assert stats.live_blocks > 0 and ours.spare_bytes == stats.allocated
    assert len(set(reserved)) == 1
    assert len(set(allocations)) == 1  # steps 2-5 asked the pool for nothing
    stats = offloader.stats()
    assert stats.pool_allocations == stats.offloaded_tensors // 5
    assert stats.reused_blocks == stats.offloaded_tensors - stats.pool_allocations
    assert stats.pinned_peak_bytes <= reserved[0]
    offloader.trim()
    assert offloader.stats().spare_bytes == 0 and pool.stats().live_blocks == 0


def test_reused_block_waits_for_its_last_load() -> None:
    log: list[StreamOp] = []
    offloader = make_offloader(log)
    sin_chain(offloader, 3)
    _, loaded = copy_events(log)
    start = len(log)
    sin_chain(offloader, 3)  # same sizes: all three blocks are reused
    assert offloader.stats().reused_blocks == 3
    second = log[start:]
    copies = [i for i, op in enumerate(second) if op.kind == "copy" and op.stream == "d2h"]
    # Before each device->host copy into a reused block, d2h waits (on the GPU) for the
    # host->device copy that last read it; blocks come back oldest-freed first.
    waited = [second[i - 3] for i in copies]
    assert all(op.kind == "wait" and op.stream == "d2h" for op in waited)
    assert [op.event for op in waited] == [loaded[2], loaded[1], loaded[0]]


def test_spares_unused_for_a_forward_pass_go_back_to_the_pool() -> None:
    offloader = make_offloader()
    sin_chain(offloader, 3, size=256)
    assert offloader.stats().spare_bytes == 3 * 1024
    sin_chain(offloader, 2, size=128)  # other sizes: the 1 KiB spares are not used
    assert offloader.stats().spare_bytes == 3 * 1024 + 2 * 512
    sin_chain(offloader, 2, size=128)  # a whole forward pass went by: the 1 KiB ones are let go
    stats = offloader.stats()
    assert stats.spare_bytes == 2 * 512 and stats.reused_blocks == 2
    assert offloader.pool is not None and offloader.pool.stats().live_blocks == 2


def test_spares_go_back_to_a_capped_pool_when_it_needs_room() -> None:
    offloader = make_offloader(max_pinned_bytes=3 * 1024)
    sin_chain(offloader, 3, size=256)  # 3 x 1 KiB: the pool is at its cap, all of it spare
    assert offloader.stats().spare_bytes == 3 * 1024
    sin_chain(offloader, 2, size=384)  # 2 x 1.5 KiB fit only once the spares are given back
    stats = offloader.stats()
    assert stats.kept_over_cap == 0 and stats.offloaded_tensors == 5
    assert stats.spare_bytes == 2 * 1536
    assert offloader.pool is not None and offloader.pool.stats().reserved <= 3 * 1024


def test_prefetch_bytes_window() -> None:
    n, size = 8, 256  # 1 KiB each
    log: list[StreamOp] = []
    offloader = make_offloader(log, prefetch=1, prefetch_bytes=3 * size * 4)
    sin_chain(offloader, n, size)
    _, loaded = copy_events(log)
    first_wait = position(log, lambda op: op.kind == "wait" and op.stream == "compute"
                          and op.event == loaded[n - 1])
    # One on demand, then three tensors' worth of bytes (more than prefetch=1 alone asks).
    assert sum(op.what.startswith("h2d") for op in log[:first_wait]) == 1 + 3
    assert offloader.stats().on_demand_loads == 1


class SavesInForwardOrder(torch.autograd.Function):
    """Saves three tensors; backward unpacks the oldest first (like attention's q, k, v)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, c)
        return a * b * c

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b, c = ctx.saved_tensors
        return grad * b * c, grad * a * c, grad * a * b


def test_a_tensor_every_block_saves_does_not_widen_the_window() -> None:
    """FLUX's rotary embedding is an input of every checkpointed block: backward asks for it
    first at the last block, far below the window's cursor. That must not start a second
    window beside the first (it held 851 MB of restored tensors at FLUX's peak, 256 MiB
    configured)."""
    from vramkit.offload.activations import _LOADED
    from vramkit.offload.checkpointing import enable_gradient_checkpointing

    tokens, width, blocks, window = 64, 16, 12, 4
    alive: list[int] = []

    class Rotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(width, width)

        def forward(self, h: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() and offloader._order:  # a recomputation in backward
                alive.append(sum(ref().nbytes for ref in offloader._order
                                 if ref() is not None and ref().state == _LOADED
                                 and ref().result is not None))
            return h + torch.tanh(self.lin(h) * rot)

    hidden = tokens * width * 4
    model = nn.ModuleList(Rotated() for _ in range(blocks))
    enable_gradient_checkpointing(model, [str(i) for i in range(blocks)])
    offloader = make_offloader(prefetch=1, prefetch_bytes=window * hidden)
    x = torch.randn(tokens, width, requires_grad=True)
    rot = torch.randn(tokens, width)
    with offloader:
        h = x
        for block in model:
            h = block(h, rot=rot)  # the same tensor for every block
    alive.clear()
    h.sum().backward()
    stats = offloader.stats()
    # The window, the block's own input, and the shared tensor (alive until its last user).
    assert max(alive) <= (window + 2) * hidden, [a // hidden for a in alive]
    assert stats.deduplicated == blocks - 1
    assert stats.on_demand_loads <= 2  # the first input and the shared tensor


def test_prefetch_covers_tensors_above_the_one_asked_for() -> None:
    def loss(x: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x)  # saves x (0)
        y = SavesInForwardOrder.apply(a, a * 2.0, a * 3.0)  # saves a (1), b (2), c (3)
        return torch.sin(y).sum()  # saves y (4)

    x = torch.randn(256, requires_grad=True)
    loss(x).backward()
    expected, x.grad = x.grad, None
    offloader = make_offloader(prefetch=1)
    with offloader:
        total = loss(x)
    total.backward()
    stats = offloader.stats()
    # sin(y)'s backward loads y on demand and prefetches c; the node then asks for a (a miss),
    # and the window must bring b next -- the tensor *above* a -- not x below it.
    assert (stats.on_demand_loads, stats.prefetch_hits) == (2, 3)
    assert torch.equal(x.grad, expected)


def test_pinned_cap_keeps_the_rest_on_the_device() -> None:
    model = make_model()
    x = torch.randn(8, 32)
    reference = train_step(model, x, contextlib.nullcontext())
    free = make_offloader()
    train_step(model, x, free)
    total = free.stats().pinned_peak_bytes
    cap = total // 2
    capped = make_offloader(max_pinned_bytes=cap)
    assert_all_equal(reference, train_step(model, x, capped))
    stats = capped.stats()
    assert stats.kept_over_cap > 0 and stats.offloaded_tensors > 0
    assert stats.pinned_peak_bytes <= cap
    assert capped.pool is not None and capped.pool.stats().peak_reserved <= cap


def test_dropped_graph_returns_its_blocks() -> None:
    offloader = make_offloader(prefetch=2)
    x = torch.randn(256, requires_grad=True)
    with offloader:
        y = torch.sin(torch.sin(torch.sin(x)))
    assert offloader.stats().pinned_bytes > 0
    del y
    stats = offloader.stats()
    assert stats.pinned_bytes == 0
    assert offloader.pool is not None
    assert stats.spare_bytes == 3 * 1024  # kept for the next step
    offloader.trim()
    pool_stats = offloader.pool.stats()
    assert pool_stats.live_blocks == 0 and pool_stats.leaked_frees == 0


def test_prefetched_but_unused_tensors_are_let_go() -> None:
    log: list[StreamOp] = []
    offloader = make_offloader(log, prefetch=3)
    x = torch.randn(256, requires_grad=True)
    with offloader:
        mid = torch.sin(torch.sin(torch.sin(x)))
        top = torch.sin(torch.sin(mid))
    (grad,) = torch.autograd.grad(top.sum(), mid)  # backward stops at mid
    assert torch.equal(grad, torch.cos(torch.sin(mid)) * torch.cos(mid))
    stats = offloader.stats()
    assert stats.loaded_bytes > 2 * 256 * 4  # the tensors below mid were prefetched too
    del top, mid
    _, loaded = copy_events(log)
    before = len(log)
    assert offloader.stats().pinned_bytes == 0
    # The compute stream waited for the unused copies before their memory could be reused.
    unused_waits = [op for op in log[before:] if op.kind == "wait" and op.stream == "compute"]
    assert {op.event for op in unused_waits} == {loaded[k] for k in range(3)}
    offloader.trim()
    assert offloader.pool is not None and offloader.pool.stats().live_blocks == 0


def test_retain_graph_backward_twice() -> None:
    model = make_model(blocks=2)
    x = torch.randn(8, 32, requires_grad=True)
    offloader = make_offloader()
    with offloader:
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward()
    assert torch.equal(first, x.grad)


def test_retain_graph_reloads_originals_from_the_host() -> None:
    model = make_model(blocks=2)
    x = torch.randn(8, 32, requires_grad=True)
    offloader = make_offloader(max_inflight_bytes=1 << 30)  # everything stays on the device
    with offloader:
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    assert offloader.stats().loaded_bytes == 0
    x.grad = None
    offloader.trim()  # forgets the originals: the second backward reads the host copies
    loss.backward()
    assert torch.equal(first, x.grad)
    assert offloader.stats().loaded_bytes > 0
    del loss
    assert offloader.stats().pinned_bytes == 0


# -- composition ---------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = make_model(blocks=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = checkpoint(self.blocks[1], x, use_reentrant=self.reentrant)
        return self.blocks[2](x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_composes_with_checkpointing(reentrant: bool) -> None:
    model = Checkpointed(reentrant)
    x = torch.randn(8, 32)
    reference = train_step(model, x, contextlib.nullcontext())
    plain = make_offloader()
    assert_all_equal(reference, train_step(model, x, plain))
    unwrapped = make_offloader()
    train_step(model.blocks, x, unwrapped)
    # The checkpointed block's own saves are recomputed, not offloaded.
    assert plain.stats().offloaded_tensors < unwrapped.stats().offloaded_tensors


def _frozen_blocks() -> Stack:
    return frozen_mlp_stack(in_dim=32, width=64, hidden=64, blocks=4, out_dim=8)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_composes_with_the_block_swapper(checkpointed: bool) -> None:
    swap = pytest.importorskip("vramkit.offload.swap")
    x = torch.randn(16, 32)
    reference = train_step(_frozen_blocks(), x, contextlib.nullcontext())
    alone = make_offloader()
    assert_all_equal(reference, train_step(_frozen_blocks(), x, alone))
    model = _frozen_blocks()
    swapper = swap.BlockSwapper(model, config=swap.SwapConfig(
        max_gpu_blocks=2, checkpointing=checkpointed, min_param_bytes=0), device="cpu")
    try:
        offloader = make_offloader()
        assert_all_equal(reference, train_step(model, x, offloader))
        assert swapper.stats().swapped_blocks == 2
    finally:
        swapper.detach()
    # The swapper passes every saved tensor that is not a slot weight on to the hooks active
    # outside the block, so activations inside swapped blocks are offloaded as well.
    assert offloader.stats().offloaded_tensors == alone.stats().offloaded_tensors


# -- API and errors ------------------------------------------------------------------------------


def test_offload_activations_context() -> None:
    x = torch.randn(256, requires_grad=True)
    offloader = offload_activations(ActivationOffloadConfig(min_bytes=0), device="cpu")
    assert not offloader.active
    with offloader as active:
        assert active is offloader and offloader.active
        y = torch.sin(x)
    assert not offloader.active
    y.sum().backward()
    stats = offloader.stats()
    assert isinstance(stats, ActivationOffloadStats) and stats.offloaded_tensors == 1
    offloader.reset_stats()
    # The block kept for the next step is a current quantity, not a counter.
    assert offloader.stats() == ActivationOffloadStats(spare_bytes=1024)
    assert offloader.trim() >= 0
    assert offloader.stats() == ActivationOffloadStats()
    assert "ActivationOffloader(device=cpu" in repr(offloader)


def test_stats_hit_rate() -> None:
    assert ActivationOffloadStats().prefetch_hit_rate == 0.0
    assert ActivationOffloadStats(prefetch_hits=3, on_demand_loads=1).prefetch_hit_rate == 0.75


def test_config_sizes_parse() -> None:
    config = ActivationOffloadConfig(min_bytes="2KiB", max_pinned_bytes="1MiB",
                                     max_inflight_bytes="0B")
    assert ((config.min_bytes, config.max_pinned_bytes, config.max_inflight_bytes)
            == (2048, 1 << 20, 0))
    assert ActivationOffloadConfig().min_bytes == 1 << 20
    assert ActivationOffloadConfig().prefetch_bytes == 256 << 20
    assert ActivationOffloadConfig(prefetch_bytes="1KiB").prefetch_bytes == 1024


@pytest.mark.parametrize("kwargs", [
    {"min_bytes": -1}, {"min_bytes": "lots"}, {"min_bytes": 1.5}, {"min_bytes": True},
    {"prefetch": -1}, {"prefetch": 1.0}, {"prefetch": True},
    {"prefetch_bytes": -1}, {"prefetch_bytes": "far"}, {"prefetch_bytes": None},
    {"max_pinned_bytes": 0}, {"max_pinned_bytes": "-1MiB"},
    {"max_inflight_bytes": -1}, {"max_inflight_bytes": None},
])
def test_config_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ActivationOffloadConfig(**kwargs)


def test_config_type_checked() -> None:
    with pytest.raises(ConfigError):
        ActivationOffloader({"min_bytes": 0}, device="cpu")  # type: ignore[arg-type]


def test_device_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError):
        ActivationOffloader(device="meta")
    with pytest.raises(ConfigError):
        ActivationOffloader(device=True)  # type: ignore[arg-type]
    with pytest.raises(DeviceError):
        ActivationOffloader(device="cpu", streams=HostStreams(device=torch.device("meta")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="device='cpu'"):
        ActivationOffloader()
    with pytest.raises(DeviceError):
        ActivationOffloader(device=0)


def test_entering_twice_is_refused() -> None:
    offloader = make_offloader()
    with offloader:
        with pytest.raises(OffloadError):
            offloader.__enter__()
    assert not offloader.active
    with offloader:  # usable again once exited
        pass


def test_in_place_change_after_save_is_reported() -> None:
    x = torch.randn(256, requires_grad=True)
    offloader = make_offloader()
    with offloader:
        h = x * 2
        y = torch.sin(h)
        h.add_(1)  # autograd would refuse this too
    with pytest.raises(OffloadError, match="modified in place"):
        y.sum().backward()


def test_the_inputs_of_non_reentrant_checkpoints_are_offloaded() -> None:
    # With every block checkpointed, what stays for backward is each block's input: the
    # checkpoint saves it on an autograd node outside its region's hooks, so it is offloaded
    # (the planner's activation-offload plans count on it).
    from vramkit.offload.checkpointing import enable_gradient_checkpointing

    model = make_model(blocks=4)
    enable_gradient_checkpointing(model)
    x = torch.randn(8, 32, requires_grad=True)
    offloader = make_offloader()
    with offloader:
        out = model(x)
    stats = offloader.stats()
    assert stats.offloaded_tensors == 4  # x and the three later blocks' inputs
    assert stats.offloaded_bytes == 4 * x.numel() * x.element_size()
    out.sum().backward()


class KeywordBlock(nn.Module):
    """A block called with keyword arguments and a tuple of tensors, as diffusers calls its
    transformer blocks (``block(hidden_states=..., temb=..., image_rotary_emb=(cos, sin))``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)  # a frozen base
        self.gain = nn.Parameter(torch.ones(width))  # trained (an adapter's part)

    def forward(self, hidden_states: torch.Tensor, *, temb: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rotary
        return hidden_states + torch.tanh(self.fc(hidden_states * cos + sin) * self.gain + temb)


class KeywordModel(nn.Module):
    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(KeywordBlock(width) for _ in range(blocks))
        self.temb = nn.Parameter(torch.randn(width), requires_grad=False)
        self.register_buffer("cos", torch.rand(width))
        self.register_buffer("sin", torch.rand(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(hidden_states=x, temb=self.temb, rotary=(self.cos, self.sin))
        return x


def _keyword_step(model: nn.Module, x: torch.Tensor, ctx: Any,
                  outputs: list[Any] | None = None) -> list[torch.Tensor]:
    import weakref

    handles = []
    if outputs is not None:
        for block in model.blocks:
            handles.append(block.register_forward_hook(
                lambda _m, _a, out: outputs.append(weakref.ref(out))))
    try:
        for p in model.parameters():
            p.grad = None
        inp = x.clone().requires_grad_(True)
        with ctx:
            out = model(inp)
        if outputs is not None:  # what is still alive between forward and backward
            outputs[:] = [ref() is not None for ref in outputs[:-1]]
        loss = out.square().mean()
        del out
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return [*grads, inp.grad.clone(), loss.detach()]
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("swapped", [False, True])
def test_keyword_inputs_of_checkpointed_blocks_are_offloaded(swapped: bool) -> None:
    # PyTorch's non-reentrant checkpoint holds keyword arguments (and tensors inside tuples)
    # by reference until backward; only its positional tensors go through the saved-tensor
    # hooks. vramkit passes every tensor of a checkpointed call positionally, so under
    # activation offload no block's hidden states stay on the device between forward and
    # backward (FLUX.1-dev at 1024 px kept 1.5 GiB there before), and gradients are unchanged.
    from vramkit.offload.checkpointing import enable_gradient_checkpointing

    x = torch.randn(8, 32)
    reference = _keyword_step(KeywordModel(), x, contextlib.nullcontext())
    model = KeywordModel()
    swapper = None
    if swapped:
        swap = pytest.importorskip("vramkit.offload.swap")
        swapper = swap.BlockSwapper(model, config=swap.SwapConfig(
            max_gpu_blocks=1, checkpointing=True, min_param_bytes=0), device="cpu")
    else:
        enable_gradient_checkpointing(model)
    try:
        offloader = make_offloader()
        alive: list[Any] = []
        assert_all_equal(reference, _keyword_step(model, x, offloader, alive))
        if swapper is not None:
            assert swapper.stats().swapped_blocks == 3
    finally:
        if swapper is not None:
            swapper.detach()
    # every block's output but the last was the next block's input: offloaded, let go
    assert alive == [False, False, False]
    # each block's hidden_states went to the host (and cos, sin: the same buffers, copied once)
    hidden = x.numel() * x.element_size()
    assert offloader.stats().offloaded_bytes >= 4 * hidden + 2 * 32 * 4
