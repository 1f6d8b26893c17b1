"""Tools for looking at a model on the meta device: bf16 autocast that works on meta tensors,
and quantized layers of the exact packed layout without any data.

Planning happens before any weight exists. ``torch.autocast`` acts on CUDA/CPU tensors only, so
:class:`MetaAutocast` plays its part for meta tensors; :func:`quantize_on_meta` replaces a
model's frozen layers by quantized ones whose packed buffers have the exact shapes and dtypes
the real quantization would give, so the swapper's rule measures their bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["MetaAutocast", "quantize_on_meta", "trainable_module_names"]

_LOW_PRECISION_OPS = frozenset({
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.scaled_dot_product_attention, torch.matmul,
    torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.Tensor.mm, torch.Tensor.bmm})
_FLOAT32_OPS = frozenset({F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax,
                          torch.Tensor.softmax, F.mse_loss})


def _autocast_cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_autocast_cast(v, dtype) for v in value)
    return value


class MetaAutocast(TorchFunctionMode):
    """Autocast for meta tensors (``torch.autocast`` acts on CUDA/CPU tensors only).

    Follows CUDA autocast's lists for the ops transformer and UNet models use: matmuls,
    convolutions and attention in ``dtype`` (default bf16); norms, softmax and the loss in fp32.
    The casts' copies are real tensors autograd may save, as under autocast. Attention called
    with keyword arguments (diffusers' dispatcher) is passed on positionally.

    Args:
        dtype: the low-precision dtype (default ``torch.bfloat16``).
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and len(args) < 3:
            args = (*(kwargs.pop(k) for k in ("query", "key", "value")), *args)
        if func in _LOW_PRECISION_OPS:
            dtype = self.dtype
        elif func in _FLOAT32_OPS:
            dtype = torch.float32
        else:
            return func(*args, **kwargs)
        return func(*_autocast_cast(args, dtype),
                    **{k: _autocast_cast(v, dtype) for k, v in kwargs.items()})


def trainable_module_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules that own a trainable parameter (LoRA adapters)."""
    return [name for name, module in model.named_modules()
            if name and any(p.requires_grad for p in module.parameters(recurse=False))]


def quantize_on_meta(module: nn.Module, weight_format: str) -> nn.Module:
    """Replace ``module``'s frozen layers by quantized ones holding meta storage of the exact
    packed layout (the selection of :func:`vramkit.quant.model.quantize_model`, modules that own
    trainable parameters excluded). In place; returns ``module``.

    Args:
        module: a model or block on the meta device.
        weight_format: ``"int8"``, ``"int4"``, ``"nf4"`` or ``"fp8"``, or a W8A8 format
            (``"fp8-w8a8"``, ``"int8-w8a8"``: :class:`~vramkit.quant.w8a8.W8A8Linear` layers,
            one fp32 scale per output row).
    """
    from vramkit.planning.w8a8 import storage_config
    from vramkit.quant.formats import QuantizedTensor, expected_layout
    from vramkit.quant.model import quantizable_layers, quantized_layer
    from vramkit.quant.w8a8 import w8a8_weight_format

    config = storage_config(weight_format, trainable_module_names(module))
    for name, layer in quantizable_layers(module, config):
        # W8A8: one scale per output row, as quantize_weight stores it
        fmt = (w8a8_weight_format(config.w8a8_kind, layer.weight[0].numel())
               if config.w8a8_kind is not None else config.weight_format())
        tensors = {key: torch.empty(shape, dtype=dtype, device="meta")
                   for key, (shape, dtype) in expected_layout(fmt, layer.weight.shape).items()}
        q = QuantizedTensor(config=fmt, data=tensors["data"], scales=tensors["scales"],
                            zero_points=tensors.get("zero_points"), shape=layer.weight.shape,
                            dtype=layer.weight.dtype,
                            extras={k.removeprefix("extra."): v for k, v in tensors.items()
                                    if k.startswith("extra.")})
        parent, _, attr = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, attr, quantized_layer(layer, q, layer.bias, config, name=name))
    return module
