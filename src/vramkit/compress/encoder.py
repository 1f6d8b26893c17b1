"""The encoder: bytes in, a :class:`~vramkit.compress.format.Compressed` out.

Vectorized torch, on whatever device the work is given (a GPU encodes a FLUX block in
milliseconds, the CPU is the reference and what tests use). Memory stays bounded: the data is
read in chunks of whole groups, three times (histogram, bits per group, then the bits
themselves), and written straight into the payload, whose exact size is known after the second
pass (so a swapper can allocate it from a pinned pool once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vramkit.compress.format import (
    GROUP,
    LANES,
    MODE,
    RECORD,
    SECTION_ALIGN,
    STEPS,
    Compressed,
    Header,
    Region,
    payload_crc,
)
from vramkit.compress.huffman import (
    MAX_CODE_BITS,
    canonical_codes,
    code_lengths,
    coded_bits,
    decode_table,
    single_symbol_table,
)
from vramkit.errors import CompressionError

__all__ = ["Allocator", "byte_kind", "encode", "encode_tensor", "fill_regions",
           "symbol_histogram"]

#: Returns a uint8 CPU tensor of exactly the bytes asked for (a pinned pool's block, say).
Allocator = Callable[[int], torch.Tensor]

# Groups encoded at once: 64 groups = 2 Mi elements, ~100 MiB of int64 temporaries (a GPU
# takes 4x that: fewer, larger launches and host syncs).
CHUNK_GROUPS = 64
CUDA_CHUNK_GROUPS = 256
TABLE_BYTES = (1 << MAX_CODE_BITS) * 2
# A region is coded only when that saves at least this share of its bytes (the tables, lane
# lengths and group records cost something, and a decode step is not free).
MIN_SAVING = 0.03

_BYTE_DTYPES = {torch.int8, torch.uint8} | {
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)}


def byte_kind(dtype: torch.dtype) -> str:
    """How a tensor of ``dtype`` is coded: ``"bf16"``, ``"byte"`` (int8, uint8, fp8) or
    ``"raw"``."""
    if dtype == torch.bfloat16:
        return "bf16"
    return "byte" if dtype in _BYTE_DTYPES else "raw"


def fill_regions(nbytes: int, regions: Sequence[Region]) -> list[Region]:
    """``regions`` sorted, with ``raw`` regions in the gaps so they cover ``[0, nbytes)``."""
    out: list[Region] = []
    at = 0
    for r in sorted(regions, key=lambda r: r.offset):
        if r.offset < at or r.offset + r.nbytes > nbytes:
            raise CompressionError(f"region {r} overlaps another or leaves the {nbytes}-byte "
                                   "buffer", hint="Give disjoint byte ranges inside the buffer.")
        if r.offset > at:
            out.append(Region(at, r.offset - at, "raw"))
        if r.nbytes:
            out.append(r)
        at = r.offset + r.nbytes
    if at < nbytes:
        out.append(Region(at, nbytes - at, "raw"))
    return out


def _symbols(data: torch.Tensor, kind: str) -> torch.Tensor:
    """The coded symbols of a region's bytes (int64): bf16 exponents, or the bytes."""
    if kind == "bf16":
        return (data.view(torch.int16).to(torch.int32) >> 7).to(torch.int64) & 0xFF
    return data.to(torch.int64)


def symbol_histogram(data: torch.Tensor, kind: str) -> torch.Tensor:
    """Counts of the 256 symbols a region of ``kind`` codes (int64, on ``data``'s device)."""
    counts = torch.zeros(256, dtype=torch.int64, device=data.device)
    step = CHUNK_GROUPS * GROUP * (2 if kind == "bf16" else 1)
    for start in range(0, data.numel(), step):
        counts += torch.bincount(_symbols(data[start:start + step], kind), minlength=256)
    return counts


@dataclass
class _Plan:
    region: Region
    kind: str
    n: int  # elements
    groups: int
    lengths: list[int] | None = None
    codes: torch.Tensor | None = None  # int64 [256], on the work device
    lens: torch.Tensor | None = None  # int64 [256]
    table: torch.Tensor | None = None
    group_words: torch.Tensor | None = None  # int64 [groups] (coded)


