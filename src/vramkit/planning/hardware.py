"""GPU hardware profiles for the planner: memory, host link and tensor-core peaks, every number
sourced.

A planner predicts a step's time from the work in it -- FLOPs, bytes read from device memory,
bytes copied between host and device -- and the rate at which a named GPU does each. This module
holds those rates. Each :class:`HardwareProfile` records:

``memory_bytes``
    Total device memory **as the driver reports it**: the ``Total`` of ``nvidia-smi`` (the
    figure NVML returns, and that ``torch.cuda.get_device_properties(i).total_memory`` reports),
    in bytes. It is what the card is sold as, less a few MiB the firmware keeps: a "24 GB" RTX
    4090 reports 24564 MiB, an "80 GB" H100 81559 MiB. It is *not* what a process can allocate:
    the CUDA context (a few hundred MiB), a display, and other processes take their share, and a
    planner subtracts those itself.

``h2d_bytes_per_s`` / ``d2h_bytes_per_s``
    Effective bandwidth of a large copy from pinned host memory to the device and back, as
    ``nvbandwidth`` (``host_to_device_memcpy_ce`` / ``device_to_host_memcpy_ce``) or CUDA's
    ``bandwidthTest --memory=pinned`` measure it on a well-configured host, one GPU copying at a
    time. This is a property of the link generation and width (``pcie``) more than of the GPU:
    every PCIe 4.0 x16 card here gets the same figures, taken from published measurements. Where
    no measurement was found (the RTX 4060 Ti's 4.0 x8 link) the figure is the raw link rate times
    the efficiency measured on 4.0 x16 (about 0.80 host-to-device, 0.83 device-to-host), and its
    source says so. Pageable (not pinned) memory, a link that trained at a lower generation or
    width, a PCIe switch shared with other GPUs, or copies in both directions at once all give
    less.

``bf16_flops``
    Dense BF16 tensor-core throughput with FP32 accumulation, FLOP/s (a multiply-add counts as
    two FLOPs), as the vendor's datasheet or architecture whitepaper gives it at the boost
    clock. Dense, never the 2:4-sparse figure the datasheets put first (that one is twice as
    large). GeForce cards run FP16/BF16 with FP32 accumulation at **half** their FP16-accumulate
    rate; BF16 only accumulates in FP32, so their BF16 figure is the halved one. Data-centre and
    workstation cards (A100, H100, H200, L4, L40S, RTX A6000) run FP32 accumulation at full rate.

``fp8_flops``
    Dense FP8 (E4M3/E5M2) tensor-core throughput with FP32 accumulation, FLOP/s, or ``None`` for
    GPUs without FP8 tensor cores (Ampere and older). GeForce Ada and Blackwell again halve it
    relative to FP16 accumulation (NVIDIA corrected the RTX 4090's row to that in v2.02 of the Ada
    whitepaper).

``int8_flops``
    Dense INT8 tensor-core throughput with INT32 accumulation, operations/s (a multiply-add
    counts as two), or ``None`` where no figure was found. GeForce cards run INT8 at full rate
    (accumulation is always INT32), four times their BF16-with-FP32-accumulation figure.

``fp8_gemm_vs_bf16`` / ``int8_gemm_vs_bf16``
    Where it was measured: how fast an 8-bit GEMM (``torch._scaled_mm`` fp8 with row-wise
    scales, ``torch._int_mm``) ran against a bf16 GEMM of the same shapes on this card (or its
    silicon), a ratio of achieved speeds that replaces the ratio of the datasheet peaks for
    W8A8 compute (:mod:`vramkit.planning.w8a8`). ``None``: not measured, the peaks' ratio is
    used. The peaks promise 2x (fp8) and 2x (int8) on Hopper; ``benchmarks/w8a8.py`` on an H200
    measured 1.46-1.65x and 0.87-0.94x on FLUX shapes.

``memory_bandwidth_bytes_per_s``
    Peak device-memory (HBM or GDDR) bandwidth from the vendor's specification.

``pcie``
    The host link as the card uses it, ``"<generation> x<lanes>"`` (``"4.0 x16"``). SXM modules
    reach the host over PCIe too (NVLink joins GPUs to each other, not to an x86 host).

``sources``
    Where each number comes from: entries ``"<group>: <source>"`` whose group is one of
    :attr:`HardwareProfile.SOURCE_GROUPS` -- ``memory`` (``memory_bytes``), ``host-link``
    (``pcie``, ``h2d_bytes_per_s``, ``d2h_bytes_per_s``), ``compute`` (``bf16_flops``,
    ``fp8_flops``, ``int8_flops``, the measured GEMM ratios) and ``memory-bandwidth`` -- each with a URL or a document and its table or
    page. Every profile has at least one source in every group.

Throughput figures are **vendor peaks**, not what kernels reach: a planner multiplies them by an
achieved fraction (large GEMMs reach roughly 0.6 to 0.8 of the tensor-core peak, streaming
kernels 0.8 to 0.9 of the memory bandwidth; consumer cards sustain their boost clock less well
than the peak assumes). The table bakes in no efficiency, so that fraction stays a visible,
tunable input of the planner. Copy bandwidths are the exception by nature: a link has no "peak"
anyone reaches, so those figures are measured (or derived) effective rates.

:func:`hardware_profile` finds a profile by name, forgivingly: ``"rtx4090"``, ``"RTX 4090"``,
``"rtx-4090"``, ``"4090"`` and the name CUDA reports (``"NVIDIA GeForce RTX 4090"``) all give the
same profile. A name that fits several cards (``"H100"``: SXM or PCIe? ``"RTX 4060 Ti"``: 8 or
16 GB?) is refused with the candidates, rather than guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from vramkit._validate import check_choice, check_int, check_number
from vramkit.errors import ConfigError

__all__ = ["PAGEABLE_MEMCPY_BYTES_PER_S", "PAGEABLE_MEMCPY_SOURCE", "PROFILES", "HardwareProfile",
           "hardware_profile"]

_MIB = 1024**2
_GB = 1e9  # bandwidths are quoted in decimal GB/s
_T = 1e12  # throughputs are quoted in decimal TFLOP/s

#: The host memcpy rate an offline plan assumes for pageable masters
#: (``SwapConfig(host_memory="pageable")``: each block is copied into a pinned staging chunk
#: before its pinned host->device copy, the two overlapped, so the slower paces it). A GPU
#: profile says nothing of the host it sits in, and no published figure of a multi-threaded
#: copy on a typical desktop was found, so it is derived (and said so in the plan's notes);
#: a measured machine times its own memcpy.
PAGEABLE_MEMCPY_BYTES_PER_S = 12 * _GB
PAGEABLE_MEMCPY_SOURCE = (
    "assumed, not measured: dual-channel DDR4-3200 moves 51.2 GB/s, a copy reads and writes "
    "every byte (25.6 GB/s of copy) and streaming copies reach about half of that: 12 GB/s")


def _pcie_raw(gt_per_s: float, lanes: int) -> float:
    """Raw per-direction bytes/s of a PCIe 3.0+ link: GT/s per lane, 128b/130b encoding."""
    return gt_per_s * 1e9 * lanes * (128 / 130) / 8


#: The host links a profile may name -> raw per-direction rate in bytes/s, before packet
#: overhead (no copy reaches it; see the module docstring).
_PCIE_LINKS: dict[str, float] = {
    "3.0 x16": _pcie_raw(8, 16),
    "4.0 x8": _pcie_raw(16, 8),
    "4.0 x16": _pcie_raw(16, 16),
    "5.0 x8": _pcie_raw(32, 8),
    "5.0 x16": _pcie_raw(32, 16),
}

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU's memory, host-link and tensor-core figures, each with its sources.

    See the module docstring for what each number means and how it was obtained.

    Attributes:
        name: the key in :data:`PROFILES` (lowercase, ``"rtx4090"``).
        label: the product's full name (``"NVIDIA GeForce RTX 4090"``).
        memory_bytes: total device memory as the driver reports it, in bytes.
        h2d_bytes_per_s: effective pinned host-to-device copy bandwidth, bytes/s.
        d2h_bytes_per_s: effective pinned device-to-host copy bandwidth, bytes/s.
        bf16_flops: dense BF16 tensor-core peak with FP32 accumulation, FLOP/s.
        fp8_flops: dense FP8 tensor-core peak with FP32 accumulation, FLOP/s; ``None`` without
            FP8 tensor cores.
        memory_bandwidth_bytes_per_s: peak device-memory bandwidth, bytes/s.
        pcie: the host link, ``"<generation> x<lanes>"``.
        sources: ``"<group>: <source>"`` entries, at least one for each of
            :attr:`SOURCE_GROUPS`.
        int8_flops: dense INT8 tensor-core peak, operations/s; ``None`` without a figure.
        fp8_gemm_vs_bf16 / int8_gemm_vs_bf16: an 8-bit GEMM's measured speed over a bf16
            GEMM's of the same shapes on this card (``None``: not measured; the peaks' ratio).

    Raises:
        ConfigError: for a field of the wrong type or out of range, an unknown ``pcie`` link, a
            copy bandwidth above the raw rate of that link, or a source group left without a
            source.
    """

    #: The groups of numbers a source backs (the ``<group>`` of a ``sources`` entry).
    SOURCE_GROUPS: ClassVar[tuple[str, ...]] = ("memory", "host-link", "compute",
                                                 "memory-bandwidth")

    name: str
    label: str
    memory_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    memory_bandwidth_bytes_per_s: float
    pcie: str
    sources: tuple[str, ...]
    int8_flops: float | None = None
    fp8_gemm_vs_bf16: float | None = None
    int8_gemm_vs_bf16: float | None = None

    def __post_init__(self) -> None:
        where = f"HardwareProfile({self.name!r})"
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(f"HardwareProfile.name must be a lowercase key such as 'rtx4090', "
                              f"got {self.name!r}",
                              hint="Use lowercase letters, digits and hyphens.")
        if not isinstance(self.label, str) or not self.label.strip():
            raise ConfigError(f"{where}.label must be a non-empty string, got {self.label!r}",
                              hint="Give the product's full name, e.g. 'NVIDIA GeForce RTX 4090'.")
        check_int(f"{where}.memory_bytes", self.memory_bytes, minimum=1)
        pcie = check_choice(f"{where}.pcie", self.pcie, tuple(_PCIE_LINKS))
        link = _PCIE_LINKS[pcie]
        canonical: dict[str, Any] = {}
        for field in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            canonical[field] = check_number(
                f"{where}.{field}", getattr(self, field), minimum=0, maximum=link,
                low_open=True,
                hint=f"A PCIe {pcie} link carries at most {link / _GB:.1f} GB/s each way; give "
                     "the measured effective copy bandwidth in bytes/s.")
        for field in ("bf16_flops", "memory_bandwidth_bytes_per_s"):
            canonical[field] = check_number(f"{where}.{field}", getattr(self, field),
                                            minimum=0, low_open=True)
        for field in ("fp8_flops", "int8_flops", "fp8_gemm_vs_bf16", "int8_gemm_vs_bf16"):
            canonical[field] = check_number(f"{where}.{field}", getattr(self, field), minimum=0,
                                            low_open=True, allow_none=True)
        canonical["sources"] = _check_sources(where, self.sources, self.SOURCE_GROUPS)
        for field, value in canonical.items():
            object.__setattr__(self, field, value)

    @property
    def link_bytes_per_s(self) -> float:
        """The raw per-direction rate of the ``pcie`` link, bytes/s (an upper bound no copy
        reaches)."""
        return _PCIE_LINKS[self.pcie]

    def sources_for(self, group: str) -> tuple[str, ...]:
        """The ``sources`` entries of one group (``"memory"``, ``"host-link"``, ``"compute"`` or
        ``"memory-bandwidth"``), prefix included.

        Raises:
            ConfigError: for a group that is not one of :attr:`SOURCE_GROUPS`.
        """
        check_choice("group", group, self.SOURCE_GROUPS)
        return tuple(s for s in self.sources if s.startswith(f"{group}: "))


