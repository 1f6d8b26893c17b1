"""What one LoRA training step of SDXL / FLUX.1-dev keeps on the GPU: the numbers behind the
presets of :mod:`vramkit.recipes.presets`.

The published model configs, the profiles measured from them on the meta device (block
footprints by the swapper's own rule, activations by :func:`vramkit.planning.activations.
estimate_activations`), the breakdown of a preset's peak by them (``config.estimate()``). Which
settings a card gets is the planner's choice: :mod:`vramkit.recipes._preset_plans`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit._validate import (
    check_choice,
    check_size,
)
from vramkit.errors import ConfigError
from vramkit.offload.blocks import unet_blocks as find_unet_blocks
from vramkit.offload.swap import SwapConfig
from vramkit.planning._meta import MetaAutocast, quantize_on_meta
from vramkit.recipes.targets import MODEL_PRESETS
from vramkit.units import format_size

QUANT_FORMATS = ("int8", "int4", "nf4", "fp8")

def unet_blocks(unet: nn.Module) -> list[str]:
    """The UNet's resnet and attention stacks (:func:`vramkit.offload.blocks.unet_blocks`).

    Raises:
        ConfigError: for a model without down/mid/up blocks holding resnets or attentions.
    """
    names = find_unet_blocks(unet)
    if not names:
        raise ConfigError(f"{type(unet).__name__} has no down/mid/up blocks with resnets or "
                          "attentions", hint="Pass a diffusers UNet2DConditionModel.")
    return names


# ------------------------------------------------------------------------------------------
# Memory estimates: what one LoRA training step of SDXL / FLUX.1-dev keeps on the GPU
# ------------------------------------------------------------------------------------------

#: SDXL base 1.0's UNet and FLUX.1-dev's transformer: the planner's model presets'
#: published configs (:data:`vramkit.recipes.targets.MODEL_PRESETS`, sourced there):
#: 2,567,463,684 and 11,901,408,320 parameters.
SDXL_UNET_CONFIG: dict[str, Any] = dict(MODEL_PRESETS["sdxl"].config)
FLUX_DEV_TRANSFORMER_CONFIG: dict[str, Any] = dict(MODEL_PRESETS["flux-dev"].config)

#: The step the estimates describe: LoRA adapters of this rank on these projections (fp32), a
#: bf16 frozen base under bf16 autocast, one IMAGE_SIZE x IMAGE_SIZE image per row (SDXL: 128x128
#: latents and 77 text tokens; Flux: 4096 image and 512 text tokens).
PROFILE_LORA_RANK = 16
PROFILE_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
IMAGE_SIZE = 1024
_TEXT_TOKENS = {"sdxl": 77, "flux": 512}
#: GPU memory a card loses before PyTorch allocates anything (CUDA context, cuBLAS/cuDNN
#: handles, a display): an "8 GB" card is capped at 7.5 GiB in benchmarks/presets.py.
CONTEXT_BYTES = 512 << 20
#: Share of the rest kept free: allocator rounding and fragmentation, and what the meta-device
#: estimate does not see (cuBLAS workspaces, attention-backward buffers, the loss).
MARGIN = 0.10
_STATE_BYTES = {"adamw": 8.0, "adamw8bit": 2 + 8 / 256, "host": 0.0}  # per trainable parameter
_FORMATS = ("bf16", *QUANT_FORMATS)
_MODELS = ("sdxl", "flux")


@dataclass(frozen=True)
class BlockRow:
    """Consecutive swap blocks (in the swapper's order) that take the same bytes.

    Attributes:
        names: the blocks, as :func:`vramkit.offload.blocks.find_blocks` names them.
        swapped: weight format -> bytes of one block's flat master, the block's share of a
            GPU slot (:meth:`BlockSwapper.footprint`, ``.swapped``).
        kept: weight format -> bytes of one block that stay on the GPU even when it is swapped
            (tensors under ``SwapConfig.min_param_bytes``); adapters excluded.
        activations: bytes one block saves for backward without checkpointing.
        inputs: bytes of one block's inputs (what a checkpointed block keeps).
    """

    names: tuple[str, ...]
    swapped: Mapping[str, int]
    kept: Mapping[str, int]
    activations: int
    inputs: int


@dataclass(frozen=True)
class ModelProfile:
    """The bytes of a model that the estimates combine, measured on the meta device by
    :func:`measure_model_profile` (stored below as ``PROFILES``; a test measures them again).

    Attributes:
        model: ``"sdxl"`` (the UNet) or ``"flux"`` (the transformer).
        blocks: the swap blocks, in the swapper's order.
        outside: weight format -> bytes of the frozen weights outside every block.
        adapter_params: parameters of the LoRA adapters.
        activations_outside: activation bytes saved outside every block (embedders, the
            final layers, the loss).
    """

    model: str
    blocks: tuple[BlockRow, ...]
    outside: Mapping[str, int]
    adapter_params: int
    activations_outside: int

    def block_rows(self) -> list[tuple[str, BlockRow]]:
        """``(name, row)`` for every block, in order."""
        return [(name, row) for row in self.blocks for name in row.names]


@dataclass(frozen=True)
class MemoryEstimate:
    """GPU bytes of one LoRA training step under a preset config (``config.estimate()``).

    Attributes:
        model: ``"sdxl"`` or ``"flux"``.
        resident_weights: frozen weights on the GPU: outside the blocks, the resident blocks,
            and the small tensors of the swapped ones.
        swap_slots: the block swapper's ring (R slots of the largest swapped block; 0 without
            swapping).
        swapped_blocks: blocks streamed from pinned host memory, of ``blocks``.
        adapters: LoRA weights and their gradients (fp32).
        optimizer: optimizer states kept on the GPU.
        activations: bytes saved for backward (with checkpointing: every block's input, one
            block's saved tensors while it is recomputed, one block's backward temporaries).
        checkpointing: whether the blocks are checkpointed.
        weight_format: ``"bf16"`` or the frozen base's quantized format.
    """

    model: str
    resident_weights: int
    swap_slots: int
    swapped_blocks: int
    blocks: int
    adapters: int
    optimizer: int
    activations: int
    checkpointing: bool
    weight_format: str

    @property
    def needed(self) -> int:
        """Bytes PyTorch allocates at the step's peak (the sum of the parts)."""
        return (self.resident_weights + self.swap_slots + self.adapters + self.optimizer
                + self.activations)

    @property
    def minimum_vram(self) -> int:
        """The smallest card this fits: ``needed / (1 - MARGIN) + CONTEXT_BYTES``."""
        vram = math.ceil(self.needed / (1 - MARGIN)) + CONTEXT_BYTES
        while self.usable(vram) < self.needed:  # float rounding in usable()
            vram += 1
        return vram

    @staticmethod
    def usable(vram: int) -> int:
        """What a card of ``vram`` bytes leaves for the step: ``(vram - CONTEXT_BYTES) *
        (1 - MARGIN)``."""
        return max(0, int((vram - CONTEXT_BYTES) * (1 - MARGIN)))

    def fits(self, vram: int | str) -> bool:
        """Whether the step fits a card of ``vram`` (bytes or ``"12GB"``)."""
        return self.needed <= self.usable(check_size("vram", vram))

    def describe(self) -> str:
        """The parts in words: ``resident weights 4.8 GiB + ... = 6.9 GiB``."""
        parts = [f"resident weights {format_size(self.resident_weights)} "
                 f"({self.weight_format})"]
        if self.swapped_blocks:
            parts.append(f"swap slots {format_size(self.swap_slots)} "
                         f"({self.swapped_blocks} of {self.blocks} blocks swapped)")
        parts += [f"LoRA weights+grads {format_size(self.adapters)}",
                  f"optimizer states {format_size(self.optimizer)}",
                  f"activations {format_size(self.activations)} "
                  f"({'checkpointed' if self.checkpointing else 'no checkpointing'})"]
        return " + ".join(parts) + f" = {format_size(self.needed)}"

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``needed`` and ``minimum_vram``, JSON-ready."""
        return {**dataclasses.asdict(self), "needed": self.needed,
                "minimum_vram": self.minimum_vram}


def estimate_step(model: str, *, weight_format: str = "bf16", max_gpu_blocks: int | None = None,
              checkpointing: bool = True, batch_size: int = 1,
              optimizer: str = "adamw") -> MemoryEstimate:
    """Combine a stored profile: the swapper's own schedule rule picks the swapped blocks
    (``max_gpu_blocks``: ``None`` = no swapper), the planner's activation rule the activations."""
    from vramkit.offload.swap import BlockSwapper
    from vramkit.planning.activations import ActivationEstimate

    profile = PROFILES[model]
    rows = profile.block_rows()
    swapped: set[str] = set()
    if max_gpu_blocks is not None:
        schedule = BlockSwapper.create_schedule(
            [(name, row.swapped[weight_format]) for name, row in rows],
            max_gpu_blocks=max_gpu_blocks, num_slots=SwapConfig.num_slots)
        swapped = {entry.name for entry in schedule if entry.swapped}
    resident = profile.outside[weight_format] + sum(
        row.kept[weight_format] + (0 if name in swapped else row.swapped[weight_format])
        for name, row in rows)
    largest = max((row.swapped[weight_format] for name, row in rows if name in swapped),
                  default=0)
    saved = ActivationEstimate(per_block={n: r.activations for n, r in rows},
                               inputs={n: r.inputs for n, r in rows},
                               outside=profile.activations_outside)
    activations = saved.checkpointed if checkpointing else saved.full
    return MemoryEstimate(
        model=model, resident_weights=resident, swap_slots=SwapConfig.num_slots * largest,
        swapped_blocks=len(swapped), blocks=len(rows), adapters=profile.adapter_params * 8,
        optimizer=math.ceil(profile.adapter_params * _STATE_BYTES[optimizer]),
        activations=activations * batch_size, checkpointing=checkpointing,
        weight_format=weight_format)


