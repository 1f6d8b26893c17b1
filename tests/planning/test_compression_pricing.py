"""The planner prices compressed masters (vramkit.planning._compression): on where a
transfer-bound step predicts faster and the decode scratch fits, off where the step is compute
bound, the weights would not shrink, or no decode rate is known."""

from __future__ import annotations

import pytest
import torch

from tests._toys import Stack, mlp
from tests.planning._models import inputs, stack
from vramkit.errors import ConfigError
from vramkit.planning._compression import (
    DECODE_SHARE,
    EXPECTED_RATIO,
    SCRATCH_BUFFERS,
    decode_rate,
    expected_ratio,
)
from vramkit.planning.analysis import analyze
from vramkit.planning.api import plan
from vramkit.planning.calibration import BlockTimes
from vramkit.planning.machine import machine_for
from vramkit.planning.record import Plan

MiB = 1 << 20


def _bf16_stack() -> torch.nn.Module:
    model = stack(device="meta").to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def test_expected_ratio_follows_the_dtypes() -> None:
    blocks = list(_bf16_stack().blocks.named_children())
    assert expected_ratio(blocks) == pytest.approx(EXPECTED_RATIO["bf16"])
    fp32 = list(stack(device="meta").blocks.named_children())
    assert expected_ratio(fp32) is None  # stored raw: nothing to gain


def test_full_fine_tuning_is_never_priced_compressed() -> None:
    # every swapped weight trains: nothing frozen to compress, so nothing is weighed
    model = stack(device="meta").to(torch.bfloat16)
    model.requires_grad_(True)
    assert expected_ratio(list(model.blocks.named_children())) is None
    xs = inputs(device="meta")
    full = plan(model, xs, 24 * MiB, hardware="rtx4090", headroom=0, autocast=None,
                trainable="swap")
    assert full.swapped and not full.compress_masters


def test_a_share_of_the_swapped_blocks_is_priced_compressed_too() -> None:
    from vramkit.planning._compression import SUBSET_SHARES, compressed, compressed_subsets
    from vramkit.planning.pricing import Candidate

    sizes = [100, 100, 200, 100, 100, 100, 100, 100]
    chosen = [1, 2, 3, 5, 6, 7]  # blocks 0 and 4 resident
    c = Candidate(chosen=chosen, flags=[i in chosen for i in range(8)], num_slots=2,
                  sizes=sizes, copy_seconds=[s / 100 if i in chosen else 0.0
                                             for i, s in enumerate(sizes)],
                  master_bytes=sum(sizes[i] for i in chosen), weights=0, slot_bytes=0,
                  scratch=0, dequant=[], per_layer=[], swapped_format="bf16",
                  resident_format="bf16", together=False, checkpoints=0, offload=False)
    subsets = compressed_subsets(c)
    assert subsets[0] is None  # all of them first
    counts = [len(s) for s in subsets[1:] if s is not None]
    assert counts == sorted({round(len(chosen) * f) for f in SUBSET_SHARES} - {len(chosen)})
    assert all(set(s) <= set(chosen) for s in subsets[1:] if s is not None)
    variant, scratch = compressed(c, 0.5, 1000.0, which=[2, 5])
    assert variant.copy_seconds[2] == 1.0 and variant.copy_seconds[5] == 0.5
    assert variant.copy_seconds[1] == 1.0 and variant.copy_seconds[3] == 1.0  # raw ones
    assert variant.decode_seconds == [0.0, 0.0, 0.2, 0.0, 0.0, 0.1, 0.0, 0.0]
    assert variant.master_bytes == c.master_bytes - 150
    assert scratch == SCRATCH_BUFFERS * 100  # the largest compressed block's payload


def test_decode_rate_sources() -> None:
    offline = machine_for("h100-sxm")
    assert decode_rate(offline, None) == pytest.approx(
        DECODE_SHARE * offline.memory_bandwidth_bytes_per_s)
    times = BlockTimes(calls={}, kinds=0, device="cpu")
    assert decode_rate(offline, times) is None  # measured without a GPU decoder
    assert decode_rate(offline, BlockTimes(calls={}, kinds=0, device="cuda:0",
                                           decode_bytes_per_s=5e11)) == 5e11


def _plan(model: torch.nn.Module, budget: int, **kw: object) -> Plan:
    xs = inputs(device="meta")
    cost = analyze(model, xs, mode="infer", autocast=None)
    return plan(model, xs, budget, mode="infer", headroom=0, cost=cost, autocast=None,
                **kw)  # type: ignore[arg-type]


def _wide(dtype: torch.dtype) -> torch.nn.Module:
    """Six frozen 2048 -> 8192 -> 2048 MLP blocks (64 MiB each in bf16): at a few tokens a
    block's copy takes far longer than its compute."""
    with torch.device("meta"):
        model = Stack(lambda: mlp(2048, 8192), 6, frozen=True).to(dtype)
    return model


