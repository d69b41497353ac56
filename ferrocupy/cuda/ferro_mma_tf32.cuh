// float32 products on tensor cores at float32 accuracy (3xTF32: x = big + small, both TF32;
// a*b ~ ab + as + sb), with the fragment loads from shared memory the float32 kernels use.
#pragma once
#include "ferro_params.cuh"

__device__ __forceinline__ u32 tf32_big(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

struct Split { u32 big, small; };

__device__ __forceinline__ Split split_tf32(float x) {
    Split s;
    s.big = tf32_big(x);
    s.small = __float_as_uint(x - __uint_as_float(s.big));  // hardware truncates it to TF32
    return s;
}

// D += A(16x8) B(8x8), TF32 in, FP32 accumulate. Fragments (g = lane/4, t = lane%4):
// a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4); b0 (k=t, n=g) b1 (k=t+4, n=g);
// c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 3xTF32: float32-level accuracy (error ~2^-22 per product) at tensor-core speed.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const u32 (&ab)[4], const u32 (&as)[4],
                                           Split b0, Split b1) {
    mma_tf32(d, as, b0.big, b1.big);
    mma_tf32(d, ab, b0.small, b1.small);
    mma_tf32(d, ab, b0.big, b1.big);
}

__device__ __forceinline__ void split_frag(const float (&x)[4], u32 (&big)[4], u32 (&small)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        Split s = split_tf32(x[r]);
        big[r] = s.big;
        small[r] = s.small;
    }
}

// ---- fragment access in shared memory (row pitch PITCH floats, PITCH % 32 in {4, 12, 20, 28}:
//      conflict-free for the patterns below). g = lane/4, t = lane%4. ---------------------------

// A operand (16 rows x 8 cols) at x[0][0], row-major.
template <int PITCH>
__device__ __forceinline__ void frag_a(const float* x, Lane L, float (&a)[4]) {
    a[0] = x[L.g * PITCH + L.t];
    a[1] = x[(L.g + 8) * PITCH + L.t];
    a[2] = x[L.g * PITCH + L.t + 4];
    a[3] = x[(L.g + 8) * PITCH + L.t + 4];
}

// B operand (k 8 x n 8) stored n-major (x[n][k]), as K is for S = Q K^T.
template <int PITCH>
__device__ __forceinline__ void frag_b_nk(const float* x, Lane L, Split& b0, Split& b1) {
    b0 = split_tf32(x[L.g * PITCH + L.t]);
    b1 = split_tf32(x[L.g * PITCH + L.t + 4]);
}

// B operand stored k-major (x[k][n]) with the k order permuted (mma k = t <-> row 2t, k = t+4 <->
// row 2t+1), which lets an accumulator fragment be reused as the A operand without shuffles.
template <int PITCH>
__device__ __forceinline__ void frag_b_kn_perm(const float* x, Lane L, Split& b0, Split& b1) {
    b0 = split_tf32(x[(2 * L.t) * PITCH + L.g]);
    b1 = split_tf32(x[(2 * L.t + 1) * PITCH + L.g]);
}

// An accumulator fragment c (16 x 8) as the A operand of the next product, k order permuted.
__device__ __forceinline__ void acc_as_a(const float (&c)[4], u32 (&big)[4], u32 (&small)[4]) {
    const float a[4] = {c[0], c[2], c[1], c[3]};
    split_frag(a, big, small);
}


// acc (16 x 8*NT) = A B^T: A is 16 rows x 8*KS at sA, B is 8*NT rows x 8*KS at sB, both
// row-major in shared memory (S = Q K^T, dP = dO V^T, and their transposes in the dK/dV kernel).
template <int NT, int KS, int PITCH>
__device__ __forceinline__ void gemm_abt(const float* sA, const float* sB, Lane L,
                                         float (&acc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        float a[4];
        u32 ab[4], as[4];
        frag_a<PITCH>(sA + ks * 8, L, a);
        split_frag(a, ab, as);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            Split b0, b1;
            frag_b_nk<PITCH>(sB + nt * 8 * PITCH + ks * 8, L, b0, b1);
            mma_3xtf32(acc[nt], ab, as, b0, b1);
        }
    }
}

// acc (16 x 8*KS) += A B: A (16 x 8*NT) in accumulator layout (e.g. P), B (8*NT x 8*KS) row-major
// in shared memory. Each 8-column chunk is summed over the tile in a fresh accumulator and then
// added to acc in ordinary float32: the tensor cores accumulate with truncation, and over
// thousands of accumulations into one register that bias reached 1.6e-5 relative error
// (S = 2048); per tile it stays near 1e-7.
template <int NT, int KS, int PITCH>
__device__ __forceinline__ void gemm_acc_ab(const float (&a)[NT][4], const float* sB, Lane L,
                                            float (&acc)[KS][4]) {
    u32 ab[NT][4], as[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc_as_a(a[nt], ab[nt], as[nt]);
#pragma unroll
    for (int nd = 0; nd < KS; ++nd) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            Split b0, b1;
            frag_b_kn_perm<PITCH>(sB + nt * 8 * PITCH + nd * 8, L, b0, b1);
            mma_3xtf32(t, ab[nt], as[nt], b0, b1);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nd][r] += t[r];
    }
}


// The mma.sync kernels' policy for float32: their bodies are written once for this and MmaF16
// (ferro_mma_f16.cuh). Tiles in shared memory are row-major with pitch DP + PAD floats.
struct MmaTf32 {
    typedef float T;
    static constexpr int PAD = 4;
    // The forward's scores scaled before the softmax, not left raw (ferro_score.cuh raw_scores):
    // at head_dim 128 its kernel sits at 255 registers, and raw scores spilled there (20 bytes).
    static constexpr bool RAW_SCORES = false;

    // acc[mt] (16 x 8*NT) = A B^T: A the MT*16 rows at sA, B the 8*NT rows at sB.
    template <int MT, int NT, int DP, int PITCH>
    static __device__ __forceinline__ void gemm_abt(const float* sA, const float* sB,
                                                    float (&acc)[MT][NT][4]) {
        const Lane L = lane_ids();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ::gemm_abt<NT, DP / 8, PITCH>(sA + mt * 16 * PITCH, sB, L, acc[mt]);
    }
    // acc[mt] (16 x DP) += C[mt] B: C an accumulator tile (16 x 8*NT), B 8*NT x DP at sB.
    template <int MT, int NT, int DP, int PITCH>
    static __device__ __forceinline__ void gemm_acc_ab(const float (&c)[MT][NT][4], const float* sB,
                                                       float (&acc)[MT][DP / 8][4]) {
        const Lane L = lane_ids();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ::gemm_acc_ab<NT, DP / 8, PITCH>(c[mt], sB, L, acc[mt]);
    }
};
