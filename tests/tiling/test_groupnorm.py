"""GroupNorm statistics merged across strips (Chan), as exact tiling gathers them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.tiling._models import one_torch_thread
from vramkit.errors import ConfigError
from vramkit.tiling import group_stats, merge_group_stats

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), groups=st.sampled_from([1, 2, 4]), per_group=st.integers(1, 3),
       width=st.integers(1, 6), cuts=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_chan_merge_of_strips_equals_full_statistics(data: st.DataObject, groups: int,
                                                     per_group: int, width: int,
                                                     cuts: list[int]) -> None:
    channels = groups * per_group
    height = sum(cuts)
    values = data.draw(arrays(np.float32, (2, channels, height, width),
                              elements=st.floats(-1e3, 1e3, width=32)))
    x = torch.from_numpy(values) + 100.0  # an offset: naive sum-of-squares would lose digits
    merged = None
    row = 0
    for rows in cuts:
        merged = merge_group_stats(merged, group_stats(x[:, :, row:row + rows], groups))
        row += rows
    flat = x.double().reshape(2, groups, -1)
    assert torch.allclose(merged.count, torch.full_like(merged.count, flat.shape[-1]))
    torch.testing.assert_close(merged.mean, flat.mean(-1), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(merged.variance(), flat.var(-1, unbiased=False),
                               rtol=1e-4, atol=1e-3)


def test_group_stats_channels_last_and_bad_groups() -> None:
    x = torch.randn(1, 8, 5, 7)
    a = group_stats(x, 4)
    b = group_stats(x.to(memory_format=torch.channels_last), 4)
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close(a.m2, b.m2)
    with pytest.raises(ConfigError):
        group_stats(x, 3)
