"""Quantize a whole model (or a state dict) with one config: :func:`quantize_model`.

Example:
    >>> config = QuantizationConfig("nf4", modules_to_not_quantize=["final_layer*"])  # doctest: +SKIP
    >>> quantize_model(model, config)            # nn.Linear -> QuantizedLinear, in place  # doctest: +SKIP

The walk is :func:`quantizable_layers` (which layers are replaced), :func:`quantize_weight` (how
a weight is quantized) and :func:`quantized_layer` (what replaces a layer): :func:`quantize_model`
runs them over a model with real weights, and :func:`vramkit.io.loader.load_into` runs the same
three while it streams a checkpoint into a model built on the meta device.

Module names (``modules_to_not_quantize``) match the way bitsandbytes and Hugging Face users
expect: a name matches every module whose qualified name (as ``model.named_modules()`` spells it,
``"double_blocks.0.img_attn.qkv"``) contains it as whole path components, anywhere. So
``"proj_out"`` matches ``"proj_out"`` and ``"transformer.proj_out"`` but not
``"proj_out_extra"``; ``"attn"`` matches ``"blocks.0.attn"`` and everything inside it
(``"blocks.0.attn.to_q"``); ``"blocks.0"`` matches ``"blocks.0.attn"`` but not
``"blocks.01"`` or ``"blocks.10"``. A name may also be a shell-style pattern
(:func:`fnmatch.fnmatchcase`, case-sensitive), matched the same way against every run of whole
components: ``"*norm*"`` keeps every module with ``norm`` in a component of its name,
``"*.proj"`` every module called ``proj`` below the root, ``"final_layer*"`` every module whose
path has a component starting with ``final_layer``. A layer is kept in full precision when its
own name *or an ancestor's* matches (the ancestor's name is a run of its components). For a
state dict the module name of ``"a.b.weight"`` is ``"a.b"``. :func:`quantize_model` warns
(``logging``) about a name that matched no module of the model: a misspelt name would
otherwise quantize a layer that was meant to stay in full precision.

Order with adapters: quantize first, then attach LoRA (peft's ``lora_A``/``lora_B`` are
``nn.Linear`` and would otherwise be quantized too, unless listed, e.g. ``"*lora_*"``).
vramkit's :class:`~vramkit.recipes.lora.LoRALinear` keeps its adapters as plain parameters, so a model
with those adapters may be quantized afterwards: its base layers are replaced.

W8A8 (``QuantizationConfig("fp8" | "int8", w8a8=True)``): each selected ``nn.Linear`` becomes a
:class:`~vramkit.quant.w8a8.W8A8Linear` (both matmuls in 8 bits, no weight gradient), so the walk
replaces frozen layers only: a layer whose weight requires grad is kept as it is (it would
otherwise stop training), and so is every module inside a peft adapter container (a path
component starting with ``lora_``: ``lora_A``, ``lora_B``, ``lora_embedding_A``...), trainable or
not. peft's LoRA layer keeps the frozen ``nn.Linear`` it wraps as ``base_layer``: that one is
replaced, so ``get_peft_model`` first, then ``quantize_model`` with ``w8a8=True``, works. Freeze
the base model (``model.requires_grad_(False)``) before quantizing a model without peft.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramkit._validate import (
    check_bool,
    check_choice,
    check_int,
    check_known_fields,
    check_number,
)
from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant.formats import (
    FP8Config,
    Int8Config,
    QuantConfigT,
    QuantFormat,
    QuantizedTensor,
    config_from_dict,
    format_config,
    quantize_tensor,
)
from vramkit.quant.kernels import FP8_GEMM_MULTIPLE, fp8_gemm_fits
from vramkit.quant.linear import (
    QuantizedConv2d,
    QuantizedLinear,
    _QuantizedWeightModule,
    _release,
    conv_geometry,
)
from vramkit.quant.w8a8 import W8A8Linear, w8a8_weight_format
from vramkit.units import format_size

__all__ = ["QuantizationConfig", "QuantoConfig", "is_trainable_for_w8a8", "model_bytes",
           "quantizable_layers",
           "quantize_model", "quantize_weight", "quantized_layer", "sqnr_db"]

logger = logging.getLogger(__name__)

_ACTIVATION_DTYPES = (None, "fp8")
# Linear layers that their owner reads through ``.weight`` (nn.MultiheadAttention's out_proj):
# replacing them would break the owner.
_NOT_REPLACEABLE: tuple[type[nn.Module], ...] = (nn.modules.linear.NonDynamicallyQuantizableLinear,)


@dataclass(frozen=True)
class QuantizationConfig:
    """What :func:`quantize_model` quantizes, and how (seed name: ``QuantoConfig``).

    Args:
        weights_dtype: ``"int8"``, ``"int4"``, ``"nf4"`` or ``"fp8"`` (or a
            :class:`~vramkit.quant.formats.QuantFormat`, or a format config such as
            ``NF4Config(double_quant=False)``).
        activations_dtype: ``None`` (default: weight-only quantization, matmuls in the input's
            dtype) or ``"fp8"``: inputs quantized per token to e4m3 and the fp8 GEMM used in
            forward. Only with ``weights_dtype="fp8"`` in channel granularity; it runs on CUDA
            GPUs of capability >= 8.9 (Hopper, Ada), elsewhere the forward raises
            :class:`~vramkit.errors.QuantizationError`. Linear layers whose in/out features
            are not multiples of 16 (which the fp8 GEMM cannot take) run weight-only.
        modules_to_not_quantize: names (or shell-style patterns) of modules to keep in full
            precision, matched as whole path components anywhere in a module's qualified name:
            ``"proj_out"`` keeps ``"transformer.proj_out"`` but not ``"proj_out_extra"``, and
            ``"attn"`` keeps everything inside ``"blocks.0.attn"`` (see the module docstring; a
            single string counts as one name). Default none.
        group_size: block/group size override for the format (int8/nf4/fp8-block blocks, int4
            groups). Default None: the format's default (32 for int8/int4/nf4, with one-byte
            log-scale codes, which meets the memory and error targets on heavy-tailed weights
            where blocks of 64 did not; 128 for fp8 blocks).
        min_sqnr_db: when set, a layer whose quantized weight has a signal-to-quantization-noise
            ratio below this many dB stays in full precision (outlier-heavy layers). Default
            None (quantize every selected layer).
        quantize_conv: replace ``nn.Conv2d`` layers too (and quantize 4-D weights of a state
            dict). Default True.
        w8a8: run both matmuls of each replaced ``nn.Linear`` in 8 bits
            (:class:`~vramkit.quant.w8a8.W8A8Linear`: activations and gradients quantized per
            token to the weight's type, per-output-channel weight scales). Needs
            ``weights_dtype`` ``"fp8"`` (CUDA capability >= 8.9) or ``"int8"`` (>= 8.0; both
            run on the CPU too), no ``group_size`` and no ``activations_dtype``. Only frozen
            layers are replaced: layers whose weight requires grad and peft adapter layers stay
            as they are (see the module docstring). Conv layers, with ``quantize_conv``, store
            the same per-channel weights and run weight-only. Default False.

    Raises:
        ConfigError: for an unknown format, a bad group size, an unsupported
            ``activations_dtype`` combination, or bad types.
    """

    weights_dtype: str | QuantFormat | QuantConfigT
    activations_dtype: str | QuantFormat | None = None
    modules_to_not_quantize: Sequence[str] = ()
    group_size: int | None = None
    min_sqnr_db: float | None = None
    quantize_conv: bool = True
    w8a8: bool = False

    def __post_init__(self) -> None:
        check_int("QuantizationConfig.group_size", self.group_size, minimum=1, allow_none=True)
        # Resolved once (ConfigError for unknown names and bad sizes); weight_format() returns it.
        weight_format = format_config(self.weights_dtype, self.group_size)
        object.__setattr__(self, "_weight_format", weight_format)
        patterns = self.modules_to_not_quantize
        if isinstance(patterns, str):
            patterns = (patterns,)
        if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
            raise ConfigError("QuantizationConfig.modules_to_not_quantize must be a sequence of "
                              f"name patterns (str), got {self.modules_to_not_quantize!r}",
                              hint="Give fnmatch patterns as strings, e.g. "
                                   "modules_to_not_quantize=('proj_out', '*norm*').")
        for pattern in patterns:
            # Components never start or end with a dot: such a name could match no module.
            if not pattern or pattern.startswith(".") or pattern.endswith(".") or ".." in pattern:
                raise ConfigError(
                    f"QuantizationConfig.modules_to_not_quantize: {pattern!r} can match no "
                    "module name",
                    hint="Give module names as model.named_modules() spells them, without "
                         "leading, trailing or doubled dots: 'proj_out', 'blocks.0.attn', "
                         "'*norm*'.")
        object.__setattr__(self, "modules_to_not_quantize", tuple(patterns))
        object.__setattr__(self, "_patterns", _split_patterns(self.modules_to_not_quantize))
        activations = self.activations_dtype
        if isinstance(activations, QuantFormat):
            activations = activations.value
        check_choice("QuantizationConfig.activations_dtype", activations, _ACTIVATION_DTYPES)
        if activations is not None:
            if not (isinstance(weight_format, FP8Config)
                    and weight_format.granularity == "channel"):
                raise ConfigError(
                    "activations_dtype='fp8' needs fp8 weights with per-channel scales, got "
                    f"weights {weight_format!r}",
                    hint="Use weights_dtype='fp8' (channel granularity is its default); "
                         "int8/int4/nf4 weights run weight-only.")
        object.__setattr__(self, "activations_dtype", activations)
        object.__setattr__(self, "min_sqnr_db", check_number(
            "QuantizationConfig.min_sqnr_db", self.min_sqnr_db, allow_none=True,
            hint="Give the threshold in dB (e.g. 30.0), or None to quantize every layer."))
        check_bool("QuantizationConfig.quantize_conv", self.quantize_conv)
        check_bool("QuantizationConfig.w8a8", self.w8a8)
        if self.w8a8:
            self._check_w8a8(weight_format)

    def _check_w8a8(self, weight_format: QuantConfigT) -> None:
        # Per-channel scales only: the formats' defaults, which a block size would change.
        kind = ("fp8" if weight_format == FP8Config() and self.group_size is None
                else "int8" if weight_format == Int8Config() and self.group_size is None
                else None)
        if kind is None or self.activations_dtype is not None:
            raise ConfigError(
                "w8a8=True needs weights_dtype 'fp8' or 'int8' with per-channel scales (no "
                "group_size) and activations_dtype=None (activations take the weights' type), "
                f"got weights {weight_format!r}, group_size={self.group_size}, "
                f"activations_dtype={self.activations_dtype!r}",
                hint="Use QuantizationConfig('fp8', w8a8=True) on capability >= 8.9 or "
                     "QuantizationConfig('int8', w8a8=True) on >= 8.0.")
        object.__setattr__(self, "_weight_format", w8a8_weight_format(kind, 1))

    @property
    def w8a8_kind(self) -> str | None:
        """``"fp8"`` or ``"int8"`` with ``w8a8``, else None."""
        if not self.w8a8:
            return None
        return "fp8" if isinstance(self.weight_format(), FP8Config) else "int8"
    def weight_format(self) -> QuantConfigT:
        """The resolved weight format config (name + ``group_size`` override), made once when
        the config was."""
        return self._weight_format  # type: ignore[attr-defined, no-any-return]

    @property
    def activation_fp8(self) -> bool:
        """Whether forwards use the fp8 GEMM (``activations_dtype == "fp8"``)."""
        return self.activations_dtype == "fp8"

    def is_excluded(self, qualified_name: str) -> bool:
        """Whether a name in ``modules_to_not_quantize`` matches ``qualified_name`` or one of
        its ancestors: as whole path components anywhere in the name (``"proj_out"`` matches
        ``"transformer.proj_out"``, not ``"proj_out_extra"``), or as a shell-style pattern
        matched against every run of whole components (``"*norm*"``).

        Args:
            qualified_name: a dotted module name (``""`` is the root and never matches).

        Returns:
            True when the module must stay in full precision.
        """
        if not qualified_name or not self.modules_to_not_quantize:
            return False
        plain, globs = self._patterns  # type: ignore[attr-defined]
        runs = _component_runs(qualified_name)
        return (not plain.isdisjoint(runs)
                or any(fnmatch.fnmatchcase(run, glob) for glob in globs for run in runs))

    def should_quantize(self, qualified_name: str, module: nn.Module) -> bool:
        """Whether this module is a layer the config selects (:func:`quantizable_layers` also
        keeps layers with tied weights in full precision).

        Args:
            qualified_name: its name in ``model.named_modules()``.
            module: the module.

        Returns:
            True for an ``nn.Linear`` (or ``nn.Conv2d`` with ``quantize_conv``) that no pattern
            excludes; False for anything else, already-quantized layers included. With
            ``w8a8`` also False for a layer whose weight requires grad and for peft adapter
            layers (:func:`is_trainable_for_w8a8`).
        """
        if isinstance(module, _QuantizedWeightModule) or isinstance(module, _NOT_REPLACEABLE):
            return False
        if not (isinstance(module, nn.Linear)
                or (self.quantize_conv and isinstance(module, nn.Conv2d))):
            return False
        if self.w8a8 and is_trainable_for_w8a8(qualified_name, module):
            return False
        return not self.is_excluded(qualified_name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (format configs as ``{"format": ..., **fields}``)."""
        weights: Any = self.weights_dtype
        if isinstance(weights, QuantFormat):
            weights = weights.value
        elif not isinstance(weights, str):
            weights = {"format": weights.format.value, **dataclasses.asdict(weights)}
        return {"weights_dtype": weights, "activations_dtype": self.activations_dtype,
                "modules_to_not_quantize": list(self.modules_to_not_quantize),
                "group_size": self.group_size, "min_sqnr_db": self.min_sqnr_db,
                "quantize_conv": self.quantize_conv, "w8a8": self.w8a8}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: for unknown keys or invalid values.
        """
        values = check_known_fields(cls, data)
        weights = values.get("weights_dtype")
        if isinstance(weights, Mapping):
            fields = dict(weights)
            values["weights_dtype"] = config_from_dict(str(fields.pop("format", "")), fields)
        return cls(**values)


QuantoConfig = QuantizationConfig  # the seed's name (EriDiffusion's QuantoConfig)

_GLOB_CHARS = frozenset("*?[")


# peft keeps adapters in containers named lora_A, lora_B, lora_embedding_A, lora_magnitude_vector...
_ADAPTER_PREFIX = "lora_"


def is_trainable_for_w8a8(qualified_name: str, module: nn.Module) -> bool:
    """Whether the W8A8 walk must keep this layer: its weight requires grad (W8A8 gives the
    weight no gradient, so replacing it would stop its training silently) or it lies in a peft
    adapter container (a path component starting with ``lora_``), trainable or not.

    Args:
        qualified_name: its name in ``model.named_modules()``.
        module: the layer.

    Returns:
        True when the layer must stay as it is.
    """
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.requires_grad:
        return True
    return any(part.startswith(_ADAPTER_PREFIX) for part in qualified_name.split("."))


def _component_runs(qualified_name: str) -> list[str]:
    """Every run of whole path components of a dotted name: ``"a.b.c"`` gives ``"a"``,
    ``"a.b"``, ``"a.b.c"``, ``"b"``, ``"b.c"`` and ``"c"``.

    Names are matched against any run, not only a prefix: modules are named from wherever the
    model was wrapped (``"proj_out"`` in a transformer is ``"transformer.proj_out"`` in a
    pipeline), and a run that ends before the last component names an ancestor, whose whole
    subtree is then kept.
    """
    parts = qualified_name.split(".")
    return [".".join(parts[start:stop])
            for start in range(len(parts)) for stop in range(start + 1, len(parts) + 1)]


def _split_patterns(patterns: Sequence[str]) -> tuple[frozenset[str], tuple[str, ...]]:
    """Plain names (matched by set lookup) and shell-style patterns (matched by fnmatch)."""
    plain = frozenset(p for p in patterns if not _GLOB_CHARS.intersection(p))
    return plain, tuple(p for p in patterns if p not in plain)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(||ref||² / ||ref - approx||²)`` in dB.

    Args:
        reference: the full-precision tensor.
        approximation: its dequantized version (same shape).

    Returns:
        The SQNR (``inf`` for an exact copy, ``-inf`` for an all-zero reference with error).
        Computed in float64 on the tensors' device; one host sync.
    """
    ref = reference.detach().to(torch.float64)
    noise = (ref - approximation.detach().to(torch.float64).reshape(ref.shape)).square().sum()
    signal = ref.square().sum()
    noise_f, signal_f = float(noise), float(signal)
    if noise_f == 0.0:
        return math.inf
    if signal_f == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_f / noise_f)


