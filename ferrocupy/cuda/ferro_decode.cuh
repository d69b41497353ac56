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

// The keys [j_lo, j_hi) some row of the call can see, clipped to the reach (past it nothing is
// read).
__device__ __forceinline__ void seen_keys_range(const AttnShape& s, long long& j_lo,
                                                long long& j_hi) {
    visible_key_range(s, s.offset, (long long)s.seq_q - 1 + s.offset, j_lo, j_hi);
    if (j_hi > s.kv_reach) j_hi = s.kv_reach;
    if (j_hi < j_lo) j_hi = j_lo;
}
// A split's keys: split * split_keys on, within seen_keys_range.
__device__ __forceinline__ void split_keys_range(const AttnShape& s, u32 split, u32 split_keys,
                                                 long long& j_lo, long long& j_hi) {
    long long lo, hi;
    seen_keys_range(s, lo, hi);
    j_lo = max(lo, (long long)split * split_keys);
    j_hi = min(hi, (long long)(split + 1) * split_keys);
}

// One decode block's work: (batch b, KV head hk) and its keys [j_lo, j_hi). `s` becomes batch
// b's shape (its kv_lens entry).
struct DecodeBlock {
    u32 b, hk, G;          // G: query heads per KV head
    int R;                 // rows: row r is head hk * G + r / seq_q, query r % seq_q
    Rows rk, rv;           // (b, hk)'s rows of K and V
    long long j_lo, j_hi;  // this block's keys
};
// The pair bhk = b * kv_heads + hk with all the keys some row of it can see, up to the reach.
__device__ __forceinline__ DecodeBlock decode_pair(AttnShape& s, const int* kv_lens,
                                                   const AttnLayout& lay, u64 bhk) {
    DecodeBlock d;
    d.b = (u32)(bhk / s.kv_heads), d.hk = (u32)(bhk % s.kv_heads);
    for_batch(s, kv_lens, d.b);
    d.G = s.heads / s.kv_heads;
    d.R = (int)(d.G * s.seq_q);
    d.rk = rows_of(lay.k, d.b, d.hk), d.rv = rows_of(lay.v, d.b, d.hk);
    seen_keys_range(s, d.j_lo, d.j_hi);
    return d;
}
// A split block's work (the tensor and tiles kernels): blocks go in (batch, KV head, split)
// order. (The KV head fastest, so that blocks running at once read neighbouring heads' slices
// of the same keys, measured 1-4% slower in 7 of the 9 compare.py decode cases, H200,
// 2026-12-03.)
__device__ __forceinline__ DecodeBlock decode_block(AttnShape& s, const int* kv_lens,
                                                    const AttnLayout& lay, u32 splits,
                                                    u32 split_keys) {
    const u32 split = blockIdx.x % splits;
    DecodeBlock d = decode_pair(s, kv_lens, lay, blockIdx.x / splits);
    split_keys_range(s, split, split_keys, d.j_lo, d.j_hi);
    return d;
}

