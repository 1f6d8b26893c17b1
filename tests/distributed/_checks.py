"""Checks shared by the gloo and NCCL runs of the distributed scenarios."""

from __future__ import annotations

from typing import Any


def check_sharded(ranks: list[dict[str, Any]], node_size: int, tolerance: float) -> None:
    """Each rank of a node copied about 1/node_size of every block it loaded collectively and
    got the rest from the node's other ranks; training equals one process."""
    for r in ranks:
        for kind in ("lora", "cpu", "swap"):
            assert r[f"{kind}_loader"] == "ShardedUploads", r
            assert r[f"{kind}_param_diff"] <= tolerance, (kind, r)
            (block,) = r[f"{kind}_block_bytes"]  # the test blocks are all the same size
            assert r[f"{kind}_slot_bytes"] % node_size == 0
            if r["rank"] == 0 or kind == "swap":
                continue  # rank 0's local calls made plain loads too; "swap" also copies state
            loaded = r[f"{kind}_loads"] * block
            assert r[f"{kind}_loader_loads"] == r[f"{kind}_loads"]
            assert r[f"{kind}_h2d_bytes"] + r[f"{kind}_gathered_bytes"] == loaded
            piece = -(-block // (node_size * 256)) * 256
            assert r[f"{kind}_h2d_bytes"] <= r[f"{kind}_loads"] * piece
            assert r[f"{kind}_gathered_bytes"] >= loaded * (node_size - 1) / node_size - 1
        assert r["lora_shared_bytes"] > 0 and r["cpu_shared_bytes"] == r["swap_shared_bytes"] == 0
        assert "swap different blocks" in (r["mismatch_refused"] or ""), r
    # every rank of a node made the same collective loads
    assert len({r["lora_loader_loads"] for r in ranks}) == 1


def check_sharded_compressed(ranks: list[dict[str, Any]], node_size: int,
                             tolerance: float) -> None:
    """compress="on" beside sharded uploads: every block compressed alike on each rank, each
    rank copies about 1/node_size of a payload and gathers the rest, each decodes; training
    equals one process; every rank made the same collective loads."""
    for r in ranks:
        assert r["param_diff"] <= tolerance, r
        assert r["compressed_blocks"] == r["blocks"] > 0, r
        assert r["gathered_bytes"] > 0 and r["h2d_bytes"] > 0, r
        # each rank read its piece of the compressed bytes it loaded (the rest gathered)
        assert r["h2d_bytes"] <= r["gathered_bytes"] + r["loads"] * 256 * node_size, r
    assert len({r["loader_loads"] for r in ranks}) == 1
