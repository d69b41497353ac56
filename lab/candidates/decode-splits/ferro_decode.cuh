// What the decode kernels (flash_decode.cu, flash_decode_streams.cu, flash_decode_mma.cu) share:
// the element type with its float conversions, a block's (batch, KV head, split), its last step
// (decode_finish), and the merging of each row's key splits (merge_splits: by the last block of
// a pair, or by flash_decode_combine for the tiles design). Each split leaves its unnormalised O
// ([splits][rows][FERRO_HEAD_DIM]) and its (max, sum) in scaled units ([splits][rows][2]) in a
// float32 workspace.
// Element type: float32, or float16 / bfloat16 with FERRO_BF16 defined.
#pragma once
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_visibility.cuh"
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"
#include "ferro_pages.cuh"

#include "ferro_elem.cuh"
static_assert(!FERRO_PAGED, "the decode kernels take a paged cache at run time (DecodeBlock)");

// One decode block's work: (batch b, KV head hk) and its split of the keys [j_lo, j_hi). Blocks
// go in (batch, KV head, split) order. (The KV head fastest, so that blocks running at once read
// neighbouring heads' slices of the same keys, measured 1-4% slower in 7 of the 9 compare.py
// decode cases, H200, 2026-12-03.) `s` becomes batch b's shape (its kv_lens entry, or its
// varlen sequence: for_sequence; a kernel leaves at once when the sequence has no row, R = 0,
// so no block of that pair takes a ticket and its counter stays zero).
// A paged cache (ferro_pages.cuh; `pg.pages` non-null): key j's K row at element
// block * k_block + row * rk.stride from rk.off (the KV head's column).
struct DecodeBlock {
    u32 b, hk, G;          // G: query heads per KV head
    int R;                 // rows: row r is head hk * G + r / seq_q, query r % seq_q
    Rows rk, rv;           // (b, hk)'s rows of K and V (paged: hk's column of a block)
    long long j_lo, j_hi;  // this split's keys
    KeyPages pg;           // batch b's pages (contiguous: one page of every key)
    u64 k_block, v_block;  // elements from one block to the next (0: contiguous)
    u32 frame_q;           // s.frame_q: the workspace's rows per (batch, head)
    long long q0;          // the batch entry's first row of q and out (varlen; else 0)

    // Element offset of query i of head h in a q-shaped tensor with strides t.
    __device__ __forceinline__ u64 q_at(const Strides& t, u32 h, u32 i) const {
        return (u64)b * t.b + (u64)(q0 + i) * t.s + (u64)h * t.h;
    }
    // (b, h, i)'s row of the workspace: the frame's [batch, heads, frame_q] rows, one layout
    // for every block of the launch whatever its sequence's length.
    __device__ __forceinline__ u64 part_row(const AttnShape& s, u32 h, u32 i) const {
        return ((u64)b * s.heads + h) * frame_q + i;
    }
};
// The workspace's rows per split: [batch, heads, frame_q].
__device__ __forceinline__ u64 part_rows(const AttnShape& s, u32 frame_q) {
    return (u64)s.batch * s.heads * frame_q;
}
__device__ __forceinline__ DecodeBlock decode_block(AttnShape& s, const int* kv_lens,
                                                    const int* block_table, const AttnExtras& ex,
                                                    const AttnLayout& lay, u32 splits,
                                                    u32 step) {
    DecodeBlock d;
    const u32 split = blockIdx.x % splits, bhk = blockIdx.x / splits;
    d.b = bhk / s.kv_heads, d.hk = bhk % s.kv_heads;
    d.frame_q = s.frame_q;
    for_batch(s, kv_lens, d.b);
    for_sequence(s, d.b);
    d.q0 = s.q_start;
    d.G = s.heads / s.kv_heads;
    d.R = (int)(d.G * s.seq_q);
    d.pg = contiguous_pages(), d.k_block = d.v_block = 0;
    if (block_table && ex.page_size) {
        d.pg = key_pages(block_table, ex.page_size, s.seq_k, d.b);
        d.k_block = lay.k.b, d.v_block = lay.v.b;
        d.rk = rows_of(lay.k, 0, d.hk), d.rv = rows_of(lay.v, 0, d.hk);
    } else {
        d.rk = k_rows(s, lay.k, d.b, d.hk), d.rv = k_rows(s, lay.v, d.b, d.hk);
    }
    split_keys_range(s, split, splits, step, d.j_lo, d.j_hi);
    return d;
}

