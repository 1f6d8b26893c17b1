"""CPU tests of vramkit.observe.recovery: recovery from OOM and the batch-size search.

OOMs are simulated by raising real exception instances (torch.OutOfMemoryError etc.) from the
step function. Detection and classification are tested in test_oom.py.
"""

from __future__ import annotations

import collections
import weakref

import pytest
import torch
from torch import nn

from vramkit.errors import ConfigError, RecoveryError
from vramkit.observe.recovery import (
    MemoryRecovery,
    batch_size_of,
    find_executable_batch_size,
    split_batch,
    train_with_memory_recovery,
)

# -- batch splitting --------------------------------------------------------------------------


def test_split_batch_nested() -> None:
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"x": torch.arange(10).reshape(5, 2), "pair": Pair(torch.arange(5), torch.ones(5)),
             "list": [torch.zeros(5, 3)], "scale": torch.tensor(2.0), "name": "run"}
    assert batch_size_of(batch) == 5
    parts = split_batch(batch, 2)
    assert [batch_size_of(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert isinstance(parts[0]["pair"], Pair) and isinstance(parts[0]["list"], list)
    assert parts[2]["scale"] is batch["scale"] and parts[1]["name"] == "run"
    assert parts[0]["x"].data_ptr() == batch["x"].data_ptr()  # views, no copies


def test_split_batch_errors() -> None:
    with pytest.raises(ConfigError):
        batch_size_of({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ConfigError):
        batch_size_of({"a": 1})
    with pytest.raises(ConfigError):
        split_batch(torch.zeros(3), 0)


# -- MemoryRecovery ---------------------------------------------------------------------------


def _problem(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    batch = {"x": torch.randn(16, 6, dtype=torch.float64),
             "y": torch.randn(16, 1, dtype=torch.float64)}
    return model, batch


def _full_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


class _Capped:
    """A step function that 'runs out of memory' above ``limit`` rows, after its backward."""

    def __init__(self, model: nn.Module, limit: int) -> None:
        self.model, self.limit, self.sizes = model, limit, []

    def __call__(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = micro["x"].shape[0]
        self.sizes.append(rows)
        loss = nn.functional.mse_loss(self.model(micro["x"]), micro["y"])
        if rows > self.limit:
            # Leave partial gradients behind, as an OOM late in backward would.
            loss.backward(retain_graph=True)
            raise torch.OutOfMemoryError("simulated")
        return loss


def test_recovery_halves_and_matches_full_batch_gradient() -> None:
    model, batch = _problem()
    expected = _full_grads(model, batch)
    step = _Capped(model, limit=5)
    events = []
    rec = MemoryRecovery(model, attempts=4, on_oom=events.append)
    result = rec.step(step, batch)
    assert step.sizes[:3] == [16, 8, 4]  # 16 fails, 8 fails, then 4 x 4
    assert result.micro_batch_size == 4 and result.accumulation_steps == 4
    assert result.attempts == 3 and len(result.events) == 2 == len(events)
    assert [e.micro_batch_size for e in events] == [16, 8]
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)  # no half-accumulated leftovers
    full_loss = nn.functional.mse_loss(model(batch["x"]), batch["y"]).detach()
    torch.testing.assert_close(result.loss, full_loss)
    # The next step starts at the size that worked.
    model.zero_grad(set_to_none=True)
    step.sizes.clear()
    again = rec.step(step, batch)
    assert again.attempts == 1 and step.sizes == [4, 4, 4, 4]


def test_recovery_uneven_split_and_existing_grads() -> None:
    model, batch = _problem(1)
    batch = {k: v[:7] for k, v in batch.items()}
    expected = _full_grads(model, batch)
    previous = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), previous, strict=True):
        p.grad = g.clone()
    old_storage = [p.grad for p in model.parameters()]
    result = train_with_memory_recovery(_Capped(model, limit=3), batch, attempts=3, params=model)
    assert result.micro_batch_size == 3 and result.accumulation_steps == 3  # 3 + 3 + 1 rows
    for p, g, prev, old in zip(model.parameters(), expected, previous, old_storage, strict=True):
        torch.testing.assert_close(p.grad, g + prev)
        assert p.grad is old  # accumulated into the caller's gradient tensors in place


def test_options_next_to_a_recovery_object_are_refused() -> None:
    model, batch = _problem(1)
    recovery = MemoryRecovery(model, attempts=2)
    with pytest.raises(ConfigError, match="attempts"):
        train_with_memory_recovery(_Capped(model, limit=3), batch, attempts=5, params=model,
                                   recovery=recovery)
    with pytest.raises(ConfigError, match="min_micro_batch_size"):
        train_with_memory_recovery(_Capped(model, limit=3), batch, params=model,
                                   recovery=recovery, min_micro_batch_size=2)


def test_recovery_gives_up_at_one_and_restores_grads() -> None:
    model, batch = _problem()
    marker = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, m in zip(model.parameters(), marker, strict=True):
        p.grad = m
    rec = MemoryRecovery(model, attempts=10)
    with pytest.raises(RecoveryError, match="already 1"):
        rec.step(_Capped(model, limit=0), batch)
    assert len(rec.events) == 5  # 16, 8, 4, 2, 1
    for p, m in zip(model.parameters(), marker, strict=True):
        assert p.grad is m and torch.all(m == 3.0)


def test_recovery_attempts_limit() -> None:
    model, batch = _problem()
    step = _Capped(model, limit=2)
    with pytest.raises(RecoveryError, match="all 2 attempts"):
        MemoryRecovery(model, attempts=2).step(step, batch)
    assert step.sizes == [16, 8]
    assert all(p.grad is None for p in model.parameters())


def test_recovery_non_oom_error_propagates() -> None:
    model, batch = _problem()

    def broken(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        nn.functional.mse_loss(model(micro["x"]), micro["y"]).backward()
        raise KeyError("bug")

    with pytest.raises(KeyError):
        MemoryRecovery(model).step(broken, batch)
    assert all(p.grad is None for p in model.parameters())


def test_failed_attempt_memory_is_released_before_retry() -> None:
    model, batch = _problem()
    refs: list[weakref.ref] = []
    alive_at_oom: list[bool] = []

    def step(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        scratch = torch.empty(1024, 1024)  # held only by this frame
        refs.append(weakref.ref(scratch))
        loss = nn.functional.mse_loss(model(micro["x"]), micro["y"])
        if micro["x"].shape[0] > 8:
            raise torch.OutOfMemoryError("simulated")
        return loss

    rec = MemoryRecovery(model, on_oom=lambda e: alive_at_oom.append(refs[0]() is not None))
    rec.step(step, batch)
    assert alive_at_oom == [False]  # the traceback's frame no longer pins the tensor


def test_run_backward_false_passes_weights() -> None:
    model, batch = _problem(2)
    expected = _full_grads(model, batch)
    weights = []

    def step(micro: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
        weights.append(weight)
        loss = nn.functional.mse_loss(model(micro["x"]), micro["y"])
        (loss * weight).backward()
        return loss

    result = MemoryRecovery(model, run_backward=False, micro_batch_size=4).step(step, batch)
    assert weights == [0.25] * 4 and result.accumulation_steps == 4
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_recovery_validation() -> None:
    model, _ = _problem()
    with pytest.raises(ConfigError):
        MemoryRecovery(model, attempts=0)
    with pytest.raises(ConfigError):
        MemoryRecovery(model, micro_batch_size=0)
    with pytest.raises(ConfigError):
        MemoryRecovery(model, run_backward=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="scalar loss"):
        MemoryRecovery(model).step(lambda micro: None, torch.zeros(2, 6))


# -- find_executable_batch_size --------------------------------------------------------------


def _fits(limit: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def run(batch_size: int, tag: str = "") -> str:
        calls.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError("simulated")
        return f"{tag}{batch_size}"

    return calls, run


def test_power_mode_with_headroom() -> None:
    calls, run = _fits(37)
    search = find_executable_batch_size(run, starting_batch_size=128)
    assert search(tag="bs") == "bs30"  # 32 ran, 5% below it -> floor(30.4)
    assert calls == [128, 64, 32, 30] and search.batch_size == 30
    assert search.probes == [(128, False), (64, False), (32, True), (30, True)]
    assert all(d.kind == "capacity" for d in search.diagnoses)
    calls.clear()
    assert search() == "30" and calls == [30]  # settled: no new search, no further shrinking


def test_power_mode_without_headroom_returns_first_success() -> None:
    calls, run = _fits(37)
    assert find_executable_batch_size(run, starting_batch_size=128, headroom=0)() == "32"
    assert calls == [128, 64, 32]


def test_binsearch_mode() -> None:
    calls, run = _fits(37)
    search = find_executable_batch_size(starting_batch_size=128, mode="binsearch",
                                        headroom=0.0)(run)
    assert search() == "37" and search.batch_size == 37
    assert calls[:3] == [128, 64, 32] and max(b for b, ok in search.probes if ok) == 37
    _, run2 = _fits(37)
    with_margin = find_executable_batch_size(run2, starting_batch_size=128, mode="binsearch")
    assert with_margin() == "35"  # floor(37 * 0.95)


def test_first_size_that_runs_is_kept() -> None:
    calls, run = _fits(1000)
    assert find_executable_batch_size(run, starting_batch_size=64)() == "64" and calls == [64]


def test_bare_decorator_and_reset() -> None:
    calls: list[int] = []

    @find_executable_batch_size
    def run(batch_size: int) -> int:
        calls.append(batch_size)
        if batch_size > 100:
            raise MemoryError
        return batch_size

    assert run() == 60 and run.__name__ == "run"  # 128 fails, 64 runs, 5% below: 60
    run.reset()
    calls.clear()
    run()
    assert calls[0] == 128


def test_batch_size_search_errors() -> None:
    _, run = _fits(0)
    with pytest.raises(RecoveryError, match="batch size 1"):
        find_executable_batch_size(run, starting_batch_size=4)()
    _, ok = _fits(10)
    with pytest.raises(ConfigError):
        find_executable_batch_size(ok)(batch_size=3)
    with pytest.raises(ConfigError):
        find_executable_batch_size(ok, mode="linear")
    with pytest.raises(ConfigError):
        find_executable_batch_size(ok, headroom=1.0)
    with pytest.raises(ConfigError):
        find_executable_batch_size(ok, starting_batch_size=0)

    def bug(batch_size: int) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        find_executable_batch_size(bug)()


# -- OOMs known by their CUDA error code (torch.AcceleratorError, torch >= 2.8) ---------------


def _accelerator_oom() -> torch.AcceleratorError:
    # As torch raises it for cudaErrorMemoryAllocation: the message, then ``error_code``.
    error = torch.AcceleratorError("CUDA error: out of memory")
    error.error_code = 2  # type: ignore[attr-defined]
    return error


class _CodedAbove:
    """A step that raises ``make()`` above ``limit`` rows (after a partial backward)."""

    def __init__(self, model: nn.Module, limit: int, make: object) -> None:
        self.model, self.limit, self.make, self.sizes = model, limit, make, []

    def __call__(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = micro["x"].shape[0]
        self.sizes.append(rows)
        loss = nn.functional.mse_loss(self.model(micro["x"]), micro["y"])
        if rows > self.limit:
            loss.backward(retain_graph=True)
            raise self.make()  # type: ignore[operator]
        return loss


def test_recovery_halves_on_an_accelerator_error_with_the_oom_code() -> None:
    model, batch = _problem()
    expected = _full_grads(model, batch)
    step = _CodedAbove(model, 5, _accelerator_oom)
    result = MemoryRecovery(model, attempts=4).step(step, batch)
    assert step.sizes[:3] == [16, 8, 4] and result.micro_batch_size == 4
    assert [e.diagnosis.error_type for e in result.events] == ["AcceleratorError"] * 2
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)
    # The seed function goes through the same loop.
    model.zero_grad(set_to_none=True)
    step = _CodedAbove(model, 5, _accelerator_oom)
    assert train_with_memory_recovery(step, batch, 4, params=model).micro_batch_size == 4


def test_recovery_does_not_take_oom_text_for_an_oom() -> None:
    model, batch = _problem()
    # What torch < 2.8 raised for a CUDA runtime failure: a message and no code.
    step = _CodedAbove(model, 5, lambda: RuntimeError("CUDA error: out of memory"))
    with pytest.raises(RuntimeError, match="out of memory") as info:
        MemoryRecovery(model, attempts=4).step(step, batch)
    assert not isinstance(info.value, RecoveryError)
    assert step.sizes == [16]  # no retry
    assert all(p.grad is None for p in model.parameters())


def test_batch_size_search_on_accelerator_errors() -> None:
    calls: list[int] = []

    def run(batch_size: int) -> int:
        calls.append(batch_size)
        if batch_size > 37:
            raise _accelerator_oom()
        return batch_size

    search = find_executable_batch_size(run, starting_batch_size=128, headroom=0)
    assert search() == 32 and calls == [128, 64, 32]
    assert [d.error_type for d in search.diagnoses] == ["AcceleratorError"] * 2

    def text_only(batch_size: int) -> int:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(RuntimeError, match="Tried to allocate"):
        find_executable_batch_size(text_only, starting_batch_size=8)()
