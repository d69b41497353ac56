// Attention backward, first kernel, float16 / bfloat16 (mma.sync m16n8k16, float32 accumulators):
// one block = BM query rows of one (batch, head), each warp 16*MT of them. Writes each row's
// [Delta, LSE] into the stats buffer for the dK/dV kernel, and grad_q = scale * sum_j dS_ij k_j
// with dS = P (dP - Delta), rounded once. LSE is the forward's when given (`lse_in`), else a first
// pass over the visible keys computes it. No atomics. Geometry comes from cuda/configs.py.
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_philox.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_mma_f16.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, MT = FERRO_MT, BN = FERRO_BN;
constexpr int THREADS = 32 * WARPS, BM = 16 * MT * WARPS, PITCH = DP + 8;
constexpr int NT = BN / 8, DT = DP / 8;
static_assert(DP % 16 == 0 && DP <= 256 && BN % 16 == 0, "tile geometry");
static_assert(2 * (2 * BM + 2 * BN) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
flash_bwd_dq_half(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                  const u16* __restrict__ out, const u16* __restrict__ grad_out,
                  u16* __restrict__ grad_q, const void* __restrict__ mask,
                  float* __restrict__ stats, const float* __restrict__ lse_in, const u32 vec,
                  const u32 mask_kind, const AttnLayout lay, const FlashBwdParams p) {
    extern __shared__ __align__(16) u16 smem_h[];
    u16* sQ = smem_h;              // [BM][PITCH]
    u16* sdO = sQ + BM * PITCH;    // [BM][PITCH]
    u16* sK = sdO + BM * PITCH;    // [BN][PITCH]
    u16* sV = sK + BN * PITCH;     // [BN][PITCH]
    const AttnShape s = attn_shape(p, mask_kind);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const QueryTile T = query_tile<BM, MT>(s, lay, L);
    const Rows dO = rows_of(lay.grad_out, T.b, T.h), dQ = rows_of(lay.grad_q, T.b, T.h);
    const u16* kb = k + T.k.off;
    const u16* vb = v + T.v.off;

    load_tile<u16, BM, DP, PITCH, THREADS>(sQ, q + T.q.off, T.q.stride, T.m0, s.seq_q, D, vec);
    load_tile<u16, BM, DP, PITCH, THREADS>(sdO, grad_out + dO.off, dO.stride, T.m0, s.seq_q, D, vec);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const u16* sQw = sQ + warp * 16 * MT * PITCH;
    const u16* sdOw = sdO + warp * 16 * MT * PITCH;

    // Delta_i = grad_out_i . out_i, both as stored (rounded), summed in float32.
    float delta[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float acc = 0.f;
            const long long i = T.row(mt, rr);
            if (i < s.seq_q) {
                const u16* orow = out + T.o.off + (u64)i * T.o.stride;
                const u16* drow = sdOw + (16 * mt + 8 * rr + L.g) * PITCH;
                for (int d = L.t; d < D; d += 4) acc += widen(drow[d]) * widen(orow[d]);
            }
            delta[mt][rr] = quad_sum(acc);
        }

    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);

    float lse[MT][2];
    if (lse_in) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const long long i = T.row(mt, rr);
                lse[mt][rr] = i < s.seq_q ? lse_in[(u64)T.bh * s.seq_q + i] : neg_inf();
            }
    } else {
        // Pass 1: LSE_i = m + log(sum exp(s - m)) over the visible keys. Only K is read, so sK
        // and sV double-buffer it: tile j+1 loads while tile j is multiplied.
        float m_run[MT][2], l_run[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = neg_inf(), l_run[mt][0] = l_run[mt][1] = 0.f;
        if (n_tiles > 0) load_tile<u16, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j_first, s.kv_reach, D, vec);
        cp_async_commit();
        for (int it = 0; it < n_tiles; ++it) {
            const long long j0 = j_first + (long long)it * BN;
            cp_async_wait<0>();
            __syncthreads();  // tile j landed; every warp is done with tile j-1's buffer
            if (it + 1 < n_tiles)
                load_tile<u16, BN, DP, PITCH, THREADS>((it & 1) ? sK : sV, kb, T.k.stride, j0 + BN,
                                                       s.kv_reach, D, vec);
            cp_async_commit();
            float sc[MT][NT][4];
            gemm_abt<MT, NT, DP, PITCH>(sQw, (it & 1) ? sV : sK, sc);
            const bool whole = keys_wholly_visible<BN>(s, T, j0);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                score_tile<NT>(s, mask, T.b, T.h, T.row(mt, 0), T.row(mt, 1), j0, whole, L, sc[mt]);
                online_softmax<NT>(sc[mt], 0, m_run[mt][0], l_run[mt][0]);
                online_softmax<NT>(sc[mt], 1, m_run[mt][1], l_run[mt][1]);
            }
        }
        __syncthreads();  // both buffers are reloaded by pass 2
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) lse[mt][rr] = row_lse(m_run[mt][rr], quad_sum(l_run[mt][rr]));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const long long i = T.row(mt, rr);
            if (L.t == 0 && i < s.seq_q) {
                float* st = stats + ((u64)T.bh * s.seq_q + i) * 2;
                st[0] = delta[mt][rr];
                st[1] = lse[mt][rr];
            }
        }

    // Pass 2: dQ += dS K with dS = P (dP - Delta), dP = (dO V^T) * keep / (1 - p).
    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);
    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;
    float dq[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) dq[mt][nd][0] = dq[mt][nd][1] = dq[mt][nd][2] = dq[mt][nd][3] = 0.f;

    // V_{j+1} loads while S, dS and dQ use K_j; K_{j+1} loads while dP uses V_{j+1}.
    if (n_tiles > 0) load_tile<u16, BN, DP, PITCH, THREADS>(sV, vb, T.v.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();
    if (n_tiles > 0) load_tile<u16, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        const bool more = it + 1 < n_tiles;
        cp_async_wait<1>();
        __syncthreads();  // V_j landed
        float sc[MT][NT][4], dpr[MT][NT][4];
        gemm_abt<MT, NT, DP, PITCH>(sdOw, sV, dpr);
        __syncthreads();  // every warp is done with V_j
        if (more) load_tile<u16, BN, DP, PITCH, THREADS>(sV, vb, T.v.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // K_j landed
        gemm_abt<MT, NT, DP, PITCH>(sQw, sK, sc);
        const bool whole = keys_wholly_visible<BN>(s, T, j0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            score_tile<NT>(s, mask, T.b, T.h, T.row(mt, 0), T.row(mt, 1), j0, whole, L, sc[mt]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 keep = 0xFu;
                if (dropout) {
                    // Both columns 2t, 2t+1 share one Philox block; j & 3 selects the word.
                    const u32 j = (u32)(j0 + nt * 8 + 2 * L.t);
                    keep = (dropout_keep4(s.seed, thr, T.bh, (u32)T.row(mt, 0), j) >> (j & 3)) & 3u;
                    keep |= ((dropout_keep4(s.seed, thr, T.bh, (u32)T.row(mt, 1), j) >> (j & 3)) & 3u) << 2;
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float l = lse[mt][r >> 1];
                    const float x = sc[mt][nt][r];
                    // 0 where not visible, and for a row that sees nothing (LSE = -inf).
                    const float P = x == neg_inf() || l == neg_inf()
                                        ? 0.f : exp2f((x - l) * FERRO_LOG2E);
                    const float dP = ((keep >> r) & 1) ? dpr[mt][nt][r] * keep_scale : 0.f;
                    sc[mt][nt][r] = P * (dP - delta[mt][r >> 1]);
                }
            }
        }
        gemm_acc_ab<MT, NT, DP, PITCH>(sc, sK, dq);  // sc holds dS
        __syncthreads();  // every warp is done with K_j
        if (more) load_tile<u16, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const long long i = T.row(mt, rr);
            if (i >= s.seq_q) continue;
            u16* grow = grad_q + dQ.off + (u64)i * dQ.stride;
#pragma unroll
            for (int nd = 0; nd < DT; ++nd) {
                const int d = nd * 8 + 2 * L.t;
                const float x0 = dq[mt][nd][2 * rr] * s.scale, x1 = dq[mt][nd][2 * rr + 1] * s.scale;
                if (vec > 1) {
                    if (d < D) *reinterpret_cast<u32*>(grow + d) = pack2(x0, x1);
                } else {
                    if (d < D) grow[d] = round1(x0);
                    if (d + 1 < D) grow[d + 1] = round1(x1);
                }
            }
        }
}
