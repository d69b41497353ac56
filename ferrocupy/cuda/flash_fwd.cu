// Fused attention forward, float32 (FlashAttention-2 schedule, 3xTF32 tensor-core products).
// One block = BM query rows of one (batch, head); each warp 16 rows. K and V tiles of BN keys
// stream through shared memory (cp.async: V_j loads during S = Q K_j^T, K_{j+1} during softmax and
// P V_j); Q is staged in shared memory once; online softmax in float32; no S x S matrix in global
// memory. Geometry (FERRO_*: padded head_dim, a multiple of 16; warps; BN) comes from
// cuda/configs.py, the one table the backend and the compile tests read.
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
constexpr int KS = DP / 8;  // k-steps of Q K^T = n-tiles of P V
constexpr int NT = BN / 8;  // n-tiles of Q K^T = k-steps of P V
static_assert(DP % 8 == 0 && DP <= 128 && FERRO_MT == 1, "tile geometry");
static_assert(4 * (BM + 2 * BN) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2(const float* __restrict__ q, const float* __restrict__ k,
              const float* __restrict__ v, float* __restrict__ out,
              const void* __restrict__ mask, float* __restrict__ lse,
              const int* __restrict__ kv_lens, const u32 vec,
              const u32 mask_kind, const AttnLayout lay, const FlashV2Params p) {
    extern __shared__ __align__(16) float smem[];
    float* sQ = smem;  // [BM][PITCH]
    float* sK = sQ + BM * PITCH;  // [BN][PITCH]
    float* sV = sK + BN * PITCH;  // [BN][PITCH]
    AttnShape s = attn_shape(p, mask_kind);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const QueryTile T = query_tile<BM, 1>(s, lay, L);

    for_batch(s, kv_lens, T.b);  // before anything reads the keys' extent
    const long long rows[2] = {T.row(0, 0), T.row(0, 1)};
    const u32 bh = T.bh;
    const long long m0 = T.m0;
    const float* kb = k + T.k.off;
    const float* vb = v + T.v.off;

    // This block's query rows, staged once in shared memory (A fragments are read per k-step:
    // holding them in registers as well as O and S spills at head_dim 128).
    load_tile<float, BM, DP, PITCH, THREADS>(sQ, q + T.q.off, T.q.stride, m0, s.seq_q, D, vec);
    const float* sQw = sQ + warp * 16 * PITCH;
    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);

    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);

    float o[KS][4];
#pragma unroll
    for (int nd = 0; nd < KS; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};

    if (n_tiles > 0)
        load_tile<float, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();

    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        cp_async_wait<0>();
        __syncthreads();  // K_j landed; every warp is done with V_{j-1}
        load_tile<float, BN, DP, PITCH, THREADS>(sV, vb, T.v.stride, j0, s.kv_reach, D, vec);
        cp_async_commit();

        float sc[NT][4];
        gemm_abt<NT, KS, PITCH>(sQw, sK, L, sc);
        __syncthreads();  // every warp is done with K_j
        if (it + 1 < n_tiles)
            load_tile<float, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();

        score_tile<NT>(s, mask, T.b, T.h, rows[0], rows[1], j0, keys_wholly_visible<BN>(s, T, j0), L, sc);

        // Online softmax; row T.rows[0] holds c0, c1 and T.rows[1] c2, c3.
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const float alpha = online_softmax<NT>(sc, rr, m_run[rr], l_run[rr]);
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
        gemm_acc_ab<NT, KS, PITCH>(sc, sV, L, o);
    }

    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float l = quad_sum(l_run[rr]);
        const float inv = l == 0.f ? 0.f : keep_scale / l;  // no visible key: 0; NaN stays NaN
        const long long i = rows[rr];
        if (i >= s.seq_q) continue;
        if (lse && L.t == 0) lse[(u64)bh * s.seq_q + i] = row_lse(m_run[rr], l);
        float* orow = out + T.o.off + (u64)i * T.o.stride;
#pragma unroll
        for (int nd = 0; nd < KS; ++nd)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int d = nd * 8 + 2 * L.t + c;
                if (d < D) orow[d] = o[nd][2 * rr + c] * inv;
            }
    }
}
