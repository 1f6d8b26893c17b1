"""batch_matmul: same results as a loop, one batched matmul per shape group, in input order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from vramkit.errors import ConfigError, DeviceMismatchError
from vramkit.kernels.batch import batch_matmul


def _pairs(shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
           dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(a, generator=generator, dtype=dtype),
             torch.randn(b, generator=generator, dtype=dtype)) for a, b in shapes]


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    original: Callable[..., Any] = getattr(torch, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, name, counted)
    return calls


MIXED = [((3, 4), (4, 5)), ((2, 7), (7, 1)), ((3, 4), (4, 5)), ((3, 4), (4, 6)),
         ((2, 7), (7, 1)), ((3, 4), (4, 5)), ((1, 1), (1, 1))]


def test_results_equal_the_loop_in_input_order() -> None:
    pairs = _pairs(MIXED)
    results = batch_matmul(pairs)
    assert len(results) == len(pairs)
    for (a, b), result in zip(pairs, results, strict=True):
        torch.testing.assert_close(result, a @ b)


def test_one_bmm_per_shape_group(monkeypatch: pytest.MonkeyPatch) -> None:
    bmm = _count(monkeypatch, "bmm")
    matmul = _count(monkeypatch, "matmul")
    batch_matmul(_pairs(MIXED))
    # Groups: (3,4)@(4,5) x3 and (2,7)@(7,1) x2 batched; (3,4)@(4,6) and (1,1)@(1,1) alone.
    assert len(bmm) == 2
    assert len(matmul) == 2


def test_max_batch_splits_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _pairs([((4, 4), (4, 4))] * 7)
    bmm = _count(monkeypatch, "bmm")
    matmul = _count(monkeypatch, "matmul")
    results = batch_matmul(pairs, max_batch=3)
    assert (len(bmm), len(matmul)) == (2, 1)  # 3 + 3 batched, the last alone
    for (a, b), result in zip(pairs, results, strict=True):
        torch.testing.assert_close(result, a @ b)


def test_shared_operand_is_broadcast_not_stacked(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(8, 3, dtype=torch.float64)
    lefts = [torch.randn(5, 8, dtype=torch.float64) for _ in range(4)]
    stacks = _count(monkeypatch, "stack")
    results = batch_matmul([(a, weight) for a in lefts])
    assert len(stacks) == 1  # only the left operands are stacked
    for a, result in zip(lefts, results, strict=True):
        torch.testing.assert_close(result, a @ weight)
    stacks.clear()
    rights = [torch.randn(3, 2, dtype=torch.float64) for _ in range(3)]
    results = batch_matmul([(weight, b) for b in rights])
    assert len(stacks) == 1
    for b, result in zip(rights, results, strict=True):
        torch.testing.assert_close(result, weight @ b)


def test_batched_operands_use_matmul_broadcasting() -> None:
    pairs = _pairs([((2, 3, 4), (1, 4, 5))] * 3 + [((6, 2, 3), (3, 2))] * 2
                   + [((3, 4), (2, 4, 5))] * 2)
    shared = torch.randn(1, 4, 2, dtype=torch.float64)
    pairs += [(torch.randn(3, 4, dtype=torch.float64), shared) for _ in range(2)]
    pairs += [(shared.transpose(1, 2), torch.randn(5, 4, 3, dtype=torch.float64))
              for _ in range(2)]
    for (a, b), result in zip(pairs, batch_matmul(pairs), strict=True):
        assert result.shape == (a @ b).shape
        torch.testing.assert_close(result, a @ b)


def test_gradients_flow_like_the_loop() -> None:
    pairs = _pairs([((3, 4), (4, 2))] * 3)
    leaves = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in pairs]
    sum(r.sum() for r in batch_matmul(leaves)).backward()
    reference = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in pairs]
    sum((a @ b).sum() for a, b in reference).backward()
    for (a, b), (ra, rb) in zip(leaves, reference, strict=True):
        torch.testing.assert_close(a.grad, ra.grad)
        torch.testing.assert_close(b.grad, rb.grad)


def test_empty_input() -> None:
    assert batch_matmul([]) == []


def test_dtypes_are_grouped_apart() -> None:
    pairs = _pairs([((2, 2), (2, 2))]) + _pairs([((2, 2), (2, 2))], dtype=torch.float32)
    results = batch_matmul(pairs)
    assert [r.dtype for r in results] == [torch.float64, torch.float32]


@pytest.mark.parametrize("pair, error", [
    ((torch.ones(2, 3), torch.ones(4, 2)), ConfigError),
    ((torch.ones(3), torch.ones(3, 2)), ConfigError),
    ((torch.ones(2, 2), [[1.0]]), ConfigError),
    ((torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float64)), ConfigError),
    ((torch.ones(2, 2), torch.ones(2, 2, device="meta")), DeviceMismatchError),
])
def test_bad_pairs_are_refused(pair: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        batch_matmul([(torch.ones(2, 2), torch.ones(2, 2)), pair])


def test_non_pairs_and_bad_max_batch_are_refused() -> None:
    with pytest.raises(ConfigError):
        batch_matmul([(torch.ones(2, 2),)])  # type: ignore[list-item]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError):
            batch_matmul([], max_batch=bad)  # type: ignore[arg-type]