def model_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each tensor counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def quantizable_layers(model: nn.Module, config: QuantizationConfig
                       ) -> list[tuple[str, nn.Module]]:
    """The layers of ``model`` that ``config`` replaces: the one selection of vramkit's
    quantization walk (:func:`quantize_model`, and ``load_into`` while it streams weights).

    A layer is selected when :meth:`QuantizationConfig.should_quantize` holds (an ``nn.Linear``,
    or an ``nn.Conv2d`` with ``quantize_conv``, that no ``modules_to_not_quantize`` pattern
    excludes and that is not quantized already) and its weight is not shared with another
    module (tied embeddings and heads stay in full precision). The root module is never
    selected: it has no parent to be replaced in.

    Args:
        model: the model; its weights may be on the meta device (nothing is read).
        config: a :class:`QuantizationConfig`.

    Returns:
        ``(qualified name, layer)`` in ``model.named_modules()`` order; a layer registered at
        several places appears once, under its first name.
    """
    return _select_layers(model, config)[0]


def _select_layers(model: nn.Module, config: QuantizationConfig
                   ) -> tuple[list[tuple[str, nn.Module]], int]:
    """:func:`quantizable_layers`, and how many selected layers were left out as tied."""
    shared = _shared_weights(model)
    layers: list[tuple[str, nn.Module]] = []
    tied = 0
    trainable: list[str] = []
    # The loader hands any config with should_quantize / weight_format through here: only a
    # QuantizationConfig knows about W8A8.
    w8a8 = getattr(config, "w8a8", False)
    for name, module in model.named_modules():
        if not name or not config.should_quantize(name, module):
            if (name and w8a8 and is_trainable_for_w8a8(name, module)
                    and not config.is_excluded(name)
                    and isinstance(module, (nn.Linear, nn.Conv2d))):
                trainable.append(name)
            continue
        if id(module.weight) in shared:
            logger.info("keeping %s in full precision: its weight is shared (tied)", name)
            tied += 1
            continue
        layers.append((name, module))
    if trainable:
        # Said at warning level when it leaves nothing to replace: an unfrozen model.
        log = logger.warning if not layers else logger.info
        log("w8a8 keeps %d trainable or adapter layers as they are (W8A8 gives weights no "
            "gradient), e.g. %s%s", len(trainable), ", ".join(trainable[:3]),
            "" if layers else "; freeze the base model first (model.requires_grad_(False))")
    return layers, tied