def card_text(vram: int) -> str:
    return f"{format_size(vram, binary=False)} ({format_size(vram)})"


# -- measuring the profiles (diffusers + peft, meta device) ----------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta_model(model: str, config: Mapping[str, Any] | None = None) -> nn.Module:
    """``model`` (``"sdxl"`` or ``"flux"``) on the meta device, from ``config`` (default: the
    published one): bf16 frozen weights, fp32 LoRA adapters of the profiles' rank and targets."""
    try:
        import diffusers
        import peft
    except ImportError as err:
        raise ConfigError(f"measuring a model profile needs diffusers and peft ({err})",
                          hint="pip install diffusers peft") from err
    with torch.device("meta"):
        if model == "sdxl":
            module: nn.Module = diffusers.UNet2DConditionModel(**(config or SDXL_UNET_CONFIG))
        else:
            module = diffusers.FluxTransformer2DModel(
                **(config or FLUX_DEV_TRANSFORMER_CONFIG))
    module.requires_grad_(False)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.bfloat16)
    module.add_adapter(peft.LoraConfig(r=PROFILE_LORA_RANK, lora_alpha=PROFILE_LORA_RANK,
                                       target_modules=list(PROFILE_LORA_TARGETS)))
    for p in module.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.float32)
    return module


def _meta_step(module: nn.Module, model: str) -> torch.Tensor:
    """Forward and loss of one row at IMAGE_SIZE, on meta tensors under bf16 autocast."""
    meta = {"device": "meta", "dtype": torch.bfloat16}
    text = _TEXT_TOKENS[model]
    with MetaAutocast():
        if model == "sdxl":
            side = IMAGE_SIZE // 8  # the VAE's scale factor
            cfg = SDXL_UNET_CONFIG
            pooled = (cfg["projection_class_embeddings_input_dim"]
                      - 6 * cfg["addition_time_embed_dim"])  # 6 time ids, each embedded
            x = torch.empty(1, cfg["in_channels"], side, side, **meta)
            out = module(x, torch.ones(1, device="meta"),
                         encoder_hidden_states=torch.empty(1, text, cfg["cross_attention_dim"],
                                                           **meta),
                         added_cond_kwargs={"text_embeds": torch.empty(1, pooled, **meta),
                                            "time_ids": torch.empty(1, 6, **meta)}).sample
        else:
            cfg = FLUX_DEV_TRANSFORMER_CONFIG
            tokens = (IMAGE_SIZE // 16) ** 2  # VAE /8, then 2x2 patches
            x = torch.empty(1, tokens, cfg["in_channels"], **meta)
            out = module(hidden_states=x,
                         encoder_hidden_states=torch.empty(1, text, cfg["joint_attention_dim"],
                                                           **meta),
                         pooled_projections=torch.empty(1, cfg["pooled_projection_dim"], **meta),
                         timestep=torch.ones(1, device="meta"),
                         img_ids=torch.zeros(tokens, 3, device="meta"),
                         txt_ids=torch.zeros(text, 3, device="meta"),
                         guidance=torch.ones(1, device="meta"), return_dict=False)[0]
        return F.mse_loss(out.float(), x.float())


def _block_names(module: nn.Module, model: str) -> list[str]:
    from vramkit.offload.blocks import find_blocks

    # The blocks the verbs swap: the UNet's resnet/attention stacks, Flux's two block stacks.
    found = find_blocks(module, unet_blocks(module) if model == "sdxl" else "auto")
    return [name for name, _ in found]


def measure_model_profile(model: str) -> ModelProfile:
    """Measure a :class:`ModelProfile` on the meta device (no weights, a few seconds).

    Builds the published config (:data:`SDXL_UNET_CONFIG`, :data:`FLUX_DEV_TRANSFORMER_CONFIG`)
    with LoRA adapters (:data:`PROFILE_LORA_RANK` on :data:`PROFILE_LORA_TARGETS`) and asks the
    swapper's rule (:meth:`BlockSwapper.footprint`, for bf16 and, for Flux, each quantized base
    format) and the activation estimator (:func:`vramkit.planning.activations.estimate_activations`,
    one row at :data:`IMAGE_SIZE` under bf16 autocast). The presets use the stored result.

    Args:
        model: ``"sdxl"`` or ``"flux"``.

    Raises:
        ConfigError: for another name, or without diffusers/peft.
    """
    from vramkit.offload.swap import BlockSwapper
    from vramkit.planning.activations import estimate_activations

    check_choice("model", model, _MODELS)
    base = _meta_model(model)
    names = _block_names(base, model)
    swapped: dict[str, dict[str, int]] = {n: {} for n in names}
    kept: dict[str, dict[str, int]] = {n: {} for n in names}
    outside: dict[str, int] = {}
    for fmt in _FORMATS if model == "flux" else ("bf16",):
        module = base if fmt == "bf16" else quantize_on_meta(copy.deepcopy(base), fmt)
        in_blocks: set[int] = set()
        for name in names:
            block = module.get_submodule(name)
            footprint = BlockSwapper.footprint(block)
            adapters = sum(_nbytes(p) for p in block.parameters() if p.requires_grad)
            swapped[name][fmt] = footprint.swapped
            kept[name][fmt] = footprint.resident - adapters
            in_blocks |= {id(t) for t in (*block.parameters(), *block.buffers())}
        outside[fmt] = sum(_nbytes(t) for t in (*module.parameters(), *module.buffers())
                           if id(t) not in in_blocks and not t.requires_grad)
    saved = estimate_activations(base, lambda: _meta_step(base, model), names)
    rows: list[BlockRow] = []
    for name in names:
        row = BlockRow((name,), swapped[name], kept[name], saved.per_block[name],
                       saved.inputs[name])
        last = rows[-1] if rows else None
        if (last is not None and last.names[-1].rpartition(".")[0] == name.rpartition(".")[0]
                and (last.swapped, last.kept, last.activations, last.inputs)
                == (row.swapped, row.kept, row.activations, row.inputs)):
            rows[-1] = dataclasses.replace(last, names=(*last.names, name))
        else:
            rows.append(row)
    return ModelProfile(model=model, blocks=tuple(rows), outside=outside,
                        adapter_params=sum(p.numel() for p in base.parameters()
                                           if p.requires_grad),
                        activations_outside=saved.outside)

def _names(prefix: str, start: int, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(start, start + count))


def _fmt(*values: int) -> dict[str, int]:
    """Bytes by weight format, in ``_FORMATS`` order (SDXL: bf16 only)."""
    return dict(zip(_FORMATS, values, strict=False))


# Measured by measure_model_profile("sdxl") / ("flux") (diffusers 0.42, peft 0.21, torch 2.13);
# tests/recipes/test_preset_estimates.py measures them again and compares. Bytes; rows are
# (names, swapped by format, kept by format, activations per block, inputs per block).
PROFILES: dict[str, ModelProfile] = {
    "sdxl": ModelProfile(
        model="sdxl", blocks=(
            BlockRow(_names("down_blocks.0.resnets", 0, 1),
                     _fmt(4505600),
                     _fmt(4480),
                     0, 10488320),
            BlockRow(_names("down_blocks.0.resnets", 1, 1),
                     _fmt(4505600),
                     _fmt(4480),
                     0, 10485760),
            BlockRow(_names("down_blocks.1.attentions", 0, 1),
                     _fmt(41615360),
                     _fmt(48640),
                     308682368, 5558272),
            BlockRow(_names("down_blocks.1.attentions", 1, 1),
                     _fmt(41615360),
                     _fmt(48640),
                     329756032, 5242880),
            BlockRow(_names("down_blocks.1.resnets", 0, 1),
                     _fmt(13107200),
                     _fmt(8960),
                     0, 2621440),
            BlockRow(_names("down_blocks.1.resnets", 1, 1),
                     _fmt(16384000),
                     _fmt(8960),
                     52434432, 5242880),
            BlockRow(_names("down_blocks.2.attentions", 0, 2),
                     _fmt(701235200),
                     _fmt(445440),
                     811871616, 2621440),
            BlockRow(_names("down_blocks.2.resnets", 0, 1),
                     _fmt(49152000),
                     _fmt(17920),
                     20979712, 1310720),
            BlockRow(_names("down_blocks.2.resnets", 1, 1),
                     _fmt(62259200),
                     _fmt(17920),
                     26225152, 2621440),
            BlockRow(_names("up_blocks.0.attentions", 0, 3),
                     _fmt(701235200),
                     _fmt(445440),
                     811871616, 2621440),
            BlockRow(_names("up_blocks.0.resnets", 0, 2),
                     _fmt(98304000),
                     _fmt(25600),
                     44580352, 5242880),
            BlockRow(_names("up_blocks.0.resnets", 2, 1),
                     _fmt(81920000),
                     _fmt(23040),
                     36713472, 3932160),
            BlockRow(_names("up_blocks.1.attentions", 0, 3),
                     _fmt(41615360),
                     _fmt(48640),
                     329756032, 5242880),
            BlockRow(_names("up_blocks.1.resnets", 0, 1),
                     _fmt(33587200),
                     _fmt(15360),
                     120596992, 15728640),
            BlockRow(_names("up_blocks.1.resnets", 1, 1),
                     _fmt(25395200),
                     _fmt(12800),
                     89137152, 10485760),
            BlockRow(_names("up_blocks.1.resnets", 2, 1),
                     _fmt(21299200),
                     _fmt(11520),
                     73407232, 7864320),
            BlockRow(_names("up_blocks.2.resnets", 0, 1),
                     _fmt(8806400),
                     _fmt(7680),
                     241178112, 31457280),
            BlockRow(_names("up_blocks.2.resnets", 1, 2),
                     _fmt(6758400),
                     _fmt(6400),
                     178262272, 20971520),
            BlockRow(_names("mid_block.attentions", 0, 1),
                     _fmt(701235200),
                     _fmt(445440),
                     811871616, 2621440),
            BlockRow(_names("mid_block.resnets", 0, 2),
                     _fmt(62259200),
                     _fmt(17920),
                     26225152, 2621440),
        ),
        outside=_fmt(60725768),
        adapter_params=23224320, activations_outside=89654784),
    "flux": ModelProfile(
        model="flux", blocks=(
            BlockRow(_names("transformer_blocks", 0, 1),
                     _fmt(679477248, 350502912, 185942016, 180486144, 339886080),
                     _fmt(185344, 406528, 406528, 351232, 406528),
                     441196544, 33036288),
            BlockRow(_names("transformer_blocks", 1, 18),
                     _fmt(679477248, 350502912, 185942016, 180486144, 339886080),
                     _fmt(185344, 406528, 406528, 351232, 406528),
                     499834880, 28311552),
            BlockRow(_names("single_transformer_blocks", 0, 38),
                     _fmt(283115520, 145981440, 77414400, 75202560, 141557760),
                     _fmt(68096, 203264, 203264, 137216, 203264),
                     427094016, 28311552),
        ),
        outside=_fmt(128249984, 66281856, 35236224, 34142912, 64278912),
        adapter_params=18677760, activations_outside=52467712),
}
