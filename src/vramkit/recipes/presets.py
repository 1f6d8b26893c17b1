"""Memory presets for diffusion models: SDXL and Flux LoRA training on 8, 12, 16 and 24 GB cards.

Two frozen configs and one verb each:

* :class:`SDXLMemoryConfig` + :func:`optimize_sdxl_memory` (a diffusers SDXL pipeline, or its
  ``unet`` / ``vae`` given as a mapping or as modules): gradient checkpointing of the UNet's
  resnet and attention blocks (:func:`vramkit.offload.checkpointing.enable_gradient_checkpointing`),
  attention slicing (diffusers' ``set_attention_slice``), VAE tiling
  (:class:`vramkit.tiling.VAETiling` attached to the VAE) and CPU offload of the UNet's blocks
  through the block swapper (:class:`vramkit.offload.swap.BlockSwapper`).
* :class:`FluxTrainingConfig` + :func:`optimize_flux_memory` (a ``FluxTransformer2DModel``,
  usually with LoRA adapters, or a pipeline holding one as ``transformer``): bf16 frozen
  weights with autocast, a quantized frozen base (:func:`vramkit.quant.model.quantize_model`),
  gradient checkpointing, block swapping, an 8-bit AdamW (:class:`vramkit.optim.AdamW8bit`) and
  a CPU-offloaded optimizer (:class:`vramkit.offload.optimizer.CPUOffloadOptimizer`); training
  steps run through :class:`vramkit.observe.recovery.MemoryRecovery` at ``batch_size`` rows per
  micro-batch.

Both verbs return a :class:`MemoryOptimization` handle that says what was applied and undoes
what can be undone (:meth:`MemoryOptimization.undo`).

Presets (``preset_8gb()`` ... ``preset_24gb()``, ``for_vram``) are plans: each tier's memory
settings (swapped blocks, checkpointing) are what :func:`vramkit.planning.planner.search` chooses
for one LoRA training step at 1024x1024 of the published SDXL / FLUX.1-dev model, built and
analyzed on the meta device as ``vramkit plan`` does, for the tier's card on an offline
RTX 4090 profile, with the preset's own choices applied (Flux's int8 base, 8-bit AdamW);
:mod:`vramkit.recipes._preset_plans` holds the rule and the stored table a test recomputes.
A config given a ``vram`` whose plan does not fit it raises when it is made; ``config.plan()``
is the planner's plan of its settings. :meth:`SDXLMemoryConfig.estimate` /
:meth:`FluxTrainingConfig.estimate` remain a breakdown by the stored block profiles
(:func:`measure_model_profile`), shown beside the measured peaks of benchmarks/presets.py; no
preset or check is decided by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramkit._validate import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_number,
    check_size,
)
from vramkit.errors import ConfigError
from vramkit.offload.swap import SwapConfig
from vramkit.planning._meta import trainable_module_names
from vramkit.recipes._preset_handle import MemoryOptimization
from vramkit.recipes._preset_memory import (
    FLUX_DEV_TRANSFORMER_CONFIG,
    IMAGE_SIZE,
    PROFILES,
    QUANT_FORMATS,
    SDXL_UNET_CONFIG,
    BlockRow,
    MemoryEstimate,
    ModelProfile,
    card_text,
    estimate_step,
    measure_model_profile,
    unet_blocks,
)
from vramkit.recipes._preset_plans import (
    Setting,
    check_fits,
    for_vram,
    price,
    room,
    tier,
    tier_vram,
)
from vramkit.units import format_size

__all__ = [
    "FLUX_DEV_TRANSFORMER_CONFIG",
    "SDXL_UNET_CONFIG",
    "BlockRow",
    "FluxTrainingConfig",
    "MemoryEstimate",
    "MemoryOptimization",
    "ModelProfile",
    "SDXLMemoryConfig",
    "measure_model_profile",
    "optimize_flux_memory",
    "optimize_sdxl_memory",
    "unet_blocks",
]

_SLICE_NAMES = ("auto", "max")
_MIXED_PRECISION = ("bf16", "no")
# Compute devices the verbs take: those MemoryRecovery runs training steps on.
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


# ------------------------------------------------------------------------------------------
# SDXL
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SDXLMemoryConfig:
    """Memory options for SDXL (seed ``SDXLMemoryConfig``).

    Args:
        enable_cpu_offload: keep the UNet's blocks in pinned host memory and stream them to the
            GPU (block swapping), all but ``offload_resident_blocks`` of them. Frozen weights
            are swapped; trainable ones (LoRA adapters) stay on the GPU. Default False.
        enable_gradient_checkpointing: recompute the UNet's resnet/attention blocks in
            backward instead of keeping their activations. Default False.
        enable_attention_slicing: compute attention in slices (diffusers'
            ``SlicedAttnProcessor``). Default False: PyTorch's SDPA already avoids the full
            attention matrix on GPUs, so slicing mostly helps where SDPA falls back to the math
            kernel.
        attention_slice_size: ``"auto"`` (half the heads per slice), ``"max"`` (one slice per
            head) or an int (heads per slice). Only with slicing; default ``None`` = ``"auto"``.
        vae_tiling: decode/encode the VAE in tiles (:class:`vramkit.tiling.VAETiling`).
            Default False.
        vae_tile_size: tile side in image pixels, a multiple of 8 (default 512).
        vae_tile_overlap: pixels shared by neighbouring tiles, a multiple of 8 below the tile
            size (default 64).
        offload_resident_blocks: with CPU offload, UNet blocks kept on the GPU (default 0).
        vram: the card these settings are for (bytes or ``"12GB"``; default ``None``: no
            check). When set, the planner's peak for these settings (:meth:`plan`) must fit
            the card less its CUDA context and the planner's headroom, or construction raises
            with the numbers. The plan is of one LoRA training step of SDXL's UNet (bf16
            weights, rank-16 fp32 adapters on the attention projections, AdamW, bf16
            autocast) at 1024x1024, batch 1; attention slicing is not modelled.

    Raises:
        ConfigError: for invalid values or combinations, or settings that do not fit ``vram``.
    """

    enable_cpu_offload: bool = False
    enable_gradient_checkpointing: bool = False
    enable_attention_slicing: bool = False
    attention_slice_size: int | str | None = None
    vae_tiling: bool = False
    vae_tile_size: int = 512
    vae_tile_overlap: int = 64
    offload_resident_blocks: int = 0
    vram: int | str | None = None

    def __post_init__(self) -> None:
        owner = "SDXLMemoryConfig"
        for name in ("enable_cpu_offload", "enable_gradient_checkpointing",
                     "enable_attention_slicing", "vae_tiling"):
            check_bool(f"{owner}.{name}", getattr(self, name))
        size = self.attention_slice_size
        if size is not None:
            if not self.enable_attention_slicing:
                raise ConfigError("attention_slice_size is set but enable_attention_slicing is "
                                  "False", hint="Enable slicing, or leave the size at None.")
            hint = "Give 'auto', 'max' or a number of heads per slice >= 1."
            if isinstance(size, str):
                check_choice(f"{owner}.attention_slice_size", size, _SLICE_NAMES, hint=hint)
            else:
                check_int(f"{owner}.attention_slice_size", size, minimum=1, hint=hint)
        check_int(f"{owner}.vae_tile_size", self.vae_tile_size, minimum=64)
        check_int(f"{owner}.vae_tile_overlap", self.vae_tile_overlap, minimum=0)
        if self.vae_tile_size % 8 or self.vae_tile_overlap % 8:
            raise ConfigError("vae_tile_size and vae_tile_overlap must be multiples of 8 (the "
                              "SDXL VAE's scale factor)",
                              hint="Round vae_tile_size and vae_tile_overlap to multiples of 8, "
                                   "e.g. 512 and 64.")
        if self.vae_tile_overlap >= self.vae_tile_size:
            raise ConfigError("vae_tile_overlap must be smaller than vae_tile_size",
                              hint="Use an overlap well under the tile size, e.g. "
                                   "vae_tile_size=512 with vae_tile_overlap=64.")
        check_int(f"{owner}.offload_resident_blocks", self.offload_resident_blocks, minimum=0)
        object.__setattr__(self, "vram", check_size(f"{owner}.vram", self.vram,
                                                    allow_none=True))
        if self.vram is not None:
            check_fits("SDXL", self._setting(), self.vram, lambda: _sdxl_hint(self.vram))

    def _setting(self) -> Setting:
        blocks = len(PROFILES["sdxl"].block_rows())
        swapped = (blocks - min(self.offload_resident_blocks, blocks)
                   if self.enable_cpu_offload else 0)
        return Setting("sdxl", checkpointing=self.enable_gradient_checkpointing,
                       swapped=swapped)

    def plan(self, vram: int | str | None = None) -> Any:
        """The planner's :class:`~vramkit.planning.record.Plan` of these settings on a card of
        ``vram`` (default: this config's ``vram``): predicted peak and step, ``explain()``.
        Builds and analyzes the UNet on the meta device the first time (diffusers, peft)."""
        return price(self._setting(), _card(vram if vram is not None else self.vram))

    def estimate(self) -> MemoryEstimate:
        """GPU bytes of one SDXL LoRA training step at 1024x1024 with these settings (see
        ``vram``), from the UNet's stored :class:`ModelProfile`."""
        return estimate_step("sdxl", checkpointing=self.enable_gradient_checkpointing,
                         max_gpu_blocks=(self.offload_resident_blocks
                                         if self.enable_cpu_offload else None))

    # The tiers' settings are the planner's (vramkit.recipes._preset_plans): the fastest plan
    # for the card's decimal size.

    @classmethod
    def preset_24gb(cls) -> SDXLMemoryConfig:
        """SDXL LoRA on a 24 GB card: the UNet resident, no checkpointing, VAE tiling."""
        return cls._tier(24)

    @classmethod
    def preset_16gb(cls) -> SDXLMemoryConfig:
        """SDXL LoRA on a 16 GB card: the UNet resident, no checkpointing."""
        return cls._tier(16)

    @classmethod
    def preset_12gb(cls) -> SDXLMemoryConfig:
        """SDXL LoRA on a 12 GB card: no checkpointing, 13 of the UNet's 28 blocks swapped."""
        return cls._tier(12)

    @classmethod
    def preset_8gb(cls) -> SDXLMemoryConfig:
        """SDXL LoRA on an 8 GB card: the UNet resident, gradient checkpointing."""
        return cls._tier(8)

    @classmethod
    def _tier(cls, gigabytes: int) -> SDXLMemoryConfig:
        s = tier("sdxl", gigabytes).setting
        blocks = len(PROFILES["sdxl"].block_rows())
        return cls(enable_gradient_checkpointing=s.checkpointing,
                   enable_cpu_offload=s.swapped > 0,
                   offload_resident_blocks=blocks - s.swapped if s.swapped else 0,
                   vae_tiling=True, vae_tile_size=512, vram=tier_vram(gigabytes))

    @classmethod
    def for_vram(cls, vram: int | str) -> SDXLMemoryConfig:
        """The largest preset whose planned peak fits a card of ``vram`` (``"12GB"``,
        ``"16GiB"``, bytes).

        Raises:
            ConfigError: when even :meth:`preset_8gb` does not fit (the message gives the
                smallest card it fits).
        """
        return for_vram(cls, vram, "SDXL")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


def _card(vram: int | str | None) -> int:
    if vram is None:
        raise ConfigError("plan() needs a card: this config has no vram",
                          hint="Pass plan(vram='12GB'), or set the config's vram.")
    return check_size("vram", vram)


def _sdxl_hint(vram: int) -> str:
    try:
        preset = SDXLMemoryConfig.for_vram(vram)
    except ConfigError:
        return (f"No SDXL preset fits a card of {card_text(vram)}: train below "
                f"{IMAGE_SIZE}x{IMAGE_SIZE} or on a larger card.")
    return (f"SDXLMemoryConfig.for_vram({format_size(vram, binary=False)!r}) fits (checkpointing "
            f"{preset.enable_gradient_checkpointing}, offload {preset.enable_cpu_offload}, "
            f"{preset.offload_resident_blocks} resident blocks); or turn on gradient "
            "checkpointing, or CPU offload with fewer offload_resident_blocks.")


def _components(target: Any) -> dict[str, Any]:
    if isinstance(target, Mapping):
        return dict(target)
    if hasattr(target, "set_attention_slice") and hasattr(target, "down_blocks"):
        return {"unet": target}
    if hasattr(target, "decoder") and hasattr(target, "post_quant_conv"):
        return {"vae": target}
    return {name: getattr(target, name) for name in ("unet", "vae", "transformer")
            if getattr(target, name, None) is not None}




def optimize_sdxl_memory(config: SDXLMemoryConfig, pipeline_or_modules: Any, *,
                         device: str | torch.device | None = None) -> MemoryOptimization:
    """Apply ``config`` to an SDXL pipeline or its modules (seed ``optimize_sdxl_memory``).

    Args:
        config: the options.
        pipeline_or_modules: a diffusers pipeline (``.unet``, ``.vae``), a mapping
            ``{"unet": ..., "vae": ...}``, or a UNet / AutoencoderKL alone.
        device: compute device for CPU offload (default ``"cuda"``; ``"cpu"`` runs the swapper's
            synchronous path, for tests).

    Returns:
        The :class:`MemoryOptimization` handle (``undo()`` reverts everything applied here).

    Raises:
        ConfigError: when an option needs a component that is missing.
    """
    if not isinstance(config, SDXLMemoryConfig):
        raise ConfigError(f"config must be an SDXLMemoryConfig, got {type(config).__name__}",
                          hint="Pass an SDXLMemoryConfig, e.g. SDXLMemoryConfig.for_vram('16GB') "
                               "or SDXLMemoryConfig.preset_12gb().")
    parts = _components(pipeline_or_modules)
    unet, vae = parts.get("unet"), parts.get("vae")
    handle = MemoryOptimization(check_device("optimize_sdxl_memory device",
                                             "cuda" if device is None else device,
                                             types=_DEVICE_TYPES))
    needs_unet = (config.enable_gradient_checkpointing or config.enable_attention_slicing
                  or config.enable_cpu_offload)
    if needs_unet and unet is None:
        raise ConfigError("the options need a UNet, but none was given",
                          hint="Pass the pipeline (with .unet) or {'unet': unet, ...}, or turn off "
                               "enable_gradient_checkpointing, enable_attention_slicing and "
                               "enable_cpu_offload.")
    if config.vae_tiling and vae is None:
        raise ConfigError("vae_tiling needs a VAE, but none was given",
                          hint="Pass the pipeline (with .vae) or {'vae': vae, ...}, or set "
                               "vae_tiling=False.")
    try:
        if config.enable_gradient_checkpointing:
            from vramkit.offload.checkpointing import (
                disable_gradient_checkpointing,
                enable_gradient_checkpointing,
            )

            names = enable_gradient_checkpointing(unet, blocks=unet_blocks(unet))
            handle._record("gradient_checkpointing", f"{len(names)} UNet blocks",
                           lambda: disable_gradient_checkpointing(unet))
        if config.enable_attention_slicing:
            size = config.attention_slice_size or "auto"
            previous = dict(unet.attn_processors)
            unet.set_attention_slice(size)
            handle._record("attention_slicing", f"slice size {size!r}",
                           lambda: unet.set_attn_processor(previous))
        if config.vae_tiling:
            from vramkit.tiling.vae import VAETiling

            tiling = VAETiling(tile_size=config.vae_tile_size, overlap=config.vae_tile_overlap)
            handle.vae_tiling = tiling.attach(vae)
            handle._record("vae_tiling", f"{config.vae_tile_size} px tiles, "
                                         f"{config.vae_tile_overlap} px overlap",
                           handle.vae_tiling.detach)
        if config.enable_cpu_offload:
            from vramkit.offload.swap import BlockSwapper

            swapper = BlockSwapper(unet, blocks=unet_blocks(unet), device=handle.device,
                                   config=SwapConfig(
                                       max_gpu_blocks=config.offload_resident_blocks))
            handle.swapper = swapper
            handle._record("cpu_offload", f"{len(swapper.swapped_names)} UNet blocks swapped",
                           swapper.detach)
    except BaseException:
        handle.undo()
        raise
    return handle


# ------------------------------------------------------------------------------------------
# Flux
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FluxTrainingConfig:
    """Memory options for training Flux (seed ``FluxTrainingConfig``).

    Args:
        batch_size: rows per forward/backward (the micro-batch); larger batches given to
            :meth:`MemoryOptimization.train_step` are split and their gradients accumulated,
            and an OOM halves it further. Default 1.
        gradient_checkpointing: recompute the transformer blocks in backward (default True).
        mixed_precision: ``"bf16"`` (default: frozen weights stored in bf16, forward under
            bf16 autocast, trainable weights kept in fp32) or ``"no"``. fp16 is refused: it
            needs loss scaling, which the CPU-offloaded optimizer does not support.
        cpu_offload_optimizer: keep optimizer states (and fp32 masters) on the host and step
            there (:class:`~vramkit.offload.optimizer.CPUOffloadOptimizer` with
            ``offload_gradients=False``: gradients accumulate on the device over micro-batches
            and go to the host in ``step()``). Default False.
        quantize_base_model: store the frozen Linear weights quantized (trainable modules,
            e.g. LoRA adapters, are kept). Default False.
        base_model_format: ``"int8"`` (default), ``"int4"``, ``"nf4"`` or ``"fp8"``.
        blocks_to_swap: transformer blocks kept in pinned host memory and streamed in
            (default 0). Frozen weights are swapped; trainable ones stay on the GPU.
        swap_min_tensor_bytes: tensors of a swapped block smaller than this stay on the GPU
            (norms, biases; default 64 KiB, :class:`~vramkit.offload.swap.SwapConfig`'s
            ``min_param_bytes``).
        use_8bit_adam: AdamW with 8-bit states (:class:`vramkit.optim.AdamW8bit`) instead of
            ``torch.optim.AdamW``. Default False.
        learning_rate: the optimizer's learning rate (default 1e-4).
        weight_decay: the optimizer's weight decay (default 1e-2).
        vram: the card these settings are for (bytes or ``"12GB"``; default ``None``: no
            check). When set, the planner's peak for these settings (:meth:`plan`) must fit
            the card less its CUDA context and the planner's headroom, or construction raises
            with the numbers. The plan is of one LoRA training step of FLUX.1-dev's
            transformer (rank-16 fp32 adapters on the attention projections, bf16 autocast,
            the base in its stored format) at 1024x1024, ``batch_size`` rows, with this
            ``swap_min_tensor_bytes``; it needs ``mixed_precision="bf16"``.

    Raises:
        ConfigError: for invalid values, or settings that do not fit ``vram``.
    """

    batch_size: int = 1
    gradient_checkpointing: bool = True
    mixed_precision: str = "bf16"
    cpu_offload_optimizer: bool = False
    quantize_base_model: bool = False
    base_model_format: str = "int8"
    blocks_to_swap: int = 0
    swap_min_tensor_bytes: int = SwapConfig.min_param_bytes
    use_8bit_adam: bool = False
    learning_rate: float = 1e-4
    weight_decay: float = 1e-2
    vram: int | str | None = None

    def __post_init__(self) -> None:
        owner = "FluxTrainingConfig"
        check_int(f"{owner}.batch_size", self.batch_size, minimum=1)
        for name in ("gradient_checkpointing", "cpu_offload_optimizer", "quantize_base_model",
                     "use_8bit_adam"):
            check_bool(f"{owner}.{name}", getattr(self, name))
        check_choice(f"{owner}.mixed_precision", self.mixed_precision, _MIXED_PRECISION,
                     hint="fp16 needs loss scaling; train Flux in bf16.")
        check_choice(f"{owner}.base_model_format", self.base_model_format, QUANT_FORMATS)
        check_int(f"{owner}.blocks_to_swap", self.blocks_to_swap, minimum=0)
        check_int(f"{owner}.swap_min_tensor_bytes", self.swap_min_tensor_bytes, minimum=0)
        object.__setattr__(self, "learning_rate", check_number(
            f"{owner}.learning_rate", self.learning_rate, minimum=0, low_open=True))
        object.__setattr__(self, "weight_decay", check_number(
            f"{owner}.weight_decay", self.weight_decay, minimum=0))
        object.__setattr__(self, "vram", check_size(f"{owner}.vram", self.vram,
                                                    allow_none=True))
        if self.vram is not None:
            if self.mixed_precision != "bf16":
                raise ConfigError(
                    "FluxTrainingConfig.vram checks the bf16 estimate, but mixed_precision is "
                    f"{self.mixed_precision!r}",
                    hint="Train in bf16, or leave vram at None (no check).")
            check_fits("Flux", self._setting(), self.vram, lambda: _flux_hint(self))

    def _setting(self) -> Setting:
        return Setting(
            "flux", base_format=self.base_model_format if self.quantize_base_model else "bf16",
            optimizer=("host" if self.cpu_offload_optimizer
                       else "adamw8bit" if self.use_8bit_adam else "adamw"),
            checkpointing=self.gradient_checkpointing,
            swapped=min(self.blocks_to_swap, len(PROFILES["flux"].block_rows())),
            batch=self.batch_size, min_param_bytes=self.swap_min_tensor_bytes)

    def plan(self, vram: int | str | None = None) -> Any:
        """The planner's :class:`~vramkit.planning.record.Plan` of these settings on a card of
        ``vram`` (default: this config's ``vram``): predicted peak and step, ``explain()``.
        Builds and analyzes the transformer on the meta device the first time (diffusers,
        peft; seconds)."""
        return price(self._setting(), _card(vram if vram is not None else self.vram))

    def estimate(self) -> MemoryEstimate:
        """GPU bytes of one FLUX.1-dev LoRA training step at 1024x1024 with these settings
        (see ``vram``), from the transformer's stored :class:`ModelProfile`."""
        blocks = len(PROFILES["flux"].block_rows())
        return estimate_step(
            "flux", weight_format=self.base_model_format if self.quantize_base_model else "bf16",
            max_gpu_blocks=blocks - min(self.blocks_to_swap, blocks) if self.blocks_to_swap
            else None,
            checkpointing=self.gradient_checkpointing, batch_size=self.batch_size,
            optimizer=("host" if self.cpu_offload_optimizer
                       else "adamw8bit" if self.use_8bit_adam else "adamw"))

    # The tiers' settings are the planner's (vramkit.recipes._preset_plans): the fastest plan
    # for the card's decimal size with the int8 base and 8-bit AdamW.

    @classmethod
    def preset_24gb(cls) -> FluxTrainingConfig:
        """Flux LoRA on a 24 GB card: int8 base resident (~11.4 GiB), checkpointing, bf16,
        8-bit AdamW."""
        return cls._tier(24)

    @classmethod
    def preset_16gb(cls) -> FluxTrainingConfig:
        """Flux LoRA on a 16 GB card: the 24 GB preset with 9 of 57 blocks swapped."""
        return cls._tier(16)

    @classmethod
    def preset_12gb(cls) -> FluxTrainingConfig:
        """Flux LoRA on a 12 GB card: the 24 GB preset with 23 of 57 blocks swapped."""
        return cls._tier(12)

    @classmethod
    def preset_8gb(cls) -> FluxTrainingConfig:
        """Flux LoRA on an 8 GB card: the 24 GB preset with 39 of 57 blocks swapped."""
        return cls._tier(8)

    @classmethod
    def _tier(cls, gigabytes: int) -> FluxTrainingConfig:
        s = tier("flux", gigabytes).setting
        return cls(batch_size=1, gradient_checkpointing=s.checkpointing, mixed_precision="bf16",
                   quantize_base_model=s.base_format != "bf16", base_model_format=s.base_format,
                   use_8bit_adam=True, cpu_offload_optimizer=s.optimizer == "host",
                   blocks_to_swap=s.swapped, vram=tier_vram(gigabytes))

    @classmethod
    def for_vram(cls, vram: int | str) -> FluxTrainingConfig:
        """The largest preset whose planned peak fits a card of ``vram`` (``"12GB"``,
        ``"16GiB"``, bytes).

        Raises:
            ConfigError: when even :meth:`preset_8gb` does not fit (the message gives the
                smallest card it fits).
        """
        return for_vram(cls, vram, "Flux")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


def _flux_hint(config: FluxTrainingConfig) -> str:
    blocks = len(PROFILES["flux"].block_rows())
    usable = room(config.vram)  # type: ignore[arg-type]
    fmt = config.base_model_format if config.quantize_base_model else "bf16"
    for swapped in range(config.blocks_to_swap, blocks + 1):
        trial = dataclasses.replace(config, blocks_to_swap=swapped, vram=None)
        if trial.plan(config.vram).predicted_peak_bytes <= usable:
            return (f"Swap more blocks: blocks_to_swap={swapped} fits (with the {fmt} base), "
                    "or use FluxTrainingConfig.for_vram("
                    f"{format_size(config.vram, binary=False)!r}).")  # type: ignore[arg-type]
    return ("Even with every block swapped it does not fit: quantize the base "
            "(quantize_base_model=True, base_model_format='nf4'), turn on checkpointing, "
            f"lower batch_size, or train below {IMAGE_SIZE}x{IMAGE_SIZE}.")


def _quantized_layer_names(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` that hold quantized weights already."""
    if "vramkit.quant.linear" not in sys.modules:
        return []  # never imported: nothing can be quantized, and no need to import it now
    from vramkit.quant.linear import QuantizedConv2d, QuantizedLinear

    return [name for name, m in model.named_modules()
            if name and isinstance(m, (QuantizedLinear, QuantizedConv2d))]




@contextlib.contextmanager
def _undo_on_error(handle: MemoryOptimization) -> Iterator[None]:
    try:
        yield
    except BaseException:
        handle.undo()
        raise


def optimize_flux_memory(config: FluxTrainingConfig, model_or_pipeline: Any, *,
                         device: str | torch.device | None = None) -> MemoryOptimization:
    """Apply ``config`` to a Flux transformer and build its optimizer and step runner.

    Order: cast frozen weights (bf16), quantize the frozen base, checkpoint blocks, swap blocks
    (or move the model to ``device``), build the optimizer over the trainable parameters and the
    :class:`~vramkit.observe.recovery.MemoryRecovery` that runs steps at ``batch_size``.

    Args:
        config: the options.
        model_or_pipeline: a ``FluxTransformer2DModel`` (trainable parameters, e.g. LoRA
            adapters, marked ``requires_grad``) or a pipeline with ``.transformer``.
        device: the compute device (default ``"cuda"``).

    Returns:
        The :class:`MemoryOptimization` handle: ``.optimizer``, ``.recovery``, ``.autocast()``,
        ``.train_step(step_fn, batch)``; ``undo()`` reverts swapping, checkpointing and the
        optimizer's host resources (not the dtype cast or quantization).

    Raises:
        ConfigError: for a model without blocks, ``blocks_to_swap`` above the block count, or
            optimizer options on a model with nothing trainable.
    """
    if not isinstance(config, FluxTrainingConfig):
        raise ConfigError(f"config must be a FluxTrainingConfig, got {type(config).__name__}",
                          hint="Pass a FluxTrainingConfig, e.g. "
                               "FluxTrainingConfig.for_vram('24GB') or "
                               "FluxTrainingConfig.preset_16gb().")
    model = getattr(model_or_pipeline, "transformer", model_or_pipeline)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected a Flux transformer module, got {type(model).__name__}",
                          hint="Pass the Flux transformer (an nn.Module) or a pipeline with a "
                               ".transformer.")
    handle = MemoryOptimization(check_device("optimize_flux_memory device",
                                             "cuda" if device is None else device,
                                             types=_DEVICE_TYPES))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and (config.use_8bit_adam or config.cpu_offload_optimizer):
        raise ConfigError("optimizer options are set but the model has no trainable parameters",
                          hint="Add LoRA adapters or unfreeze parameters first.")
    with _undo_on_error(handle):
        # Layers quantized before (a load-and-quantize, io.loader's quantization=): their
        # packed storage keeps its dtypes and they are not quantized again.
        prequantized = _quantized_layer_names(model)
        storage = {id(t) for name in prequantized
                   for t in model.get_submodule(name).buffers(recurse=False)}
        if config.mixed_precision == "bf16":
            cast = 0
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    if (tensor.is_floating_point() and not tensor.requires_grad
                            and tensor.dtype != torch.bfloat16 and id(tensor) not in storage):
                        tensor.data = tensor.data.to(torch.bfloat16)
                        cast += 1
            handle.autocast_dtype = torch.bfloat16
            handle._record("mixed_precision", f"{cast} frozen tensors in bf16, bf16 autocast")
        if config.quantize_base_model:
            from vramkit.quant.model import QuantizationConfig, quantizable_layers, quantize_model

            quant = QuantizationConfig(
                weights_dtype=config.base_model_format,
                modules_to_not_quantize=(*trainable_module_names(model), *prequantized))
            if quantizable_layers(model, quant):
                quantize_model(model, quant)
            kept = f" ({len(prequantized)} layers quantized before kept)" if prequantized else ""
            handle._record("quantize_base_model", f"frozen Linear weights in "
                                                  f"{config.base_model_format}{kept}")
        if config.gradient_checkpointing:
            from vramkit.offload.checkpointing import (
                disable_gradient_checkpointing,
                enable_gradient_checkpointing,
            )

            names = enable_gradient_checkpointing(model)
            handle._record("gradient_checkpointing", f"{len(names)} blocks",
                           lambda: disable_gradient_checkpointing(model))
        if config.blocks_to_swap:
            from vramkit.offload.blocks import find_blocks
            from vramkit.offload.swap import BlockSwapper

            count = len(find_blocks(model))
            if config.blocks_to_swap > count:
                raise ConfigError(f"blocks_to_swap={config.blocks_to_swap} but the model has "
                                  f"{count} blocks",
                                  hint=f"Set FluxTrainingConfig.blocks_to_swap to {count} or fewer.")
            swapper = BlockSwapper(model, device=handle.device, config=SwapConfig(
                max_gpu_blocks=count - config.blocks_to_swap,
                min_param_bytes=config.swap_min_tensor_bytes))
            handle.swapper = swapper
            handle._record("blocks_to_swap", f"{len(swapper.swapped_names)} of {count} blocks "
                                             "swapped", swapper.detach)
        else:
            model.to(handle.device)
        if trainable:
            _build_optimizer(config, handle, trainable)
    return handle


def _build_optimizer(config: FluxTrainingConfig, handle: MemoryOptimization,
                     trainable: list[torch.Tensor]) -> None:
    from vramkit.observe.recovery import MemoryRecovery

    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW
    if config.use_8bit_adam:
        from vramkit.optim.adamw8bit import AdamW8bit

        optimizer_class = AdamW8bit
    hyper = {"lr": config.learning_rate, "weight_decay": config.weight_decay}
    if config.cpu_offload_optimizer:
        from vramkit.offload.optimizer import CPUOffloadOptimizer

        # Gradients stay on the device until step(): micro-batches accumulate there, and a failed
        # attempt's partial gradients can be dropped (host-side accumulation could not be).
        optimizer: torch.optim.Optimizer = CPUOffloadOptimizer(
            trainable, optimizer_class=optimizer_class, offload_gradients=False, overlap=True,
            **hyper)
        handle._record("cpu_offload_optimizer", f"{optimizer_class.__name__} states on the host",
                       optimizer.close)
    else:
        optimizer = optimizer_class(trainable, **hyper)
    if config.use_8bit_adam:
        handle._record("use_8bit_adam", "AdamW8bit")
    handle.optimizer = optimizer
    handle.recovery = MemoryRecovery(trainable, micro_batch_size=config.batch_size,
                                     device=handle.device)
    handle._record("batch_size", f"micro-batches of {config.batch_size}")