def _check_sources(where: str, sources: object, groups: tuple[str, ...]) -> tuple[str, ...]:
    hint = (f"Give a tuple of '<group>: <source>' strings, at least one for each group of "
            f"{list(groups)}.")
    if isinstance(sources, str) or not isinstance(sources, Iterable):
        raise ConfigError(f"{where}.sources must be a tuple of strings, got {sources!r}",
                          hint=hint)
    entries = tuple(sources)
    for entry in entries:
        if not isinstance(entry, str) or not any(
                entry.startswith(f"{g}: ") and entry[len(g) + 2:].strip() for g in groups):
            raise ConfigError(f"{where}.sources has an entry that names no group: {entry!r}",
                              hint=hint)
    missing = [g for g in groups if not any(e.startswith(f"{g}: ") for e in entries)]
    if missing:
        raise ConfigError(f"{where}.sources has no source for {missing}", hint=hint)
    return entries


# --- sources shared by several profiles --------------------------------------------------------

_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper v2.02, https://images.nvidia.com/aem-dam/"
           "Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_BLACKWELL_WP = ("NVIDIA RTX Blackwell GPU Architecture whitepaper v1.1, https://images.nvidia.com/"
                 "aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf, "
                 "Appendix A, Table 3 'GeForce RTX 5090 vs GeForce RTX 4090 vs GeForce RTX 3090 "
                 "Specs' (printed pp. 46-48)")
_GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper v2, https://www.nvidia.com/content/"
             "PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
_HOPPER_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, https://resources.nvidia.com/"
              "en-us-tensor-core/gtc22-whitepaper-hopper, Table 3 'Comparison of NVIDIA A100 and "
              "H100 Data Center GPUs' (pp. 39-40)")
_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
            " (H100 SXM / H100 PCIe columns; '*' figures are with sparsity)")

# Ada GeForce per-SM rate, from the RTX 4090 row of the Ada whitepaper: 165.2 TFLOP/s /
# (128 SMs x 2.52 GHz) = 512 BF16 FLOP/clk/SM with FP32 accumulation, 1024 for FP8.
_ADA_RATE = ("compute: derived as SMs x 512 BF16 (1024 FP8) FLOP/clk/SM x boost clock, the "
             "GeForce Ada rate with FP32 accumulation implied by the RTX 4090 row of the Ada "
             "whitepaper (165.2 TFLOP/s = 128 SMs x 512 x 2.52 GHz); it equals NVIDIA's 'AI "
             "TOPS' figure (FP8, 2:4 sparse, FP16 accumulate) divided by 8 for BF16 and by 4 "
             "for FP8")

_PCIE4_X16_H2D = 25 * _GB
_PCIE4_X16_D2H = 26 * _GB
_PCIE4_X16_LINK = (
    "host-link: nvbandwidth v0.2 on 8x GeForce RTX 4090 (PCIe 4.0 x16): "
    "host_to_device_memcpy_ce 23.9-26.4 GB/s, device_to_host_memcpy_ce 26.3-27.1 GB/s, "
    "https://github.com/NVIDIA/nvbandwidth/issues/15",
    "host-link: nvbandwidth v0.8 on A100-SXM4-40GB (PCIe 4.0 x16 host link): "
    "host_to_device_memcpy_sm 25.13 GB/s at 512 MiB-1 GiB, "
    "https://github.com/NVIDIA/nvbandwidth/issues/42",
    "host-link: table value 25 GB/s H2D, 26 GB/s D2H for every PCIe 4.0 x16 card (79% / 83% of "
    "the 31.5 GB/s raw link rate)",
)
_HOPPER_H2D = 55 * _GB
_HOPPER_D2H = 50 * _GB
_HOPPER_LINK = (
    "host-link: H100 80GB HBM3 SXM5 (PCIe 5.0 x16 host link), 4-node Voltage Park cluster: GPU "
    "H2D 54.8 GB/s, GPU D2H 46.8 GB/s, aigatech/vpbenchmarking README "
    "(https://github.com/aigatech/vpbenchmarking)",
    "host-link: nvbandwidth on 8x H100: device_to_host_memcpy_sm 52.8 GB/s, "
    "https://github.com/NVIDIA/nvbandwidth/issues/24",
    "host-link: table value 55 GB/s H2D, 50 GB/s D2H for Hopper on PCIe 5.0 x16 (87% / 79% of "
    "the 63.0 GB/s raw link rate)",
)


