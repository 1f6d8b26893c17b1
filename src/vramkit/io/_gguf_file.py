"""GGUF file headers, parsed and checked without reading tensor data (no torch, no numpy).

A GGUF file (llama.cpp's format, also what city96's ComfyUI-GGUF writes for FLUX) is: the magic
``GGUF``, a version (2 or 3), the tensor and key-value counts, the key-value metadata, one record
per tensor (name, dimensions innermost first, GGML type, offset), then the tensor data from the
next multiple of ``general.alignment`` (default 32). Every read is bounded by the file's size, so
a truncated or corrupt file is an error naming what is wrong and where, never a hang or a huge
allocation; an unknown tensor type is named with the tensor.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from vramkit._gguf_types import GGUF_FLOAT_TYPES, GGUF_QUANT_TYPES
from vramkit.errors import SafetensorsFormatError
from vramkit.io._paths import check_path

__all__ = ["GGUF_MAGIC", "GGUFHeader", "GGUFTensorInfo", "is_gguf", "read_gguf_header",
           "write_gguf"]

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_NAME = 1 << 16  # a key or tensor name longer than this is corruption, not a name
_MAX_DIMS = 8
_MAX_NESTING = 8  # arrays of arrays deeper than this are corruption (and would recurse)
_KEEP_ARRAY = 64  # arrays longer than this (tokenizer vocabularies) are summarized, not kept
# GGUF value types: id -> struct format of a scalar (8: string, 9: array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_HINT = ("The file is damaged or not a GGUF file; re-download it, or convert the model again "
         "(llama.cpp's convert scripts, or ComfyUI-GGUF's tools for diffusion models).")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor record of a GGUF file.

    Args:
        name: the tensor's name.
        shape: its shape in torch order (GGUF stores dimensions innermost first; reversed here).
        type_id: the GGML type id.
        type_name: ``"Q8_0"``, ``"F16"``, ...
        begin: first byte, relative to the data section.
        nbytes: bytes of data.
        quantized: whether the type is a block-quantized one (else a plain element type).
    """

    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    begin: int
    nbytes: int
    quantized: bool

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    """A parsed GGUF header.

    Args:
        path: the file.
        file_size: its size.
        version: the GGUF version.
        data_start: absolute offset of the tensor data section.
        tensors: the tensor records, in data-offset order.
        metadata: key -> value (long arrays summarized as ``"<array of N TYPE>"``).
    """

    path: Path
    file_size: int
    version: int
    data_start: int
    tensors: list[GGUFTensorInfo]
    metadata: dict[str, Any] = field(default_factory=dict)


def is_gguf(prefix: bytes) -> bool:
    """Whether a file's first bytes are GGUF's magic."""
    return prefix[:4] == GGUF_MAGIC


