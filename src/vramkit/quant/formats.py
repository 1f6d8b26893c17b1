"""Quantized weight formats: configs, the :class:`QuantizedTensor` record, quantize/dequantize.

Layout (``docs/quantization.md`` has every byte): a tensor of any shape is viewed as 2-D
``[rows, cols] = [shape[0], prod(shape[1:])]`` (1-D and 0-D as one row); groups run along each
row, the input dim of a Linear weight ``[out, in]``. A row is zero-padded to a whole number of
groups; the padding dequantizes to exactly 0 and never changes a real element. Packed 4-bit data
holds element 2j in the low nibble and 2j+1 in the high nibble of byte j of the padded row.

Defaults meet the memory targets (scales included) and the error targets on Gaussian and
Student-t (3 dof) weights; ``benchmarks/quant.py`` prints both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from vramkit._validate import check_int
from vramkit.errors import ConfigError, QuantizationError
from vramkit.quant import _reference, kernels
from vramkit.quant._configs import (
    FP8Config,
    Int4Config,
    Int8Config,
    NF4Config,
    QuantConfigT,
    QuantFormat,
    config_from_dict,
    format_config,
)

__all__ = [
    "FP8Config",
    "Int4Config",
    "Int8Config",
    "NF4Config",
    "QuantConfigT",
    "QuantFormat",
    "QuantizedTensor",
    "apply_device_only",
    "dequantize_tensor",
    "expected_layout",
    "format_config",
    "quantize_tensor",
]

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAYOUT_VERSION = "1"
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


def expected_layout(config: QuantConfigT, shape: torch.Size | tuple[int, ...]
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The exact storage a tensor of ``shape`` takes in ``config``'s format.

    Args:
        config: the format config.
        shape: the original tensor shape.

    Returns:
        Flat name (as in :meth:`QuantizedTensor.tensors`) -> (shape, dtype) of every stored
        tensor.
    """
    rows, cols = _reference.rows_cols(shape)
    padded = _reference.padded_cols(config, cols)
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if isinstance(config, FP8Config):
        groups = 1 if config.granularity == "channel" else padded // config.block_size
        layout["data"] = ((rows, padded), torch.float8_e4m3fn)
        layout["scales"] = ((rows, groups), torch.float32)
        return layout
    groups = padded // config.group
    if isinstance(config, Int8Config):
        layout["data"] = ((rows, padded), torch.int8)
        if config.compact_scales:
            layout["scales"] = ((rows, groups), torch.uint8)
            layout["extra.row_scales"] = ((rows,), torch.float32)
        else:
            layout["scales"] = ((rows, groups), torch.float32)
        return layout
    layout["data"] = ((rows, padded // 2), torch.uint8)
    if isinstance(config, Int4Config):
        if config.compact_scales:
            layout["scales"] = ((rows, groups), torch.uint8)
            layout["zero_points"] = ((rows, (groups + 1) // 2), torch.uint8)
            layout["extra.row_scales"] = ((rows,), torch.float32)
        else:
            layout["scales"] = ((rows, groups), torch.float32)
            layout["zero_points"] = ((rows, groups), torch.uint8)
        return layout
    if config.double_quant:
        dq_blocks = -(-rows * groups // config.double_quant_block_size)
        layout["scales"] = ((rows, groups), torch.uint8)
        layout["extra.scale_scales"] = ((dq_blocks,), torch.float32)
    else:
        layout["scales"] = ((rows, groups), torch.float32)
    return layout


@dataclass
class QuantizedTensor:
    """A quantized tensor: packed codes, scales, zero points and what is needed to restore it.

    Attributes:
        config: the format config.
        data: packed codes, 2-D ``[rows, padded_cols]`` (8-bit) or ``[rows, padded_cols // 2]``.
        scales: per-group scales (fp32) or uint8 log-step scale codes (compact layouts).
        zero_points: int4 zero points (uint8; packed two per byte when compact), else None.
        shape: the original shape.
        dtype: the original floating dtype.
        extras: further tensors: ``"row_scales"`` (int8/int4 compact), ``"scale_scales"``
            (nf4 double quantization).
    """

    config: QuantConfigT
    data: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def format(self) -> QuantFormat:
        """The format (:class:`QuantFormat`)."""
        return self.config.format

    @property
    def rows(self) -> int:
        """Rows of the 2-D view (``shape[0]``)."""
        return _reference.rows_cols(self.shape)[0]

    @property
    def cols(self) -> int:
        """Real (unpadded) row length of the 2-D view."""
        return _reference.rows_cols(self.shape)[1]

    @property
    def numel(self) -> int:
        """Elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of all storage: data, scales, zero points and extras."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        """Device of the packed data."""
        return self.data.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        """A copy on ``device`` (every stored tensor moved).

        Args:
            device: target device.
            non_blocking: passed to ``Tensor.to`` (default False; asynchronous from pinned memory).

        Returns:
            A new :class:`QuantizedTensor` (self when already there).
        """
        target = torch.device(device)
        if self.data.device == target:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(target, non_blocking=non_blocking)

        return dataclasses.replace(
            self, data=move(self.data), scales=move(self.scales),
            zero_points=None if self.zero_points is None else move(self.zero_points),
            extras={k: move(v) for k, v in self.extras.items()})

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized tensor in its original shape (Triton on CUDA, torch elsewhere).

        Args:
            dtype: output dtype (default None: the original dtype).

        Returns:
            A tensor of ``shape`` on :attr:`device`.
        """
        return kernels.dequantize(self, dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor by flat name: ``data``, ``scales``, ``zero_points``, ``extra.<k>``."""
        out = {"data": self.data, "scales": self.scales}
        if self.zero_points is not None:
            out["zero_points"] = self.zero_points
        for key, value in self.extras.items():
            out[f"extra.{key}"] = value
        return out

    def metadata(self) -> dict[str, str]:
        """String metadata describing the layout (safetensors ``__metadata__`` compatible).

        Returns:
            ``format``, ``config`` (JSON of the config fields), ``shape`` (JSON list), ``dtype``
            and ``layout_version``.
        """
        return {
            "format": self.format.value,
            "config": json.dumps(dataclasses.asdict(self.config), sort_keys=True),
            "shape": json.dumps(list(self.shape)),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layout_version": _LAYOUT_VERSION,
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str]) -> QuantizedTensor:
        """Rebuild a record from :meth:`tensors` and :meth:`metadata` (e.g. read from a file).

        Args:
            tensors: flat name -> tensor.
            metadata: the string metadata.

        Returns:
            The record.

        Raises:
            QuantizationError: unknown format, version or dtype, or tensors whose names, shapes
                or dtypes do not match the declared layout.
        """
        try:
            version = metadata.get("layout_version", _LAYOUT_VERSION)
            if version != _LAYOUT_VERSION:
                raise QuantizationError(f"unknown quantized layout version {version!r}",
                                        hint="The file was written by a newer vramkit; upgrade "
                                             "vramkit to read it.")
            config = config_from_dict(metadata["format"], json.loads(metadata["config"]))
            shape = torch.Size(int(s) for s in json.loads(metadata["shape"]))
            dtype = _DTYPE_NAMES[metadata["dtype"]]
        except QuantizationError:
            raise
        except (ConfigError, KeyError, TypeError, ValueError) as err:
            raise QuantizationError(f"unknown or invalid quantized layout metadata {metadata!r}: "
                                    f"{err}", hint="The file was not written by vramkit's "
                                    "QuantizedTensor.metadata(), or by a newer version.") from err
        layout = expected_layout(config, shape)
        if set(tensors) != set(layout):
            raise QuantizationError(f"{config.format.value} layout needs tensors {sorted(layout)}, "
                                    f"got {sorted(tensors)}",
                                    hint="The quantized tensors do not match their metadata: "
                                         "re-save the weights with save_quantized, or pass the "
                                         "tensors of QuantizedTensor.tensors() unchanged.")
        for name, (want_shape, want_dtype) in layout.items():
            got = tensors[name]
            if tuple(got.shape) != want_shape or got.dtype != want_dtype:
                raise QuantizationError(f"tensor {name!r}: expected {want_dtype} {want_shape}, "
                                        f"got {got.dtype} {tuple(got.shape)}",
                                        hint="The tensor was altered or comes from another layout; "
                                             "re-quantize the float weight, or re-save with "
                                             "save_quantized.")
        return cls(config=config, data=tensors["data"], scales=tensors["scales"],
                   zero_points=tensors.get("zero_points"), shape=shape, dtype=dtype,
                   extras={k.removeprefix("extra."): v for k, v in tensors.items()
                           if k.startswith("extra.")})


def _check_float(t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise QuantizationError(f"can only quantize float32/float16/bfloat16 tensors, got "
                                f"{t.dtype}",
                                hint="Quantize floating-point weights; convert other dtypes with "
                                     ".float() first if that is meant.")


def quantize_tensor(t: torch.Tensor, fmt: str | QuantFormat | QuantConfigT = "int8", *,
                    group_size: int | None = None) -> QuantizedTensor:
    """Quantize a floating tensor.

    Deterministic; runs on ``t``'s device with torch ops (on CUDA too: quantizing is a one-off
    at load time, and torch's elementwise ops round exactly as the CPU does, so GPU and CPU give
    the same codes except for rare exact ties of the clipping search's summed error).

    Args:
        t: float32, float16 or bfloat16 tensor of any shape, finite values.
        fmt: format name, :class:`QuantFormat` or config (default ``"int8"``).
        group_size: override of the group/block size (default None: the config's).

    Returns:
        The :class:`QuantizedTensor`, on ``t``'s device.

    Raises:
        QuantizationError: a non-floating dtype, an empty tensor or non-finite values.
        ConfigError: an unknown format or invalid group size.
    """
    if not isinstance(t, torch.Tensor):
        raise QuantizationError(f"quantize_tensor expects a torch.Tensor, got {type(t).__name__}",
                                hint="Pass a floating-point torch.Tensor, e.g. "
                                     "quantize_tensor(linear.weight.data, 'int8').")
    _check_float(t)
    config = format_config(fmt, group_size)
    if t.numel() == 0:
        raise QuantizationError(f"cannot quantize an empty tensor (shape {tuple(t.shape)})",
                                hint="Skip empty tensors (t.numel() == 0): keep them in floating "
                                     "point.")
    rows, cols = _reference.rows_cols(t.shape)
    x = t.detach().reshape(rows, cols).to(torch.float32)
    # one sync per tensor, at load time: inf/nan would silently poison a whole group's scale
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError("cannot quantize a tensor with inf or nan values",
                                hint="Check the checkpoint; the weights are not finite.")
    data, scales, zero_points, extras = _reference.quantize_rows(x, config)
    return QuantizedTensor(config=config, data=data, scales=scales, zero_points=zero_points,
                           shape=t.shape, dtype=t.dtype, extras=extras)


def _broadcast_affine(param: torch.Tensor | float, rows: int, cols: int,
                      group_size: int | None, name: str, device: torch.device) -> torch.Tensor:
    p = torch.as_tensor(param, device=device).to(torch.float32)
    if p.numel() == 1:
        return p.reshape(1, 1)
    if group_size is not None:
        groups = -(-cols // group_size)
        if p.numel() != rows * groups:
            raise QuantizationError(f"{name} has {p.numel()} elements; per-group with group_size="
                                    f"{group_size} needs rows * groups = {rows} * {groups}",
                                    hint="Give scale/zero_point one value per (row, group) with "
                                         "the same group_size used to quantize, a scalar, or a "
                                         "per-row tensor.")
        return p.reshape(rows, groups).repeat_interleave(group_size, dim=1)[:, :cols]
    if p.numel() == rows:
        return p.reshape(rows, 1)
    if p.numel() == rows * cols:
        return p.reshape(rows, cols)
    raise QuantizationError(f"{name} of shape {tuple(p.shape)} matches neither per-tensor (1), "
                            f"per-row ({rows}) nor per-element ({rows * cols}) broadcasting",
                            hint="Pass group_size= for per-group parameters.")


@overload
def dequantize_tensor(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor: ...


@overload
def dequantize_tensor(q: torch.Tensor, scale: torch.Tensor | float,
                      zero_point: torch.Tensor | float | None = None, *,
                      group_size: int | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


def dequantize_tensor(q: QuantizedTensor | torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Dequantize a :class:`QuantizedTensor`, or a plain affine-quantized tensor (the seed form).

    Forms:
        ``dequantize_tensor(q: QuantizedTensor, dtype=None)``: the original shape, in ``dtype``
        (default the original dtype).

        ``dequantize_tensor(tensor, scale, zero_point=None, *, group_size=None,
        dtype=torch.float32)``: ``(tensor - zero_point) * scale`` computed in fp32. ``tensor`` is
        viewed as ``[rows, cols]`` like the formats; ``scale``/``zero_point`` broadcast
        per-tensor (one element), per-row (``rows`` elements), per-element, or per-group
        (``rows * ceil(cols / group_size)`` elements, with ``group_size`` given).

    Returns:
        The dequantized tensor.

    Raises:
        QuantizationError: a non-numeric tensor or parameters that do not broadcast.
    """
    if isinstance(q, QuantizedTensor):
        return q.dequantize(*args, **kwargs)
    return _dequantize_affine(q, *args, **kwargs)


def _dequantize_affine(tensor: torch.Tensor, scale: torch.Tensor | float,
                       zero_point: torch.Tensor | float | None = None, *,
                       group_size: int | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype == torch.bool or tensor.is_complex():
        raise QuantizationError("dequantize_tensor expects an integer or floating tensor of codes, "
                                f"got {getattr(tensor, 'dtype', type(tensor).__name__)}",
                                hint="Pass integer (or fp8) codes with their scale, or call "
                                     "dequantize_tensor(q) / q.dequantize() on a QuantizedTensor.")
    check_int("group_size", group_size, minimum=1, allow_none=True)
    rows, cols = _reference.rows_cols(tensor.shape)
    values = tensor.reshape(rows, cols).to(torch.float32)
    if zero_point is not None:
        values = values - _broadcast_affine(zero_point, rows, cols, group_size, "zero_point",
                                            tensor.device)
    values = values * _broadcast_affine(scale, rows, cols, group_size, "scale", tensor.device)
    return values.reshape(tensor.shape).to(dtype)


def apply_device_only(module: torch.nn.Module, names: Sequence[str], fn: Callable[[torch.Tensor],
                      torch.Tensor], apply: Callable[[], object]) -> None:
    """Run ``apply()`` (the module's ``nn.Module._apply(fn)``) with the buffers ``names`` set
    aside, then move each of them with ``fn`` keeping its dtype.

    ``module.to(dtype)`` casts floating buffers: that would turn packed codes and fp32 scales
    into something their format cannot read, so they follow device moves only.
    """
    kept = {name: module._buffers[name] for name in names}
    for name in names:
        module._buffers[name] = None  # _apply skips None buffers
    try:
        apply()
    finally:
        for name, tensor in kept.items():
            if tensor is None:
                continue
            moved = fn(tensor)
            if moved.dtype != tensor.dtype:
                moved = tensor.to(device=moved.device)
            module._buffers[name] = moved
