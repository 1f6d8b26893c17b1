"""The cuda-core backend of :class:`~vramkit.kernels.manager.KernelManager`, and its disk cache.

Compilation goes straight through NVRTC (``cuda.bindings.nvrtc``): it takes the caller's option
strings as they are, reports its version for the cache key and returns the compiler log. Loading
and launching go through ``cuda.core`` (1.x, falling back to ``cuda.core.experimental`` of 0.x):
the cubin is loaded with ``ObjectCode.from_cubin`` and launched with ``cuda.core.launch`` on a
non-owning wrapper of PyTorch's stream, in the device's *primary* context (the one PyTorch uses),
so a kernel orders with surrounding torch work without any host sync.

Everything CUDA is imported lazily; the disk cache is plain Python and works without a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from vramkit._files import atomic_open
from vramkit.errors import KernelError

if TYPE_CHECKING:
    import torch

    from vramkit.kernels.launch import LaunchConfig

logger = logging.getLogger(__name__)

__all__ = [
    "CudaCoreBackend",
    "KernelDiskCache",
    "KernelInfo",
    "compile_cubin",
    "default_cache_dir",
    "load_cuda_core",
    "nvrtc_version",
]

_INSTALL_HINT = ("Install the kernels extra: pip install 'vramkit[kernels]' (cuda-core and "
                 "cuda-bindings matching your CUDA driver).")
# Header of a cache entry: magic, then the sha256 of the payload (detects torn/corrupt files).
_MAGIC = b"VRAMKIT-CUBIN-1\n"
_DIGEST_SIZE = 32
_cuda_core: Any | None = None


def load_cuda_core() -> Any:
    """The ``cuda.core`` namespace (1.x, or ``cuda.core.experimental`` of 0.x).

    Returns:
        A namespace with ``Device``, ``LaunchConfig``, ``ObjectCode`` and ``launch``.

    Raises:
        KernelError: cuda-core (or cuda-bindings) is not installed or cannot load.
    """
    global _cuda_core
    if _cuda_core is not None:
        return _cuda_core
    errors: list[str] = []
    for module_name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = __import__(module_name, fromlist=["Device"])
        except ImportError as err:
            errors.append(f"{module_name}: {err}")
            continue
        if all(hasattr(module, name) for name in ("Device", "LaunchConfig", "ObjectCode",
                                                  "launch")):
            _cuda_core = SimpleNamespace(
                Device=module.Device, LaunchConfig=module.LaunchConfig,
                ObjectCode=module.ObjectCode, launch=module.launch,
                legacy_default_stream=getattr(module, "LEGACY_DEFAULT_STREAM", None),
                name=module_name)
            return _cuda_core
        errors.append(f"{module_name}: lacks Device/LaunchConfig/ObjectCode/launch")
    raise KernelError("runtime-compiled kernels need NVIDIA's cuda-core package, which is not "
                      "usable here: " + "; ".join(errors), _INSTALL_HINT)


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # cuda-python < 12.6
        except ImportError as err:
            raise KernelError(f"NVRTC bindings are missing ({err})", _INSTALL_HINT) from err
    return nvrtc


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6
    return driver


def _check_nvrtc(nvrtc: Any, result: Any, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(result)
        raise KernelError(f"NVRTC {what} failed: {text.decode(errors='replace')}",
                          "Check that the NVRTC library matches cuda-bindings.")


def nvrtc_version() -> str:
    """The NVRTC version, ``"major.minor"`` (part of the cache key).

    Raises:
        KernelError: NVRTC cannot be loaded.
    """
    nvrtc = _nvrtc()
    try:
        result, major, minor = nvrtc.nvrtcVersion()
    except Exception as err:  # a missing libnvrtc.so raises the loader's own error type
        raise KernelError(f"NVRTC cannot be loaded: {err}",
                          "Install nvidia-cuda-nvrtc (pip) or the CUDA toolkit.") from err
    _check_nvrtc(nvrtc, result, "version query")
    return f"{major}.{minor}"


def _writable_buffer(size: int) -> bytes:
    """A fresh bytes object NVRTC can fill in place (the bindings take ``char*`` as bytes).

    At least 2 bytes: CPython shares the 0- and 1-byte bytes objects, and NVRTC writing into
    a shared object would corrupt that constant for the whole interpreter.
    """
    return b"\x00" * max(size, 2)


def compile_cubin(name: str, source: str, options: Sequence[str], arch: str) -> bytes:
    """Compile CUDA C ``source`` to a cubin for ``arch`` with NVRTC.

    Args:
        name: the program name (shown in compiler messages as ``<name>.cu``).
        source: CUDA C++ source.
        options: NVRTC options, passed as given (``"--use_fast_math"``, ``"-DNAME=1"``, ...).
        arch: the real architecture, e.g. ``"sm_90"``.

    Returns:
        The cubin bytes.

    Raises:
        KernelError: compilation failed; ``err.log`` holds the compiler log.
    """
    nvrtc = _nvrtc()
    result, program = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check_nvrtc(nvrtc, result, "program creation")
    try:
        flags = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        result, log_size = nvrtc.nvrtcGetProgramLogSize(program)
        _check_nvrtc(nvrtc, result, "log size query")
        log_buffer = _writable_buffer(log_size)
        (result,) = nvrtc.nvrtcGetProgramLog(program, log_buffer)
        log = log_buffer[:log_size].rstrip(b"\x00 \n").decode(errors="replace")
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, reason = nvrtc.nvrtcGetErrorString(compiled)
            if compiled == getattr(nvrtc.nvrtcResult, "NVRTC_ERROR_INVALID_OPTION", None):
                hint = (f"NVRTC refused one of the options {list(options)}: it takes nvcc-style "
                        "front-end options such as -DNAME=VALUE, -std=c++17, --use_fast_math, "
                        "-lineinfo (not host-compiler flags like -O3).")
            else:
                hint = ("Fix the CUDA C source (see the log above); kernels must be declared "
                        "extern \"C\" __global__ to be found by name.")
            raise KernelError(
                f"kernel {name!r} failed to compile for {arch} "
                f"({reason.decode(errors='replace')}); compiler log:",
                hint, log=log or "(empty log)")
        if log:
            logger.info("NVRTC messages for %s:\n%s", name, log)
        result, size = nvrtc.nvrtcGetCUBINSize(program)
        _check_nvrtc(nvrtc, result, "cubin size query")
        cubin = _writable_buffer(size)
        (result,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _check_nvrtc(nvrtc, result, "cubin retrieval")
        return cubin[:size]
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def default_cache_dir() -> Path:
    """Where compiled kernels are cached, read from the environment when called.

    Returns:
        ``$VRAMKIT_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/vramkit/kernels``, else
        ``~/.cache/vramkit/kernels``.
    """
    root = os.environ.get("VRAMKIT_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vramkit" / "kernels"


class KernelDiskCache:
    """Compiled kernels on disk, one file per (name, source, options, arch, compiler) key.

    Writes are atomic (a temporary file in the same directory, then ``os.replace``), so
    concurrent processes never see a torn entry; each entry carries a sha256 of its payload, so a
    corrupt or truncated entry is detected, removed and reported as a miss (the caller
    recompiles). An unwritable directory disables the cache with a warning; it never fails the
    compile.

    Args:
        directory: the cache directory (created on first write).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.corrupt_entries = 0

    @staticmethod
    def key(name: str, source: str, options: Sequence[str], arch: str, compiler: str) -> str:
        """The hex sha256 of everything that determines the binary."""
        digest = hashlib.sha256()
        for part in (name, source, "\x1f".join(options), arch, compiler):
            data = part.encode()
            digest.update(len(data).to_bytes(8, "little"))  # no ambiguity between fields
            digest.update(data)
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.directory / f"{key}.cubin"

    def load(self, key: str) -> bytes | None:
        """The cached binary of ``key``, or ``None`` when absent or corrupt."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            logger.warning("kernel cache entry %s is unreadable (%s); recompiling", path, err)
            return None
        header = len(_MAGIC) + _DIGEST_SIZE
        payload = data[header:]
        if (len(data) <= header or not data.startswith(_MAGIC)
                or hashlib.sha256(payload).digest() != data[len(_MAGIC):header]):
            self.corrupt_entries += 1
            logger.warning("kernel cache entry %s is corrupt; removing it and recompiling", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return payload

    def store(self, key: str, binary: bytes) -> bool:
        """Write ``binary`` under ``key`` atomically.

        Returns:
            Whether the entry was written (``False``: the directory is not writable).
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # a cache entry: no fsync (a lost one is compiled again)
            with atomic_open(self.path(key), "wb", fsync=False) as file:
                file.write(_MAGIC + hashlib.sha256(binary).digest() + binary)
        except OSError as err:
            logger.warning("cannot write the kernel cache in %s (%s); kernels will be "
                           "recompiled in new processes", self.directory, err)
            return False
        return True


