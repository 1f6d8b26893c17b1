"""Planning one rank of a node: the copy rate a swapped block arrives at when the node's ranks
load it together (whole or sharded), from the node's measured figures."""

from __future__ import annotations

from typing import Any

import pytest

from tests.planning._models import inputs, stack, stack_cost
from vramkit.distributed.planning import (
    NODE_COPIES,
    NodeCopies,
    node_copies_for,
    plan_for_rank,
    rank_copy_bytes_per_s,
)
from vramkit.errors import ConfigError

MiB = 1 << 20
H100 = NODE_COPIES["h100-sxm"]


def test_whole_copies_share_the_nodes_host_memory() -> None:
    # 4x H100 SXM measured: 55.2 GB/s alone, 41.3 each with four copying (165.2 in all)
    assert rank_copy_bytes_per_s(55.2e9, 4, "whole", H100) == pytest.approx(41.3e9)
    assert rank_copy_bytes_per_s(55.2e9, 2, "whole", H100) == 55.2e9  # 82.6 each: link-bound
    assert rank_copy_bytes_per_s(55.2e9, 1, "sharded", H100) == 55.2e9
    assert rank_copy_bytes_per_s(55.2e9, 4, "whole", None) == 55.2e9  # not measured


def test_a_sharded_block_is_a_quarter_copied_and_three_quarters_gathered() -> None:
    # per GB: 0.25 / 41.3 GB/s = 6.053 ms copied + 0.75 / 339 GB/s = 2.212 ms gathered
    # -> 121.0 GB/s per rank (measured 121.1)
    rate = rank_copy_bytes_per_s(55.2e9, 4, "sharded", H100)
    assert rate == pytest.approx(1 / (0.25 / 41.3e9 + 0.75 / 339e9))
    assert rate == pytest.approx(121.1e9, rel=0.002)
    with pytest.raises(ConfigError, match="all-gather"):
        rank_copy_bytes_per_s(55.2e9, 4, "sharded", None)
    with pytest.raises(ConfigError):
        NodeCopies(host_bytes_per_s=0, allgather_bytes_per_s=1e9, source="-")


def test_the_node_is_found_by_the_gpus_profile() -> None:
    assert node_copies_for("h100-sxm") is H100
    assert node_copies_for("measured: NVIDIA H100 80GB HBM3") is H100
    assert node_copies_for("rtx4090") is None
    assert node_copies_for("measured: some GPU nobody profiled") is None


@pytest.fixture(scope="module")
def cost() -> Any:
    return stack_cost()


@pytest.mark.parametrize(("uploads", "rate"), [("whole", 41.3e9),
                                               ("sharded", 1 / (0.25 / 41.3e9 + 0.75 / 339e9))])
def test_a_ranks_plan_copies_at_the_nodes_rate(cost: Any, uploads: str, rate: float) -> None:
    model, xs = stack(device="meta"), inputs(device="meta")
    rank = plan_for_rank(model, xs, 6 * MiB, hardware="h100-sxm", headroom=0, cost=cost,
                         gradient_as_bucket_view=True, local_ranks=4, uploads=uploads)
    assert rank.swapped and rank.forward.copy_bytes > 0
    assert rank.forward.copy_seconds == pytest.approx(rank.forward.copy_bytes / rate)
    assert f"{uploads} uploads by 4 ranks" in rank.notes[0] and "GB/s" in rank.notes[0]
    alone = plan_for_rank(model, xs, 6 * MiB, hardware="h100-sxm", headroom=0, cost=cost,
                          gradient_as_bucket_view=True)
    assert alone.forward.copy_seconds == pytest.approx(alone.forward.copy_bytes / 55.2e9,
                                                       rel=0.05)
    if uploads == "whole":  # four ranks sharing the host copy no faster than one alone
        assert rank.predicted_step_seconds >= alone.predicted_step_seconds * (1 - 1e-9)