def _plan_wide(model: torch.nn.Module, budget: int, **kw: object) -> Plan:
    xs = (torch.empty(1, 4, 2048, device="meta", dtype=next(model.parameters()).dtype),)
    return plan(model, xs, budget, mode="infer", headroom=0, autocast=None, blocks="blocks",
                **kw)  # type: ignore[arg-type]


def test_a_transfer_bound_plan_compresses() -> None:
    # Inference through two slots with room for one more block: raw, one stays resident and
    # five are copied each call; compressed, all six are copied at 0.7x the bytes (the decode
    # scratch takes the resident block's room), each decoded while the next one copies: the
    # faster step.
    tight = _plan_wide(_wide(torch.bfloat16), 230 * MiB, hardware="rtx4090", num_slots=(2,))
    raw = _plan_wide(_wide(torch.bfloat16), 230 * MiB, hardware="rtx4090", num_slots=(2,),
                     compress="off")
    assert len(tight.swapped) == 6 and tight.compress_masters and len(raw.swapped) == 5
    assert tight.predicted_step_seconds < raw.predicted_step_seconds
    scratch = tight.peak_breakdown["compress_scratch"]
    assert scratch == SCRATCH_BUFFERS * int(64 * MiB * EXPECTED_RATIO["bf16"])
    assert tight.predicted_peak_bytes <= 230 * MiB
    # Through one slot the next copy waits for the slot, so each block's decode adds to its
    # copy instead of hiding behind the next one: raw masters are the faster step there.
    assert not _plan_wide(_wide(torch.bfloat16), 230 * MiB, hardware="rtx4090",
                          num_slots=(1,)).compress_masters
    assert "compressed" in tight.explain()
    assert Plan.from_dict(tight.to_dict()).compress_masters
    # fp32 weights are stored raw: nothing to gain
    assert not _plan_wide(_wide(torch.float32), 400 * MiB, hardware="rtx4090").compress_masters
    # compress="off" (what fit_rank asks for node-shared masters, which stay raw): never
    off = _plan_wide(_wide(torch.bfloat16), 230 * MiB, hardware="rtx4090", num_slots=(2,),
                     compress="off")
    assert not off.compress_masters and "compress_scratch" not in off.peak_breakdown
    with pytest.raises(ConfigError, match="compress"):
        _plan_wide(_wide(torch.bfloat16), 160 * MiB, hardware="rtx4090", compress="on")


def test_no_decode_rate_or_no_room_means_raw_masters() -> None:
    model = _wide(torch.bfloat16)
    # a measured machine without a GPU decoder
    times = BlockTimes(calls={}, kinds=0, device="cpu")
    from vramkit.planning.planner import search

    xs = (torch.empty(1, 4, 2048, device="meta", dtype=torch.bfloat16),)
    cost = analyze(model, xs, mode="infer", autocast=None)
    ratio = expected_ratio(list(model.blocks.named_children()))
    offline = search(cost, machine_for("rtx4090"), 230 * MiB, 0, compress_ratio=ratio,
                     num_slots=(2,))
    assert offline.compress_masters
    assert not search(cost, machine_for("rtx4090"), 230 * MiB, 0,
                      num_slots=(2,)).compress_masters
    assert not search(cost, machine_for("rtx4090"), 230 * MiB, 0, compress_ratio=ratio,
                      times=times, num_slots=(2,)).compress_masters  # a CPU calibration
    # room for two slots, not for the scratch beside them
    assert not search(cost, machine_for("rtx4090"), 140 * MiB, 0, compress_ratio=ratio,
                      num_slots=(2,)).compress_masters


def test_fit_applies_a_compressed_plan() -> None:
    import dataclasses

    import vramkit

    model = stack().to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    xs = tuple(x.bfloat16() for x in inputs())
    made = vramkit.plan(_bf16_stack(), xs, 3 * MiB, hardware="rtx4090", headroom=0,
                        autocast=None, mode="infer")
    assert made.swapped
    with vramkit.fit(model, xs, 3 * MiB, plan=dataclasses.replace(made, compress_masters=True),
                     device="cpu", mode="infer") as fitted:
        assert fitted.swapper is not None
        assert fitted.swapper.config.compress == "on"


@pytest.mark.gpu
def test_the_decode_rate_is_measured_on_a_gpu() -> None:
    from vramkit.planning.calibration import measure_decode_rate

    rate = measure_decode_rate(torch.device("cuda"), nbytes=16 << 20)
    assert rate is not None and rate > 1e10
    assert measure_decode_rate(torch.device("cpu")) is None
