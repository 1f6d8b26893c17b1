"""The compressed format: what a :class:`Compressed` holds, byte for byte.

A buffer of ``nbytes`` decoded bytes is cut into *regions* (:class:`Region`), each coded one way:

* ``"bf16"``: bfloat16 values. The 8 exponent bits carry a few dozen distinct values in trained
  weights (2.6-3 bits of entropy), the sign and 7 mantissa bits look random. Each value is
  split into a raw byte (sign << 7 | mantissa) kept as is, and an exponent coded with the
  region's own canonical Huffman code.
* ``"byte"``: one-byte storage (int8, uint8, fp8): the whole byte is coded.
* ``"raw"``: stored as is (other dtypes, gaps between tensors, data a code would not shrink).

Regions are cut into *groups* of ``LANES * STEPS`` elements, each decoded by one GPU program of
``LANES`` threads: thread ``l`` decodes elements ``l, l + LANES, l + 2 * LANES, ...`` of its group
(so each step the threads write neighbouring elements: coalesced), reading its own bit stream.
A group's streams follow each other from a 32-bit word boundary; each thread finds its start
from the group's word and the bit lengths of the threads before it (a prefix sum of the
``uint16`` lane lengths). No thread waits for another: a block decodes in one launch.

The payload (the bytes copied to the device) has five sections, each 16-byte aligned:

``groups``  int64 ``[n_groups, 8]``: output byte offset, elements, mode (0 bf16, 1 byte, 2 raw),
            table offset (entries), plane offset (bytes), first bit-stream word, lane-length
            offset (entries), checksum of the decoded values.
``tables``  int16 ``[2 ** MAX_CODE_BITS]`` per coded region: ``symbol | length << 8``.
``lanes``   uint16 ``[LANES]`` per coded group: the bits each thread reads.
``plane``   uint8: sign+mantissa bytes (bf16), raw bytes (raw); nothing for ``byte``.
``words``   uint32 bit streams, most significant bit first, two spare words at the end.

Integrity: the header carries a crc32 of the payload (checked by :func:`check_crc`, by the
disk tier and on request), and every group a checksum of its decoded values
(``sum(v_i * (1 + (i & 255)))``) that both decoders verify, with the end position of every
thread's stream: a corrupted payload is a :class:`~vramkit.errors.CompressionError`, never
silent garbage.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from vramkit.compress.huffman import MAX_CODE_BITS
from vramkit.errors import CompressionError

__all__ = ["FORMAT_VERSION", "LANES", "STEPS", "Compressed", "Header", "Region", "check_crc",
           "payload_crc"]

#: Bumped whenever a byte of the layout changes meaning.
FORMAT_VERSION = 1
#: Threads per group (one GPU program).
LANES = 256
#: Elements each thread decodes in a group. 128 keeps the lane lengths (2 bytes per 128
#: elements) at 0.8 % of a bf16 region and still gives a FLUX block thousands of programs.
STEPS = 128
GROUP = LANES * STEPS
SECTION_ALIGN = 16
KINDS = ("bf16", "byte", "raw")
MODE = {"bf16": 0, "byte": 1, "raw": 2}
RECORD = 8  # int64 fields per group

_MAGIC = b"VKZC"
_HEADER = struct.Struct("<4sHHHHQQQ5QII")  # magic, version, lanes, steps, max bits, nbytes,
# payload bytes, groups, 5 section offsets, payload crc32, header crc32


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes at ``offset`` of the decoded buffer, coded as ``kind``."""

    offset: int
    nbytes: int
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CompressionError(f"region kind {self.kind!r} is not one of {KINDS}",
                                   hint="Use 'bf16' for bfloat16, 'byte' for int8/fp8 storage, "
                                        "'raw' for the rest.")
        if self.offset < 0 or self.nbytes < 0:
            raise CompressionError(f"region at {self.offset} of {self.nbytes} bytes",
                                   hint="Offsets and sizes are non-negative byte counts.")
        if self.kind == "bf16" and (self.offset % 2 or self.nbytes % 2):
            raise CompressionError(
                f"a bf16 region needs an even offset and size, got {self.offset}+{self.nbytes}",
                hint="Give the byte range of a bfloat16 tensor.")


@dataclass(frozen=True)
class Header:
    """The fixed fields of a compressed buffer (section offsets into the payload)."""

    nbytes: int
    payload_nbytes: int
    n_groups: int
    groups: int
    tables: int
    lanes: int
    plane: int
    words: int
    crc: int
    version: int = FORMAT_VERSION
    lanes_per_group: int = LANES
    steps: int = STEPS
    max_bits: int = MAX_CODE_BITS

    def to_bytes(self) -> bytes:
        fields = (_MAGIC, self.version, self.lanes_per_group, self.steps, self.max_bits,
                  self.nbytes, self.payload_nbytes, self.n_groups, self.groups, self.tables,
                  self.lanes, self.plane, self.words, self.crc)
        body = _HEADER.pack(*fields, 0)
        return _HEADER.pack(*fields, zlib.crc32(body[:-4]))

    @classmethod
    def from_bytes(cls, data: bytes) -> Header:
        if len(data) < _HEADER.size:
            raise CompressionError(f"a compressed header is {_HEADER.size} bytes, got "
                                   f"{len(data)}")
        fields = _HEADER.unpack(data[:_HEADER.size])
        if fields[0] != _MAGIC:
            raise CompressionError(f"not a vramkit compressed buffer (magic {fields[0]!r})")
        if zlib.crc32(data[:_HEADER.size - 4]) != fields[-1]:
            raise CompressionError("the compressed header is corrupted (crc32 mismatch)")
        version, lanes, steps, max_bits = fields[1:5]
        if (version, lanes, steps, max_bits) != (FORMAT_VERSION, LANES, STEPS, MAX_CODE_BITS):
            raise CompressionError(
                f"compressed format version {version} ({lanes} lanes x {steps} steps, "
                f"{max_bits}-bit codes); this vramkit reads version {FORMAT_VERSION} "
                f"({LANES} x {STEPS}, {MAX_CODE_BITS}-bit)",
                hint="Encode the weights again with this vramkit version.")
        return cls(*fields[5:14], version=version, lanes_per_group=lanes, steps=steps,
                   max_bits=max_bits)

    @staticmethod
    def size() -> int:
        return _HEADER.size

    def check(self) -> None:
        """The section offsets are in order and inside the payload."""
        offsets = (self.groups, self.tables, self.lanes, self.plane, self.words,
                   self.payload_nbytes)
        if (list(offsets) != sorted(offsets) or self.groups != 0
                or self.tables - self.groups < self.n_groups * RECORD * 8
                or any(o % SECTION_ALIGN for o in offsets[:-1])
                or self.payload_nbytes - self.words < 8):
            raise CompressionError(f"the compressed header's sections are inconsistent: {self}")


