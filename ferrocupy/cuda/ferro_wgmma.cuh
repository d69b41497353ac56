// float16 / bfloat16 products on sm_90a's warpgroup tensor cores (wgmma.mma_async): four warps
// (a warpgroup, 128 threads) multiply 64 rows at once, reading B, and A too if it is not in
// registers, straight from shared memory through a 64-bit descriptor. The instructions are
// asynchronous: issue, commit, then wait before the accumulators are read or written.
//
// Shared-memory layout (the "128-byte swizzle" wgmma reads): a tile of R rows x DP columns is
// stored as DP/64 column blocks, each R rows of 128 bytes (64 elements); in row r, 16-byte chunk c
// of a block sits at chunk c ^ (r % 8). Blocks start at multiples of 1024 bytes, so the pattern
// the hardware applies to the address bits matches the one the loads wrote. Within one
// instruction (k = 16 = 32 bytes) the 8-row groups are 1024 bytes apart.
//   K-major (rows = M or N, contiguous along k: Q, K): a k-step moves the start by 32 bytes
//   inside a block, then on to the next block; the leading offset is unused.
//   MN-major (rows = k, contiguous along N: V in O = P V): 8-row k-groups 1024 bytes apart
//   (stride offset), and the next 64 columns of N one column block (R * 128 bytes) on (leading
//   offset).
// Accumulators: per warp 16 rows, laid out as mma.sync's m16n8 C fragments, n-tile by n-tile
// (d[nt][0..3]); so a 64 x 16 slice of them, packed pairwise, is the A operand of wgmma_rs.
#pragma once
#include "ferro_params.cuh"
#include "ferro_copy.cuh"
#include "ferro_mma_f16.cuh"

#ifndef FERRO_BF16
#error "FERRO_BF16 (0: float16, 1: bfloat16) comes from ferrocupy/cuda/configs.py"
#endif
#if FERRO_BF16
#define FERRO_WG_AB "bf16"
#else
#define FERRO_WG_AB "f16"
#endif
#include "ferro_wgmma_ops.cuh"

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins the accumulators in place around an asynchronous product, so the compiler neither reads
// them before the wait nor moves writes after the issue.
template <int NT>
__device__ __forceinline__ void wgmma_pin(float (&d)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[i][r])::"memory");
}
// Shared-memory writes by ordinary stores and cp.async are made visible to the async proxy that
// wgmma reads through (then a barrier makes them visible to the other warps).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// An accumulator tile (64 rows x 8*NT columns), rounded pairwise to the dtype, as the A operand of
// wgmma_rs: k-step kk takes columns 16kk..16kk+15, whose two n-tiles are exactly mma.sync's A
// fragment. (P for O += P V; P^T and dS^T for dV and dK; dS for dQ.)
template <int NT>
__device__ __forceinline__ void to_a_fragments(const float (&c)[NT][4], u32 (&a)[NT / 2][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) acc_to_a(c[2 * kk], c[2 * kk + 1], a[kk]);
}

// A 128-byte-swizzle descriptor of the tile at shared address `addr`.
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(leading_bytes >> 4) << 16) |
           ((u64)(stride_bytes >> 4) << 32) | (1ull << 62);
}
// K-major operand (rows x DP, ROWS rows per column block): k-step kk (16 columns).
template <int ROWS>
__device__ __forceinline__ u64 desc_k_major(u32 tile, int kk) {
    return sw128_desc(tile + (kk >> 2) * ROWS * 128 + (kk & 3) * 32, 16, 1024);
}
// MN-major operand (ROWS k-rows x DP columns): k-step kk (rows 16kk..16kk+15), all DP columns.
template <int ROWS>
__device__ __forceinline__ u64 desc_mn_major(u32 tile, int kk) {
    return sw128_desc(tile + kk * 2048, ROWS * 128, 1024);
}

// Copy rows [row0, row0 + ROWS) x [0, DP) of a matrix of 16-bit elements (row `row` at element
// row_at(row) of base, asked only of valid rows: ferro_copy.cuh's RowAt) into the swizzled
// layout, 16 bytes per cp.async; rows before 0 or past n_rows and columns past D (a multiple of
// 8) are zero-filled.
template <int ROWS, int DP, int THREADS, class RowAt>
__device__ __forceinline__ void load_tile_sw128_at(u16* smem, const u16* base, RowAt row_at,
                                                   long long row0, long long n_rows, int D) {
    constexpr int CHUNKS = DP / 8;
#pragma unroll 1  // unrolled, its addresses would be hoisted out of the key loop
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const long long row = row0 + r;
        const bool ok = row >= 0 && row < n_rows && 8 * c < D;
        const u16* src = ok ? base + row_at(row) + 8 * c : base;
        u16* dst = smem + (c >> 3) * ROWS * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);
        cp_async<16>(dst, src, ok);
    }
}
// Rows `row_stride` elements apart.
template <int ROWS, int DP, int THREADS>
__device__ __forceinline__ void load_tile_sw128(u16* smem, const u16* base, u64 row_stride,
                                                long long row0, long long n_rows, int D) {
    load_tile_sw128_at<ROWS, DP, THREADS>(smem, base, StridedRows{row_stride}, row0, n_rows, D);
}