def quantize_weight(weight: torch.Tensor, config: QuantizationConfig, *, name: str = "weight"
                    ) -> QuantizedTensor | None:
    """A layer's weight in ``config``'s format, as the walk quantizes it.

    Args:
        weight: the full-precision weight (real, not meta).
        config: a :class:`QuantizationConfig`.
        name: the weight's name, for messages (default ``"weight"``).

    Returns:
        The :class:`QuantizedTensor`, or None when the weight's SQNR is below
        ``config.min_sqnr_db`` (the layer then stays in full precision).

    Raises:
        QuantizationError: for a meta weight or an unsupported dtype.
    """
    _check_not_meta(name, weight)
    fmt = config.weight_format()
    if config.w8a8_kind is not None:  # one scale per output channel: a block spans the row
        fmt = w8a8_weight_format(config.w8a8_kind, weight[0].numel() if weight.dim() else 1)
    q = quantize_tensor(weight.detach(), fmt)
    if config.min_sqnr_db is not None:
        quality = sqnr_db(weight, q.dequantize(torch.float32))
        if quality < config.min_sqnr_db:
            logger.info("keeping %s in full precision: SQNR %.1f dB < min_sqnr_db %.1f", name,
                        quality, config.min_sqnr_db)
            return None
    return q


def quantize_model(model_or_state_dict: nn.Module | Mapping[str, Any],
                   config: QuantizationConfig) -> Any:
    """Quantize the weights of a model (in place) or of a state dict (seed ``quantize_model``).

    For a module, every ``nn.Linear`` (and ``nn.Conv2d`` with ``config.quantize_conv``) selected
    by :meth:`QuantizationConfig.should_quantize` is replaced by a :class:`QuantizedLinear` /
    :class:`QuantizedConv2d` holding only the packed weight; the original weight's storage is
    released (its ``Parameter`` is emptied), so model bytes drop to about 0.52x (int8, fp8) or
    0.27x (int4, nf4) of bf16. Biases are kept as they are (same ``Parameter`` objects).
    Weights shared by several modules (tied embeddings) stay in full precision.

    For a state dict, every floating 2-D tensor (4-D with ``quantize_conv``) whose key ends in
    ``weight`` and whose module is not excluded becomes a :class:`QuantizedTensor`; other
    entries are passed through. The input dict is not modified.

    Args:
        model_or_state_dict: an ``nn.Module`` with real (not meta) weights, or a mapping of
            name -> tensor.
        config: a :class:`QuantizationConfig`.

    Returns:
        The same module (a new :class:`QuantizedLinear`/:class:`QuantizedConv2d` when the module
        itself is a bare ``nn.Linear``/``nn.Conv2d``), or a new dict
        ``{name: QuantizedTensor | Tensor}``.

    Raises:
        ConfigError: when ``config`` is not a :class:`QuantizationConfig`.
        QuantizationError: for an already-quantized layer or tensor that the config selects,
            meta weights, or unsupported weight dtypes.
    """
    if not isinstance(config, QuantizationConfig):
        raise ConfigError(f"config must be a QuantizationConfig, got {type(config).__name__}",
                          hint="Pass a QuantizationConfig, e.g. quantize_model(model, "
                               "QuantizationConfig(weights_dtype='int8')).")
    if isinstance(model_or_state_dict, nn.Module):
        return _quantize_module(model_or_state_dict, config)
    if isinstance(model_or_state_dict, Mapping):
        return _quantize_state_dict(model_or_state_dict, config)
    raise ConfigError(f"quantize_model needs an nn.Module or a state dict, got "
                      f"{type(model_or_state_dict).__name__}",
                      hint="Pass the model (nn.Module) or its state_dict() (a dict of name -> "
                           "tensor).")


