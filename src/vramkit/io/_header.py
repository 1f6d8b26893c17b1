"""Parsing and validating safetensors headers and Hugging Face shard indexes.

A safetensors file is ``<u64 little-endian N><N bytes of JSON header><data>``. The header maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
start of the data) plus an optional ``"__metadata__"`` dict of strings.

Everything that can be wrong with such a file is checked here, before any tensor byte is read,
and reported as :class:`vramkit.errors.SafetensorsFormatError` naming the file and, where there
is one, the tensor. The header length is checked against the file size and a 100 MB cap before
anything is allocated for it, so a hostile length can neither exhaust memory nor hang the reader.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramkit.errors import SafetensorsFormatError
from vramkit.io import _paths

if TYPE_CHECKING:  # headers are read without torch; a TensorEntry's dtype imports it when asked
    import torch

__all__ = [
    "DTYPE_ITEMSIZES",
    "FLOATING_CODES",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "ShardIndex",
    "TensorEntry",
    "missing_shard_error",
    "parse_header",
    "read_header",
    "read_index",
]

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 * 1000 * 1000  # the limit the safetensors format itself sets (100 MB)
MAX_INDEX_BYTES = 100 * 1000 * 1000

_REPAIR_HINT = ("The file is damaged or was not written as safetensors; re-download it or re-save "
                "it with safetensors.torch.save_file.")


#: Bytes per element of every safetensors dtype code whose element is a whole number of bytes.
DTYPE_ITEMSIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8, "U16": 2, "U32": 4, "U64": 8,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
}

#: The codes of floating-point elements (weights; integers and bools are ids, masks, counters).
FLOATING_CODES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ",
                            "F8_E5M2FNUZ", "F8_E8M0"})

# Codes whose torch dtype exists only in newer torch builds (torch attribute names).
_OPTIONAL_CODES = {"U16": "uint16", "U32": "uint32", "U64": "uint64",
                   "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
                   "F8_E8M0": "float8_e8m0fnu"}


@functools.cache
def _dtype_table() -> dict[str, torch.dtype]:
    # Every safetensors dtype named explicitly; the optional ones exist only in newer torch builds.
    import torch

    table: dict[str, torch.dtype] = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
        "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
        "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "C64": torch.complex64,
    }
    for code, attr in _OPTIONAL_CODES.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            table[code] = dtype
    return table


#: safetensors dtype code -> torch dtype, for every code this torch build can represent (and
#: its inverse); module attributes made on first use by :func:`__getattr__`.
SAFETENSORS_DTYPES: dict[str, torch.dtype]
TORCH_TO_SAFETENSORS: dict[torch.dtype, str]


def __getattr__(name: str) -> Any:
    # SAFETENSORS_DTYPES and TORCH_TO_SAFETENSORS need torch: made on first use, so that reading
    # a header (vramkit inspect) never imports it.
    if name == "SAFETENSORS_DTYPES":
        return _dtype_table()
    if name == "TORCH_TO_SAFETENSORS":
        return {v: k for k, v in _dtype_table().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Codes the format defines whose element is not a whole byte (or that torch lacks): named in the
# error so the user knows the file is valid but unsupported here.
_KNOWN_UNSUPPORTED = ("F4", "F6_E2M3", "F6_E3M2", "U16", "U32", "U64", "F8_E4M3FNUZ",
                      "F8_E5M2FNUZ", "F8_E8M0")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it.

    Args:
        name: the tensor's name.
        dtype_code: the safetensors dtype code (``"BF16"``...); :attr:`dtype` is its torch
            dtype.
        shape: the tensor's shape.
        begin: first byte, relative to the start of the data section.
        end: one past the last byte, relative to the start of the data section.
        data_start: absolute file offset of the data section (``8 + header length``).
        path: the file holding the tensor.
    """

    name: str
    dtype_code: str
    shape: tuple[int, ...]
    begin: int
    end: int
    data_start: int
    path: Path

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        """The matching torch dtype (imports torch on first use)."""
        return _dtype_table()[self.dtype_code]

    @property
    def is_floating_point(self) -> bool:
        """Whether the elements are floating-point numbers (known without torch)."""
        return self.dtype_code in FLOATING_CODES

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def file_offset(self) -> int:
        """Absolute offset of the first data byte in the file."""
        return self.data_start + self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header.

    Args:
        path: the file.
        file_size: its size in bytes.
        header_length: the JSON header's length in bytes.
        tensors: name -> :class:`TensorEntry`, in data-offset order.
        metadata: the ``__metadata__`` strings (empty when absent).
    """

    path: Path
    file_size: int
    header_length: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        """Absolute offset of the data section."""
        return 8 + self.header_length


def _fail(path: Path | str, message: str, tensor: str | None = None,
          hint: str | None = None) -> SafetensorsFormatError:
    return SafetensorsFormatError(message, path=path, tensor=tensor, hint=hint or _REPAIR_HINT)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads would silently keep the last of two equal keys; a tensor named twice is damage.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _load_json(raw: bytes, path: Path | str, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as dup:
        raise _fail(path, f"the {what} names {dup.key!r} twice", tensor=dup.key) from None
    except UnicodeDecodeError as err:
        raise _fail(path, f"the {what} is not UTF-8 text ({err.reason} at byte "
                          f"{err.start})") from None
    except RecursionError:
        raise _fail(path, f"the {what} JSON is nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, and int literals beyond Python's digit limit
        raise _fail(path, f"the {what} is not valid JSON ({err})") from None


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file without reading any tensor data.

    The path is checked before it is opened and opened without blocking
    (:func:`vramkit.io._paths.open_file`); a file that fails the checks and begins like a pickle
    or a ``torch.save`` zip archive (or is named ``.ckpt``/``.bin``/``.pt``/``.pth``) is reported
    as a pickle checkpoint, with how to convert it.

    Args:
        path: the ``.safetensors`` file.

    Returns:
        The validated :class:`SafetensorsHeader`.

    Raises:
        SafetensorsFormatError: for any malformed header (see :func:`parse_header`), a file
            shorter than 8 bytes, a header length beyond the file or over 100 MB, a pickle
            checkpoint, or a path that is not a readable regular file (missing: also a
            ``FileNotFoundError``).
    """
    path = Path(path)
    fd, info = _paths.open_file(path)
    file_size = info.st_size
    prefix = raw = b""
    try:
        with os.fdopen(fd, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated file: {file_size} bytes, shorter than the 8-byte "
                                  "header length")
            (header_length,) = struct.unpack("<Q", prefix)
            _check_header_length(path, header_length, file_size)
            raw = handle.read(header_length)
        if len(raw) != header_length:  # the file shrank while we read it
            raise _fail(path, f"truncated file: header needs {header_length} bytes, read "
                              f"{len(raw)}")
        return parse_header(raw, file_size, path)
    except SafetensorsFormatError:
        # Only for a file that failed the checks and whose header is not a JSON object: a valid
        # safetensors file may begin with bytes that look like a pickle's (a 640-byte header
        # begins with 0x80 0x02), and a damaged one is reported as damaged.
        length_possible = (len(prefix) == 8
                           and struct.unpack("<Q", prefix)[0] <= MAX_HEADER_BYTES)
        other = (None if raw.lstrip()[:1] == b"{"
                 else _paths.not_safetensors_error(path, prefix, length_possible))
        if other is not None:
            raise other from None
        raise
    except OSError as err:  # EIO and the like while reading
        raise _paths.os_error(path, err) from None


