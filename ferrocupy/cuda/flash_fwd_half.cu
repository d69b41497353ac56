// Fused attention forward in float16 / bfloat16 (FlashAttention-2's schedule on mma.sync
// m16n8k16, float32 accumulators and softmax, the output rounded once). One block = BM query rows
// of one (batch, head); each warp owns 16*MT rows. Q is staged in shared memory once; K and V
// tiles of BN keys stream through it by cp.async (V_j loads during S = Q K_j^T, K_{j+1} during the
// softmax and O += P V_j); P stays in registers. Geometry (FERRO_*) comes from cuda/configs.py.
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
constexpr int NT = BN / 8;  // n-tiles of S = k-steps (x2) of P V
constexpr int DT = DP / 8;  // n-tiles of O
static_assert(DP % 16 == 0 && DP <= 256 && BN % 16 == 0, "tile geometry");
static_assert(2 * (BM + 2 * BN) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
flash_fwd_half(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ out, const void* __restrict__ mask, float* __restrict__ lse,
               const int* __restrict__ kv_lens, const u32 vec, const u32 mask_kind, const AttnLayout lay, const FlashV2Params p) {
    extern __shared__ __align__(16) u16 smem_h[];
    u16* sQ = smem_h;             // [BM][PITCH]
    u16* sK = sQ + BM * PITCH;    // [BN][PITCH]
    u16* sV = sK + BN * PITCH;    // [BN][PITCH]
    AttnShape s = attn_shape(p, mask_kind);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const QueryTile T = query_tile<BM, MT>(s, lay, L);

    for_batch(s, kv_lens, T.b);  // before anything reads the keys' extent
    const u16* kb = k + T.k.off;
    const u16* vb = v + T.v.off;

    load_tile<u16, BM, DP, PITCH, THREADS>(sQ, q + T.q.off, T.q.stride, T.m0, s.seq_q, D, vec);
    const u16* sQw = sQ + warp * 16 * MT * PITCH;
    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);

    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);
    const float sl2 = s.scale * FERRO_LOG2E;  // m_run is in raw units

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.f;
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = neg_inf(), l_run[mt][0] = l_run[mt][1] = 0.f;

    if (n_tiles > 0) load_tile<u16, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();

    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        cp_async_wait<0>();
        __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
        load_tile<u16, BN, DP, PITCH, THREADS>(sV, vb, T.v.stride, j0, s.kv_reach, D, vec);
        cp_async_commit();

        float sc[MT][NT][4];
        gemm_abt<MT, NT, DP, PITCH>(sQw, sK, sc);
        __syncthreads();  // every warp is done with K_j
        if (it + 1 < n_tiles)
            load_tile<u16, BN, DP, PITCH, THREADS>(sK, kb, T.k.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();

        const bool whole = keys_wholly_visible<BN>(s, T, j0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // Scores stay raw (q.k) on the common tile; a tile that needs the per-element rules
            // is scaled, masked, and brought back to raw units.
            if (!whole || s.has_mask) {
                score_tile<NT>(s, mask, T.b, T.h, T.row(mt, 0), T.row(mt, 1), j0, whole, L, sc[mt]);
                const float inv_scale = 1.f / s.scale;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) sc[mt][nt][r] *= inv_scale;
            }
            float alpha[2];
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
                alpha[rr] = online_softmax_raw<NT>(sc[mt], rr, m_run[mt][rr], l_run[mt][rr], sl2);
            // Rescale O only when some row's max moved (alpha != 1): after the first tiles it
            // rarely does, and the multiply by exactly 1 is skipped, not approximated.
            if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
                for (int nd = 0; nd < DT; ++nd) {
                    o[mt][nd][0] *= alpha[0];
                    o[mt][nd][1] *= alpha[0];
                    o[mt][nd][2] *= alpha[1];
                    o[mt][nd][3] *= alpha[1];
                }
            }
            // Dropout: P' = P * keep (the 1/(1-p) is applied once at the end); l keeps P's sum.
            if (dropout) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        const u32 j = (u32)(j0 + nt * 8 + 2 * L.t);
                        const u32 keep = dropout_keep4(s.seed, thr, T.bh, (u32)T.row(mt, rr), j) >> (j & 3);
                        if (!(keep & 1u)) sc[mt][nt][2 * rr] = 0.f;
                        if (!(keep & 2u)) sc[mt][nt][2 * rr + 1] = 0.f;
                    }
            }
        }

        cp_async_wait<1>();
        __syncthreads();  // V_j landed (K_{j+1} may still be in flight)
        gemm_acc_ab<MT, NT, DP, PITCH>(sc, sV, o);
    }

    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const float l = quad_sum(l_run[mt][rr]);
            const float inv = l == 0.f ? 0.f : keep_scale / l;  // no visible key: 0; NaN stays NaN
            const long long i = T.row(mt, rr);
            if (i >= s.seq_q) continue;
            if (lse && L.t == 0) lse[(u64)T.bh * s.seq_q + i] = row_lse(m_run[mt][rr] * s.scale, l);
            u16* orow = out + T.o.off + (u64)i * T.o.stride;
#pragma unroll
            for (int nd = 0; nd < DT; ++nd) {
                const int d = nd * 8 + 2 * L.t;
                const float x0 = o[mt][nd][2 * rr] * inv, x1 = o[mt][nd][2 * rr + 1] * inv;
                if (vec > 1) {  // head_dim even and rows 4-byte aligned: one store per pair
                    if (d < D) *reinterpret_cast<u32*>(orow + d) = pack2(x0, x1);
                } else {
                    if (d < D) orow[d] = round1(x0);
                    if (d + 1 < D) orow[d + 1] = round1(x1);
                }
            }
        }
}
