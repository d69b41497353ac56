// Fused attention forward, float32 (FlashAttention-2 schedule, 3xTF32 tensor-core products).
// One block = BM query rows of one (batch, head); 4 warps x 16 rows. K and V tiles of BN keys
// stream through shared memory (cp.async: V_j loads during S = Q K_j^T, K_{j+1} during softmax and
// P V_j); Q is staged in shared memory once; online softmax in float32; no S x S matrix in global memory.
// ferro-variants: FERRO_HEAD_DIM=16,32,64,96,128
#include "ferro_common.cuh"

#ifndef FERRO_HEAD_DIM
#define FERRO_HEAD_DIM 128  // head_dim rounded up to a multiple of 8 (the mma k / n size)
#endif
#ifndef FERRO_VEC
#define FERRO_VEC 4  // floats per cp.async: 4 when head_dim % 4 == 0 and rows are 16-byte aligned
#endif

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = 4, THREADS = 32 * WARPS;
constexpr int BM = 16 * WARPS, BN = 64, PITCH = DP + 4;
constexpr int KS = DP / 8;  // k-steps of Q K^T = n-tiles of P V
constexpr int NT = BN / 8;  // n-tiles of Q K^T = k-steps of P V
static_assert(DP % 8 == 0 && DP <= 128, "padded head_dim");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2(const float* __restrict__ q, const float* __restrict__ k,
              const float* __restrict__ v, float* __restrict__ out,
              const float* __restrict__ mask, const FlashV2Params p) {
    extern __shared__ float smem[];
    float* sQ = smem;  // [BM][PITCH]
    float* sK = sQ + BM * PITCH;  // [BN][PITCH]
    float* sV = sK + BN * PITCH;  // [BN][PITCH]
    const AttnShape s = attn_shape(p);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    // 1-D grid over (batch*heads) x query tiles, in block_coords order.
    const u32 q_tiles = (s.seq_q + BM - 1) / BM;
    u32 bh, rank;
    block_coords(blockIdx.x, q_tiles, s.batch * s.heads, bh, rank);
    const u32 tile = q_tiles - 1 - rank;  // the last query tiles see the most keys
    const u32 b = bh / s.heads, h = bh % s.heads, hk = h / (s.heads / s.kv_heads);
    const long long m0 = (long long)tile * BM;
    const long long rows[2] = {m0 + warp * 16 + L.g, m0 + warp * 16 + L.g + 8};

    const u64 q_stride = (u64)s.heads * D, kv_stride = (u64)s.kv_heads * D;
    const float* qb = q + ((u64)b * s.seq_q * s.heads + h) * D;
    const float* kb = k + ((u64)b * s.seq_k * s.kv_heads + hk) * D;
    const float* vb = v + ((u64)b * s.seq_k * s.kv_heads + hk) * D;

    // This block's query rows, staged once in shared memory (A fragments are read per k-step:
    // holding them in registers as well as O and S spills at head_dim 128).
    load_tile<BM, DP, PITCH, FERRO_VEC, THREADS>(sQ, qb, q_stride, m0, s.seq_q, D);
    const float* sQw = sQ + warp * 16 * PITCH;

    const long long m_last = min((long long)s.seq_q, m0 + BM) - 1;
    long long k_lo, k_hi;
    visible_key_range(s, m0 + s.offset, m_last + s.offset, k_lo, k_hi);
    const long long j_first = k_lo / BN * BN;
    const int n_tiles = k_hi > j_first ? (int)((k_hi - j_first + BN - 1) / BN) : 0;

    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);

    float o[KS][4];
