"""Single-file checkpoint layouts mapped, tensor by tensor, onto diffusers' model keys.

Users bring FLUX as Black Forest Labs released it (``double_blocks.0.img_attn.qkv.weight``,
optionally under ComfyUI's ``model.diffusion_model.`` prefix) and SDXL in the original LDM UNet
layout (``model.diffusion_model.input_blocks.1.0.in_layers.0.weight``). diffusers' converters
(``convert_flux_transformer_checkpoint_to_diffusers``, ``convert_ldm_unet_checkpoint``) work on
a whole state dict in memory; here the same mapping is a list of :class:`Piece` records, one per
diffusers key: which source tensor and which rows of it. Every fused tensor diffusers splits is
split along its first dimension (FLUX's ``qkv`` into ``to_q/to_k/to_v``, the single blocks'
``linear1`` into ``to_q/to_k/to_v/proj_mlp``), so each piece is a contiguous byte range of the
file, in any storage format whose rows are whole (bf16, fp8, GGUF blocks): tensors stream into
the model with each source byte read once. The one piece that is not a range, FLUX's final
``adaLN_modulation`` (diffusers wants its two halves swapped), is marked ``swap_halves``.

Nothing here imports torch: the maps work on names and shapes, so ``vramkit inspect`` can name
a file's layout. :func:`original_names` is the inverse (diffusers key -> source rows), which
the tests use to write tiny checkpoints in the original layouts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["FLUX", "LDM_PREFIX", "SDXL", "Piece", "detect_layout", "layout_pieces",
           "original_names"]

FLUX = "flux"
SDXL = "sdxl"
LDM_PREFIX = "model.diffusion_model."  # ComfyUI's and the LDM checkpoints' model prefix


@dataclass(frozen=True)
class Piece:
    """Where one diffusers tensor comes from.

    Args:
        target: the diffusers state-dict key.
        source: the file's tensor name.
        row0: first row (first-dimension index) of the source taken.
        row1: one past the last row taken.
        swap_halves: the target is the source with its two halves (along rows) swapped.
    """

    target: str
    source: str
    row0: int
    row1: int
    swap_halves: bool = False


def detect_layout(names: Sequence[str]) -> tuple[str, str] | None:
    """The single-file layout a list of tensor names is in: ``(kind, prefix)`` with ``kind``
    :data:`FLUX` or :data:`SDXL` and ``prefix`` the prefix the model's names carry (``""`` or
    :data:`LDM_PREFIX`); ``None`` for any other layout (diffusers' own, or unknown)."""
    present = set(names)
    for prefix in ("", LDM_PREFIX):
        if f"{prefix}double_blocks.0.img_attn.qkv.weight" in present:
            return FLUX, prefix
    for prefix in (LDM_PREFIX, ""):  # bare: a UNet saved alone (ComfyUI-GGUF's unet files)
        if f"{prefix}input_blocks.0.0.weight" in present and any(
                n.startswith(f"{prefix}middle_block.") for n in present):
            return SDXL, prefix
    return None


# -- FLUX ----------------------------------------------------------------------------------

# (source pattern, target patterns) for tensors renamed whole; {i} is a block index.
_FLUX_RENAMES: tuple[tuple[str, str], ...] = (
    ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
    ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
    ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
    ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
    ("txt_in", "context_embedder"),
    ("img_in", "x_embedder"),
    ("final_layer.linear", "proj_out"),
    ("double_blocks.{i}.img_mod.lin", "transformer_blocks.{i}.norm1.linear"),
    ("double_blocks.{i}.txt_mod.lin", "transformer_blocks.{i}.norm1_context.linear"),
    ("double_blocks.{i}.img_mlp.0", "transformer_blocks.{i}.ff.net.0.proj"),
    ("double_blocks.{i}.img_mlp.2", "transformer_blocks.{i}.ff.net.2"),
    ("double_blocks.{i}.txt_mlp.0", "transformer_blocks.{i}.ff_context.net.0.proj"),
    ("double_blocks.{i}.txt_mlp.2", "transformer_blocks.{i}.ff_context.net.2"),
    ("double_blocks.{i}.img_attn.proj", "transformer_blocks.{i}.attn.to_out.0"),
    ("double_blocks.{i}.txt_attn.proj", "transformer_blocks.{i}.attn.to_add_out"),
    ("single_blocks.{i}.modulation.lin", "single_transformer_blocks.{i}.norm.linear"),
    ("single_blocks.{i}.linear2", "single_transformer_blocks.{i}.proj_out"),
)
# qk-norm scales: the full names (no .weight/.bias suffix in the source).
_FLUX_NORMS: tuple[tuple[str, str], ...] = (
    ("double_blocks.{i}.img_attn.norm.query_norm.scale", "transformer_blocks.{i}.attn.norm_q.weight"),
    ("double_blocks.{i}.img_attn.norm.key_norm.scale", "transformer_blocks.{i}.attn.norm_k.weight"),
    ("double_blocks.{i}.txt_attn.norm.query_norm.scale",
     "transformer_blocks.{i}.attn.norm_added_q.weight"),
    ("double_blocks.{i}.txt_attn.norm.key_norm.scale",
     "transformer_blocks.{i}.attn.norm_added_k.weight"),
    ("single_blocks.{i}.norm.query_norm.scale", "single_transformer_blocks.{i}.attn.norm_q.weight"),
    ("single_blocks.{i}.norm.key_norm.scale", "single_transformer_blocks.{i}.attn.norm_k.weight"),
)
# Fused projections split along rows: (source, targets in row order, split rule).
_FLUX_SPLITS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("double_blocks.{i}.img_attn.qkv", ("transformer_blocks.{i}.attn.to_q",
                                        "transformer_blocks.{i}.attn.to_k",
                                        "transformer_blocks.{i}.attn.to_v"), "thirds"),
    ("double_blocks.{i}.txt_attn.qkv", ("transformer_blocks.{i}.attn.add_q_proj",
                                        "transformer_blocks.{i}.attn.add_k_proj",
                                        "transformer_blocks.{i}.attn.add_v_proj"), "thirds"),
    ("single_blocks.{i}.linear1", ("single_transformer_blocks.{i}.attn.to_q",
                                   "single_transformer_blocks.{i}.attn.to_k",
                                   "single_transformer_blocks.{i}.attn.to_v",
                                   "single_transformer_blocks.{i}.proj_mlp"), "qkv+mlp"),
)
_SWAPPED = ("final_layer.adaLN_modulation.1", "norm_out.linear")


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_FLUX_RULES: list[tuple[re.Pattern[str], tuple[str, ...], str]] = []
for _src, _dst in _FLUX_RENAMES:
    for _p in ("weight", "bias"):
        _FLUX_RULES.append((_regex(f"{_src}.{_p}"), (f"{_dst}.{_p}",), "whole"))
