// float16 / bfloat16 products on tensor cores (sm_80+): mma.sync m16n8k16 with float32
// accumulators, operands loaded from shared memory by ldmatrix. Elements are raw 16-bit words
// (ferro_convert.cuh); FERRO_BF16 picks the type.
//
// Fragments (g = lane/4, t = lane%4; each register holds two consecutive-k elements, low first):
//   A 16x16: a0 (g, 2t..) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k=2t.., n=g) b1 (k=2t+8.., n=g)
//   C 16x8:  c0 c1 (g, 2t..) c2 c3 (g+8, 2t..)
// so an accumulator tile of 16 x 16 is, packed pairwise, the A operand of the next product
// (P of the forward, dS and P' of the backward) with no shuffles.
//
// Shared-memory tiles are row-major with a row pitch of DP + 8 elements: DP is a multiple of 16,
// so the pitch is an odd number of 16-byte units and the 8 row addresses of one ldmatrix phase
// fall in 8 different bank groups (conflict-free, no swizzle needed). The decode kernel's K/V
// tiles are swizzled instead (`swz_at`, at the end): the padding slowed its copies.
#pragma once
#include "ferro_params.cuh"
#include "ferro_convert.cuh"

#ifndef FERRO_BF16
#error "FERRO_BF16 (0: float16, 1: bfloat16) comes from ferrocupy/cuda/configs.py"
#endif

// Two n-tiles of an accumulator (16 x 16: columns 0-7 in c0, 8-15 in c1), rounded pairwise to the
// dtype: the A fragment of the next product (P, dS, P').
__device__ __forceinline__ void acc_to_a(const float (&c0)[4], const float (&c1)[4], u32 (&a)[4]) {
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}

// D += A B (16x8x16), float32 accumulate.
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if FERRO_BF16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix takes a 32-bit shared-memory address; each thread's address is a per-tile base (its
// lane's row and column folded in once) plus a compile-time offset, which the instruction encodes
// as an immediate: no address registers per fragment.
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Lane bases (bytes) of the three fragment kinds, for a row-major tile with pitch PITCH:
//   A 16x16 at (row 0, col 0): lanes 0-15 rows 0-15 at col 0, lanes 16-31 the same at col 8.
//   B from x[n][k] (K for S = Q K^T), n-tiles n, n+8 x k 16: matrix m = lane/8 at
//     n + 8*(m>>1) + lane%8, k + 8*(m&1) -> b[0], b[1] (n-tile n), b[2], b[3] (n-tile n+8).
//   B from x[k][n] (V for O = P V) through the transpose: k + 8*(m&1) + lane%8, n + 8*(m>>1).
template <int PITCH>
__device__ __forceinline__ u32 lane_a(const u16* x) {
    const int l = threadIdx.x & 31;
    return smem_u32(x + (l & 15) * PITCH + 8 * (l >> 4));
}
template <int PITCH>
__device__ __forceinline__ u32 lane_b_nk(const u16* x) {
    const int l = threadIdx.x & 31, m = l >> 3;
    return smem_u32(x + (8 * (m >> 1) + (l & 7)) * PITCH + 8 * (m & 1));
}
template <int PITCH>
__device__ __forceinline__ u32 lane_b_kn(const u16* x) {
    const int l = threadIdx.x & 31, m = l >> 3;
    return smem_u32(x + (8 * (m & 1) + (l & 7)) * PITCH + 8 * (m >> 1));
}

// acc[mt] (16 x 8*NT, MT m-tiles) = A B^T with A the MT*16 rows at sA and B the 8*NT rows at sB,
// both [rows][DP] in shared memory: S = Q K^T, dP = dO V^T and their transposes.
template <int MT, int NT, int DP, int PITCH>
__device__ __forceinline__ void gemm_abt(const u16* sA, const u16* sB, float (&acc)[MT][NT][4]) {
    static_assert(NT % 2 == 0, "n-tiles come in pairs");
    const u32 a0 = lane_a<PITCH>(sA), b0 = lane_b_nk<PITCH>(sB);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] =
                                            acc[mt][nt][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < DP; k0 += 16) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], a0 + 2 * (mt * 16 * PITCH + k0));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b[4];
            ldmatrix_x4(b, b0 + 2 * (np * 16 * PITCH + k0));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc[mt] (16 x DP) += A[mt] B with A an accumulator tile (16 x 8*NT, float32, e.g. P), rounded
