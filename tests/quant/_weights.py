"""Test weights shared by the quantization tests: Gaussian and Student-t (3 dof) matrices.

Student-t is built from ``randn`` alone (z / sqrt(chi2_3 / 3)), so a seed gives the same matrix on
every torch version and device.
"""

from __future__ import annotations

import torch


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 N(0, 1) matrix from ``seed``."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def student_t3(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 Student-t matrix with 3 degrees of freedom from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, cols, generator=gen)
    chi2 = torch.randn(3, rows, cols, generator=gen).square().sum(dim=0)
    return z / torch.sqrt(chi2 / 3.0)


def matmul_error(weight: torch.Tensor, approx: torch.Tensor, tokens: int = 256,
                 seed: int = 5) -> float:
    """Relative matmul error ||X W^T - X A^T|| / ||X W^T|| with Gaussian X."""
    x = torch.randn(tokens, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    x = x.to(weight.device)
    y = x @ weight.float().T
    return float((y - x @ approx.float().T).norm() / y.norm())
