"""LaunchConfig validation, device limits, for_elements and calculate_optimal_launch_params."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramkit.errors import ConfigError, DeviceError
from vramkit.kernels import launch as launch_module
from vramkit.kernels.launch import (
    DeviceLimits,
    LaunchConfig,
    OccupancyQuery,
    calculate_optimal_launch_params,
    device_limits,
    occupancy_fraction,
)

H200 = DeviceLimits(
    name="fake H200", compute_capability=(9, 0), multiprocessor_count=132,
    max_threads_per_multiprocessor=2048, max_blocks_per_multiprocessor=32,
    max_shared_memory_per_block=48 * 1024, max_shared_memory_per_block_optin=227 * 1024,
    max_shared_memory_per_multiprocessor=228 * 1024)
SMALL_OLD = DeviceLimits(
    name="fake sm_52", compute_capability=(5, 2), multiprocessor_count=4,
    max_threads_per_multiprocessor=2048, max_blocks_per_multiprocessor=32,
    max_shared_memory_per_block=48 * 1024, max_shared_memory_per_block_optin=48 * 1024,
    max_shared_memory_per_multiprocessor=96 * 1024)


class FakeKernel:
    """A compiled kernel's occupancy answers, chosen by the test."""

    def __init__(self, block: int | None = 512, max_threads: int = 1024,
                 resident: dict[int, int] | None = None) -> None:
        self.block = block
        self._max_threads = max_threads
        self.resident = resident or {}
        self.queries: list[tuple[int, int]] = []

    @property
    def max_threads_per_block(self) -> int:
        return self._max_threads

    def max_potential_block_size(self, shared_mem: int = 0) -> int | None:
        self.queries.append((-1, shared_mem))
        return self.block

    def max_active_blocks_per_multiprocessor(self, block_size: int,
                                             shared_mem: int = 0) -> int | None:
        self.queries.append((block_size, shared_mem))
        return self.resident.get(block_size)


def test_fake_kernel_satisfies_the_protocol() -> None:
    assert isinstance(FakeKernel(), OccupancyQuery)


# ---------------------------------------------------------------------------- LaunchConfig


def test_dimensions_are_normalized_to_three_tuples() -> None:
    config = LaunchConfig(4, (16, 8), shared_mem=128)
    assert config.grid == (4, 1, 1)
    assert config.block == (16, 8, 1)
    assert config.threads_per_block == 128
    assert config.num_blocks == 4
    assert config.to_dict() == {"grid": (4, 1, 1), "block": (16, 8, 1), "shared_mem": 128}


