"""Memory presets for diffusion models: SDXL and Flux on 16 GB and 24 GB cards.

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
  steps run through :class:`vramkit.memory.recovery.MemoryRecovery` at ``batch_size`` rows per
  micro-batch.

Both verbs return a :class:`MemoryOptimization` handle that says what was applied and undoes
what can be undone (:meth:`MemoryOptimization.undo`). The presets' reasoning is in
docs/recovery_and_presets.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
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

__all__ = [
    "FluxTrainingConfig",
    "MemoryOptimization",
    "SDXLMemoryConfig",
    "optimize_flux_memory",
    "optimize_sdxl_memory",
]

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# A "24 GB" card has 24 GiB and reports 23.5-24 GiB usable, while "24GB" typed by a person
# parses to 24e9 bytes (22.4 GiB): the thresholds sit below both readings of each tier.
_TIER_24 = 22 * _GIB
_TIER_16 = int(14.5 * _GIB)
_SLICE_NAMES = ("auto", "max")
_MIXED_PRECISION = ("bf16", "no")
_QUANT_FORMATS = ("int8", "int4", "nf4", "fp8")
# Compute devices the verbs take: those MemoryRecovery runs training steps on.
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


# ------------------------------------------------------------------------------------------
# The handle
# ------------------------------------------------------------------------------------------


class MemoryOptimization:
    """What :func:`optimize_sdxl_memory` / :func:`optimize_flux_memory` applied.

    Attributes:
        applied: option name -> what was done, in application order.
        swapper: the :class:`~vramkit.offload.swap.BlockSwapper`, when blocks are offloaded.
        vae_tiling: the VAE tiling handle (``.detach()``), when tiling is on.
        optimizer: the optimizer built for the trainable parameters (Flux), else ``None``.
        recovery: the :class:`~vramkit.memory.recovery.MemoryRecovery` that runs training steps
            at the configured micro-batch size (Flux), else ``None``.
        autocast_dtype: the autocast dtype of :meth:`autocast` (``None``: autocast off).
        device: the compute device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.applied: dict[str, str] = {}
        self.swapper: Any = None
        self.vae_tiling: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.recovery: Any = None
        self.autocast_dtype: torch.dtype | None = None
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def _record(self, option: str, what: str, undo: Callable[[], None] | None = None) -> None:
        self.applied[option] = what
        if undo is not None:
            self._undo.append((option, undo))
        logger.info("%s: %s", option, what)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A ``torch.autocast`` context for the forward pass (a no-op without mixed precision)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_step(self, step_fn: Callable[..., Any], batch: Any) -> Any:
        """One optimizer step: micro-batched forward/backward under autocast, then ``step()``.

        Args:
            step_fn: ``step_fn(micro_batch) -> mean loss`` (see
                :class:`~vramkit.memory.recovery.MemoryRecovery`).
            batch: the batch; split into ``batch_size``-row micro-batches, smaller on OOM.

        Returns:
            The :class:`~vramkit.memory.recovery.RecoveryResult`.

        Raises:
            ConfigError: when nothing is trainable (no optimizer was built).
        """
        if self.optimizer is None or self.recovery is None:
            raise ConfigError("train_step needs trainable parameters: the model had none",
                              hint="Add LoRA adapters (model.add_adapter) or unfreeze weights "
                                   "before optimize_flux_memory.")
        with self.autocast():
            result = self.recovery.step(step_fn, batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def undo(self) -> list[str]:
        """Undo what can be undone, newest first: swapping, VAE tiling, attention slicing,
        checkpointing, the optimizer's host resources. Dtype casts and quantization stay (the
        original weights are gone; reload them to start over).

        Returns:
            The options undone.
        """
        done = []
        while self._undo:
            option, undo = self._undo.pop()
            undo()
            self.applied.pop(option, None)
            done.append(option)
        return done

    def __enter__(self) -> MemoryOptimization:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"MemoryOptimization({', '.join(self.applied) or 'nothing'})"


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

    Raises:
        ConfigError: for invalid values or combinations.
    """

    enable_cpu_offload: bool = False
    enable_gradient_checkpointing: bool = False
    enable_attention_slicing: bool = False
    attention_slice_size: int | str | None = None
    vae_tiling: bool = False
    vae_tile_size: int = 512
    vae_tile_overlap: int = 64
    offload_resident_blocks: int = 0

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
                              "SDXL VAE's scale factor)")
        if self.vae_tile_overlap >= self.vae_tile_size:
            raise ConfigError("vae_tile_overlap must be smaller than vae_tile_size")
        check_int(f"{owner}.offload_resident_blocks", self.offload_resident_blocks, minimum=0)

    @classmethod
    def preset_24gb(cls) -> SDXLMemoryConfig:
        """SDXL on a 24 GB card: checkpointing and VAE tiling; the UNet stays on the GPU."""
        return cls(enable_gradient_checkpointing=True, vae_tiling=True, vae_tile_size=512)

    @classmethod
    def preset_16gb(cls) -> SDXLMemoryConfig:
        """SDXL on a 16 GB card: the 24 GB preset plus half of the UNet's blocks swapped."""
        return cls(enable_cpu_offload=True, offload_resident_blocks=14,
                   enable_gradient_checkpointing=True, vae_tiling=True, vae_tile_size=512)

    @classmethod
    def for_vram(cls, vram: int | str) -> SDXLMemoryConfig:
        """The preset for a card of ``vram`` (``"24GB"``, ``"16GiB"``, bytes).

        Raises:
            ConfigError: below the 16 GB tier (no preset was worked out for it).
        """
        return _tiered(vram, cls.preset_24gb, cls.preset_16gb, "SDXL")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


def _tiered(vram: int | str, p24: Callable[[], Any], p16: Callable[[], Any], what: str) -> Any:
    nbytes = check_size("vram", vram)
    if nbytes >= _TIER_24:
        return p24()
    if nbytes >= _TIER_16:
        return p16()
    raise ConfigError(f"no {what} preset below 16 GB (got {vram!r})",
                      hint="Start from preset_16gb() and offload/swap more blocks.")


def _components(target: Any) -> dict[str, Any]:
    if isinstance(target, Mapping):
        return dict(target)
    if hasattr(target, "set_attention_slice") and hasattr(target, "down_blocks"):
        return {"unet": target}
    if hasattr(target, "decoder") and hasattr(target, "post_quant_conv"):
        return {"vae": target}
    return {name: getattr(target, name) for name in ("unet", "vae", "transformer")
            if getattr(target, name, None) is not None}


def unet_blocks(unet: nn.Module) -> list[str]:
    """The UNet's resnet and attention stacks (block names for checkpointing and swapping).

    A UNet stage is too coarse to swap (SDXL's largest is ~1.4 GB in bf16) and diffusers' own
    ``ModuleList`` nesting fools the automatic block finder, so blocks are each stage's
    ``resnets`` and ``attentions`` children.
    """
    names = []
    for stage_name in ("down_blocks", "mid_block", "up_blocks"):
        stage = getattr(unet, stage_name, None)
        stages = (list(stage.named_children()) if isinstance(stage, nn.ModuleList)
                  else [("", stage)] if stage is not None else [])
        for index, module in stages:
            prefix = f"{stage_name}.{index}" if index else stage_name
            for part in ("resnets", "attentions"):
                if isinstance(getattr(module, part, None), nn.ModuleList) and len(getattr(module, part)):
                    names.append(f"{prefix}.{part}")
    if not names:
        raise ConfigError(f"{type(unet).__name__} has no down/mid/up blocks with resnets or "
                          "attentions", hint="Pass a diffusers UNet2DConditionModel.")
    return names


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
        raise ConfigError(f"config must be an SDXLMemoryConfig, got {type(config).__name__}")
    parts = _components(pipeline_or_modules)
    unet, vae = parts.get("unet"), parts.get("vae")
    handle = MemoryOptimization(check_device("optimize_sdxl_memory device",
                                             "cuda" if device is None else device,
                                             types=_DEVICE_TYPES))
    needs_unet = (config.enable_gradient_checkpointing or config.enable_attention_slicing
                  or config.enable_cpu_offload)
    if needs_unet and unet is None:
        raise ConfigError("the options need a UNet, but none was given")
    if config.vae_tiling and vae is None:
        raise ConfigError("vae_tiling needs a VAE, but none was given")
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

    Raises:
        ConfigError: for invalid values.
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

    def __post_init__(self) -> None:
        owner = "FluxTrainingConfig"
        check_int(f"{owner}.batch_size", self.batch_size, minimum=1)
        for name in ("gradient_checkpointing", "cpu_offload_optimizer", "quantize_base_model",
                     "use_8bit_adam"):
            check_bool(f"{owner}.{name}", getattr(self, name))
        check_choice(f"{owner}.mixed_precision", self.mixed_precision, _MIXED_PRECISION,
                     hint="fp16 needs loss scaling; train Flux in bf16.")
        check_choice(f"{owner}.base_model_format", self.base_model_format, _QUANT_FORMATS)
        check_int(f"{owner}.blocks_to_swap", self.blocks_to_swap, minimum=0)
        check_int(f"{owner}.swap_min_tensor_bytes", self.swap_min_tensor_bytes, minimum=0)
        object.__setattr__(self, "learning_rate", check_number(
            f"{owner}.learning_rate", self.learning_rate, minimum=0, low_open=True))
        object.__setattr__(self, "weight_decay", check_number(
            f"{owner}.weight_decay", self.weight_decay, minimum=0))

    @classmethod
    def preset_24gb(cls) -> FluxTrainingConfig:
        """Flux LoRA on a 24 GB card: int8 base (~12 GB), checkpointing, bf16, 8-bit AdamW."""
        return cls(batch_size=1, gradient_checkpointing=True, mixed_precision="bf16",
                   quantize_base_model=True, base_model_format="int8", use_8bit_adam=True)

    @classmethod
    def preset_16gb(cls) -> FluxTrainingConfig:
        """Flux LoRA on a 16 GB card: the 24 GB preset with 16 of 57 blocks swapped and the
        optimizer on the host."""
        return cls(batch_size=1, gradient_checkpointing=True, mixed_precision="bf16",
                   quantize_base_model=True, base_model_format="int8", blocks_to_swap=16,
                   use_8bit_adam=True, cpu_offload_optimizer=True)

    @classmethod
    def for_vram(cls, vram: int | str) -> FluxTrainingConfig:
        """The preset for a card of ``vram`` (``"24GB"``, ``"16GiB"``, bytes).

        Raises:
            ConfigError: below the 16 GB tier.
        """
        return _tiered(vram, cls.preset_24gb, cls.preset_16gb, "Flux")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


def _trainable_module_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules()
            if name and any(p.requires_grad for p in module.parameters(recurse=False))]


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
    :class:`~vramkit.memory.recovery.MemoryRecovery` that runs steps at ``batch_size``.

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
        raise ConfigError(f"config must be a FluxTrainingConfig, got {type(config).__name__}")
    model = getattr(model_or_pipeline, "transformer", model_or_pipeline)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected a Flux transformer module, got {type(model).__name__}")
    handle = MemoryOptimization(check_device("optimize_flux_memory device",
                                             "cuda" if device is None else device,
                                             types=_DEVICE_TYPES))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and (config.use_8bit_adam or config.cpu_offload_optimizer):
        raise ConfigError("optimizer options are set but the model has no trainable parameters",
                          hint="Add LoRA adapters or unfreeze parameters first.")
    with _undo_on_error(handle):
        if config.mixed_precision == "bf16":
            cast = 0
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    if (tensor.is_floating_point() and not tensor.requires_grad
                            and tensor.dtype != torch.bfloat16):
                        tensor.data = tensor.data.to(torch.bfloat16)
                        cast += 1
            handle.autocast_dtype = torch.bfloat16
            handle._record("mixed_precision", f"{cast} frozen tensors in bf16, bf16 autocast")
        if config.quantize_base_model:
            from vramkit.quant.model import QuantizationConfig, quantize_model

            keep = _trainable_module_names(model)
            quantize_model(model, QuantizationConfig(weights_dtype=config.base_model_format,
                                                     modules_to_not_quantize=tuple(keep)))
            handle._record("quantize_base_model", f"frozen Linear weights in "
                                                  f"{config.base_model_format}")
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
                                  f"{count} blocks")
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
    from vramkit.memory.recovery import MemoryRecovery

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