// The balanced grid (the streams kernel). Each pair's keys, from the first one it sees, are cut
// into `pair_units` units (warp tiles). For each KV head its batches' units in a row (batch *
// pair_units) are shared out evenly among `per_head` blocks, cut the same way for every head:
// block share * kv_heads + hk takes head hk's units [share_start(share), share_start(share + 1)),
// which may end inside one batch and go on into the next. Every SM streams the same number of
// keys, with no wave of blocks left half full (the split grid kept 4 of the H200's 132 SMs idle
// at B16 and B1, and ran B64 in 1.94 waves), and the blocks of one share, neighbours in launch
// order, read the same keys of every head at once: in [B, S, Hkv, D] one key's rows of all
// heads lie together. (Shares cut from the pairs' units in a row, each head's blocks at other
// keys, read DRAM a quarter slower: bf16 B1 Sk128k 2922 GB/s against the split grid's 3806,
// compare.py, H200, 2026-12-04.)
struct DecodeShares {
    u64 units;       // one head's units: batch * pair_units
    u32 per_head;    // blocks per KV head (gridDim.x = per_head * kv_heads)
    u32 kv_heads, pair_units;
    __device__ __forceinline__ u64 start(u32 share) const { return units * share / per_head; }
    // The share holding unit u: the last one starting at or before it.
    __device__ __forceinline__ u32 share_of(u64 u) const {
        return (u32)(((u + 1) * per_head - 1) / units);
    }
};
__device__ __forceinline__ DecodeShares decode_shares(const FlashV2Params& p, u32 pair_units) {
    return DecodeShares{(u64)p.batch * pair_units, gridDim.x / p.kv_heads, p.kv_heads,
                        pair_units};
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

// The last step of a block of the balanced grid for a pair it shares with other blocks: its
// warps' partial results (as decode_finish takes them) merged per row go to its slot of the
// workspace (part_o [2 * blocks][ROWS][FERRO_HEAD_DIM], part_ml [2 * blocks][ROWS][2]: slot 2i
// holds the batch block i's share starts in, 2i + 1 the one it ends in). The pair's blocks count
// themselves in counters[f], f the pair's first block (a block's share ends inside at most one
// batch, so no two shared pairs have the same f); the last to arrive merges every slot of the
// pair into out and lse and sets the count back to 0, so a counter is 0 before each launch and
// after it. No block waits for another: blocks may run in any order.
template <int WARPS, int ROWS, int THREADS>
__device__ __forceinline__ void decode_share_finish(const float* sO, const float* sML,
                                                    const AttnShape& s, const AttnLayout& lay,
                                                    const DecodeBlock& blk, const DecodeShares& sh,
                                                    u32* counters, T* out, float* lse,
                                                    float* part_o, float* part_ml) {
    constexpr int DP = FERRO_HEAD_DIM;
    __shared__ u32 last_block;
    const u64 first_unit = (u64)blk.b * sh.pair_units;
    const u32 f = sh.share_of(first_unit), l = sh.share_of(first_unit + sh.pair_units - 1);
    // The slot of the pair's block of share i: 2 (i * kv_heads + hk), + 1 for the first share
    // when the pair starts inside it (the pair is the one that share ends in).
    const u32 f_odd = sh.start(f) < first_unit ? 1u : 0u;
    auto slot_of = [&](u32 i) -> u64 {
        return 2ull * (i * sh.kv_heads + blk.hk) + (i == f ? f_odd : 0u);
    };
    const u32 counter = f * sh.kv_heads + blk.hk;
    const u64 mine = slot_of(blockIdx.x / sh.kv_heads);
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
        part_o[(mine * ROWS + r) * DP + d] = O;
        if (d == 0) part_ml[(mine * ROWS + r) * 2] = M, part_ml[(mine * ROWS + r) * 2 + 1] = L;
    }
    __threadfence();  // this thread's slot writes, before the count that publishes them
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 before = atomicAdd(counters + counter, 1u);
        last_block = before == l - f;
        if (last_block) counters[counter] = 0;  // every block of the pair has counted
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();  // the other blocks' slots, after their counts
    const float keep_scale = s.dropout_prob > 0.f ? 1.f / (1.f - s.dropout_prob) : 1.f;
    for (int idx = threadIdx.x; idx < blk.R * DP; idx += THREADS) {
        const int r = idx / DP, d = idx % DP;
        // Two passes of independent loads (each a round trip to L2 the last block waits for at
        // the end of the launch: an online merge, one slot after another, kept bf16 B1 Sk128k,
        // 16 blocks a pair, 30 us slower): the max, then the weighted sums. A share that saw no
        // key of the row left (-inf, 0): weight 0.
        float M = neg_inf(), L = 0.f, O = 0.f;
#pragma unroll 8
        for (u32 i = f; i <= l; ++i) M = fmaxf(M, __ldcg(part_ml + (slot_of(i) * ROWS + r) * 2));
        const float m_use = M == neg_inf() ? 0.f : M;
#pragma unroll 8
        for (u32 i = f; i <= l; ++i) {
            const u64 sl = slot_of(i);
            const float a = exp2f((__ldcg(part_ml + (sl * ROWS + r) * 2) - m_use) * FERRO_LOG2E);
            L = fmaf(__ldcg(part_ml + (sl * ROWS + r) * 2 + 1), a, L);
            O = fmaf(__ldcg(part_o + (sl * ROWS + r) * DP + d), a, O);
        }
        const u32 h = blk.hk * blk.G + r / s.seq_q, qi = r % s.seq_q;
        const float inv = L == 0.f ? 0.f : keep_scale / L;  // a row that sees nothing: 0
        if (d < (int)s.head_dim)
            out[(u64)blk.b * lay.out.b + (u64)qi * lay.out.s + (u64)h * lay.out.h + d] = from_f(O * inv);
        if (lse && d == 0)
            lse[((u64)blk.b * s.heads + h) * s.seq_q + qi] = L == 0.f ? neg_inf() : M + logf(L);
    }
}

