// What the two decode kernels (flash_decode.cu, flash_decode_streams.cu) share: the element type
// with its float conversions, and the kernel that merges each row's key splits. Each split leaves
// its unnormalised O ([splits][rows][FERRO_HEAD_DIM]) and its (max, sum) in scaled units
// ([splits][rows][2]) in a float32 workspace.
// Element type: float32, or float16 / bfloat16 with FERRO_BF16 defined.
#pragma once
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_visibility.cuh"

#ifdef FERRO_BF16
#include "ferro_mma_f16.cuh"  // widen, round1
typedef u16 T;
__device__ __forceinline__ float to_f(T x) { return widen(x); }
__device__ __forceinline__ T from_f(float x) { return round1(x); }
// 16 bytes of shared memory as floats (in registers: no local copy to index).
__device__ __forceinline__ void load16(const T* src, float (&f)[8]) {
    const uint4 r = *reinterpret_cast<const uint4*>(src);
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        f[2 * c] = widen((u16)(w[c] & 0xffffu));
        f[2 * c + 1] = widen((u16)(w[c] >> 16));
    }
}
#else
typedef float T;
__device__ __forceinline__ float to_f(T x) { return x; }
__device__ __forceinline__ T from_f(float x) { return x; }
__device__ __forceinline__ void load16(const T* src, float (&f)[4]) {
    const float4 r = *reinterpret_cast<const float4*>(src);
    f[0] = r.x, f[1] = r.y, f[2] = r.z, f[3] = r.w;
}
#endif

// A split's keys [j_lo, j_hi): split * split_keys on, clipped to what some row of the call can
// see and to the reach (past it nothing is read).
__device__ __forceinline__ void split_keys_range(const AttnShape& s, u32 split, u32 split_keys,
                                                 long long& j_lo, long long& j_hi) {
    long long lo, hi;
    visible_key_range(s, s.offset, (long long)s.seq_q - 1 + s.offset, lo, hi);
    if (hi > s.kv_reach) hi = s.kv_reach;
    j_lo = max(lo, (long long)split * split_keys);
    j_hi = min(hi, (long long)(split + 1) * split_keys);
}

// One decode block's work: (batch b, KV head hk) and its split of the keys [j_lo, j_hi). Blocks
// go in (batch, KV head, split) order. (The KV head fastest, so that blocks running at once read
// neighbouring heads' slices of the same keys, measured 1-4% slower in 7 of the 9 compare.py
// decode cases, H200, 2026-12-03.) `s` becomes batch b's shape (its kv_lens entry).
struct DecodeBlock {
    u32 b, hk, G;          // G: query heads per KV head
    int R;                 // rows: row r is head hk * G + r / seq_q, query r % seq_q
    Rows rk, rv;           // (b, hk)'s rows of K and V
    long long j_lo, j_hi;  // this split's keys
};
__device__ __forceinline__ DecodeBlock decode_block(AttnShape& s, const int* kv_lens,
                                                    const AttnLayout& lay, u32 splits,
                                                    u32 split_keys) {
    DecodeBlock d;
    const u32 split = blockIdx.x % splits, bhk = blockIdx.x / splits;
    d.b = bhk / s.kv_heads, d.hk = bhk % s.kv_heads;
    for_batch(s, kv_lens, d.b);
    d.G = s.heads / s.kv_heads;
    d.R = (int)(d.G * s.seq_q);
    d.rk = rows_of(lay.k, d.b, d.hk), d.rv = rows_of(lay.v, d.b, d.hk);
    split_keys_range(s, split, split_keys, d.j_lo, d.j_hi);
    return d;
}

