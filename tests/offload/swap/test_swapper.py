"""BlockSwapper on the CPU: configuration, scheduling, event/slot ordering, inference,
detach/restore, which tensors swap, sizes and statistics (training calls: ``test_calls.py``).

The swapper runs with ``device="cpu"``: masters live in a plain host pool, slots in a host
arena, and the copy streams are the synchronous :class:`HostStreams`. Ordering tests give the
swapper a logging ``HostStreams`` and add ``acquire``/``release`` markers to its log, so the
exact sequence of copies, waits and records is checked against what a GPU would need.
"""

from __future__ import annotations

import copy
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests._toys import assert_same_grads, grads_of, host_params
from vramkit.errors import ConfigError, DeviceError, OffloadError, VramkitWarning
from vramkit.memory.layout import Random, Sequential, Strided
from vramkit.memory.transfer import HostStreams, StreamOp
from vramkit.offload.blocks import BlockSpec, spread_evenly
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockScheduleEntry, BlockSwapper, SwapConfig, SwapStats
from vramkit.offload.swap import swapper as swapper_module

D = 32
MIN = 1024  # min_param_bytes for the tests: Linear weights (>= 8 KiB) swap, biases/norms stay

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """Pre-norm residual MLP with optional dropout and a LoRA adapter on fc1; counts calls."""

    def __init__(self, dim: int = D, hidden: int | None = None, dropout: float = 0.0,
                 lora: bool = False) -> None:
        super().__init__()
        hidden = hidden or 2 * dim
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        if lora:
            self.lora_a = nn.Parameter(torch.randn(4, dim) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(hidden, 4) * 0.1)
        else:
            self.lora_a = self.lora_b = None
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        h = self.norm(x)
        z = self.fc1(h)
        if self.lora_a is not None:
            z = z + (h @ self.lora_a.t()) @ self.lora_b.t()
        # fc2 through a transposed view: autograd then saves a view of the slot's memory, not
        # the leaf Parameter, which is what the swapper's saved-tensor hooks must handle.
        out = x + self.drop(F.gelu(z)) @ self.fc2.weight.t() + self.fc2.bias
        return out * scale if scale is not None else out


