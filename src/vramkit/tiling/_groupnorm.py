"""GroupNorm statistics over a whole image, gathered strip by strip (Chan's parallel merge).

Exact tiling (:mod:`vramkit.tiling._program`) normalises every strip with the statistics of the
whole plane: each strip contributes its per-group count, mean and M2 (:func:`group_stats`), the
contributions are merged in float64 (:func:`merge_group_stats`), and :func:`norm_scale_shift`
turns the merged statistics into the per-channel affine map the GroupNorm applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vramkit.errors import ConfigError

__all__ = ["GroupStats", "group_stats", "merge_group_stats", "norm_scale_shift"]


@dataclass(frozen=True)
class GroupStats:
    """Per-(sample, group) element count, mean and M2 (sum of squared deviations), float64.

    Args:
        count: number of elements, shape ``(B, G)``.
        mean: mean, shape ``(B, G)``.
        m2: sum of squared deviations from ``mean``, shape ``(B, G)``.
    """

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    def variance(self) -> torch.Tensor:
        """The biased variance ``m2 / count`` (what GroupNorm normalises with)."""
        return self.m2 / self.count


def group_stats(x: torch.Tensor, num_groups: int) -> GroupStats:
    """Count, mean and M2 of each group of channels of ``x`` (one tile).

    Per-channel moments are reduced in float32 over the spatial dims (Welford, in whatever
    memory layout ``x`` has: no reshaping copy of a channels-last strip), then the channels of
    a group are merged exactly in float64.

    Args:
        x: a ``(B, C, H, W)`` tensor (any layout).
        num_groups: the GroupNorm's number of groups; must divide ``C``.

    Returns:
        The tile's :class:`GroupStats`.
    """
    batch, channels = x.shape[0], x.shape[1]
    if channels % num_groups:
        raise ConfigError(f"{channels} channels do not split into {num_groups} groups",
                          hint="The GroupNorm's num_groups must divide the channels; check the "
                               "model's norm layers, or use exact_groupnorm=False.")
    per_channel = x.shape[2] * x.shape[3]
    var_c, mean_c = torch.var_mean(x.float(), dim=(2, 3), correction=0)  # (B, C)
    mean_c = mean_c.double().view(batch, num_groups, -1)
    m2_c = var_c.double().view(batch, num_groups, -1) * per_channel
    mean = mean_c.mean(dim=-1)
    # Equal counts per channel: M2 of the group = sum of channel M2 + n * sum of squared offsets.
    m2 = m2_c.sum(dim=-1) + per_channel * ((mean_c - mean[..., None]) ** 2).sum(dim=-1)
    count = torch.full_like(mean, float(per_channel * (channels // num_groups)))
    return GroupStats(count, mean, m2)


def merge_group_stats(a: GroupStats | None, b: GroupStats) -> GroupStats:
    """Chan's merge of two disjoint sets' statistics (``a`` may be ``None``: returns ``b``).

    Args:
        a: statistics gathered so far, or ``None``.
        b: the statistics of a new, disjoint set of elements.

    Returns:
        The statistics of the union, exactly those of the concatenated elements (up to rounding).
    """
    if a is None:
        return b
    count = a.count + b.count
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.count / count)
    m2 = a.m2 + b.m2 + delta * delta * (a.count * b.count / count)
    return GroupStats(count, mean, m2)


def norm_scale_shift(norm: nn.GroupNorm, stats: GroupStats) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(sample, channel) ``scale, shift`` with ``norm(x) == x * scale + shift``, float32."""
    rstd = torch.rsqrt(stats.variance() + norm.eps)  # (B, G), float64
    per_group = norm.num_channels // norm.num_groups
    rstd_c = rstd.repeat_interleave(per_group, dim=1)
    mean_c = stats.mean.repeat_interleave(per_group, dim=1)
    if norm.affine:
        gamma = norm.weight.detach().double()[None]
        beta = norm.bias.detach().double()[None]
        scale = rstd_c * gamma
        shift = beta - mean_c * scale
    else:
        scale = rstd_c
        shift = -mean_c * rstd_c
    return scale.float()[:, :, None, None], shift.float()[:, :, None, None]
