"""Checkpoint formats users bring, opened as the tensors of a diffusers model: one door.

:func:`open_checkpoint` reads a path's first bytes and returns a
:class:`~vramkit.io.lazy.LazySafetensors` whose tensor names are the model's:

* a Hugging Face / diffusers safetensors checkpoint (file, shards, index): as it is;
* a single-file FLUX (Black Forest Labs' keys, bare or under ComfyUI's
  ``model.diffusion_model.``) or SDXL (the LDM UNet layout): renamed to diffusers keys, each
  fused tensor (FLUX's ``qkv``, ``linear1``) split into row ranges of the file, so every piece
  is read straight from disk into its place, once (:mod:`vramkit.io._single_file`); the other
  components of a full checkpoint (VAE, text encoders) are left out;
* an ``fp8_scaled`` file (ComfyUI: float8 e4m3 weights with a per-tensor ``.scale_weight``):
  each weight read as stored and multiplied by its scale as it is loaded, or kept 8-bit by
  :func:`prepare_module` when the load quantizes to fp8 (the file's codes and scale become a
  ``QuantizedLinear``'s fp8 storage, bit for bit);
* a GGUF file (llama.cpp, city96's ComfyUI-GGUF): float tensors as they are, quantized tensors
  as ``uint8`` rows of blocks that :func:`prepare_module` turns into
  :class:`~vramkit.quant.gguf.GGUFLinear` layers, so the packed bytes stay the master (in host
  memory, in a swapper's pinned masters) and are decoded on the device per call.

Tensors keep their byte ranges in the file: streaming, pinned staging and a swapper's direct
reads into its masters work unchanged. The few that need work after reading (FLUX's final
modulation with its halves swapped, fp8 weights scaled) are :attr:`MappedCheckpoint.fixed_names`,
which :meth:`MappedCheckpoint.load_tensor` applies.

:func:`detect_format` names a file's format without torch (``vramkit inspect``);
:func:`write_gguf` writes a GGUF file tensor by tensor (benchmarks, tests, examples).
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramkit._gguf_types import GGUF_FLOAT_TYPES
from vramkit.errors import ConfigError, SafetensorsFormatError
from vramkit.io import _paths
from vramkit.io._gguf_file import GGUFHeader, is_gguf, read_gguf_header, write_gguf
from vramkit.io._header import SafetensorsHeader, TensorEntry, read_header
from vramkit.io._single_file import FLUX, SDXL, Piece, detect_layout, layout_pieces
from vramkit.io.lazy import LazySafetensors, ReadThreads, resolve_checkpoint

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CheckpointFormat", "MappedCheckpoint", "describe_names", "detect_format",
           "gguf_file", "model_prefix", "open_checkpoint", "prepare_module", "write_gguf"]

logger = logging.getLogger(__name__)

_SCALE_SUFFIX = ".scale_weight"
# ComfyUI's fp8_scaled bookkeeping: a marker tensor, and input scales for its fp8 matmuls.
_FP8_SIDE_TENSORS = ("scaled_fp8", ".scale_input")
_FP8_CODES = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint file is.

    Args:
        container: ``"safetensors"`` or ``"gguf"``.
        layout: ``"diffusers"`` (names used as they are), ``"flux"`` (the original FLUX keys)
            or ``"sdxl"`` (the LDM UNet layout).
        prefix: the prefix the model's names carry in the file (``"model.diffusion_model."``).
        fp8_scaled: float8 weights with per-tensor ``.scale_weight`` scales.
        quant_types: GGUF: tensors per GGML type (``{"Q8_0": 304, "F32": 200}``).
    """

    container: str
    layout: str = "diffusers"
    prefix: str = ""
    fp8_scaled: bool = False
    quant_types: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: ``"GGUF (Q8_0 x 304, F32 x 200), FLUX original layout"``."""
        parts = [self.container if not self.quant_types else
                 "gguf (" + ", ".join(f"{k} x {v}" for k, v in self.quant_types.items()) + ")"]
        if self.layout != "diffusers":
            where = f" under {self.prefix!r}" if self.prefix else ""
            parts.append(f"single-file {self.layout.upper()} layout{where}")
        if self.fp8_scaled:
            parts.append("fp8_scaled")
        return ", ".join(parts)


def _read_prefix(path: Path) -> bytes:
    fd, _ = _paths.open_file(path)
    try:
        return os.pread(fd, 8, 0)
    finally:
        os.close(fd)


def gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that starts like a GGUF file (no blocking open)."""
    target = Path(path)
    return target.is_file() and is_gguf(_read_prefix(target))