class Net(nn.Module):
    """inp -> blocks (in ``order``) -> out."""

    def __init__(self, n: int = 4, dim: int = D, dropout: float = 0.0, lora: bool = False,
                 order: list[int] | None = None, hiddens: list[int] | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(
            MLPBlock(dim, hiddens[i] if hiddens else None, dropout, lora) for i in range(n))
        self.out = nn.Linear(dim, dim)
        self.order = list(order) if order is not None else list(range(n))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        x = self.inp(x)
        for i in self.order:
            x = self.blocks[i](x) if scale is None else self.blocks[i](x, scale=scale)
        return self.out(x)


def _net(seed: int = 0, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def _frozen_blocks(model: Net) -> Net:
    """Blocks frozen, inp/out trainable: everything large in the blocks swaps."""
    model.blocks.requires_grad_(False)
    return model


def _lora_only(model: Net) -> Net:
    """Frozen base with trainable LoRA adapters: nothing before block 0 requires grad."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("lora_a", "lora_b")))
    return model


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def _optimizer(model: nn.Module, swapper: BlockSwapper | None = None,
               lr: float = 0.05) -> torch.optim.Optimizer:
    host = host_params(swapper) if swapper is not None else {}
    params = [host.get(id(p), p) for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=lr)


def _swap(model: nn.Module, **config: Any) -> BlockSwapper:
    config.setdefault("min_param_bytes", MIN)
    return BlockSwapper(model, config=SwapConfig(**config), device="cpu")


X = torch.randn(8, D, generator=torch.Generator().manual_seed(42))


# --------------------------------------------------------------------------------------------
# Logging streams and traces
# --------------------------------------------------------------------------------------------


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[StreamOp]:
    """Swappers created in the test get a HostStreams that logs every op into this list."""
    ops: list[StreamOp] = []
    streams = HostStreams(log=ops)
    monkeypatch.setattr(swapper_module, "transfer_streams", lambda device: streams)
    return ops


def _mark(swapper: BlockSwapper, log: list[StreamOp]) -> None:
    """Log acquire/release markers, so ops can be attributed to the block being acquired."""
    ring = swapper._ring
    acquire, release = ring.acquire, ring.release

    def marked_acquire(block: Any, *, backward: bool, stream: Any = None) -> Any:
        log.append(StreamOp("acquire", "compute", None, block.name))
        return acquire(block, backward=backward, stream=stream)

    def marked_release(block: Any, *, backward: bool, stream: Any = None) -> None:
        log.append(StreamOp("release", "compute", None, block.name))
        release(block, backward=backward, stream=stream)

    ring.acquire = marked_acquire  # type: ignore[method-assign]
    ring.release = marked_release  # type: ignore[method-assign]


@dataclass
class Trace:
    acquired: list[str] = field(default_factory=list)  # block per acquisition, in order
    copies: list[str] = field(default_factory=list)  # h2d slot fills, in order
    on_demand: list[str] = field(default_factory=list)  # fills issued inside an acquire


def _contents(swapper: BlockSwapper) -> dict[int, str]:
    """What each slot holds now (the starting point of a trace taken after a log.clear())."""
    return {s.index: s.block.name for s in swapper._ring.slots if s.block is not None}


def _trace(log: list[StreamOp], swapper: BlockSwapper,
           contents: dict[int, str] | None = None) -> Trace:
    """Replay the log against the slot protocol; assert every invariant a GPU relies on.

    ``contents`` is what the slots held when the log starts (empty for a fresh swapper).
    """
    slots = swapper._ring.slots
    free_of = {s.free_event.id: s.index for s in slots}
    loaded_of = {s.loaded_event.id: s.index for s in slots}
    contents = dict(contents or {})
    locked: set[int] = set()
    free_recorded = set(range(len(slots)))  # never used, or released since last use
    acquiring: str | None = None
    trace = Trace()
    for i, op in enumerate(log):
        if op.kind == "acquire":
            assert acquiring is None, "nested acquire"
            acquiring = op.what
        elif op.kind == "copy" and op.stream == "h2d":
            wait, record = log[i - 1], log[i + 1]
            # The copy stream waits for the slot's free event before overwriting it...
            assert (wait.kind, wait.stream) == ("wait", "h2d") and wait.event in free_of, op
            slot = free_of[wait.event]
            assert slot in free_recorded, f"slot {slot} refilled before its free event"
            assert slot not in locked, f"slot {slot} loaded while locked"
            # ...and records the slot's loaded event right after the copy.
            assert (record.kind, record.stream) == ("record", "h2d")
            assert loaded_of.get(record.event) == slot
            contents[slot] = op.what
            trace.copies.append(op.what)
            if acquiring is not None:
                trace.on_demand.append(op.what)
        elif op.kind == "wait" and op.stream == "compute" and op.event in loaded_of:
            slot = loaded_of[op.event]
            # Compute waits on the loaded event of the slot that holds the acquired block.
            assert acquiring is not None and contents.get(slot) == acquiring, (op, contents)
            assert slot not in locked
            locked.add(slot)
            free_recorded.discard(slot)
            trace.acquired.append(acquiring)
            acquiring = None
        elif op.kind == "record" and op.stream == "compute" and op.event in free_of:
            slot = free_of[op.event]
            assert slot in locked
            locked.discard(slot)
            free_recorded.add(slot)
    assert acquiring is None and not locked
    return trace


def _step(model: nn.Module, x: torch.Tensor = X) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _names(*indices: int) -> list[str]:
    return [f"blocks.{i}" for i in indices]


def _train_and_compare(model: Net, swapper: BlockSwapper, ref: Net, steps: int = 3,
                       x: torch.Tensor = X, scale: torch.Tensor | None = None) -> None:
    opt, ref_opt = _optimizer(model, swapper), _optimizer(ref)
    cpu = swapper.config.trainable == "cpu"
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(x, scale).square().mean()
        loss.backward()
        torch.manual_seed(100 + step)
        ref_loss = ref(x, scale).square().mean()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), step
        if cpu:
            swapper.sync_gradients()
        assert_same_grads(grads_of(model, swapper), grads_of(ref))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with torch.no_grad():  # the updated weights are what inference sees
        model.eval()
        ref.eval()
        assert torch.equal(model(x, scale), ref(x, scale))
        model.train()
        ref.train()


# --------------------------------------------------------------------------------------------
# SwapConfig
# --------------------------------------------------------------------------------------------


def test_config_defaults_and_lookahead() -> None:
    config = SwapConfig()
    assert config.max_gpu_blocks is None and config.max_gpu_bytes is None
    # Default lookahead R: when a block releases its slot, the next R blocks should be loaded.
    assert (config.num_slots, config.prefetch, config.lookahead) == (2, None, 2)
    assert config.checkpointing is None and config.trainable == "resident"
    assert config.min_param_bytes == 65536 and config.swap_buffers and config.preserve_rng_state
    assert SwapConfig(num_slots=4).lookahead == 4
    assert SwapConfig(num_slots=4, prefetch=4).lookahead == 4
    assert SwapConfig(num_slots=4, prefetch=0).lookahead == 0
    assert SwapConfig(num_slots=4, prefetch=2).lookahead == 2
    assert SwapConfig(max_gpu_bytes="2KiB").max_gpu_bytes == 2048
    assert SwapConfig(max_gpu_bytes=100).max_gpu_bytes == 100
    with pytest.raises(AttributeError):
        config.num_slots = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", [
    {"max_gpu_blocks": -1}, {"max_gpu_blocks": 1.5}, {"max_gpu_blocks": True},
    {"max_gpu_blocks": "2"},
    {"max_gpu_bytes": "lots"}, {"max_gpu_bytes": [1]},
    {"num_slots": 0}, {"num_slots": True}, {"num_slots": 2.0},
    {"prefetch": -1}, {"prefetch": 3}, {"num_slots": 3, "prefetch": 4}, {"prefetch": True},
    {"prefetch": 0.5},
    {"checkpointing": "yes"}, {"checkpointing": 2},
    {"min_param_bytes": -1}, {"min_param_bytes": True}, {"min_param_bytes": 1.0},
    {"trainable": "gpu"}, {"trainable": None},
    {"swap_buffers": 1}, {"preserve_rng_state": "no"},
])
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        SwapConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    assert "SwapConfig." in info.value.message


def test_swapper_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        BlockSwapper(_net(), config={"num_slots": 2}, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        BlockSwapper("model", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        BlockSwapper(_net(), device="meta")
    with pytest.raises(OffloadError):
        BlockSwapper(_net(), blocks=["nothing.*"], device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_without_cuda_is_a_device_error() -> None:
    with pytest.raises(DeviceError) as info:
        BlockSwapper(_net())
    assert "device='cpu'" in info.value.hint


# --------------------------------------------------------------------------------------------
# create_schedule
# --------------------------------------------------------------------------------------------


def _swapped(schedule: list[BlockScheduleEntry]) -> list[int]:
    return [e.index for e in schedule if e.swapped]


def test_schedule_by_count() -> None:
    specs = [BlockSpec(f"blocks.{i}", 100) for i in range(8)]
    schedule = BlockSwapper.create_schedule(specs, 6)
    assert [e.index for e in schedule] == list(range(8))
    assert [e.name for e in schedule] == [s.name for s in specs]
    assert _swapped(schedule) == [0, 7]  # two swapped: the ends (see spread_evenly)
    assert _swapped(BlockSwapper.create_schedule(specs, 0)) == list(range(8))
    assert _swapped(BlockSwapper.create_schedule(specs, 8)) == []
    assert _swapped(BlockSwapper.create_schedule(specs, 20)) == []


def test_schedule_without_limits_swaps_everything() -> None:
    specs = [(f"b.{i}", 10 * (i + 1)) for i in range(5)]
    schedule = BlockSwapper.create_schedule(specs)
    assert all(e.swapped for e in schedule)
    assert [e.nbytes for e in schedule] == [10, 20, 30, 40, 50]


def test_schedule_by_bytes_is_the_smallest_set_that_fits() -> None:
    sizes = [100] * 10
    # 4 swapped: 6 resident (600) + 2 slots (200) = 800 fits; 3 swapped needs 700 + 200.
    schedule = BlockSwapper.create_schedule([(f"b.{i}", s) for i, s in enumerate(sizes)],
                                            max_gpu_bytes=800)
    assert len(_swapped(schedule)) == 4
    schedule = BlockSwapper.create_schedule([(f"b.{i}", s) for i, s in enumerate(sizes)],
                                            max_gpu_bytes=800, num_slots=3)
    assert len(_swapped(schedule)) == 5  # 500 + 3 * 100
    assert not any(e.swapped for e in BlockSwapper.create_schedule(
        [(f"b.{i}", s) for i, s in enumerate(sizes)], max_gpu_bytes="1000B"))


def test_schedule_with_both_limits_takes_the_stricter() -> None:
    specs = [(f"b.{i}", 100) for i in range(10)]
    by_count = BlockSwapper.create_schedule(specs, 8, max_gpu_bytes=10_000)
    assert len(_swapped(by_count)) == 2
    by_bytes = BlockSwapper.create_schedule(specs, 9, max_gpu_bytes=800)
    assert len(_swapped(by_bytes)) == 4


def test_schedule_orders_plain_names_numerically() -> None:
    names = ["blocks.10", "blocks.2", "blocks.1", "blocks.0"]
    schedule = BlockSwapper.create_schedule(names, 3)
    assert [e.name for e in schedule] == ["blocks.0", "blocks.1", "blocks.2", "blocks.10"]
    assert len(_swapped(schedule)) == 1


def test_schedule_accepts_modules() -> None:
    mods = [nn.Linear(4, 4), nn.Linear(4, 8)]
    schedule = BlockSwapper.create_schedule(mods, 1)
    assert [(e.name, e.nbytes) for e in schedule] == [("0", 80), ("1", 160)]


@pytest.mark.parametrize("blocks", ["blocks", nn.Linear(2, 2), [1, 2], [("a",)]])
def test_schedule_rejects_bad_blocks(blocks: Any) -> None:
    with pytest.raises(ConfigError):
        BlockSwapper.create_schedule(blocks, 1)


def test_schedule_impossible_budget_raises() -> None:
    specs = [("a", 100), ("b", 300)]
    # Resident: 400; one swapped: 100 + 2 * 300; all swapped: 2 * 300.
    with pytest.raises(OffloadError) as info:
        BlockSwapper.create_schedule(specs, max_gpu_bytes=399)
    assert "num_slots" in info.value.hint
    with pytest.raises(OffloadError):
        BlockSwapper.create_schedule(specs, max_gpu_bytes=299, num_slots=1)
    assert _swapped(BlockSwapper.create_schedule(specs, max_gpu_bytes=400)) == []
    assert _swapped(BlockSwapper.create_schedule(specs, 0, max_gpu_bytes=600)) == [0, 1]


def test_schedule_mixed_sizes_counts_the_largest_swapped_block() -> None:
    sizes = [100, 1000, 100, 1000, 100, 100]
    specs = [(f"b.{i}", s) for i, s in enumerate(sizes)]
    seen = set()
    for budget in (2000, 2300, 2400):
        chosen = _swapped(BlockSwapper.create_schedule(specs, max_gpu_bytes=budget))
        resident = sum(s for i, s in enumerate(sizes) if i not in chosen)
        assert resident + 2 * max((sizes[i] for i in chosen), default=0) <= budget
        seen.add(tuple(chosen))
    assert len(seen) == 3  # each budget gives a different swapped set


@given(st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=16),
       st.integers(min_value=0, max_value=200_000), st.integers(min_value=1, max_value=4),
       st.one_of(st.none(), st.integers(min_value=0, max_value=16)))
@settings(max_examples=150, deadline=None)
def test_schedule_property(sizes: list[int], budget: int, slots: int,
                           max_blocks: int | None) -> None:
    specs = [(f"b.{i}", s) for i, s in enumerate(sizes)]
    try:
        schedule = BlockSwapper.create_schedule(specs, max_blocks, max_gpu_bytes=budget,
                                                num_slots=slots)
    except OffloadError:
        assert slots * max(sizes) > budget  # only when even all-swapped does not fit
        return
    chosen = _swapped(schedule)
    assert chosen == spread_evenly(sizes, len(chosen))
    resident = sum(s for i, s in enumerate(sizes) if i not in chosen)
    assert resident + slots * max((sizes[i] for i in chosen), default=0) <= budget
    if max_blocks is not None:
        assert len(sizes) - len(chosen) <= max_blocks
    floor = 0 if max_blocks is None else max(0, len(sizes) - max_blocks)
    if len(chosen) > floor:  # one fewer swapped block would not fit the bytes
        fewer = spread_evenly(sizes, len(chosen) - 1)
        over = sum(s for i, s in enumerate(sizes) if i not in fewer) + slots * max(
            (sizes[i] for i in fewer), default=0)
        assert over > budget


def test_schedule_validates_its_arguments() -> None:
    specs = [("a", 1), ("b", 1)]
    with pytest.raises(ConfigError):
        BlockSwapper.create_schedule(specs, -1)
    with pytest.raises(ConfigError):
        BlockSwapper.create_schedule(specs, None, max_gpu_bytes=10, num_slots=0)


def test_swapper_schedule_and_numeric_block_order() -> None:
    model = _frozen_blocks(_net(n=12, dim=16))
    swapper = _swap(model, max_gpu_blocks=6, min_param_bytes=0)
    assert [e.name for e in swapper.schedule] == _names(*range(12))
    assert swapper.swapped_names == [e.name for e in swapper.schedule if e.swapped]
    assert len(swapper.swapped_names) == 6
    for entry in swapper.schedule:
        if not entry.swapped:  # resident blocks are never repointed
            assert not any(_is_placeholder(p) for p in model.blocks[entry.index].parameters())
    assert "6/12 blocks swapped" in repr(swapper) and "attached" in repr(swapper)
    swapper.detach()
    assert "detached" in repr(swapper)


def test_swapper_byte_budget() -> None:
    model = _frozen_blocks(_net(n=6))
    probe = _swap(model)
    block_bytes = probe.blocks[0].nbytes
    probe.detach()
    # Room for 3 resident blocks plus 2 slots: 3 swapped.
    budget = 5 * block_bytes + 6 * 1000  # slack for small resident tensors of swapped blocks
    swapper = _swap(model, max_gpu_bytes=budget)
    assert len(swapper.swapped_names) == 3
    swapper.detach()


# --------------------------------------------------------------------------------------------
# Event and slot ordering
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True])
def test_slot_protocol_and_copy_counts(log: list[StreamOp], checkpointing: bool) -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model, checkpointing=checkpointing)
    assert len(swapper._ring.slots) == 2 and swapper.swapped_names == _names(0, 1, 2, 3)
    _mark(swapper, log)
    expected_acquired = _names(0, 1, 2, 3, 3, 2, 1, 0)

    _step(model)
    first = _trace(log, swapper)
    assert first.acquired == expected_acquired
    # Forward loads S=4 blocks, backward S-R=2 (the last two stay across the turn).
    assert first.copies == _names(0, 1, 2, 3, 1, 0)
    assert first.on_demand == _names(0)  # only the very first acquire waits for a load
    stats = swapper.stats()
    assert (stats.loads, stats.on_demand, stats.prefetched) == (6, 1, 5)
    assert (stats.acquisitions, stats.hits) == (8, 7)

    for _ in range(2):
        log.clear()
        swapper.reset_stats()
        before = _contents(swapper)
        assert sorted(before.values()) == _names(0, 1)  # prefetched for the next forward
        _step(model)
        steady = _trace(log, swapper, before)
        assert steady.acquired == expected_acquired
        # Blocks 0 and 1 were prefetched by the previous backward: hits.
        assert steady.copies == _names(2, 3, 1, 0)
        assert steady.on_demand == []
        stats = swapper.stats()
        assert (stats.loads, stats.on_demand, stats.hits) == (4, 0, 8)
        assert stats.h2d_bytes == 4 * swapper.blocks[0].nbytes

    # Block j is issued ahead: when block j - lookahead releases its slot, before j's acquire.
    ahead = swapper.config.lookahead
    kinds = [(op.kind, op.what) for op in log]
    for j in (2, 3):
        released = kinds.index(("release", f"blocks.{j - ahead}"))
        issued = kinds.index(("copy", f"blocks.{j}"))
        needed = kinds.index(("acquire", f"blocks.{j}"))
        assert released < issued < needed
    swapper.detach()


def test_order_is_learnt_from_the_forward(log: list[StreamOp]) -> None:
    order = [2, 0, 3, 1]
    model = _frozen_blocks(_net(order=order))
    swapper = _swap(model)
    _mark(swapper, log)
    _step(model)
    first = _trace(log, swapper)
    seq = _names(*order)
    assert first.acquired == seq + seq[::-1]
    assert swapper.stats().on_demand > 1  # registration order mispredicts the first pass
    for step in range(3):
        log.clear()
        swapper.reset_stats()
        before = _contents(swapper)
        _step(model)
        trace = _trace(log, swapper, before)
        assert trace.acquired == seq + seq[::-1]
        assert len(trace.on_demand) <= (1 if step == 0 else 0), step
        if step:  # steady state: prefetch follows the observed order
            assert trace.copies == [seq[2], seq[3], seq[1], seq[0]]
    swapper.detach()


def test_first_backward_already_follows_the_observed_order() -> None:
    model = _frozen_blocks(_net(order=[2, 0, 3, 1]))
    swapper = _swap(model)
    assert swapper.stats().order_pattern == Sequential()  # container order until observed
    _step(model)
    swapper.reset_stats()
    _step(model)
    assert swapper.stats().on_demand == 0
    assert swapper.stats().order_pattern == Random()  # the learnt order, analysed
    assert swapper.stats().as_dict()["order_pattern"] == "random"
    swapper.detach()
    reverse = _frozen_blocks(_net(order=[3, 2, 1, 0]))
    swapper = _swap(reverse)
    _step(reverse)
    assert swapper.stats().order_pattern == Strided(-1)
    swapper.detach()


def test_prefetch_zero_loads_every_miss_on_demand(log: list[StreamOp]) -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model, prefetch=0)
    _mark(swapper, log)
    for _ in range(2):
        _step(model)
    trace = _trace(log, swapper)
    assert trace.copies == trace.on_demand  # nothing issued ahead
    stats = swapper.stats()
    assert stats.prefetched == 0
    assert stats.loads == stats.on_demand == stats.acquisitions - stats.hits > 0
    swapper.detach()


@pytest.mark.parametrize(("prefetch", "ahead"), [(1, _names(1)), (2, _names(1, 2))])
def test_lookahead_controls_blocks_issued_ahead(log: list[StreamOp], prefetch: int,
                                                ahead: list[str]) -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model, num_slots=3, prefetch=prefetch)
    _mark(swapper, log)
    _step(model)
    _trace(log, swapper)
    kinds = [(op.kind, op.what) for op in log]
    start = kinds.index(("release", "blocks.0"))
    end = kinds.index(("acquire", "blocks.1"))
    assert [w for k, w in kinds[start:end] if k == "copy"] == ahead
    swapper.detach()


def test_more_slots_keep_more_blocks_across_steps(log: list[StreamOp]) -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model, num_slots=3, prefetch=2)
    assert len(swapper._ring.slots) == 3
    _mark(swapper, log)
    _step(model)
    log.clear()
    swapper.reset_stats()
    before = _contents(swapper)
    _step(model)
    trace = _trace(log, swapper, before)
    assert trace.on_demand == []
    assert swapper.stats().loads == 2  # 2 * (S - R) with S=4, R=3
    swapper.detach()


def test_trainable_cpu_offloads_gradients_after_the_block(log: list[StreamOp]) -> None:
    model = _net()
    swapper = _swap(model, trainable="cpu")
    _mark(swapper, log)
    _step(model)
    d2h = [op for op in log if op.kind == "copy" and op.stream == "d2h"]
    per_block = len(swapper.blocks[0].trainable_entries)
    assert [op.what for op in d2h] == [n for n in _names(3, 2, 1, 0) for _ in range(per_block)]
    for i, op in enumerate(log):
        if op.kind == "copy" and op.stream == "d2h":
            # The d2h stream waited for an event recorded on compute after the block's backward.
            waits = [o for o in log[:i] if o.kind == "wait" and o.stream == "d2h"]
            assert waits and any(o.kind == "record" and o.stream == "compute"
                                 and o.event == waits[-1].event for o in log[:i])
    stats = swapper.stats()
    assert stats.d2h_bytes == sum(e.nbytes for b in swapper.blocks for e in b.trainable_entries)
    # The device gradient is dropped once it is on its way to the host.
    assert all(e.tensor.grad is None for b in swapper.blocks for e in b.trainable_entries)
    swapper.detach()


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------


def test_inference_matches_and_wraps_around() -> None:
    ref = _frozen_blocks(_net()).eval()
    ref.requires_grad_(False)
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    with torch.no_grad():
        want = ref(X)
        assert torch.equal(model(X), want)
    first = swapper.stats()
    assert first.on_demand == 1
    assert first.loads > 4  # the last block's release loads the next call's first blocks
    swapper.reset_stats()
    assert torch.equal(swapper.forward_with_swapping(X), want)
    again = swapper.stats()
    assert again.on_demand == 0 and again.hits == again.acquisitions == 4
    # A custom forward_fn; grad mode is off inside.
    out = swapper.forward_with_swapping(X, lambda v: model(v) if not torch.is_grad_enabled()
                                        else None)
    assert torch.equal(out, want) and not out.requires_grad
    # Frozen model with grad enabled: no graph needed, same result.
    assert torch.equal(model(X), want)
    assert swapper.stats().on_demand == 0
    swapper.detach()


def test_inference_between_training_steps() -> None:
    ref = _lora_only(_net(lora=True))
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    for _ in range(2):
        _step(model)
        _step(ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(swapper.forward_with_swapping(X), ref(X))
    _step(model)
    _step(ref)
    assert_same_grads(grads_of(model), grads_of(ref))
    swapper.detach()


# --------------------------------------------------------------------------------------------
# detach / restore
# --------------------------------------------------------------------------------------------


def test_detach_restores_the_model() -> None:
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    ids = [id(p) for p in model.parameters()] + [id(b) for b in model.buffers()]
    calls: list[str] = []
    handles = [model.blocks[1].register_forward_pre_hook(lambda m, a: calls.append("pre")),
               model.blocks[1].register_forward_hook(lambda m, a, o: o * 2)]
    handles.append(ref.blocks[1].register_forward_hook(lambda m, a, o: o * 2))
    swapper = _swap(model)
    assert all("forward" in b.__dict__ for b in model.blocks)
    swapped_forward = model.blocks[0].forward
    assert torch.equal(_step(model), _step(ref))  # the user's hooks run under swapping
    assert_same_grads(grads_of(model), grads_of(ref))
    assert calls == ["pre"]
    swapper.detach()
    assert [id(p) for p in model.parameters()] + [id(b) for b in model.buffers()] == ids
    for b in model.blocks:
        assert "forward" not in b.__dict__
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.device == q.device and torch.equal(p, q) and not _is_placeholder(p)
        assert p.is_contiguous()
    assert torch.equal(model(X), ref(X))  # a normal module again; hooks still registered
    assert calls == ["pre", "pre"]
    assert torch.equal(model.blocks[2](X), ref.blocks[2](X))
    with pytest.raises(OffloadError):
        swapped_forward(X)  # a kept reference to the swapper's forward refuses to run
    with pytest.raises(OffloadError):
        swapper.detach()
    for h in handles:
        h.remove()
    again = _swap(model)  # the model can be swapped again
    assert torch.equal(model(X), ref(X))
    again.detach()


def test_a_cast_or_a_move_of_the_swapped_model_is_refused_until_detach() -> None:
    # Only the placeholders would follow: the forward then failed in a matmul of two dtypes.
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    for convert in (model.half, lambda: model.to(torch.float64), lambda: model.to("meta"),
                    model.blocks[1].bfloat16):
        with pytest.raises(OffloadError, match="nothing was converted"):
            convert()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.float().cpu()(X), ref(X))  # no change: allowed
    swapper.detach()
    assert all("_apply" not in m.__dict__ for m in model.modules())
    assert {p.dtype for p in model.half().parameters()} == {torch.float16}


def test_detach_restores_a_preexisting_instance_forward() -> None:
    ref = _frozen_blocks(_net())
    block = ref.blocks[2]
    block.forward = types.MethodType(lambda self, x: MLPBlock.forward(self, x) * 0.5, block)
    model = copy.deepcopy(ref)  # the copy's instance forward is bound to the copied block
    own = model.blocks[2].__dict__["forward"]
    swapper = _swap(model)
    assert model.blocks[2].__dict__["forward"] is not own
    assert torch.equal(_step(model), _step(ref))  # the instance forward is what runs
    swapper.detach()
    assert model.blocks[2].__dict__["forward"] is own
    assert torch.equal(model(X), ref(X))


def test_context_manager_detaches() -> None:
    model = _frozen_blocks(_net())
    with _swap(model) as swapper:
        _step(model)
        assert isinstance(swapper, BlockSwapper)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    with pytest.raises(OffloadError):
        swapper.detach()
    with _swap(model) as inner:
        inner.detach()  # detaching inside the block is fine; exit does not raise
    with pytest.raises(RuntimeError), _swap(model):
        raise RuntimeError("boom")
    assert all("forward" not in b.__dict__ for b in model.blocks)


# --------------------------------------------------------------------------------------------
# What swaps: sizes, buffers, tied weights, statistics
# --------------------------------------------------------------------------------------------


def test_min_param_bytes_keeps_small_tensors_resident() -> None:
    model = _frozen_blocks(_net())
    swapper = _swap(model)
    _step(model)
    assert {e.attr for b in swapper.blocks for e in b.entries} == {"weight"}
    evicted = 0
    for block in model.blocks:
        for name, p in block.named_parameters():
            small = p.numel() * p.element_size() < MIN
            if small:
                assert not _is_placeholder(p), name
            evicted += _is_placeholder(p)
    assert evicted == 4  # blocks 2 and 3 are out of the slots: their two weights each
    swapper.detach()
    everything = _swap(model, min_param_bytes=0)
    assert {e.attr for b in everything.blocks for e in b.entries} == {"weight", "bias"}
    everything.detach()


class BufferBlock(MLPBlock):
    def __init__(self, dim: int = D) -> None:
        super().__init__(dim)
        self.register_buffer("proj", torch.randn(dim, dim))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x) @ self.proj * 0.2


@pytest.mark.parametrize("swap_buffers", [True, False])
def test_swap_buffers(swap_buffers: bool) -> None:
    torch.manual_seed(0)
    ref = Net()
    ref.blocks = nn.ModuleList(BufferBlock() for _ in range(4))
    _frozen_blocks(ref)
    model = copy.deepcopy(ref)
    swapper = _swap(model, swap_buffers=swap_buffers)
    assert any(not e.is_param for b in swapper.blocks for e in b.entries) == swap_buffers
    _train_and_compare(model, swapper, ref, steps=2)
    assert any(_is_placeholder(b.proj) for b in model.blocks) == swap_buffers
    swapper.detach()
    assert all(torch.equal(b.proj, r.proj) for b, r in zip(model.blocks, ref.blocks, strict=True))


def test_tied_weights_across_blocks_stay_resident() -> None:
    ref = _frozen_blocks(_net())
    ref.blocks[3].fc1.weight = ref.blocks[0].fc1.weight
    model = copy.deepcopy(ref)
    tied = model.blocks[0].fc1.weight
    assert tied is model.blocks[3].fc1.weight
    swapper = _swap(model)
    assert all(e.tensor is not tied for b in swapper.blocks for e in b.entries)
    _train_and_compare(model, swapper, ref)
    assert not _is_placeholder(tied) and tied is model.blocks[3].fc1.weight
    swapper.detach()
    assert model.blocks[0].fc1.weight is model.blocks[3].fc1.weight


def test_submodule_shared_by_two_blocks() -> None:
    ref = _frozen_blocks(_net())
    ref.blocks[2].fc1 = ref.blocks[0].fc1
    model = copy.deepcopy(ref)
    swapper = _swap(model)
    try:
        assert torch.equal(model(X), ref(X))
    finally:
        swapper.detach()
    assert torch.equal(model.blocks[0].fc1.weight, ref.blocks[0].fc1.weight)


def test_host_update_through_data_is_seen() -> None:
    ref = _net()
    model = copy.deepcopy(ref)
    swapper = _swap(model, trainable="cpu")
    _step(model)
    _step(ref)
    swapper.sync_gradients()
    host = host_params(swapper)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            h = host.get(id(p), p)
            h.data.add_(h.grad, alpha=-0.1)
            q.data.add_(q.grad, alpha=-0.1)
    try:
        assert torch.equal(model(X), ref(X))
    finally:
        swapper.detach()


def test_stats_sizes() -> None:
    dim = 36  # 36x72 float weights: 10368 bytes, not a multiple of the 512-byte alignment
    hiddens = [2 * dim, 4 * dim, 2 * dim, 4 * dim]
    model = _frozen_blocks(_net(dim=dim, hiddens=hiddens))
    swapper = _swap(model, num_slots=3, max_gpu_blocks=1)
    stats = swapper.stats()
    assert isinstance(stats, SwapStats)
    swapped = [model.blocks[int(n.split(".")[1])] for n in swapper.swapped_names]
    assert stats.blocks == 4 and stats.swapped_blocks == len(swapped) == 3
    expected = sum(p.numel() * p.element_size() for b in swapped for p in b.parameters()
                   if p.numel() * p.element_size() >= MIN)
    assert stats.swapped_bytes == expected
    assert expected < stats.pinned_bytes <= 1.05 * expected  # alignment, nothing more
    largest = max(b.nbytes for b in swapper.blocks)
    assert largest == 2 * -(-dim * 4 * dim * 4 // 512) * 512
    assert stats.slot_bytes == 3 * largest
    resident = [b for i, b in enumerate(model.blocks) if b not in swapped]
    small = sum(p.numel() * p.element_size() for b in swapped for p in b.parameters()
                if p.numel() * p.element_size() < MIN)
    assert stats.resident_block_bytes == sum(
        p.numel() * p.element_size() for b in resident for p in b.parameters()) + small
    assert stats.loads == stats.hits == stats.acquisitions == stats.h2d_bytes == 0
    model(torch.randn(2, dim)).sum().backward()
    stats = swapper.stats()
    # Three slots for three swapped blocks: each is loaded once and stays for backward.
    assert (stats.loads, stats.on_demand, stats.acquisitions, stats.hits) == (3, 1, 6, 5)
    assert stats.h2d_bytes == sum(b.nbytes for b in swapper.blocks)
    assert stats.d2h_bytes == 0 and stats.enqueue_seconds > 0
    assert stats.as_dict()["loads"] == stats.loads
    swapper.reset_stats()
    after = swapper.stats()
    assert after.loads == after.h2d_bytes == 0 and after.swapped_bytes == stats.swapped_bytes
    swapper.detach()



# -- review findings: each test fails on the code before its fix ---------------------------------


def test_adapters_added_after_attaching_get_correct_gradients() -> None:
    ref = _frozen_blocks(_net())
    ref.inp.requires_grad_(False)  # block 0's input needs no gradient: only its weights do
    model = copy.deepcopy(ref)
    swapper = _swap(model, prefetch=0)
    for m in (model, ref):  # unfreeze after attaching: the swapper must notice per call
        m.blocks[0].requires_grad_(True)
    _step(model)
    _step(ref)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p_ref.grad is not None:
            assert p.grad is not None and torch.equal(p.grad, p_ref.grad), name
    swapper.detach()


def test_host_gradients_follow_pytorch_accumulation_semantics() -> None:
    ref = _net()
    model = copy.deepcopy(ref)
    swapper = _swap(model, trainable="cpu")
    hosts = {id(e.tensor): e.host_param for b in swapper.blocks for e in b.trainable_entries}
    for _ in range(2):  # backward, sync, backward: the second adds to the first
        _step(model)
        swapper.sync_gradients()
        _step(ref)
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        hp = hosts.get(id(p))
        grad = hp.grad if hp is not None else p.grad
        assert torch.equal(grad, p_ref.grad)
    for hp in hosts.values():  # zero_grad(set_to_none): a block without a gradient keeps None
        hp.grad = None
    swapper.detach()


def test_checkpointed_calls_without_backward_are_freed() -> None:
    import gc

    from vramkit.offload.swap.function import BlockCall

    model = _net()
    swapper = _swap(model, checkpointing=True)
    for _ in range(3):
        model(torch.randn(4, 32)).sum()  # graph dropped, backward never runs
    gc.collect()
    assert sum(type(o) is BlockCall for o in gc.get_objects()) == 0
    swapper.detach()


def test_expanded_buffers_stay_resident_and_detach_restores_them() -> None:
    model = _net()
    model.blocks[0].register_buffer("table", torch.ones(1, 64).expand(4096, 64))
    swapper = _swap(model, min_param_bytes=0)
    swapped = {id(e.tensor) for b in swapper.blocks for e in b.entries}
    assert id(model.blocks[0].table) not in swapped
    swapper.detach()
    assert model.blocks[0].table.stride() == (0, 1)


@pytest.mark.parametrize("overlap", [False, True])
def test_full_finetune_bf16_with_cpu_offload_optimizer(overlap: bool) -> None:
    """trainable="cpu" with 16-bit weights: the swapper assigns host gradients (no autograd
    accumulation, so no post-accumulate hook fires); CPUOffloadOptimizer must still step them."""
    from vramkit.offload.optimizer import CPUOffloadOptimizer

    ref = _net().to(torch.bfloat16)
    model = copy.deepcopy(ref)
    swapper = _swap(model, trainable="cpu")
    assert swapper.host_parameters()
    params = swapper.optimizer_parameters()
    host = swapper.host_parameters()
    assert len(params) == len(list(ref.parameters())) and params[-len(host):] == host
    opt = CPUOffloadOptimizer(params, torch.optim.AdamW, overlap=overlap, lr=1e-2)
    ref_opt = CPUOffloadOptimizer(ref.parameters(), torch.optim.AdamW, overlap=overlap, lr=1e-2)
    x = X.to(torch.bfloat16)
    for _ in range(3):
        model(x).float().square().mean().backward()
        swapper.sync_gradients()
        opt.step()
        opt.zero_grad()
        ref(x).float().square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert opt.stats().grads_transferred == ref_opt.stats().grads_transferred > 0
    swapper.detach()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    opt.close()
    ref_opt.close()


# -- a schedule chosen elsewhere (SwapConfig.swapped_blocks) ----------------------------------


def test_swapped_blocks_swaps_exactly_the_named_blocks() -> None:
    ref = _frozen_blocks(_net())
    model = copy.deepcopy(ref)
    names = ["blocks.1", "blocks.3"]
    swapper = _swap(model, swapped_blocks=names)
    assert swapper.swapped_names == names
    assert [e.swapped for e in swapper.schedule] == [False, True, False, True]
    assert torch.equal(_step(model), _step(ref))
    assert_same_grads(grads_of(model), grads_of(ref))
    swapper.detach()


def test_swapped_blocks_is_checked() -> None:
    with pytest.raises(ConfigError, match="list of block names"):
        SwapConfig(swapped_blocks="blocks.1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="would choose them again"):
        SwapConfig(swapped_blocks=["blocks.1"], max_gpu_blocks=2)
    assert SwapConfig(swapped_blocks=["blocks.1"]).swapped_blocks == ("blocks.1",)
    with pytest.raises(ConfigError, match="does not have"):
        _swap(_frozen_blocks(_net()), swapped_blocks=["blocks.9"])


# -- ordinary models: the model itself is the stack; nothing to swap --------------------------


def test_schedule_accepts_the_container_of_blocks() -> None:
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 8)])
    schedule = BlockSwapper.create_schedule(blocks, 1)
    assert [(e.name, e.nbytes) for e in schedule] == [("0", 80), ("1", 160), ("2", 288)]
    assert sum(e.swapped for e in schedule) == 2
    assert [e.name for e in BlockSwapper.create_schedule(nn.Sequential(*blocks), 3)] == [
        "0", "1", "2"]


def test_a_bare_sequential_of_blocks_swaps_and_checkpoints() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(*(MLPBlock(D) for _ in range(4)))
    ref.requires_grad_(False)
    x = X.clone().requires_grad_(True)
    model = copy.deepcopy(ref)
    assert enable_gradient_checkpointing(model) == ["0", "1", "2", "3"]
    swapper = _swap(model, max_gpu_blocks=1)
    assert len(swapper.swapped_names) == 3
    expected = ref(x).square().sum()
    (x_grad,) = torch.autograd.grad(expected, x)
    got = model(x).square().sum()
    (got_grad,) = torch.autograd.grad(got, x)
    assert torch.equal(got, expected) and torch.equal(got_grad, x_grad)
    swapper.detach()


@pytest.mark.parametrize(("config", "words"), [
    ({"min_param_bytes": 1 << 20}, "below min_param_bytes"),
    ({"max_gpu_bytes": "1GiB"}, "holds every block"),
    ({"swapped_blocks": []}, "swapped_blocks is empty"),
])
def test_a_swapper_that_swaps_nothing_says_why(config: dict[str, Any], words: str) -> None:
    model = _frozen_blocks(_net())
    with pytest.warns(VramkitWarning, match=words):
        swapper = _swap(model, **config)
    assert swapper.swapped_names == []
    swapper.detach()


def test_trainable_blocks_kept_resident_are_named_as_the_reason() -> None:
    model = _net()  # every block trainable: trainable="resident" keeps them on the device
    with pytest.warns(VramkitWarning, match="trainable='resident'"):
        swapper = _swap(model)
    swapper.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", VramkitWarning)
        _swap(_frozen_blocks(_net())).detach()  # swaps: no warning


def test_a_second_swapper_on_a_swapped_model_is_refused() -> None:
    # It found every block's tensors already in the first swapper's masters: it swapped
    # nothing and warned about shared tensors, with both attached.
    model = _frozen_blocks(_net())
    first = BlockSwapper(model, config=SwapConfig(num_slots=1, min_param_bytes=0),
                         device="cpu")
    assert first.swapped_names
    with pytest.raises(OffloadError, match=r"blocks\.0 .*swapped by another BlockSwapper") as err:
        BlockSwapper(model, config=SwapConfig(num_slots=1, min_param_bytes=0), device="cpu")
    assert "detach" in (err.value.hint or "")
    first.detach()
    BlockSwapper(model, config=SwapConfig(num_slots=1, min_param_bytes=0), device="cpu").detach()


def test_a_swapper_on_weights_a_cpu_offload_manager_holds_is_refused() -> None:
    from vramkit.offload.cpu import CPUOffloadManager

    model = _frozen_blocks(_net())
    manager = CPUOffloadManager("cpu")
    manager.offload_weights(model)
    with pytest.raises(OffloadError, match="CPUOffloadManager"):
        BlockSwapper(model, config=SwapConfig(num_slots=1, min_param_bytes=0), device="cpu")
    manager.restore()
