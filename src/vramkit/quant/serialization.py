"""Quantized models in safetensors files whose ``__metadata__`` declares the layout.

A quantized weight is stored as its parts (packed codes, scales, zero points, extras), each a
plain safetensors tensor named ``"<key>:<part>"`` (``"blocks.0.fc1.weight:data"``). The file's
``__metadata__`` (string -> string) says how to put them back together, so any reader can:

* ``"vramkit.quant.format_version"``: ``"1"``;
* ``"vramkit.quant.layout"``: JSON object, one entry per quantized tensor key::

      {"blocks.0.fc1.weight": {
          "format": "int8",                           # int8 | int4 | nf4 | fp8
          "config": {"block_size": 32, ...},          # the format config's fields
          "shape": [1024, 256],                       # original shape
          "dtype": "bfloat16",                        # original (dequantized) dtype
          "tensors": {"data": "blocks.0.fc1.weight:data",
                      "scales": "blocks.0.fc1.weight:scales",
                      "zero_points": ..., "extra.<name>": ...},   # only the parts it has
          "record": {...},                            # QuantizedTensor.metadata(), verbatim
          "module": {"kind": "linear", "activation_fp8": false}   # model saves only
      }}

Every other tensor (biases, norms, layers kept in full precision) is stored under its own name.
User metadata passed to :func:`save_quantized` is kept beside these two keys. docs/quantization.md
("File layout") describes each part's bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from vramkit._files import atomic_path
from vramkit.devices.resolve import resolve_device
from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant.formats import QuantizedTensor
from vramkit.quant.linear import (
    QuantizedConv2d,
    QuantizedLinear,
    _QuantizedWeightModule,
    _release,
    conv_geometry,
)

__all__ = ["FORMAT_VERSION", "load_quantized", "load_quantized_model", "quantized_state_dict",
           "save_quantized"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"
VERSION_KEY = "vramkit.quant.format_version"
LAYOUT_KEY = "vramkit.quant.layout"
_PART_SEPARATOR = ":"


def quantized_state_dict(model: nn.Module) -> dict[str, QuantizedTensor | torch.Tensor]:
    """A model's state dict with each quantized layer's buffers folded into one
    :class:`QuantizedTensor` under ``"<layer>.weight"``.

    Args:
        model: any module (quantized layers or not).

    Returns:
        ``{name: QuantizedTensor | Tensor}`` (tensors detached, not copied).
    """
    state: dict[str, Any] = dict(model.state_dict(keep_vars=False))
    for name, module in model.named_modules():
        if not isinstance(module, _QuantizedWeightModule):
            continue
        prefix = f"{name}." if name else ""
        for buffer_name in list(module._buffers):
            state.pop(prefix + buffer_name, None)
        state[prefix + "weight"] = module.quantized_weight
    return state


def _module_info(model: nn.Module) -> dict[str, dict[str, Any]]:
    info = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantizedLinear):
            info[prefix + "weight"] = {"kind": "linear",
                                       "activation_fp8": module.activation_fp8}
        elif isinstance(module, QuantizedConv2d):
            info[prefix + "weight"] = {"kind": "conv2d"}
    return info


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_quantized(model_or_state_dict: nn.Module | Mapping[str, Any], path: str | os.PathLike[str],
                   metadata: Mapping[str, str] | None = None) -> None:
    """Write a quantized model or state dict to a safetensors file (layout in its metadata).

    Args:
        model_or_state_dict: a model (its quantized layers saved packed, see
            :func:`quantized_state_dict`) or a dict ``{name: QuantizedTensor | Tensor}`` (as
            :func:`~vramkit.quant.model.quantize_model` returns for a state dict).
        path: the file to write.
        metadata: extra string -> string metadata to store (default none); the keys
            ``vramkit.quant.*`` are reserved.

    Raises:
        ConfigError: for non-string metadata, reserved keys or bad values in the dict.
        QuantizationError: when a stored part's name collides with another tensor's.
    """
    from safetensors.torch import save_file

    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"safetensors metadata must map str to str, got {key!r}: {value!r}",
                              hint="Give metadata as a dict of strings, e.g. metadata={'step': "
                                   "str(step)}.")
        if key.startswith("vramkit.quant."):
            raise ConfigError(f"metadata key {key!r} is reserved for the quantized layout",
                              hint="Rename the key: keys starting with 'vramkit.quant.' are "
                                   "written by save_quantized itself.")
    if isinstance(model_or_state_dict, nn.Module):
        state = quantized_state_dict(model_or_state_dict)
        modules = _module_info(model_or_state_dict)
    elif isinstance(model_or_state_dict, Mapping):
        state, modules = dict(model_or_state_dict), {}
    else:
        raise ConfigError(f"save_quantized needs an nn.Module or a dict, got "
                          f"{type(model_or_state_dict).__name__}",
                          hint="Pass the model (nn.Module) or a dict of name -> "
                               "Tensor/QuantizedTensor, e.g. from quantize_model(state_dict, "
                               "config).")
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if isinstance(value, QuantizedTensor):
            parts = {}
            for part, tensor in value.tensors().items():
                stored = f"{key}{_PART_SEPARATOR}{part}"
                if stored in state:
                    raise QuantizationError(
                        f"the stored part {stored!r} of {key!r} collides with a tensor of that "
                        "name", hint=f"Tensor names may not end in '{_PART_SEPARATOR}<part>'.")
                parts[part] = stored
                tensors[stored] = tensor
            entry: dict[str, Any] = {
                "format": value.format.value, "config": _config_fields(value),
                "shape": list(value.shape), "dtype": _dtype_name(value.dtype), "tensors": parts,
                "record": value.metadata()}
            if key in modules:
                entry["module"] = modules[key]
            layout[key] = entry
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            raise ConfigError(f"{key}: expected a Tensor or QuantizedTensor, got "
                              f"{type(value).__name__}",
                              hint="Keep only tensors in the dict (torch.Tensor or "
                                   "QuantizedTensor); store other values in metadata= as strings.")
    user[VERSION_KEY] = FORMAT_VERSION
    user[LAYOUT_KEY] = json.dumps(layout, sort_keys=True)
    # Under a temporary name, renamed once whole: a save killed midway leaves the previous
    # checkpoint readable.
    with atomic_path(path) as temporary:
        save_file(_storable(tensors), os.fspath(temporary), metadata=user)
    logger.info("saved %d tensors (%d quantized) to %s", len(state), len(layout), path)


def _config_fields(q: QuantizedTensor) -> dict[str, Any]:
    return dataclasses.asdict(q.config)


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, no two sharing memory (safetensors refuses aliases)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (0, id(t))
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def _read_layout(metadata: Mapping[str, str] | None, path: str) -> dict[str, dict[str, Any]]:
    if not metadata or VERSION_KEY not in metadata or LAYOUT_KEY not in metadata:
        raise QuantizationError(
            f"{path} declares no vramkit quantized layout (no {VERSION_KEY!r} / {LAYOUT_KEY!r} "
            "in its metadata)",
            hint="Write it with vramkit.quant.save_quantized; a plain safetensors file loads "
                 "with safetensors.torch.load_file.")
    version = metadata[VERSION_KEY]
    if version != FORMAT_VERSION:
        raise QuantizationError(f"{path}: unknown quantized layout version {version!r} (this "
                                f"vramkit reads version {FORMAT_VERSION})",
                                hint="Upgrade vramkit to read files written by a newer one.")
    try:
        layout = json.loads(metadata[LAYOUT_KEY])
    except json.JSONDecodeError as exc:
        raise QuantizationError(
            f"{path}: the quantized layout is not valid JSON ({exc})",
            hint="The file's quantized layout was damaged; re-save it with "
                 "save_quantized.") from None
    if not isinstance(layout, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("tensors"), dict)
            and isinstance(v.get("record"), dict) for v in layout.values()):
        raise QuantizationError(f"{path}: unknown quantized layout (each entry needs 'tensors' "
                                "and 'record' objects)",
                                hint="The file was not written by save_quantized (or was edited); "
                                     "re-save it with save_quantized, or load it with safetensors "
                                     "directly.")
    return layout


def load_quantized(path: str | os.PathLike[str], device: str | torch.device = "cpu"
                   ) -> dict[str, QuantizedTensor | torch.Tensor]:
    """Read a file written by :func:`save_quantized`.

    Args:
        path: the safetensors file.
        device: where the tensors go: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"``, an int
            CUDA ordinal or a ``torch.device``.

    Returns:
        ``{name: QuantizedTensor | Tensor}``, quantized records rebuilt bit-exactly.

    Raises:
        InvalidDeviceError: for a value that is not a cpu or cuda device.
        DeviceError: for a CUDA device that is not there.
        QuantizationError: when the file declares no layout, an unknown version or layout, or
            a layout that names missing tensors.
    """
    from safetensors import safe_open

    target = resolve_device(device, owner="load_quantized", default="cpu")
    path_str = os.fspath(path)
    with safe_open(path_str, framework="pt", device=str(target)) as handle:
        layout = _read_layout(handle.metadata(), path_str)
        names = set(handle.keys())
        out: dict[str, QuantizedTensor | torch.Tensor] = {}
        parts_used: set[str] = set()
        for key, entry in layout.items():
            parts = {}
            for part, stored in entry["tensors"].items():
                if stored not in names:
                    raise QuantizationError(f"{path_str}: the layout of {key!r} names tensor "
                                            f"{stored!r}, which the file does not hold",
                                            hint="The file lost tensors after it was written; "
                                                 "re-save it with save_quantized.")
                parts[part] = handle.get_tensor(stored)
                parts_used.add(stored)
            record = {str(k): str(v) for k, v in entry["record"].items()}
            out[key] = QuantizedTensor.from_tensors(parts, record)
        for name in handle.keys():
            if name not in parts_used:
                out[name] = handle.get_tensor(name)
    return out


def _module_layout(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt", device="cpu") as handle:
        layout = _read_layout(handle.metadata(), os.fspath(path))
    return {k: v.get("module", {}) for k, v in layout.items()}


def load_quantized_model(model: nn.Module, path: str | os.PathLike[str], *,
                         strict: bool = True) -> nn.Module:
    """Load a quantized file into a model of the same architecture (float or quantized).

    Each quantized ``"<layer>.weight"`` of the file replaces the model's ``<layer>`` (an
    ``nn.Linear``/``nn.Conv2d`` or an existing quantized layer) by a :class:`QuantizedLinear` /
    :class:`QuantizedConv2d` on that layer's device, keeping the layer's geometry; a replaced
    float weight is released. The other tensors load through ``load_state_dict``.

    Args:
        model: the model (real tensors; a float model built from its config is fine).
        path: a file written by :func:`save_quantized`.
        strict: raise when the file and the model do not hold the same tensors (default True).

    Returns:
        The same model, changed in place.

    Raises:
        QuantizationError: unknown layout (see :func:`load_quantized`), a quantized entry whose
            layer is missing or not a Linear/Conv2d, or (strict) missing/unexpected tensors.
    """
    entries = load_quantized(path)
    modules_info = _module_layout(path)
    plain = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    rebuilt: set[str] = set()  # state-dict keys that the rebuilt layers took from the file
    for key, value in entries.items():
        if not isinstance(value, QuantizedTensor):
            continue
        layer_name, _, leaf = key.rpartition(".")
        if leaf != "weight":
            raise QuantizationError(f"quantized entry {key!r} is not a layer weight",
                                    hint="Only layer weights load into layers; read this file with "
                                         "load_quantized(path) as a state dict instead.")
        try:
            layer = model.get_submodule(layer_name)
        except AttributeError:
            raise QuantizationError(f"the model has no layer {layer_name!r} for quantized "
                                    f"weight {key!r}",
                                    hint="Build the model with the same architecture.") from None
        bias_key = f"{layer_name}.bias" if layer_name else "bias"
        file_bias = entries.get(bias_key)
        device = _layer_device(layer)
        q = value.to(device)
        bias = getattr(layer, "bias", None)
        if isinstance(file_bias, torch.Tensor):
            if isinstance(bias, nn.Parameter) and bias.device.type != "meta":
                # Keep the Parameter object (optimizers, tied references hold it).
                bias.data = file_bias.to(device)
            else:
                requires_grad = bool(getattr(bias, "requires_grad", False))
                bias = nn.Parameter(file_bias.to(device), requires_grad=requires_grad)
        elif isinstance(bias, nn.Parameter) and strict:
            raise QuantizationError(f"{os.fspath(path)} holds no {bias_key!r} for layer "
                                    f"{layer_name!r}, which has a bias",
                                    hint="Pass strict=False to keep the model's bias.")
        info = modules_info.get(key, {})
        if isinstance(layer, (nn.Conv2d, QuantizedConv2d)):
            new: nn.Module = QuantizedConv2d.from_quantized(q, bias, **conv_geometry(layer))
        elif isinstance(layer, (nn.Linear, QuantizedLinear)):
            new = QuantizedLinear.from_quantized(
                q, bias, activation_fp8=bool(info.get("activation_fp8", False)))
        else:
            raise QuantizationError(f"{layer_name!r} is a {type(layer).__name__}; quantized "
                                    "weights load into Linear or Conv2d layers",
                                    hint="Load into a model of the class the file was saved from, "
                                         "or read the file with load_quantized(path) as a state "
                                         "dict.")
        if isinstance(getattr(layer, "weight", None), nn.Parameter):
            _release(layer.weight)
        new.train(layer.training)
        _set_submodule(model, layer_name, new)
        plain.pop(bias_key, None)
        rebuilt.update(f"{layer_name}.{k}" for k in new.state_dict())
    # A model built on the meta device takes the file's tensors as they are (assign).
    assign = any(t.device.type == "meta" for t in model.parameters())
    result = model.load_state_dict(plain, strict=False, assign=assign)
    if strict:
        missing = [k for k in result.missing_keys if k not in rebuilt]
        if missing or result.unexpected_keys:
            raise QuantizationError(f"{os.fspath(path)} does not match the model: missing "
                                    f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}",
                                    hint="Pass strict=False to load what matches.")
    return model


def _layer_device(layer: nn.Module) -> torch.device:
    for tensor in list(layer.parameters()) + list(layer.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        raise QuantizationError("cannot replace the root module; pass its parent",
                                hint="Wrap the layer in a container (e.g. nn.Sequential(layer)) so "
                                     "it can be replaced, or use "
                                     "QuantizedLinear.from_linear(layer) directly.")
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)