def detect_format(path: str | os.PathLike[str]) -> CheckpointFormat:
    """Name a checkpoint's format from its bytes (headers only; no torch).

    Args:
        path: a ``.safetensors`` or ``.gguf`` file, or a sharded checkpoint (always the
            diffusers layout).

    Returns:
        Its :class:`CheckpointFormat`.

    Raises:
        SafetensorsFormatError: for a path that is not a readable checkpoint.
    """
    target = Path(path)
    if gguf_file(target):
        header = read_gguf_header(target)
        counts: dict[str, int] = {}
        for info in header.tensors:
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
        found = detect_layout([t.name for t in header.tensors])
        kind, prefix = found if found else ("diffusers", "")
        return CheckpointFormat("gguf", kind, prefix, quant_types=counts)
    index, files = resolve_checkpoint(path)
    if index is not None or len(files) != 1:
        return CheckpointFormat("safetensors")
    sf = read_header(files[0])
    found = detect_layout(list(sf.tensors))
    kind, prefix = found if found else ("diffusers", "")
    return CheckpointFormat("safetensors", kind, prefix, fp8_scaled=_is_fp8_scaled(sf.tensors))


def _is_fp8_scaled(entries: dict[str, TensorEntry]) -> bool:
    return any(name.endswith(_SCALE_SUFFIX)
               and entries.get(name[:-len(_SCALE_SUFFIX)] + ".weight") is not None
               and entries[name[:-len(_SCALE_SUFFIX)] + ".weight"].dtype_code in _FP8_CODES
               for name in entries)


def model_prefix(checkpoint: LazySafetensors, prefix: str | None) -> str | None:
    """The prefix a loader should strip: ``None`` when ``prefix`` is the single-file layout's
    own (``"model.diffusion_model."``), which the mapping to the model's names already took off;
    else ``prefix``."""
    fmt = getattr(checkpoint, "format", None)
    if fmt is not None and fmt.layout != "diffusers" and prefix == fmt.prefix:
        return None
    return prefix


def describe_names(names: Sequence[str], limit: int = 6) -> str:
    """The top-level names of a checkpoint with their tensor counts, for messages:
    ``"double_blocks.* (57), single_blocks.* (114), img_in.* (2)"``."""
    counts: dict[str, int] = {}
    for name in names:
        head = name.split(".", 1)[0]
        if head in ("model", "first_stage_model", "conditioner", "cond_stage_model"):
            head = ".".join(name.split(".")[:3 if name.startswith("model.diffusion_model")
                                              else 2])
        counts[head] = counts.get(head, 0) + 1
    shown = [f"{head}.* ({n})" for head, n in list(counts.items())[:limit]]
    more = len(counts) - limit
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


