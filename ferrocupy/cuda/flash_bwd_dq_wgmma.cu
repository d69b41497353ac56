// Attention backward, first kernel, float16 / bfloat16 on sm_90a's warpgroup tensor cores
// (wgmma), for calls that pass the forward's LSE. One block =
// BM = 64 x (WARPS / 4) query rows of one (batch, head), warp-specialized like the wgmma forward:
// a loading warpgroup fetches the block's Q and dO, then fills a ring of STAGES K/V tiles (BN
// keys each); each computing warpgroup owns 64 rows and visits the key tiles they can see:
//   S  = Q K^T,  dP = dO V^T     (wgmma, from shared memory)
//   P  = exp(scale S + mask - LSE), 0 where a key is not visible to the row
//   dS = P (keep dP / (1 - p) - Delta),  dQ += dS K   (keep: dropout's bit, 1 without it;
//                                                   wgmma, dS from registers, rounded)
// The mask and dropout are the build's options (ferro_score.cuh; a `plain` build has neither).
// Writes each row's [Delta, LSE] into the stats for the dK/dV kernel, and grad_q = scale dQ,
// rounded once. No atomics. The products and roundings are those of flash_bwd_dq.cu's half build
// (P's exponent is formed as one fma here); geometry from cuda/configs.py.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"
#include "ferro_mma_f16.cuh"
#include "ferro_wgmma.cuh"
#include "ferro_mbarrier.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, BN = FERRO_BN, STAGES = FERRO_STAGES;
constexpr int LOADERS = 128, THREADS = LOADERS + 32 * WARPS, BM = 16 * WARPS;
constexpr int NT = BN / 8;  // n-tiles of S and dP; k-steps of dQ += dS K: NT / 2
constexpr int DT = DP / 8;  // n-tiles of dQ
constexpr int Q_ELEMS = BM * DP, KV_ELEMS = BN * DP;
constexpr int LOADER_REGS = 24, COMPUTE_REGS = 240;
static_assert(FERRO_MT == 1 && WARPS % 4 == 0, "whole warpgroups, 16 rows per warp");
static_assert((DP == 64 || DP == 128 || DP == 192 || DP == 256) && BN == 64, "wgmma tile geometry");
static_assert(LOADERS * LOADER_REGS + 32 * WARPS * COMPUTE_REGS <= 65536, "register file");
// Q and dO, the ring of K and V (swizzled), 1 KB to align the base.
static_assert(2 * (2 * Q_ELEMS + 2 * STAGES * KV_ELEMS) + 1024 == FERRO_SMEM_BYTES,
              "configs.py's shared memory");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_bwd_dq_wgmma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                   const u16* __restrict__ out, const u16* __restrict__ grad_out,
                   u16* __restrict__ grad_q, const void* __restrict__ mask,
                   float* __restrict__ stats, const float* __restrict__ lse_in,
                   const float* __restrict__ alibi, const float* __restrict__ sinks,
                   const int* __restrict__ cu_q, const int* __restrict__ cu_k, const u32 vec,
                   const u32 mask_kind, const AttnLayout lay, const FlashBwdParams p,
                   const AttnExtras ex) {
    extern __shared__ __align__(1024) u16 smem_w[];
    __shared__ u64 q_full, full[STAGES], empty[STAGES];
    const u32 raw = smem_u32(smem_w);
    u16* sQ = smem_w + (((1024u - (raw & 1023u)) & 1023u) >> 1);  // 1024-byte aligned
    u16* sdO = sQ + Q_ELEMS;
    u16* sK = sdO + Q_ELEMS;            // [STAGES][BN x DP], swizzled
    u16* sV = sK + STAGES * KV_ELEMS;   // [STAGES][BN x DP], swizzled
    AttnShape s = attn_shape(p, ex, mask_kind);
    if (BuildOptions::MODS) with_extras(s, ex, alibi, sinks);  // (the given lse holds any sink)
    with_varlen(s, ex, cu_q, cu_k);
    const Lane L = lane_ids();
    const int D = s.head_dim, wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0);  // 0 loads
    (void)vec;  // 16-byte rows and the forward's lse: the backend picks it only then

    QueryTile T = query_tile<BM, 1>(s, lay, L);  // (s: its batch entry's)
    if (T.empty()) return;  // a varlen tile past its sequence's rows (the whole block leaves)
    T.row0 = T.m0 + ((int)(threadIdx.x >> 5) - LOADERS / 32) * 16 + L.g;  // computing warps' rows
    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);
    const Rows rdo = q_rows(s, lay.grad_out, T.b, T.h);
    const u64 row0 = row_index(s, T.b, T.h);  // of lse_in and the stats

    if (threadIdx.x == 0) {
        mbar_init(&q_full, LOADERS);
        mbar_init_ring(full, empty, LOADERS, 32 * WARPS);
    }
    __syncthreads();

    if (wg == 0) {  // ---- the loading warpgroup --------------------------------------------------
        regs_shrink<LOADER_REGS>();
        load_tile_sw128<BM, DP, LOADERS>(sQ, q + T.q.off, T.q.stride, T.m0, s.seq_q, D);
        load_tile_sw128<BM, DP, LOADERS>(sdO, grad_out + rdo.off, rdo.stride, T.m0, s.seq_q, D);
        mbar_arrive_cp_async(&q_full);
        const u16* kb = k + T.k.off;
        const u16* vb = v + T.v.off;
        for (int t = 0; t < n_tiles; ++t) {
            const int st = t % STAGES;
            ring_wait_empty(empty, t);  // tile t - STAGES is used
            const long long j = j_first + (long long)t * BN;
            load_tile_sw128<BN, DP, LOADERS>(sK + st * KV_ELEMS, kb, T.k.stride, j, s.kv_reach, D);
            load_tile_sw128<BN, DP, LOADERS>(sV + st * KV_ELEMS, vb, T.v.stride, j, s.kv_reach, D);
            mbar_arrive_cp_async(&full[st]);
        }
        cp_async_wait<0>();  // nothing in flight when the block ends
        return;
    }

    // ---- the computing warpgroups: 64 rows each ------------------------------------------------
    regs_grow<COMPUTE_REGS>();
    const u32 q_slice = smem_u32(sQ) + (wg - 1) * 64 * 128;  // this warpgroup's 64 rows
    const u32 do_slice = smem_u32(sdO) + (wg - 1) * 64 * 128;
    const float sl2 = s.scale * FERRO_LOG2E;
    const Dropout<BuildOptions::DROPOUT> drop(s);
    const float keep_scale = drop.keep_scale();
    const float slope = BuildOptions::MODS ? alibi_slope(s, T.b, T.h) : 0.f;

    // Delta_i = grad_out_i . out_i (both as stored, summed in float32) and the forward's LSE, per
    // row of this thread; both into the stats for the dK/dV kernel.
    float delta[2], lse2[2];  // lse2: LSE * log2(e)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long i = T.row(0, rr);
        float acc = 0.f, lse = neg_inf();
        if (i < s.seq_q) {
            const u16* orow = out + T.o.off + (u64)i * T.o.stride;
            const u16* drow = grad_out + rdo.off + (u64)i * rdo.stride;
            for (int d = 2 * L.t; d < D; d += 8) {  // D is a multiple of 8 (16-byte rows)
                float o0, o1, g0, g1;
                Elem<u16>::widen2(*reinterpret_cast<const u32*>(orow + d), o0, o1);
                Elem<u16>::widen2(*reinterpret_cast<const u32*>(drow + d), g0, g1);
                acc += g0 * o0 + g1 * o1;
            }
            lse = lse_in[row0 + i];
        }
        delta[rr] = quad_sum(acc);
        lse2[rr] = lse * FERRO_LOG2E;
        if (L.t == 0 && i < s.seq_q) {
            float* st = stats + (row0 + i) * 2;
            st[0] = delta[rr];
            st[1] = lse;
        }
    }

    // This warpgroup's rows, the key tiles [t_lo, t_hi) they can see, and each of this thread's
    // rows' visible keys counted from j_first (as in the wgmma forward).
    const long long wm0 = T.m0 + (wg - 1) * 64, wm_last = min(T.m_last, wm0 + 63);
    int t_lo, t_hi;
    rows_key_tiles<BN>(s, wm0, wm_last, j_first, n_tiles, t_lo, t_hi);
    KeySpan span[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        span[rr] = key_span(s, T.row(0, rr), j_first, n_tiles * BN);
        if (lse2[rr] == neg_inf()) span[rr].hi = -1;  // a given LSE of -inf: P = 0 (SPEC)
    }

    float dq[DT][4];