def test_config_is_frozen_and_hashable() -> None:
    config = LaunchConfig(2, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.grid = (3, 1, 1)  # type: ignore[misc]
    assert config == LaunchConfig((2, 1, 1), (32, 1, 1))
    assert len({config, LaunchConfig((2,), (32,))}) == 1


@pytest.mark.parametrize("grid, block, shared", [
    (0, 32, 0), (1, 0, 0), (-1, 32, 0), (1, (32, 2, 2, 1), 0), (1, (), 0), (1.5, 32, 0),
    (True, 32, 0), ("4", 32, 0), (1, 32, -1), (1, 32, 1.0), (1, 2048, 0), (1, (32, 32, 2), 0),
    (1, (1, 1, 65), 0), (1, (1, 1025, 1), 0), ((1, 65536), 32, 0), ((1, 1, 70000), 32, 0),
    (2**31, 32, 0), (1, 32, 300 * 1024),
])
def test_architectural_limits_are_enforced(grid: object, block: object, shared: object) -> None:
    with pytest.raises(ConfigError):
        LaunchConfig(grid, block, shared)  # type: ignore[arg-type]


def test_the_largest_legal_config_is_accepted() -> None:
    config = LaunchConfig((2**31 - 1, 65535, 65535), (1024, 1, 1), 227 * 1024)
    assert config.validate(H200) is config


def test_validate_checks_the_device_shared_memory() -> None:
    config = LaunchConfig(1, 32, shared_mem=100 * 1024)
    config.validate(H200)
    with pytest.raises(ConfigError, match="fake sm_52"):
        config.validate(SMALL_OLD)


def test_validate_checks_the_kernel_register_limit() -> None:
    config = LaunchConfig(1, 512)
    config.validate(H200, FakeKernel(max_threads=1024))
    with pytest.raises(ConfigError, match="register"):
        config.validate(H200, FakeKernel(max_threads=256))


def test_validate_checks_a_smaller_device_grid() -> None:
    tiny = dataclasses.replace(H200, max_grid_dims=(100, 10, 10))
    LaunchConfig(100, 32).validate(tiny)
    with pytest.raises(ConfigError, match="grid"):
        LaunchConfig(101, 32).validate(tiny)


# ---------------------------------------------------------------------------- device limits


def test_device_limits_returns_given_limits_and_arch() -> None:
    assert device_limits(H200) is H200
    assert H200.arch == "sm_90"


def test_device_limits_without_cuda_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vramkit.devices._runtime.is_cuda_available", lambda: False)
    monkeypatch.setattr(launch_module, "_LIMITS_CACHE", {})
    with pytest.raises(DeviceError):
        device_limits(0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_devices_are_refused(device: str) -> None:
    with pytest.raises(DeviceError):
        device_limits(device)


def test_device_limits_read_from_torch_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        name = "Fake GPU"
        major, minor = 8, 6
        multi_processor_count = 10
        max_threads_per_multi_processor = 1536
        shared_memory_per_block = 48 * 1024
        shared_memory_per_block_optin = 99 * 1024
        shared_memory_per_multiprocessor = 100 * 1024
        regs_per_multiprocessor = 65536
        warp_size = 32

    import torch

    monkeypatch.setattr("vramkit.devices._runtime.is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(launch_module, "_LIMITS_CACHE", {})
    limits = device_limits("cuda:1")
    assert limits.arch == "sm_86"
    assert limits.max_blocks_per_multiprocessor == 16  # from the compute-capability table
    assert limits.max_shared_memory_per_block_optin == 99 * 1024
    assert limits.max_threads_per_multiprocessor == 1536
    with pytest.raises(DeviceError, match="does not exist"):
        device_limits(5)


# ---------------------------------------------------------------------------- for_elements


def test_for_elements_uses_the_compute_capability_default() -> None:
    assert LaunchConfig.for_elements(10_000, H200).block == (256, 1, 1)
    assert LaunchConfig.for_elements(10_000, SMALL_OLD).block == (128, 1, 1)


def test_for_elements_uses_the_kernel_occupancy_api() -> None:
    # Registers cap occupancy: only the suggested 640 reaches 1920 resident threads per SM.
    kernel = FakeKernel(block=640, resident={640: 3, 256: 4, 512: 2})
    config = LaunchConfig.for_elements(100_000, H200, kernel, shared_mem=1024)
    assert config.block == (640, 1, 1)
    assert config.grid == (157, 1, 1)
    assert config.shared_mem == 1024
    assert (-1, 1024) in kernel.queries


def test_for_elements_prefers_the_smallest_block_at_full_occupancy() -> None:
    # The API suggests the largest block with the best occupancy; 256 threads reach the same.
    kernel = FakeKernel(block=1024, resident={1024: 2, 512: 4, 256: 8})
    assert LaunchConfig.for_elements(1 << 24, H200, kernel).block == (256, 1, 1)
    # ...unless the smaller blocks lose occupancy (say, a per-block shared-memory cost).
    kernel = FakeKernel(block=1024, resident={1024: 2, 512: 2, 256: 2})
    assert LaunchConfig.for_elements(1 << 24, H200, kernel).block == (1024, 1, 1)


def test_for_elements_without_occupancy_answer_falls_back() -> None:
    assert LaunchConfig.for_elements(100_000, H200, FakeKernel(block=None)).block == (256, 1, 1)


def test_for_elements_respects_the_kernel_thread_limit() -> None:
    kernel = FakeKernel(block=1024, max_threads=384, resident={384: 5, 256: 6})
    assert LaunchConfig.for_elements(100_000, H200, kernel).block == (384, 1, 1)


def test_for_elements_shrinks_the_block_for_tiny_problems() -> None:
    assert LaunchConfig.for_elements(1, H200) == LaunchConfig(1, 32)
    assert LaunchConfig.for_elements(33, H200) == LaunchConfig(1, 64)


@pytest.mark.parametrize("n", [0, -5, 2.0, True])
def test_for_elements_rejects_bad_counts(n: object) -> None:
    with pytest.raises(ConfigError):
        LaunchConfig.for_elements(n, H200)  # type: ignore[arg-type]


def test_for_elements_too_many_elements_for_the_grid() -> None:
    with pytest.raises(ConfigError, match="grid-stride"):
        LaunchConfig.for_elements((2**31) * 1024, H200, FakeKernel(block=1024))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=2**35),
       block=st.sampled_from([None, 32, 96, 128, 256, 640, 1024]))
def test_for_elements_covers_every_element_exactly(n: int, block: int | None) -> None:
    kernel = FakeKernel(block=block) if block is not None else None
    config = LaunchConfig.for_elements(n, H200, kernel)
    threads = config.block[0]  # type: ignore[index]
    assert config.block[1:] == (1, 1) and config.grid[1:] == (1, 1)  # type: ignore[index]
    assert threads % 32 == 0
    assert config.grid[0] * threads >= n  # type: ignore[index]
    assert (config.grid[0] - 1) * threads < n  # type: ignore[index]


# ---------------------------------------------------------------------------- matmul tiles


def test_large_problem_gets_the_largest_full_occupancy_tile() -> None:
    config = calculate_optimal_launch_params(4096, 4096, 4096, H200)
    assert config.block == (32, 32, 1)
    assert config.grid == (128, 128, 1)
    assert config.shared_mem == (32 + 32) * 32 * 4


def test_large_tiles_once_every_sm_has_a_block() -> None:
    # 512 x 512: 32-tiles give 256 blocks, enough for the 132 SMs (measured fastest).
    config = calculate_optimal_launch_params(512, 512, 512, H200)
    assert config.block == (32, 32, 1)
    assert config.num_blocks >= H200.multiprocessor_count
    # A tiny problem cannot cover the SMs: the tile reaching the most SMs wins.
    assert calculate_optimal_launch_params(40, 40, 40, H200).block == (8, 8, 1)


def test_min_blocks_per_sm_changes_the_choice() -> None:
    # 32-byte elements: a 32x32x32 tile stages 64 KiB, room for 3 resident blocks on a
    # 228 KiB SM, fewer than 4: the 16x16 tile (16 KiB) wins unless 1 block per SM is enough.
    assert calculate_optimal_launch_params(4096, 4096, 4096, H200,
                                           element_size=32).block == (16, 16, 1)
    assert calculate_optimal_launch_params(4096, 4096, 4096, H200, element_size=32,
                                           min_blocks_per_sm=1).block == (32, 32, 1)


def test_kernel_occupancy_changes_the_choice() -> None:
    # Registers allow one 1024-thread block per SM (50% occupancy) but full occupancy at 256.
    kernel = FakeKernel(resident={1024: 1, 256: 8, 64: 32})
    config = calculate_optimal_launch_params(4096, 4096, 4096, H200, kernel=kernel)
    assert config.block == (16, 16, 1)
    assert (1024, (32 + 32) * 32 * 4) in kernel.queries


def test_explicit_rectangular_tile_and_element_size() -> None:
    config = calculate_optimal_launch_params(1000, 3000, 64, H200, tile_m=8, tile_n=64,
                                             tile_k=16, element_size=2)
    assert config.block == (64, 8, 1)
    assert config.grid == (47, 125, 1)
    assert config.shared_mem == (8 + 64) * 16 * 2


def test_one_tile_side_makes_a_square_tile() -> None:
    assert calculate_optimal_launch_params(64, 64, 64, H200, tile_n=16).block == (16, 16, 1)


def test_tile_depth_is_clamped_to_k() -> None:
    deep = calculate_optimal_launch_params(4096, 4096, 4096, H200)
    shallow = calculate_optimal_launch_params(4096, 4096, 8, H200)
    assert shallow.shared_mem == (32 + 32) * 8 * 4 < deep.shared_mem


def test_a_tile_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ConfigError, match="threads"):
        calculate_optimal_launch_params(64, 64, 64, H200, tile_m=64, tile_n=64)
    with pytest.raises(ConfigError, match="shared"):
        calculate_optimal_launch_params(64, 64, 4096, SMALL_OLD, tile_m=32, tile_n=32,
                                        tile_k=512)


