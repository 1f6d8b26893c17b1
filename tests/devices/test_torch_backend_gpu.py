"""GPU tests of torch_backend (streams, idleness, async transfers) and env (allocator settings).

Run on a CUDA machine: ``PYTHONPATH=src python -m pytest tests/devices/test_torch_backend_gpu.py
-q -m gpu``. Asynchrony is checked with CUDA events and ``stream.query()``, never with timings:
each test first parks the GPU in ``torch.cuda._sleep`` (a kernel that spins for a number of clock
cycles, about a second here) so that work queued behind it is certainly still pending.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._child import run_child
from vramkit.devices.env import (
    ALLOC_CONF_VAR,
    LEGACY_ALLOC_CONF_VAR,
    clear_cuda_cache,
    get_gpu_memory_info,
)
from vramkit.devices.torch_backend import (
    Device,
    can_access_peer,
    distribute_batch,
    enable_peer_access,
    to_device,
)
from vramkit.errors import DeviceError

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SPIN_CYCLES = 2_000_000_000  # ~1 s at H200 clocks; far longer than any host-side step below


def occupy_current_stream() -> torch.cuda.Event:
    """Queue a long GPU spin on the current stream; return an event recorded right after it."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SPIN_CYCLES)
    else:  # pragma: no cover - every torch with CUDA has had _sleep; keep a fallback anyway
        a = torch.randn(8192, 8192, device="cuda")
        for _ in range(40):
            a = torch.mm(a, a).clamp_(-1, 1)
    done = torch.cuda.Event()
    done.record()
    return done


@pytest.fixture(autouse=True)
def quiet_gpu() -> Any:
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()


# -- streams --------------------------------------------------------------------------------------

def test_new_stream_is_idle_and_synchronize() -> None:
    gpu = Device.cuda(0)
    stream = gpu.new_stream()
    assert stream.device == torch.device("cuda", 0)
    assert gpu.is_idle()
    with gpu.stream(stream) as active:
        assert active is stream
        assert torch.cuda.current_stream() == stream
        occupy_current_stream()
    assert torch.cuda.current_stream() != stream  # the context restored the previous stream
    assert not gpu.is_idle()  # no sync happened: the spin is still running on `stream`
    gpu.synchronize()
    assert gpu.is_idle()


def test_is_idle_sees_the_current_stream() -> None:
    gpu = Device.cuda(0)
    occupy_current_stream()
    assert not gpu.is_idle()
    gpu.synchronize()
    assert gpu.is_idle()


def test_stream_priority_is_passed_to_cuda() -> None:
    gpu = Device.cuda(0)
    low, high = gpu.new_stream(priority=0), gpu.new_stream(priority=-1)
    assert low.priority == 0
    assert high.priority < low.priority


def test_validation_and_peer_access_on_gpu() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=f"sees {count} CUDA device"):
        Device.cuda(count).validate()
    assert can_access_peer(0, 0) is True
    assert can_access_peer(0, "cpu") is False


def test_enable_peer_access_with_one_gpu_is_a_clear_error() -> None:
    if torch.cuda.device_count() != 1:
        pytest.skip("this machine has more than one GPU")
    with pytest.raises(DeviceError, match="needs two GPUs; this process sees 1"):
        enable_peer_access(0, 1)


_PEER_CHILD = """
import ctypes, json
import torch
from vramkit.devices.torch_backend import Device, can_access_peer, enable_peer_access
from vramkit.errors import DeviceError

def loaded_cudart():
    # The CUDA runtime torch loaded (same library, so the same runtime state), if dynamic.
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            pass
    return None

def peer_probe(cudart, op):
    # cudaDeviceDisablePeerAccess(1) from device 0 answers 705 (not enabled) without changing
    # anything; cudaDeviceEnablePeerAccess(1, 0) answers 704 once it is enabled. The error is
    # cleared afterwards so that torch does not pick it up.
    previous = ctypes.c_int()
    cudart.cudaGetDevice(ctypes.byref(previous))
    cudart.cudaSetDevice(0)
    try:
        return int(op())
    finally:
        cudart.cudaGetLastError()
        cudart.cudaSetDevice(previous.value)

result = {"can": can_access_peer(0, 1)}
torch.cuda.init()
cudart = loaded_cudart()
result["cudart"] = cudart is not None
if not result["can"]:
    try:
        enable_peer_access(0, 1)
    except DeviceError as err:
        result["refused"] = str(err)
else:
    if cudart is not None:
        result["before"] = peer_probe(cudart, lambda: cudart.cudaDeviceDisablePeerAccess(1))
    enable_peer_access(0, 1)
    if cudart is not None:
        result["after"] = peer_probe(cudart, lambda: cudart.cudaDeviceEnablePeerAccess(1, 0))
    Device.cuda(0).enable_peer_access(Device.cuda(1))  # idempotent
    enable_peer_access(0, 1)
    x = torch.arange(1 << 20, device="cuda:0", dtype=torch.float32)
    y = x.to("cuda:1", non_blocking=True)
    z = (y * 2).to("cuda:0", non_blocking=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    result["copied"] = bool(torch.equal(z, x * 2)) and y.device == torch.device("cuda", 1)
print(json.dumps(result))
"""


