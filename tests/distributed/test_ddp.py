"""Two-process data-parallel training of swapped models (CPU, gloo), through ``_worker.py``.

One torchrun job runs every scenario once per module; each test checks one claim of
``vramkit.distributed`` on the numbers the two ranks wrote (see the scenario functions in
``_worker.py`` for what each key means).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed._checks import check_sharded, check_sharded_compressed
from tests.distributed._launch import NPROC, WORKER, describe, require_gloo, torchrun

require_gloo()
pytestmark = pytest.mark.slow  # torchrun jobs: ~10 s each

SCENARIOS = ("lora", "plain_ddp", "full_cpu", "full_swap", "pss", "fsdp", "shm_fallback",
             "fit_rank", "accumulate_cpu", "accumulate_swap", "sharded", "sharded_compressed")
TOLERANCE = 1e-6
#: Four ranks' all-reduced gradients against one process's whole batch: the summation order
#: differs, and three AdamW steps at lr 1e-2 carry it further where a gradient is near zero.
#: On an AMD EPYC host plain DDP (scenario full_cpu at four ranks, no sharded uploads) and the
#: sharded scenario both read 2.2e-06 (1.1e-07 at two ranks).
FOUR_RANK_TOLERANCE = 1e-5
PAGE = 4096

Ranks = list[dict[str, Any]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    """Every scenario's per-rank JSON from one torchrun job."""
    out: Path = tmp_path_factory.mktemp("ddp")
    proc = torchrun([str(WORKER), "--out", str(out), "--scenarios", ",".join(SCENARIOS)],
                    cwd=out)
    if proc.returncode != 0:
        pytest.fail(f"the distributed worker failed: {describe(proc)}")
    loaded: dict[str, Ranks] = {}
    for name in SCENARIOS:
        ranks = []
        for rank in range(NPROC):
            path = out / f"{name}-rank{rank}.json"
            if not path.exists():
                pytest.fail(f"the worker wrote no {path.name}: {describe(proc)}")
            ranks.append(json.loads(path.read_text()))
        loaded[name] = ranks
    return loaded


def scenario(results: dict[str, Ranks], name: str) -> Ranks:
    """The scenario's ranks, failing with the rank's traceback where it raised."""
    ranks = results[name]
    for r in ranks:
        if "error" in r:
            pytest.fail(f"scenario {name} failed on rank {r['rank']}: {r['error']}\n"
                        f"{r.get('traceback', '')}")
    return ranks


def test_every_scenario_ran_on_both_ranks_of_a_gloo_job(results: dict[str, Ranks]) -> None:
    for name in SCENARIOS:
        ranks = results[name]
        assert [r["rank"] for r in ranks] == list(range(NPROC)), name
        assert [r["local_rank"] for r in ranks] == list(range(NPROC)), name
        assert all(r["world_size"] == NPROC and r["backend"] == "gloo" for r in ranks), name


# -- gradients and parameters equal one process on the whole batch -----------------------------


def test_lora_gradients_equal_one_process_on_the_combined_batch(
        results: dict[str, Ranks]) -> None:
    """Adapters and resident layers reduce through DDP; the swapped base is left to the swapper."""
    for r in scenario(results, "lora"):
        assert r["ddp_type"] == "DistributedDataParallel"
        assert 0 <= r["grad_diff"] <= TOLERANCE, r


def test_plain_ddp_around_a_swapped_model_gives_the_combined_batch_gradients(
        results: dict[str, Ranks]) -> None:
    """``DistributedDataParallel(model)`` after attaching (no wrap_ddp) constructs and reduces:
    the placeholders are not broadcast."""
    for r in scenario(results, "plain_ddp"):
        assert 0 <= r["grad_diff"] <= TOLERANCE, r


