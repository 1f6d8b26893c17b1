"""Single-file layouts (BFL FLUX, ComfyUI prefixes, LDM SDXL) mapped onto diffusers keys,
checked against diffusers' own whole-state-dict converters."""

from __future__ import annotations

import types

import pytest
import torch

from tests.io._single_files import tiny_flux, tiny_sdxl, to_original
from vramkit.io._single_file import FLUX, LDM_PREFIX, SDXL, detect_layout, layout_pieces

pytest.importorskip("diffusers")


def _apply(pieces, original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for p in pieces:
        t = original[p.source][p.row0:p.row1]
        if p.swap_halves:
            half = t.shape[0] // 2
            t = torch.cat([t[half:], t[:half]])
        out[p.target] = t
    return out


def _diffusers_flux(original: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """diffusers' FLUX converter, its single-block split widths (fixed to the 12B model's 3072)
    taken from the tiny model."""
    from diffusers.loaders import single_file_utils as sfu

    def split(tensor, sizes, dim=0):
        if tuple(sizes) == (3072, 3072, 3072, 12288):
            sizes = (hidden, hidden, hidden, tensor.shape[0] - 3 * hidden)
        return torch.split(tensor, sizes, dim)

    shim = types.SimpleNamespace(**{n: getattr(torch, n) for n in ("chunk", "cat")}, split=split)
    saved = sfu.torch
    sfu.torch = shim
    try:
        return sfu.convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    finally:
        sfu.torch = saved


@pytest.mark.parametrize("prefix", ["", LDM_PREFIX])
def test_flux_pieces_match_diffusers_converter(prefix: str) -> None:
    model = tiny_flux()
    state = model.state_dict()
    original = to_original(FLUX, state, prefix=prefix)
    assert f"{prefix}double_blocks.0.img_attn.qkv.weight" in original
    assert f"{prefix}single_blocks.1.linear1.weight" in original
    assert detect_layout(list(original)) == (FLUX, prefix)
    pieces, unmatched = layout_pieces(FLUX, {k: v.shape for k, v in original.items()}, prefix)
    assert unmatched == []
    ours = _apply(pieces, original)
    theirs = _diffusers_flux(original, model.inner_dim)
    assert set(ours) == set(theirs) == set(state)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
        assert torch.equal(ours[key], state[key]), key


def test_sdxl_pieces_match_diffusers_converter() -> None:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    model = tiny_sdxl()
    state = model.state_dict()
    original = to_original(SDXL, state, prefix=LDM_PREFIX)
    original["first_stage_model.decoder.conv_in.weight"] = torch.zeros(1)  # another component
    assert detect_layout(list(original)) == (SDXL, LDM_PREFIX)
    pieces, unmatched = layout_pieces(SDXL, {k: v.shape for k, v in original.items()}, LDM_PREFIX)
    assert unmatched == []
    ours = _apply(pieces, original)
    theirs = convert_ldm_unet_checkpoint(dict(original), dict(model.config))
    assert set(ours) == set(theirs) == set(state)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_other_layouts_are_not_detected() -> None:
    assert detect_layout(["transformer_blocks.0.attn.to_q.weight"]) is None
    assert detect_layout(["input_blocks.0.0.weight"]) is None  # no middle block: not a UNet
    assert detect_layout(["input_blocks.0.0.weight", "middle_block.0.x"]) == (SDXL, "")