def test_enable_peer_access_with_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    # A fresh process: nothing has copied between the GPUs yet (any copy enables peer access
    # for its pair), so the state before the call is known.
    result = run_child(_PEER_CHILD)
    if not result["can"]:
        assert "no peer path" in result["refused"]
        pytest.skip("cuda:0 has no peer path to cuda:1 here (refused as documented)")
    if result["cudart"]:
        assert result["before"] == 705  # cudaErrorPeerAccessNotEnabled
        assert result["after"] == 704  # cudaErrorPeerAccessAlreadyEnabled: it is on now
    assert result["copied"] is True


def test_device_info_describes_the_gpu() -> None:
    info = Device.cuda(0).info
    assert info is not None
    assert info.device_id == 0
    assert info.name and info.total_memory > 0


# -- transfers ------------------------------------------------------------------------------------

def test_pageable_to_cuda_does_not_wait_for_the_stream() -> None:
    gpu = Device.cuda(0)
    source = torch.randn(64 * MiB // 4)
    assert not source.is_pinned()
    to_device(source, gpu)  # warm the pinned and device caches so no first-time allocation runs
    torch.cuda.synchronize()

    spin_done = occupy_current_stream()
    moved, copied = to_device(source, gpu, return_event=True)
    # A pageable cudaMemcpyAsync waits for the stream's earlier work before returning; the pinned
    # staging path must not, so the spin is still running and the copy queued behind it.
    assert not spin_done.query()
    assert not copied.query()
    assert moved.device == torch.device("cuda", 0)
    copied.synchronize()
    torch.testing.assert_close(moved.cpu(), source)


def test_staging_buffers_are_not_reused_in_flight() -> None:
    gpu = Device.cuda(0)
    first, second = torch.full((16 * MiB,), 1.0), torch.full((16 * MiB,), 2.0)
    occupy_current_stream()
    # Both copies wait behind the spin; if the first staging block were recycled for the second
    # copy before its DMA ran, the first result would read 2.0.
    moved_first = to_device(first, gpu)
    moved_second = to_device(second, gpu)
    torch.cuda.synchronize()
    assert torch.equal(moved_first.cpu(), first)
    assert torch.equal(moved_second.cpu(), second)


def test_pinned_source_and_blocking_copies() -> None:
    gpu = Device.cuda(0)
    pinned = torch.arange(1024.0).pin_memory()
    torch.testing.assert_close(to_device(pinned, gpu).cpu(), pinned)
    pageable = torch.arange(1024.0)
    moved, event = to_device(pageable, "cuda:0", non_blocking=False, return_event=True)
    assert event is None
    torch.testing.assert_close(moved.cpu(), pageable)
    on_gpu = torch.ones(4, device="cuda")
    assert to_device(on_gpu, 0) is on_gpu


def test_cuda_to_host_is_pinned_and_event_guarded() -> None:
    source = torch.randn(1024, 1024, device="cuda")
    expected = source.cpu()
    occupy_current_stream()
    host, ready = to_device(source, "cpu", return_event=True)
    assert host.device == torch.device("cpu") and host.is_pinned()
    assert not ready.query()
    ready.synchronize()
    torch.testing.assert_close(host, expected)


def test_to_device_keeps_autograd() -> None:
    leaf = torch.randn(8, requires_grad=True)
    moved = to_device(leaf, "cuda:0")
    (moved * 3).sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full((8,), 3.0))