// A decode block's last step: its warps' partial results for each of its R rows (sO
// [WARPS][ROWS][FERRO_HEAD_DIM] unnormalised O, sML [WARPS][ROWS][2] (max, sum), max in scaled
// units, a warp that saw no key of a row leaving (-inf, 0)) merged per row. With one split the
// block writes out (rounded once) and lse itself; with more, the split's O and (max, sum) go to
// the workspace for flash_decode_combine.
template <int WARPS, int ROWS, int THREADS>
__device__ __forceinline__ void decode_finish(const float* sO, const float* sML, const AttnShape& s,
                                              const AttnLayout& lay, const DecodeBlock& blk,
                                              u32 split, u32 splits, T* out, float* lse,
                                              float* part_o, float* part_ml) {
    constexpr int DP = FERRO_HEAD_DIM;
    const u64 rows_total = (u64)s.batch * s.heads * s.seq_q;
    const float keep_scale = s.dropout_prob > 0.f ? 1.f / (1.f - s.dropout_prob) : 1.f;
    for (int idx = threadIdx.x; idx < blk.R * DP; idx += THREADS) {
        const int r = idx / DP, d = idx % DP;
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sML[(w * ROWS + r) * 2]);
        const float m_use = M == neg_inf() ? 0.f : M;
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float a = exp2f((sML[(w * ROWS + r) * 2] - m_use) * FERRO_LOG2E);
            L += sML[(w * ROWS + r) * 2 + 1] * a;
            O += sO[(w * ROWS + r) * DP + d] * a;
        }
        const u32 h = blk.hk * blk.G + r / s.seq_q, i = r % s.seq_q;
        const u64 row = ((u64)blk.b * s.heads + h) * s.seq_q + i;
        if (splits == 1) {  // the only split: this block writes the answer
            const float inv = L == 0.f ? 0.f : keep_scale / L;  // a row that sees nothing: 0
            if (d < (int)s.head_dim)
                out[(u64)blk.b * lay.out.b + (u64)i * lay.out.s + (u64)h * lay.out.h + d] = from_f(O * inv);
            if (lse && d == 0) lse[row] = L == 0.f ? neg_inf() : M + logf(L);
        } else {
            part_o[((u64)split * rows_total + row) * DP + d] = O;
            if (d == 0) {
                part_ml[((u64)split * rows_total + row) * 2] = M;
                part_ml[((u64)split * rows_total + row) * 2 + 1] = L;
            }
        }
    }
}

// One block of COMBINE_THREADS per output row (b, h, i), a thread per column of O (head_dim <=
// COMBINE_THREADS). Each thread reads the splits' (max, sum) itself (the same addresses across the
// block: broadcast) together with its column, CHUNK splits at a time, every load independent:
// one round trip to L2 for up to CHUNK splits, no barrier, no shared memory. (The block-wide
// version, a reduction for the max, another for the sum, then the columns, waited on three.)
// Chunks after the first rescale what came before (an online softmax over the splits). Writes
// out (rounded once) and lse. Any number of splits (configs.py caps them at DECODE_MAX_SPLITS).
constexpr int COMBINE_THREADS = FERRO_COMBINE_THREADS;
static_assert(FERRO_HEAD_DIM <= COMBINE_THREADS, "a combine thread per column");

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
flash_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                     T* __restrict__ out, float* __restrict__ lse, const u32 splits,
                     const AttnLayout lay, const FlashV2Params p) {
    constexpr int CHUNK = 16;
    const u64 rows_total = (u64)p.batch * p.heads * p.seq_q, row = blockIdx.x;
    const int d = threadIdx.x, D = p.head_dim;
    const bool col = d < D;
    float M = neg_inf(), L = 0.f, acc = 0.f;
    for (u32 s0 = 0; s0 < splits; s0 += CHUNK) {
        float m[CHUNK], l[CHUNK], o[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            const u32 sp = s0 + i;
            const u64 at = (u64)sp * rows_total + row;
            const bool ok = sp < splits;
            m[i] = ok ? part_ml[at * 2] : neg_inf();
            l[i] = ok ? part_ml[at * 2 + 1] : 0.f;
            o[i] = ok && col ? part_o[at * FERRO_HEAD_DIM + d] : 0.f;
        }
        float mx = M;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) mx = fmaxf(mx, m[i]);
        const float m_use = mx == neg_inf() ? 0.f : mx;
        const float a = exp2f((M - m_use) * FERRO_LOG2E);  // what came before, rescaled
        L *= a, acc *= a;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            const float w = l[i] != 0.f ? exp2f((m[i] - m_use) * FERRO_LOG2E) : 0.f;  // empty: 0
            L = fmaf(l[i], w, L);
            acc = fmaf(w, o[i], acc);
        }
        M = mx;
    }
    const float keep_scale = p.dropout_prob > 0.f ? 1.f / (1.f - p.dropout_prob) : 1.f;
    const float inv = L == 0.f ? 0.f : keep_scale / L;  // a row that sees nothing: 0
    const u32 i = row % p.seq_q, bh = row / p.seq_q, h = bh % p.heads, b = bh / p.heads;
    if (col) out[(u64)b * lay.out.b + (u64)i * lay.out.s + (u64)h * lay.out.h + d] = from_f(acc * inv);
    if (lse && d == 0) lse[row] = L == 0.f ? neg_inf() : M + logf(L);
}
