"""Launch configuration for CUDA kernels: grid, block, dynamic shared memory, device limits.

:class:`LaunchConfig` is checked twice: against CUDA's architectural limits when it is built
(any GPU since compute capability 3.0: 1024 threads per block, block at most 1024 x 1024 x 64,
grid at most (2^31 - 1) x 65535 x 65535) and against the actual device (shared memory per
block, including the opt-in maximum, and the kernel's own register-limited thread count) when it
is launched or :meth:`LaunchConfig.validate` is called.

:meth:`LaunchConfig.for_elements` sizes a one-thread-per-element launch, using the CUDA occupancy
API of a compiled kernel when one is given; :func:`calculate_optimal_launch_params` sizes a tiled
matrix-multiply launch from the tile's shared-memory use and the device's SM count.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from vramkit._validate import check_device, check_int
from vramkit.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DeviceLimits",
    "LaunchConfig",
    "OccupancyQuery",
    "calculate_optimal_launch_params",
    "device_limits",
    "occupancy_fraction",
]

# Architectural limits shared by every CUDA GPU since compute capability 3.0.
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIMS: tuple[int, int, int] = (1024, 1024, 64)
MAX_GRID_DIMS: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
# The largest opt-in dynamic shared memory of any released GPU (sm_80: 163 KiB, sm_90/sm_100:
# 227 KiB). The device check is the authoritative one; this only rejects impossible values early.
MAX_SHARED_MEMORY_ANY_GPU = 227 * 1024
# Without opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize) a block gets at most 48 KiB.
DEFAULT_SHARED_MEMORY_PER_BLOCK = 48 * 1024

# Resident blocks per SM by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"); torch does not report it.
_MAX_BLOCKS_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 32, (7, 2): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24,
    (9, 0): 32, (10, 0): 32, (10, 3): 32, (12, 0): 24, (12, 1): 24,
}

DeviceArg: TypeAlias = "torch.device | str | int | DeviceLimits | None"


@runtime_checkable
class OccupancyQuery(Protocol):
    """What the launch helpers ask of a compiled kernel (:class:`~vramkit.kernels.manager.
    CompiledKernel` implements it): the CUDA occupancy API, ``None`` where unsupported."""

    @property
    def max_threads_per_block(self) -> int: ...

    def max_potential_block_size(self, shared_mem: int = 0) -> int | None: ...

    def max_active_blocks_per_multiprocessor(self, block_size: int,
                                             shared_mem: int = 0) -> int | None: ...


@dataclass(frozen=True)
class DeviceLimits:
    """Launch-relevant limits of one CUDA device.

    Args:
        name: the device name.
        compute_capability: ``(major, minor)``.
        multiprocessor_count: number of SMs.
        max_threads_per_multiprocessor: resident threads per SM.
        max_blocks_per_multiprocessor: resident blocks per SM.
        max_shared_memory_per_block: dynamic + static shared memory without opt-in (48 KiB).
        max_shared_memory_per_block_optin: the most a block may use after opting in.
        max_shared_memory_per_multiprocessor: shared memory of one SM.
        registers_per_multiprocessor: 32-bit registers of one SM.
        warp_size: threads per warp (32).
        max_threads_per_block: 1024 on every current GPU.
        max_block_dims: largest block, per dimension.
        max_grid_dims: largest grid, per dimension.
    """

    name: str
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    max_threads_per_multiprocessor: int
    max_blocks_per_multiprocessor: int
    max_shared_memory_per_block: int = DEFAULT_SHARED_MEMORY_PER_BLOCK
    max_shared_memory_per_block_optin: int = DEFAULT_SHARED_MEMORY_PER_BLOCK
    max_shared_memory_per_multiprocessor: int = 64 * 1024
    registers_per_multiprocessor: int = 65536
    warp_size: int = 32
    max_threads_per_block: int = MAX_THREADS_PER_BLOCK
    max_block_dims: tuple[int, int, int] = MAX_BLOCK_DIMS
    max_grid_dims: tuple[int, int, int] = MAX_GRID_DIMS

    @property
    def arch(self) -> str:
        """The NVRTC architecture name, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"


_LIMITS_CACHE: dict[int, DeviceLimits] = {}


def _cuda_index(device: torch.device | str | int | None) -> int:
    """The CUDA ordinal ``device`` names (``None`` and ``"cuda"``: torch's current device).

    Checks the form only (:func:`vramkit._validate.check_device`); whether the device is there
    is asked by whoever needs it (:func:`device_limits`, ``KernelManager.get``).
    """
    from vramkit.devices._runtime import current_cuda_ordinal

    if device is None:
        return current_cuda_ordinal()
    torch_device = check_device("kernel device", device, types=("cuda",))
    return current_cuda_ordinal() if torch_device.index is None else int(torch_device.index)


