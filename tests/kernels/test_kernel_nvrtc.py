"""The kernel disk cache, its directory, and the cuda-core import (missing package path)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from vramkit.errors import KernelError
from vramkit.kernels import _nvrtc
from vramkit.kernels import launch as launch_module
from vramkit.kernels._nvrtc import (
    KernelDiskCache,
    compile_cubin,
    default_cache_dir,
    load_cuda_core,
)
from vramkit.kernels.launch import DeviceLimits, LaunchConfig

LIMITS = DeviceLimits(name="fake", compute_capability=(9, 0), multiprocessor_count=4,
                      max_threads_per_multiprocessor=2048, max_blocks_per_multiprocessor=32,
                      max_shared_memory_per_block_optin=200 * 1024)

KEY_ARGS = ("relu_kernel", "source", ("-O3",), "sm_90", "nvrtc-13.0")


# ---------------------------------------------------------------------------- cache directory


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VRAMKIT_CACHE_DIR", str(tmp_path / "vk"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "vk" / "kernels"
    monkeypatch.delenv("VRAMKIT_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "vramkit" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "vramkit" / "kernels"


# ---------------------------------------------------------------------------- cache keys


def test_key_depends_on_every_field() -> None:
    base = KernelDiskCache.key(*KEY_ARGS)
    assert base == KernelDiskCache.key(*KEY_ARGS)
    variants = [
        ("other", *KEY_ARGS[1:]),
        (KEY_ARGS[0], "source ", *KEY_ARGS[2:]),
        (*KEY_ARGS[:2], ("-O2",), *KEY_ARGS[3:]),
        (*KEY_ARGS[:2], (), *KEY_ARGS[3:]),
        (*KEY_ARGS[:3], "sm_80", KEY_ARGS[4]),
        (*KEY_ARGS[:4], "nvrtc-12.8"),
    ]
    keys = {KernelDiskCache.key(*v) for v in variants}  # type: ignore[arg-type]
    assert base not in keys and len(keys) == len(variants)


def test_key_fields_cannot_run_into_each_other() -> None:
    assert (KernelDiskCache.key("ab", "c", (), "sm_90", "x")
            != KernelDiskCache.key("a", "bc", (), "sm_90", "x"))
    assert (KernelDiskCache.key("k", "s", ("-a", "-b"), "sm_90", "x")
            != KernelDiskCache.key("k", "s", ("-a -b",), "sm_90", "x"))


# ---------------------------------------------------------------------------- entries


def test_store_then_load_round_trips(tmp_path: Path) -> None:
    cache = KernelDiskCache(tmp_path / "new" / "dir")
    key = KernelDiskCache.key(*KEY_ARGS)
    assert cache.load(key) is None
    assert cache.store(key, b"\x7fELF cubin bytes")
    assert cache.load(key) == b"\x7fELF cubin bytes"
    assert [p.name for p in cache.directory.iterdir()] == [f"{key}.cubin"]  # no temp files


def test_store_replaces_an_entry(tmp_path: Path) -> None:
    cache = KernelDiskCache(tmp_path)
    cache.store("k", b"old")
    cache.store("k", b"new")
    assert cache.load("k") == b"new"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "header-only"])
def test_corrupt_entries_are_misses_and_removed(tmp_path: Path, damage: str) -> None:
    cache = KernelDiskCache(tmp_path)
    cache.store("k", b"x" * 1000)
    path = cache.path("k")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-10])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "garbage":
        path.write_bytes(b"not a cache entry at all" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(data[:48])
    assert cache.load("k") is None
    assert cache.corrupt_entries == 1
    assert not path.exists()
    cache.store("k", b"fresh")  # recompiled and written again
    assert cache.load("k") == b"fresh"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write read-only directories")
def test_unwritable_directory_disables_the_cache(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        cache = KernelDiskCache(tmp_path / "sub")
        assert cache.store("k", b"data") is False
        assert cache.load("k") is None
    finally:
        tmp_path.chmod(0o700)


def test_a_file_in_place_of_the_directory_disables_the_cache(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    cache = KernelDiskCache(blocker / "kernels")
    assert cache.store("k", b"data") is False
    assert cache.load("k") is None


# ---------------------------------------------------------------------------- cuda-core import


def _hide_cuda_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvrtc, "_cuda_core", None)
    for name in ("cuda.core", "cuda.core.experimental"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError


def test_missing_cuda_core_is_a_kernel_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_cuda_core(monkeypatch)
    with pytest.raises(KernelError, match="cuda-core") as info:
        load_cuda_core()
    assert "vramkit[kernels]" in info.value.hint


@pytest.mark.skipif(importlib.util.find_spec("cuda") is not None
                    and importlib.util.find_spec("cuda.core") is not None,
                    reason="cuda-core is installed here")
def test_cuda_core_is_really_missing_here() -> None:
    with pytest.raises(KernelError, match="cuda-core"):
        load_cuda_core()
    with pytest.raises(KernelError):
        _nvrtc.nvrtc_version()


# ---------------------------------------------------------------------------- NVRTC driving
# A fake of cuda.bindings.nvrtc with the bindings' calling convention: status tuples, and output
# buffers passed as bytes that the C side fills in place.

OK, FAILED, BAD_OPTION = "NVRTC_SUCCESS", "NVRTC_ERROR_COMPILATION", "NVRTC_ERROR_INVALID_OPTION"
LOG = b"k.cu(3): error: identifier \"undefined_name\" is undefined\n"


class FakeNvrtc:
    nvrtcResult = SimpleNamespace(NVRTC_SUCCESS=OK, NVRTC_ERROR_INVALID_OPTION=BAD_OPTION)

    def __init__(self, fail: bool | str = False, log: bytes = LOG) -> None:
        self.fail = fail
        self.log = log
        self.created: list[tuple[bytes, bytes]] = []
        self.options: list[bytes] = []
        self.destroyed = 0

    @staticmethod
    def _fill(buffer: bytes, data: bytes) -> None:
        assert len(buffer) >= len(data) and len(buffer) >= 2  # never a shared 0/1-byte object
        ctypes.memmove(ctypes.c_char_p(buffer), data, len(data))

    def nvrtcVersion(self) -> tuple[str, int, int]:
        return (OK, 13, 0)

    def nvrtcGetErrorString(self, result: str) -> tuple[str, bytes]:
        return (OK, result.encode())

    def nvrtcCreateProgram(self, source: bytes, name: bytes, count: int, headers: list[bytes],
                           names: list[bytes]) -> tuple[str, str]:
        self.created.append((source, name))
        return (OK, "program")

    def nvrtcCompileProgram(self, program: str, count: int,
                            options: list[bytes]) -> tuple[str]:
        assert count == len(options)
        self.options = list(options)
        if isinstance(self.fail, str):
            return (self.fail,)
        return (FAILED if self.fail else OK,)

    def nvrtcGetProgramLogSize(self, program: str) -> tuple[str, int]:
        return (OK, len(self.log) + 1)

    def nvrtcGetProgramLog(self, program: str, buffer: bytes) -> tuple[str]:
        self._fill(buffer, self.log + b"\x00")
        return (OK,)

    def nvrtcGetCUBINSize(self, program: str) -> tuple[str, int]:
        return (OK, len(CUBIN))

    def nvrtcGetCUBIN(self, program: str, buffer: bytes) -> tuple[str]:
        self._fill(buffer, CUBIN)
        return (OK,)

    def nvrtcDestroyProgram(self, program: str) -> tuple[str]:
        self.destroyed += 1
        return (OK,)


CUBIN = b"\x7fELF" + bytes(range(200))


def test_compile_cubin_drives_nvrtc(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvrtc(log=b"")
    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: fake)
    assert compile_cubin("k", "source text", ("-O3", "-DX=1"), "sm_90") == CUBIN
    assert fake.created == [(b"source text", b"k.cu")]
    assert fake.options == [b"--gpu-architecture=sm_90", b"-O3", b"-DX=1"]
    assert fake.destroyed == 1
    assert _nvrtc.nvrtc_version() == "13.0"


def test_compile_failure_raises_with_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvrtc(fail=True)
    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: fake)
    with pytest.raises(KernelError) as info:
        compile_cubin("k", "bad source", (), "sm_80")
    assert info.value.log == LOG.decode().rstrip("\n")
    assert "NVRTC_ERROR_COMPILATION" in info.value.message
    assert fake.destroyed == 1  # the program is destroyed on failure too


def test_an_invalid_option_gets_an_option_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvrtc(fail=BAD_OPTION, log=b"nvrtc: error: unrecognized option -O3 found")
    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: fake)
    with pytest.raises(KernelError) as info:
        compile_cubin("k", "source", ("-O3",), "sm_90")
    assert "-O3" in info.value.hint and "extern" not in info.value.hint


# ---------------------------------------------------------------------------- the cuda-core backend


class FakeKernel:
    attributes = SimpleNamespace(max_threads_per_block=768, num_regs=18, shared_size_bytes=64,
                                 local_size_bytes=0)
    num_arguments = 3
    # ParamInfo as a named tuple or a plain (offset, size) pair: both are read.
    arguments_info: ClassVar[list[Any]] = [SimpleNamespace(offset=0, size=8), (8, 8),
                                           SimpleNamespace(offset=16, size=4)]
    occupancy = SimpleNamespace(
        max_potential_block_size=lambda shared, limit: SimpleNamespace(min_grid_size=264,
                                                                       max_block_size=640),
        max_active_blocks_per_multiprocessor=lambda block, shared: 3)

    def __init__(self) -> None:
        self.handle = FakeDriver.CUkernel()


class FakeObjectCode:
    loaded: ClassVar[list[tuple[bytes, str]]] = []

    def __init__(self, binary: bytes) -> None:
        self.binary = binary

    @classmethod
    def from_cubin(cls, binary: bytes, *, name: str = "") -> FakeObjectCode:
        cls.loaded.append((binary, name))
        return cls(binary)

    def get_kernel(self, name: str) -> FakeKernel:
        if name == "missing":
            raise RuntimeError("CUDA_ERROR_NOT_FOUND: named symbol not found")
        return FakeKernel()


class FakeDevice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.current = 0
        self.streams: list[int] = []

    def set_current(self) -> None:
        self.current += 1

    def create_stream(self, obj: Any) -> tuple[str, int]:
        version, handle = obj.__cuda_stream__()
        assert version == 0
        self.streams.append(handle)
        return ("stream", handle)


class FakeDriver:
    class CUkernel:
        pass

    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8)
    CUresult = SimpleNamespace(CUDA_SUCCESS="CUDA_SUCCESS")
    calls: ClassVar[list[tuple[Any, ...]]] = []

    @staticmethod
    def CUdevice(index: int) -> tuple[str, int]:
        return ("dev", index)

    @classmethod
    def cuKernelSetAttribute(cls, attribute: int, value: int, kernel: Any,
                             device: Any) -> tuple[str]:
        cls.calls.append((attribute, value, device))
        return ("CUDA_SUCCESS",)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    launches: list[tuple[Any, ...]] = []
    core = SimpleNamespace(
        Device=FakeDevice, ObjectCode=FakeObjectCode, legacy_default_stream="LEGACY",
        LaunchConfig=lambda **kwargs: ("config", tuple(sorted(kwargs.items()))),
        launch=lambda *args: launches.append(args), name="fake")
    monkeypatch.setattr(_nvrtc, "_cuda_core", core)
    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: FakeNvrtc())
    monkeypatch.setattr(_nvrtc, "_driver", lambda: FakeDriver)
    monkeypatch.setitem(launch_module._LIMITS_CACHE, 0, LIMITS)
    FakeDriver.calls = []
    backend = _nvrtc.CudaCoreBackend(0)
    backend.test_launches = launches
    return backend


def test_backend_identity(backend: Any) -> None:
    assert backend.device == torch.device("cuda", 0)
    assert (backend.arch, backend.compiler) == ("sm_90", "nvrtc-13.0")
    assert backend._cuda_device.current == 1  # the primary context made current once


def test_backend_loads_and_describes_kernels(backend: Any) -> None:
    kernel = backend.load("scale", CUBIN)
    assert FakeObjectCode.loaded[-1] == (CUBIN, "scale")
    info = backend.kernel_info(kernel)
    assert info == _nvrtc.KernelInfo(num_arguments=3, argument_sizes=(8, 8, 4),
                                     max_threads_per_block=768, num_regs=18,
                                     static_shared_bytes=64, local_bytes=0)
    assert backend.max_potential_block_size(kernel, 0) == 640
    assert backend.max_active_blocks(kernel, 256, 0) == 3
    with pytest.raises(KernelError, match="extern"):
        backend.load("missing", CUBIN)


def test_backend_launch_converts_arguments_and_caches(backend: Any) -> None:
    kernel = backend.load("scale", CUBIN)
    config = LaunchConfig(4, 128)
    side = SimpleNamespace(cuda_stream=0xABC)
    args = [("ptr", 2**40 + 16), ("int32", -5), ("float32", 1.5), ("int64", 2**40),
            ("float16", 0.5), ("bool", True)]
    backend.launch(kernel, config, args, side)
    backend.launch(kernel, config, args, side)
    backend.launch(kernel, config, args, SimpleNamespace(cuda_stream=0))
    first, _, third = backend.test_launches
    stream, core_config, launched, *values = first
    assert stream == ("stream", 0xABC) and launched is kernel
    assert core_config == ("config", (("block", (128, 1, 1)), ("grid", (4, 1, 1)),
                                      ("shmem_size", 0)))
    assert [type(v) for v in values] == [np.uint64, np.int32, np.float32, np.int64,
                                         np.float16, np.bool_]
    assert [v.item() for v in values] == [2**40 + 16, -5, 1.5, 2**40, 0.5, True]
    assert backend._cuda_device.streams == [0xABC]  # the wrapper is created once per stream
    assert third[0] == "LEGACY"  # torch's default stream (handle 0)
    assert FakeDriver.calls == []  # <= 48 KiB: no opt-in


def test_backend_opts_in_to_large_dynamic_shared_memory(backend: Any) -> None:
    kernel = backend.load("scale", CUBIN)
    stream = SimpleNamespace(cuda_stream=1)
    for shared in (64 * 1024, 64 * 1024, 32 * 1024, 96 * 1024):
        backend.launch(kernel, LaunchConfig(1, 32, shared_mem=shared), [], stream)
    assert FakeDriver.calls == [(8, 64 * 1024, ("dev", 0)), (8, 96 * 1024, ("dev", 0))]
