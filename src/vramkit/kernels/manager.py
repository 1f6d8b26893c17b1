"""KernelManager: CUDA C compiled at run time, cached on disk, launched on PyTorch's stream.

FLAME's ``KernelManager::get(device)`` / ``launch_custom`` and ``CudaKernels::ensure_kernel``,
made real::

    from vramkit.kernels.examples import RELU_SOURCE
    from vramkit.kernels.launch import LaunchConfig
    from vramkit.kernels.manager import KernelManager

    manager = KernelManager.get("cuda:0")
    manager.ensure_kernel("relu_kernel", RELU_SOURCE)
    manager.launch("relu_kernel", LaunchConfig.for_elements(x.numel(), x.device), x, x.numel())

* Compilation: NVRTC for the device's architecture (``sm_90`` on an H200); the cubin is cached
  in ``$VRAMKIT_CACHE_DIR/kernels`` (or ``$XDG_CACHE_HOME/vramkit/kernels``, or
  ``~/.cache/vramkit/kernels``) keyed by name, source, options, architecture and NVRTC version,
  so a second process loads it without compiling.
* Arguments: torch tensors become device pointers (and must be on the kernel's device), Python
  ``int`` becomes a C ``int`` (range-checked), ``float`` a C ``float``; other C types through the
  scalar wrappers of this module (``int64(x)``, ``uint32(x)``, ``float64(x)``, ...) or numpy
  scalars. The count (and, where the driver reports it, each size) is checked before launching.
* Streams: PyTorch's current stream on the kernel's device by default, so a launch orders with
  the torch work around it; nothing waits for the GPU.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vramkit._validate import check_choice, check_int
from vramkit.errors import ConfigError, DeviceError, DeviceMismatchError, KernelError
from vramkit.kernels._nvrtc import KernelDiskCache, KernelInfo, default_cache_dir
from vramkit.kernels.launch import DeviceLimits, LaunchConfig, _cuda_index
from vramkit.kernels.stats import performance_stats

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CompiledKernel",
    "KernelCacheStats",
    "KernelManager",
    "KernelScalar",
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "is_available",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
]

# ----------------------------------------------------------------------------------------------
# Availability


def _unavailable_reason() -> str | None:
    """Why kernels cannot run here, or ``None`` when they can."""
    from vramkit.devices._runtime import is_cuda_available
    from vramkit.kernels._nvrtc import load_cuda_core

    try:
        load_cuda_core()
    except KernelError as err:
        return err.message
    if not is_cuda_available():
        return "runtime-compiled kernels need a CUDA GPU, and PyTorch sees none"
    return None


def is_available() -> bool:
    """Whether :class:`KernelManager` can compile and launch kernels in this process.

    Returns:
        ``True`` when the optional ``cuda-core`` package imports and PyTorch sees a CUDA GPU.
        Creates no CUDA context.
    """
    return _unavailable_reason() is None


# ----------------------------------------------------------------------------------------------
# Scalar arguments

_ARG_SIZES: dict[str, int] = {
    "ptr": 8, "bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "float16": 2, "float32": 4, "float64": 8,
}
_INT_RANGES: dict[str, tuple[int, int]] = {
    "int8": (-(2**7), 2**7 - 1), "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1), "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}
_SCALAR_TYPES = tuple(sorted(set(_ARG_SIZES) - {"ptr"}))
_C_NAMES: dict[str, str] = {
    "ptr": "pointer", "bool": "bool", "int8": "int8_t", "int16": "short", "int32": "int",
    "int64": "long long", "uint8": "uint8_t", "uint16": "unsigned short",
    "uint32": "unsigned int", "uint64": "unsigned long long", "float16": "__half",
    "float32": "float", "float64": "double",
}


@dataclass(frozen=True)
class KernelScalar:
    """A kernel argument of an explicit C scalar type (made by :func:`int64`, :func:`uint32`,
    :func:`float64`, ...).

    Args:
        ctype: the type name: ``int8``/``16``/``32``/``64``, ``uint8``/``16``/``32``/``64``,
            ``float16``/``32``/``64`` or ``bool``.
        value: the value; integers are range-checked for the type.

    Raises:
        ConfigError: an unknown type, a non-integer for an integer type, or a value out of range.
    """

    ctype: str
    value: int | float | bool

    def __post_init__(self) -> None:
        check_choice("kernel scalar type", self.ctype, _SCALAR_TYPES)
        if self.ctype in _INT_RANGES:
            value: object = self.value
            # numpy integers, and bools (uint8(flag) is how a flag is passed), become ints.
            with contextlib.suppress(TypeError):
                value = operator.index(value)  # type: ignore[arg-type]
            low, high = _INT_RANGES[self.ctype]
            object.__setattr__(self, "value", check_int(f"{self.ctype} kernel argument", value,
                                                        minimum=low, maximum=high))
        elif self.ctype == "bool":
            object.__setattr__(self, "value", bool(self.value))
        else:
            object.__setattr__(self, "value", float(self.value))

    @property
    def nbytes(self) -> int:
        """Size of the C type in bytes."""
        return _ARG_SIZES[self.ctype]


def int8(value: int) -> KernelScalar:
    """A C ``int8_t`` kernel argument."""
    return KernelScalar("int8", value)


def int16(value: int) -> KernelScalar:
    """A C ``short`` kernel argument."""
    return KernelScalar("int16", value)


def int32(value: int) -> KernelScalar:
    """A C ``int`` kernel argument (what a plain Python ``int`` becomes)."""
    return KernelScalar("int32", value)


def int64(value: int) -> KernelScalar:
    """A C ``long long`` / ``int64_t`` kernel argument (e.g. sizes above 2^31 - 1)."""
    return KernelScalar("int64", value)


def uint8(value: int) -> KernelScalar:
    """A C ``uint8_t`` kernel argument."""
    return KernelScalar("uint8", value)


def uint16(value: int) -> KernelScalar:
    """A C ``unsigned short`` kernel argument."""
    return KernelScalar("uint16", value)


def uint32(value: int) -> KernelScalar:
    """A C ``unsigned int`` kernel argument."""
    return KernelScalar("uint32", value)


def uint64(value: int) -> KernelScalar:
    """A C ``unsigned long long`` / ``size_t`` kernel argument."""
    return KernelScalar("uint64", value)


def float16(value: float) -> KernelScalar:
    """A C ``__half`` kernel argument."""
    return KernelScalar("float16", value)


def float32(value: float) -> KernelScalar:
    """A C ``float`` kernel argument (what a plain Python ``float`` becomes)."""
    return KernelScalar("float32", value)


def float64(value: float) -> KernelScalar:
    """A C ``double`` kernel argument."""
    return KernelScalar("float64", value)


def _pack_argument(position: int, arg: Any, device: torch.device) -> tuple[str, Any]:
    """One argument as ``(kind, value)`` for the backend."""
    import torch

    if isinstance(arg, torch.Tensor):
        if arg.device != device:
            raise DeviceMismatchError(device, arg.device, what=f"kernel argument {position}")
        if not arg.is_contiguous():
            # A kernel sees only the data pointer: a strided view (x.t(), x[:, ::2]) would be
            # read and written as if it were dense, silently wrong.
            raise KernelError(
                f"kernel argument {position} is a non-contiguous tensor (shape "
                f"{tuple(arg.shape)}, strides {tuple(arg.stride())})",
                hint="Pass tensor.contiguous() (and copy results back), or pass the strides "
                     "as extra scalar arguments and pass the base tensor.")
        return ("ptr", arg.data_ptr())
    if arg is None:
        return ("ptr", 0)  # a null pointer
    if isinstance(arg, KernelScalar):
        return (arg.ctype, arg.value)
    # numpy scalars first: numpy.float64 is also a Python float, but keeps its own width.
    if type(arg).__module__ == "numpy" and getattr(arg, "ndim", None) == 0:
        name = str(arg.dtype)
        if name in _ARG_SIZES and name != "ptr":
            return (name, arg.item())
        raise KernelError(f"kernel argument {position} is a numpy {name}, which has no "
                          "kernel scalar type", "Use an integer, float or bool dtype.")
    if isinstance(arg, bool):
        raise KernelError(f"kernel argument {position} is a Python bool; its C width is "
                          "ambiguous", "Pass int32(flag) or uint8(flag) from vramkit.kernels.manager.")
    if isinstance(arg, int):
        low, high = _INT_RANGES["int32"]
        if not low <= arg <= high:
            raise KernelError(f"kernel argument {position} = {arg} does not fit in a C int",
                              "Declare the parameter long long / int64_t and pass "
                              "int64(value) from vramkit.kernels.manager.")
        return ("int32", arg)
    if isinstance(arg, float):
        return ("float32", arg)
    raise KernelError(f"kernel argument {position} has unsupported type {type(arg).__name__}",
                      "Pass torch tensors (device pointers), Python int/float, None (a null "
                      "pointer), numpy scalars or the int64(...)-style wrappers of "
                      "vramkit.kernels.manager.")


def _check_arguments(name: str, packed: Sequence[tuple[str, Any]], info: KernelInfo) -> None:
    if info.num_arguments is not None and len(packed) != info.num_arguments:
        raise KernelError(
            f"kernel {name!r} takes {info.num_arguments} arguments, got {len(packed)}",
            "Pass one value per kernel parameter, in the declared order.")
    if info.argument_sizes is None:
        return
    for position, ((kind, _), expected) in enumerate(zip(packed, info.argument_sizes,
                                                         strict=False)):
        got = _ARG_SIZES[kind]
        if got != expected:
            raise KernelError(
                f"kernel {name!r} argument {position} is {expected} bytes, but a "
                f"{_C_NAMES[kind]} ({got} bytes) was passed",
                "Match the parameter's C type: a tensor for a pointer, and the wrappers of "
                "vramkit.kernels.manager: int64(x) for long long, float64(x) for double, "
                "uint8(x) for 1-byte values.")


# ----------------------------------------------------------------------------------------------
# Compiled kernels


class _Backend(Protocol):
    """What :class:`KernelManager` needs from a compile/launch backend (see ``_nvrtc``)."""

    device: torch.device
    arch: str
    compiler: str
    limits: DeviceLimits

    def compile(self, name: str, source: str, options: Sequence[str]) -> bytes: ...

    def load(self, name: str, binary: bytes) -> Any: ...

    def kernel_info(self, kernel: Any) -> KernelInfo: ...

    def max_potential_block_size(self, kernel: Any, shared_mem: int) -> int | None: ...

    def max_active_blocks(self, kernel: Any, block_size: int, shared_mem: int) -> int | None: ...

    def resolve_stream(self, stream: Any) -> Any: ...

    def new_timing_event(self) -> Any: ...

    def launch(self, kernel: Any, config: LaunchConfig, args: Sequence[tuple[str, Any]],
               stream: Any) -> None: ...


class CompiledKernel:
    """A kernel compiled and loaded on one device (returned by
    :meth:`KernelManager.ensure_kernel`).

    Implements :class:`~vramkit.kernels.launch.OccupancyQuery`, so it can be given to
    :meth:`LaunchConfig.for_elements` and :func:`calculate_optimal_launch_params`.
    """

    def __init__(self, manager: KernelManager, name: str, handle: Any, info: KernelInfo,
                 source_key: tuple[str, tuple[str, ...]]) -> None:
        self._manager = manager
        self.name = name
        self._handle = handle
        self.info = info
        self._source_key = source_key
        self._validated: set[LaunchConfig] = set()

    @property
    def device(self) -> torch.device:
        """The CUDA device the kernel is loaded on."""
        return self._manager.device

    @property
    def num_arguments(self) -> int | None:
        """Declared parameter count (``None`` when the driver cannot report it)."""
        return self.info.num_arguments

    @property
    def max_threads_per_block(self) -> int:
        """Most threads per block this kernel can be launched with (limited by registers)."""
        return self.info.max_threads_per_block

    @property
    def num_regs(self) -> int:
        """Registers per thread."""
        return self.info.num_regs

    def max_potential_block_size(self, shared_mem: int = 0) -> int | None:
        """The block size with the best occupancy (``cuOccupancyMaxPotentialBlockSize``).

        Args:
            shared_mem: dynamic shared memory per block in bytes (default 0).

        Returns:
            Threads per block, or ``None`` when the backend has no occupancy API.
        """
        return self._manager._backend.max_potential_block_size(self._handle, shared_mem)

    def max_active_blocks_per_multiprocessor(self, block_size: int,
                                             shared_mem: int = 0) -> int | None:
        """Resident blocks per SM at this block size
        (``cuOccupancyMaxActiveBlocksPerMultiprocessor``).

        Args:
            block_size: threads per block.
            shared_mem: dynamic shared memory per block in bytes (default 0).

        Returns:
            Blocks per SM, or ``None`` when the backend has no occupancy API.
        """
        return self._manager._backend.max_active_blocks(self._handle, block_size, shared_mem)

    def launch(self, config: LaunchConfig, *args: Any, stream: Any = None) -> None:
        """Launch this kernel (see :meth:`KernelManager.launch`)."""
        self._manager.launch(self, config, *args, stream=stream)

    def __repr__(self) -> str:
        return (f"CompiledKernel({self.name!r}, device={self.device}, "
                f"args={self.num_arguments}, regs={self.num_regs})")


@dataclass(frozen=True)
class KernelCacheStats:
    """How a :class:`KernelManager` obtained its kernels.

    Args:
        compiles: NVRTC compilations run by this manager.
        disk_hits: kernels loaded from the disk cache without compiling.
        memory_hits: ``ensure_kernel`` calls answered by an already loaded kernel.
        corrupt_entries: disk cache entries found corrupt (and recompiled).
    """

    compiles: int
    disk_hits: int
    memory_hits: int
    corrupt_entries: int


_MANAGERS: dict[int, KernelManager] = {}
_MANAGERS_LOCK = threading.Lock()
_ARCH_OPTIONS = ("-arch", "--gpu-architecture", "--gpu-name")


class KernelManager:
    """Compiles, caches and launches CUDA C kernels on one device (one manager per device).

    Use :meth:`get`; the constructor is for tests that supply their own backend.

    Args:
        backend: the compile/load/launch backend (``_nvrtc.CudaCoreBackend`` for a GPU).
        cache_dir: the disk cache directory (default ``None``: :func:`default_cache_dir`, read
            when the manager is created).
    """

    def __init__(self, backend: _Backend, cache_dir: str | Path | None = None) -> None:
        self._backend = backend
        self.device = backend.device
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._disk = KernelDiskCache(self.cache_dir)
        self._kernels: dict[str, CompiledKernel] = {}
        self._lock = threading.Lock()
        self._compiles = 0
        self._disk_hits = 0
        self._memory_hits = 0
        self._stats = performance_stats()

    @classmethod
    def get(cls, device: torch.device | str | int | None = None) -> KernelManager:
        """The manager of a CUDA device, created on first use.

        Args:
            device: ``"cuda:1"``, an ordinal or a ``torch.device`` (default ``None``: torch's
                current CUDA device).

        Returns:
            The device's :class:`KernelManager` (the same object on every call).

        Raises:
            KernelError: no GPU, or the optional ``cuda-core`` package is missing.
            DeviceError: ``device`` is not a CUDA device.
        """
        index = _cuda_index(device)
        manager = _MANAGERS.get(index)
        if manager is not None:
            return manager
        reason = _unavailable_reason()
        if reason is not None:
            raise KernelError(reason,
                              hint="Kernels need an NVIDIA GPU visible to PyTorch and the kernels "
                                   "extra (pip install 'vramkit[kernels]'); check "
                                   "vramkit.kernels.is_available() first to fall back.")
        import torch

        from vramkit.devices.resolve import cuda_ordinal

        try:
            cuda_ordinal(torch.device("cuda", index), owner="KernelManager")
        except DeviceError as err:  # kernels report what stops them as KernelError
            raise KernelError(err.message, err.hint) from None
        with _MANAGERS_LOCK:
            manager = _MANAGERS.get(index)
            if manager is None:
                from vramkit.kernels._nvrtc import CudaCoreBackend

                manager = cls(CudaCoreBackend(index))
                _MANAGERS[index] = manager
        return manager

    @property
    def limits(self) -> DeviceLimits:
        """The device's launch limits."""
        return self._backend.limits

    @property
    def kernels(self) -> tuple[str, ...]:
        """Names of the kernels loaded so far."""
        return tuple(self._kernels)

    def cache_stats(self) -> KernelCacheStats:
        """Compile and cache counters of this manager."""
        return KernelCacheStats(compiles=self._compiles, disk_hits=self._disk_hits,
                                memory_hits=self._memory_hits,
                                corrupt_entries=self._disk.corrupt_entries)

    def ensure_kernel(self, name: str, source: str, *, options: Sequence[str] = (),
                      disk_cache: bool = True) -> CompiledKernel:
        """Compile (or reuse) the kernel ``name`` defined in ``source``.

        A kernel already loaded with the same source and options is returned as is; a new
        source under the same name replaces it.

        Args:
            name: the kernel's function name; declare it ``extern "C" __global__`` so the
                symbol is not C++-mangled.
            source: CUDA C++ source defining it.
            options: extra NVRTC options (``"--use_fast_math"``, ``"-DTILE=16"``, ``"-std=c++17"``);
                the architecture is chosen from the device and may not be given (default none).
            disk_cache: read and write the on-disk cache (default ``True``); ``False`` always
                compiles and writes nothing.

        Returns:
            The :class:`CompiledKernel`.

        Raises:
            ConfigError: an empty name/source, non-string options, or an architecture option.
            KernelError: compilation failed (``err.log`` has the compiler log) or the kernel
                is not found in the compiled module.
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"kernel name must be a C identifier, got {name!r}",
                              hint="Pass the kernel's function name, declared extern \"C\" "
                                   "__global__ in the source, e.g. ensure_kernel('vector_add', "
                                   "source).")
        if not isinstance(source, str) or not source.strip():
            raise ConfigError(f"kernel {name!r}: source must be non-empty CUDA C text",
                              hint="Pass the CUDA C++ source text that defines the kernel (an "
                                   "extern \"C\" __global__ function).")
        if isinstance(options, str) or not all(isinstance(o, str) for o in options):
            raise ConfigError(f"kernel {name!r}: options must be a sequence of strings, "
                              f"got {options!r}",
                              hint="Pass NVRTC options as a list of strings, e.g. "
                                   "options=['--use_fast_math', '-DTILE=16'].")
        options = tuple(options)
        for option in options:
            if option.split("=", 1)[0] in _ARCH_OPTIONS:
                raise ConfigError(f"kernel {name!r}: option {option!r} is not allowed",
                                  f"The architecture comes from the device "
                                  f"({self._backend.arch}); drop the option.")
        source_key = (source, options)
        with self._lock:
            existing = self._kernels.get(name)
            if existing is not None and existing._source_key == source_key:
                self._memory_hits += 1
                return existing
            handle = None
            key = KernelDiskCache.key(name, source, options, self._backend.arch,
                                      self._backend.compiler)
            binary = self._disk.load(key) if disk_cache else None
            if binary is not None:
                try:
                    handle = self._backend.load(name, binary)
                    self._disk_hits += 1
                    logger.debug("kernel %s loaded from %s", name, self._disk.path(key))
                except KernelError as err:
                    logger.warning("cached kernel %s does not load (%s); recompiling", name,
                                   err.message)
            if handle is None:
                binary = self._backend.compile(name, source, options)
                self._compiles += 1
                handle = self._backend.load(name, binary)
                if disk_cache:
                    self._disk.store(key, binary)
                logger.info("compiled kernel %s for %s (%s)", name, self._backend.arch,
                            self._backend.compiler)
            kernel = CompiledKernel(self, name, handle, self._backend.kernel_info(handle),
                                    source_key)
            if existing is not None:
                logger.info("kernel %s replaced by a new source/options", name)
            self._kernels[name] = kernel
            return kernel

    def kernel(self, name: str) -> CompiledKernel:
        """The loaded kernel ``name``.

        Raises:
            KernelError: no kernel of that name was ensured on this manager.
        """
        kernel = self._kernels.get(name)
        if kernel is None:
            raise KernelError(f"no kernel named {name!r} on {self.device}",
                              "Call ensure_kernel(name, source) first.")
        return kernel

    def launch(self, kernel: str | CompiledKernel, config: LaunchConfig, *args: Any,
               stream: Any = None) -> None:
        """Launch a kernel asynchronously (FLAME ``launch_custom``).

        Args:
            kernel: a kernel name or a :class:`CompiledKernel` of this manager.
            config: the :class:`LaunchConfig`; checked against the device and kernel limits.
            *args: the kernel's arguments: tensors on this device (pointers), ``None`` (a null
                pointer), ``int`` (C ``int``), ``float`` (C ``float``), numpy scalars or
                :class:`KernelScalar` wrappers.
            stream: a ``torch.cuda.Stream``, a raw stream handle or an object with
                ``__cuda_stream__`` (default ``None``: torch's current stream on the device).

        Raises:
            ConfigError: the configuration exceeds the device's or kernel's limits.
            DeviceMismatchError: a tensor argument is on another device.
            KernelError: unknown kernel, wrong argument count/sizes/types, or the launch
                failed (with a hint from :func:`~vramkit.devices.cuda_errors.explain_cuda_error`).
        """
        compiled = self.kernel(kernel) if isinstance(kernel, str) else kernel
        if not isinstance(compiled, CompiledKernel) or compiled._manager is not self:
            raise KernelError(f"{kernel!r} is not a kernel of the manager of {self.device}",
                              "Launch through the manager that compiled it.")
        if not isinstance(config, LaunchConfig):
            raise ConfigError(f"launch needs a LaunchConfig, got {type(config).__name__}",
                              hint="Pass a LaunchConfig(grid, block), e.g. LaunchConfig(grid=64, "
                                   "block=256).")
        if config not in compiled._validated:
            config.validate(self._backend.limits, compiled)
            if len(compiled._validated) >= 1024:  # sizes that vary per call: keep it bounded
                compiled._validated.clear()
            compiled._validated.add(config)
        device = self.device
        packed = [_pack_argument(i, arg, device) for i, arg in enumerate(args)]
        _check_arguments(compiled.name, packed, compiled.info)
        stream = self._backend.resolve_stream(stream)
        timing = self._stats.timing_enabled
        if timing:
            start, end = self._backend.new_timing_event(), self._backend.new_timing_event()
            start.record(stream)
        try:
            self._backend.launch(compiled._handle, config, packed, stream)
        except (KernelError, ConfigError):
            raise
        except Exception as err:  # cuda-core's CUDAError, or a RuntimeError from the driver
            from vramkit.devices.cuda_errors import explain_cuda_error

            explanation = explain_cuda_error(err)
            raise KernelError(f"launch of kernel {compiled.name!r} failed: {err} "
                              f"({explanation.summary})",
                              " ".join(explanation.suggestions[:2])) from err
        index = device.index if device.index is not None else 0
        if timing:
            end.record(stream)
            self._stats.record_launch(index, (start, end))
        else:
            self._stats.record_launch(index)

    def __repr__(self) -> str:
        return (f"KernelManager({self.device}, arch={self._backend.arch}, "
                f"kernels={list(self._kernels)})")


def _reset_managers() -> None:
    """Forget every per-device manager (tests)."""
    with _MANAGERS_LOCK:
        _MANAGERS.clear()
