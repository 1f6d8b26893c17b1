"""Fused Triton kernel for the quantized AdamW8bit step (imported only when a CUDA tensor steps).

One kernel launch per parameter does what the torch reference path
(:meth:`vramkit.optim.adamw8bit.AdamW8bit._quantized_update`) does in ~25 launches per chunk:
each program takes ``rows`` whole quantization blocks, loads the gradient and the parameter,
dequantizes ``m`` (signed book) and ``r = sqrt(v)`` (unsigned book) from their codes and
per-block absmax, updates both moments and the parameter in fp32, and re-quantizes the moments
with fresh per-block absmax values, writing codes and scales in place.

Bit-compatibility with the torch path *on CUDA* is the design goal, so the kernel reproduces the
rounding of every ATen kernel the reference launches:

* the kernel is compiled with ``enable_fp_fusion=False`` (no implicit contraction of a multiply
  and an add into an FMA, ``ptxas --fmad=false``), and uses ``tl.fma`` exactly where ATen's CUDA
  kernels contract (``lerp``: ``self + w * (end - self)``; ``addcmul``/``addcdiv``:
  ``fma(alpha, b op c, a)``);
* divisions and square roots are IEEE round-to-nearest (``div_rn``, ``sqrt_rn``), as nvcc
  compiles ATen's ``/`` and ``sqrt``; the one division by a Python scalar
  (``r / sqrt(bias_correction2)``) is a multiplication by the fp32 reciprocal, as ATen's
  ``div_true_kernel_cuda`` computes it;
* every scalar is rounded to fp32 the way ATen's ``Scalar.to<float>()`` rounds it, and is passed
  as a runtime fp32 argument (never a ``constexpr``), so schedulers changing ``lr`` or the step
  count never trigger a recompile;
* rounding to the nearest code is a branch-free binary search over the midpoints between levels
  (stored as a breadth-first search tree, so one step's probes share cache lines) that counts
  the midpoints strictly below the value: what ``torch.bucketize(right=False)`` returns, ties
  included.

Padding elements of a tensor's last block take a zero gradient (as the reference pads) and are
re-quantized like the others, so codes match byte for byte; a block size that is not a power of
two is handled by masking lanes beyond it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import threading
from typing import cast

import torch
import triton
import triton.language as tl

from vramkit.optim._blockwise import CodeBook, codebook

__all__ = ["LAUNCHES", "MAX_BLOCK_SIZE", "SUPPORTED_DTYPES", "fused_quantized_update",
           "nearest_codes"]

logger = logging.getLogger(__name__)

# Largest quantization block one program holds in registers (16 values per thread at 8 warps;
# twice that spills); larger blocks take the torch path.
MAX_BLOCK_SIZE = 4096
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per program (whole blocks) and per thread: 8 per thread kept sm_90 at ~127 registers
# without spills (16 per thread needs ~220, halving the warps an SM can hold).
_TILE_ELEMENTS = 2048
_ELEMENTS_PER_THREAD = 8

# Kernel launches so far; tests read it to prove the fused path ran (a Python int: no GPU work).
LAUNCHES = 0

_TABLES: dict[tuple[str, int, str], torch.Tensor] = {}
_TABLES_LOCK = threading.Lock()


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32, as ATen's ``Scalar.to<float>()`` rounds it."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _launch_scope(tensor: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensor's. CPU tensors only reach
    here under ``TRITON_INTERPRET=1`` (the CPU check of the kernels' logic)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _eytzinger(sorted_values: list[float]) -> list[float]:
    """``sorted_values`` (``2**k - 1`` of them) in breadth-first order of their balanced search
    tree, 1-indexed (entry 0 is unused): node ``i`` has the children ``2i`` and ``2i + 1``."""
    tree = [math.nan] * (len(sorted_values) + 1)
    position = iter(sorted_values)

    def fill(node: int) -> None:  # in-order walk: left subtree, node, right subtree
        if node < len(tree):
            fill(2 * node)
            tree[node] = next(position)
            fill(2 * node + 1)

    fill(1)
    return tree


def _search_table(book: CodeBook) -> torch.Tensor:
    """The book's midpoints as the search tree of :func:`_nearest_code` (on the book's device).

    The midpoints are padded with ``+inf`` to ``2**bits - 1`` entries (never below a finite value,
    so never counted) and stored breadth-first: the probes of search step ``k`` all lie in entries
    ``2**k .. 2**(k+1) - 1``, so a warp's probes touch few cache lines, where the later steps of a
    search in the sorted table would scatter over all of it.
    """
    device = book.midpoints.device
    key = (book.kind, book.bits, str(device))
    table = _TABLES.get(key)
    if table is not None:
        return table
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None:
            # the CPU copy of the book: reading a CUDA tensor back would synchronize
            midpoints = codebook(book.kind, book.bits, "cpu").midpoints.tolist()
            padded = midpoints + [math.inf] * ((1 << book.bits) - 1 - len(midpoints))
            table = torch.tensor(_eytzinger(padded), dtype=torch.float32).to(device)
            _TABLES[key] = table
    return table


@triton.jit
def _nearest_code(x, tree_ptr, BITS: tl.constexpr):
    """Number of midpoints strictly below ``x`` (``torch.bucketize(x, mids, right=False)``).

    Descends the search tree of :func:`_search_table`, right where the node is below ``x``; after
    ``BITS`` steps the node index is ``2**BITS`` plus the number of midpoints below ``x`` (the
    tree's empty leaves, left to right, are the gaps between the sorted midpoints).
    """
    node = tl.full(x.shape, 1, dtype=tl.int32)
    for _ in tl.static_range(BITS):
        probe = tl.load(tree_ptr + node)
        node = 2 * node + (probe < x).to(tl.int32)
    return node - (1 << BITS)


@triton.jit
def _nearest_code_kernel(x_ptr, tree_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, _nearest_code(x, tree_ptr, BITS), mask=mask)


def nearest_codes(normalized: torch.Tensor, book: CodeBook) -> torch.Tensor:
    """Index of the nearest level for each value, by the kernel's binary search.

    Exposes the search the fused step uses so tests can compare it with ``torch.bucketize``
    (ties included) without going through a whole optimizer step.

    Args:
        normalized: float32 values (already divided by their block's absmax), on a CUDA device
            (or the CPU under ``TRITON_INTERPRET=1``).
        book: the code book, on the same device.

    Returns:
        int32 codes, shaped like ``normalized``.
    """
    flat = normalized.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.int32, device=flat.device)
    block = 1024
    grid = (triton.cdiv(flat.numel(), block),)
    with _launch_scope(flat):
        _nearest_code_kernel[grid](flat, _search_table(book), out, flat.numel(), BITS=book.bits,
                                   BLOCK=block)
    return out.view(normalized.shape)


@triton.jit
def _update_lanes(index, in_block, code_index, param_ptr, grad_ptr, m_codes_ptr,
                  r_codes_ptr, m_absmax, r_absmax, m_levels_ptr, r_levels_ptr, numel,
                  lerp_weight, beta2, one_minus_beta2, decay, neg_step_size, inv_bc2_sqrt, eps,
                  SHIFT: tl.constexpr, CODE_MASK: tl.constexpr):
    """Update m, r and the parameter for one ``[rows, lanes]`` tile; returns the new m and r.

    Each line mirrors one ATen op of the reference path (see the module docstring).
    """
    in_tensor = in_block & (index < numel)
    # grad.float(), padded with zeros past the tensor's end
    g = tl.load(grad_ptr + index, mask=in_tensor, other=0.0).to(tl.float32)
    m_code = (tl.load(m_codes_ptr + code_index, mask=in_block, other=0).to(tl.int32)
              >> SHIFT) & CODE_MASK
    r_code = (tl.load(r_codes_ptr + code_index, mask=in_block, other=0).to(tl.int32)
              >> SHIFT) & CODE_MASK
    # dequantize_blockwise: levels[code] * absmax
    m = tl.load(m_levels_ptr + m_code) * m_absmax[:, None]
    r = tl.load(r_levels_ptr + r_code) * r_absmax[:, None]
    # exp_avg.lerp_(grad, 1 - beta1): ATen's two-sided lerp, contracted by nvcc
    diff = g - m
    m_small = tl.fma(lerp_weight, diff, m)
    m_large = tl.fma(-diff, 1.0 - lerp_weight, g)
    m = tl.where(tl.abs(lerp_weight) < 0.5, m_small, m_large)
    # sqrt_sq.square_().mul_(beta2).addcmul_(grad, grad, value=1 - beta2).sqrt_()
    r_sq = r * r
    r_sq = r_sq * beta2
    r = tl.sqrt_rn(tl.fma(one_minus_beta2, g * g, r_sq))
    # _decay_and_apply: denom = r * (1 / bc2_sqrt) + eps; p = p * decay; p += -step * m / denom
    denom = r * inv_bc2_sqrt
    denom = denom + eps
    p_in = tl.load(param_ptr + index, mask=in_tensor, other=0.0)
    p = p_in.to(tl.float32) * decay
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)
    tl.store(param_ptr + index, p.to(p_in.dtype), mask=in_tensor)
    return m, r


@triton.jit
def _store_codes(values, in_block, absmax, tree_ptr, BITS: tl.constexpr):
    """Codes of ``values`` against ``absmax`` (quantize_blockwise's division and bucketize)."""
    # 1.17e-38: the smallest normal fp32, the reference's clamp_min(tiny) on absmax
    normalized = tl.div_rn(values, tl.maximum(absmax, 1.1754943508222875e-38)[:, None])
    code = _nearest_code(normalized, tree_ptr, BITS)
    return tl.where(in_block, code, 0)


@triton.jit
def _adamw_quantized_kernel(param_ptr, grad_ptr, m_codes_ptr, m_absmax_ptr, r_codes_ptr,
                            r_absmax_ptr, m_levels_ptr, m_tree_ptr, r_levels_ptr, r_tree_ptr,
                            numel, blocks, lerp_weight, beta2, one_minus_beta2, decay,
                            neg_step_size, inv_bc2_sqrt, eps, BLOCK_SIZE: tl.constexpr,
                            LANES: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < blocks
    m_absmax = tl.load(m_absmax_ptr + rows, mask=row_ok, other=0.0)
    r_absmax = tl.load(r_absmax_ptr + rows, mask=row_ok, other=0.0)
    lanes = tl.arange(0, LANES)
    if BITS == 8:
        # one code byte per element; LANES = next power of two >= BLOCK_SIZE
        in_block = row_ok[:, None] & (lanes[None, :] < BLOCK_SIZE)
        index = rows[:, None] * BLOCK_SIZE + lanes[None, :]
        m, r = _update_lanes(index, in_block, index, param_ptr, grad_ptr, m_codes_ptr,
                             r_codes_ptr, m_absmax, r_absmax, m_levels_ptr, r_levels_ptr, numel,
                             lerp_weight, beta2, one_minus_beta2, decay, neg_step_size,
                             inv_bc2_sqrt, eps, 0, 255)
        new_m_absmax = tl.max(tl.where(in_block, tl.abs(m), 0.0), axis=1)
        new_r_absmax = tl.max(tl.where(in_block, tl.abs(r), 0.0), axis=1)
        m_code = _store_codes(m, in_block, new_m_absmax, m_tree_ptr, BITS)
        r_code = _store_codes(r, in_block, new_r_absmax, r_tree_ptr, BITS)
        tl.store(m_codes_ptr + index, m_code.to(tl.uint8), mask=in_block)
        tl.store(r_codes_ptr + index, r_code.to(tl.uint8), mask=in_block)
    else:
        # two codes per byte: element 2j in the low nibble, 2j + 1 in the high one. The even and
        # odd elements are two half-width tiles; LANES = next power of two >= BLOCK_SIZE // 2.
        in_block = row_ok[:, None] & (lanes[None, :] < BLOCK_SIZE // 2)
        code_index = rows[:, None] * (BLOCK_SIZE // 2) + lanes[None, :]
        even = rows[:, None] * BLOCK_SIZE + 2 * lanes[None, :]
        m_lo, r_lo = _update_lanes(even, in_block, code_index, param_ptr, grad_ptr,
                                   m_codes_ptr, r_codes_ptr, m_absmax, r_absmax, m_levels_ptr,
                                   r_levels_ptr, numel, lerp_weight, beta2, one_minus_beta2,
                                   decay, neg_step_size, inv_bc2_sqrt, eps, 0, 15)
        m_hi, r_hi = _update_lanes(even + 1, in_block, code_index, param_ptr, grad_ptr,
                                   m_codes_ptr, r_codes_ptr, m_absmax, r_absmax, m_levels_ptr,
                                   r_levels_ptr, numel, lerp_weight, beta2, one_minus_beta2,
                                   decay, neg_step_size, inv_bc2_sqrt, eps, 4, 15)
        new_m_absmax = tl.maximum(tl.max(tl.where(in_block, tl.abs(m_lo), 0.0), axis=1),
                                  tl.max(tl.where(in_block, tl.abs(m_hi), 0.0), axis=1))
        new_r_absmax = tl.maximum(tl.max(tl.where(in_block, tl.abs(r_lo), 0.0), axis=1),
                                  tl.max(tl.where(in_block, tl.abs(r_hi), 0.0), axis=1))
        m_byte = (_store_codes(m_lo, in_block, new_m_absmax, m_tree_ptr, BITS)
                  | (_store_codes(m_hi, in_block, new_m_absmax, m_tree_ptr, BITS) << 4))
        r_byte = (_store_codes(r_lo, in_block, new_r_absmax, r_tree_ptr, BITS)
                  | (_store_codes(r_hi, in_block, new_r_absmax, r_tree_ptr, BITS) << 4))
        tl.store(m_codes_ptr + code_index, m_byte.to(tl.uint8), mask=in_block)
        tl.store(r_codes_ptr + code_index, r_byte.to(tl.uint8), mask=in_block)
    tl.store(m_absmax_ptr + rows, new_m_absmax, mask=row_ok)
    tl.store(r_absmax_ptr + rows, new_r_absmax, mask=row_ok)


def fused_quantized_update(flat_param: torch.Tensor, flat_grad: torch.Tensor,
                           state: dict[str, object], m_book: CodeBook, r_book: CodeBook,
                           hyper: tuple[float, ...]) -> None:
    """One AdamW step of a parameter with quantized moments, in a single kernel launch.

    Args:
        flat_param: the parameter, contiguous 1-D (fp32, bf16 or fp16), updated in place.
        flat_grad: its gradient, 1-D, same device (fp32, bf16 or fp16); made contiguous if not.
        state: the optimizer state holding ``exp_avg_codes`` / ``exp_avg_absmax`` /
            ``exp_avg_sq_sqrt_codes`` / ``exp_avg_sq_sqrt_absmax``, ``block_size`` and
            ``state_bits`` (codes and scales are updated in place).
        m_book: the signed book of ``exp_avg`` (on the parameter's device).
        r_book: the unsigned book of ``sqrt(exp_avg_sq)`` (on the parameter's device).
        hyper: ``(beta1, beta2, lr, eps, weight_decay, step_size, bias_correction2_sqrt)`` as
            :meth:`AdamW8bit._step_param` computes them.
    """
    global LAUNCHES
    beta1, beta2, lr, eps, weight_decay, step_size, bias_correction2_sqrt = hyper
    block_size, bits = cast(int, state["block_size"]), cast(int, state["state_bits"])
    m_absmax = cast(torch.Tensor, state["exp_avg_absmax"])
    blocks = m_absmax.numel()
    width = block_size if bits == 8 else block_size // 2
    lanes = triton.next_power_of_2(width)
    rows = max(1, _TILE_ELEMENTS // (lanes if bits == 8 else 2 * lanes))
    tile = rows * lanes * (1 if bits == 8 else 2)
    num_warps = max(1, min(8, tile // (32 * _ELEMENTS_PER_THREAD)))
    grid = (triton.cdiv(blocks, rows),)
    args = (flat_param, flat_grad.contiguous(), state["exp_avg_codes"], m_absmax,
            state["exp_avg_sq_sqrt_codes"], state["exp_avg_sq_sqrt_absmax"], m_book.levels,
            _search_table(m_book), r_book.levels, _search_table(r_book), flat_param.numel(),
            blocks,
            float(1 - beta1), float(beta2), float(1 - beta2), float(1 - lr * weight_decay),
            float(-step_size),
            # ATen divides a tensor by a Python scalar as a multiplication by its fp32 reciprocal
            _fp32(1.0 / _fp32(float(bias_correction2_sqrt))), float(eps))
    with _launch_scope(flat_param):
        _adamw_quantized_kernel[grid](*args, BLOCK_SIZE=block_size, LANES=lanes, ROWS=rows,
                                      BITS=bits, num_warps=num_warps, enable_fp_fusion=False)
    LAUNCHES += 1