@pytest.mark.parametrize("name", ["lora", "full_cpu", "full_swap"])
def test_parameters_after_three_adamw_steps_equal_one_process(
        results: dict[str, Ranks], name: str) -> None:
    """LoRA through DDP; swapped trainable weights (host-stepped ``"cpu"`` and device-stepped
    ``"swap"``) through the swapper's gradient hook."""
    for r in scenario(results, name):
        assert 0 <= r["param_diff"] <= TOLERANCE, r


# Values that differ between processes by nature: who they are, and their own memory.
_PER_PROCESS = {"rank", "local_rank", "shared_pss_delta", "per_rank_pss_delta",
                "warnings",  # rank 0 alone warns
                # sharded uploads: each rank copies its own piece; rank 0 also previews alone
                *(f"{kind}_{key}" for kind in ("lora", "cpu", "swap")
                  for key in ("h2d_bytes", "gathered_bytes", "loads")),
                "h2d_bytes", "gathered_bytes"}  # (sharded_compressed: each rank's own piece)


@pytest.mark.parametrize("name", SCENARIOS)
def test_both_ranks_report_identical_values(results: dict[str, Ranks], name: str) -> None:
    """The replicas agree: the same differences to the reference, sizes, outputs and errors."""
    ranks = scenario(results, name)
    first, *others = ({k: v for k, v in r.items() if k not in _PER_PROCESS} for r in ranks)
    assert set(first) - {"world_size", "backend"}, first  # the scenario reported something
    for other in others:
        assert other == first


# -- what DDP sees ------------------------------------------------------------------------------


def test_swapped_tensors_are_ignored_by_ddp_while_attached_and_forgotten_at_detach(
        results: dict[str, Ranks]) -> None:
    expected = sorted(f"blocks.{i}.{name}" for i in range(4)
                      for name in ("0.base.weight", "0.base.bias", "2.weight", "2.bias"))
    for r in scenario(results, "lora"):
        assert r["ignored"] == expected  # the frozen base; not the adapters, inp or out
        assert r["ignored_after_detach"] is False


# -- host memory --------------------------------------------------------------------------------


def test_frozen_masters_are_shared_and_trainable_swapped_weights_are_not(
        results: dict[str, Ranks]) -> None:
    for r in scenario(results, "lora"):
        swapped = r["swapped_bytes"]
        assert swapped > 0 and r["swapped_blocks"] > 0
        # Every frozen master in the shared mapping, each block page-aligned in it.
        assert swapped <= r["shared_bytes"] <= swapped + r["swapped_blocks"] * PAGE, r
    for name in ("full_cpu", "full_swap"):
        for r in scenario(results, name):
            assert r["shared_bytes"] == 0, (name, r)  # each rank steps its own masters


def test_the_node_holds_one_copy_of_shared_masters_and_one_per_rank_otherwise(
        results: dict[str, Ranks]) -> None:
    """Proportional set size grown by attaching and running a 64 MiB frozen model, summed over
    the two ranks: ~1x the swapped bytes with shared masters, ~2x with a swapper per rank.

    On the CPU the swapper's ring slots (the "device" copies) are host memory too; they are
    taken out of each rank's growth, which leaves the masters and a few MiB of allocator noise.
    """
    ranks = scenario(results, "pss")
    if any(r["shared_pss_delta"] is None or r["per_rank_pss_delta"] is None for r in ranks):
        pytest.skip("/proc/self/smaps_rollup gives no Pss on this system")
    swapped = ranks[0]["shared_swapped_bytes"]
    assert swapped == 16 * 1024 * 1024 * 4  # 16 fp32 1024x1024 weights
    shared = sum(r["shared_pss_delta"] - r["shared_slot_bytes"] for r in ranks)
    per_rank = sum(r["per_rank_pss_delta"] - r["per_rank_slot_bytes"] for r in ranks)
    detail = (f"shared {shared / swapped:.2f}x, per rank {per_rank / swapped:.2f}x of "
              f"{swapped} swapped bytes ({ranks})")
    assert shared <= 1.3 * swapped, detail
    assert per_rank >= 1.7 * swapped, detail


