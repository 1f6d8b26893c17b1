"""The GPU decoder: one Triton program per group, one thread per lane (imported only when a
CUDA decode runs).

Each program reads its group's record, then loops ``STEPS`` times: every thread reads the next
``MAX_CODE_BITS`` bits of its stream (two 32-bit words, most significant bit first), looks them
up in the region's table (8 KiB, L1-resident), and writes its element; at step ``k`` the threads
write elements ``k * LANES ... k * LANES + LANES - 1`` of the group: one coalesced store. A bf16
element joins the decoded exponent with its sign+mantissa byte. The program then checks that
every stream ended where its lane length says and that the values sum to the group's checksum,
and sets the error flag otherwise. Every load and store is masked to its buffer, so even a
corrupted group table cannot write outside the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vramkit.compress.format import LANES, STEPS, Compressed

__all__ = ["decode"]


@triton.jit
def _decode_kernel(records_ptr, tables_ptr, lanes_ptr, plane_ptr, words_ptr, out8_ptr,
                   out16_ptr, flag_ptr, out_nbytes, n_tables, n_lanes, n_plane, n_words,
                   LANES_: tl.constexpr, STEPS_: tl.constexpr, BITS: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    rec = records_ptr + g * 8
    out_off = tl.load(rec)
    n = tl.load(rec + 1)
    mode = tl.load(rec + 2)
    table = tl.load(rec + 3)
    plane_off = tl.load(rec + 4)
    word = tl.load(rec + 5)
    lane_off = tl.load(rec + 6)
    expect = tl.load(rec + 7)
    lane = tl.arange(0, LANES_).to(tl.int64)
    acc = tl.zeros([LANES_], dtype=tl.int64)
    bad = tl.zeros([LANES_], dtype=tl.int32)
    if mode == 2:
        for k in range(STEPS_):
            i = k * LANES_ + lane
            m = i < n
            v = tl.load(plane_ptr + plane_off + i, mask=m & (plane_off + i < n_plane),
                        other=0).to(tl.int64)
            tl.store(out8_ptr + out_off + i, v.to(tl.uint8), mask=m & (out_off + i < out_nbytes))
            acc += v * (1 + (i & 255))
    else:
        length = tl.load(lanes_ptr + lane_off + lane, mask=lane_off + lane < n_lanes,
                         other=0).to(tl.int64)
        start = word * 32 + tl.cumsum(length, 0) - length
        pos = start
        mask_bits = (1 << BITS) - 1
        for k in range(STEPS_):
            i = k * LANES_ + lane
            m = i < n
            w = pos >> 5
            w0 = tl.load(words_ptr + w, mask=w < n_words, other=0).to(tl.int64) & 0xFFFFFFFF
            w1 = tl.load(words_ptr + w + 1, mask=w + 1 < n_words,
                         other=0).to(tl.int64) & 0xFFFFFFFF
            window = (((w0 << 32) | w1) >> (64 - BITS - (pos & 31))) & mask_bits
            t = table + window
            entry = tl.load(tables_ptr + t, mask=t < n_tables, other=0).to(tl.int64)
            symbol = entry & 0xFF
            pos += tl.where(m, entry >> 8, 0)
            if mode == 0:
                sm = tl.load(plane_ptr + plane_off + i, mask=m & (plane_off + i < n_plane),
                             other=0).to(tl.int64)
                v = ((sm & 0x80) << 8) | (symbol << 7) | (sm & 0x7F)
                o = out_off // 2 + i
                tl.store(out16_ptr + o, v.to(tl.int16), mask=m & (o * 2 + 1 < out_nbytes))
            else:
                v = symbol
                o = out_off + i
                tl.store(out8_ptr + o, v.to(tl.uint8), mask=m & (o < out_nbytes))
            acc += tl.where(m, v * (1 + (i & 255)), 0)
        bad = (pos != start + length).to(tl.int32)
    failed = (tl.sum(acc, 0) != expect) | (tl.max(bad, 0) != 0)
    if failed:
        tl.atomic_max(flag_ptr, 1)


# One kernel, in 64-bit integer arithmetic: a 32-bit variant was measured beside it on an H200
# (276-282 against 274-296 GB/s decoded, benchmarks/compress.py): no faster, and it missed a
# corrupted payload this kernel flags.


def decode(c: Compressed, out: torch.Tensor, flag: torch.Tensor | None) -> None:
    """Launch the kernel on the current stream: ``c``'s payload (on the GPU) into ``out``."""
    h = c.header
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=out.device)
    records = c.records()
    tables = c.section("tables", torch.int16)
    lanes = c.section("lanes", torch.int16)
    plane = c.section("plane", torch.uint8)
    words = c.section("words", torch.int32)
    out16 = out[:out.numel() // 2 * 2].view(torch.int16)
    _decode_kernel[(h.n_groups,)](
        records, tables, lanes, plane, words, out, out16, flag, c.nbytes, tables.numel(),
        lanes.numel(), plane.numel(), words.numel(), LANES_=LANES, STEPS_=STEPS,
        BITS=h.max_bits, num_warps=8)
