// Fused attention forward in float16 / bfloat16 on sm_90a's warpgroup tensor cores (wgmma), for
// head_dim up to 64 or 128 with 16-byte rows. A block is two warpgroups (8 warps) over BM = 128
// query rows of one (batch, head); each warpgroup owns 64 rows, each warp 16. Q is staged once;
// K and V tiles of BN keys stream through three buffers by cp.async. S = Q K^T reads both
// operands from shared memory; P stays in registers as the A operand of O += P V, which runs on
// the tensor cores while the warps do the next tile's softmax. Softmax, masks and dropout are the mma.sync kernel's, element for element
// (the accumulator layout is the same). Geometry (FERRO_*) comes from cuda/configs.py.
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_philox.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_mma_f16.cuh"
#include "ferro_wgmma.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, BN = FERRO_BN;
constexpr int THREADS = 32 * WARPS, BM = 16 * WARPS;
constexpr int NT = BN / 8;  // n-tiles of S; 16-key k-steps of P V are NT / 2
constexpr int DT = DP / 8;  // n-tiles of O
constexpr int Q_ELEMS = BM * DP, KV_ELEMS = BN * DP;
constexpr int STAGES = 3;  // K/V buffers: tile t in use by S, t - 1 by P V, t + 1 loading
static_assert(FERRO_MT == 1 && WARPS % 4 == 0, "whole warpgroups, 16 rows per warp");
static_assert((DP == 64 || DP == 128) && (BN == 64 || BN == 128), "wgmma tile geometry");
// Q, the K and V buffers, and 1 KB to align the base for the 128-byte swizzle.
static_assert(2 * (Q_ELEMS + 2 * STAGES * KV_ELEMS) + 1024 == FERRO_SMEM_BYTES, "configs.py's shared memory");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_fwd_wgmma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                u16* __restrict__ out, const void* __restrict__ mask, float* __restrict__ lse,
                const int* __restrict__ kv_lens, const u32 vec, const u32 mask_kind, const FlashV2Params p) {
    extern __shared__ __align__(1024) u16 smem_w[];
    const u32 raw = smem_u32(smem_w);
    u16* sQ = smem_w + (((1024u - (raw & 1023u)) & 1023u) >> 1);  // 1024-byte aligned
    u16* sK = sQ + Q_ELEMS;            // [STAGES][BN x DP], swizzled
    u16* sV = sK + STAGES * KV_ELEMS;  // [STAGES][BN x DP], swizzled
    AttnShape s = attn_shape(p, mask_kind);
    const Lane L = lane_ids();
    const int D = s.head_dim, wg = threadIdx.x >> 7;
    (void)vec;  // always 16-byte copies: the backend picks this kernel only then

    const QueryTile T = query_tile<BM, 1>(s, L);

    for_batch(s, kv_lens, T.b);  // before anything reads the keys' extent
    const u16* kb = k + T.kv_off;
    const u16* vb = v + T.kv_off;
    const u64 kv_stride = T.kv_stride;
    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);

    const bool dropout = s.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s.dropout_prob);
    const float sl2 = s.scale * FERRO_LOG2E;  // m_run is in raw units
    const u32 q_tile = smem_u32(sQ) + wg * 64 * 128;  // this warpgroup's 64 rows
    auto k_tile = [&](int t) { return smem_u32(sK + (t % STAGES) * KV_ELEMS); };
    auto v_tile = [&](int t) { return smem_u32(sV + (t % STAGES) * KV_ELEMS); };
    auto load_kv = [&](int t) {
        const long long j = j_first + (long long)t * BN;
        load_tile_sw128<BN, DP, THREADS>(sK + (t % STAGES) * KV_ELEMS, kb, kv_stride, j, s.kv_reach, D);
        load_tile_sw128<BN, DP, THREADS>(sV + (t % STAGES) * KV_ELEMS, vb, kv_stride, j, s.kv_reach, D);
    };
    // S = Q K_t^T, issued (the caller commits and waits).
    auto issue_s = [&](float (&sc)[NT][4], int t) {
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            wgmma_ss(sc, desc_k_major<BM>(q_tile, kk), desc_k_major<BN>(k_tile(t), kk), kk > 0);
    };

    float o[DT][4];
