"""KernelManager on a CUDA GPU (needs the kernels extra: cuda-core + cuda-bindings + NVRTC).

The seed's kernels (``relu_kernel``, ``custom_op``) on odd sizes against torch, compile errors
with the compiler log, argument checks, the disk cache across processes, ordering with torch
work on the current stream without host syncs, occupancy-based launch sizes, > 48 KiB dynamic
shared memory, a tiled matmul sized by calculate_optimal_launch_params, and event timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._child import run_child
from vramkit.devices.cuda_errors import CudaErrorKind, explain_cuda_error
from vramkit.errors import ConfigError, DeviceMismatchError, KernelError
from vramkit.kernels.batch import batch_matmul
from vramkit.kernels.examples import RELU_SOURCE, TILED_MATMUL_SOURCE
from vramkit.kernels.launch import LaunchConfig, calculate_optimal_launch_params, device_limits
from vramkit.kernels.manager import KernelManager, _reset_managers, int64, is_available
from vramkit.kernels.stats import memory_stats, performance_stats

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)
# torch.cuda._sleep spins this many GPU cycles (~0.5 s on an H200): the host checks below run
# while the stream is still busy.
SLEEP_CYCLES = 1_000_000_000
ODD_SIZES = [1, 7, 1023, 1025, 65_537, 1_000_003]

CUSTOM_OP = r"""
extern "C" __global__ void custom_op(float* output, const float* input, int n) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) {
        output[idx] = input[idx] * 2.0f;
    }
}
"""
SCALED = r"""
extern "C" __global__ void scaled(float* output, const float* input, int n) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) { output[idx] = input[idx] * SCALE; }
}
"""
BOUNDED = r"""
extern "C" __global__ void __launch_bounds__(128) bounded(float* data, int n) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) { data[idx] += 1.0f; }
}
"""
REVERSE_SEGMENTS = r"""
extern "C" __global__ void reverse_segments(float* out, const float* in, int n, int seg) {
    extern __shared__ float buf[];
    int base = blockIdx.x * seg;
    for (int i = threadIdx.x; i < seg; i += blockDim.x) {
        int g = base + i;
        buf[i] = g < n ? in[g] : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < seg; i += blockDim.x) {
        int g = base + i;
        if (g < n) { out[g] = buf[seg - 1 - i]; }
    }
}
"""


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelManager]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VRAMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        _reset_managers()
        yield KernelManager.get(DEVICE)
        _reset_managers()


def test_available_and_one_manager_per_device(manager: KernelManager) -> None:
    assert is_available()
    assert KernelManager.get(0) is manager
    assert KernelManager.get("cuda:0") is manager
    assert manager.limits.arch == f"sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}"


@pytest.mark.parametrize("n", ODD_SIZES)
def test_relu_kernel_on_odd_sizes(manager: KernelManager, n: int) -> None:
    manager.ensure_kernel("relu_kernel", RELU_SOURCE)
    data = torch.randn(n, device=DEVICE)
    expected = torch.relu(data)
    manager.launch("relu_kernel", LaunchConfig.for_elements(n, DEVICE), data, n)
    assert torch.equal(data, expected)


@pytest.mark.parametrize("n", ODD_SIZES)
def test_custom_op_on_odd_sizes_with_an_occupancy_config(manager: KernelManager, n: int) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    source = torch.randn(n, device=DEVICE)
    output = torch.full_like(source, float("nan"))
    config = LaunchConfig.for_elements(n, DEVICE, kernel)
    kernel.launch(config, output, source, n)
    assert torch.equal(output, source * 2.0)


def test_occupancy_api_drives_for_elements(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    suggested = kernel.max_potential_block_size()
    assert suggested is not None and 32 <= suggested <= 1024 and suggested % 32 == 0
    assert kernel.max_active_blocks_per_multiprocessor(256) >= 1
    config = LaunchConfig.for_elements(10_000_000, DEVICE, kernel)
    block = config.block[0]
    suggested = min(suggested, kernel.max_threads_per_block)
    # The smallest block from 256 up with the suggested block's occupancy (resident threads).
    assert 256 <= block <= suggested
    assert (kernel.max_active_blocks_per_multiprocessor(block) * block
            >= kernel.max_active_blocks_per_multiprocessor(suggested) * suggested)
    if block > 256:
        smaller = block // 2
        assert (kernel.max_active_blocks_per_multiprocessor(smaller) * smaller
                < kernel.max_active_blocks_per_multiprocessor(suggested) * suggested)


def test_parameter_info_is_reported(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    assert kernel.num_arguments == 3
    assert kernel.info.argument_sizes == (8, 8, 4)
    assert kernel.num_regs > 0


def test_compile_options_are_used(manager: KernelManager) -> None:
    source = torch.arange(100, dtype=torch.float32, device=DEVICE)
    output = torch.empty_like(source)
    kernel = manager.ensure_kernel("scaled", SCALED, options=("-DSCALE=3.0f", "--use_fast_math"))
    kernel.launch(LaunchConfig.for_elements(100, DEVICE), output, source, 100)
    assert torch.equal(output, source * 3)
    kernel = manager.ensure_kernel("scaled", SCALED, options=("-DSCALE=-1.0f",))
    kernel.launch(LaunchConfig.for_elements(100, DEVICE), output, source, 100)
    assert torch.equal(output, -source)


def test_compile_error_carries_the_log(manager: KernelManager) -> None:
    broken = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }'
    with pytest.raises(KernelError) as info:
        manager.ensure_kernel("broken", broken, disk_cache=False)
    assert info.value.log is not None and "undefined_name" in info.value.log
    assert "undefined_name" in str(info.value)


def test_a_mangled_or_missing_name_is_a_kernel_error(manager: KernelManager) -> None:
    mangled = "__global__ void not_extern_c(float* x) { x[0] = 1.0f; }"
    with pytest.raises(KernelError, match="extern"):
        manager.ensure_kernel("not_extern_c", mangled, disk_cache=False)


def test_wrong_argument_count_and_size(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    output, source = torch.empty(10, device=DEVICE), torch.ones(10, device=DEVICE)
    config = LaunchConfig.for_elements(10, DEVICE)
    with pytest.raises(KernelError, match="takes 3 arguments, got 2"):
        kernel.launch(config, output, source)
    with pytest.raises(KernelError, match="argument 2 is 4 bytes"):
        kernel.launch(config, output, source, int64(10))


def test_device_mismatch(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    with pytest.raises(DeviceMismatchError):
        kernel.launch(LaunchConfig(1, 32), torch.empty(10, device=DEVICE), torch.ones(10), 10)


def test_launch_bounds_limit_the_block(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("bounded", BOUNDED)
    assert kernel.max_threads_per_block == 128
    data = torch.zeros(1000, device=DEVICE)
    with pytest.raises(ConfigError, match=r"register|kernel"):
        kernel.launch(LaunchConfig(4, 256), data, 1000)
    config = LaunchConfig.for_elements(1000, DEVICE, kernel)
    assert config.threads_per_block <= 128
    kernel.launch(config, data, 1000)
    assert torch.equal(data, torch.ones_like(data))


def test_dynamic_shared_memory_above_48_kib(manager: KernelManager) -> None:
    limits = device_limits(DEVICE)
    segment = 16384  # 64 KiB of floats per block
    if limits.max_shared_memory_per_block_optin < segment * 4:
        pytest.skip("device has less than 64 KiB of shared memory per block")
    kernel = manager.ensure_kernel("reverse_segments", REVERSE_SEGMENTS)
    n = 100_003
    source = torch.randn(n, device=DEVICE)
    output = torch.empty_like(source)
    blocks = -(-n // segment)
    kernel.launch(LaunchConfig(blocks, 256, shared_mem=segment * 4), output, source, n, segment)
    padded = torch.zeros(blocks * segment, device=DEVICE)
    padded[:n] = source
    expected = padded.view(blocks, segment).flip(1).reshape(-1)[:n]
    assert torch.equal(output, expected)


@pytest.mark.parametrize("m, n, k, tiles", [
    (100, 77, 53, {}), (1, 1, 1, {}), (513, 1031, 67, {}), (64, 300, 129, {"tile_m": 8,
                                                                            "tile_n": 64}),
    (257, 129, 33, {"tile_m": 16, "tile_n": 16, "tile_k": 8}),
])
def test_tiled_matmul_with_calculated_launch(manager: KernelManager, m: int, n: int, k: int,
                                             tiles: dict[str, int]) -> None:
    kernel = manager.ensure_kernel("tiled_matmul", TILED_MATMUL_SOURCE)
    a = torch.randn(m, k, device=DEVICE)
    b = torch.randn(k, n, device=DEVICE)
    c = torch.full((m, n), float("nan"), device=DEVICE)
    config = calculate_optimal_launch_params(m, n, k, DEVICE, kernel=kernel, **tiles)
    tile_n, tile_m, _ = config.block  # type: ignore[misc]
    depth = config.shared_mem // ((tile_m + tile_n) * 4)
    kernel.launch(config, a, b, c, m, n, k, depth)
    expected = (a.double() @ b.double()).float()
    torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-4 * k)


def test_launch_orders_with_torch_work_on_the_current_stream(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    n = 1 << 20
    config = LaunchConfig.for_elements(n, DEVICE, kernel)
    source = torch.randn(n, device=DEVICE)
    staged = torch.zeros(n, device=DEVICE)
    output = torch.empty_like(source)
    result = torch.empty_like(source)
    kernel.launch(config, output, source, n)  # loads the module before the timing-free checks
    side = torch.cuda.Stream(DEVICE)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        torch.mul(source, 3, out=staged)  # preallocated outputs: no allocator calls here
        kernel.launch(config, output, staged, n)  # on `side`: after the multiply
        torch.add(output, 1, out=result)  # after the kernel
        still_busy = not side.query()
    side.synchronize()
    assert still_busy, "the launch waited for the GPU"
    torch.testing.assert_close(result, source * 6 + 1)


@pytest.mark.parametrize("as_handle", [False, True])
def test_explicit_stream_argument(manager: KernelManager, as_handle: bool) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    n = 1 << 16
    config = LaunchConfig.for_elements(n, DEVICE, kernel)
    source = torch.randn(n, device=DEVICE)
    staged = torch.zeros(n, device=DEVICE)
    output = torch.zeros(n, device=DEVICE)
    side = torch.cuda.Stream(DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        staged.copy_(source * 5)
    # The current stream is the default one; the kernel must still run after the copy.
    kernel.launch(config, output, staged, n, stream=side.cuda_stream if as_handle else side)
    side.synchronize()
    assert torch.equal(output, source * 10)


def test_the_disk_cache_is_reused_by_a_second_process(tmp_path: Path) -> None:
    code = f"""
        import json, torch
        from vramkit.kernels.launch import LaunchConfig
        from vramkit.kernels.manager import KernelManager
        manager = KernelManager.get(0)
        kernel = manager.ensure_kernel("custom_op", {CUSTOM_OP!r})
        x = torch.arange(1000, dtype=torch.float32, device="cuda")
        out = torch.empty_like(x)
        kernel.launch(LaunchConfig.for_elements(1000, 0, kernel), out, x, 1000)
        stats = manager.cache_stats()
        print(json.dumps({{"compiles": stats.compiles, "disk_hits": stats.disk_hits,
                          "ok": bool(torch.equal(out, x * 2))}}))
    """
    env = {"VRAMKIT_CACHE_DIR": str(tmp_path)}
    first = run_child(code, env=env)
    second = run_child(code, env=env)
    assert first == {"compiles": 1, "disk_hits": 0, "ok": True}
    assert second == {"compiles": 0, "disk_hits": 1, "ok": True}
    assert len(list((tmp_path / "kernels").glob("*.cubin"))) == 1


def test_launches_are_counted_and_timed(manager: KernelManager) -> None:
    kernel = manager.ensure_kernel("custom_op", CUSTOM_OP)
    n = 1 << 24
    source = torch.randn(n, device=DEVICE)
    output = torch.empty_like(source)
    config = LaunchConfig.for_elements(n, DEVICE, kernel)
    stats = performance_stats()
    stats.reset()
    kernel.launch(config, output, source, n)
    assert stats.snapshot(DEVICE).kernel_launches == 1
    assert stats.snapshot(DEVICE).timed_launches == 0
    stats.enable_timing()
    try:
        for _ in range(5):
            kernel.launch(config, output, source, n)
        snap = stats.snapshot(DEVICE)
    finally:
        stats.enable_timing(False)
        stats.reset()
    assert (snap.kernel_launches, snap.timed_launches, snap.pending_timings) == (6, 5, 0)
    # 128 MiB read + written per launch: well above a microsecond, far below a second.
    assert 0.001 < snap.mean_kernel_time_ms < 1000  # type: ignore[operator]


def test_memory_stats_are_measured() -> None:
    torch.cuda.empty_cache()
    free_before, total = memory_stats(DEVICE)
    assert abs(total - torch.cuda.get_device_properties(0).total_memory) < 0.01 * total
    block = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    free_after, _ = memory_stats(DEVICE)
    assert free_before - free_after >= 0.9 * (1 << 30)
    del block
    torch.cuda.empty_cache()


def test_a_real_out_of_memory_is_explained() -> None:
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(1 << 50, dtype=torch.uint8, device=DEVICE)
    assert explain_cuda_error(info.value).kind is CudaErrorKind.OUT_OF_MEMORY


def test_batch_matmul_on_the_gpu() -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    pairs = [(torch.randn(64, 32, device=DEVICE, dtype=torch.float64, generator=generator),
              torch.randn(32, 16, device=DEVICE, dtype=torch.float64, generator=generator))
             for _ in range(10)]
    pairs.append((torch.randn(3, 5, device=DEVICE, dtype=torch.float64),
                  torch.randn(5, 2, device=DEVICE, dtype=torch.float64)))
    for (a, b), result in zip(pairs, batch_matmul(pairs), strict=True):
        torch.testing.assert_close(result, a @ b)