// into A fragments 16 columns at a time as they are used (so no second copy of the tile is held
// in registers), and B the 8*NT x DP tile at sB, stored [k][DP] in shared memory (V, K, Q, dO).
template <int MT, int NT, int DP, int PITCH>
__device__ __forceinline__ void gemm_acc_ab(const float (&c)[MT][NT][4], const u16* sB,
                                            float (&acc)[MT][DP / 8][4]) {
    const u32 b0 = lane_b_kn<PITCH>(sB);
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc_to_a(c[mt][2 * kk], c[mt][2 * kk + 1], a[mt]);
#pragma unroll
        for (int dp = 0; dp < DP / 16; ++dp) {
            u32 b[4];
            ldmatrix_x4_trans(b, b0 + 2 * (kk * 16 * PITCH + dp * 16));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(acc[mt][2 * dp], a[mt], b[0], b[1]);
                mma16816(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// The mma.sync kernels' policy for float16 / bfloat16 (see MmaTf32, ferro_mma_tf32.cuh): tiles
// row-major with pitch DP + PAD elements.
struct MmaF16 {
    typedef u16 T;
    static constexpr int PAD = 8;
    static constexpr bool RAW_SCORES = true;  // the forward's common tile skips a multiply
    template <int MT, int NT, int DP, int PITCH>
    static __device__ __forceinline__ void gemm_abt(const u16* sA, const u16* sB,
                                                    float (&acc)[MT][NT][4]) {
        ::gemm_abt<MT, NT, DP, PITCH>(sA, sB, acc);
    }
    template <int MT, int NT, int DP, int PITCH>
    static __device__ __forceinline__ void gemm_acc_ab(const float (&c)[MT][NT][4], const u16* sB,
                                                       float (&acc)[MT][DP / 8][4]) {
        ::gemm_acc_ab<MT, NT, DP, PITCH>(c, sB, acc);
    }
};

// Swizzled tiles (the decode kernel's K and V): rows of exactly DP elements (DP a multiple of 64,
// so a row is whole 128-byte lines), row r's 16-byte chunk c stored at chunk c ^ (r & 7). The 8
// rows of one ldmatrix phase (8 consecutive rows, one chunk column) then fall in 8 different
// bank groups, and the rows need no padding. (Padded rows, DP + 8, made the copies of a
// memory-bound decode 4-6% slower on an H100, the math left out: dev/decode_probe.py,
// 2026-12-06.) Offsets in elements.
template <int DP>
__device__ __forceinline__ int swz_at(int row, int chunk) {
    static_assert(DP % 64 == 0, "swizzled rows are whole 128-byte lines");
    return row * DP + ((chunk ^ (row & 7)) << 3);
}

// acc (16 x 8*NT) = A B^T with A in registers (a[kk]: the A fragment of columns 16kk..16kk+15)
// and B the 8*NT swizzled rows at sB (S = Q K^T).
template <int NT, int DP>
__device__ __forceinline__ void gemm_abt_swz(const u32 (&a)[DP / 16][4], const u16* sB,
                                             float (&acc)[NT][4]) {
    static_assert(NT % 2 == 0, "n-tiles come in pairs");
    const int l = threadIdx.x & 31, m = l >> 3;
    const int row = 8 * (m >> 1) + (l & 7), half = m & 1;  // as lane_b_nk
    const u32 base = smem_u32(sB + row * DP);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk)
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b[4];  // rows + 16 np keep row & 7
            ldmatrix_x4(b, base + 2 * (np * 16 * DP) + (((2 * kk + half) ^ (l & 7)) << 4));
            mma16816(acc[2 * np], a[kk], b[0], b[1]);
            mma16816(acc[2 * np + 1], a[kk], b[2], b[3]);
        }
}

// acc (16 x DP) += A B with A an accumulator tile (16 x 8*NT, float32: P), rounded into A
// fragments 16 columns at a time, and B the 8*NT x DP swizzled tile at sB (V).
template <int NT, int DP>
__device__ __forceinline__ void gemm_acc_ab_swz(const float (&c)[NT][4], const u16* sB,
                                                float (&acc)[DP / 8][4]) {
    const int l = threadIdx.x & 31, m = l >> 3;
    const int row = 8 * (m & 1) + (l & 7), half = m >> 1;  // as lane_b_kn
    const u32 base = smem_u32(sB + row * DP);
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        u32 a[4];
        acc_to_a(c[2 * kk], c[2 * kk + 1], a);
#pragma unroll
        for (int dp = 0; dp < DP / 16; ++dp) {
            u32 b[4];  // rows + 16 kk keep row & 7
            ldmatrix_x4_trans(b, base + 2 * (kk * 16 * DP) + (((2 * dp + half) ^ (l & 7)) << 4));
            mma16816(acc[2 * dp], a, b[0], b[1]);
            mma16816(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}