#pragma unroll
    for (int nd = 0; nd < DT; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    u32 pa[NT / 2][4];  // P of the previous tile, rounded: the A operand of O += P V

    // Softmax of tile t's scores into P (as A fragments); returns each row's rescale factor.
    auto softmax_to_p = [&](float (&sc)[NT][4], int t, float (&alpha)[2]) {
        const long long j0 = j_first + (long long)t * BN;
        // Scores stay raw (q.k) on the common tile; a tile that needs the per-element rules is
        // scaled, masked, and brought back to raw units.
        const bool whole = keys_wholly_visible<BN>(s, T, j0);
        if (!whole || s.has_mask) {
            score_tile<NT>(s, mask, T.b, T.h, T.row(0, 0), T.row(0, 1), j0, whole, L, sc);
            const float inv_scale = 1.f / s.scale;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) sc[nt][r] *= inv_scale;
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) alpha[rr] = online_softmax_raw<NT>(sc, rr, m_run[rr], l_run[rr], sl2);
        // Dropout: P' = P * keep (the 1/(1-p) is applied once at the end); l keeps P's sum.
        if (dropout) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const u32 j = (u32)(j0 + nt * 8 + 2 * L.t);
                    const u32 keep = dropout_keep4(s.seed, thr, T.bh, (u32)T.row(0, rr), j) >> (j & 3);
                    if (!(keep & 1u)) sc[nt][2 * rr] = 0.f;
                    if (!(keep & 2u)) sc[nt][2 * rr + 1] = 0.f;
                }
        }
    };
    auto to_a = [&](const float (&sc)[NT][4]) {
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            pa[kk][0] = pack2(sc[2 * kk][0], sc[2 * kk][1]);
            pa[kk][1] = pack2(sc[2 * kk][2], sc[2 * kk][3]);
            pa[kk][2] = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[kk][3] = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
    };
    auto issue_pv = [&](int t) {
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) wgmma_rs(o, pa[kk], desc_mn_major<BN>(v_tile(t), kk), 1);
    };

    // Pipeline (FlashAttention-3's within a warpgroup): while the tensor cores do O += P_{t-1}
    // V_{t-1}, the warps do tile t's softmax. Tile t + 1 loads during iteration t into the
    // buffer tile t - 2 used; the one barrier per iteration says every warp is done with it.
    load_tile_sw128<BM, DP, THREADS>(sQ, q + T.q_off, T.q_stride, T.m0, s.seq_q, D);
    if (n_tiles > 0) load_kv(0);
    cp_async_commit();
    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // tile t (and Q) landed and is visible to the tensor cores
        if (t + 1 < n_tiles) load_kv(t + 1);
        cp_async_commit();

        float sc[NT][4];
        wgmma_fence();
        issue_s(sc, t);
        wgmma_commit();
        if (t > 0) issue_pv(t - 1);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_pin(sc);
        float alpha[2];
        softmax_to_p(sc, t, alpha);
        wgmma_wait<0>();
        wgmma_pin(o);
        // Rescale O only when some row's max moved (alpha != 1).
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int nd = 0; nd < DT; ++nd) {
                o[nd][0] *= alpha[0];
                o[nd][1] *= alpha[0];
                o[nd][2] *= alpha[1];
                o[nd][3] *= alpha[1];
            }
        }
        to_a(sc);
    }
    if (n_tiles > 0) {
        wgmma_fence();
        issue_pv(n_tiles - 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(o);
    }

    const float keep_scale = dropout ? 1.f / (1.f - s.dropout_prob) : 1.f;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float l = quad_sum(l_run[rr]);
        const float inv = l == 0.f ? 0.f : keep_scale / l;  // no visible key: 0; NaN stays NaN
        const long long i = T.row(0, rr);
        if (i >= s.seq_q) continue;
        if (lse && L.t == 0) lse[(u64)T.bh * s.seq_q + i] = row_lse(m_run[rr] * s.scale, l);
        u16* orow = out + T.q_off + (u64)i * T.q_stride;
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) {
            const int d = nd * 8 + 2 * L.t;
            if (d < D) *reinterpret_cast<u32*>(orow + d) = pack2(o[nd][2 * rr] * inv, o[nd][2 * rr + 1] * inv);
        }
    }
}
