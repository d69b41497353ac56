"""The sm_90a warpgroup products on their own (ferro_wgmma.cuh): S = A B^T with both operands
K-major in the 128-byte-swizzled shared layout, and O = P V with P in registers and V MN-major,
against float64 products of the same half-precision values. A wrong descriptor, swizzle or
fragment layout fails here with a small, readable case before it fails inside attention.

Runs only on a GPU of compute capability 9.0 (the kernels are built for sm_90a)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy.dtypes import BFLOAT16, FLOAT16
from gpu_helpers import gpu_pytestmark, needs_real_gpu

pytestmark = gpu_pytestmark()

PROBE = r"""
#include "ferro_params.cuh"
#include "ferro_mma_f16.cuh"
#include "ferro_wgmma.cuh"
#include "ferro_dq_order.cuh"

__device__ __forceinline__ u16* aligned(u16* p) {
    return p + (((1024u - (smem_u32(p) & 1023u)) & 1023u) >> 1);
}
// c[r][n] of a 64 x N accumulator, r = 16 * warp + g (+8), n = 8 * nt + 2t (+1).
template <int N>
__device__ void store(const float (&d)[N / 8][4], float* c) {
    const int w = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    for (int nt = 0; nt < N / 8; ++nt)
        for (int r = 0; r < 4; ++r)
            c[(16 * w + g + 8 * (r >> 1)) * N + 8 * nt + 2 * t + (r & 1)] = d[nt][r];
}
// c (64 x N) = a (64 x DK) b (N x DK)^T
template <int N, int DK>
__device__ void ss(const u16* a, const u16* b, float* c) {
    extern __shared__ __align__(1024) u16 sm[];
    u16* sA = aligned(sm);
    u16* sB = sA + 64 * DK;
    load_tile_sw128<64, DK, 128>(sA, a, DK, 0, 64, DK);
    load_tile_sw128<N, DK, 128>(sB, b, DK, 0, N, DK);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float d[N / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk)
        wgmma_ss(d, desc_k_major<64>(smem_u32(sA), kk), desc_k_major<N>(smem_u32(sB), kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(d);
    store<N>(d, c);
}
// This thread's A fragments (mma.sync's layout, k-step kk: columns 16kk..16kk+15) of a 64 x K
// row-major matrix.
template <int K>
__device__ void a_fragments(const u16* p, u32 (&a)[K / 16][4]) {
    const int w = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const u32* p32 = reinterpret_cast<const u32*>(p);
    for (int kk = 0; kk < K / 16; ++kk) {
        const int r0 = 16 * w + g, c0 = 16 * kk + 2 * t;
        a[kk][0] = p32[(r0 * K + c0) / 2];
        a[kk][1] = p32[((r0 + 8) * K + c0) / 2];
        a[kk][2] = p32[(r0 * K + c0 + 8) / 2];
        a[kk][3] = p32[((r0 + 8) * K + c0 + 8) / 2];
    }
}
// c (64 x N) = p (64 x K, from registers) v (K x N, MN-major)
template <int N, int K>
__device__ void rs(const u16* p, const u16* v, float* c) {
    extern __shared__ __align__(1024) u16 sm[];
    u16* sV = aligned(sm);
    load_tile_sw128<K, N, 128>(sV, v, N, 0, K, N);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float d[N / 8][4];
    for (int nt = 0; nt < N / 8; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.f;
    u32 a[K / 16][4];
    a_fragments<K>(p, a);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) wgmma_rs(d, a[kk], desc_mn_major<K>(smem_u32(sV), kk), 1);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(d);
    store<N>(d, c);
}
// c (64 x N) = a (64 x K, K-major) b (K x N, MN-major), both from shared memory: the fused
// backward's dQ_part = dS K.
template <int N, int K>
__device__ void ss_mn(const u16* a, const u16* b, float* c) {
    extern __shared__ __align__(1024) u16 sm[];
    u16* sA = aligned(sm);
    u16* sB = sA + 64 * K;
    load_tile_sw128<64, K, 128>(sA, a, K, 0, 64, K);
    load_tile_sw128<K, N, 128>(sB, b, N, 0, K, N);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float d[N / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        wgmma_ss_mn(d, desc_k_major<64>(smem_u32(sA), kk), desc_mn_major<K>(smem_u32(sB), kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(d);
    store<N>(d, c);
}
// c (64 x N) = p^T b: p (64 x 64) as the A fragments of dS^T that the dK/dV kernel holds,
// stored transposed by store_ds_transposed, then dS K as the fused kernel forms it.
template <int N>
__device__ void ds_t(const u16* p, const u16* b, float* c) {
    extern __shared__ __align__(1024) u16 sm[];
    u16* sA = aligned(sm);
    u16* sB = sA + 64 * 64;
    load_tile_sw128<64, N, 128>(sB, b, N, 0, 64, N);
    u32 a[4][4];
    a_fragments<64>(p, a);
    store_ds_transposed<8>(sA, a, lane_ids());
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float d[N / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        wgmma_ss_mn(d, desc_k_major<64>(smem_u32(sA), kk), desc_mn_major<64>(smem_u32(sB), kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(d);
    store<N>(d, c);
}
#define SS(N, DK) extern "C" __global__ void ss_##N##_##DK(const u16* a, const u16* b, float* c) { ss<N, DK>(a, b, c); }
#define RS(N, K) extern "C" __global__ void rs_##N##_##K(const u16* p, const u16* v, float* c) { rs<N, K>(p, v, c); }
#define SSMN(N, K) extern "C" __global__ void ss_mn_##N##_##K(const u16* a, const u16* b, float* c) { ss_mn<N, K>(a, b, c); }
#define DST(N) extern "C" __global__ void ds_t_##N(const u16* p, const u16* b, float* c) { ds_t<N>(p, b, c); }
SS(64, 64) SS(64, 128) SS(128, 64) SS(128, 128)
RS(64, 128) RS(128, 128) RS(128, 64)
SSMN(64, 64) SSMN(64, 128) SSMN(128, 64) SSMN(128, 128)
DST(64) DST(128)
"""

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]


def _module(dtype):
    needs_real_gpu()
    import cupy

    dev = cupy.cuda.Device()
    if dev.compute_capability != "90":
        pytest.skip(f"wgmma kernels are built for sm_90a; this GPU is sm_{dev.compute_capability}")
    from ferrocupy.cuda.loader import SOURCE_DIR

    return cupy.RawModule(code=PROBE, options=(
        "-std=c++17", "-arch=sm_90a", f"-I{SOURCE_DIR}", f"-DFERRO_BF16={int(dtype == BFLOAT16)}"))


def _run(mod, name, arrays, out_shape, smem):
    import cupy

    fn = mod.get_function(name)
    fn.max_dynamic_shared_size_bytes = smem
    out = cupy.full(out_shape, np.nan, dtype=np.float32)
    fn((1,), (128,), tuple(cupy.asarray(a) for a in arrays) + (out,), shared_mem=smem)
    return cupy.asnumpy(out)


def _rel(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,dk", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_wgmma_ss_is_a_times_b_transposed(rng, dtype, n, dk):
    mod = _module(dtype)
    a = rng.standard_normal((64, dk)).astype(dtype)
    b = rng.standard_normal((n, dk)).astype(dtype)
    got = _run(mod, f"ss_{n}_{dk}", (a.view(np.uint16), b.view(np.uint16)), (64, n),
               2 * (64 + n) * dk + 1024)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    assert not np.isnan(got).any(), "an accumulator element was never written"
    assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,k", [(64, 128), (128, 128), (128, 64)])
def test_wgmma_rs_is_p_times_v(rng, dtype, n, k):
    mod = _module(dtype)
    p = rng.standard_normal((64, k)).astype(dtype)
    v = rng.standard_normal((k, n)).astype(dtype)
    got = _run(mod, f"rs_{n}_{k}", (p.view(np.uint16), v.view(np.uint16)), (64, n),
               2 * k * n + 1024)
    want = p.astype(np.float64) @ v.astype(np.float64)
    assert not np.isnan(got).any(), "an accumulator element was never written"
    assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,k", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_wgmma_ss_mn_is_a_times_b(rng, dtype, n, k):
    """The fused backward's dQ_part = dS K: A K-major, B MN-major, both from shared memory (at
    k 128, A's two 64-column blocks side by side, as the two warpgroups' dS)."""
    mod = _module(dtype)
    a = rng.standard_normal((64, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    got = _run(mod, f"ss_mn_{n}_{k}", (a.view(np.uint16), b.view(np.uint16)), (64, n),
               2 * (64 + n) * k + 1024)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert not np.isnan(got).any(), "an accumulator element was never written"
    assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", [64, 128])
def test_transposed_ds_store_feeds_the_dq_product(rng, dtype, n):
    """dS^T's A fragments (registers) stored transposed into the swizzled layout
    (store_ds_transposed), then dS K: equals p^T b."""
    mod = _module(dtype)
    p = rng.standard_normal((64, 64)).astype(dtype)
    b = rng.standard_normal((64, n)).astype(dtype)
    got = _run(mod, f"ds_t_{n}", (p.view(np.uint16), b.view(np.uint16)), (64, n),
               2 * (64 + n) * 64 + 1024)
    want = p.astype(np.float64).T @ b.astype(np.float64)
    assert not np.isnan(got).any(), "an accumulator element was never written"
    assert _rel(got, want) < 1e-5, _rel(got, want)