#: An 8-bit GEMM's achieved speed over a bf16 GEMM of the same shapes, measured by
#: benchmarks/w8a8.py on an H200 (FLUX shapes, 4096 tokens, 3072 -> 3072 and -> 12288):
#: ``torch._scaled_mm`` fp8 with row-wise scales 1.46-1.65x, ``torch._int_mm`` 0.87-0.94x; the
#: midpoints. The int8 GEMM is slower than bf16 there: a plan on Hopper never gains speed by
#: int8 W8A8 (the datasheet promises 2x for both).
H200_FP8_GEMM_VS_BF16 = 1.555
H200_INT8_GEMM_VS_BF16 = 0.905


def _mib(count: int) -> int:
    return count * _MIB


_PROFILE_LIST: tuple[HardwareProfile, ...] = (
    HardwareProfile(
        name="rtx3090",
        label="NVIDIA GeForce RTX 3090",
        memory_bytes=_mib(24576),  # nvidia-smi Total 24576 MiB (24 GB GDDR6X)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=71.2 * _T,
        fp8_flops=None,  # Ampere: no FP8 tensor cores
        int8_flops=284 * _T,
        memory_bandwidth_bytes_per_s=936 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA GeForce RTX 3090 ... 24576MiB' (driver 580.142), "
            "https://github.com/noonghunna/club-3090/issues/390",
            *_PCIE4_X16_LINK,
            f"compute: {_BLACKWELL_WP}: RTX 3090 Peak BF16 Tensor TFLOPS with FP32 Accumulate "
            "71.2/142.4 (dense/sparse); GA102 whitepaper Appendix A gives 71/142",
            f"compute: {_BLACKWELL_WP}: RTX 3090 Peak INT8 Tensor TOPS 284/568 (dense/sparse)",
            f"memory-bandwidth: {_BLACKWELL_WP}: RTX 3090 Memory Bandwidth 936 GB/s; "
            f"{_GA102_WP}, Appendix A",
        ),
    ),
    HardwareProfile(
        name="rtx3060-12gb",
        label="NVIDIA GeForce RTX 3060 12GB",
        memory_bytes=_mib(12288),  # nvidia-smi Total 12288 MiB (12 GB GDDR6)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=25.5 * _T,
        fp8_flops=None,  # Ampere: no FP8 tensor cores
        int8_flops=101.9 * _T,
        memory_bandwidth_bytes_per_s=360 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA GeForce RTX 3060 ... 12288MiB' (driver 580.95.05), "
            "https://github.com/geerlingguy/raspberry-pi-pcie-devices/issues/790",
            *_PCIE4_X16_LINK,
            "compute: derived, 28 SMs x 512 BF16 FLOP/clk/SM x 1.777 GHz boost = 25.5 TFLOP/s; "
            "512 FLOP/clk/SM is the GeForce GA10x rate with FP32 accumulation implied by the RTX "
            "3090's 71.2 TFLOP/s (82 SMs x 512 x 1.695 GHz); SM count and boost clock from "
            "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3060-3060ti/ "
            "(3584 CUDA cores, 1.78 GHz)",
            "compute: INT8 derived, 28 SMs x 2048 INT8 ops/clk/SM x 1.777 GHz = 101.9 TOPS; 2048 "
            "is the GA10x rate implied by the RTX 3090's 284 TOPS (82 SMs x 2048 x 1.695 GHz)",
            "memory-bandwidth: 15 Gbps GDDR6 x 192-bit / 8 = 360 GB/s, NVIDIA RTX 3060 "
            "specifications, https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/"
            "rtx-3060-3060ti/",
        ),
    ),
    HardwareProfile(
        name="rtx4060ti-16gb",
        label="NVIDIA GeForce RTX 4060 Ti 16GB",
        memory_bytes=_mib(16380),  # nvidia-smi Total 16380 MiB (16 GB GDDR6)
        h2d_bytes_per_s=12.5 * _GB,
        d2h_bytes_per_s=13 * _GB,
        bf16_flops=44.1 * _T,
        fp8_flops=88.3 * _T,
        int8_flops=176.5 * _T,
        memory_bandwidth_bytes_per_s=288 * _GB,
        pcie="4.0 x8",
        sources=(
            "memory: nvidia-smi 'NVIDIA GeForce RTX 4060 Ti ... 165W ... 16380MiB', the same "
            "Total in several independent public logs on GitHub (no single issue thread)",
            "host-link: AD106 has an 8-lane PCIe 4.0 interface (15.75 GB/s raw), Hardwareluxx "
            "RTX 4060 Ti review, https://hardwareluxx.de/index.php/artikel/hardware/grafikkarten/"
            "61026-geforce-rtx-4060-ti-mit-8-gb-im-test.html?start=25",
            "host-link: no published pinned-copy measurement found; derived as 15.75 GB/s x 0.79 "
            "(H2D) and x 0.83 (D2H), the efficiencies measured on PCIe 4.0 x16 "
            "(https://github.com/NVIDIA/nvbandwidth/issues/15) = 12.5 / 13.0 GB/s",
            f"{_ADA_RATE}: 34 SMs x 2.535 GHz = 44.1 TFLOP/s BF16, 88.3 FP8 (353 AI TOPS / 8, / 4), "
            "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4060-4060ti/",
            "compute: INT8 derived, 34 SMs x 2048 INT8 ops/clk/SM x 2.535 GHz = 176.5 TOPS; 2048 "
            "is the GeForce Ada rate implied by the RTX 4090 row of the Ada whitepaper (660.6 "
            "TOPS = 128 SMs x 2048 x 2.52 GHz)",
            "memory-bandwidth: 18 Gbps GDDR6 x 128-bit / 8 = 288 GB/s, NVIDIA RTX 4060 Ti "
            "specifications, https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/"
            "rtx-4060-4060ti/",
        ),
    ),
    HardwareProfile(
        name="rtx4070ti-super",
        label="NVIDIA GeForce RTX 4070 Ti SUPER",
        memory_bytes=_mib(16376),  # nvidia-smi Total 16376 MiB (16 GB GDDR6X, AD103)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=88.2 * _T,
        fp8_flops=176.4 * _T,
        int8_flops=352.8 * _T,
        memory_bandwidth_bytes_per_s=672 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'RTX 4070 Ti SUPER ... 285W ... 16376MiB' in public logs on "
            "GitHub (no single issue thread); every 16 GB AD103 card (RTX 4080, 4070 Ti SUPER) "
            "reports 16376 MiB",
            *_PCIE4_X16_LINK,
            f"{_ADA_RATE}: 66 SMs x 2.61 GHz = 88.2 TFLOP/s BF16, 176.4 FP8 (706 AI TOPS / 8, "
            "/ 4), https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4070-family/",
            "compute: INT8 derived, 66 SMs x 2048 INT8 ops/clk/SM x 2.61 GHz = 352.8 TOPS (the "
            "GeForce Ada rate of the RTX 4090's 660.6 TOPS)",
            "memory-bandwidth: 21 Gbps GDDR6X x 256-bit / 8 = 672 GB/s, NVIDIA RTX 4070 family "
            "specifications, https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/"
            "rtx-4070-family/",
        ),
    ),
    HardwareProfile(
        name="rtx4080",
        label="NVIDIA GeForce RTX 4080",
        memory_bytes=_mib(16376),  # nvidia-smi Total 16376 MiB (16 GB GDDR6X)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=97.5 * _T,
        fp8_flops=194.9 * _T,
        int8_flops=389.9 * _T,
        memory_bandwidth_bytes_per_s=716.8 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA GeForce RTX 4080 ... 320W ... 16376MiB' in public logs "
            "on GitHub (no single issue thread)",
            *_PCIE4_X16_LINK,
            f"{_ADA_RATE}: 76 SMs x 2.505 GHz = 97.5 TFLOP/s BF16, 194.9 FP8 (780 AI TOPS / 8, "
            f"/ 4); {_ADA_WP}, Appendix A (GeForce RTX 4080 16GB)",
            "compute: INT8 derived, 76 SMs x 2048 INT8 ops/clk/SM x 2.505 GHz = 389.9 TOPS (the "
            "GeForce Ada rate of the RTX 4090's 660.6 TOPS)",
            f"memory-bandwidth: 22.4 Gbps GDDR6X x 256-bit / 8 = 716.8 GB/s, {_ADA_WP}, "
            "Appendix A (GeForce RTX 4080 16GB)",
        ),
    ),
    HardwareProfile(
        name="rtx4090",
        label="NVIDIA GeForce RTX 4090",
        memory_bytes=_mib(24564),  # nvidia-smi Total 24564 MiB (24 GB GDDR6X)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=165.2 * _T,
        fp8_flops=330.3 * _T,
        int8_flops=660.6 * _T,
        memory_bandwidth_bytes_per_s=1008 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA GeForce RTX 4090 ... 24564MiB' (driver 550.163.01), "
            "https://github.com/RLinf/RLinf/issues/255",
            *_PCIE4_X16_LINK,
            f"compute: {_ADA_WP}, Appendix A, Table 2 (GeForce RTX 4090): Peak BF16 Tensor "
            "TFLOPS with FP32 Accumulate 165.2/330.4; Peak FP8 Tensor TFLOPS with FP32 "
            "Accumulate 330.3/660.6 (footnote 4: corrected in v2.02; FP16 accumulate is "
            "660.6/1321.2)",
            f"compute: {_ADA_WP}, Appendix A, Table 2 (GeForce RTX 4090): Peak INT8 Tensor TOPS "
            "660.6/1321.2 (dense/sparse)",
            f"memory-bandwidth: {_ADA_WP}, Appendix A, Table 2: Memory Bandwidth 1008 GB/sec",
        ),
    ),
    HardwareProfile(
        name="rtx5090",
        label="NVIDIA GeForce RTX 5090",
        memory_bytes=_mib(32607),  # nvidia-smi Total 32607 MiB (32 GB GDDR7)
        h2d_bytes_per_s=56 * _GB,
        d2h_bytes_per_s=57 * _GB,
        bf16_flops=209.5 * _T,
        fp8_flops=419 * _T,
        int8_flops=838 * _T,
        memory_bandwidth_bytes_per_s=1792 * _GB,
        pcie="5.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA GeForce RTX 5090 ... 32607MiB' (driver 595.71.05), "
            "https://github.com/noonghunna/club-3090/issues/617",
            "host-link: nvbandwidth on 8x GeForce RTX 5090 (PCIe 5.0 x16): "
            "host_to_device_memcpy_ce 56.3-56.4 GB/s, device_to_host_memcpy_ce 57.3 GB/s, "
            "https://github.com/tinygrad/open-gpu-kernel-modules/issues/29",
            f"compute: {_BLACKWELL_WP}: RTX 5090 Peak BF16 Tensor TFLOPS with FP32 Accumulate "
            "209.5/419, Peak FP8 Tensor TFLOPS with FP32 Accumulate 419/838 (dense/sparse)",
            "compute: INT8 838 TOPS dense: NVIDIA's 3352 AI TOPS for the RTX 5090 (FP4, 2:4 "
            "sparse, https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/) halved for "
            "INT8 and halved again for dense; the same /4 gives the RTX 4090's 660.6",
            f"memory-bandwidth: {_BLACKWELL_WP}: RTX 5090 Memory Bandwidth 1792 GB/s",
        ),
    ),
    HardwareProfile(
        name="a6000",
        label="NVIDIA RTX A6000",
        memory_bytes=_mib(49140),  # nvidia-smi Total 49140 MiB (48 GB GDDR6, ECC off)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=154.8 * _T,
        fp8_flops=None,  # Ampere: no FP8 tensor cores
        int8_flops=309.7 * _T,
        memory_bandwidth_bytes_per_s=768 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: rig report 'NVIDIA RTX A6000 | 49140 MiB | driver 580.173.02', "
            "https://github.com/noonghunna/club-3090/issues/1047",
            *_PCIE4_X16_LINK,
            f"compute: {_GA102_WP}, Table 3 (NVIDIA RTX A6000): Peak BF16 Tensor TFLOPS with "
            "FP32 Accumulate 154.8/309.6 (full rate on the workstation card)",
            f"compute: {_GA102_WP}, Table 3 (NVIDIA RTX A6000): Peak INT8 Tensor TOPS "
            "309.7/619.4 (dense/sparse)",
            f"memory-bandwidth: {_GA102_WP}, Table 3 (NVIDIA RTX A6000): 768 GB/sec; NVIDIA RTX "
            "A6000 datasheet, https://www.nvidia.com/en-us/design-visualization/rtx-a6000/",
        ),
    ),
    HardwareProfile(
        name="a100-80gb",
        label="NVIDIA A100 80GB SXM4",
        memory_bytes=_mib(81920),  # nvidia-smi Total 81920 MiB (80 GB HBM2e)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=312 * _T,
        fp8_flops=None,  # Ampere: no FP8 tensor cores
        int8_flops=624 * _T,
        memory_bandwidth_bytes_per_s=2039 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA A100-SXM4-80GB ... 81920MiB' in public logs (drivers "
            "5xx); the same board as 'NVIDIA A800-SXM4-80GB ... 81920MiB', "
            "https://github.com/dexmal/dexbotic/issues/41 (driver 450.x reported 81252MiB, "
            "https://github.com/keyu-tian/SparK/issues/8)",
            *_PCIE4_X16_LINK,
            f"compute: {_HOPPER_WP}: A100 Peak BF16 Tensor TFLOPS with FP32 Accumulate 312/624, "
            "Peak FP8 N/A; NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/"
            "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: "
            "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*",
            "compute: NVIDIA A100 datasheet (as above): INT8 Tensor Core 624 TOPS | 1248 TOPS*",
            "memory-bandwidth: NVIDIA A100 datasheet (as above): GPU memory bandwidth 2,039 GB/s "
            "for A100 80GB SXM (1,935 GB/s for the PCIe card)",
        ),
    ),
    HardwareProfile(
        name="l4",
        label="NVIDIA L4",
        memory_bytes=_mib(23034),  # nvidia-smi Total 23034 MiB (24 GB GDDR6, ECC on)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=121 * _T,
        fp8_flops=242.5 * _T,
        int8_flops=242.5 * _T,
        memory_bandwidth_bytes_per_s=300 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA L4 ... 72W | 0MiB / 23034MiB' (driver 570.133.20), "
            "https://github.com/speaches-ai/speaches/pull/438",
            *_PCIE4_X16_LINK,
            "compute: NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/"
            "data-center/l4/: BFLOAT16 Tensor Core 242 TFLOPS*, FP8 Tensor Core 485 TFLOPS* "
            "(* with sparsity), halved to dense 121 / 242.5; consistent with 58 SMs x 1024 BF16 "
            "FLOP/clk/SM x 2.04 GHz = 121.2",
            "compute: NVIDIA L4 datasheet (as above): INT8 Tensor Core 485 TOPS* (* with "
            "sparsity), halved to dense 242.5",
            "memory-bandwidth: NVIDIA L4 datasheet (as above): GPU memory bandwidth 300 GB/s; "
            "interconnect PCIe Gen4 x16",
        ),
    ),
    HardwareProfile(
        name="l40s",
        label="NVIDIA L40S",
        memory_bytes=_mib(46068),  # nvidia-smi Total 46068 MiB (48 GB GDDR6, ECC on)
        h2d_bytes_per_s=_PCIE4_X16_H2D,
        d2h_bytes_per_s=_PCIE4_X16_D2H,
        bf16_flops=362.05 * _T,
        fp8_flops=733 * _T,
        int8_flops=733 * _T,
        memory_bandwidth_bytes_per_s=864 * _GB,
        pcie="4.0 x16",
        sources=(
            "memory: nvidia-smi --query-gpu 'NVIDIA L40S, 595.71.05, 46068 MiB', "
            "https://github.com/akash-network/provider-configs/pull/99",
            *_PCIE4_X16_LINK,
            "compute: NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/: "
            "BFLOAT16 Tensor Core 362.05 | 733* TFLOPS, FP8 Tensor Core 733 | 1,466* TFLOPS "
            "(* with sparsity); the L40 lists 181.05 (FP32 accumulate at half rate), the L40S "
            "runs it at full rate",
            "compute: NVIDIA L40S datasheet (as above): INT8 Tensor Core 733 | 1,466* TOPS",
            "memory-bandwidth: NVIDIA L40S datasheet (as above): 864 GB/s; interconnect PCIe "
            "Gen4 x16",
        ),
    ),
    HardwareProfile(
        name="h100-pcie",
        label="NVIDIA H100 PCIe",
        memory_bytes=_mib(81559),  # nvidia-smi Total 81559 MiB (80 GB HBM2e)
        h2d_bytes_per_s=_HOPPER_H2D,
        d2h_bytes_per_s=_HOPPER_D2H,
        bf16_flops=756 * _T,
        fp8_flops=1513 * _T,
        int8_flops=1513 * _T,
        fp8_gemm_vs_bf16=H200_FP8_GEMM_VS_BF16,
        int8_gemm_vs_bf16=H200_INT8_GEMM_VS_BF16,
        memory_bandwidth_bytes_per_s=2.0e12,
        pcie="5.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA H100 PCIe ... 350W ... 81559MiB' in several public logs "
            "on GitHub (no single issue thread); the same Total as the 80 GB SXM5 module",
            *_HOPPER_LINK,
            "host-link: measurements above are of the SXM5 module; the PCIe card has the same "
            "PCIe 5.0 x16 host link",
            f"compute: {_HOPPER_WP}: H100 PCIe Peak BF16 Tensor TFLOPS with FP32 Accumulate "
            "756/1513, Peak FP8 Tensor TFLOPS with FP32 Accumulate 1513/3026",
            f"compute: {_HOPPER_WP}: H100 PCIe Peak INT8 Tensor TOPS 1513/3026",
            "compute: fp8_gemm_vs_bf16 / int8_gemm_vs_bf16 measured by benchmarks/w8a8.py on "
            "an H200 (FLUX shapes, 4096 tokens, 3072 -> 3072 and -> 12288): torch._scaled_mm "
            "fp8 with row-wise scales ran 1.46-1.65x as fast as a bf16 GEMM, torch._int_mm "
            "0.87-0.94x; the midpoints (measured on the H200, the same GH100 silicon as the H100)",
            f"memory-bandwidth: {_H100_DS}: GPU memory bandwidth 2TB/s (H100 PCIe)",
        ),
    ),
    HardwareProfile(
        name="h100-sxm",
        label="NVIDIA H100 80GB SXM5",
        memory_bytes=_mib(81559),  # nvidia-smi Total 81559 MiB (80 GB HBM3)
        h2d_bytes_per_s=_HOPPER_H2D,
        d2h_bytes_per_s=_HOPPER_D2H,
        bf16_flops=989.4 * _T,
        fp8_flops=1978.9 * _T,
        int8_flops=1978.9 * _T,
        fp8_gemm_vs_bf16=H200_FP8_GEMM_VS_BF16,
        int8_gemm_vs_bf16=H200_INT8_GEMM_VS_BF16,
        memory_bandwidth_bytes_per_s=3.35e12,
        pcie="5.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA H100 80GB HBM3 ... 700W ... 81559MiB' (driver 550.54.15), "
            "https://github.com/NVIDIA/nccl/issues/1264",
            *_HOPPER_LINK,
            f"compute: {_HOPPER_WP}: H100 SXM5 Peak BF16 Tensor TFLOPS with FP32 Accumulate "
            "989.4/1978.9, Peak FP8 Tensor TFLOPS with FP32 Accumulate 1978.9/3957.8",
            f"compute: {_HOPPER_WP}: H100 SXM5 Peak INT8 Tensor TOPS 1978.9/3957.8",
            "compute: fp8_gemm_vs_bf16 / int8_gemm_vs_bf16 measured by benchmarks/w8a8.py on "
            "an H200 (FLUX shapes, 4096 tokens, 3072 -> 3072 and -> 12288): torch._scaled_mm "
            "fp8 with row-wise scales ran 1.46-1.65x as fast as a bf16 GEMM, torch._int_mm "
            "0.87-0.94x; the midpoints (measured on the H200, the same GH100 silicon as the H100)",
            f"memory-bandwidth: {_H100_DS}: GPU memory bandwidth 3.35TB/s (H100 SXM)",
        ),
    ),
    HardwareProfile(
        name="h200",
        label="NVIDIA H200 SXM",
        memory_bytes=_mib(143771),  # nvidia-smi Total 143771 MiB (141 GB HBM3e)
        h2d_bytes_per_s=_HOPPER_H2D,
        d2h_bytes_per_s=_HOPPER_D2H,
        bf16_flops=989.4 * _T,
        fp8_flops=1978.9 * _T,
        int8_flops=1978.9 * _T,
        fp8_gemm_vs_bf16=H200_FP8_GEMM_VS_BF16,
        int8_gemm_vs_bf16=H200_INT8_GEMM_VS_BF16,
        memory_bandwidth_bytes_per_s=4.8e12,
        pcie="5.0 x16",
        sources=(
            "memory: nvidia-smi 'NVIDIA H200 ... 700W | 0MiB / 143771MiB' (driver 550.54.15), "
            "https://github.com/NVIDIA/cuda-samples/issues/311",
            *_HOPPER_LINK,
            "compute: NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/"
            "data-center/h200/: H200 SXM BFLOAT16 Tensor Core 1,979 TFLOPS*, FP8 Tensor Core "
            "3,958 TFLOPS* (* with sparsity); the same GH100 silicon and clocks as the H100 SXM5, "
            f"so the dense figures of {_HOPPER_WP} (989.4 / 1978.9) are used",
            "compute: NVIDIA H200 datasheet (as above): INT8 Tensor Core 3,958 TOPS* (* with "
            "sparsity): dense 1978.9, as the H100 SXM5",
            "compute: fp8_gemm_vs_bf16 / int8_gemm_vs_bf16 measured by benchmarks/w8a8.py on "
            "an H200 (FLUX shapes, 4096 tokens, 3072 -> 3072 and -> 12288): torch._scaled_mm "
            "fp8 with row-wise scales ran 1.46-1.65x as fast as a bf16 GEMM, torch._int_mm "
            "0.87-0.94x; the midpoints",
            "memory-bandwidth: NVIDIA H200 datasheet (as above): GPU memory 141GB, bandwidth "
            "4.8TB/s; interconnect PCIe Gen5 128GB/s (bidirectional)",
        ),
    ),
)

