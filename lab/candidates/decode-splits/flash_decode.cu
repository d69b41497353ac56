// Decoding from a KV cache (flash-decoding): few query rows against many keys, in two kernels.
// This design serves what flash_decode_streams.cu does not: rows of K and V that take no 16-byte
// copies, and KV groups of 9-16 query rows. `out` and `lse` are the combine's to write.
// `flash_decode` gives each block one (batch, KV head) and one split of its keys: the block's rows
// are every query row of every head of that KV group (R = heads / kv_heads * seq_q, at most
// ROWS), so K and V are read once per group. Tiles of BN keys stream through shared memory by
// cp.async (double-buffered); scores, softmax and O += P V run on the CUDA cores in float32 (a
// few rows per key: the kernel is bound by memory, not arithmetic). Each split writes its
// unnormalised O and its (max, sum) to a float32 workspace; `flash_decode_combine` merges the
// splits of each row through them and writes out (and lse); `tickets` is for the other designs
// (their last block of a pair merges the splits) and unused here. Every forward option holds: causal
// + offset, window, mask, dropout (the same keep mask), kv_lens, a paged cache, dead rows -> 0.
// Element type: float32, or float16 / bfloat16 with FERRO_BF16 defined. Geometry from configs.py.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_score.cuh"
#include "ferro_decode.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, THREADS = 32 * FERRO_WARPS, BN = FERRO_BN;
constexpr int ROWS = FERRO_ROWS;                   // query rows per block, at most
constexpr int VEC = 16 / sizeof(T);                // elements per 16-byte shared read
constexpr int PITCH = DP + VEC;  // +16 bytes: a warp's 32 key rows hit distinct bank groups
constexpr int KV_ELEMS = BN * PITCH;
constexpr int STAGES = FERRO_STAGES;               // tile t in use, the next STAGES - 1 in flight
constexpr int PAIRS = ROWS * DP / THREADS;         // (row, column) outputs per thread
static_assert(BN == 32 && THREADS % BN == 0, "a key per lane in the softmax");
static_assert(STAGES >= 2, "at least one tile in flight");
static_assert(DP % 16 == 0 && (ROWS * DP) % THREADS == 0, "decode geometry");
static_assert(2 * STAGES * KV_ELEMS * (int)sizeof(T) + 4 * (ROWS * DP + ROWS * (BN + 1) + 3 * ROWS) ==
                  FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
flash_decode(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             float* __restrict__ part_o, float* __restrict__ part_ml, u32* __restrict__ tickets,
             T* __restrict__ out, float* __restrict__ lse, const void* __restrict__ mask,
             const int* __restrict__ kv_lens, const int* __restrict__ block_table,
             const float* __restrict__ alibi,
             const float* __restrict__ sinks, const int* __restrict__ cu_q,
             const int* __restrict__ cu_k, const u32 splits, const u32 split_keys,
             const u32 vec, const u32 mask_kind, const AttnLayout lay, const FlashV2Params p,
             const AttnExtras ex) {
    extern __shared__ __align__(16) unsigned char smem_d[];
    T* sK = reinterpret_cast<T*>(smem_d);      // [STAGES][BN][PITCH]
    T* sV = sK + STAGES * KV_ELEMS;            // [STAGES][BN][PITCH]
    float* sQ = reinterpret_cast<float*>(sV + STAGES * KV_ELEMS);  // [ROWS][DP], scaled
    float* sP = sQ + ROWS * DP;                // [ROWS][BN + 1]: scores, then P
    float* sM = sP + ROWS * (BN + 1);          // running max, sum, rescale per row
    float* sL = sM + ROWS;
    float* sA = sL + ROWS;

    AttnShape s = attn_shape(p, ex, mask_kind);
    if (BuildOptions::MODS) with_extras(s, ex, alibi, sinks);
    with_varlen(s, ex, cu_q, cu_k);
    // (split_keys, planned on the capacity, is unused: each block divides its entry's own keys)
    (void)split_keys;
    const DecodeBlock blk = decode_block(s, kv_lens, block_table, ex, lay, splits, FERRO_BN);
    if (FERRO_VARLEN && blk.R == 0) return;  // a sequence with no query row (the block leaves)
    const u32 split = blockIdx.x % splits, b = blk.b, hk = blk.hk, G = blk.G;
    const int R = blk.R;
    const int D = s.head_dim, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const Rows rk = blk.rk, rv = blk.rv;
    const T* kb = k + rk.off;
    const T* vb = v + rv.off;
    const long long j_lo = blk.j_lo, j_hi = blk.j_hi;
    const int n_tiles = j_hi > j_lo ? (int)((j_hi - j_lo + BN - 1) / BN) : 0;

    for (int idx = tid; idx < ROWS * DP; idx += THREADS) {  // Q, scaled, zero past D and R
        const int r = idx / DP, d = idx % DP;
        float x = 0.f;
        if (r < R && d < D) {
            const u32 h = hk * G + r / s.seq_q, i = r % s.seq_q;
            x = E::to_f(q[blk.q_at(lay.q, h, i) + d]) * s.scale;
        }
        sQ[idx] = x;
    }
    if (tid < ROWS) sM[tid] = neg_inf(), sL[tid] = 0.f;
    __syncthreads();  // Q and the row state, for every thread (a split with no tile included)
    const Dropout<true> drop(s);

    float o[PAIRS];
#pragma unroll
    for (int n = 0; n < PAIRS; ++n) o[n] = 0.f;

    // Tiles t + 1 .. t + STAGES - 1 load while tile t is used; one commit group per tile (maybe
    // empty), so waiting for all but the newest STAGES - 1 groups means tile t has landed.
    // A paged cache: each key row translated on its own (this design's copies go a chunk per
    // thread, not a tile per warp).
    auto k_row = [&](long long j) {
        u64 bl, r;
        key_slot(blk.pg, j, bl, r);
        return bl * blk.k_block + r * rk.stride;
    };
    auto v_row = [&](long long j) {
        u64 bl, r;
        key_slot(blk.pg, j, bl, r);
        return bl * blk.v_block + r * rv.stride;
    };
    auto load_kv = [&](int t) {
        if (t < n_tiles) {
            const long long j = j_lo + (long long)t * BN;
            load_tile_at<T, BN, DP, PITCH, THREADS>(sK + (t % STAGES) * KV_ELEMS, kb, k_row, j,
                                                    j_hi, D, vec);
            load_tile_at<T, BN, DP, PITCH, THREADS>(sV + (t % STAGES) * KV_ELEMS, vb, v_row, j,
                                                    j_hi, D, vec);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) load_kv(t);
    for (int t = 0; t < n_tiles; ++t) {
        const long long j0 = j_lo + (long long)t * BN;
        const T* tK = sK + (t % STAGES) * KV_ELEMS;
        const T* tV = sV + (t % STAGES) * KV_ELEMS;
        load_kv(t + STAGES - 1);  // into tile t - 1's buffer, released by the last barrier of t - 1
        cp_async_wait<STAGES - 1>();
        __syncthreads();  // tile t landed

        // Scores: lane = key, warp w takes rows w, w + WARPS, ... (a warp shares its row, so its
        // Q reads are broadcasts; its 32 keys' 16-byte reads fall in distinct bank groups).
        {
            const int kk = lane;
            const long long j = j0 + kk;
            for (int r = warp; r < R; r += THREADS / 32) {
                const float* qr = sQ + r * DP;
                const T* kr = tK + kk * PITCH;
                float part[4] = {0.f, 0.f, 0.f, 0.f};  // four chains: the FMAs overlap
#pragma unroll
                for (int d = 0; d < DP; d += VEC) {
                    float e[VEC];
                    E::load16(kr + d, e);
#pragma unroll
                    for (int c = 0; c < VEC; c += 4) {
                        const float4 qv = *reinterpret_cast<const float4*>(qr + d + c);
                        part[0] = fmaf(qv.x, e[c], part[0]);
                        part[1] = fmaf(qv.y, e[c + 1], part[1]);
                        part[2] = fmaf(qv.z, e[c + 2], part[2]);
                        part[3] = fmaf(qv.w, e[c + 3], part[3]);
                    }
                }
                float acc = (part[0] + part[1]) + (part[2] + part[3]);
                const u32 h = hk * G + r / s.seq_q, i = r % s.seq_q;
                // Keys past the split's end belong to the next split (and were not loaded).
                const bool ok = j < j_hi && visible(s, (long long)i + s.offset, j);
                acc = modified_score<true, BuildOptions::MODS>(s, mask, b, h, i, j, ok,
                                                               alibi_slope(s, b, h), acc);
                sP[r * (BN + 1) + kk] = ok ? acc : neg_inf();
            }
        }
        __syncwarp();
        // Online softmax, a warp per row (its scores are its own: no barrier needed before).
        for (int r = warp; r < R; r += THREADS / 32) {
            const float x = sP[r * (BN + 1) + lane];
            const float m_old = sM[r];
            float mx = x;
#pragma unroll
            for (int w = 16; w; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
            const float m_new = fmaxf(m_old, mx);
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float e = exp2f((x - m_use) * FERRO_LOG2E);
            float sum = e;
#pragma unroll
            for (int w = 16; w; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
            float pe = e;
            if (drop.on) {
                const u32 h = hk * G + r / s.seq_q, i = r % s.seq_q, j = (u32)(j0 + lane);
                if (!drop.kept(b * s.heads + h, i, j)) pe = 0.f;
            }
            sP[r * (BN + 1) + lane] = pe;
            __syncwarp();
            if (lane == 0) {
                const float alpha = exp2f((m_old - m_use) * FERRO_LOG2E);
                sA[r] = alpha;
                sL[r] = sL[r] * alpha + sum;
                sM[r] = m_new;
            }
        }
        __syncthreads();  // P and the rescale factors of every row are in place

        // O += P V: thread owns (row, column) pairs tid + THREADS * n; consecutive threads take
        // consecutive columns of V (conflict-free) and mostly the same row of P (broadcast).
#pragma unroll
        for (int n = 0; n < PAIRS; ++n) {
            const int idx = tid + THREADS * n, r = idx / DP, d = idx % DP;
            if (r >= R) break;
            const float* pr = sP + r * (BN + 1);
            float acc = o[n] * sA[r];
#pragma unroll 8
            for (int kk = 0; kk < BN; ++kk) acc = fmaf(pr[kk], E::to_f(tV[kk * PITCH + d]), acc);
            o[n] = acc;
        }
        __syncthreads();  // every thread is done with tile t's buffers and with P
    }
    cp_async_wait<0>();

    // This split's part of each row: unnormalised O, and (max, sum) in scaled units.
    const u64 rows_total = part_rows(s, blk.frame_q);
#pragma unroll
    for (int n = 0; n < PAIRS; ++n) {
        const int idx = tid + THREADS * n, r = idx / DP, d = idx % DP;
        if (r >= R) break;
        const u32 h = hk * G + r / s.seq_q, i = r % s.seq_q;
        const u64 row = blk.part_row(s, h, i);
        part_o[((u64)split * rows_total + row) * DP + d] = o[n];
        if (d == 0) {
            part_ml[((u64)split * rows_total + row) * 2] = sM[r];
            part_ml[((u64)split * rows_total + row) * 2 + 1] = sL[r];
        }
    }
}
