"""Long sequences: a tiny Wan-shaped video transformer at thousands of tokens, where a block's
temporaries, not its weights, set the peak. The planner's choice fits its budget, chunking the
feed-forward layers lowers the least budget, and the fitted model trains exactly as built."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import vramkit
from tests.planning._models import video_inputs, video_model, video_parts_model
from vramkit.errors import PlanError
from vramkit.offload.chunked import is_chunked
from vramkit.offload.subblock import is_part_checkpointed

FRAMES, HEIGHT, WIDTH = 6, 24, 40  # 6 x 12 x 20 = 1440 video tokens


def _plan(budget: int, model=None, **kw):  # type: ignore[no-untyped-def]
    model = model if model is not None else video_model(device="meta")
    return vramkit.plan(model, video_inputs(FRAMES, HEIGHT, WIDTH, device="meta"), budget,
                        hardware="rtx4090", headroom=0, autocast=None, **kw)


def _minimum(**kw) -> int:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError) as info:
        _plan(1, **kw)
    assert info.value.minimum_budget is not None
    return info.value.minimum_budget


def test_activations_not_weights_set_the_peak_and_the_plan_fits() -> None:
    need = _minimum()
    p = _plan(need)
    assert p.predicted_peak_bytes <= need
    weights = sum(t.numel() * t.element_size() for t in video_model(device="meta").parameters())
    assert p.peak_breakdown["activations"] > 5 * weights  # a video step: memory is activations
    assert len(p.checkpointed) == len(p.block_order)  # the least budget checkpoints every block


def test_chunked_feed_forwards_lower_the_least_budget_and_leave_the_model_as_it_was() -> None:
    model = video_model(device="meta")
    plain, chunked = _minimum(), _minimum(ffn_chunks=4)
    assert chunked < plain
    p = _plan(plain, model=model, ffn_chunks=4)
    assert p.ffn_chunks == 4 and "feed-forward layer over 4 slices" in p.explain()
    assert not any(is_chunked(m) for m in model.modules())  # the meta model given: untouched


def test_a_fitted_chunked_plan_trains_exactly_as_built() -> None:
    xs = video_inputs(FRAMES, HEIGHT, WIDTH)
    need = _minimum(ffn_chunks=4)
    p = _plan(need, ffn_chunks=4)
    ref, model = video_model(), video_model()
    with sdpa_kernel(SDPBackend.MATH):
        ref(*xs).square().mean().backward()
        fitted = vramkit.fit(model, xs, need, plan=p, device="cpu")
        try:
            assert all(is_chunked(model.get_submodule(f"{n}.ffn")) for n in p.block_order)
            model(*xs).square().mean().backward()
        finally:
            fitted.detach()
    assert not any(is_chunked(m) for m in model.modules())
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad), name


def test_subblock_checkpointing_lowers_the_least_budget_and_auto_takes_it_only_there() -> None:
    def least(**kw):  # type: ignore[no-untyped-def]
        return _minimum(model=video_parts_model(), **kw)

    plain, parts = least(subblock_checkpoint=False), least(subblock_checkpoint=True)
    assert parts < plain
    assert least() == parts  # "auto": the least budget reached either way
    with pytest.raises(PlanError, match="sub-block checkpointing"):  # and says how
        _plan(1, model=video_parts_model())
    model = video_parts_model()
    p = _plan(parts, model=model)  # fits only with the parts checkpointed
    assert p.subblock_checkpoint and "sub-block checkpointing" in p.explain()
    assert not any(is_part_checkpointed(m) for m in model.modules())  # the model given: as is
    roomy = _plan(plain, model=video_parts_model())
    off = _plan(plain, model=video_parts_model(), subblock_checkpoint=False)
    assert not roomy.subblock_checkpoint
    assert roomy.to_dict() == off.to_dict()  # where it fits as built: the same plan


def test_a_fitted_subblock_plan_trains_as_the_block_checkpoint_does() -> None:
    xs = video_inputs(FRAMES, HEIGHT, WIDTH)
    p = _plan(10 * _minimum(model=video_parts_model()), model=video_parts_model(),
              subblock_checkpoint=True, checkpointing="all")
    assert p.subblock_checkpoint
    ref, model = video_parts_model(device="cpu"), video_parts_model(device="cpu")
    vramkit.offload.enable_gradient_checkpointing(ref, list(p.checkpointed))
    with sdpa_kernel(SDPBackend.MATH):
        ref(*xs).square().mean().backward()
        fitted = vramkit.fit(model, xs, p.budget_bytes, plan=p, device="cpu")
        try:
            assert all(is_part_checkpointed(model.get_submodule(f"{n}.{part}"))
                       for n in p.block_order for part in ("attn1", "ffn"))
            model(*xs).square().mean().backward()
        finally:
            fitted.detach()
    assert not any(is_part_checkpointed(m) for m in model.modules())
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad), name
