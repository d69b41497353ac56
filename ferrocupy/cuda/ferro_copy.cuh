// Global -> shared tile copies: cp.async where a row allows it, zero-filled past the valid part
// (rows past the end, columns past head_dim), so the products never meet garbage.
#pragma once
#include "ferro_params.cuh"

template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool valid) {
    u32 dst = (u32)__cvta_generic_to_shared(smem);
    int src_bytes = valid ? BYTES : 0;
    if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem),
                     "r"(src_bytes));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(gmem),
                     "n"(BYTES), "r"(src_bytes));
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Copy rows [row0, row0+ROWS) x [0, DP) of a matrix of T (valid part: rows < n_rows, cols < D;
// row `row` starts at element row_at(row) of base, asked only of valid rows) into shared memory
// with row pitch PITCH elements. `vec` elements per copy, chosen by the host for the whole
// launch: 16 bytes when head_dim and every row allow it, else 4 bytes, else (2-byte halves at
// odd head_dim) plain loads and stores.
template <class T, int VEC, int ROWS, int DP, int PITCH, int THREADS, class RowAt>
__device__ __forceinline__ void load_tile_vec(T* smem, const T* base, RowAt row_at,
                                              long long row0, long long n_rows, int D) {
    constexpr int PER_ROW = DP / VEC;
#pragma unroll 1  // unrolled, its addresses would be hoisted out of the key loop: ~80 registers
    for (int idx = threadIdx.x; idx < ROWS * PER_ROW; idx += THREADS) {
        const int r = idx / PER_ROW, c = (idx % PER_ROW) * VEC;
        const long long row = row0 + r;
        const bool ok = row < n_rows && c < D;
        const T* src = ok ? base + row_at(row) + c : base;
        if (VEC * sizeof(T) >= 4) {
            cp_async<VEC * sizeof(T)>(smem + r * PITCH + c, src, ok);
        } else {
            smem[r * PITCH + c] = ok ? *src : T(0);
        }
    }
}

template <class T, int ROWS, int DP, int PITCH, int THREADS, class RowAt>
__device__ __forceinline__ void load_tile_at(T* smem, const T* base, RowAt row_at, long long row0,
                                             long long n_rows, int D, u32 vec) {
    constexpr int V16 = 16 / sizeof(T), V4 = 4 / sizeof(T);
    if (vec == V16) {
        load_tile_vec<T, V16, ROWS, DP, PITCH, THREADS>(smem, base, row_at, row0, n_rows, D);
    } else if (vec == V4) {
        load_tile_vec<T, V4, ROWS, DP, PITCH, THREADS>(smem, base, row_at, row0, n_rows, D);
    } else {
        load_tile_vec<T, 1, ROWS, DP, PITCH, THREADS>(smem, base, row_at, row0, n_rows, D);
    }
}

// Rows `row_stride` elements apart.
struct StridedRows {
    u64 stride;
    __device__ __forceinline__ u64 operator()(long long row) const { return (u64)row * stride; }
};

template <class T, int ROWS, int DP, int PITCH, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* base, u64 row_stride, long long row0,
                                          long long n_rows, int D, u32 vec) {
    load_tile_at<T, ROWS, DP, PITCH, THREADS>(smem, base, StridedRows{row_stride}, row0, n_rows, D,
                                              vec);
}
