"""Decoding: the torch reference (any device; the oracle of the tests) and the dispatch to the
GPU kernel (:mod:`vramkit.compress._triton`).

The reference walks every thread's stream one step at a time, all threads of all groups at once
(``STEPS`` vectorized steps), exactly as the kernel's threads do, and checks what the kernel
checks: each stream ends where its lane length says, each group's decoded values give its
checksum.
"""

from __future__ import annotations

import torch

from vramkit.compress.format import GROUP, LANES, STEPS, Compressed, validate_records
from vramkit.errors import CompressionError

__all__ = ["check_flag", "decode", "decode_into", "decode_reference", "new_flag",
           "triton_decoder_available"]


def decode(c: Compressed, device: torch.device | str | None = None) -> torch.Tensor:
    """The decoded bytes (uint8, ``c.nbytes``) on ``device`` (default: the payload's).

    A CUDA device with Triton decodes with the GPU kernel (the payload is copied there first),
    anything else with the reference. Raises :class:`~vramkit.errors.CompressionError` when
    the payload is corrupted.
    """
    target = torch.device(device) if device is not None else c.payload.device
    out = torch.empty(c.nbytes, dtype=torch.uint8, device=target)
    payload = c.payload.to(target, non_blocking=True)
    flag = new_flag(target)
    decode_into(c.to(payload), out, flag)
    check_flag(flag)
    return out


def new_flag(device: torch.device | str) -> torch.Tensor:
    """The error flag a GPU decode raises (one int32, 0 while every decode checked out)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def check_flag(flag: torch.Tensor, what: str = "compressed buffer") -> None:
    """Raise :class:`CompressionError` when a decode set ``flag`` (a host sync on a GPU)."""
    if int(flag.item()):
        raise CompressionError(
            f"decoding a {what} failed its checks (a stream ended early or late, or the "
            "decoded values' checksum differs): the compressed copy is corrupted")


def triton_decoder_available(device: torch.device) -> bool:
    """Whether :func:`decode_into` runs the GPU kernel on ``device``."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def decode_into(c: Compressed, out: torch.Tensor, flag: torch.Tensor | None = None, *,
                reference: bool = False) -> None:
    """Decode ``c`` (its payload on ``out``'s device) into ``out`` (uint8, ``c.nbytes``).

    On CUDA with Triton this launches the kernel on the current stream and returns at once:
    a failed check sets ``flag`` (see :func:`check_flag`; ``None``: not reported). Elsewhere,
    or with ``reference=True``, the torch reference decodes and raises
    :class:`CompressionError` on a failed check.
    """
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < c.nbytes:
        raise CompressionError(f"decode_into needs a 1-D uint8 output of {c.nbytes} bytes, got "
                               f"{out.dtype} {tuple(out.shape)}")
    if c.payload.device != out.device:
        raise CompressionError(f"the payload is on {c.payload.device}, the output on "
                               f"{out.device}", hint="Copy the payload to the output's device "
                                                     "first (Compressed.to).")
    if c.header.n_groups == 0:
        return
    if not reference and triton_decoder_available(out.device):
        from vramkit.compress import _triton

        _triton.decode(c, out, flag)
        return
    decode_reference(c, out)


def decode_reference(c: Compressed, out: torch.Tensor) -> None:
    """The reference decoder (vectorized torch on the payload's device)."""
    validate_records(c)
    h = c.header
    records = c.records()
    device = records.device
    tables = c.section("tables", torch.int16).to(torch.int64)
    lanes = c.section("lanes", torch.int16).to(torch.int64)
    plane = c.section("plane", torch.uint8)
    words = c.section("words", torch.int32).to(torch.int64) & 0xFFFFFFFF
    mode = records[:, 2]
    n = records[:, 1]
    index = torch.arange(GROUP, device=device)
    valid = index[None, :] < n[:, None]  # [groups, GROUP]
    # int32 values: a bf16 pattern times its checksum weight (< 2**24) still fits
    values = torch.zeros(h.n_groups, GROUP, dtype=torch.int32, device=device)
    rows = (mode != 1).nonzero().view(-1)  # sign+mantissa or raw bytes
    if rows.numel() and plane.numel():
        where = (records[rows, 4:5] + index[None, :]).clamp(0, plane.numel() - 1)
        values[rows] = plane[where].to(torch.int32) * valid[rows]
    coded = (mode <= 1).nonzero().view(-1)
    if coded.numel():
        symbols = _walk(records[coded], tables, lanes, words, h.max_bits).to(torch.int32)
        sm = values[coded]
        values[coded] = torch.where(
            (mode[coded] == 0)[:, None],
            ((sm & 0x80) << 8) | (symbols << 7) | (sm & 0x7F), symbols) * valid[coded]
    weights = (1 + (index & 255)).to(torch.int32)
    if not torch.equal((values * weights).sum(1, dtype=torch.int64), records[:, 7]):
        raise CompressionError(
            "decoded values differ from their checksum: the compressed copy is corrupted")
    _scatter(records, values, valid, out)


def _walk(records: torch.Tensor, tables: torch.Tensor, lanes: torch.Tensor,
          words: torch.Tensor, max_bits: int) -> torch.Tensor:
    """Run every thread of the coded groups ``records``: symbols ``[groups, GROUP]``."""
    device = records.device
    count = records.shape[0]
    lane = torch.arange(LANES, device=device)
    length = lanes[(records[:, 6:7] + lane[None, :]).clamp(0, lanes.numel() - 1)]
    start = records[:, 5:6] * 32 + torch.cumsum(length, 1) - length
    pos = start.clone()
    n = records[:, 1:2]
    table = records[:, 3:4]
    mask = (1 << max_bits) - 1
    last = words.numel() - 1
    symbols = torch.empty(count, STEPS, LANES, dtype=torch.int64, device=device)
    for k in range(STEPS):
        valid = (k * LANES + lane)[None, :] < n
        w = pos >> 5
        w0 = words[w.clamp(0, last)]
        w1 = words[(w + 1).clamp(0, last)]
        window = (((w0 << 32) | w1) >> (64 - max_bits - (pos & 31))) & mask
        entry = tables[(table + window).clamp(0, tables.numel() - 1)]
        symbols[:, k] = entry & 0xFF
        pos = pos + torch.where(valid, entry >> 8, 0)
    if not torch.equal(pos, start + length):
        raise CompressionError(
            "a compressed bit stream does not end where its length says: the compressed copy "
            "is corrupted")
    return symbols.view(count, GROUP)


def _scatter(records: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
             out: torch.Tensor) -> None:
    wide = records[:, 2] == 0
    index = torch.arange(GROUP, device=records.device)
    if bool(wide.any()):
        where = (records[wide, 0:1] // 2 + index[None, :])[valid[wide]]
        v = values[wide][valid[wide]]
        out16 = out[:out.numel() // 2 * 2].view(torch.int16)
        out16[where] = torch.where(v >= 1 << 15, v - (1 << 16), v).to(torch.int16)
    narrow = ~wide
    if bool(narrow.any()):
        where = (records[narrow, 0:1] + index[None, :])[valid[narrow]]
        out[where] = values[narrow][valid[narrow]].to(torch.uint8)