// The keys of one tile [jt, jt + n) (jt < j_hi), translated once where one page holds them
// (TileSlots): element offsets of key j's K and V rows (from rk.off, rv.off).
struct TileKeys {
    TileSlots slots;
    __device__ __forceinline__ TileKeys(const DecodeBlock& d, long long jt, int n)
        : slots(d.pg, jt, n) {}
    __device__ __forceinline__ void at(const DecodeBlock& d, long long j, u64& k_off,
                                       u64& v_off) const {
        u64 bl, r;
        slots.at(d.pg, j, bl, r);
        k_off = bl * d.k_block + r * d.rk.stride;
        v_off = bl * d.v_block + r * d.rv.stride;
    }
};

// Row `row`'s column d merged over the splits' parts in the workspace (unnormalised O
// [splits][rows_total][FERRO_HEAD_DIM], (max, sum) [splits][rows_total][2]): each thread reads
// the splits' (max, sum) itself (the same addresses across a row: broadcast) together with its
// column, CHUNK splits at a time, every load independent: one round trip to L2 for up to CHUNK
// splits, no barrier, no shared memory. Chunks after the first rescale what came before (an
// online softmax over the splits). L2 loads (ld.cg): other blocks wrote the parts during this
// launch, which this SM's L1 does not see. Gives (max, sum, O's column).
__device__ __forceinline__ void merge_splits(const float* part_o, const float* part_ml, u32 splits,
                                             u64 rows_total, u64 row, int d, bool col, float& M,
                                             float& L, float& acc) {
    constexpr int CHUNK = 16;
    M = neg_inf(), L = 0.f, acc = 0.f;
    for (u32 s0 = 0; s0 < splits; s0 += CHUNK) {
        float m[CHUNK], l[CHUNK], o[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            const u32 sp = s0 + i;
            const u64 at = (u64)sp * rows_total + row;
            const bool ok = sp < splits;
            m[i] = ok ? __ldcg(part_ml + at * 2) : neg_inf();
            l[i] = ok ? __ldcg(part_ml + at * 2 + 1) : 0.f;
            o[i] = ok && col ? __ldcg(part_o + at * FERRO_HEAD_DIM + d) : 0.f;
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
}

// Writes row (b, h, i)'s column d of out (O / its denominator, rounded once; a row that sees
// nothing: 0) and, from column 0, its lse, given the row's (max, sum, O's column): row_end, with
// head h's sink. `s` is batch entry b's (for_sequence: its rows of out and lse).
__device__ __forceinline__ void write_row(const AttnShape& s, const AttnLayout& lay, u32 b, u32 h,
                                          u32 i, int d, float M, float L, float O, T* out,
                                          float* lse) {
    float inv, lse_i;
    row_end<BuildOptions::MODS>(M, L, Dropout<true>(s).keep_scale(), sink_logit(s, h), inv,
                                lse_i);
    if (d < (int)s.head_dim)
        out[q_rows(s, lay.out, b, h).off + (u64)i * lay.out.s + d] = E::from_f(O * inv);
    if (lse && d == 0) lse[row_index(s, b, h) + i] = lse_i;
}

// A decode block's last step: its warps' partial results for each of its R rows (sO
// [WARPS][ROWS][FERRO_HEAD_DIM] unnormalised O, sML [WARPS][ROWS][2] (max, sum), max in scaled
// units, a warp that saw no key of a row leaving (-inf, 0)) merged per row. With one split the
// block writes out and lse itself. With more, the split's O and (max, sum) go to the workspace,
// and then, given `tickets` (a zeroed counter per (batch, KV head), left zeroed again), the last
// of the pair's blocks to get there merges every split (merge_splits) and writes out and lse:
// no combine launch, whose start and the drain of this kernel before it cost about 3.6 us of
// 181 at bf16 B1 Sk128k (dev/decode_probe.py, H100, 2026-12-06). Without tickets,
// flash_decode_combine merges them.
template <int WARPS, int ROWS, int THREADS>
__device__ __forceinline__ void decode_finish(const float* sO, const float* sML, const AttnShape& s,
                                              const AttnLayout& lay, const DecodeBlock& blk,
                                              u32 split, u32 splits, T* out, float* lse,
                                              float* part_o, float* part_ml, u32* tickets) {
    constexpr int DP = FERRO_HEAD_DIM;
    const u64 rows_total = part_rows(s, blk.frame_q);
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
        const u64 row = blk.part_row(s, h, i);
        if (splits == 1) {  // the only split: this block writes the answer
            write_row(s, lay, blk.b, h, i, d, M, L, O, out, lse);
        } else {
            part_o[((u64)split * rows_total + row) * DP + d] = O;
            if (d == 0) {
                part_ml[((u64)split * rows_total + row) * 2] = M;
                part_ml[((u64)split * rows_total + row) * 2 + 1] = L;
            }
        }
    }
    if (splits == 1 || !tickets) return;
    // The last block of the pair: every other block's parts are written and visible to it
    // (each block fences its writes before taking its ticket; the last fences before reading).
    __threadfence();
    __syncthreads();  // every thread's parts fenced before the ticket is taken
    u32* ticket = tickets + blockIdx.x / splits;
    const bool last = __syncthreads_or(threadIdx.x == 0 && atomicAdd(ticket, 1u) == splits - 1);
    if (!last) return;
    if (threadIdx.x == 0) *ticket = 0u;  // every block of the pair has counted: zero for the next launch
    __threadfence();
    for (int idx = threadIdx.x; idx < blk.R * DP; idx += THREADS) {
        const int r = idx / DP, d = idx % DP;
        const u32 h = blk.hk * blk.G + r / s.seq_q, i = r % s.seq_q;
        float M, L, O;
        merge_splits(part_o, part_ml, splits, rows_total, blk.part_row(s, h, i), d, true, M, L, O);
        write_row(s, lay, blk.b, h, i, d, M, L, O, out, lse);
    }
}

// The second kernel where the decode kernel has no tickets (the tiles design): one block of
// COMBINE_THREADS per row (b, h, i) of the workspace's frame, a thread per column of O
// (head_dim <= COMBINE_THREADS), merge_splits; a varlen frame's rows past their sequence's
// length hold nothing and write nothing. Any number of splits (configs.py caps them at
// DECODE_MAX_SPLITS).
constexpr int COMBINE_THREADS = FERRO_COMBINE_THREADS;
static_assert(FERRO_HEAD_DIM <= COMBINE_THREADS, "a combine thread per column");

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
flash_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                     T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ sinks,
                     const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                     const u32 splits, const AttnLayout lay, const FlashV2Params p,
                     const AttnExtras ex) {
    const u64 rows_total = (u64)p.batch * p.heads * p.seq_q, row = blockIdx.x;
    const int d = threadIdx.x;
    AttnShape s = attn_shape(p, ex, 0);
    if (BuildOptions::MODS) with_extras(s, ex, nullptr, sinks);
    with_varlen(s, ex, cu_q, cu_k);
    const u32 i = row % p.seq_q, bh = row / p.seq_q, h = bh % p.heads, b = bh / p.heads;
    for_sequence(s, b);
    if (i >= s.seq_q) return;  // (the whole block: one row)
    float M, L, O;
    merge_splits(part_o, part_ml, splits, rows_total, row, d, d < (int)p.head_dim, M, L, O);
    if (d < (int)p.head_dim) write_row(s, lay, b, h, i, d, M, L, O, out, lse);
}