def quantized_layer(layer: nn.Module, weight: QuantizedTensor, bias: torch.Tensor | None,
                    config: QuantizationConfig, *, name: str = "<layer>") -> nn.Module:
    """What replaces ``layer`` in the walk: a :class:`QuantizedConv2d` or :class:`QuantizedLinear`
    around its quantized weight.

    A Linear runs the fp8 GEMM when ``config.activation_fp8`` holds and the GEMM takes its shape
    (:func:`vramkit.quant.kernels.fp8_gemm_fits`); otherwise it runs weight-only. With
    ``config.w8a8`` a Linear becomes a :class:`~vramkit.quant.w8a8.W8A8Linear` (which runs a
    dequantized matmul for shapes its GEMMs cannot take, and says so). The new layer takes
    ``layer``'s training mode.

    Args:
        layer: the ``nn.Linear`` or ``nn.Conv2d`` replaced (its geometry and features are read;
            it may be on the meta device).
        weight: its weight, quantized (:func:`quantize_weight`).
        bias: the new layer's bias (a ``Parameter`` is kept as is), or None.
        config: the :class:`QuantizationConfig` ``weight`` was quantized with.
        name: the layer's qualified name, for messages.

    Returns:
        The quantized layer.

    Raises:
        QuantizationError: for a layer that is neither an ``nn.Linear`` nor an ``nn.Conv2d``.
    """
    if isinstance(layer, nn.Conv2d):
        new: nn.Module = QuantizedConv2d.from_quantized(weight, bias, **conv_geometry(layer))
    elif isinstance(layer, nn.Linear) and config.w8a8:
        new = W8A8Linear.from_quantized(weight, bias, name=name)
    elif isinstance(layer, nn.Linear):
        fp8_gemm = config.activation_fp8 and fp8_gemm_fits(layer.in_features, layer.out_features)
        if config.activation_fp8 and not fp8_gemm:
            logger.info("%s (%d -> %d) runs weight-only: the fp8 GEMM needs features divisible "
                        "by %d", name, layer.in_features, layer.out_features, FP8_GEMM_MULTIPLE)
        new = QuantizedLinear.from_quantized(weight, bias, activation_fp8=fp8_gemm)
    else:
        raise QuantizationError(f"{name} is a {type(layer).__name__}; only nn.Linear and "
                                "nn.Conv2d layers are replaced by quantized ones",
                                hint="Exclude this layer with "
                                     "QuantizationConfig.modules_to_not_quantize, or quantize its "
                                     "weight tensor with quantize_tensor.")
    new.train(layer.training)
    return new