#pragma unroll
    for (int nd = 0; nd < DT; ++nd) dq[nd][0] = dq[nd][1] = dq[nd][2] = dq[nd][3] = 0.f;

    for (int t = 0; t < t_lo; ++t) ring_pass_over(full, empty, t);
    if (t_hi > t_lo) mbar_wait(&q_full, 0);
    for (int t = t_lo; t < t_hi; ++t) {
        const int st = t % STAGES;
        const u32 k_tile = smem_u32(sK + st * KV_ELEMS), v_tile = smem_u32(sV + st * KV_ELEMS);
        ring_wait_full(full, t);
        fence_proxy_async();  // the loaders' writes, now seen here, to the tensor cores' view

        float sc[NT][4], dp[NT][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            wgmma_ss(sc, desc_k_major<BM>(q_slice, kk), desc_k_major<BN>(k_tile, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            wgmma_ss(dp, desc_k_major<BM>(do_slice, kk), desc_k_major<BN>(v_tile, kk), kk > 0);
        wgmma_commit();
        const KeySpan tile[2] = {span[0].from(t * BN), span[1].from(t * BN)};
        const bool whole = tile[0].covers(BN) && tile[1].covers(BN);

        wgmma_wait<1>();
        wgmma_pin(sc);
        const long long j0 = j_first + (long long)t * BN;  // even: BN is
        // A wholly visible tile of a softcap / ALiBi call without a mask: float operations only
        // (capped_alibi), a - j of element r of n-tile nt being d[r >> 1] - (8 nt + (r & 1)).
        const bool fast = whole && float_mods<BuildOptions>(s);
        const float d[2] = {(float)(T.row(0, 0) + s.offset - j0 - 2 * L.t),
                            (float)(T.row(0, 1) + s.offset - j0 - 2 * L.t)};
        if (whole && row_mask<BuildOptions>(s)) {  // the mask alone, every key visible: row loads
            add_mask_row<NT>(s, mask, T.b, T.h, T.row(0, 0), j0, 0, L, sc);
            add_mask_row<NT>(s, mask, T.b, T.h, T.row(0, 1), j0, 1, L, sc);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) sc[nt][r] = exp2f(fmaf(sc[nt][r], FERRO_LOG2E, -lse2[r >> 1]));
        } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int c = nt * 8 + 2 * L.t + (r & 1);
                const bool ok = whole || (c >= tile[r >> 1].lo && c <= tile[r >> 1].hi);
                // (a row that sees no key, or whose given LSE is -inf, sees none of them)
                float e, dcap = 1.f;
                if (fast) {
                    float th;
                    const float x = capped_alibi(s, slope, sc[nt][r] * s.scale,
                                                 fabsf(d[r >> 1] - (float)(nt * 8 + (r & 1))), th);
                    e = fmaf(x, FERRO_LOG2E, -lse2[r >> 1]);
                    dcap = 1.f - th * th;  // softcap's derivative (1 without softcap)
                } else if (per_element<BuildOptions>(s)) {  // softcap, ALiBi, mask: element by element
                    const long long i = T.row(0, r >> 1);
                    const float x = modified_score<BuildOptions::MASK, BuildOptions::MODS>(
                        s, mask, T.b, T.h, i, j0 + c, ok, slope, sc[nt][r] * s.scale);
                    e = fmaf(x, FERRO_LOG2E, -lse2[r >> 1]);
                    if (BuildOptions::MODS && ok)  // softcap's 1 - tanh^2, into P: dQ uses P only in dS
                        dcap = softcap_grad<BuildOptions::MASK, true>(s, mask, T.b, T.h, i, j0 + c,
                                                                      slope, x);
                } else {
                    e = fmaf(sc[nt][r], sl2, -lse2[r >> 1]);
                }
                sc[nt][r] = ok ? exp2f(e) * dcap : 0.f;
            }
        }
        wgmma_wait<0>();
        wgmma_pin(dp);
        u32 da[NT / 2][4];  // dS rounded: the A operand of dQ += dS K
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32 keep = drop.keep_rows(T.bh, (u32)T.row(0, 0), (u32)T.row(0, 1), j0, nt, L);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float dpk = BuildOptions::DROPOUT ? ((keep >> r) & 1u ? dp[nt][r] * keep_scale : 0.f)
                                                        : dp[nt][r];
                sc[nt][r] *= dpk - delta[r >> 1];
            }
        }
        to_a_fragments<NT>(sc, da);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) wgmma_rs(dq, da[kk], desc_mn_major<BN>(k_tile, kk), 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(dq);
        ring_release(empty, t);  // done with tile t
    }
    for (int t = t_hi; t < n_tiles; ++t) ring_pass_over(full, empty, t);

    const Rows rdq = q_rows(s, lay.grad_q, T.b, T.h);
    store_acc_tile<u16, DT>(grad_q, rdq, T.row(0, 0), s.seq_q, dq, s.scale, L, D, true);
}