def test_grid_y_limit_rejects_too_many_tile_rows() -> None:
    with pytest.raises(ConfigError, match="grid"):
        calculate_optimal_launch_params(65536 * 8 + 8, 8, 8, H200, tile_m=8, tile_n=8)


@pytest.mark.parametrize("kwargs", [
    {"m": 0}, {"n": -1}, {"k": 0}, {"element_size": 0}, {"tile_m": 0}, {"tile_k": 1.5},
    {"min_blocks_per_sm": 0}, {"m": True},
])
def test_bad_matmul_sizes_are_config_errors(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"m": 64, "n": 64, "k": 64}
    args.update(kwargs)
    with pytest.raises(ConfigError):
        calculate_optimal_launch_params(device=H200, **args)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 5000))
def test_matmul_grid_covers_the_output(m: int, n: int, k: int) -> None:
    config = calculate_optimal_launch_params(m, n, k, H200)
    bx, by, _ = config.block  # type: ignore[misc]
    gx, gy, _ = config.grid  # type: ignore[misc]
    assert gx * bx >= n and (gx - 1) * bx < n
    assert gy * by >= m and (gy - 1) * by < m
    assert config.shared_mem <= H200.max_shared_memory_per_block_optin


def test_occupancy_fraction() -> None:
    assert occupancy_fraction(LaunchConfig(1, 1024), H200) == 1.0
    assert occupancy_fraction(LaunchConfig(1, 1024), H200, FakeKernel(resident={1024: 1})) == 0.5
    # 100 KiB per block: two blocks fit in 228 KiB, 64 threads each.
    assert occupancy_fraction(LaunchConfig(1, 64, 100 * 1024), H200) == pytest.approx(128 / 2048)
