"""GPU tests of vramkit.observe.recovery with REAL out-of-memory errors under a memory cap.

The cap is ``torch.cuda.set_per_process_memory_fraction``, sized from a measured half-batch run
so the full batch fails and the half batch fits; it is restored to 1.0 afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from vramkit.observe.recovery import MemoryRecovery, OomEvent, find_executable_batch_size

pytestmark = pytest.mark.gpu

WIDTH = 4096
ROWS = 32768  # 512 MiB of fp32 input; activations of the full batch ~2.5 GiB
_CAP: dict[str, float] = {}  # the memory fraction the fixture set


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, 1)).cuda()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"x": torch.randn(ROWS, WIDTH, device="cuda", generator=g),
            "y": torch.randn(ROWS, 1, device="cuda", generator=g)}


def _loss(model: nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(micro["x"]), micro["y"])


def _reference_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture
def capped() -> Iterator[tuple[nn.Module, dict[str, torch.Tensor]]]:
    """A model and batch, with a cap the half batch fits under and the full batch does not."""
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # exact-ish fp32 for the gradient comparison
    model = _model()
    batch = _batch(0)
    half = {k: v[: ROWS // 2] for k, v in batch.items()}
    # Warm up forward and backward (cuBLAS workspaces of both threads) before measuring.
    _loss(model, half).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    _loss(model, half).backward()
    torch.cuda.synchronize()
    half_extra = torch.cuda.max_memory_reserved() - base
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    # The half batch needs half_extra; the full one about 2x its activations (+ the same weight
    # gradients): 1.5x leaves room on both sides.
    _CAP["fraction"] = (base + 1.5 * half_extra) / total
    torch.cuda.set_per_process_memory_fraction(_CAP["fraction"])
    # Garbage from earlier code would be collected by the recovery's gc.collect() and make
    # "after" smaller than "before" for reasons unrelated to the failed attempt.
    gc.collect()
    try:
        yield model, batch
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
        del model, batch, half
        torch.cuda.empty_cache()


def test_real_oom_recovers_memory_and_effective_batch(
        capped: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    model, batch = capped
    seen: list[tuple[OomEvent, int]] = []
    recovery = MemoryRecovery(model, attempts=3,
                              on_oom=lambda e: seen.append((e, torch.cuda.memory_allocated())))
    result = recovery.step(lambda micro: _loss(model, micro), batch)
    assert result.events, "the full batch was expected to run out of memory under the cap"
    first = result.events[0]
    assert first.micro_batch_size == ROWS
    assert first.allocated_before is not None and first.allocated_after is not None
    # The failed attempt's memory is gone: back within 1% of where it started.
    assert abs(first.allocated_after - first.allocated_before) <= 0.01 * first.allocated_before
    assert abs(seen[0][1] - first.allocated_before) <= 0.01 * first.allocated_before
    # The driver has plenty free; the cap is what ran out (never "outside PyTorch").
    assert first.diagnosis.kind in ("capacity", "fragmentation")
    assert first.diagnosis.limit is not None
    assert result.micro_batch_size * result.accumulation_steps == ROWS
    # Results and references go to the host: under the cap every GPU byte counts.
    grads = [p.grad.cpu() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.cuda.set_per_process_memory_fraction(1.0)  # the reference needs the full batch at once
    reference = [g.cpu() for g in _reference_grads(model, batch)]
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(_CAP["fraction"])
    for got, want in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    # Training continues at the settled size, same effective batch, no new OOM: a new batch
    # in the same memory (a second 512 MiB batch would not fit the cap next to the first).
    with torch.no_grad():
        batch["x"].mul_(-0.5).add_(0.25)
        batch["y"].mul_(2.0)
    again = recovery.step(lambda micro: _loss(model, micro), batch)
    assert again.attempts == 1 and again.micro_batch_size == result.micro_batch_size
    grads2 = [p.grad.cpu() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.cuda.set_per_process_memory_fraction(1.0)
    for got, want in zip(grads2, _reference_grads(model, batch), strict=True):
        torch.testing.assert_close(got, want.cpu(), rtol=1e-4, atol=1e-6)


def test_real_oom_batch_size_search(capped: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    model, batch = capped

    @find_executable_batch_size(starting_batch_size=ROWS, headroom=0.0)
    def step(batch_size: int) -> int:
        _loss(model, {k: v[:batch_size] for k, v in batch.items()}).backward()
        model.zero_grad(set_to_none=True)
        return batch_size

    before = torch.cuda.memory_allocated()
    assert step() == ROWS // 2
    assert step.probes[0] == (ROWS, False)
    assert abs(torch.cuda.memory_allocated() - before) <= 0.01 * before