def encode(data: torch.Tensor, regions: Sequence[Region] | None = None, *,
           device: torch.device | str | None = None, alloc: Allocator | None = None,
           crc: bool = True, chunk_groups: int | None = None) -> Compressed:
    """Encode the bytes of ``data`` (uint8, 1-D) coded as ``regions`` say (the rest raw).

    Args:
        data: the decoded bytes, on any device.
        regions: byte ranges and how each is coded (:class:`Region`); gaps are stored raw.
            ``None``: the whole buffer raw.
        device: where the encoding work runs (default: ``data``'s device); a CUDA device
            encodes a host buffer chunk by chunk.
        alloc: allocates the payload (a uint8 CPU tensor of exactly the bytes asked); default
            ``torch.empty``.
        crc: compute the payload's crc32 (the header keeps 0 otherwise).
        chunk_groups: groups encoded at once (default :data:`CUDA_CHUNK_GROUPS` on a GPU,
            :data:`CHUNK_GROUPS` on the CPU): fewer bound the temporaries (~1.6 MiB of them a
            group), e.g. beside a training step; the payload is the same.

    Returns:
        The :class:`Compressed` buffer, its payload on the CPU.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise CompressionError(f"encode takes a 1-D uint8 tensor, got {data.dtype} "
                               f"{tuple(data.shape)}",
                               hint="Pass tensor.view(-1).view(torch.uint8) (or encode_tensor).")
    work = torch.device(device) if device is not None else data.device
    nbytes = data.numel()
    plans = []
    step = chunk_groups or (CUDA_CHUNK_GROUPS if work.type == "cuda" else CHUNK_GROUPS)
    for region in fill_regions(nbytes, regions or ()):
        plans.extend(_plan(data, region, work, step))
    n_groups = sum(p.groups for p in plans)
    coded = [p for p in plans if p.kind != "raw"]
    # section sizes (bytes)
    sizes = {
        "groups": n_groups * RECORD * 8,
        "tables": len(coded) * TABLE_BYTES,
        "lanes": sum(p.groups for p in coded) * LANES * 2,
        "plane": sum(p.n for p in plans if p.kind != "byte"),
        "words": 4 * (sum(int(p.group_words.sum()) for p in coded  # type: ignore[union-attr]
                          ) + 2),
    }
    offsets: dict[str, int] = {}
    at = 0
    for name in ("groups", "tables", "lanes", "plane", "words"):
        offsets[name] = at
        at = _align(at + sizes[name])
    total = offsets["words"] + sizes["words"]
    payload = alloc(total) if alloc is not None else torch.empty(total, dtype=torch.uint8)
    if payload.numel() != total or payload.dtype != torch.uint8 or payload.device.type != "cpu":
        raise CompressionError(f"the payload allocator returned {payload.dtype} "
                               f"{tuple(payload.shape)} on {payload.device}, not {total} "
                               "uint8 bytes on the CPU")
    payload.zero_()  # padding between sections is part of the crc: make it defined
    header = Header(nbytes, total, n_groups, offsets["groups"], offsets["tables"],
                    offsets["lanes"], offsets["plane"], offsets["words"], 0)
    out = Compressed(header, payload)
    records = out.records()
    tables = out.section("tables", torch.int16)
    lanes = out.section("lanes", torch.int16)
    plane = out.section("plane", torch.uint8)
    words = out.section("words", torch.int32)
    group = table_i = lane_i = plane_i = word_i = 0
    for p in plans:
        table_off = -1
        if p.kind != "raw":
            assert p.table is not None
            tables[table_i * (TABLE_BYTES // 2):(table_i + 1) * (TABLE_BYTES // 2)] = p.table
            table_off = table_i * (TABLE_BYTES // 2)
            table_i += 1
        for first in range(0, p.groups, step):
            count = min(step, p.groups - first)
            chunk = _encode_chunk(data, p, first, count, work)
            rec = records[group:group + count]
            rec[:, 0] = chunk.out_off
            rec[:, 1] = chunk.n
            rec[:, 2] = MODE[p.kind]
            rec[:, 3] = table_off
            rec[:, 7] = chunk.checksum
            if p.kind != "byte":
                rec[:, 4] = plane_i + torch.arange(count) * GROUP
                m = int(chunk.n.sum())
                plane[plane_i:plane_i + m] = chunk.plane
                plane_i += m
            else:
                rec[:, 4] = -1
            if p.kind != "raw":
                assert chunk.lanes is not None and chunk.words is not None
                assert chunk.word_starts is not None
                rec[:, 5] = word_i + chunk.word_starts
                rec[:, 6] = lane_i + torch.arange(count) * LANES
                lanes[lane_i:lane_i + count * LANES] = chunk.lanes
                lane_i += count * LANES
                words[word_i:word_i + chunk.words.numel()] = chunk.words
                word_i += chunk.words.numel()
            else:
                rec[:, 5] = rec[:, 6] = -1
            group += count
    header = Header(nbytes, total, n_groups, offsets["groups"], offsets["tables"],
                    offsets["lanes"], offsets["plane"], offsets["words"],
                    payload_crc(payload) if crc else 0)
    return Compressed(header, payload)


def encode_tensor(tensor: torch.Tensor, *, device: torch.device | str | None = None,
                  alloc: Allocator | None = None, crc: bool = True) -> Compressed:
    """Encode one tensor's bytes, coded by its dtype (:func:`byte_kind`)."""
    flat = tensor.detach().contiguous().view(-1)
    data = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8,
                                                                   device=flat.device)
    return encode(data, [Region(0, data.numel(), byte_kind(tensor.dtype))], device=device,
                  alloc=alloc, crc=crc)


