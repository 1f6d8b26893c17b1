"""``BlockSwapper(block_loader=...)`` in one process: every slot fill goes through the loader
(into a slot of the loader's padded size), and ``local_calls()`` loads with plain copies and
puts the ring back as it was (the collective loader's contract, checked without a group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramkit.errors import ConfigError
from vramkit.memory.transfer import Streams
from vramkit.offload.swap import BlockSwapper, SwapConfig

CONFIG = SwapConfig(min_param_bytes=0, num_slots=2)
PAD = 1000


class Net(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(n))
        self.blocks.requires_grad_(False)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


class RecordingLoader:
    """A BlockLoader that copies the whole block itself and records what it was asked."""

    def __init__(self) -> None:
        self.prepared: tuple[list[str], list[int]] | None = None
        self.loads: list[tuple[int, int]] = []  # (dest bytes, source bytes)

    def prepare(self, names: list[str], sizes: list[int]) -> None:
        self.prepared = (names, sizes)

    def padded_bytes(self, nbytes: int) -> int:
        return nbytes + PAD

    def load(self, dest: torch.Tensor, source: torch.Tensor, streams: Streams,
             what: str) -> int:
        self.loads.append((dest.numel(), source.numel()))
        dest[source.numel():].fill_(7)  # padding is the loader's: the block must not see it
        streams.copy(dest[:source.numel()], source, streams.h2d, what)
        return source.numel() // 2  # "half came from the host"


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))


def _ring_state(swapper: BlockSwapper) -> list[tuple[str | None, int, int]]:
    """Each slot's block, version and last use (what the next loads are decided by)."""
    ring = swapper._ring
    assert ring is not None
    return [(s.block.name if s.block is not None else None, s.loaded_version, s.last_used)
            for s in ring.slots] + [("clock", ring._clock, 0)]


def test_every_fill_goes_through_the_loader_into_a_padded_slot() -> None:
    reference = Net()
    expected = reference(_x())
    model = Net()
    loader = RecordingLoader()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu", block_loader=loader)
    assert swapper.block_loader is loader
    assert loader.prepared == ([b.name for b in swapper.blocks],
                               [b.nbytes for b in swapper.blocks])
    largest = max(b.nbytes for b in swapper.blocks)
    stats = swapper.stats()
    assert stats.slot_bytes == 2 * (-(-(largest + PAD) // 512) * 512)  # slots are 512-aligned
    out = model(_x())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    stats = swapper.stats()
    assert stats.loads == len(loader.loads) > 0
    assert all(d == s + PAD for d, s in loader.loads)
    # the loader said half of each block came from the host, the rest from elsewhere
    assert stats.h2d_bytes == sum(s // 2 for _, s in loader.loads)
    assert stats.gathered_bytes == sum(s - s // 2 for _, s in loader.loads)
    swapper.detach()


def test_local_calls_copy_plainly_and_put_the_ring_back() -> None:
    model = Net()
    loader = RecordingLoader()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu", block_loader=loader)
    model(_x())
    model(_x(2))
    before = _ring_state(swapper)
    ring = swapper._ring
    assert ring is not None
    order = list(ring.order)
    through_loader = len(loader.loads)
    loads = swapper.stats().loads
    with swapper.local_calls(), torch.no_grad():
        local = model(_x(3))
        model(_x(4))
    assert len(loader.loads) == through_loader  # nothing collective inside
    assert swapper.stats().loads > loads
    assert _ring_state(swapper) == before  # the same blocks in the same slots
    assert ring.order == order
    # ... and the model computes what it did: the next calls match a fresh model's
    torch.testing.assert_close(local, Net()(_x(3)), rtol=0, atol=0)
    torch.testing.assert_close(model(_x(5)), Net()(_x(5)), rtol=0, atol=0)
    assert len(loader.loads) > through_loader  # back to the loader after the section
    swapper.detach()


def test_local_calls_do_nothing_without_a_loader() -> None:
    model = Net()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu")
    with swapper.local_calls():
        out = model(_x())
    torch.testing.assert_close(out, Net()(_x()), rtol=0, atol=0)
    swapper.detach()


def test_a_loader_with_the_disk_tier_is_refused(tmp_path: object) -> None:
    config = SwapConfig(min_param_bytes=0, host_budget="1MiB")
    with pytest.raises(ConfigError, match="host_budget") as info:
        BlockSwapper(Net(), "blocks.*", config, device="cpu", block_loader=RecordingLoader())
    assert "uploads='whole'" in (info.value.hint or "")


def test_no_grad_calls_copy_plainly_until_the_next_call_with_gradients() -> None:
    """A collective loader's contract for calls one rank may make alone under no_grad (a
    preview): plain copies, then the ring as it was once gradients are back -- at the next
    training call, or at backward when the preview came between forward and backward."""
    model = Net()
    loader = RecordingLoader()
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu", block_loader=loader)
    ring = swapper._ring
    assert ring is not None

    def x_grad(seed: int) -> torch.Tensor:  # input gradients: backward runs through the blocks
        return _x(seed).requires_grad_(True)

    model(x_grad(1)).sum().backward()
    model(x_grad(2)).sum().backward()
    through = len(loader.loads)
    with torch.no_grad():
        model(_x(3))
        model(_x(4))
    assert len(loader.loads) == through  # nothing collective under no_grad
    assert ring._no_grad_saved is not None
    x5 = x_grad(5)
    loss = model(x5).sum()  # gradients again: the ring was put back first
    assert ring._no_grad_saved is None and len(loader.loads) > through
    with torch.no_grad():  # between forward and backward
        model(_x(6))
    assert ring._no_grad_saved is not None
    mid = len(loader.loads)
    loss.backward()  # the ring is put back before backward's collective loads
    assert ring._no_grad_saved is None and len(loader.loads) > mid
    reference = Net()
    r5 = x_grad(5)
    reference(x_grad(1)).sum().backward()
    reference(x_grad(2)).sum().backward()
    reference(r5).sum().backward()
    torch.testing.assert_close(x5.grad, r5.grad, rtol=0, atol=0)
    torch.testing.assert_close(model.out.weight.grad, reference.out.weight.grad, rtol=0, atol=0)
    swapper.detach()


def test_the_ring_is_put_back_after_no_grad_calls() -> None:
    model = Net()
    model.out.requires_grad_(True)
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device="cpu", block_loader=RecordingLoader())
    model(_x()).sum().backward()
    model(_x(2)).sum()  # a forward: the ring holds its last blocks
    before = _ring_state(swapper)
    with torch.no_grad():
        model(_x(3))
    ring = swapper._ring
    assert ring is not None
    ring.end_no_grad()  # what the next call with gradients does first
    assert _ring_state(swapper) == before
    swapper.detach()