def device_limits(device: DeviceArg = None) -> DeviceLimits:
    """The launch limits of a CUDA device, read once per device from PyTorch.

    Args:
        device: a CUDA device (``torch.device``, ``"cuda:1"``, an ordinal) or a
            :class:`DeviceLimits` (returned as is). Default ``None``: torch's current device.

    Returns:
        The device's :class:`DeviceLimits` (``torch.cuda.get_device_properties``; the resident
        blocks per SM come from the compute-capability table, torch does not report them).

    Raises:
        InvalidDeviceError: (a ``ConfigError`` and a ``DeviceError``) ``device`` is not a CUDA
            device.
        DeviceError: CUDA is not available or the device does not exist.
    """
    if isinstance(device, DeviceLimits):
        return device
    index = _cuda_index(device)
    cached = _LIMITS_CACHE.get(index)
    if cached is not None:
        return cached
    import torch

    from vramkit.devices.resolve import cuda_ordinal

    try:
        cuda_ordinal(torch.device("cuda", index), owner="device_limits")
    except DeviceError as err:  # the resolver's message, with a hint for launch limits
        raise DeviceError(err.message, "Run on a machine with an NVIDIA GPU (`vramkit info` lists "
                                       "the visible ones), or pass DeviceLimits explicitly."
                          ) from None
    props = torch.cuda.get_device_properties(index)
    cc = (int(props.major), int(props.minor))
    per_block = int(getattr(props, "shared_memory_per_block", 0) or
                    DEFAULT_SHARED_MEMORY_PER_BLOCK)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or per_block)
    limits = DeviceLimits(
        name=str(props.name),
        compute_capability=cc,
        multiprocessor_count=int(props.multi_processor_count),
        max_threads_per_multiprocessor=int(getattr(props, "max_threads_per_multi_processor",
                                                   2048)),
        max_blocks_per_multiprocessor=_MAX_BLOCKS_PER_SM.get(cc, 16),
        max_shared_memory_per_block=per_block,
        max_shared_memory_per_block_optin=optin,
        max_shared_memory_per_multiprocessor=int(
            getattr(props, "shared_memory_per_multiprocessor", 0) or optin),
        registers_per_multiprocessor=int(getattr(props, "regs_per_multiprocessor", 65536)),
        warp_size=int(getattr(props, "warp_size", 32)),
    )
    _LIMITS_CACHE[index] = limits
    return limits


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        items: tuple[Any, ...] = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = tuple(value)
    else:
        raise ConfigError(f"LaunchConfig.{what} must be an int or a tuple of 1-3 ints, "
                          f"got {value!r}",
                          hint="Give it as an int or a tuple of 1-3 positive ints, e.g. block=256 "
                               "or block=(16, 16).")
    if not 1 <= len(items) <= 3:
        raise ConfigError(f"LaunchConfig.{what} has {len(items)} dimensions; CUDA allows 1-3",
                          hint="Give at most 3 dimensions (x, y, z), e.g. grid=(64, 64) or "
                               "grid=(8, 8, 4).")
    for item in items:
        check_int(f"a LaunchConfig.{what} dimension", item, minimum=1)
    padded = (*items, 1, 1)[:3]
    return (int(padded[0]), int(padded[1]), int(padded[2]))