def _selects_tensor(key: str, value: Any, config: QuantizationConfig) -> bool:
    """The state-dict form of the selection: a floating 2-D weight (4-D with ``quantize_conv``)
    whose module (``"a.b"`` for ``"a.b.weight"``) no pattern excludes."""
    module_name, _, leaf = key.rpartition(".")
    return (isinstance(value, torch.Tensor) and leaf == "weight"
            and value.dim() in ((2, 4) if config.quantize_conv else (2,))
            and value.is_floating_point() and not config.is_excluded(module_name))


def _quantize_state_dict(state: Mapping[str, Any], config: QuantizationConfig
                         ) -> dict[str, QuantizedTensor | torch.Tensor]:
    _warn_unmatched([key.rpartition(".")[0] for key in state if "." in key], "state dict",
                    config)
    out: dict[str, QuantizedTensor | torch.Tensor] = {}
    for key, value in state.items():
        module_name, _, leaf = key.rpartition(".")
        if isinstance(value, QuantizedTensor):
            if leaf == "weight" and not config.is_excluded(module_name):
                raise QuantizationError(f"{key} is already quantized",
                                        hint="Quantize the float state dict, or exclude it with "
                                             "modules_to_not_quantize.")
            out[key] = value
            continue
        if _selects_tensor(key, value, config):
            q = quantize_weight(value, config, name=key)
            out[key] = q if q is not None else value
        else:
            out[key] = value
    return out