def test_distribute_batch_to_cuda() -> None:
    batch = {"pixels": torch.randn(10, 3, 8, 8), "labels": [torch.arange(10)]}
    chunks = distribute_batch(batch, ["cuda:0", Device.cuda(0), 0])
    torch.cuda.synchronize()
    assert [c["pixels"].shape[0] for c in chunks] == [4, 3, 3]
    assert all(c["pixels"].device == torch.device("cuda", 0) for c in chunks)
    torch.testing.assert_close(torch.cat([c["pixels"] for c in chunks]).cpu(), batch["pixels"])
    assert torch.cat([c["labels"][0] for c in chunks]).tolist() == list(range(10))


# -- memory read-outs -----------------------------------------------------------------------------

def test_memory_info_matches_torch() -> None:
    block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    info = get_gpu_memory_info(0)
    free, total = torch.cuda.mem_get_info(0)
    assert info.kind == "cuda" and info.device == "cuda:0"
    assert info.total == total
    assert abs(info.free - free) <= 64 * MiB  # nothing else allocates between the two reads
    assert info.used == info.total - info.free
    assert info.allocated is not None and info.allocated >= 256 * MiB
    assert info.reserved is not None and info.reserved >= info.allocated
    assert info.max_allocated is not None and info.max_allocated >= info.allocated
    assert "cuda:0" in str(info)
    del block
    assert clear_cuda_cache(0) >= 256 * MiB
    assert get_gpu_memory_info(0).reserved < info.reserved


# -- allocator settings in a fresh process ----------------------------------------------------------

def run_fresh(script: str) -> dict[str, Any]:
    """Run ``script`` in a new interpreter without inherited allocator variables; parse its JSON."""
    return run_child(script, drop=(ALLOC_CONF_VAR, LEGACY_ALLOC_CONF_VAR),  # type: ignore[no-any-return]
                     timeout=300)


def test_settings_before_cuda_init_take_effect() -> None:
    report = run_fresh("""
        import json
        from vramkit.devices.env import setup_cuda_memory_management, allocator_settings
        setup_cuda_memory_management(expandable_segments=True, garbage_collection_threshold=0.6)
        import torch
        block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        segments = torch.cuda.memory._snapshot()["segments"]
        settings = allocator_settings()
        print(json.dumps({"in_effect": settings["in_effect"], "backend": settings["backend"],
                          "variable": settings["variable"],
                          "expandable_segment_seen": any(s.get("is_expandable", False)
                                                         for s in segments),
                          "tf32": torch.backends.cuda.matmul.allow_tf32}))
    """)
    assert report["in_effect"]["expandable_segments"] is True
    assert report["in_effect"]["garbage_collection_threshold"] == pytest.approx(0.6)
    assert report["backend"] == "native"
    assert report["tf32"] is True


def test_max_split_size_before_cuda_init() -> None:
    report = run_fresh("""
        import json
        from vramkit.devices.env import setup_cuda_memory_management, allocator_settings
        setup_cuda_memory_management(expandable_segments=False, max_split_size_mb=256)
        import torch
        torch.zeros(1, device="cuda")
        print(json.dumps(allocator_settings()["in_effect"]))
    """)
    assert report["expandable_segments"] is False
    assert report["max_split_size"] == 256 * MiB


def test_runtime_change_after_cuda_init_and_too_late_backend() -> None:
    report = run_fresh("""
        import json
        import torch
        torch.zeros(1, device="cuda")
        from vramkit.devices.env import setup_cuda_memory_management
        from vramkit.errors import TooLateError
        before = torch.cuda.memory._snapshot()["allocator_settings"]["expandable_segments"]
        result = setup_cuda_memory_management(expandable_segments=True, allow_tf32=None)
        try:
            setup_cuda_memory_management(backend="cudaMallocAsync", expandable_segments=False,
                                         allow_tf32=None)
            too_late = False
        except TooLateError:
            too_late = True
        print(json.dumps({"before": before, "applied": result["applied_at_runtime"],
                          "after": result["in_effect"]["expandable_segments"],
                          "too_late": too_late}))
    """)
    assert report["before"] is False
    assert report["applied"] is True
    assert report["after"] is True
    assert report["too_late"] is True


def test_backend_before_torch_import() -> None:
    report = run_fresh("""
        import json
        from vramkit.devices.env import setup_cuda_memory_management
        setup_cuda_memory_management(backend="cudaMallocAsync", expandable_segments=False,
                                     allow_tf32=None)
        import torch
        torch.zeros(1, device="cuda")
        print(json.dumps({"backend": torch.cuda.get_allocator_backend()}))
    """)
    assert report["backend"] == "cudaMallocAsync"
