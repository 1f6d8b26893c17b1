"""Frozen quantized layers that train through: :class:`QuantizedLinear` and :class:`QuantizedConv2d`.

A quantized layer holds **only the packed weight storage** (codes, scales, zero points and the
format's extras, see :class:`~vramkit.quant.formats.QuantizedTensor`) as module *buffers*, plus an
optional bias ``Parameter``. Buffers, because then ``.to()``, ``state_dict`` and vramkit's
:class:`~vramkit.offload.swap.BlockSwapper` see them: the swapper moves buffers >= 64 KiB as raw
bytes, so a quantized block crosses PCIe as its packed bytes (about half of bf16 for int8/fp8, a
quarter for int4/nf4) and is dequantized on the GPU. The layer reads its buffers at every forward
(:attr:`QuantizedLinear.quantized_weight` is rebuilt from them each call), which is what lets the
swapper repoint them between slots.

Training through the layer (LoRA on a quantized base): the forward and backward run in one
``torch.autograd.Function``. It saves the *packed* buffers (never a full-precision weight) and its
backward re-dequantizes them to compute ``grad_input = grad_output @ W``. The weight never gets a
gradient; the bias gets one when it requires grad. Adapters: vramkit's
:class:`vramkit.recipes.lora.LoRALinear` wraps a :class:`QuantizedLinear` as it wraps an ``nn.Linear``;
for peft call :func:`register_peft_lora` on the ``LoraConfig`` before ``get_peft_model``.

Autocast: inside ``torch.autocast`` the input (and bias) are cast to the autocast dtype before
the quantized matmul, as autocast does for ``F.linear``/``F.conv2d``; the output is in that dtype.
Outside autocast the output has the input's dtype and the bias is cast to it.

``torch.compile``: the layers trace (the CPU fallback is plain torch ops; on CUDA the kernels are
PyTorch custom ops registered by :mod:`vramkit.quant.kernels`, used while compiling; eager calls go
straight to the Triton kernels, which saves the dispatcher's host time).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import QuantizationError
from vramkit.quant import kernels
from vramkit.quant.formats import (
    FP8Config,
    QuantConfigT,
    QuantFormat,
    QuantizedTensor,
    apply_device_only,
    format_config,
    quantize_tensor,
)

if TYPE_CHECKING:
    from vramkit.quant.dense import DenseGroup

__all__ = ["QuantizedConv2d", "QuantizedLinear", "register_peft_lora"]

logger = logging.getLogger(__name__)

# Buffer name of each stored tensor of a QuantizedTensor (keys of QuantizedTensor.tensors()).
_BUFFER_PREFIX = "weight_"
_EXTRA_KEY = "extra."


@dataclass(frozen=True)
class WeightLayout:
    """Everything about a quantized weight except its tensors (hashable, so torch.compile can
    treat it as a constant): the format config, the original shape and dtype, and the names of
    the stored tensors, in the order they are passed around."""

    config: QuantConfigT
    shape: torch.Size
    dtype: torch.dtype
    names: tuple[str, ...]  # keys of QuantizedTensor.tensors(): "data", "scales", ...
    # Derived once from the fields above: how to dequantize tensors of this layout.
    dequantize: kernels.DequantPlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dequantize",
                           kernels.DequantPlan(self.config, self.shape, self.names))

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> QuantizedTensor:
        """The :class:`QuantizedTensor` whose stored tensors are ``tensors`` (in ``names`` order).

        Args:
            tensors: one tensor per name.

        Returns:
            A record sharing the given tensors (nothing copied).
        """
        by_name = dict(zip(self.names, tensors, strict=True))
        extras = {name[len(_EXTRA_KEY):]: t for name, t in by_name.items()
                  if name.startswith(_EXTRA_KEY)}
        return QuantizedTensor(config=self.config, data=by_name["data"],
                               scales=by_name["scales"], zero_points=by_name.get("zero_points"),
                               shape=self.shape, dtype=self.dtype, extras=extras)


def _buffer_name(tensor_name: str) -> str:
    # Buffer names may not contain dots: "extra.row_scales" -> "weight_extra_row_scales".
    return _BUFFER_PREFIX + tensor_name.replace(".", "_")


def _check_float_weight(weight: torch.Tensor, what: str) -> None:
    if weight.device.type == "meta":
        raise QuantizationError(f"cannot quantize {what}: its weight is on the meta device",
                                hint="Materialize the model (to_empty + load the weights) "
                                     "before quantizing it.")


class _QuantizedWeightModule(nn.Module):
    """Shared storage handling of the quantized layers (buffers, ``weight``, ``.to()``)."""

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not isinstance(q, QuantizedTensor):
            raise QuantizationError(f"expected a QuantizedTensor, got {type(q).__name__}",
                                    hint="Build the layer with QuantizedLinear.from_linear(linear, "
                                         "'int8'), or pass quantize_tensor(weight, fmt).")
        names = tuple(q.tensors())
        for name in ("data", "scales"):
            if name not in names:
                raise QuantizationError(f"QuantizedTensor.tensors() has no {name!r} entry",
                                        hint="This is a vramkit bug; please report it.")
        self._layout = WeightLayout(q.config, torch.Size(q.shape), q.dtype, names)
        self._buffer_names = tuple(_buffer_name(name) for name in names)  # read at every call
        for name, tensor in q.tensors().items():
            self.register_buffer(_buffer_name(name), tensor.detach())
        if bias is not None and tuple(bias.shape) != (q.shape[0],):
            raise QuantizationError(f"bias shape {list(bias.shape)} does not match the "
                                    f"{q.shape[0]} outputs of the weight",
                                    hint="Pass a bias of shape [out_features] (the weight's first "
                                         "dimension), or None.")
        if isinstance(bias, nn.Parameter):
            # The same object: optimizers and tied references keep working.
            self.bias: nn.Parameter | None = bias
        elif bias is not None:
            self.bias = nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
        else:
            self.register_parameter("bias", None)

    # -- the packed weight -------------------------------------------------------------------

    def _packed(self) -> list[torch.Tensor]:
        # Read at every call: a BlockSwapper repoints these buffers between slots.
        buffers = self._buffers
        return [buffers[name] for name in self._buffer_names]  # type: ignore[misc]

    @property
    def quantized_weight(self) -> QuantizedTensor:
        """The weight as a :class:`QuantizedTensor` over this module's current buffers (cheap:
        nothing is copied)."""
        return self._layout.rebuild(self._packed())

    @property
    def weight(self) -> QuantizedTensor:
        """Alias of :attr:`quantized_weight`, so adapter wrappers that read ``base.weight.device``
        / ``.dtype`` (vramkit's ``LoRALinear``, peft) work. It is the packed record, not a
        tensor: call ``.dequantize()`` for a full-precision copy."""
        return self.quantized_weight

    @property
    def weight_format(self) -> QuantFormat:
        """The weight's quantization format."""
        return self._layout.config.format

    @property
    def quant_config(self) -> QuantConfigT:
        """The weight's format config (block/group size...)."""
        return self._layout.config

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the packed weight storage (data, scales, zero points, extras)."""
        return sum(t.numel() * t.element_size() for t in self._packed())

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A full-precision copy of the weight, in its original shape.

        Args:
            dtype: output dtype. Default: the original weight dtype.

        Returns:
            A new tensor on the buffers' device.
        """
        return self._layout.dequantize(self._packed(),
                                       self._layout.dtype if dtype is None else dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # nn.Module.to(dtype) casts floating buffers: that would turn fp8 codes and fp32 scales
        # into something the format cannot read. Packed buffers follow device moves only; the
        # recorded dtype (of dequantized weights) follows the cast.
        apply = super()._apply
        apply_device_only(self, self._buffer_names, fn, lambda: apply(fn, recurse))
        probe = fn(torch.empty(0, dtype=self._layout.dtype))
        if probe.dtype != self._layout.dtype and probe.dtype.is_floating_point:
            layout = self._layout
            self._layout = WeightLayout(layout.config, layout.shape, probe.dtype, layout.names)
        return self

    def _compute_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The input and bias in the dtype the matmul runs in (autocast's, else the input's)."""
        if not x.is_floating_point():
            raise QuantizationError(f"{type(self).__name__} needs a floating-point input, got "
                                    f"{x.dtype}",
                                    hint="Cast the input to a floating dtype first, e.g. "
                                         "x.to(torch.bfloat16).")
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            if x.dtype != dtype:  # Tensor.to costs the host a dispatch even when it is a no-op
                x = x.to(dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return x, bias


def _check_features(x: torch.Tensor, cols: int) -> None:
    if x.shape[-1] != cols:
        raise QuantizationError(f"activations end in {x.shape[-1]} features, the weight "
                                f"takes {cols}",
                                hint="Give x a last dimension of the layer's in_features.")


class _DenseUse(NamedTuple):
    """A layer's weight from its :class:`~vramkit.quant.dense.DenseGroup` for one call."""

    group: DenseGroup
    index: int
    weight: torch.Tensor


def _linear(x: torch.Tensor, bias: torch.Tensor | None, layout: WeightLayout,
            activation_fp8: bool, packed: Sequence[torch.Tensor]) -> torch.Tensor:
    """A quantized layer's output from its packed weight (checked input, compute dtype)."""
    plan = layout.dequantize
    if activation_fp8:  # the fp8 GEMM
        return kernels.quantized_matmul(x, layout.rebuild(packed), bias, activation_fp8=True)
    if x.is_cuda and x.numel() <= kernels.FUSED_MAX_TOKENS * plan.cols:
        return plan.few_tokens(x, packed, bias)  # the fused decode kernel
    return F.linear(x, plan(packed, x.dtype), bias)


class _QuantizedLinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` with W packed; backward re-dequantizes W for ``grad_x``.

    Kept lean on purpose: a block of quantized layers is host-bound on a fast GPU, so the
    common case (weight-only, more than a few tokens) dequantizes through the layer's
    :class:`~vramkit.quant.kernels.DequantPlan` and calls ``F.linear``, with no record rebuilt
    and nothing re-derived per call. A layer in a :class:`~vramkit.quant.dense.DenseGroup`
    passes its view of the group's dequantized weights (``dense``) instead; backward uses that
    view while the group's scratch still holds it, else dequantizes the saved packed bytes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layout: WeightLayout,
                activation_fp8: bool, dense: _DenseUse | None,
                *packed: torch.Tensor) -> torch.Tensor:
        plan = layout.dequantize
        _check_features(x, plan.cols)
        ctx.dense = None
        if dense is not None:  # the group's view (vramkit.quant.dense); the weight not kept
            out = F.linear(x, dense.weight, bias)
            ctx.dense = (dense.group, dense.index)
        else:
            out = _linear(x, bias, layout, activation_fp8, packed)
        ctx.plan = plan
        if ctx.needs_input_grad[0]:
            # The packed bytes, never a dequantized copy: inside a BlockSwapper these lie in a
            # slot and its saved-tensor hooks turn them into handles re-read in backward.
            ctx.save_for_backward(*packed)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = grad_bias = None
        plan = ctx.plan
        if ctx.needs_input_grad[0]:
            weight = None
            if ctx.dense is not None:  # still in the group's scratch (a recomputed block)?
                group, index = ctx.dense
                weight = group.current(index, grad_out.dtype)
            if weight is None:
                weight = plan(ctx.saved_tensors, grad_out.dtype)
            grad_x = grad_out @ weight
        if ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, plan.rows).sum(0)
        return (grad_x, grad_bias, None, None, None, *([None] * (len(ctx.needs_input_grad) - 5)))


class QuantizedLinear(_QuantizedWeightModule):
    """A frozen ``nn.Linear`` whose weight is stored quantized (int8, int4, nf4 or fp8).

    Build it with :meth:`from_linear` (or :func:`vramkit.quant.model.quantize_model` for a whole
    model) or :meth:`from_quantized`. Calling it computes ``x @ W.T + bias`` through
    :func:`vramkit.quant.kernels.quantized_matmul`; backward gives the input gradient (and the
    bias gradient when the bias requires grad), never a weight gradient.

    Args:
        q: the quantized weight, shape ``[out_features, in_features]``.
        bias: optional bias ``[out_features]``; a ``Parameter`` is used as is (the same
            object), a tensor is copied into a new one keeping its ``requires_grad``. Default
            None.
        activation_fp8: run the forward matmul as an fp8 GEMM (inputs quantized per token to
            e4m3); needs an fp8 weight with channel granularity, and at forward time a CUDA GPU
            of capability >= 8.9 (else :class:`~vramkit.errors.QuantizationError`). Backward
            always runs in the input's dtype. Default False.

    Raises:
        QuantizationError: for a weight that is not 2-D, or ``activation_fp8`` with a weight
            that is not fp8 per channel.
    """

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                 activation_fp8: bool = False) -> None:
        super().__init__(q, bias)
        if len(q.shape) != 2:
            raise QuantizationError(f"QuantizedLinear needs a 2-D weight, got shape "
                                    f"{list(q.shape)}",
                                    hint="Quantize a 2-D [out_features, in_features] weight here, "
                                         "or use QuantizedConv2d for 4-D conv weights.")
        if activation_fp8 and not _fp8_per_channel(q.config):
            raise QuantizationError(
                "activation_fp8 needs an fp8 weight with channel granularity, got "
                f"{q.config!r}", hint="Use QuantizationConfig(weights_dtype='fp8', "
                                      "activations_dtype='fp8').")
        self.out_features, self.in_features = int(q.shape[0]), int(q.shape[1])
        self.activation_fp8 = bool(activation_fp8)
        # (group, index) while vramkit.quant.dense groups this layer with its block's others
        self._dense: tuple[DenseGroup, int] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt_config: str | QuantFormat | QuantConfigT = "int8",
                    *, group_size: int | None = None, activation_fp8: bool = False,
                    release_weight: bool = True) -> QuantizedLinear:
        """Quantize an ``nn.Linear``.

        Args:
            linear: the layer (a real, floating-point weight; not meta).
            fmt_config: a format name, :class:`QuantFormat` or format config. Default "int8".
            group_size: override of the format's group/block size. Default None (format's).
            activation_fp8: see the class. Default False.
            release_weight: free the original weight's storage (its ``.data`` becomes an empty
                tensor), so memory drops even while something else references the old layer.
                Pass False when the weight is shared with another module. Default True.

        Returns:
            The new layer, on the weight's device; the bias ``Parameter`` is reused.

        Raises:
            QuantizationError: for an already-quantized layer, a meta or non-floating weight.
        """
        if isinstance(linear, _QuantizedWeightModule):
            raise QuantizationError(f"{type(linear).__name__} is already quantized",
                                    hint="Quantize the original nn.Linear, or skip this layer "
                                         "with modules_to_not_quantize.")
        if not isinstance(linear, nn.Linear):
            raise QuantizationError(f"from_linear needs an nn.Linear, got "
                                    f"{type(linear).__name__}",
                                    hint="Pass an nn.Linear layer; use QuantizedConv2d.from_conv2d "
                                         "for nn.Conv2d.")
        _check_float_weight(linear.weight, "this nn.Linear")
        q = quantize_tensor(linear.weight.detach(), format_config(fmt_config, group_size))
        layer = cls.from_quantized(q, linear.bias, activation_fp8=activation_fp8)
        if release_weight:
            _release(linear.weight)
        return layer

    @classmethod
    def from_quantized(cls, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                       activation_fp8: bool = False) -> QuantizedLinear:
        """Wrap an existing quantized weight (a loaded file, a quantized state dict).

        Args:
            q: the weight ``[out, in]``.
            bias: optional bias (a ``Parameter`` is reused as is). Default None.
            activation_fp8: see the class. Default False.

        Returns:
            The layer, sharing ``q``'s tensors.
        """
        return cls(q, bias, activation_fp8=activation_fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]``."""
        x, bias = self._compute_inputs(x)
        dense = self._dense
        no_grad = not torch.is_grad_enabled() or not (
            x.requires_grad or (bias is not None and bias.requires_grad))
        if (dense is not None and not self.activation_fp8
                and not torch.compiler.is_compiling()):
            group, index = dense
            if x.is_cuda and x.numel() <= kernels.FUSED_MAX_TOKENS * self.in_features:
                group.decodes(index)  # the fused kernel reads the packed weight: leave it out
            else:
                _check_features(x, self.in_features)
                weight = group.weight(index, x.dtype, x.device)
                if no_grad:
                    return F.linear(x, weight, bias)  # nothing to differentiate or save
                return _QuantizedLinearFunction.apply(
                    x, bias, self._layout, False, _DenseUse(group, index, weight),
                    *self._packed())
        if no_grad:  # e.g. a checkpointed block's forward: no autograd node
            _check_features(x, self.in_features)
            return _linear(x, bias, self._layout, self.activation_fp8, self._packed())
        return _QuantizedLinearFunction.apply(x, bias, self._layout, self.activation_fp8, None,
                                              *self._packed())

    def extra_repr(self) -> str:
        fp8 = ", activation_fp8=True" if self.activation_fp8 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self._layout.config!r}{fp8}")


class _QuantizedConv2dFunction(torch.autograd.Function):
    """``F.conv2d`` with W packed; backward re-dequantizes W for ``grad_x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layout: WeightLayout,
                conv: tuple[Any, ...], *packed: torch.Tensor) -> torch.Tensor:
        stride, padding, dilation, groups = conv
        weight = layout.dequantize(packed, x.dtype)
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.layout, ctx.conv, ctx.input_shape = layout, conv, x.shape
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(*packed)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        stride, padding, dilation, groups = ctx.conv
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = ctx.layout.dequantize(ctx.saved_tensors, grad_out.dtype)
            grad_x = torch.nn.grad.conv2d_input(ctx.input_shape, weight, grad_out, stride,
                                                padding, dilation, groups)
        if ctx.needs_input_grad[1]:
            grad_bias = grad_out.sum((0, 2, 3))
        return (grad_x, grad_bias, None, None, *([None] * len(ctx.layout.names)))


class QuantizedConv2d(_QuantizedWeightModule):
    """A frozen ``nn.Conv2d`` whose weight is stored quantized.

    The 4-D weight ``[out, in/groups, kh, kw]`` is quantized as ``[out, in/groups*kh*kw]`` (one
    row per output channel). Forward dequantizes it (on the GPU with Triton) and runs
    ``F.conv2d``; backward re-dequantizes for the input gradient. String padding ("same",
    "valid") and non-zero padding modes are applied as an explicit pad first, as ``nn.Conv2d``
    does for non-zero modes.

    Args:
        q: the quantized 4-D weight.
        bias: optional bias ``[out_channels]``. Default None.
        stride, padding, dilation, groups, padding_mode: as ``nn.Conv2d``.

    Raises:
        QuantizationError: for a weight that is not 4-D.
    """

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] | str = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1,
                 padding_mode: str = "zeros") -> None:
        super().__init__(q, bias)
        if len(q.shape) != 4:
            raise QuantizationError(f"QuantizedConv2d needs a 4-D weight, got shape "
                                    f"{list(q.shape)}",
                                    hint="Quantize a 4-D [out, in/groups, kh, kw] conv weight "
                                         "here, or use QuantizedLinear for 2-D weights.")
        # nn.Conv2d validates the geometry and computes the explicit padding of "same".
        probe = nn.Conv2d(q.shape[1] * groups, q.shape[0], tuple(q.shape[2:]), stride=stride,
                          padding=padding, dilation=dilation, groups=groups, bias=False,
                          padding_mode=padding_mode, device="meta")
        self.in_channels, self.out_channels = probe.in_channels, probe.out_channels
        self.kernel_size = probe.kernel_size
        self.stride, self.dilation, self.groups = probe.stride, probe.dilation, probe.groups
        self.padding, self.padding_mode = probe.padding, probe.padding_mode
        self._pre_pad: tuple[int, ...] | None = None
        self._conv_padding: tuple[int, int] = (0, 0)
        if isinstance(probe.padding, str) or padding_mode != "zeros":
            self._pre_pad = tuple(probe._reversed_padding_repeated_twice)
        else:
            self._conv_padding = probe.padding  # type: ignore[assignment]

    @classmethod
    def from_conv2d(cls, conv: nn.Conv2d, fmt_config: str | QuantFormat | QuantConfigT = "int8",
                    *, group_size: int | None = None,
                    release_weight: bool = True) -> QuantizedConv2d:
        """Quantize an ``nn.Conv2d`` (arguments as :meth:`QuantizedLinear.from_linear`)."""
        if isinstance(conv, _QuantizedWeightModule):
            raise QuantizationError(f"{type(conv).__name__} is already quantized",
                                    hint="Quantize the original nn.Conv2d, or skip this layer "
                                         "with modules_to_not_quantize.")
        if not isinstance(conv, nn.Conv2d):
            raise QuantizationError(f"from_conv2d needs an nn.Conv2d, got {type(conv).__name__}",
                                    hint="Pass an nn.Conv2d layer; use QuantizedLinear.from_linear "
                                         "for nn.Linear.")
        _check_float_weight(conv.weight, "this nn.Conv2d")
        q = quantize_tensor(conv.weight.detach(), format_config(fmt_config, group_size))
        layer = cls.from_quantized(q, conv.bias, **conv_geometry(conv))
        if release_weight:
            _release(conv.weight)
        return layer

    @classmethod
    def from_quantized(cls, q: QuantizedTensor, bias: torch.Tensor | None = None,
                       **geometry: Any) -> QuantizedConv2d:
        """Wrap an existing quantized 4-D weight; ``geometry`` as the constructor's keywords."""
        return cls(q, bias, **geometry)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, in_channels, H, W]`` -> ``[B, out_channels, H', W']``."""
        x, bias = self._compute_inputs(x)
        if self._pre_pad is not None:
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            x = F.pad(x, self._pre_pad, mode=mode)
        conv = (self.stride, self._conv_padding, self.dilation, self.groups)
        return _QuantizedConv2dFunction.apply(x, bias, self._layout, conv, *self._packed())

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}, "
                f"format={self._layout.config!r}")


def conv_geometry(conv: nn.Conv2d | QuantizedConv2d) -> dict[str, Any]:
    """The keywords that rebuild ``conv``'s geometry in :class:`QuantizedConv2d`."""
    return dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation,
                groups=conv.groups, padding_mode=conv.padding_mode)


def _fp8_per_channel(config: QuantConfigT) -> bool:
    return isinstance(config, FP8Config) and config.granularity == "channel"


def _release(param: torch.Tensor) -> None:
    """Free a float weight's storage in place (the Parameter object survives, empty)."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


# -- peft --------------------------------------------------------------------------------------

_PEFT_LAYER: type[nn.Module] | None = None


def _peft_layer_class() -> type[nn.Module]:
    global _PEFT_LAYER
    if _PEFT_LAYER is None:
        try:
            from peft.tuners.lora.layer import Linear as LoraLinear
        except ImportError as exc:
            raise QuantizationError("peft is not installed",
                                    hint="pip install 'vramkit[integration]'") from exc

        class QuantizedLoraLinear(LoraLinear):
            """peft's LoRA ``Linear`` over a :class:`QuantizedLinear` base. Merging an adapter
            into packed weights would need a re-quantization that loses the adapter's update,
            so merge/unmerge refuse."""

            def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
                # peft would find these too, after warning about an unknown layer type.
                return module.in_features, module.out_features

            def merge(self, safe_merge: bool = False,
                      adapter_names: list[str] | None = None) -> None:
                raise QuantizationError(
                    "cannot merge a LoRA adapter into a quantized base layer",
                    hint="Keep the adapter separate, or load the float model, merge there and "
                         "quantize the result.")

            def unmerge(self) -> None:
                raise QuantizationError("a quantized base layer holds no merged adapter",
                                        hint="Nothing was merged into a quantized layer, so there "
                                             "is nothing to unmerge; drop the unmerge() call (or "
                                             "use the float model).")

        _PEFT_LAYER = QuantizedLoraLinear
    return _PEFT_LAYER


def register_peft_lora(lora_config: Any) -> Any:
    """Teach a peft ``LoraConfig`` to adapt :class:`QuantizedLinear` layers (and
    :class:`~vramkit.quant.gguf.GGUFLinear` ones, whose packed GGUF bytes are the base).

    peft knows ``nn.Linear`` and a few quantization libraries; this registers a LoRA layer for
    :class:`QuantizedLinear` through peft's custom-module hook (its forward runs the quantized
    base, then adds ``lora_B(lora_A(x)) * scaling``; adapters are created on the base's device
    in its original dtype). Merging adapters into the packed base raises
    :class:`~vramkit.errors.QuantizationError`.

    Args:
        lora_config: a ``peft.LoraConfig``.

    Returns:
        The same config (registered in place), for chaining into ``get_peft_model``.

    Raises:
        QuantizationError: when peft is not installed.
    """
    from vramkit.quant.gguf import GGUFLinear  # a packed base of the same kind

    layer_class = _peft_layer_class()
    register = getattr(lora_config, "_register_custom_module", None)
    if register is None:
        raise QuantizationError(f"{type(lora_config).__name__} has no _register_custom_module",
                                hint="Pass a peft LoraConfig (peft >= 0.13).")
    register({QuantizedLinear: layer_class, GGUFLinear: layer_class})
    return lora_config