#: Every profile, by key.
PROFILES: dict[str, HardwareProfile] = {p.name: p for p in _PROFILE_LIST}


# --- name resolution -------------------------------------------------------------------------

def _normalize(text: str) -> str:
    """Lowercase, without the vendor and brand words, without spaces and punctuation."""
    text = re.sub(r"\b(nvidia|geforce)\b", " ", text.lower())
    return re.sub(r"[^a-z0-9]", "", text)


#: More spellings of a profile, beyond its key and label (with or without 'rtx'): the device
#: names drivers report and the usual short forms.
_EXTRA_ALIASES: dict[str, tuple[str, ...]] = {
    "rtx3060-12gb": ("RTX 3060 12 GB",),
    "rtx4060ti-16gb": ("RTX 4060 Ti 16 GB",),
    "rtx4070ti-super": ("RTX 4070 Ti S",),
    "a6000": ("RTX A6000 48GB",),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", "A100 SXM4", "A100 SXM", "A100 SXM4 80GB",
                  "A100-SXM-80GB", "A100 80GB"),
    "h100-sxm": ("NVIDIA H100 80GB HBM3", "H100 SXM5", "H100 SXM5 80GB", "H100 SXM 80GB"),
    "h100-pcie": ("H100 PCIe 80GB", "H100 80GB PCIe"),
    "h200": ("H200 SXM", "H200 141GB", "H200 SXM 141GB"),
    "l40s": ("L40S 48GB",),
    "l4": ("L4 24GB",),
}

