// Attention backward, first kernel (float32, 3xTF32 tensor-core products): one block = BM query
// rows of one (batch, head). Writes each row's [Delta, LSE] into the stats buffer (LSE is the
// forward's when given as `lse_in`, else a first pass over the visible keys computes it), then
// recomputes P and writes grad_q = scale * sum_j dS_ij k_j with dS = P (dP - Delta). No atomics.
// Geometry (FERRO_*) comes from cuda/configs.py.
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_philox.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_mma_tf32.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, THREADS = 32 * WARPS;
constexpr int BM = 16 * WARPS, BN = FERRO_BN, PITCH = DP + 4;
constexpr int KS = DP / 8, NT = BN / 8;
static_assert(DP % 8 == 0 && DP <= 128 && FERRO_MT == 1, "tile geometry");
static_assert(4 * (2 * BM + 2 * BN) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2_bw_dq(const float* __restrict__ q, const float* __restrict__ k,
                    const float* __restrict__ v, const float* __restrict__ out,
                    const float* __restrict__ grad_out, float* __restrict__ grad_q,
                    const void* __restrict__ mask, float* __restrict__ stats,
                    const float* __restrict__ lse_in, const u32 vec, const u32 mask_kind,
                    const AttnLayout lay, const FlashBwdParams p) {
    extern __shared__ __align__(16) float smem[];
    float* sQ = smem;               // [BM][PITCH]
    float* sdO = sQ + BM * PITCH;   // [BM][PITCH]
    float* sK = sdO + BM * PITCH;   // [BN][PITCH]
    float* sV = sK + BN * PITCH;    // [BN][PITCH]
    const AttnShape s = attn_shape(p, mask_kind);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const QueryTile T = query_tile<BM, 1>(s, lay, L);
    const u32 bh = T.bh;
    const long long m0 = T.m0;
    const long long rows[2] = {T.row(0, 0), T.row(0, 1)};
    const Rows dO = rows_of(lay.grad_out, T.b, T.h), dQ = rows_of(lay.grad_q, T.b, T.h);
    const float* kb = k + T.k.off;
    const float* vb = v + T.v.off;

    load_tile<float, BM, DP, PITCH, THREADS>(sQ, q + T.q.off, T.q.stride, m0, s.seq_q, D, vec);
    load_tile<float, BM, DP, PITCH, THREADS>(sdO, grad_out + dO.off, dO.stride, m0, s.seq_q, D, vec);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const float* sQw = sQ + warp * 16 * PITCH;
    const float* sdOw = sdO + warp * 16 * PITCH;

    // Delta_i = grad_out_i . out_i
    float delta[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float acc = 0.f;
        const long long i = rows[rr];
        if (i < s.seq_q) {
            const float* orow = out + T.o.off + (u64)i * T.o.stride;
            for (int d = L.t; d < D; d += 4) acc += sdOw[(L.g + 8 * rr) * PITCH + d] * orow[d];
        }
        delta[rr] = quad_sum(acc);
    }

    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);

    float lse[2];
    if (lse_in) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
            lse[rr] = rows[rr] < s.seq_q ? lse_in[(u64)bh * s.seq_q + rows[rr]] : neg_inf();
    } else {
        // Pass 1: LSE_i = m + log(sum exp(s - m)) over the visible keys. Only K is read, so sK and
        // sV double-buffer it: tile j+1 loads while tile j is multiplied.
        float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
        if (n_tiles > 0)
            load_tile<float, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j_first, s.kv_reach, D, vec);
        cp_async_commit();
        for (int it = 0; it < n_tiles; ++it) {
            const long long j0 = j_first + (long long)it * BN;
            cp_async_wait<0>();
            __syncthreads();  // tile j landed; every warp is done with tile j-1's buffer
            if (it + 1 < n_tiles)
                load_tile<float, BN, DP, PITCH, THREADS>((it & 1) ? sK : sV, kb, T.k.stride,
                                                             j0 + BN, s.kv_reach, D, vec);
            cp_async_commit();
            float sc[NT][4];
            gemm_abt<NT, KS, PITCH>(sQw, (it & 1) ? sV : sK, L, sc);
            score_tile<NT>(s, mask, T.b, T.h, rows[0], rows[1], j0, keys_wholly_visible<BN>(s, T, j0), L, sc);
            online_softmax<NT>(sc, 0, m_run[0], l_run[0]);
            online_softmax<NT>(sc, 1, m_run[1], l_run[1]);
        }
        __syncthreads();  // both buffers are reloaded by pass 2
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) lse[rr] = row_lse(m_run[rr], quad_sum(l_run[rr]));
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long i = rows[rr];
        if (L.t == 0 && i < s.seq_q) {
            float* st = stats + ((u64)bh * s.seq_q + i) * 2;
            st[0] = delta[rr];
            st[1] = lse[rr];
        }
    }

    // Pass 2: dQ += dS K with dS = P (dP - Delta), dP = (dO V^T) * keep / (1 - p).
    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);
    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;
    float dq[KS][4];
#pragma unroll
    for (int nd = 0; nd < KS; ++nd) dq[nd][0] = dq[nd][1] = dq[nd][2] = dq[nd][3] = 0.f;

    // V_{j+1} loads while S, dS and dQ use K_j; K_{j+1} loads while dP uses V_{j+1}.
    if (n_tiles > 0)
        load_tile<float, BN, DP, PITCH, THREADS>(sV, vb, T.v.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();
    if (n_tiles > 0)
        load_tile<float, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        const bool more = it + 1 < n_tiles;
        cp_async_wait<1>();
        __syncthreads();  // V_j landed
        float sc[NT][4], dp[NT][4];
        gemm_abt<NT, KS, PITCH>(sdOw, sV, L, dp);
        __syncthreads();  // every warp is done with V_j
        if (more) load_tile<float, BN, DP, PITCH, THREADS>(sV, vb, T.v.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // K_j landed
        gemm_abt<NT, KS, PITCH>(sQw, sK, L, sc);
        score_tile<NT>(s, mask, T.b, T.h, rows[0], rows[1], j0, keys_wholly_visible<BN>(s, T, j0), L, sc);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 keep = 0xFu;
            if (dropout) {
                // Both columns 2t, 2t+1 share one Philox block; j & 3 selects the word.
                const u32 j = (u32)(j0 + nt * 8 + 2 * L.t);
                keep = (dropout_keep4(s.seed, thr, bh, (u32)rows[0], j) >> (j & 3)) & 3u;
                keep |= ((dropout_keep4(s.seed, thr, bh, (u32)rows[1], j) >> (j & 3)) & 3u) << 2;
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float pr = exp2f((sc[nt][r] - lse[r >> 1]) * FERRO_LOG2E);
                // 0 where not visible, and for a row that sees nothing (LSE = -inf)
                const float P = sc[nt][r] == neg_inf() || lse[r >> 1] == neg_inf() ? 0.f : pr;
                const float dP = ((keep >> r) & 1) ? dp[nt][r] * keep_scale : 0.f;
                sc[nt][r] = P * (dP - delta[r >> 1]);
            }
        }
        gemm_acc_ab<NT, KS, PITCH>(sc, sK, L, dq);
        __syncthreads();  // every warp is done with K_j
        if (more) load_tile<float, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();
    }

#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long i = rows[rr];
        if (i >= s.seq_q) continue;
        float* grow = grad_q + dQ.off + (u64)i * dQ.stride;
#pragma unroll
        for (int nd = 0; nd < KS; ++nd)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int d = nd * 8 + 2 * L.t + c;
                if (d < D) grow[d] = dq[nd][2 * rr + c] * s.scale;
            }
    }
}
