// Attention backward, second kernel (float32, 3xTF32 tensor-core products): one block = BK keys
// of one (batch, KV head), 4 warps x 16 keys. Reads [Delta, LSE] from the stats the dq kernel
// wrote, loops over the query heads of its GQA group and the query tiles that can see its keys,
// and writes grad_k = scale * sum dS^T q, grad_v = sum P'^T grad_out. No atomics: deterministic.
// Geometry (FERRO_*; FERRO_BN is BQ here) comes from cuda/configs.py.
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_philox.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_mma_tf32.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, THREADS = 32 * WARPS;
constexpr int BK = 16 * WARPS, BQ = FERRO_BN, PITCH = DP + 4;
constexpr int KS = DP / 8, NT = BQ / 8;
static_assert(DP % 8 == 0 && DP <= 128 && FERRO_MT == 1, "tile geometry");
static_assert(4 * (2 * BK + 2 * BQ) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2_bw_dkdv(const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ grad_out,
                      float* __restrict__ grad_k, float* __restrict__ grad_v,
                      const void* __restrict__ mask, const float* __restrict__ stats,
                      const u32 vec, const u32 mask_kind, const AttnLayout lay, const FlashBwdParams p) {
    extern __shared__ __align__(16) float smem[];
    float* sK = smem;               // [BK][PITCH]
    float* sV = sK + BK * PITCH;    // [BK][PITCH]
    float* sQ = sV + BK * PITCH;    // [BQ][PITCH]
    float* sdO = sQ + BQ * PITCH;   // [BQ][PITCH]; columns DP, DP+1 hold the row's Delta, LSE
    const AttnShape s = attn_shape(p, mask_kind);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const u32 k_tiles = (s.seq_k + BK - 1) / BK;
    u32 bhk, tile;  // the first key tiles are seen by the most queries
    block_coords(blockIdx.x, k_tiles, s.batch * s.kv_heads, bhk, tile);
    const u32 b = bhk / s.kv_heads, hk = bhk % s.kv_heads, group = s.heads / s.kv_heads;
    const long long k0 = (long long)tile * BK;
    const long long keys[2] = {k0 + warp * 16 + L.g, k0 + warp * 16 + L.g + 8};

    const Rows rk = rows_of(lay.k, b, hk), rv = rows_of(lay.v, b, hk);
    const Rows gk_rows = rows_of(lay.grad_k, b, hk), gv_rows = rows_of(lay.grad_v, b, hk);
    load_tile<float, BK, DP, PITCH, THREADS>(sK, k + rk.off, rk.stride, k0, s.kv_reach, D, vec);
    load_tile<float, BK, DP, PITCH, THREADS>(sV, v + rv.off, rv.stride, k0, s.kv_reach, D, vec);
    const float* sKw = sK + warp * 16 * PITCH;
    const float* sVw = sV + warp * 16 * PITCH;

    const long long k_last = min((long long)s.seq_k, k0 + BK) - 1;
    long long q_lo, q_hi;
    visible_row_range(s, k0, k_last, q_lo, q_hi);
    const long long i_first = q_lo / BQ * BQ;
    const int n_tiles = q_hi > i_first ? (int)((q_hi - i_first + BQ - 1) / BQ) : 0;

    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);
    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;

    float dk[KS][4], dv[KS][4];
#pragma unroll
    for (int nd = 0; nd < KS; ++nd)
#pragma unroll
        for (int r = 0; r < 4; ++r) dk[nd][r] = dv[nd][r] = 0.f;

    // Steps t = (query head of the group, query tile). Q_{t+1} loads while dV uses dO_t;
    // dO_{t+1} and its stats load while S^T uses Q_{t+1}.
    const int steps = (int)group * n_tiles;
    auto load_q = [&](int t) {
        const u32 h = hk * group + t / n_tiles;
        const long long i0 = i_first + (long long)(t % n_tiles) * BQ;
        const Rows rq = rows_of(lay.q, b, h);
        load_tile<float, BQ, DP, PITCH, THREADS>(sQ, q + rq.off, rq.stride, i0, s.seq_q, D, vec);
    };
    auto load_do = [&](int t) {
        const u32 h = hk * group + t / n_tiles;
        const long long i0 = i_first + (long long)(t % n_tiles) * BQ;
        const Rows rdo = rows_of(lay.grad_out, b, h);
        load_tile<float, BQ, DP, PITCH, THREADS>(sdO, grad_out + rdo.off, rdo.stride, i0, s.seq_q, D, vec);
        const float* st = stats + ((u64)b * s.heads + h) * s.seq_q * 2;
        for (int idx = threadIdx.x; idx < 2 * BQ; idx += THREADS) {
            const bool ok = i0 + idx / 2 < s.seq_q;  // rows past the end: never visible
            // Into sdO's pad columns (never read by the products): the block stays at
            // 99 KB of shared memory, the per-block limit of sm_86/sm_89.
            cp_async<4>(sdO + (idx / 2) * PITCH + DP + (idx & 1), ok ? st + (i0 * 2 + idx) : st, ok);
        }
    };
    if (steps > 0) load_q(0);
    cp_async_commit();  // (with K and V)
    if (steps > 0) load_do(0);
    cp_async_commit();

    for (int t = 0; t < steps; ++t) {
        const u32 h = hk * group + t / n_tiles, bh = b * s.heads + h;
        const long long i0 = i_first + (long long)(t % n_tiles) * BQ;
        const bool more = t + 1 < steps;
        cp_async_wait<1>();
        __syncthreads();  // Q_t (and K, V) landed
        float sT[NT][4], dpT[NT][4];  // [16 keys x BQ queries]: S^T and (dO V^T)^T
        gemm_abt<NT, KS, PITCH>(sKw, sQ, L, sT);
        cp_async_wait<0>();
        __syncthreads();  // dO_t and its stats landed
        gemm_abt<NT, KS, PITCH>(sVw, sdO, L, dpT);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const long long j = keys[r >> 1], i = i0 + nt * 8 + 2 * L.t + (r & 1);
                const int c = nt * 8 + 2 * L.t + (r & 1);
                const bool ok = i < s.seq_q && j < s.seq_k && visible(s, i + s.offset, j);
                float x = sT[nt][r] * s.scale;
                if (s.has_mask && ok) x += mask_at(s, mask, b, h, i, j);
                const float lse = sdO[c * PITCH + DP + 1];
                const float P = ok && lse != neg_inf() ? exp2f((x - lse) * FERRO_LOG2E) : 0.f;
                bool keep = true;
                if (dropout) {
                    keep = (dropout_keep4(s.seed, thr, bh, (u32)i, (u32)j) >> (j & 3)) & 1u;
                }
                const float dP = keep ? dpT[nt][r] * keep_scale : 0.f;
                sT[nt][r] = keep ? P * keep_scale : 0.f;      // P'
                dpT[nt][r] = P * (dP - sdO[c * PITCH + DP]);   // dS
            }
        gemm_acc_ab<NT, KS, PITCH>(dpT, sQ, L, dk);
        __syncthreads();  // every warp is done with Q_t
        if (more) load_q(t + 1);
        cp_async_commit();
        gemm_acc_ab<NT, KS, PITCH>(sT, sdO, L, dv);
        __syncthreads();  // every warp is done with dO_t and its stats
        if (more) load_do(t + 1);
        cp_async_commit();
    }

    cp_async_wait<0>();  // (with no query step, the K/V copies are still in flight)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long j = keys[rr];
        if (j >= s.seq_k) continue;
        float* gk = grad_k + gk_rows.off + (u64)j * gk_rows.stride;
        float* gv = grad_v + gv_rows.off + (u64)j * gv_rows.stride;
#pragma unroll
        for (int nd = 0; nd < KS; ++nd)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int d = nd * 8 + 2 * L.t + c;
                if (d < D) {
                    gk[d] = dk[nd][2 * rr + c] * s.scale;
                    gv[d] = dv[nd][2 * rr + c];
                }
            }
    }
}