// One block of COMBINE_THREADS per output row (b, h, i): the splits' weights exp(m_s - M) once,
// into shared memory (threads across splits), then each thread a column of O over every split
// (independent loads, coalesced across the row); writes out (rounded once) and lse. At most
// FERRO_MAX_SPLITS splits (configs.py).
constexpr int COMBINE_THREADS = FERRO_COMBINE_THREADS;

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* scratch) {
#pragma unroll
    for (int w = 16; w; w >>= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, w);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();  // scratch is free (a previous reduction has been read)
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
    __syncthreads();
    x = scratch[0];
#pragma unroll
    for (int w = 1; w < COMBINE_THREADS / 32; ++w) x = is_max ? fmaxf(x, scratch[w]) : x + scratch[w];
    return x;
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
flash_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                     T* __restrict__ out, float* __restrict__ lse, const u32 splits,
                     const AttnLayout lay, const FlashV2Params p) {
    __shared__ float weight[FERRO_MAX_SPLITS];
    __shared__ float scratch[COMBINE_THREADS / 32];
    const u64 rows_total = (u64)p.batch * p.heads * p.seq_q, row = blockIdx.x;
    const int tid = threadIdx.x, D = p.head_dim;
    float M = neg_inf();
    for (u32 sp = tid; sp < splits; sp += COMBINE_THREADS)
        M = fmaxf(M, part_ml[((u64)sp * rows_total + row) * 2]);
    M = block_reduce(M, true, scratch);
    const float m_use = M == neg_inf() ? 0.f : M;
    float L = 0.f;
    for (u32 sp = tid; sp < splits; sp += COMBINE_THREADS) {
        const float* ml = part_ml + ((u64)sp * rows_total + row) * 2;
        const float w = ml[1] != 0.f ? exp2f((ml[0] - m_use) * FERRO_LOG2E) : 0.f;  // an empty split: 0
        weight[sp] = w;
        L += ml[1] * w;
    }
    L = block_reduce(L, false, scratch);  // its barriers also publish `weight`
    const float keep_scale = p.dropout_prob > 0.f ? 1.f / (1.f - p.dropout_prob) : 1.f;
    const float inv = L == 0.f ? 0.f : keep_scale / L;  // a row that sees nothing: 0
    const u32 i = row % p.seq_q, bh = row / p.seq_q, h = bh % p.heads, b = bh / p.heads;
    T* orow = out + (u64)b * lay.out.b + (u64)i * lay.out.s + (u64)h * lay.out.h;
    for (int d = tid; d < D; d += COMBINE_THREADS) {
        const float* col = part_o + row * FERRO_HEAD_DIM + d;
        float acc = 0.f;
#pragma unroll 8
        for (u32 sp = 0; sp < splits; ++sp) acc = fmaf(weight[sp], col[(u64)sp * rows_total * FERRO_HEAD_DIM], acc);
        orow[d] = from_f(acc * inv);
    }
    if (lse && tid == 0) lse[row] = L == 0.f ? neg_inf() : M + logf(L);
}