class _Reader:
    """Bounded reads from a file object: every read checks the bytes are there."""

    def __init__(self, handle: BinaryIO, path: Path, size: int) -> None:
        self.handle, self.path, self.size = handle, path, size
        self.offset = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.offset + n > self.size:
            raise SafetensorsFormatError(
                f"truncated GGUF file: {what} needs bytes [{self.offset}, {self.offset + n}) but "
                f"the file has {self.size}", path=self.path, hint=_HINT)
        data = self.handle.read(n)
        if len(data) != n:
            raise SafetensorsFormatError(f"short read of {what} at byte {self.offset}",
                                         path=self.path, hint=_HINT)
        self.offset += n
        return data

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"{what} length")
        if length > _MAX_NAME and what != "string value":
            raise SafetensorsFormatError(f"{what} of {length} bytes at byte {self.offset}: "
                                         "corrupt header", path=self.path, hint=_HINT)
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SafetensorsFormatError(f"{what} at byte {self.offset - length} is not UTF-8",
                                         path=self.path, hint=_HINT) from err

    def value(self, kind: int, key: str, depth: int = 0) -> Any:
        if depth > _MAX_NESTING:
            raise SafetensorsFormatError(f"metadata {key!r}: arrays nested over {_MAX_NESTING} "
                                         "deep", path=self.path, hint=_HINT)
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], f"value of {key!r}")
        if kind == _STRING:
            return self.string("string value")
        if kind == _ARRAY:
            item = self.unpack("<I", f"array type of {key!r}")
            count = self.unpack("<Q", f"array length of {key!r}")
            if item in _SCALARS:  # fixed-size items: skip a long array in one seek
                width = struct.calcsize(_SCALARS[item])
                if count > _KEEP_ARRAY:
                    self.skip(count * width, f"array {key!r}")
                    return f"<array of {count} {_type_name(item)}>"
            elif item not in (_STRING, _ARRAY):
                raise SafetensorsFormatError(f"metadata {key!r}: unknown array item type {item}",
                                             path=self.path, hint=_HINT)
            if count > self.size - self.offset:  # each item takes at least one byte
                raise SafetensorsFormatError(
                    f"truncated GGUF file: array {key!r} claims {count} items past the end",
                    path=self.path, hint=_HINT)
            items = [self.value(item, key, depth + 1) for _ in range(count)]
            return items if count <= _KEEP_ARRAY else f"<array of {count} {_type_name(item)}>"
        raise SafetensorsFormatError(f"metadata {key!r}: unknown value type {kind}",
                                     path=self.path, hint=_HINT)

    def skip(self, n: int, what: str) -> None:
        if self.offset + n > self.size:
            raise SafetensorsFormatError(
                f"truncated GGUF file: {what} needs bytes [{self.offset}, {self.offset + n}) but "
                f"the file has {self.size}", path=self.path, hint=_HINT)
        self.handle.seek(n, os.SEEK_CUR)
        self.offset += n