class MappedCheckpoint(LazySafetensors):
    """A checkpoint whose tensors are named and sliced as a diffusers model's (see the module
    docstring). Built by :func:`open_checkpoint`.

    Attributes:
        format: the file's :class:`CheckpointFormat`.
        sources: each tensor's name in the file (the fused tensor a split piece comes from).
        scales: fp8_scaled tensors -> their scale.
        swapped: tensors whose two halves (along rows) are swapped after reading.
        packed: GGUF quantized tensors -> ``(type name, shape of the decoded weight)``; each is
            held as ``uint8 [rows, row_bytes]``.
        decoded: GGUF quantized tensors decoded to float32 as they are read (those
            :func:`prepare_module` found on something other than an ``nn.Linear`` weight).
        prefilled: module keys :func:`prepare_module` already filled (fp8 scales), which the
            file does not hold as such.
        left_out: names in the file that belong to no tensor of the model (other components
            of a full checkpoint, fp8_scaled's bookkeeping).
    """

    def __init__(self, header: SafetensorsHeader, fmt: CheckpointFormat, *, use_mmap: bool,
                 source: Path, sources: dict[str, str], scales: dict[str, float],
                 swapped: set[str], packed: dict[str, tuple[str, tuple[int, ...]]],
                 left_out: list[str]) -> None:
        super().__init__([header], use_mmap=use_mmap, source=source)
        self.format = fmt
        self.sources = sources
        self.scales = scales
        self.swapped = swapped
        self.packed = packed
        self.prefilled: set[str] = set()
        self.left_out = left_out
        self.decoded: dict[str, tuple[str, tuple[int, ...]]] = {}

    @property
    def fixed_names(self) -> frozenset[str]:
        """Tensors that need work after their bytes are read (scaled, halves swapped): a
        loader must read them through :meth:`load_tensor`, not as raw bytes."""
        return frozenset(self.scales) | frozenset(self.swapped) | frozenset(self.decoded)

    def load_tensor(self, name: str, index: Any = None, *,
                    threads: ReadThreads | None = None) -> torch.Tensor:
        """Read a tensor as the model wants it (fp8 scaled to float32, halves swapped, GGUF
        blocks of a tensor that is not kept packed decoded to float32); indexed reads return
        stored values."""
        if name in self.decoded and index is None:
            import torch

            from vramkit.quant.gguf import dequantize_gguf, gguf_quant_type

            entry = self.entry(name)
            raw = torch.empty(entry.nbytes, dtype=torch.uint8)
            self.read_bytes(entry, raw, threads=threads)
            kind, shape = self.decoded[name]
            # Decoded as a run of blocks (the stored rows may be a flattening of ``shape``).
            block = gguf_quant_type(kind).block_size
            numel = math.prod(shape)
            values = dequantize_gguf(raw, kind, (numel // block, block)).reshape(shape)
            return self.fix(name, values)
        tensor = super().load_tensor(name, index, threads=threads)
        if index is None:
            tensor = self.fix(name, tensor)
        return tensor

    def decode_on_load(self, name: str) -> None:
        """Make GGUF tensor ``name`` (quantized, not kept packed) a float32 tensor of its real
        shape, decoded one tensor at a time as it is read."""
        kind, shape = self.packed.pop(name)
        entry = self._entries[name]
        self._entries[name] = TensorEntry(name, "F32", tuple(shape), entry.begin, entry.end,
                                          entry.data_start, entry.path)
        self.decoded[name] = (kind, tuple(shape))

    def fix(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Apply ``name``'s fixups to its stored value (on any device)."""
        import torch

        if name in self.swapped:
            half = tensor.shape[0] // 2
            tensor = torch.cat([tensor[half:], tensor[:half]])
        scale = self.scales.get(name)
        if scale is not None:
            tensor = tensor.to(torch.float32) * scale
        return tensor

    def rename(self, old: str, new: str, *, keep_scale: bool = False) -> None:
        """Expose tensor ``old`` as ``new`` (a prepared layer's buffer name); its scale is
        dropped unless ``keep_scale`` (the layer then stores it itself)."""
        entry = self._entries[old]
        renamed = TensorEntry(new, entry.dtype_code, entry.shape, entry.begin, entry.end,
                              entry.data_start, entry.path)
        self._entries = {(new if k == old else k): (renamed if k == old else v)
                         for k, v in self._entries.items()}
        self.sources[new] = self.sources.pop(old, old)
        scale = self.scales.pop(old, None)
        if keep_scale and scale is not None:
            self.scales[new] = scale
        if old in self.swapped:
            self.swapped.discard(old)
            self.swapped.add(new)
        if old in self.packed:
            self.packed[new] = self.packed.pop(old)


def open_checkpoint(path: str | os.PathLike[str], *, use_mmap: bool = True) -> LazySafetensors:
    """Open any supported checkpoint with the model's tensor names (see the module docstring).

    Args:
        path: a safetensors file, shards, index or directory, or a ``.gguf`` file.
        use_mmap: read through a memory map (default) or with positional reads.

    Returns:
        A plain :class:`LazySafetensors` for checkpoints in diffusers' layout, else a
        :class:`MappedCheckpoint`.

    Raises:
        SafetensorsFormatError: for a malformed file (truncated GGUF, unknown tensor type...).
    """
    target = Path(path)
    if gguf_file(target):
        return _open_gguf(read_gguf_header(target), use_mmap)
    index, files = resolve_checkpoint(path)
    if index is not None or len(files) != 1:  # shards: the diffusers layout
        return LazySafetensors.open(path, use_mmap=use_mmap)
    header = read_header(files[0])
    found = detect_layout(list(header.tensors))
    fp8 = _is_fp8_scaled(header.tensors)
    if found is None and not fp8:
        return LazySafetensors([header], use_mmap=use_mmap, source=target)
    kind, prefix = found if found else ("diffusers", "")
    fmt = CheckpointFormat("safetensors", kind, prefix, fp8_scaled=fp8)
    return _mapped(header, header.tensors, fmt, use_mmap, target, packed_types={})


def _open_gguf(gguf: GGUFHeader, use_mmap: bool) -> MappedCheckpoint:
    entries: dict[str, TensorEntry] = {}
    packed_types: dict[str, tuple[str, tuple[int, ...]]] = {}
    counts: dict[str, int] = {}
    for info in gguf.tensors:
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
        if info.quantized:
            rows = info.numel // info.shape[-1] if info.shape else 1
            shape: tuple[int, ...] = (rows, info.nbytes // max(rows, 1))
            code = "U8"
            packed_types[info.name] = (info.type_name, _real_shape(gguf, info.name, info.shape))
        else:
            shape = _real_shape(gguf, info.name, info.shape)
            code = GGUF_FLOAT_TYPES[info.type_id][2]
        entries[info.name] = TensorEntry(info.name, code, shape, info.begin,
                                         info.begin + info.nbytes, gguf.data_start, gguf.path)
    found = detect_layout(list(entries))
    kind, prefix = found if found else ("diffusers", "")
    header = SafetensorsHeader(gguf.path, gguf.file_size, gguf.data_start - 8, entries,
                               {k: str(v) for k, v in gguf.metadata.items()})
    fmt = CheckpointFormat("gguf", kind, prefix, quant_types=counts)
    return _mapped(header, entries, fmt, use_mmap, gguf.path, packed_types)


def _real_shape(gguf: GGUFHeader, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """ComfyUI-GGUF flattens tensors whose rows are not whole blocks (SDXL's convolutions) and
    records the shape to restore under ``comfy.gguf.orig_shape.<name>``."""
    recorded = gguf.metadata.get(f"comfy.gguf.orig_shape.{name}")
    if isinstance(recorded, list) and all(isinstance(d, int) for d in recorded):
        real = tuple(recorded)
        if math.prod(real) == math.prod(stored):
            return real
        raise SafetensorsFormatError(f"comfy.gguf.orig_shape {list(real)} does not hold the "
                                     f"{math.prod(stored)} elements of {list(stored)}",
                                     path=gguf.path, tensor=name)
    return stored


def _read_scale(entry: TensorEntry) -> float:
    if entry.numel != 1 or entry.dtype_code not in ("F32", "F16", "BF16"):
        raise SafetensorsFormatError(f"an fp8 scale must be one F32/F16/BF16 value, got "
                                     f"{entry.dtype_code} {list(entry.shape)}", path=entry.path,
                                     tensor=entry.name)
    fd, _ = _paths.open_file(entry.path)
    try:
        raw = os.pread(fd, entry.nbytes, entry.file_offset)
    finally:
        os.close(fd)
    if entry.dtype_code == "F32":
        return float(struct.unpack("<f", raw)[0])
    if entry.dtype_code == "F16":
        return float(struct.unpack("<e", raw)[0])
    return float(struct.unpack("<f", b"\0\0" + raw)[0])


def _mapped(header: SafetensorsHeader, entries: dict[str, TensorEntry], fmt: CheckpointFormat,
            use_mmap: bool, source: Path,
            packed_types: dict[str, tuple[str, tuple[int, ...]]]) -> MappedCheckpoint:
    left_out: list[str] = []
    source_scales: dict[str, float] = {}
    model_names: dict[str, TensorEntry] = {}
    for name, entry in entries.items():
        if fmt.fp8_scaled and name.endswith(_SCALE_SUFFIX):
            source_scales[name[:-len(_SCALE_SUFFIX)] + ".weight"] = _read_scale(entry)
            left_out.append(name)
        elif fmt.fp8_scaled and (name == "scaled_fp8" or name.endswith(_FP8_SIDE_TENSORS[1])):
            left_out.append(name)
        else:
            model_names[name] = entry
    if fmt.layout in (FLUX, SDXL):
        pieces, unmatched = layout_pieces(fmt.layout, {n: e.shape for n, e in
                                                       model_names.items()}, fmt.prefix)
        left_out += [n for n in model_names if not n.startswith(fmt.prefix)]
    else:
        pieces = [Piece(n, n, 0, e.shape[0] if e.shape else 1) for n, e in model_names.items()]
        unmatched = []
    tensors: dict[str, TensorEntry] = {}
    sources: dict[str, str] = {}
    scales: dict[str, float] = {}
    swapped: set[str] = set()
    packed: dict[str, tuple[str, tuple[int, ...]]] = {}
    for piece in [*pieces, *(Piece(n, n, 0, model_names[n].shape[0] if model_names[n].shape
                                   else 1) for n in unmatched)]:
        entry = model_names[piece.source]
        rows = entry.shape[0] if entry.shape else 1
        row_bytes = entry.nbytes // rows if rows else 0
        whole = (piece.row0, piece.row1) == (0, rows)
        shape = entry.shape if whole else (piece.row1 - piece.row0, *entry.shape[1:])
        tensors[piece.target] = TensorEntry(piece.target, entry.dtype_code, shape,
                                            entry.begin + piece.row0 * row_bytes,
                                            entry.begin + piece.row1 * row_bytes,
                                            entry.data_start, entry.path)
        sources[piece.target] = piece.source
        if piece.source in source_scales:
            scales[piece.target] = source_scales[piece.source]
        if piece.swap_halves:
            swapped.add(piece.target)
        if piece.source in packed_types:
            kind, full = packed_types[piece.source]
            packed[piece.target] = (kind, (piece.row1 - piece.row0, *full[1:]))
    if left_out:
        logger.info("%s: %d tensor(s) belong to no model tensor and are left out: %s",
                    source, len(left_out), describe_names(left_out))
    ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
    virtual = SafetensorsHeader(header.path, header.file_size, header.header_length, ordered,
                                header.metadata)
    return MappedCheckpoint(virtual, fmt, use_mmap=use_mmap, source=source, sources=sources,
                            scales=scales, swapped=swapped, packed=packed, left_out=left_out)


# -- preparing a model on meta for packed tensors -----------------------------------------------


def prepare_module(module: nn.Module, checkpoint: LazySafetensors | str | os.PathLike[str],
                   quantization: Any = None, device: str | torch.device = "cpu", *,
                   prefix: str | None = None) -> list[str]:
    """Replace the layers whose weights a checkpoint keeps packed, before the module is filled.

    * a GGUF quantized weight of an ``nn.Linear``: the layer becomes a
      :class:`~vramkit.quant.gguf.GGUFLinear` whose ``weight_packed`` the file fills (any other
      quantized tensor, a convolution's or an embedding's, is decoded as it loads);
    * an fp8_scaled weight of a layer ``quantization`` (a ``QuantizationConfig``) quantizes to
      fp8 weight-only, when the file's layout fits vramkit's fp8 format: the layer becomes a
      ``QuantizedLinear`` whose ``weight_data`` is the file's fp8 codes and whose scales are
      the file's scale (filled here: they are tiny).

    Layers already prepared (by an earlier call on the same model) are matched again: their
    packed tensor is what this checkpoint fills. So a model can be prepared once, with the
    load's quantization config, and then filled by a swapper's ``checkpoint=`` (which calls
    this without one). ``load_into`` calls it itself.

    Args:
        module: the model (on meta).
        checkpoint: from :func:`open_checkpoint`, or a path (opened, prepared for, closed).
        quantization: the load's ``QuantizationConfig``, or None.
        device: where the tensors this fills itself (fp8 scales) go: the load's device.
        prefix: the checkpoint names of ``module``'s tensors start with it (``load_into``'s
            ``prefix``: a block filled alone); other names are left as they are.

    Returns:
        The qualified names of the layers replaced.

    Raises:
        ConfigError: a GGUF quantized weight whose shape differs from its layer's.
    """
    if not isinstance(checkpoint, LazySafetensors):
        with open_checkpoint(checkpoint) as opened:
            return prepare_module(module, opened, quantization, device, prefix=prefix)
    if not isinstance(checkpoint, MappedCheckpoint):
        return []
    replaced: list[str] = []
    if checkpoint.packed:
        replaced += _prepare_gguf(module, checkpoint, prefix or "")
    if checkpoint.scales:
        replaced += _prepare_fp8(module, checkpoint, quantization, device, prefix or "")
    return replaced


def _linear_of(module: nn.Module, key: str) -> tuple[str, Any]:
    from torch import nn

    owner, _, attr = key.rpartition(".")
    try:
        layer = module.get_submodule(owner) if owner else module
    except AttributeError:
        return owner, None
    return owner, layer if attr == "weight" and type(layer) is nn.Linear else None


def _set(module: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, child, layer)


def _prepare_gguf(module: nn.Module, checkpoint: MappedCheckpoint, prefix: str) -> list[str]:
    import torch

    from vramkit.io.adapters import base_layer_of
    from vramkit.quant.gguf import GGUFLinear

    replaced = []
    state = dict(module.state_dict(keep_vars=True))
    for name, (kind, shape) in list(checkpoint.packed.items()):
        if not name.startswith(prefix):
            continue
        key = name[len(prefix):]
        owner, layer = _linear_of(module, key)
        path, current = base_layer_of(module, owner)
        if isinstance(current, GGUFLinear) and current.qtype.name == kind:
            # prepared before (and perhaps wrapped by peft's LoRA since)
            checkpoint.rename(name, f"{prefix}{path}.weight_packed")
            continue
        if key not in state:
            continue  # unexpected: the filler reports it
        if layer is None:
            # A convolution, an embedding...: decoded as it is read (one tensor at a time).
            logger.info("%s: %s is GGUF %s on a %s: decoded as it loads", checkpoint.source.name,
                        name, kind, type(current).__name__)
            checkpoint.decode_on_load(name)
            continue
        if tuple(layer.weight.shape) != tuple(shape):
            raise ConfigError(f"{checkpoint.source.name}: {name!r} is {list(shape)} in the file, "
                              f"{list(layer.weight.shape)} in the module",
                              hint="Build the module with the checkpoint's configuration.")
        rows, row_bytes = checkpoint.entry(name).shape
        packed = torch.empty((rows, row_bytes), dtype=torch.uint8, device=layer.weight.device)
        new = GGUFLinear(packed, kind, layer.in_features, layer.out_features, layer.bias,
                         dtype=layer.weight.dtype)
        new.train(layer.training)
        _set(module, owner, new)
        checkpoint.rename(name, f"{prefix}{owner}.weight_packed")
        replaced.append(owner)
    return replaced


def _prepare_fp8(module: nn.Module, checkpoint: MappedCheckpoint, config: Any,
                 device: Any, prefix: str) -> list[str]:
    import torch

    from vramkit.io.adapters import base_layer_of
    from vramkit.quant.formats import FP8Config, QuantizedTensor
    from vramkit.quant.linear import QuantizedLinear
    from vramkit.quant.model import QuantizationConfig, quantizable_layers, quantized_layer

    fmt: Any = None
    selected: dict[str, Any] = {}
    if isinstance(config, QuantizationConfig) and not config.w8a8:
        fmt = config.weight_format()
        if isinstance(fmt, FP8Config):
            selected = dict(quantizable_layers(module, config))
    replaced = []
    for name, scale in list(checkpoint.scales.items()):
        if not name.startswith(prefix):
            continue
        key = name[len(prefix):]
        entry = checkpoint.entry(name)
        owner, layer = _linear_of(module, key)
        path, current = base_layer_of(module, owner)
        if (isinstance(current, QuantizedLinear) and isinstance(current.quant_config, FP8Config)
                and current.weight_data.is_meta and entry.dtype_code == "F8_E4M3"
                and tuple(current.weight_data.shape) == tuple(entry.shape)):
            # prepared before (and perhaps wrapped by peft's LoRA since): its scales were
            # filled then
            checkpoint.rename(name, f"{prefix}{path}.weight_data")
            checkpoint.prefilled.add(f"{path}.weight_scales")
            continue
        if layer is None or owner not in selected or entry.dtype_code != "F8_E4M3":
            continue
        rows, cols = layer.out_features, layer.in_features
        if fmt.granularity == "block" and cols % fmt.block_size:
            continue  # vramkit's layout would pad the rows: dequantized and re-quantized instead
        groups = 1 if fmt.granularity == "channel" else cols // fmt.block_size
        data = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=layer.weight.device)
        scales = torch.full((rows, groups), scale, dtype=torch.float32, device=device)
        q = QuantizedTensor(config=fmt, data=data, scales=scales, zero_points=None,
                            shape=torch.Size((rows, cols)), dtype=layer.weight.dtype)
        new = quantized_layer(layer, q, layer.bias, config, name=owner)
        _set(module, owner, new)
        checkpoint.rename(name, f"{prefix}{owner}.weight_data")
        checkpoint.prefilled.add(f"{owner}.weight_scales")
        replaced.append(owner)
    return replaced


def _owner(module: nn.Module, key: str) -> Any:
    owner = key.rpartition(".")[0]
    try:
        return module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