#: Names that fit more than one card: normalized name -> (profiles to choose from, why).
_AMBIGUOUS: dict[str, tuple[tuple[str, ...], str]] = {
    "h100": (("h100-sxm", "h100-pcie"),
             "the H100 comes as an SXM5 module and a PCIe card with different clocks and memory"),
    "a100": (("a100-80gb",), "the A100 comes with 40 GB and 80 GB; the 80 GB SXM4 is profiled"),
    "rtx4060ti": (("rtx4060ti-16gb",),
                  "the RTX 4060 Ti comes with 8 GB and 16 GB; the 16 GB card is profiled"),
    "rtx3060": (("rtx3060-12gb",),
                "the RTX 3060 comes with 8 GB and 12 GB; the 12 GB card is profiled"),
    "rtx4070ti": (("rtx4070ti-super",),
                  "the RTX 4070 Ti (12 GB, AD104) is not profiled; its SUPER (16 GB) is"),
    "rtx4080super": (("rtx4080",), "the RTX 4080 SUPER is not profiled; the RTX 4080 is"),
}


def _variants(normalized: str) -> set[str]:
    found = {normalized}
    if normalized.startswith("rtx") and len(normalized) > 3:
        found.add(normalized[3:])
    return found


def _build_aliases() -> dict[str, str]:
    table: dict[str, str] = {}
    for key, profile in PROFILES.items():
        spellings = (key, profile.label, *_EXTRA_ALIASES.get(key, ()))
        for spelling in spellings:
            for alias in _variants(_normalize(spelling)):
                if table.setdefault(alias, key) != key:
                    raise ValueError(f"hardware alias {alias!r} names both {table[alias]!r} "
                                     f"and {key!r}")
    for name in _AMBIGUOUS:
        for alias in _variants(name):
            if alias in table:
                raise ValueError(f"ambiguous hardware name {alias!r} is also an alias of "
                                 f"{table[alias]!r}")
    return table