def test_outputs_are_equal_with_shared_and_per_rank_masters(results: dict[str, Ranks]) -> None:
    for r in scenario(results, "pss"):
        assert r["shared_out"] == r["per_rank_out"]
        assert r["shared_swapped_bytes"] == r["per_rank_swapped_bytes"]


# -- refusals -----------------------------------------------------------------------------------


def test_attaching_to_a_ddp_wrapped_model_is_refused_with_a_hint(
        results: dict[str, Ranks]) -> None:
    for r in scenario(results, "plain_ddp"):
        assert r["wrapped_refused"] is not None, "BlockSwapper(DistributedDataParallel) attached"
        assert "DistributedDataParallel" in r["wrapped_refused"]
        assert "wrap_ddp" in r["wrapped_hint"]


@pytest.mark.parametrize("name", ["full_cpu", "full_swap"])
def test_unreduced_swapped_trainable_gradients_are_refused(
        results: dict[str, Ranks], name: str) -> None:
    """Without a gradient hook the ranks would step their own gradients and drift apart."""
    for r in scenario(results, name):
        message = r["unreduced_refused"]
        assert message is not None, f"{name}: backward without a hook was not refused"
        assert f"{NPROC} processes" in message
        assert "wrap_ddp" in message and "set_gradient_hook" in message


def _fsdp(results: dict[str, Ranks]) -> Ranks:
    ranks = scenario(results, "fsdp")
    if "skipped" in ranks[0]:
        pytest.skip(ranks[0]["skipped"])
    return ranks


def test_an_fsdp_sharded_model_is_refused_before_attaching(results: dict[str, Ranks]) -> None:
    for r in _fsdp(results):
        assert r["before"] is not None, "BlockSwapper attached to a model fully_shard sharded"
        assert "sharded by FSDP" in r["before"]
        assert "wrap_ddp" in r["before"]  # the hint names the supported combination


def test_fsdp_applied_after_attaching_is_refused(results: dict[str, Ranks]) -> None:
    """Either the swapper refuses at the next call of a swapped block, or FSDP refuses the
    swapper's stride-0 placeholders itself (what torch does today); never silent training."""
    for r in _fsdp(results):
        after = r["after"]
        assert after is not None, "fully_shard after attaching was accepted and ran"
        ours = "sharded by FSDP after the swapper attached" in after
        theirs = after.startswith("fsdp: ") and "non-contiguous" in after
        assert ours or theirs, after


# -- sharing impossible: per-rank copies, said once --------------------------------------------


def test_without_room_to_share_every_rank_pins_its_own_and_rank_0_says_why(
        results: dict[str, Ranks]) -> None:
    ranks = scenario(results, "shm_fallback")
    for r in ranks:
        assert r["shared"] is False and r["shared_bytes"] == 0
        assert r["pinned_bytes"] >= r["swapped_bytes"] > 0  # its own masters
        assert "does not exist" in r["reason"]
        assert r["grad_diff"] <= TOLERANCE
    first, other = ranks
    assert len(first["warnings"]) == 1 and other["warnings"] == []
    message = first["warnings"][0]
    assert "cannot share" in message and "/nonexistent/vramkit-shm" in message
    assert "--shm-size" in message  # the hint says how to give /dev/shm room


# -- planning a rank -----------------------------------------------------------------------------


