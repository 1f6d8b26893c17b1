"""Batched matrix multiplication of many independent (a, b) pairs.

The seed's ``batch_matmul_optimized`` launched one matmul per pair and synchronized after every
group. Here pairs of equal shape, dtype and device are stacked and multiplied with one
``torch.bmm`` (or ``torch.matmul`` for inputs with batch dimensions) per group: one kernel instead
of one per pair, no host sync, and results returned in the input order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vramkit._validate import check_int
from vramkit.errors import ConfigError, DeviceMismatchError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["batch_matmul"]


def _group_key(index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[object, ...]:
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ConfigError(f"batch_matmul: pair {index} is not two tensors "
                          f"({type(a).__name__}, {type(b).__name__})",
                          hint="Give each item as an (a, b) pair of torch.Tensor, e.g. "
                               "batch_matmul([(a1, b1), (a2, b2)]).")
    if a.dim() < 2 or b.dim() < 2:
        raise ConfigError(f"batch_matmul: pair {index} has shapes {tuple(a.shape)} and "
                          f"{tuple(b.shape)}; both operands need at least 2 dimensions",
                          "Use a.unsqueeze(0) / b.unsqueeze(-1) for vectors.")
    if a.shape[-1] != b.shape[-2]:
        raise ConfigError(f"batch_matmul: pair {index} cannot be multiplied: "
                          f"{tuple(a.shape)} @ {tuple(b.shape)}",
                          hint="The last dimension of a must equal the second-to-last of b, as for "
                               "torch.matmul; transpose one operand (b.mT) if they are swapped.")
    if a.device != b.device:
        raise DeviceMismatchError(a.device, b.device, what=f"b of pair {index}")
    if a.dtype != b.dtype:
        raise ConfigError(f"batch_matmul: pair {index} mixes {a.dtype} and {b.dtype}",
                          "Cast both operands to one dtype first.")
    return (tuple(a.shape), tuple(b.shape), a.dtype, a.device)


def batch_matmul(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                 max_batch: int | None = None) -> list[torch.Tensor]:
    """Multiply many ``(a, b)`` pairs, one batched matmul per group of equal shapes.

    Pairs with the same shapes, dtype and device are stacked along a new batch dimension and
    multiplied together (``torch.bmm`` for 2-D operands, ``torch.matmul`` when they already
    have batch dimensions). When every pair of a group shares the same ``b`` (or the same
    ``a``) tensor object, that operand is broadcast instead of copied. Autograd flows through
    as for the per-pair products.

    Stacking copies the operands of a group, so peak memory grows by the group's input bytes;
    ``max_batch`` bounds it.

    Args:
        pairs: ``(a, b)`` tensors with ``a.shape[-1] == b.shape[-2]``, at least 2-D each.
        max_batch: most pairs per batched matmul (default ``None``: a whole shape group at once).

    Returns:
        ``[a @ b for a, b in pairs]``, in the input order.

    Raises:
        ConfigError: a pair is not two tensors of >= 2 dimensions with matching inner sizes and
            one dtype, or ``max_batch < 1``.
        DeviceMismatchError: ``a`` and ``b`` of a pair are on different devices.
    """
    import torch

    check_int("batch_matmul max_batch", max_batch, minimum=1, allow_none=True)
    items = list(pairs)
    groups: dict[tuple[object, ...], list[int]] = {}
    for index, pair in enumerate(items):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigError(f"batch_matmul: item {index} is not an (a, b) pair",
                              hint="Pass an iterable of 2-tuples, e.g. batch_matmul([(a1, b1), "
                                   "(a2, b2)]).")
        groups.setdefault(_group_key(index, pair[0], pair[1]), []).append(index)
    results: list[torch.Tensor | None] = [None] * len(items)
    for members in groups.values():
        chunk = len(members) if max_batch is None else max_batch
        for start in range(0, len(members), chunk):
            part = members[start:start + chunk]
            if len(part) == 1:
                a, b = items[part[0]]
                results[part[0]] = torch.matmul(a, b)
                continue
            outputs = _multiply_group([items[i][0] for i in part], [items[i][1] for i in part])
            for index, output in zip(part, outputs, strict=True):
                results[index] = output
    logger.debug("batch_matmul: %d pairs in %d shape groups", len(items), len(groups))
    return results  # type: ignore[return-value]


def _multiply_group(lefts: list[torch.Tensor], rights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Products of equally shaped operands with one batched kernel."""
    import torch

    # Give both operands the product's rank first (leading 1s, as matmul broadcasting does), so
    # the new group dimension lines up with the same axis on both sides.
    rank = max(lefts[0].dim(), rights[0].dim())

    def lift(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape((1,) * (rank - tensor.dim()) + tuple(tensor.shape))

    shared_right = all(b is rights[0] for b in rights)
    shared_left = all(a is lefts[0] for a in lefts)
    if shared_right:
        # (G, ..., m, k) @ (1, ..., k, n) broadcasts b without materializing G copies.
        product = torch.matmul(torch.stack([lift(a) for a in lefts]), lift(rights[0])[None])
    elif shared_left:
        product = torch.matmul(lift(lefts[0])[None], torch.stack([lift(b) for b in rights]))
    elif rank == 2:
        product = torch.bmm(torch.stack(lefts), torch.stack(rights))
    else:
        product = torch.matmul(torch.stack([lift(a) for a in lefts]),
                               torch.stack([lift(b) for b in rights]))
    return list(product.unbind(0))