#pragma unroll
    for (int nd = 0; nd < KS; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};

    if (n_tiles > 0)
        load_tile<BN, DP, PITCH, FERRO_VEC, THREADS>(sK, kb, kv_stride, j_first, s.seq_k, D);
    cp_async_commit();

    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        cp_async_wait<0>();
        __syncthreads();  // K_j landed; every warp is done with V_{j-1}
        load_tile<BN, DP, PITCH, FERRO_VEC, THREADS>(sV, vb, kv_stride, j0, s.seq_k, D);
        cp_async_commit();

        float sc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            float qa[4];
            u32 ab[4], as[4];
            frag_a<PITCH>(sQw + ks * 8, L, qa);
            split_frag(qa, ab, as);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                Split b0, b1;
                frag_b_nk<PITCH>(sK + nt * 8 * PITCH + ks * 8, L, b0, b1);
                mma_3xtf32(sc[nt], ab, as, b0, b1);
            }
        }
        __syncthreads();  // every warp is done with K_j
        if (it + 1 < n_tiles)
            load_tile<BN, DP, PITCH, FERRO_VEC, THREADS>(sK, kb, kv_stride, j0 + BN, s.seq_k, D);
        cp_async_commit();

        // Scores: scale, additive mask, visibility (only where the tile is not wholly visible).
        const long long a_lo = m0 + s.offset, a_hi = m_last + s.offset;
        const bool whole = j0 + BN <= s.seq_k && (!s.causal || j0 + BN - 1 <= a_lo) &&
                           (!s.window || (a_hi - j0 < s.window && j0 + BN - 1 - a_lo < s.window));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const long long i = rows[r >> 1], j = j0 + nt * 8 + 2 * L.t + (r & 1);
                float x = sc[nt][r] * s.scale;
                if (s.has_mask && i < s.seq_q && j < s.seq_k) x += mask_at(s, mask, b, h, i, j);
                if (!whole && !(j < s.seq_k && visible(s, i + s.offset, j))) x = neg_inf();
                sc[nt][r] = x;
            }

        // Online softmax; rows[0] uses c0,c1, rows[1] c2,c3.
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = neg_inf();
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][2 * rr], sc[nt][2 * rr + 1]));
            mx = quad_max(mx);
            const float m_new = fmaxf(m_run[rr], mx);
            const float m_use = m_new == neg_inf() ? 0.f : m_new;  // all -inf so far: keep 0s
            const float alpha = exp2f((m_run[rr] - m_use) * FERRO_LOG2E);
            m_run[rr] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float e = exp2f(sc[nt][2 * rr + c] * FERRO_LOG2E - m_use * FERRO_LOG2E);
                    sum += e;
                    sc[nt][2 * rr + c] = e;
                }
            l_run[rr] = l_run[rr] * alpha + sum;
#pragma unroll
            for (int nd = 0; nd < KS; ++nd) {
                o[nd][2 * rr] *= alpha;
                o[nd][2 * rr + 1] *= alpha;
            }
        }

        // Dropout: P' = P * keep (the 1/(1-p) is applied once at the end); l keeps P's sum.
        if (dropout) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const u32 j = (u32)(j0 + nt * 8 + 2 * L.t);
                    const u32 keep = dropout_keep4(s.seed, thr, bh, (u32)rows[rr], j);
                    const int bit = j & 3;
                    if (!((keep >> bit) & 1)) sc[nt][2 * rr] = 0.f;
                    if (!((keep >> (bit + 1)) & 1)) sc[nt][2 * rr + 1] = 0.f;
                }
        }

        cp_async_wait<1>();
        __syncthreads();  // V_j landed (K_{j+1} may still be in flight)
        add_tile_product<NT, KS, PITCH>(sc, sV, L, o);
    }

    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;
    const u64 ob = ((u64)b * s.seq_q * s.heads + h) * D;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float l = quad_sum(l_run[rr]);
        const float inv = l == 0.f ? 0.f : keep_scale / l;  // no visible key: 0; NaN stays NaN
        const long long i = rows[rr];
        if (i >= s.seq_q) continue;
        float* orow = out + ob + (u64)i * q_stride;
#pragma unroll
        for (int nd = 0; nd < KS; ++nd)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int d = nd * 8 + 2 * L.t + c;
                if (d < D) orow[d] = o[nd][2 * rr + c] * inv;
            }
    }
}