@dataclass(frozen=True)
class KernelInfo:
    """What the backend reports about a loaded kernel.

    Args:
        num_arguments: parameter count, ``None`` when the driver/cuda-core cannot tell.
        argument_sizes: bytes of each parameter, ``None`` when unknown.
        max_threads_per_block: the most threads a block may have (register-limited).
        num_regs: registers per thread.
        static_shared_bytes: statically declared shared memory per block.
        local_bytes: local memory (spills) per thread.
    """

    num_arguments: int | None
    argument_sizes: tuple[int, ...] | None
    max_threads_per_block: int
    num_regs: int
    static_shared_bytes: int
    local_bytes: int


class _ForeignStream:
    """A non-owning ``__cuda_stream__`` view of a PyTorch stream handle."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _attribute(attributes: Any, name: str) -> int:
    value = getattr(attributes, name)
    return int(value() if callable(value) else value)  # methods in 0.x, properties in 1.x


class CudaCoreBackend:
    """Compile with NVRTC, load and launch with cuda-core, on one CUDA device.

    Args:
        index: the CUDA ordinal (as torch numbers devices).

    Raises:
        KernelError: cuda-core or NVRTC is unusable.
    """

    def __init__(self, index: int) -> None:
        import torch

        self._core = load_cuda_core()
        self.device = torch.device("cuda", index)
        self.index = index
        self._cuda_device = self._core.Device(index)
        # The primary context: the one PyTorch's runtime uses, so pointers and streams match.
        self._cuda_device.set_current()
        self._threads_current = threading.local()
        self._threads_current.done = True
        from vramkit.kernels.launch import device_limits

        self.limits = device_limits(index)
        major, minor = self.limits.compute_capability
        self.arch = f"sm_{major}{minor}"
        self.compiler = f"nvrtc-{nvrtc_version()}"
        self._streams: dict[int, Any] = {}
        self._configs: dict[LaunchConfig, Any] = {}
        self._dynamic_shared: dict[int, int] = {}
        import numpy

        self._numpy_types: dict[str, Any] = {
            "int8": numpy.int8, "int16": numpy.int16, "int32": numpy.int32,
            "int64": numpy.int64, "uint8": numpy.uint8, "uint16": numpy.uint16,
            "uint32": numpy.uint32, "uint64": numpy.uint64, "float16": numpy.float16,
            "float32": numpy.float32, "float64": numpy.float64, "bool": numpy.bool_,
            "ptr": numpy.uint64,
        }

    def _make_current(self) -> None:
        # cuda-core needs a current context per thread; set it once per launching thread.
        if not getattr(self._threads_current, "done", False):
            self._cuda_device.set_current()
            self._threads_current.done = True

    def compile(self, name: str, source: str, options: Sequence[str]) -> bytes:
        """A cubin for this device's architecture (see :func:`compile_cubin`)."""
        return compile_cubin(name, source, options, self.arch)

    def load(self, name: str, binary: bytes) -> Any:
        """Load ``binary`` and return its kernel ``name`` (a cuda-core ``Kernel``).

        Raises:
            KernelError: the binary does not load or has no kernel of that name.
        """
        self._make_current()
        object_code_type = self._core.ObjectCode
        try:
            if hasattr(object_code_type, "from_cubin"):
                module = object_code_type.from_cubin(binary, name=name)
            else:  # cuda-core 0.1
                module = object_code_type(binary, "cubin")
            return module.get_kernel(name)
        except Exception as err:  # cuda-core raises CUDAError/RuntimeError for bad modules
            raise KernelError(
                f"kernel {name!r} could not be loaded from its compiled module: {err}",
                "Declare the kernel extern \"C\" __global__ and pass its exact name, so the "
                "symbol is not C++-mangled.") from err

    def kernel_info(self, kernel: Any) -> KernelInfo:
        """Parameter layout and resource use of a loaded kernel."""
        attributes = kernel.attributes
        try:
            count: int | None = int(kernel.num_arguments)
            # ParamInfo(offset, size): a named tuple in some versions, a plain pair in others.
            sizes: tuple[int, ...] | None = tuple(
                int(getattr(p, "size", None) if hasattr(p, "size") else p[1])
                for p in kernel.arguments_info)
        except Exception as err:  # older cuda-core / driver without cuFuncGetParamInfo
            logger.debug("kernel parameter info unavailable: %s", err)
            count, sizes = None, None
        return KernelInfo(
            num_arguments=count, argument_sizes=sizes,
            max_threads_per_block=_attribute(attributes, "max_threads_per_block"),
            num_regs=_attribute(attributes, "num_regs"),
            static_shared_bytes=_attribute(attributes, "shared_size_bytes"),
            local_bytes=_attribute(attributes, "local_size_bytes"))

    def max_potential_block_size(self, kernel: Any, shared_mem: int) -> int | None:
        """The occupancy API's block size for ``kernel``, ``None`` when unsupported."""
        occupancy = getattr(kernel, "occupancy", None)
        if occupancy is None:
            return None
        return int(occupancy.max_potential_block_size(shared_mem, 0).max_block_size)

    def max_active_blocks(self, kernel: Any, block_size: int, shared_mem: int) -> int | None:
        """Resident blocks per SM of ``kernel`` at this block size, ``None`` when unsupported."""
        occupancy = getattr(kernel, "occupancy", None)
        if occupancy is None:
            return None
        return int(occupancy.max_active_blocks_per_multiprocessor(block_size, shared_mem))

    def _allow_dynamic_shared(self, kernel: Any, nbytes: int) -> None:
        # Above 48 KiB a kernel must opt in to more dynamic shared memory, once per size.
        key = id(kernel)
        if nbytes <= self._dynamic_shared.get(key, 48 * 1024):
            return
        driver = _driver()
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = kernel.handle
        if isinstance(handle, driver.CUkernel):
            (result,) = driver.cuKernelSetAttribute(attribute, nbytes, handle,
                                                    driver.CUdevice(self.index))
        else:
            (result,) = driver.cuFuncSetAttribute(handle, attribute, nbytes)
        if result != driver.CUresult.CUDA_SUCCESS:
            raise KernelError(f"cannot give the kernel {nbytes} bytes of dynamic shared memory "
                              f"({result.name})", "Use less shared memory per block.")
        self._dynamic_shared[key] = nbytes

    def resolve_stream(self, stream: Any) -> torch.cuda.Stream:
        """A torch stream for ``stream`` (``None``: torch's current stream on this device)."""
        import torch

        if stream is None:
            return torch.cuda.current_stream(self.device)
        if isinstance(stream, torch.cuda.Stream):
            if stream.device != self.device:
                from vramkit.errors import DeviceMismatchError

                raise DeviceMismatchError(self.device, stream.device, what="the stream")
            return stream
        if isinstance(stream, int):
            return torch.cuda.ExternalStream(stream, device=self.device)
        protocol = getattr(stream, "__cuda_stream__", None)
        if protocol is not None:
            return torch.cuda.ExternalStream(int(protocol()[1]), device=self.device)
        raise KernelError(f"not a stream: {stream!r}",
                          "Pass a torch.cuda.Stream, a raw stream handle (int) or an object "
                          "with __cuda_stream__.")

    def new_timing_event(self) -> Any:
        """A CUDA event that records time (for opt-in kernel timing)."""
        import torch

        return torch.cuda.Event(enable_timing=True)

    def _core_stream(self, handle: int) -> Any:
        core_stream = self._streams.get(handle)
        if core_stream is None:
            if handle == 0 and self._core.legacy_default_stream is not None:
                core_stream = self._core.legacy_default_stream
            else:
                core_stream = self._cuda_device.create_stream(_ForeignStream(handle))
            if len(self._streams) > 256:  # streams come and go; keep the table bounded
                self._streams.clear()
            self._streams[handle] = core_stream
        return core_stream

    def launch(self, kernel: Any, config: LaunchConfig, args: Sequence[tuple[str, Any]],
               stream: torch.cuda.Stream) -> None:
        """Enqueue ``kernel`` on ``stream`` (asynchronous; no host sync).

        Args:
            kernel: a kernel returned by :meth:`load`.
            config: the validated launch configuration.
            args: ``(kind, value)`` pairs: ``"ptr"`` with an int device address, or a C scalar
                type name (``"int32"``, ``"float32"``, ...) with its value.
            stream: the torch stream to launch on.
        """
        self._make_current()
        if config.shared_mem > 48 * 1024:
            self._allow_dynamic_shared(kernel, config.shared_mem)
        core_config = self._configs.get(config)
        if core_config is None:
            core_config = self._core.LaunchConfig(grid=config.grid, block=config.block,
                                                  shmem_size=config.shared_mem)
            if len(self._configs) > 1024:
                self._configs.clear()
            self._configs[config] = core_config
        types = self._numpy_types
        # Every argument goes as a numpy scalar of its exact C type (pointers as uint64), so
        # cuda-core never has to guess a width.
        values = [types[kind](value) for kind, value in args]
        self._core.launch(self._core_stream(int(stream.cuda_stream)), core_config, kernel,
                          *values)