def _align(n: int) -> int:
    return -(-n // SECTION_ALIGN) * SECTION_ALIGN


def _plan(data: torch.Tensor, region: Region, work: torch.device, step: int) -> list[_Plan]:
    """How one region is coded: its code (or raw when coding would not pay); ``step`` groups
    are counted at once."""
    kind = region.kind
    width = 2 if kind == "bf16" else 1
    n = region.nbytes // width
    raw = _Plan(region, "raw", region.nbytes, -(-region.nbytes // GROUP))
    if kind == "raw" or n == 0:
        return [raw] if region.nbytes else []
    part = data[region.offset:region.offset + region.nbytes].to(work)
    counts = symbol_histogram(part, kind).tolist()
    lengths = code_lengths(counts)
    groups = -(-n // GROUP)
    present = [s for s in range(256) if counts[s]]
    cost = (coded_bits(counts, lengths) // 8 + groups * (LANES * 2 + 4 + RECORD * 8)
            + TABLE_BYTES + (n if kind == "bf16" else 0))
    if cost > (1 - MIN_SAVING) * region.nbytes:
        return [raw]
    plan = _Plan(region, kind, n, groups, lengths)
    plan.lens = torch.tensor(lengths, dtype=torch.int64, device=work)
    plan.codes = torch.tensor(canonical_codes(lengths), dtype=torch.int64, device=work)
    plan.table = (single_symbol_table(present[0]) if len(present) == 1
                  else decode_table(lengths))
    # words per group, from the bits each group's symbols take (plus the word boundary)
    words = []
    for first in range(0, groups, step):
        count = min(step, groups - first)
        sym, valid = _group_symbols(part, kind, first, count)
        bits = (plan.lens[sym] * valid).view(count, -1).sum(1)
        words.append((bits + 31) // 32)
    plan.group_words = torch.cat(words).cpu()
    return [plan]


def _group_symbols(part: torch.Tensor, kind: str, first: int, count: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symbols of ``count`` groups from ``first``, padded to whole groups, and which are real."""
    width = 2 if kind == "bf16" else 1
    lo = first * GROUP * width
    raw = part[lo:lo + count * GROUP * width]
    sym = _symbols(raw, kind)
    valid = torch.ones(count * GROUP, dtype=torch.int64, device=part.device)
    if sym.numel() < count * GROUP:
        valid[sym.numel():] = 0
        sym = torch.nn.functional.pad(sym, (0, count * GROUP - sym.numel()))
    return sym, valid


@dataclass
class _Chunk:
    out_off: torch.Tensor
    n: torch.Tensor
    checksum: torch.Tensor
    plane: torch.Tensor | None = None
    lanes: torch.Tensor | None = None
    words: torch.Tensor | None = None
    word_starts: torch.Tensor | None = None


def _weights(device: torch.device) -> torch.Tensor:
    return 1 + (torch.arange(GROUP, dtype=torch.int64, device=device) & 255)


def _encode_chunk(data: torch.Tensor, p: _Plan, first: int, count: int, work: torch.device
                  ) -> _Chunk:
    region = p.region
    width = 2 if p.kind == "bf16" else 1
    starts = torch.arange(first, first + count, dtype=torch.int64) * GROUP
    n = (p.n - starts).clamp(max=GROUP)
    out_off = region.offset + starts * width
    lo = region.offset + first * GROUP * width
    raw = data[lo:lo + int(n.sum()) * width].to(work)
    pad = count * GROUP - raw.numel() // width
    if p.kind == "bf16":
        values = raw.view(torch.int16).to(torch.int64) & 0xFFFF
    else:
        values = raw.to(torch.int64)
    values = torch.nn.functional.pad(values, (0, pad)).view(count, GROUP)
    checksum = (values * _weights(work)).sum(1).cpu()
    chunk = _Chunk(out_off, n, checksum)
    if p.kind == "raw":
        chunk.plane = raw.cpu()
        return chunk
    if p.kind == "bf16":
        sm = ((values >> 8) & 0x80) | (values & 0x7F)
        chunk.plane = sm.view(-1)[:raw.numel() // 2].to(torch.uint8).cpu()
    assert p.lens is not None and p.codes is not None and p.group_words is not None
    sym = torch.nn.functional.pad(_symbols(raw, p.kind), (0, pad))
    valid = (torch.arange(count * GROUP, device=work) < raw.numel() // width).to(torch.int64)
    # element i of a group is step i // LANES of lane i % LANES; a lane's codes follow each
    # other, lane after lane: reorder [group, step, lane] -> [group, lane, step]
    lens = (p.lens[sym] * valid).view(count, STEPS, LANES).transpose(1, 2).reshape(count, -1)
    codes = p.codes[sym].view(count, STEPS, LANES).transpose(1, 2).reshape(count, -1)
    chunk.lanes = lens.view(count, LANES, STEPS).sum(2).view(-1).to(torch.int16).cpu()
    group_words = p.group_words[first:first + count].to(work)
    word_starts = torch.cumsum(group_words, 0) - group_words
    bitpos = torch.cumsum(lens, 1) - lens + (word_starts * 32)[:, None]
    total_words = int(group_words.sum())
    chunk.words = _pack(bitpos.view(-1), codes.view(-1), lens.view(-1), total_words)
    chunk.word_starts = word_starts.cpu()
    return chunk


def _pack(bitpos: torch.Tensor, codes: torch.Tensor, lens: torch.Tensor, total_words: int
          ) -> torch.Tensor:
    """Codes into uint32 words (as int32 bits), most significant bit first: a code of ``l``
    bits at bit ``p`` sits in word ``p // 32``, spilling into the next one. Codes never overlap,
    so adding their parts is OR-ing them."""
    keep = lens > 0
    bitpos, codes, lens = bitpos[keep], codes[keep], lens[keep]
    word = bitpos >> 5
    shift = bitpos & 31
    end = shift + lens
    fits = end <= 32
    hi = torch.where(fits, codes << (32 - end).clamp(min=0), codes >> (end - 32).clamp(min=0))
    lo = torch.where(fits, torch.zeros_like(codes), (codes << (64 - end).clamp(max=63))
                     & 0xFFFFFFFF)
    acc = torch.zeros(total_words + 1, dtype=torch.int64, device=codes.device)
    acc.index_add_(0, word, hi)
    acc.index_add_(0, word + 1, lo)
    acc = acc[:total_words]
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32).cpu()