def _type_name(kind: int) -> str:
    names = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
             8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64"}
    return names.get(kind, str(kind))


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse and check a GGUF file's header.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The :class:`GGUFHeader`.

    Raises:
        SafetensorsFormatError: for a file that is not GGUF, an unsupported version, a truncated
            or corrupt header, an unknown tensor type, or tensor data past the end of the file
            (the tensor named).
    """
    path = Path(path)
    size = check_path(path).st_size
    with open(path, "rb") as handle:
        reader = _Reader(handle, path, size)
        magic = reader.take(4, "the magic") if size >= 4 else b""
        if magic != GGUF_MAGIC:
            raise SafetensorsFormatError(f"not a GGUF file (starts with {magic!r})", path=path,
                                         hint=_HINT)
        version = reader.unpack("<I", "the version")
        if version not in _VERSIONS:
            raise SafetensorsFormatError(f"GGUF version {version} is not supported (2 and 3 are)",
                                         path=path, hint="Convert the file with a current "
                                                         "llama.cpp.")
        n_tensors = reader.unpack("<Q", "the tensor count")
        n_kv = reader.unpack("<Q", "the metadata count")
        if n_tensors > size or n_kv > size:
            raise SafetensorsFormatError(f"GGUF header claims {n_tensors} tensors and {n_kv} "
                                         f"metadata entries in a {size}-byte file", path=path,
                                         hint=_HINT)
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string("metadata key")
            kind = reader.unpack("<I", f"type of {key!r}")
            metadata[key] = reader.value(kind, key)
        records = [_tensor_record(reader) for _ in range(n_tensors)]
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise SafetensorsFormatError(f"general.alignment {alignment!r} is not a power of two",
                                         path=path, hint=_HINT)
        data_start = -(-reader.offset // alignment) * alignment
    tensors = []
    seen: set[str] = set()
    for name, shape, type_id, begin in records:
        if name in seen:
            raise SafetensorsFormatError("tensor stored twice", path=path, tensor=name,
                                         hint=_HINT)
        seen.add(name)
        tensors.append(_info(path, name, shape, type_id, begin, data_start, size))
    tensors.sort(key=lambda t: t.begin)
    return GGUFHeader(path=path, file_size=size, version=version, data_start=data_start,
                      tensors=tensors, metadata=metadata)


def _tensor_record(reader: _Reader) -> tuple[str, tuple[int, ...], int, int]:
    name = reader.string("tensor name")
    dims = reader.unpack("<I", f"dimension count of {name!r}")
    if dims > _MAX_DIMS:
        raise SafetensorsFormatError(f"{dims} dimensions: corrupt tensor record",
                                     path=reader.path, tensor=name, hint=_HINT)
    shape = tuple(reader.unpack("<Q", f"shape of {name!r}") for _ in range(dims))
    type_id = reader.unpack("<I", f"type of {name!r}")
    begin = reader.unpack("<Q", f"offset of {name!r}")
    return name, tuple(reversed(shape)), type_id, begin


def _info(path: Path, name: str, shape: tuple[int, ...], type_id: int, begin: int,
          data_start: int, size: int) -> GGUFTensorInfo:
    numel = math.prod(shape)
    if type_id in GGUF_FLOAT_TYPES:
        type_name, width, _ = GGUF_FLOAT_TYPES[type_id]
        nbytes, quantized = numel * width, False
    elif type_id in GGUF_QUANT_TYPES:
        qtype = GGUF_QUANT_TYPES[type_id]
        type_name, quantized = qtype.name, True
        cols = shape[-1] if shape else 1
        if cols % qtype.block_size:
            raise SafetensorsFormatError(f"{qtype.name} rows of {cols} elements are not whole "
                                         f"blocks of {qtype.block_size}", path=path, tensor=name,
                                         hint=_HINT)
        nbytes = numel // qtype.block_size * qtype.type_size
    else:
        known = ", ".join(sorted({*(t.name for t in GGUF_QUANT_TYPES.values()),
                                  *(v[0] for v in GGUF_FLOAT_TYPES.values())}))
        raise SafetensorsFormatError(f"unknown GGML tensor type {type_id}", path=path, tensor=name,
                                     hint=f"Known types: {known}. The file may come from a newer "
                                          "llama.cpp; convert it to one of them.")
    if data_start + begin + nbytes > size:
        raise SafetensorsFormatError(
            f"truncated GGUF file: the tensor's data ends at byte {data_start + begin + nbytes} "
            f"but the file has {size}", path=path, tensor=name,
            hint="The download or copy was cut short; fetch the file again.")
    return GGUFTensorInfo(name, shape, type_id, type_name, begin, nbytes, quantized)


def write_gguf(path: str | os.PathLike[str],
               tensors: Sequence[tuple[str, tuple[int, ...], int, Callable[[], bytes | Any]]],
               metadata: dict[str, str] | None = None, *, alignment: int = _DEFAULT_ALIGNMENT
               ) -> int:
    """Write a GGUF (version 3) file, tensor by tensor: for benchmarks and tests that need a
    large file without the ``gguf`` package or the whole model in memory.

    Args:
        path: the file to write.
        tensors: ``(name, shape in torch order, GGML type id, data)`` with ``data()`` returning
            the tensor's bytes (anything with the buffer protocol), called once, in order.
        metadata: string key-value pairs.
        alignment: data alignment (default 32).

    Returns:
        The file's size.
    """
    out = bytearray(GGUF_MAGIC)
    out += struct.pack("<IQQ", 3, len(tensors), len(metadata or {}))

    def text(value: str) -> bytes:
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw

    for key, value in (metadata or {}).items():
        out += text(key) + struct.pack("<I", _STRING) + text(value)
    offset = 0
    sizes = []
    for name, shape, type_id, _ in tensors:
        numel = math.prod(shape)
        if type_id in GGUF_FLOAT_TYPES:
            nbytes = numel * GGUF_FLOAT_TYPES[type_id][1]
        else:
            qtype = GGUF_QUANT_TYPES[type_id]
            nbytes = numel // qtype.block_size * qtype.type_size
        out += text(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", type_id, offset)
        sizes.append(nbytes)
        offset += -(-nbytes // alignment) * alignment
    out += bytes(-len(out) % alignment)
    with open(path, "wb") as handle:
        handle.write(out)
        for (name, _, _, data), nbytes in zip(tensors, sizes, strict=True):
            raw = memoryview(data()).cast("B")
            if raw.nbytes != nbytes:
                raise ValueError(f"tensor {name!r}: {raw.nbytes} bytes given, {nbytes} expected")
            handle.write(raw)
            handle.write(bytes(-nbytes % alignment))
        return handle.tell()