@dataclass(frozen=True)
class LaunchConfig:
    """Grid, block and dynamic shared memory of one kernel launch (FLAME/cuda-core
    ``LaunchConfig``).

    ``grid`` and ``block`` accept an int or a tuple of up to 3 ints and are stored as 3-tuples,
    so ``LaunchConfig(4, 256).grid == (4, 1, 1)``.

    Args:
        grid: blocks per grid dimension.
        block: threads per block dimension.
        shared_mem: dynamic shared memory per block in bytes (default 0). Above 48 KiB the
            launcher opts the kernel in to the device's larger limit.

    Raises:
        ConfigError: a dimension is not an int >= 1, or a value exceeds CUDA's architectural
            limits (1024 threads per block, block <= 1024 x 1024 x 64, grid <=
            (2^31 - 1) x 65535 x 65535, shared memory <= 227 KiB).
    """

    grid: int | tuple[int, ...]
    block: int | tuple[int, ...]
    shared_mem: int = 0

    def __post_init__(self) -> None:
        grid = _dims(self.grid, "grid")
        block = _dims(self.block, "block")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "block", block)
        check_int("LaunchConfig.shared_mem", self.shared_mem, minimum=0,
                  maximum=MAX_SHARED_MEMORY_ANY_GPU,
                  hint=f"Give bytes per block; no CUDA GPU has more than "
                       f"{MAX_SHARED_MEMORY_ANY_GPU} bytes of shared memory per block: use fewer "
                       "or smaller tiles per block.")
        self._check_dims(block, grid, MAX_THREADS_PER_BLOCK, MAX_BLOCK_DIMS, MAX_GRID_DIMS)

    @property
    def threads_per_block(self) -> int:
        """Threads in one block (the product of the block dimensions)."""
        x, y, z = self.block  # type: ignore[misc]
        return x * y * z

    @property
    def num_blocks(self) -> int:
        """Blocks in the grid (the product of the grid dimensions)."""
        x, y, z = self.grid  # type: ignore[misc]
        return x * y * z

    def _check_dims(self, block: tuple[int, int, int], grid: tuple[int, int, int],
                    max_threads: int, max_block: tuple[int, int, int],
                    max_grid: tuple[int, int, int], where: str = "CUDA") -> None:
        threads = block[0] * block[1] * block[2]
        if threads > max_threads:
            raise ConfigError(
                f"block {block} has {threads} threads; {where} allows at most {max_threads} "
                "per block", "Use a smaller block and more blocks in the grid.")
        for axis, (value, limit) in enumerate(zip(block, max_block, strict=True)):
            if value > limit:
                raise ConfigError(f"block dimension {'xyz'[axis]}={value} exceeds {where}'s "
                                  f"limit {limit}",
                                  hint="Move threads from this axis to another (block x and y "
                                       "allow 1024 on current GPUs, z allows 64), e.g. "
                                       "block=(256, 4, 1).")
        for axis, (value, limit) in enumerate(zip(grid, max_grid, strict=True)):
            if value > limit:
                raise ConfigError(
                    f"grid dimension {'xyz'[axis]}={value} exceeds {where}'s limit {limit}",
                    "Use a grid-stride loop in the kernel and launch fewer blocks.")

    def validate(self, device: DeviceArg = None,
                 kernel: OccupancyQuery | None = None) -> LaunchConfig:
        """Check this configuration against a device's (and optionally a kernel's) limits.

        Args:
            device: a CUDA device or its :class:`DeviceLimits` (default: torch's current
                device).
            kernel: a compiled kernel; its register-limited ``max_threads_per_block`` is checked
                too (default ``None``: only the device's limits).

        Returns:
            ``self``, so calls chain.

        Raises:
            ConfigError: the block, grid or shared memory exceeds what the device or kernel
                allows.
        """
        limits = device_limits(device)
        max_threads = limits.max_threads_per_block
        where = limits.name
        if kernel is not None and kernel.max_threads_per_block < max_threads:
            max_threads = kernel.max_threads_per_block
            where = f"this kernel (register use) on {limits.name}"
        self._check_dims(self.block, self.grid, max_threads,  # type: ignore[arg-type]
                         limits.max_block_dims, limits.max_grid_dims, where)
        if self.shared_mem > limits.max_shared_memory_per_block_optin:
            raise ConfigError(
                f"shared_mem={self.shared_mem} bytes exceeds {limits.name}'s "
                f"{limits.max_shared_memory_per_block_optin} bytes per block",
                "Use smaller tiles, or fewer tiles per block.")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a JSON-serializable dict."""
        return asdict(self)

    @classmethod
    def for_elements(cls, n: int, device: DeviceArg = None,
                     kernel: OccupancyQuery | None = None, *,
                     shared_mem: int = 0) -> LaunchConfig:
        """A 1-D launch with one thread per element, ``grid = ceil(n / block)``.

        Args:
            n: number of elements (>= 1).
            device: a CUDA device or its :class:`DeviceLimits` (default: torch's current
                device).
            kernel: a compiled kernel; when given, the block size is the one the CUDA
                occupancy API (``cuOccupancyMaxPotentialBlockSize``) suggests for its register
                and shared-memory use. Default ``None``: the compute-capability default, 256
                threads (8 warps) on sm_60 and newer and 128 before, which keeps enough warps
                per SM to hide memory latency for simple element-wise kernels.
            shared_mem: dynamic shared memory per block in bytes (default 0).

        Returns:
            The :class:`LaunchConfig`, validated against the device.

        Raises:
            ConfigError: ``n < 1`` or ``n`` needs more blocks than the grid allows (use a
                grid-stride loop and an explicit grid then).
        """
        check_int("for_elements n", n, minimum=1)
        limits = device_limits(device)
        block = 256 if limits.compute_capability >= (6, 0) else 128
        if kernel is not None:
            suggested = kernel.max_potential_block_size(shared_mem)
            if suggested:
                block = _smallest_block_at_full_occupancy(
                    limits, kernel, min(int(suggested), kernel.max_threads_per_block),
                    shared_mem, floor=block)
            else:
                logger.debug("occupancy API unavailable; using the default block of %d", block)
            block = min(block, kernel.max_threads_per_block)
        # A tiny problem does not need a full block; keep whole warps.
        warp = limits.warp_size
        block = max(warp, min(block, -(-n // warp) * warp))
        grid = -(-n // block)
        if grid > limits.max_grid_dims[0]:
            raise ConfigError(
                f"{n} elements need {grid} blocks of {block}, more than the grid allows",
                "Write the kernel with a grid-stride loop and pass an explicit LaunchConfig.")
        return cls(grid=grid, block=block, shared_mem=shared_mem).validate(limits, kernel)


def _smallest_block_at_full_occupancy(limits: DeviceLimits, kernel: OccupancyQuery,
                                      suggested: int, shared_mem: int, floor: int) -> int:
    """The smallest block (>= ``floor`` threads, whole warps) that reaches the occupancy of
    ``suggested``. The occupancy API suggests the *largest* block with the best occupancy;
    at equal occupancy smaller blocks schedule at a finer grain (measured on an H200 for a
    memory-bound element-wise kernel: 256 threads 1.15-1.2x faster than the suggested 1024,
    ``benchmarks/kernels.py``)."""
    def resident_threads(block: int) -> int:
        return _resident_blocks(limits, block, shared_mem, kernel) * block

    best = resident_threads(suggested)
    block = max(floor, limits.warp_size)
    while block < suggested:
        if resident_threads(block) >= best:
            return block
        block *= 2
    return suggested


def _resident_blocks(limits: DeviceLimits, threads: int, shared_mem: int,
                     kernel: OccupancyQuery | None) -> int:
    """Blocks of this shape that fit on one SM at once."""
    if kernel is not None:
        measured = kernel.max_active_blocks_per_multiprocessor(threads, shared_mem)
        if measured is not None:
            return int(measured)
    by_threads = limits.max_threads_per_multiprocessor // threads
    # Each resident block also reserves ~1 KiB of shared memory for the system (sm_80+).
    by_shared = (limits.max_shared_memory_per_multiprocessor // (shared_mem + 1024)
                 if shared_mem else limits.max_blocks_per_multiprocessor)
    return max(0, min(by_threads, by_shared, limits.max_blocks_per_multiprocessor))


def calculate_optimal_launch_params(
    m: int, n: int, k: int, device: DeviceArg = None, *,
    tile_m: int | None = None, tile_n: int | None = None, tile_k: int | None = None,
    element_size: int = 4, kernel: OccupancyQuery | None = None, min_blocks_per_sm: int = 4,
) -> LaunchConfig:
    """Launch configuration for a tiled ``C[m, n] = A[m, k] @ B[k, n]`` kernel.

    The kernel contract: a block of ``(tile_n, tile_m)`` threads computes one ``tile_m x tile_n``
    tile of C (``threadIdx.x`` along columns), staging a ``tile_m x tile_k`` tile of A and a
    ``tile_k x tile_n`` tile of B in *dynamic* shared memory per step along k. So
    ``block = (tile_n, tile_m)``, ``grid = (ceil(n / tile_n), ceil(m / tile_m))`` and
    ``shared_mem = (tile_m + tile_n) * tile_k * element_size``.

    When no tile is given the square tiles 32, 16 and 8 are ranked by:

    1. SM coverage: at least one block per SM in the grid, or as many SMs as the problem allows;
    2. the tile's shared-memory use leaves room for ``min_blocks_per_sm`` resident blocks per
       SM (4 by default: a tile whose staging buffers would allow fewer is demoted);
    3. occupancy (resident threads per SM, from the kernel's occupancy API when ``kernel`` is
       given, else from the device's thread/shared-memory/block limits);
    4. the larger tile (more reuse of each loaded element).

    Asking for four *launched* blocks per SM instead (``grid >= 4 x SMs``) preferred 16x16
    tiles at 512x512x512, which measured 1.31x slower than 32x32 on an H200 (256 blocks of
    32x32 already cover the 132 SMs); ``benchmarks/kernels.py`` keeps the sweep.

    Args:
        m: rows of A and C (>= 1).
        n: columns of B and C (>= 1).
        k: the inner dimension (>= 1). A tile deeper than k is clamped to k, which shrinks the
            shared memory per block.
        device: a CUDA device or its :class:`DeviceLimits` (default: torch's current device).
        tile_m: rows of a C tile (default ``None``: chosen). Giving only one of ``tile_m`` /
            ``tile_n`` makes a square tile.
        tile_n: columns of a C tile (default ``None``: chosen).
        tile_k: depth of the staged A/B tiles (default ``None``: ``min(tile_m, tile_n)``).
        element_size: bytes per element of A and B (default 4, float32).
        kernel: the compiled kernel, for its occupancy (register use) (default ``None``).
        min_blocks_per_sm: resident blocks per SM the tile's shared memory must leave room
            for (default 4).

    Returns:
        The :class:`LaunchConfig`, validated against the device.

    Raises:
        ConfigError: a size is < 1, or the requested tile does not fit the device.
    """
    for name, value in (("m", m), ("n", n), ("k", k), ("element_size", element_size),
                        ("min_blocks_per_sm", min_blocks_per_sm), ("tile_m", tile_m),
                        ("tile_n", tile_n), ("tile_k", tile_k)):
        check_int(f"calculate_optimal_launch_params {name}", value, minimum=1,
                  allow_none=name.startswith("tile_"))
    limits = device_limits(device)
    if tile_m is None and tile_n is None:
        tiles = [(t, t) for t in (32, 16, 8)]
        explicit = False
    else:
        tiles = [(tile_m or tile_n, tile_n or tile_m)]  # type: ignore[list-item]
        explicit = True
    max_threads = limits.max_threads_per_block
    if kernel is not None:
        max_threads = min(max_threads, kernel.max_threads_per_block)
    sms = limits.multiprocessor_count

    best: tuple[tuple[int, float, int], LaunchConfig] | None = None
    rejected: list[str] = []
    for tm, tn in tiles:
        depth = min(tile_k if tile_k is not None else min(tm, tn), k)
        shared = (tm + tn) * depth * element_size
        grid = (-(-n // tn), -(-m // tm), 1)
        threads = tm * tn
        if (threads > max_threads or tn > limits.max_block_dims[0]
                or tm > limits.max_block_dims[1]):
            rejected.append(f"{tm}x{tn}: {threads} threads > {max_threads}")
            continue
        if shared > limits.max_shared_memory_per_block_optin:
            rejected.append(f"{tm}x{tn}: {shared} B shared > "
                            f"{limits.max_shared_memory_per_block_optin}")
            continue
        if grid[1] > limits.max_grid_dims[1] or grid[0] > limits.max_grid_dims[0]:
            rejected.append(f"{tm}x{tn}: grid {grid} too large")
            continue
        blocks = grid[0] * grid[1]
        occupancy = (_resident_blocks(limits, threads, shared, kernel) * threads
                     / limits.max_threads_per_multiprocessor)
        # Each resident block also reserves ~1 KiB of shared memory for the system (sm_80+).
        by_shared = (limits.max_shared_memory_per_multiprocessor // (shared + 1024)
                     if shared else min_blocks_per_sm)
        score = (min(blocks, sms), min(by_shared, min_blocks_per_sm), round(occupancy, 3),
                 threads)
        config = LaunchConfig(grid=grid, block=(tn, tm, 1), shared_mem=shared)
        logger.debug("tile %dx%dx%d: %d blocks, occupancy %.2f", tm, tn, depth, blocks,
                     occupancy)
        if best is None or score > best[0]:
            best = (score, config)
    if best is None:
        what = "the requested tile" if explicit else "no candidate tile"
        raise ConfigError(f"{what} fits {limits.name}: " + "; ".join(rejected),
                          "Use a smaller tile_m/tile_n/tile_k or element_size.")
    return best[1].validate(limits)


def occupancy_fraction(config: LaunchConfig, device: DeviceArg = None,
                       kernel: OccupancyQuery | None = None) -> float:
    """Theoretical occupancy of ``config``: resident threads per SM / the SM's maximum.

    Args:
        config: the launch configuration.
        device: a CUDA device or its :class:`DeviceLimits` (default: torch's current device).
        kernel: the compiled kernel, for its register use (default ``None``: device limits
            only).

    Returns:
        A fraction in [0, 1].
    """
    limits = device_limits(device)
    threads = config.threads_per_block
    resident = _resident_blocks(limits, threads, config.shared_mem, kernel)
    return min(1.0, resident * threads / limits.max_threads_per_multiprocessor)