@dataclass(frozen=True)
class Compressed:
    """A compressed buffer: its :class:`Header` and the payload (uint8, any device; host
    memory, pinned or not, for a swapper's master)."""

    header: Header
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Decoded bytes."""
        return self.header.nbytes

    @property
    def compressed_nbytes(self) -> int:
        """Bytes of the payload (what a copy moves)."""
        return self.header.payload_nbytes

    @property
    def ratio(self) -> float:
        """Payload bytes over decoded bytes (1.0 for an empty buffer)."""
        return self.compressed_nbytes / self.nbytes if self.nbytes else 1.0

    def section(self, name: str, dtype: torch.dtype, payload: torch.Tensor | None = None
                ) -> torch.Tensor:
        """A typed view of one section of ``payload`` (default: this one's)."""
        h = self.header
        bounds = {"groups": (h.groups, h.tables), "tables": (h.tables, h.lanes),
                  "lanes": (h.lanes, h.plane), "plane": (h.plane, h.words),
                  "words": (h.words, h.payload_nbytes)}[name]
        data = self.payload if payload is None else payload
        raw = data[bounds[0]:bounds[1]]
        if name == "groups":
            raw = raw[:h.n_groups * RECORD * 8]
        return raw.view(dtype)

    def records(self) -> torch.Tensor:
        """The group table, int64 ``[n_groups, 8]``."""
        return self.section("groups", torch.int64).view(-1, RECORD)

    def to(self, payload: torch.Tensor) -> Compressed:
        """The same buffer over another copy of its payload (e.g. a device scratch)."""
        return Compressed(self.header, payload)

    def to_bytes(self) -> bytes:
        """Header then payload, as written to a file."""
        return self.header.to_bytes() + self.payload.cpu().numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, verify: bool = True
                   ) -> Compressed:
        """Read :meth:`to_bytes` back (crc32 of the payload checked unless ``verify=False``)."""
        header = Header.from_bytes(bytes(data[:Header.size()]))
        header.check()
        body = memoryview(data)[Header.size():]
        if len(body) != header.payload_nbytes:
            raise CompressionError(f"the compressed payload holds {len(body)} bytes, its "
                                   f"header says {header.payload_nbytes}")
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8) if len(body) else (
            torch.empty(0, dtype=torch.uint8))
        out = cls(header, payload)
        if verify:
            check_crc(out)
        validate_records(out)
        return out


def payload_crc(payload: torch.Tensor) -> int:
    """crc32 of a host payload (zlib releases the GIL on large buffers)."""
    if payload.numel() == 0:
        return 0
    return zlib.crc32(payload.cpu().numpy())


def check_crc(c: Compressed) -> None:
    """Raise :class:`CompressionError` when the payload's crc32 differs from the header's."""
    got = payload_crc(c.payload)
    if got != c.header.crc:
        raise CompressionError(
            f"compressed payload of {c.compressed_nbytes} bytes is corrupted: crc32 "
            f"{got:08x}, header says {c.header.crc:08x}")


def validate_records(c: Compressed) -> None:
    """Every group's offsets lie inside their sections and the decoded buffer, so a decoder
    never reads or writes out of bounds (raises :class:`CompressionError` otherwise)."""
    h = c.header
    h.check()
    if h.n_groups == 0:
        return
    r = c.records().cpu()
    out_off, n, mode, table, plane, word, lane = (r[:, i] for i in range(7))
    width = torch.where(mode == 0, 2, 1)
    coded = mode <= 1
    n_tables = (h.lanes - h.tables) // 2
    n_lanes = (h.plane - h.lanes) // 2
    n_words = (h.payload_nbytes - h.words) // 4
    bad = ((mode < 0) | (mode > 2) | (n < 0) | (n > GROUP) | (out_off < 0)
           | (out_off + n * width > h.nbytes) | ((mode == 0) & (out_off % 2 != 0))
           | ((mode != 1) & ((plane < 0) | (plane + n > h.words - h.plane)))
           | (coded & ((table < 0) | (table + (1 << h.max_bits) > n_tables)))
           | (coded & ((lane < 0) | (lane + LANES > n_lanes)))
           | (coded & ((word < 0) | (word > n_words - 2))))
    if bool(bad.any()):
        g = int(bad.nonzero()[0, 0])
        raise CompressionError(f"compressed group {g} of {h.n_groups} points outside its "
                               f"buffer: {r[g].tolist()}")