def _check_header_length(path: Path, header_length: int, file_size: int) -> None:
    if header_length > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {header_length} bytes is over the 100 MB limit of the "
                          "format")
    if 8 + header_length > file_size:
        raise _fail(path, f"header length {header_length} bytes runs beyond the end of the "
                          f"{file_size}-byte file (truncated file?)")


def parse_header(raw: bytes, file_size: int, path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Validate a header's JSON bytes against the file they came from.

    Checks: valid UTF-8 JSON object; each entry a dict with a known ``dtype``, a ``shape`` of
    non-negative ints and ``data_offsets`` ``[begin, end]`` with ``begin <= end``; the byte count
    equals ``prod(shape) * itemsize``; sorted by offset, the tensors start at 0, neither overlap
    nor leave gaps, and end exactly at the end of the file; ``__metadata__`` maps strings to
    strings.

    Args:
        raw: the header bytes (without the 8-byte length).
        file_size: the size of the whole file.
        path: the file, for messages.

    Returns:
        The validated :class:`SafetensorsHeader`.

    Raises:
        SafetensorsFormatError: naming the file and tensor at fault.
    """
    path = Path(path)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
        raise _fail(path, "safetensors data is little-endian; this host is big-endian",
                    hint="Load the file on a little-endian machine.")
    header_length = len(raw)
    _check_header_length(path, header_length, file_size)
    document = _load_json(raw, path, "header")
    if not isinstance(document, dict):
        raise _fail(path, f"the header is a JSON {type(document).__name__}, not an object")
    data_start = 8 + header_length
    data_size = file_size - data_start
    metadata = _parse_metadata(document.pop("__metadata__", None), path)
    entries = [_parse_entry(name, value, data_start, path) for name, value in document.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    position = 0
    for entry in entries:
        if entry.end > data_size:
            raise _fail(path, f"data_offsets [{entry.begin}, {entry.end}] run past the "
                              f"{data_size}-byte data section (truncated file?)", entry.name)
        if entry.begin < position:
            raise _fail(path, f"data_offsets [{entry.begin}, {entry.end}] overlap the previous "
                              f"tensor, which ends at {position}", entry.name)
        if entry.begin > position:
            raise _fail(path, f"a gap of {entry.begin - position} bytes before this tensor: data "
                              f"offsets must be contiguous (previous end {position})", entry.name)
        position = entry.end
    if position != data_size:
        raise _fail(path, f"the tensors cover {position} bytes but the data section has "
                          f"{data_size}: {data_size - position} trailing bytes belong to no "
                          "tensor")
    tensors = {entry.name: entry for entry in entries}
    return SafetensorsHeader(path, file_size, header_length, tensors, metadata)


def _parse_metadata(value: Any, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(path, f"__metadata__ is a JSON {type(value).__name__}, not an object of "
                          "strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise _fail(path, f"__metadata__[{key!r}] is a JSON {type(item).__name__}, not a "
                              "string")
    return dict(value)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(name: str, value: Any, data_start: int, path: Path) -> TensorEntry:
    if not isinstance(value, dict):
        raise _fail(path, f"the entry is a JSON {type(value).__name__}, not an object with "
                          "dtype, shape and data_offsets", name)
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in value]
    if missing:
        raise _fail(path, f"the entry lacks {', '.join(missing)}", name)
    code = value["dtype"]
    if not isinstance(code, str):
        raise _fail(path, f"dtype is a JSON {type(code).__name__}, not a string", name)
    itemsize = DTYPE_ITEMSIZES.get(code)
    # torch is imported only for the rare codes an older torch may lack.
    if itemsize is None or (code in _OPTIONAL_CODES and code not in _dtype_table()):
        if code in _KNOWN_UNSUPPORTED:
            import torch

            raise _fail(path, f"dtype {code!r} is valid safetensors but not supported by this "
                              f"PyTorch ({torch.__version__})", name,
                        hint="Upgrade PyTorch, or convert the tensor to a supported dtype.")
        known = sorted(c for c in DTYPE_ITEMSIZES if c not in _KNOWN_UNSUPPORTED
                       or c in _dtype_table())
        raise _fail(path, f"unknown dtype {code!r}; known: {', '.join(known)}", name)
    shape = value["shape"]
    if not isinstance(shape, list) or not all(_is_index(d) and d >= 0 for d in shape):
        raise _fail(path, f"shape {shape!r} is not a list of non-negative integers", name)
    offsets = value["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_index(o) and o >= 0 for o in offsets)):
        raise _fail(path, f"data_offsets {offsets!r} is not a pair of non-negative integers", name)
    begin, end = offsets
    if begin > end:
        raise _fail(path, f"data_offsets [{begin}, {end}] end before they begin", name)
    expected = math.prod(shape) * itemsize
    if expected != end - begin:
        raise _fail(path, f"shape {shape} of {code} needs {expected} bytes but data_offsets "
                          f"[{begin}, {end}] hold {end - begin}", name)
    return TensorEntry(name, code, tuple(shape), begin, end, data_start, path)


@dataclass(frozen=True)
class ShardIndex:
    """A Hugging Face ``*.safetensors.index.json``: which shard file holds which tensor.

    Args:
        path: the index file.
        weight_map: tensor name -> shard path (resolved next to the index).
        metadata: the index's ``"metadata"`` object (e.g. ``total_size``), or empty.
    """

    path: Path
    weight_map: dict[str, Path]
    metadata: dict[str, Any]

    @property
    def shards(self) -> list[Path]:
        """The shard files, each once, in the order the index first names them."""
        return list(dict.fromkeys(self.weight_map.values()))


def missing_shard_error(index_path: Path, shard: Path,
                        tensor: str | None = None) -> SafetensorsFormatError:
    """The error for a shard an index names that is not on disk."""
    name = os.path.relpath(shard, index_path.parent)
    return _fail(index_path, f"the index points to shard {name!r}, which does not exist in "
                             f"{index_path.parent}", tensor,
                 hint="Download every shard the index lists (a partial download?).")


def read_index(path: str | os.PathLike[str], *, check_shards: bool = True) -> ShardIndex:
    """Read and validate a sharded checkpoint's index file.

    Args:
        path: the ``*.safetensors.index.json`` file.
        check_shards: refuse an index naming a shard that does not exist (default ``True``);
            with ``False`` the caller checks each shard as it opens it.

    Returns:
        The :class:`ShardIndex`, with shard paths resolved relative to the index.

    Raises:
        SafetensorsFormatError: for invalid JSON, a missing or malformed ``weight_map``, a tensor
            named twice, a shard path leaving the index's directory, a shard that does not
            exist, or an index path that is not a readable regular file.
    """
    path = Path(path)
    fd, info = _paths.open_file(path)
    with os.fdopen(fd, "rb") as handle:
        if info.st_size > MAX_INDEX_BYTES:
            raise _fail(path, f"index file of {info.st_size} bytes is over the 100 MB limit")
        try:
            raw = handle.read(MAX_INDEX_BYTES + 1)
        except OSError as err:
            raise _paths.os_error(path, err) from None
    document = _load_json(raw, path, "index")
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise _fail(path, "the index has no \"weight_map\" object mapping tensor names to shard "
                          "files")
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise _fail(path, f"\"metadata\" is a JSON {type(metadata).__name__}, not an object")
    root = path.parent
    weight_map: dict[str, Path] = {}
    resolved: dict[str, Path] = {}
    for name, shard in document["weight_map"].items():
        if not isinstance(shard, str) or not shard:
            raise _fail(path, f"weight_map entry is {shard!r}, not a shard file name", name)
        if shard not in resolved:
            shard_path = Path(shard)
            if shard_path.is_absolute() or ".." in shard_path.parts:
                raise _fail(path, f"shard {shard!r} is outside the checkpoint directory", name,
                            hint="Shard names in weight_map must be relative to the index file.")
            full = root / shard_path
            # lexists: a dangling link or a link loop is reported by name when it is opened
            if check_shards and not os.path.lexists(full):
                raise missing_shard_error(path, full, name)
            resolved[shard] = full
        weight_map[name] = resolved[shard]
    return ShardIndex(path, weight_map, dict(metadata))