def _check_not_meta(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise QuantizationError(f"{name} is on the meta device: there is nothing to quantize",
                                hint="Load the real weights first (or quantize the state dict "
                                     "as it is loaded).")


def _quantize_module(model: nn.Module, config: QuantizationConfig) -> nn.Module:
    if isinstance(model, (_QuantizedWeightModule, W8A8Linear)):
        raise QuantizationError(f"{type(model).__name__} is already quantized",
                                hint="Quantize the original float model; a quantized model is "
                                     "ready to use as is (save and reload it with save_quantized / "
                                     "load_quantized_model).")
    if config.should_quantize("", model):  # a bare layer: nothing to replace it in
        replaced = _replace_layer("<root>", model, config)
        return replaced if replaced is not None else model
    for name, module in model.named_modules():
        if (isinstance(module, (_QuantizedWeightModule, W8A8Linear))
                and not config.is_excluded(name)):
            raise QuantizationError(
                f"{name} is already quantized ({type(module).__name__})",
                hint="quantize_model runs once per model; to quantize the remaining float "
                     "layers list the quantized ones in modules_to_not_quantize.")
    _warn_unmatched([name for name, _ in model.named_modules() if name],
                    type(model).__name__, config)
    before = model_bytes(model)
    layers, kept = _select_layers(model, config)
    # Every (parent, attribute) slot of each module: a module registered twice is replaced at
    # both places by one quantized layer.
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for attr, child in parent._modules.items():
            if child is not None:
                slots.setdefault(id(child), []).append((parent, attr))
    quantized = 0
    for name, module in layers:
        replacement = _replace_layer(name, module, config)
        if replacement is None:
            kept += 1
            continue
        for parent, attr in slots.get(id(module), []):
            setattr(parent, attr, replacement)
        quantized += 1
    after = model_bytes(model)
    dequantizing = [name for name, m in model.named_modules()
                    if isinstance(m, W8A8Linear) and m.kernel == "dequantize"]
    if dequantizing:
        logger.warning("w8a8: %d layers run a dequantized matmul (features the 8-bit GEMMs "
                       "cannot take), e.g. %s", len(dequantizing), ", ".join(dequantizing[:3]))
    logger.info("quantize_model: %d layers quantized to %s (%d kept in full precision); "
                "parameters + buffers %s -> %s", quantized, _format_label(config), kept,
                format_size(before), format_size(after))
    return model


def _warn_unmatched(names: Sequence[str], what: str, config: QuantizationConfig) -> None:
    """Warn about names in ``modules_to_not_quantize`` that match none of ``names``: a
    misspelt name would otherwise quantize the layers it was meant to keep, silently."""
    if not config.modules_to_not_quantize:
        return
    runs = {run for name in names if name for run in _component_runs(name)}
    plain, globs = _split_patterns(config.modules_to_not_quantize)
    unmatched = [p for p in plain if p not in runs]
    unmatched += [g for g in globs if not any(fnmatch.fnmatchcase(r, g) for r in runs)]
    for pattern in sorted(unmatched):
        logger.warning("modules_to_not_quantize: %r matches no module of this %s, so it keeps "
                       "nothing in full precision (names look like %s)", pattern, what,
                       ", ".join(repr(n) for n in names[:3] if n) or "nothing")


def _format_label(config: QuantizationConfig) -> str:
    label = config.weight_format().format.value
    if config.w8a8:
        return label + " W8A8 (per-channel weights, per-token activations)"
    return label + ("+fp8-activations" if config.activation_fp8 else "")


def _replace_layer(name: str, module: nn.Module, config: QuantizationConfig
                   ) -> nn.Module | None:
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        return None
    q = quantize_weight(weight, config, name=f"{name}.weight")
    if q is None:
        return None
    layer = quantized_layer(module, q, module.bias, config, name=name)
    _release(weight)
    return layer


def _shared_weights(model: nn.Module) -> set[int]:
    """Ids of weights registered in more than one module (tied embeddings and heads)."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
    return {pid for pid, mods in owners.items() if len(mods) > 1}