def test_fit_rank_counts_ddp_buckets_agrees_on_one_plan_and_trains_as_one_process(
        results: dict[str, Ranks]) -> None:
    for r in scenario(results, "fit_rank"):
        # DDP's buckets (one copy of the reduced gradients) raise the smallest budget by them,
        # grossed up by the 5 % headroom.
        extra = r["minimum_rank"] - r["minimum_one_gpu"]
        assert r["bucket_bytes"] <= extra <= r["bucket_bytes"] / 0.95 + 64
        assert r["reserved_at_least_buckets"]
        assert r["swapped"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
        assert r["shared_bytes"] >= 4 * 256 * 256 * 4  # the frozen blocks, once per node
        assert r["grad_diff"] <= TOLERANCE
        # rank 1's plan predicted the slower step (2 s more overhead): every rank applies it
        assert r["agreed_step"] >= 2.0


# -- two nodes of two ranks (hosts faked) --------------------------------------------------------


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    out: Path = tmp_path_factory.mktemp("nodes")
    proc = torchrun([str(WORKER), "--out", str(out), "--scenarios",
                     "two_nodes,one_node_without_room,sharded", "--fake-hosts", "2"], cwd=out,
                    nproc=4)
    if proc.returncode != 0:
        pytest.fail(f"the four-rank worker failed: {describe(proc)}")
    found: dict[str, Ranks] = {}
    for name in ("two_nodes", "one_node_without_room", "sharded"):
        found[name] = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(4)]
        for r in found[name]:
            if "error" in r:
                pytest.fail(f"{name}, rank {r['rank']}: {r['error']}\n{r.get('traceback', '')}")
    return found


def test_each_node_shares_one_copy_between_its_own_ranks(four_ranks: dict[str, Ranks]) -> None:
    two_nodes = four_ranks["two_nodes"]
    assert [r["local_ranks"] for r in two_nodes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["shared_bytes"] > 0 for r in two_nodes)


def test_wrap_ddp_broadcasts_rank_0s_masters_to_the_other_nodes_writer(
        four_ranks: dict[str, Ranks]) -> None:
    """Node 1 built other frozen weights; after wrap_ddp every rank computes rank 0's model
    (slots loaded before the broadcast are reloaded: a collective bumps no version counter)."""
    two_nodes = four_ranks["two_nodes"]
    assert [r["differed_before"] for r in two_nodes] == [False, False, True, True]
    assert all(r["equal_after"] and r["same_as_rank0_model"] for r in two_nodes)


def test_a_node_without_room_pins_per_rank_while_the_other_shares(
        four_ranks: dict[str, Ranks]) -> None:
    ranks = four_ranks["one_node_without_room"]
    assert [r["shared_bytes"] > 0 for r in ranks] == [True, True, False, False]
    assert [r["reason"] is None for r in ranks] == [True, True, False, False]
    assert all("does not exist" in r["reason"] for r in ranks[2:])
    assert all(r["grad_diff"] <= TOLERANCE for r in ranks)


@pytest.mark.parametrize("name", ["accumulate_cpu", "accumulate_swap"])
def test_accumulating_under_no_sync_equals_one_process_accumulating(
        results: dict[str, Ranks], name: str) -> None:
    """Two micro-batches per step, the first under DDP's no_sync(): swapped trainable gradients
    reduce through the swapper's hook (every micro-batch with trainable='cpu', the window's last
    with 'swap' and accumulation_steps=2), the rest through DDP at the last micro-batch."""
    for r in scenario(results, name):
        assert r["param_diff"] <= TOLERANCE


# -- sharded uploads ------------------------------------------------------------------------------


def test_sharded_uploads_split_each_block_between_the_ranks_and_train_exactly(
        results: dict[str, Ranks]) -> None:
    """uploads='sharded' on gloo: each rank copies half of a block and all-gathers the other
    half; LoRA over a shared base and trainable='cpu' equal one process; rank 0's preview in
    local_calls() between steps leaves the ranks' loads matched (no hang)."""
    check_sharded(scenario(results, "sharded"), NPROC, TOLERANCE)


def test_sharded_uploads_gather_compressed_masters_and_train_exactly(
        results: dict[str, Ranks]) -> None:
    """compress="on" beside sharded uploads on gloo (the checks: ``_checks``)."""
    check_sharded_compressed(scenario(results, "sharded_compressed"), NPROC, TOLERANCE)


def test_sharded_uploads_gather_within_each_node(four_ranks: dict[str, Ranks]) -> None:
    """Two (fake) nodes of two ranks: one gather group per node; DDP still spans all four."""
    check_sharded(four_ranks["sharded"], 2, FOUR_RANK_TOLERANCE)