_ALIASES: dict[str, str] = _build_aliases()
_AMBIGUOUS_ALIASES: dict[str, str] = {alias: name for name in _AMBIGUOUS
                                      for alias in _variants(name)}


def hardware_profile(name: str) -> HardwareProfile:
    """The :class:`HardwareProfile` of a GPU, found by a forgiving name.

    Case, spaces, hyphens and underscores do not matter, nor do the words "NVIDIA" and "GeForce"
    or a leading "RTX": ``"rtx4090"``, ``"RTX 4090"``, ``"rtx-4090"``, ``"4090"`` and
    ``"NVIDIA GeForce RTX 4090"`` (the name ``torch.cuda.get_device_name`` gives) are the same
    card. Device names drivers report for the data-centre parts (``"NVIDIA A100-SXM4-80GB"``,
    ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA H100 PCIe"``) resolve too.

    Args:
        name: a key of :data:`PROFILES` or one of its spellings.

    Returns:
        The profile.

    Raises:
        ConfigError: for a name that is not a string, names no profile (the hint lists the known
            ones), or fits more than one card (``"H100"``, ``"RTX 4060 Ti"``: the hint names the
            profiles to choose from).
    """
    known = ", ".join(PROFILES)
    if not isinstance(name, str):
        raise ConfigError(f"a GPU name must be a string, got {name!r}",
                          hint=f"Name one of: {known}.")
    normalized = _normalize(name)
    key = _ALIASES.get(normalized)
    if key is not None:
        return PROFILES[key]
    ambiguous = _AMBIGUOUS_ALIASES.get(normalized)
    if ambiguous is not None:
        choices, why = _AMBIGUOUS[ambiguous]
        listed = " or ".join(repr(c) for c in choices)
        raise ConfigError(f"GPU name {name!r} is ambiguous: {why}",
                          hint=f"Name the card exactly: {listed}. Known GPUs: {known}.")
    raise ConfigError(f"unknown GPU {name!r}: vramkit has no hardware profile for it",
                      hint=f"Known GPUs: {known}. For another card, build a HardwareProfile "
                           "with its figures and sources.")
