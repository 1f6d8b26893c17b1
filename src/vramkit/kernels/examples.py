"""Example CUDA C sources for :class:`~vramkit.kernels.manager.KernelManager`.

``RELU_SOURCE`` is the seed's element-wise kernel (launch it with
:meth:`LaunchConfig.for_elements <vramkit.kernels.launch.LaunchConfig.for_elements>`);
``TILED_MATMUL_SOURCE`` is the tiled-kernel contract that
:func:`~vramkit.kernels.launch.calculate_optimal_launch_params` assumes: block
``(tile_n, tile_m)`` computes a ``tile_m x tile_n`` tile of ``C = A @ B`` (float32, row-major),
the A (``tile_m x TK``) and B (``TK x tile_n``) tiles are staged in dynamic shared memory, and the
tile depth ``TK`` is the last argument::

    kernel = manager.ensure_kernel("tiled_matmul", TILED_MATMUL_SOURCE)
    config = calculate_optimal_launch_params(m, n, k, device, kernel=kernel)
    tile_n, tile_m, _ = config.block
    depth = config.shared_mem // ((tile_m + tile_n) * 4)  # TK
    kernel.launch(config, a, b, c, m, n, k, depth)

The GPU tests and ``benchmarks/kernels.py`` run these same sources.
"""

from __future__ import annotations

__all__ = ["RELU_SOURCE", "TILED_MATMUL_SOURCE"]

RELU_SOURCE = r"""
extern "C" __global__ void relu_kernel(float* data, int n) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) {
        data[idx] = data[idx] > 0.0f ? data[idx] : 0.0f;
    }
}
"""

TILED_MATMUL_SOURCE = r"""
extern "C" __global__ void tiled_matmul(const float* __restrict__ A, const float* __restrict__ B,
                                        float* __restrict__ C, int M, int N, int K, int TK) {
    extern __shared__ float smem[];
    const int TM = blockDim.y, TN = blockDim.x;
    float* As = smem;
    float* Bs = smem + TM * TK;
    const int row = blockIdx.y * TM + threadIdx.y;
    const int col = blockIdx.x * TN + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int kk = threadIdx.x; kk < TK; kk += TN) {
            int c = k0 + kk;
            As[threadIdx.y * TK + kk] = (row < M && c < K) ? A[(size_t)row * K + c] : 0.0f;
        }
        for (int kk = threadIdx.y; kk < TK; kk += TM) {
            int r = k0 + kk;
            Bs[kk * TN + threadIdx.x] = (r < K && col < N) ? B[(size_t)r * N + col] : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < TK; ++kk) {
            acc += As[threadIdx.y * TK + kk] * Bs[kk * TN + threadIdx.x];
        }
        __syncthreads();
    }
    if (row < M && col < N) { C[(size_t)row * N + col] = acc; }
}
"""