for _src, _dst in _FLUX_NORMS:
    _FLUX_RULES.append((_regex(_src), (_dst,), "whole"))
for _src, _dsts, _rule in _FLUX_SPLITS:
    for _p in ("weight", "bias"):
        _FLUX_RULES.append((_regex(f"{_src}.{_p}"), tuple(f"{d}.{_p}" for d in _dsts), _rule))
for _p in ("weight", "bias"):
    _FLUX_RULES.append((_regex(f"{_SWAPPED[0]}.{_p}"), (f"{_SWAPPED[1]}.{_p}",), "swap"))


def _split_rows(rule: str, rows: int, hidden: int, count: int) -> list[int]:
    if rule == "thirds":
        return [rows // 3] * 3
    if rule == "qkv+mlp":
        return [hidden, hidden, hidden, rows - 3 * hidden]
    return [rows] * count


def _flux_pieces(shapes: Mapping[str, Sequence[int]], prefix: str) -> tuple[list[Piece], list[str]]:
    hidden_shape = shapes.get(f"{prefix}img_in.weight")
    hidden = int(hidden_shape[0]) if hidden_shape else 0
    pieces: list[Piece] = []
    unmatched: list[str] = []
    for name, shape in shapes.items():
        if not name.startswith(prefix):
            continue  # another component of a full checkpoint (text encoders, VAE)
        key = name[len(prefix):]
        for pattern, targets, rule in _FLUX_RULES:
            found = pattern.match(key)
            if found is None:
                continue
            i = found.groupdict().get("i")
            rows = int(shape[0]) if shape else 1
            row0 = 0
            for target, size in zip(targets, _split_rows(rule, rows, hidden, len(targets)),
                                    strict=True):
                pieces.append(Piece(target.replace("{i}", i or ""), name, row0, row0 + size,
                                    swap_halves=rule == "swap"))
                row0 += size
            break
        else:
            unmatched.append(name)
    return pieces, unmatched


def _flux_original(targets: Mapping[str, Sequence[int]]) -> dict[str, list[tuple[str, bool]]]:
    """diffusers FLUX keys -> original names: source -> [(target, swap_halves)] in row order."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for target in targets:
        for pattern, dsts, rule in _FLUX_RULES:
            for position, dst in enumerate(dsts):
                found = _regex(dst).match(target)
                if found is None:
                    continue
                src = _pattern_source(pattern).replace("{i}", found.groupdict().get("i") or "")
                slots = out.setdefault(src, [("", False)] * len(dsts))
                slots[position] = (target, rule == "swap")
    return out


def _pattern_source(pattern: re.Pattern[str]) -> str:
    text = pattern.pattern.removesuffix("$").replace(r"(?P<i>\d+)", "{i}")
    return re.sub(r"\\(.)", r"\1", text)


# -- SDXL (LDM UNet) -------------------------------------------------------------------------

_LDM_FIXED = {
    "time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
    "label_emb.0.0": "add_embedding.linear_1", "label_emb.0.2": "add_embedding.linear_2",
    "input_blocks.0.0": "conv_in", "out.0": "conv_norm_out", "out.2": "conv_out",
}
_RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "out_layers.0": "norm2",
           "out_layers.3": "conv2", "emb_layers.1": "time_emb_proj",
           "skip_connection": "conv_shortcut"}
_LDM_BLOCK = re.compile(r"(input_blocks|middle_block|output_blocks)\.(\d+)\.(?:(\d+)\.)?(.+)$")


def _layers_per_block(keys: Sequence[str]) -> int:
    """LDM input blocks come in levels of ``L`` resnets (+ attentions) and one downsampler;
    the first downsampler's index is ``L + 1``."""
    downs = [int(m.group(1)) for k in keys
             if (m := re.match(r"input_blocks\.(\d+)\.0\.op\.", k))]
    if downs:
        return min(downs) - 1
    blocks = [int(m.group(1)) for k in keys if (m := re.match(r"input_blocks\.(\d+)\.", k))]
    return max(blocks, default=1)


def _resnet(rest: str) -> str:
    for old, new in _RESNET.items():
        if rest.startswith(old + "."):
            return new + rest[len(old):]
    return rest


def _ldm_target(key: str, per_block: int) -> str | None:
    head, _, param = key.rpartition(".")
    if head in _LDM_FIXED:
        return f"{_LDM_FIXED[head]}.{param}"
    found = _LDM_BLOCK.match(key)
    if found is None:
        return None
    kind, index, sub, rest = found.group(1), int(found.group(2)), found.group(3), found.group(4)
    if kind == "middle_block":
        # middle_block.0 / .2 are resnets 0 / 1, middle_block.1 the attention.
        if sub is not None:
            rest = f"{sub}.{rest}"
        if index % 2:
            return f"mid_block.attentions.0.{rest}"
        return f"mid_block.resnets.{index // 2}.{_resnet(rest)}"
    if sub is None:
        return None
    j = int(sub)
    if kind == "input_blocks":
        block, layer = divmod(index - 1, per_block + 1)
        if j == 0 and rest.startswith("op."):
            return f"down_blocks.{block}.downsamplers.0.conv.{rest[3:]}"
        if j == 0:
            return f"down_blocks.{block}.resnets.{layer}.{_resnet(rest)}"
        return f"down_blocks.{block}.attentions.{layer}.{rest}" if j == 1 else None
    block, layer = divmod(index, per_block + 1)
    if j == 0:
        return f"up_blocks.{block}.resnets.{layer}.{_resnet(rest)}"
    if rest.startswith("conv."):
        return f"up_blocks.{block}.upsamplers.0.conv.{rest[5:]}"
    return f"up_blocks.{block}.attentions.{layer}.{rest}" if j == 1 else None


def _sdxl_pieces(shapes: Mapping[str, Sequence[int]], prefix: str) -> tuple[list[Piece], list[str]]:
    keys = [n[len(prefix):] for n in shapes if n.startswith(prefix)]
    per_block = _layers_per_block(keys)
    pieces: list[Piece] = []
    unmatched: list[str] = []
    for name, shape in shapes.items():
        if not name.startswith(prefix):
            continue  # the VAE and text encoders of a full checkpoint
        target = _ldm_target(name[len(prefix):], per_block)
        if target is None:
            unmatched.append(name)
            continue
        rows = int(shape[0]) if shape else 1
        pieces.append(Piece(target, name, 0, rows))
    return pieces, unmatched


def layout_pieces(kind: str, shapes: Mapping[str, Sequence[int]], prefix: str
                  ) -> tuple[list[Piece], list[str]]:
    """Map a single-file checkpoint's tensors onto diffusers keys.

    Args:
        kind: :data:`FLUX` or :data:`SDXL` (from :func:`detect_layout`).
        shapes: every tensor name of the file -> its shape (in file order).
        prefix: the model's prefix (names without it belong to other components and are left
            out).

    Returns:
        ``(pieces, unmatched)``: one :class:`Piece` per diffusers tensor, in the file's order,
        and the names under ``prefix`` no rule maps.
    """
    if kind == FLUX:
        return _flux_pieces(shapes, prefix)
    if kind == SDXL:
        return _sdxl_pieces(shapes, prefix)
    raise ValueError(f"unknown single-file layout {kind!r}")


def original_names(kind: str, targets: Mapping[str, Sequence[int]], *, per_block: int = 2,
                   prefix: str = "") -> dict[str, list[tuple[str, bool]]]:
    """The inverse map: diffusers keys -> the original layout's tensors.

    Args:
        kind: :data:`FLUX` or :data:`SDXL`.
        targets: diffusers state-dict keys -> shapes.
        per_block: SDXL's ``layers_per_block``.
        prefix: prepended to every original name (e.g. :data:`LDM_PREFIX`).

    Returns:
        original name -> ``[(diffusers key, swap_halves), ...]``: concatenated along rows in
        this order (halves swapped where marked), they form the original tensor.
    """
    if kind == FLUX:
        out = _flux_original(targets)
    elif kind == SDXL:
        out = {}
        for target in targets:
            source = _ldm_source(target, per_block, targets)
            if source is not None:
                out[source] = [(target, False)]
    else:
        raise ValueError(f"unknown single-file layout {kind!r}")
    return {prefix + name: parts for name, parts in out.items()}


def _ldm_source(target: str, per_block: int, targets: Mapping[str, object]) -> str | None:
    reverse_fixed = {new: old for old, new in _LDM_FIXED.items()}
    reverse_resnet = {new: old for old, new in _RESNET.items()}
    head, _, param = target.rpartition(".")
    if head in reverse_fixed:
        return f"{reverse_fixed[head]}.{param}"

    def resnet(rest: str) -> str:
        first, _, tail = rest.partition(".")
        return f"{reverse_resnet.get(first, first)}.{tail}"

    found = re.match(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)"
                     r"\.(\d+)\.(.+)$", target)
    if found is not None:
        side, block, part, layer, rest = (found.group(1), int(found.group(2)), found.group(3),
                                          int(found.group(4)), found.group(5))
        step = per_block + 1
        if side == "down":
            if part == "downsamplers":
                return f"input_blocks.{block * step + per_block + 1}.0.op.{rest.removeprefix('conv.')}"
            index = block * step + layer + 1
            return (f"input_blocks.{index}.0.{resnet(rest)}" if part == "resnets"
                    else f"input_blocks.{index}.1.{rest}")
        if part == "upsamplers":
            index = block * step + per_block
            has_attention = any(k.startswith(f"up_blocks.{block}.attentions.") for k in targets)
            return f"output_blocks.{index}.{2 if has_attention else 1}.{rest}"
        index = block * step + layer
        return (f"output_blocks.{index}.0.{resnet(rest)}" if part == "resnets"
                else f"output_blocks.{index}.1.{rest}")
    found = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", target)
    if found is not None:
        part, layer, rest = found.group(1), int(found.group(2)), found.group(3)
        if part == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * layer}.{resnet(rest)}"
    return None
