"""Tools for looking at a model on the meta device: bf16 autocast that works on meta tensors,
and quantized layers of the exact packed layout without any data.

Planning happens before any weight exists. ``torch.autocast`` acts on CUDA/CPU tensors only, so
:class:`MetaAutocast` plays its part for meta tensors; :func:`quantize_on_meta` replaces a
model's frozen layers by quantized ones whose packed buffers have the exact shapes and dtypes
the real quantization would give, so the swapper's rule measures their bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["MetaAutocast", "meta_autocast_checks", "quantize_on_meta",
           "trainable_module_names"]

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

    #: entered again around a checkpointed part's recomputation in the backward
    #: (:data:`vramkit.offload.subblock.REPLAY_ATTRIBUTE`), as torch's checkpoint replays
    #: ``torch.autocast``
    replay_in_recompute = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype
        self.off = 0  # regions under torch.autocast("meta", enabled=False) entered

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if self.off:
            return func(*args, **(kwargs or {}))
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


@contextlib.contextmanager
def meta_autocast_checks(active: MetaAutocast | None) -> Iterator[None]:
    """Let a model's own autocast code run on meta tensors while a step is traced.

    Adapter and model code asks autocast about its input's device --
    ``torch.is_autocast_enabled(x.device.type)``, ``torch.get_autocast_dtype(...)``, ``with
    torch.autocast(x.device.type, enabled=False)`` (an adapter computing in float32) -- and
    PyTorch knows no autocast for ``"meta"``: each raises. Inside this context ``"meta"``
    answers as ``active`` (the trace's :class:`MetaAutocast`, ``None`` for none) sets it, and
    ``torch.autocast("meta", enabled=False)`` turns ``active``'s casts off for its region.
    The functions are replaced process-wide while the context lasts (a trace is short and
    runs on one thread); other devices go to PyTorch's own.
    """
    amp = torch.amp.autocast_mode.autocast
    saved = (torch.is_autocast_enabled, torch.get_autocast_dtype, amp.__init__, amp.__enter__,
             amp.__exit__)
    is_enabled, get_dtype, init, enter, leave = saved

    def meta_is_enabled(*args: Any) -> bool:
        if args and args[0] == "meta":
            return active is not None and not active.off
        return is_enabled(*args)

    def meta_get_dtype(device_type: str) -> torch.dtype:
        if device_type == "meta":
            return active.dtype if active is not None else torch.bfloat16
        return get_dtype(device_type)

    def meta_init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type != "meta":
            init(self, device_type, *args, **kwargs)
            return
        enabled = kwargs.get("enabled", args[1] if len(args) > 1 else True)
        self.device = "meta"
        self._vramkit_meta_off = not enabled

    def meta_enter(self: Any) -> Any:
        off = getattr(self, "_vramkit_meta_off", None)
        if off is None:
            return enter(self)
        if off and active is not None:
            active.off += 1
        return self

    def meta_exit(self: Any, *exc: Any) -> Any:
        off = getattr(self, "_vramkit_meta_off", None)
        if off is None:
            return leave(self, *exc)
        if off and active is not None:
            active.off -= 1
        return False

    torch.is_autocast_enabled = meta_is_enabled
    torch.get_autocast_dtype = meta_get_dtype
    amp.__init__ = meta_init
    amp.__enter__ = meta_enter
    amp.__exit__ = meta_exit
    try:
        yield
    finally:
        (torch.is_autocast_enabled, torch.get_autocast_dtype, amp.__init__, amp.__enter__,
         amp.__exit__) = saved


def trainable_module_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules that own a trainable parameter (LoRA adapters), or whose
    call reaches one of an adapter hooked in from outside (a layer whose ``forward`` a
    kohya-style network replaced, or with an adapter's forward hook): quantizing such a layer
    (a new module in its place) would drop the adapter."""
    from vramkit.offload._reach import reached_modules

    names = []
    for name, module in model.named_modules():
        if not name:
            continue
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            names.append(name)
        elif (module.__dict__.get("forward") is not None or module._forward_hooks
              or module._forward_pre_hooks):
            outside = reached_modules(module)[sum(1 for _ in module.modules()):]
            if any(p.requires_grad for m in outside for p in m.parameters(recurse=False)):
                names.append(name)
    return names


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
