"""The machine a plan is made for: copy bandwidth, achieved compute throughput, memory.

Either from a named :class:`~vramkit.planning.hardware.HardwareProfile` (offline planning from
the vendor's peaks), or measured on this machine's GPU (:func:`measure_machine`: a pinned
host->device copy and a bf16 matmul, timed with CUDA events; a plan on a measured machine also
times its blocks, :mod:`vramkit.planning.calibration`).

Offline, a block's time comes from what the meta pass counted
(:class:`~vramkit.planning.analysis.Work`), not from its FLOPs alone
(:meth:`Machine.work_seconds`): the device runs its matmuls at :data:`MATMUL_FRACTION` of the
bf16 peak, its fused attention at :data:`ATTENTION_FRACTION`, its other kernels at
:data:`MEMORY_FRACTION` of the memory bandwidth, plus :data:`DEVICE_SECONDS_PER_KERNEL` per
kernel; the host needs :data:`HOST_SECONDS_PER_KERNEL` to launch each one; the block takes the
longer of the two. One share of the peak for everything (:data:`ACHIEVED_FRACTION`, what plans
used before) fitted FLUX.1-dev's blocks and missed a Llama layer by 36 %: on an H100 a FLUX
block reaches 0.29 of the peak and a Llama layer 0.46, because FLUX spends more of its time in
memory-bound work and kernel launches (``benchmarks/block_times.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vramkit._validate import check_number
from vramkit.errors import ConfigError, DeviceError
from vramkit.planning.hardware import HardwareProfile, hardware_profile

if TYPE_CHECKING:  # annotations only: analysis is not imported with the machine
    from vramkit.planning.analysis import Work

__all__ = ["ACHIEVED_FRACTION", "COPY_SLOWDOWN", "Machine", "machine_for", "measure_machine"]

#: Share of the dense bf16 peak the blocks of a diffusion-transformer or LLM training step
#: achieve, as the planner counts their FLOPs: on an H100 80GB HBM3 (the h100-sxm profile,
#: 989 TFLOP/s), FLUX.1-dev LoRA at 1024x1024 with every block checkpointed, the blocks' timed
#: forward and backward (calibrate_blocks: 277 + 695 ms) against their FLOPs (578 ms at 0.43)
#: gave 0.26 (the calibration of ``benchmarks/plan.py``). Attention, norms and element-wise work
#: are in the blocks' time but not in a matmul's peak, hence the low share. A measured machine
#: needs no such factor. Offline, blocks whose work was counted are timed by the model below;
#: this share remains the throughput (``Machine.flops_per_s``) of work that was not (a
#: hand-built ModelCost) and of the fp8 GEMM.
ACHIEVED_FRACTION = 0.26
#: How much slower a block's compute runs, forward and backward, while host-to-device copies
#: run beside it: the copy engine's writes share the GPU's memory with the kernels. What the
#: calibration (``calibrate_blocks``' ``"beside-copies"`` timing) read on an H200 for FLUX.1-dev's
#: blocks in every plan of ``benchmarks/plan.py`` (its plans' notes): +3.4-4.0 % forward,
#: +2.5-3.0 % backward; the midpoints. An offline plan prices it for every
#: card (a measured machine times its own): not measured off Hopper, said in the plan's notes.
COPY_SLOWDOWN = (0.037, 0.0275)
# The offline time model (module docstring), fitted on an H100 80GB HBM3 (989 TFLOP/s bf16,
# 3.35 TB/s) to the device and host times of one block of each kind of FLUX.1-dev, Llama-3.1-8B,
# SD3.5-large, Qwen-Image, Wan2.1-14B and SDXL (calibrate_blocks' timing, with the kernels and
# bytes analyze() counts for them). Against the stored run (`benchmarks/block_times.py
# --measured benchmarks/data/block_times_h100.json`): the
# device part of the transformer blocks and SDXL's attention stacks -18 % .. +10 %, the whole
# (device or host) mean |error| 17.5 % over 42 block phases, against 60.5 % for one share of
# the peak.
#: Share of the dense bf16 peak a block's matmuls reach (fixed: large GEMMs on Hopper).
MATMUL_FRACTION = 0.70
#: Share of the dense bf16 peak fused attention reaches (flash attention, forward and backward).
ATTENTION_FRACTION = 0.36
#: Share of the memory bandwidth the other kernels reach (bytes read + written, as counted).
MEMORY_FRACTION = 0.81
#: Device time per kernel beyond its work (launch, tails, small grids), seconds.
DEVICE_SECONDS_PER_KERNEL = 2.5e-6
#: Host time to launch one kernel through PyTorch (dispatcher, autocast, module hooks): the
#: median of the blocks above on the H100 machine's 16-core Xeon host (a faster desktop CPU
#: needs less), seconds.
HOST_SECONDS_PER_KERNEL = 26e-6
#: Host time a convolution adds beyond a kernel's launch (cuDNN's descriptors and plan lookup),
#: forward and backward, seconds: SDXL's resnet blocks (19-20 kernels, 2-3 convolutions) took
#: 1.1-1.8 ms of host per forward and 0.7-1.7 ms per backward on the same host
#: (benchmarks/block_times.py), 3x what their kernel count gives.
HOST_SECONDS_PER_CONVOLUTION = (370e-6, 150e-6)
#: A block's backward against its forward, as counted on meta for the same blocks: kernels
#: 1.40-1.45x, bytes of the memory-bound kernels 1.54-1.81x.
BACKWARD_KERNELS = 1.43
BACKWARD_BYTES = 1.65
#: Host time the swapper adds per block acquisition (enqueue of a copy and events), seconds:
#: 0.04-0.06 ms per block on the H200 host (the enqueue column of ``benchmarks/swap.py``).
SWAP_HOST_SECONDS = 50e-6
#: Share of each direction's pinned bandwidth kept while host->device and device->host copies
#: run at once (a full fine-tune's backward uploads weights and optimizer state while it
#: writes the stepped ones back): host->device kept 0.84-0.90 of its rate alone (median 0.88)
#: in six probes of ``benchmarks/swap_full_ft.py`` on an H200's PCIe 5 link, device->host
#: 51.1-51.9 GB/s meanwhile. For a hardware profile; a measured machine times its own.
DUPLEX_SHARE = 0.88


@dataclass(frozen=True)
class Machine:
    """What a plan assumes of the machine.

    Attributes:
        name: a hardware profile's name, or ``"measured: <GPU name>"``.
        memory_bytes: device memory (``None`` when unknown).
        h2d_bytes_per_s / d2h_bytes_per_s: pinned copy bandwidth each way.
        flops_per_s: achieved bf16 throughput of the model's matmuls.
        fp8_flops_per_s: the same for fp8 GEMMs (``None``: no fp8 tensor cores).
        memory_bandwidth_bytes_per_s: device memory bandwidth (dequantization, optimizer).
        measured: whether the figures were measured on this machine.
        peak_flops_per_s: the dense bf16 peak of a hardware profile: set, blocks with counted
            :class:`~vramkit.planning.analysis.Work` are timed by :meth:`work_seconds`; ``None``
            (a measured machine, whose blocks are timed on it): FLOPs over ``flops_per_s``.
        copy_slowdown: the shares by which a block's forward and backward compute slow while
            host-to-device copies run beside it, for blocks the calibration did not time
            (a hardware profile: :data:`COPY_SLOWDOWN`; a measured machine: none, its
            calibration times each kind of block beside copies).
        duplex_share: the share of each direction's copy bandwidth kept while copies run
            both ways at once (:data:`DUPLEX_SHARE` for a hardware profile; measured on a
            measured machine).
        fp8_gemm_flops_per_s / int8_gemm_flops_per_s: the peak an 8-bit GEMM of W8A8 compute
            is timed against, as ``peak_flops_per_s`` is for bf16 (:mod:`vramkit.planning.w8a8`):
            the bf16 peak times the profile's measured ratio where it has one, else the
            datasheet's 8-bit peak; ``None``: no such GEMM (or a measured machine, whose
            calibration times W8A8 blocks).
    """

    name: str
    memory_bytes: int | None
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    flops_per_s: float
    fp8_flops_per_s: float | None
    memory_bandwidth_bytes_per_s: float
    measured: bool = False
    peak_flops_per_s: float | None = None
    copy_slowdown: tuple[float, float] = (0.0, 0.0)
    fp8_gemm_flops_per_s: float | None = None
    int8_gemm_flops_per_s: float | None = None
    duplex_share: float = DUPLEX_SHARE

    def __post_init__(self) -> None:
        check_number("Machine.duplex_share", self.duplex_share, minimum=0, maximum=1,
                     low_open=True)
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "flops_per_s",
                     "memory_bandwidth_bytes_per_s"):
            check_number(f"Machine.{name}", getattr(self, name), minimum=0, low_open=True)
        for name in ("peak_flops_per_s", "fp8_gemm_flops_per_s", "int8_gemm_flops_per_s"):
            check_number(f"Machine.{name}", getattr(self, name), minimum=0, low_open=True,
                         allow_none=True)
        shares = self.copy_slowdown
        if not isinstance(shares, tuple) or len(shares) != 2:
            raise ConfigError(f"Machine.copy_slowdown must be a (forward, backward) pair of "
                              f"shares, got {shares!r}",
                              hint="Give two numbers in [0, 1), e.g. (0.037, 0.0275).")
        object.__setattr__(self, "copy_slowdown", tuple(
            check_number(f"Machine.copy_slowdown[{i}]", share, minimum=0, maximum=1,
                         high_open=True) for i, share in enumerate(shares)))

    def device_seconds(self, matmul_flops: float, attention_flops: float,
                       elementwise_bytes: float, kernels: float) -> float:
        """The device's part of the offline time model (module docstring): each kind of work
        at its share of the peak, plus a cost per kernel.

        Raises:
            ConfigError: on a machine without ``peak_flops_per_s`` (a measured one).
        """
        peak = self.peak_flops_per_s
        if peak is None:
            raise ConfigError(f"{self.name} has no peak throughput to time work with",
                              hint="Time its blocks instead (calibrate_blocks), or plan with "
                                   "a hardware profile.")
        return (matmul_flops / (peak * MATMUL_FRACTION)
                + attention_flops / (peak * ATTENTION_FRACTION)
                + elementwise_bytes / (self.memory_bandwidth_bytes_per_s * MEMORY_FRACTION)
                + kernels * DEVICE_SECONDS_PER_KERNEL)

    def work_seconds(self, matmul_flops: float, attention_flops: float,
                     elementwise_bytes: float, kernels: float,
                     host_extra_seconds: float = 0.0) -> float:
        """Seconds of a block's forward or backward by the offline time model when the call runs
        alone: the longer of its two sides (:meth:`work_sides`).

        Raises:
            ConfigError: on a machine without ``peak_flops_per_s`` (a measured one).
        """
        return max(self.work_sides(matmul_flops, attention_flops, elementwise_bytes, kernels,
                                   host_extra_seconds))

    def work_sides(self, matmul_flops: float, attention_flops: float,
                   elementwise_bytes: float, kernels: float,
                   host_extra_seconds: float = 0.0) -> tuple[float, float]:
        """The device's seconds (:meth:`device_seconds`) and the host's (its launches, plus
        ``host_extra_seconds``: what some calls cost the host beyond a launch, e.g.
        :data:`HOST_SECONDS_PER_CONVOLUTION`) of a block's forward or backward.

        Raises:
            ConfigError: on a machine without ``peak_flops_per_s`` (a measured one).
        """
        device = self.device_seconds(matmul_flops, attention_flops, elementwise_bytes, kernels)
        return device, kernels * HOST_SECONDS_PER_KERNEL + host_extra_seconds

    def block_seconds(self, forward_flops: float, backward_flops: float,
                      work: Work | None) -> tuple[float, float]:
        """Forward and backward seconds of a block (or of the work outside the blocks) when
        the call runs alone: the longer side of each of :meth:`block_sides`."""
        (fwd, host_fwd), (bwd, host_bwd) = self.block_sides(forward_flops, backward_flops, work)
        return max(fwd, host_fwd), max(bwd, host_bwd)

    def block_sides(self, forward_flops: float, backward_flops: float, work: Work | None
                    ) -> tuple[tuple[float, float], tuple[float, float]]:
        """(device, host) seconds of a block's forward and of its backward: by
        :meth:`work_sides` where this machine is a hardware profile and the work was counted
        (:class:`~vramkit.planning.analysis.Work`; the backward has :data:`BACKWARD_KERNELS`
        and :data:`BACKWARD_BYTES` times the forward's kernels and bytes, its FLOPs from the
        analysis), else the FLOPs at ``flops_per_s`` on the device and nothing on the host.
        ``backward_flops`` 0: no backward."""
        if self.peak_flops_per_s is None or work is None:
            return ((forward_flops / self.flops_per_s, 0.0),
                    (backward_flops / self.flops_per_s, 0.0))
        forward, *backward = (self.work_sides(*phase)
                              for phase in phase_work(work, backward_flops))
        return forward, backward[0] if backward else (0.0, 0.0)

    @classmethod
    def from_profile(cls, profile: HardwareProfile,
                     achieved_fraction: float = ACHIEVED_FRACTION) -> Machine:
        """The machine a hardware profile describes, at ``achieved_fraction`` of its peaks."""
        check_number("achieved_fraction", achieved_fraction, minimum=0, maximum=1,
                     low_open=True)
        fp8 = profile.fp8_flops * achieved_fraction if profile.fp8_flops else None

        def gemm8(peak: float | None, measured: float | None) -> float | None:
            """An 8-bit GEMM's peak: bf16's times the measured ratio where there is one (the
            datasheets promise what the H200's int8 GEMM did not reach)."""
            if peak is None:
                return None
            return profile.bf16_flops * measured if measured is not None else peak

        return cls(name=profile.name, memory_bytes=profile.memory_bytes,
                   h2d_bytes_per_s=profile.h2d_bytes_per_s,
                   d2h_bytes_per_s=profile.d2h_bytes_per_s,
                   flops_per_s=profile.bf16_flops * achieved_fraction, fp8_flops_per_s=fp8,
                   memory_bandwidth_bytes_per_s=profile.memory_bandwidth_bytes_per_s,
                   peak_flops_per_s=profile.bf16_flops, copy_slowdown=COPY_SLOWDOWN,
                   fp8_gemm_flops_per_s=gemm8(profile.fp8_flops, profile.fp8_gemm_vs_bf16),
                   int8_gemm_flops_per_s=gemm8(profile.int8_flops, profile.int8_gemm_vs_bf16))


def phase_work(work: Work, backward_flops: float
               ) -> list[tuple[float, float, float, float, float]]:
    """:meth:`Machine.work_seconds`' arguments for a forward with ``work`` and, unless
    ``backward_flops`` is 0 (no backward), its backward: the backward has
    :data:`BACKWARD_KERNELS` and :data:`BACKWARD_BYTES` times the forward's kernels and bytes,
    attention's backward FLOPs (``ATTENTION_BACKWARD_FACTOR`` times its forward's) and the
    rest of ``backward_flops`` as matmuls; convolutions cost the host
    :data:`HOST_SECONDS_PER_CONVOLUTION`."""
    from vramkit.planning.analysis import ATTENTION_BACKWARD_FACTOR

    conv_fwd, conv_bwd = HOST_SECONDS_PER_CONVOLUTION
    phases = [(work.matmul_flops, work.attention_flops, work.elementwise_bytes,
               float(work.kernels), work.convolutions * conv_fwd)]
    if backward_flops > 0:
        attention = ATTENTION_BACKWARD_FACTOR * work.attention_flops
        phases.append((max(0.0, backward_flops - attention), attention,
                       BACKWARD_BYTES * work.elementwise_bytes, BACKWARD_KERNELS * work.kernels,
                       work.convolutions * conv_bwd))
    return phases


def machine_for(hardware: str | HardwareProfile | Machine | None,
                device: torch.device | None = None) -> Machine:
    """The machine to plan for: a name or profile (offline), a :class:`Machine`, or ``None``
    (measure this machine's GPU).

    Raises:
        ConfigError: for an unknown hardware name.
        DeviceError: for ``None`` on a machine without a CUDA GPU.
    """
    if isinstance(hardware, Machine):
        return hardware
    if isinstance(hardware, HardwareProfile):
        return Machine.from_profile(hardware)
    if hardware is not None:
        return Machine.from_profile(hardware_profile(hardware))
    return measure_machine(device)


def measure_machine(device: torch.device | None = None) -> Machine:
    """Measure this machine's GPU: pinned host<->device bandwidth (256 MiB copies) and the
    throughput of a bf16 matmul of transformer size (8192 x 3072 x 3072), with CUDA events.

    Raises:
        DeviceError: without a CUDA GPU (plan offline with ``hardware="<name>"`` instead).
    """
    if not torch.cuda.is_available():
        raise DeviceError("planning without hardware= measures this machine's GPU, and "
                          "PyTorch sees none",
                          hint="Plan offline for a named GPU: hardware='rtx4090' (see "
                               "vramkit.planning.PROFILES for the names).")
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    nbytes = 256 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(fn: object, repeat: int) -> float:
        fn()  # type: ignore[operator]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / repeat

    # The link's speed is what it can do: the best of three rounds, once the device is idle
    # (one probe of a single round read 32 GB/s on an H200 whose fitted FLUX forward then
    # copied at ~55 GB/s: the plan took the slow figure; what slowed that round is not known).
    torch.cuda.synchronize(device)
    h2d = max(nbytes / timed(lambda: dev.copy_(host, non_blocking=True), 5) for _ in range(3))
    d2h = max(nbytes / timed(lambda: host.copy_(dev, non_blocking=True), 5) for _ in range(3))
    duplex = _duplex_share(device, host, dev, h2d, d2h)
    a = torch.randn(8192, 3072, device=device, dtype=torch.bfloat16)
    b = torch.randn(3072, 3072, device=device, dtype=torch.bfloat16)
    flops = 2 * 8192 * 3072 * 3072 / timed(lambda: a @ b, 20)
    # A training step reaches about 0.6 of an isolated large matmul (launch gaps, norms,
    # attention, element-wise kernels): ACHIEVED_FRACTION / the matmul's own share of peak.
    step_flops = flops * 0.6
    big = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    bandwidth = 2 * big.numel() / timed(lambda: dev[:nbytes // 2].copy_(big), 10)
    name = torch.cuda.get_device_name(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if not all(math.isfinite(x) and x > 0 for x in (h2d, d2h, flops, bandwidth)):
        raise DeviceError(f"measuring {name} gave no usable figures",
                          hint="Plan offline with hardware='<name>' instead.")
    return Machine(name=f"measured: {name}", memory_bytes=int(total), h2d_bytes_per_s=h2d,
                   d2h_bytes_per_s=d2h, flops_per_s=step_flops, fp8_flops_per_s=None,
                   memory_bandwidth_bytes_per_s=bandwidth, measured=True,
                   duplex_share=duplex)


def _duplex_share(device: torch.device, host: torch.Tensor, dev: torch.Tensor, h2d: float,
                  d2h: float, repeat: int = 5) -> float:
    """Each direction's bandwidth while both copy at once (two streams, ``repeat`` copies of
    ``host``'s size each way), as a share of its own alone: the smaller of the two, the best
    of three rounds, at most 1."""
    host_b = torch.empty_like(host, pin_memory=True)
    dev_b = torch.empty_like(dev)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        marks = []
        for stream, dst, src in ((up, dev, host), (down, host_b, dev_b)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for _ in range(repeat):
                    dst.copy_(src, non_blocking=True)
                end.record(stream)
            marks.append((start, end))
        torch.cuda.synchronize(device)
        rates = [repeat * host.numel() / (s.elapsed_time(e) / 1000) for s, e in marks]
        best = max(best, min(rates[0] / h2d, rates[1] / d2h))
    return min(1.0, best) if math.isfinite(best) and best > 0 else DUPLEX_SHARE
