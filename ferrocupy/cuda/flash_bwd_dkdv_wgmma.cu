// Attention backward, second kernel, float16 / bfloat16 on sm_90a's warpgroup tensor cores
// (wgmma). One block = BK = 64 x (WARPS / 4) keys of
// one (batch, KV head), warp-specialized like the wgmma forward: a loading warpgroup fills a ring
// of STAGES {Q, dO, [Delta, LSE]} query tiles (BQ rows each) after the block's K and V, and each
// computing warpgroup owns 64 keys, for every query head of the GQA group and every query tile
// that can see them. At head_dim 256 (SPLIT) a block is BK = 64 keys instead, and each of its two
// computing warpgroups owns half the columns of their dK and dV (128 each: a warpgroup's whole
// dK and dV would take 256 registers a thread); both form the same S^T and dP^T (the products
// over all 256 columns: 1.5x the minimal work, which the mma.sync kernel's two column-range
// blocks also pay, on slower instructions):
//   S^T  = K Q^T          (wgmma, both from shared memory)
//   dP^T = V dO^T         (wgmma, both from shared memory)
//   P^T  = exp(scale S^T + mask - LSE), 0 where a key is not visible to the row
//   dS^T = P^T (keep dP^T / (1 - p) - Delta)        (keep: dropout's bit; 1 without dropout)
//   dV  += P'^T dO,  dK += dS^T Q   (P' = keep P / (1 - p); wgmma, P'^T and dS^T from
//                                    registers, rounded to the dtype)
// The mask and dropout are the build's options (ferro_score.cuh; a `plain` build has neither).
// then writes grad_k = scale dK and grad_v = dV, each rounded once. No atomics: deterministic.
// The [Delta, LSE] per query row come from the dQ kernel's stats. The products and roundings are
// the mma.sync kernel's (flash_bwd_dkdv.cu, half build; P's exponent is one fma here);
// geometry from cuda/configs.py.
// Built with FERRO_FUSED_DQ (flash_bwd_fused_wgmma.cu) it is the fused backward's main kernel:
// each warpgroup also stores its dS (rounded, transposed) to shared memory, and per step one
// warpgroup in turn forms dQ_part = dS K over the block's BK keys and stages it in shared memory;
// the loading warpgroup's last warp adds each staged partial into a float32 dQ in global memory,
// in a fixed order (ferro_dq_order.cuh), while the first three copy.
#ifndef FERRO_FUSED_DQ
#define FERRO_FUSED_DQ 0
#endif
#ifndef FERRO_DKDV_SPLIT
#define FERRO_DKDV_SPLIT 0
#endif
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"
#include "ferro_mma_f16.cuh"
#include "ferro_wgmma.cuh"
#include "ferro_mbarrier.cuh"
#if FERRO_FUSED_DQ
#include "ferro_dq_order.cuh"
#define FERRO_DKDV_KERNEL flash_bwd_fused_wgmma
#else
// The first row of step t's query tile: the two-kernel build walks each query head's tiles up
// (it has no adds to order; ferro_dq_order.cuh's step_row0 walks the fused build's down).
__device__ __forceinline__ long long step_row0(long long i_first, int n_tiles, int t, int rows) {
    return i_first + (long long)(t % n_tiles) * rows;
}
#define FERRO_DKDV_KERNEL flash_bwd_dkdv_wgmma
#endif

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, BQ = FERRO_BN, STAGES = FERRO_STAGES;
constexpr int GROUPS = WARPS / 4;  // computing warpgroups
// The warpgroups split dK/dV's columns, not the keys (configs.py's split_columns, above 128).
constexpr bool SPLIT = FERRO_DKDV_SPLIT;
static_assert(SPLIT == (DP > 128), "configs.py's split_columns: exactly the builds above 128");
constexpr int LOADERS = 128, THREADS = LOADERS + 32 * WARPS, BK = SPLIT ? 64 : 16 * WARPS;
// The loading warpgroup's threads that copy: all but the fused build's dQ writer warp (its last).
constexpr int COPIERS = FERRO_FUSED_DQ ? LOADERS - 32 : LOADERS;
constexpr int CW = SPLIT ? DP / GROUPS : DP;  // columns of dK and dV a warpgroup holds
constexpr int NT = BQ / 8;  // n-tiles of S^T and dP^T (query columns); k-steps of dV, dK: NT / 2
constexpr int DT = CW / 8;  // n-tiles of this warpgroup's dK and dV
static_assert(!SPLIT || (DP == 256 && GROUPS == 2 && !FERRO_FUSED_DQ),
              "head_dim 256: two warpgroups of 128 columns each, two kernels (not fused)");
static_assert(NT <= 8, "dropout's keep bits of a step fit one u32");
constexpr int KV_ELEMS = BK * DP, Q_ELEMS = BQ * DP;
// (the dQ writer's order bookkeeping, fused, takes more than the copies' 24; 40 spills none of
// it, but leaves the computing warpgroups 232, where the builds with softcap / ALiBi / sinks or
// a mask or dropout at head_dim 128 had ptxas serialize every wgmma, C7512: those keep 240)
constexpr bool FUSED_PLAIN = FERRO_FUSED_DQ && !BuildOptions::MASK && !BuildOptions::DROPOUT &&
                             !BuildOptions::MODS;
constexpr int LOADER_REGS = FUSED_PLAIN ? 40 : FERRO_FUSED_DQ ? 32 : 24;
constexpr int COMPUTE_REGS = FUSED_PLAIN ? 232 : 240;
static_assert(FERRO_MT == 1 && WARPS % 4 == 0, "whole warpgroups, 16 keys per warp");
static_assert((DP == 64 || DP == 128 || DP == 256) && BQ == 64, "wgmma tile geometry");
static_assert(LOADERS * LOADER_REGS + 32 * WARPS * COMPUTE_REGS <= 65536, "register file");
// (fused) dS of a step: BQ query rows x BK keys, one swizzled column block of 64 keys per
// warpgroup; two buffers, by the step's parity.
constexpr int DS_ELEMS = FERRO_FUSED_DQ ? BQ * BK : 0;
// (fused) A staged float32 dQ_part, BQ x DP, one buffer per computing warpgroup (its turns).
constexpr int DQ_FLOATS = FERRO_FUSED_DQ ? BQ * DP : 0;
static_assert(!FERRO_FUSED_DQ || GROUPS == 2,
              "dQ_part's k-steps: the two warpgroups' 64-key blocks of dS");
// K and V, the ring of Q and dO (swizzled), (fused) the two dS buffers and the staged dQ
// partials, the ring of [Delta, LSE], 1 KB to align the base.
static_assert(2 * (2 * KV_ELEMS + 2 * STAGES * Q_ELEMS + 2 * DS_ELEMS) + 4 * GROUPS * DQ_FLOATS +
                      8 * STAGES * BQ + 1024 ==
                  FERRO_SMEM_BYTES,
              "configs.py's shared memory");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
FERRO_DKDV_KERNEL(const u16* __restrict__ q, const u16* __restrict__ k,
                  const u16* __restrict__ v, const u16* __restrict__ grad_out,
                  u16* __restrict__ grad_k, u16* __restrict__ grad_v,
                  const void* __restrict__ mask, const float* __restrict__ stats,
                  const float* __restrict__ alibi, const int* __restrict__ cu_q,
                  const int* __restrict__ cu_k,
#if FERRO_FUSED_DQ
                  float* __restrict__ dq_accum, u32* __restrict__ dq_sem,
#endif
                  const u32 vec, const u32 mask_kind, const AttnLayout lay,
                  const FlashBwdParams p, const AttnExtras ex) {
    extern __shared__ __align__(1024) u16 smem_w[];
    __shared__ u64 kv_full, full[STAGES], empty[STAGES];
#if FERRO_FUSED_DQ
    __shared__ u64 dq_full[GROUPS], dq_empty[GROUPS];  // a staged dQ_part's buffer: written, read
#endif
    const u32 raw = smem_u32(smem_w);
    u16* sK = smem_w + (((1024u - (raw & 1023u)) & 1023u) >> 1);  // 1024-byte aligned
    u16* sV = sK + KV_ELEMS;
    u16* sQ = sV + KV_ELEMS;            // [STAGES][BQ x DP], swizzled
    u16* sdO = sQ + STAGES * Q_ELEMS;   // [STAGES][BQ x DP], swizzled
    u16* sdS = sdO + STAGES * Q_ELEMS;  // (fused) [2][BQ x BK], swizzled
    float* sDQ = reinterpret_cast<float*>(sdS + 2 * DS_ELEMS);  // (fused) [GROUPS][BQ x DP]
    float* sSt = sDQ + GROUPS * DQ_FLOATS;  // [STAGES][BQ][Delta, LSE]
    AttnShape s = attn_shape(p, ex, mask_kind);
    if (BuildOptions::MODS) with_extras(s, ex, alibi, nullptr);
    with_varlen(s, ex, cu_q, cu_k);
    const Lane L = lane_ids();
    const int D = s.head_dim, wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0);  // 0 loads
    (void)vec;  // 16-byte rows: the backend picks this kernel only then

    const u32 k_tiles = (s.seq_k + BK - 1) / BK;
    u32 bhk, tile;  // the first key tiles are seen by the most queries
    block_coords(blockIdx.x, k_tiles, s, s.kv_heads, bhk, tile);
    const u32 b = bhk / s.kv_heads, hk = bhk % s.kv_heads, group = s.heads / s.kv_heads;
    const long long k0 = (long long)tile * BK;
    for_sequence(s, b);  // (k_tiles above: the grid's, over the frame)
    if (FERRO_VARLEN && k0 >= s.seq_k) return;  // a key tile past its sequence's (the block leaves)
    const long long k_last = min((long long)s.seq_k, k0 + BK) - 1;
    long long q_lo, q_hi;
    visible_row_range(s, k0, k_last, q_lo, q_hi);
    const long long i_first = q_lo / BQ * BQ;
    const int n_tiles = q_hi > i_first ? (int)((q_hi - i_first + BQ - 1) / BQ) : 0;
    const int steps = (int)group * n_tiles;  // (query head of the group, query tile)

    if (threadIdx.x == 0) {
        mbar_init(&kv_full, COPIERS);
        mbar_init_ring(full, empty, COPIERS, 32 * WARPS);
#if FERRO_FUSED_DQ
        mbar_init_ring(dq_full, dq_empty, 128, 1);  // staged by a warpgroup, read by the writer
#endif
    }
    __syncthreads();

    if (wg == 0) {  // ---- the loading warpgroup --------------------------------------------------
        regs_shrink<LOADER_REGS>();
#if FERRO_FUSED_DQ
        if (threadIdx.x >= COPIERS) {  // the dQ writer warp
            write_dq_in_order<BK, BQ, DP, GROUPS>(s, dq_accum, dq_sem, sDQ, dq_full, dq_empty, b, hk,
                                                  group, tile, i_first, n_tiles, steps);
            return;
        }
#endif
        const Rows rk = k_rows(s, lay.k, b, hk), rv = k_rows(s, lay.v, b, hk);
        load_tile_sw128<BK, DP, COPIERS>(sK, k + rk.off, rk.stride, k0, s.kv_reach, D);
        load_tile_sw128<BK, DP, COPIERS>(sV, v + rv.off, rv.stride, k0, s.kv_reach, D);
        mbar_arrive_cp_async(&kv_full);
        for (int t = 0; t < steps; ++t) {
            const int st = t % STAGES;
            ring_wait_empty(empty, t);  // step t - STAGES is done
            const u32 h = hk * group + t / n_tiles;
            const long long i0 = step_row0(i_first, n_tiles, t, BQ);
            const Rows rq = q_rows(s, lay.q, b, h), rdo = q_rows(s, lay.grad_out, b, h);
            load_tile_sw128<BQ, DP, COPIERS>(sQ + st * Q_ELEMS, q + rq.off, rq.stride, i0, s.seq_q, D);
            load_tile_sw128<BQ, DP, COPIERS>(sdO + st * Q_ELEMS, grad_out + rdo.off, rdo.stride, i0,
                                             s.seq_q, D);
            const float* rows = stats + row_index(s, b, h) * 2;
            for (int r = threadIdx.x; r < BQ; r += COPIERS) {  // rows past seq_q: zeros
                const bool ok = i0 + r < s.seq_q;
                cp_async<8>(sSt + (st * BQ + r) * 2, ok ? rows + (i0 + r) * 2 : rows, ok);
            }
            mbar_arrive_cp_async(&full[st]);
        }
        cp_async_wait<0>();  // nothing in flight when the block ends
        return;
    }

    // ---- the computing warpgroups: 64 keys each (SPLIT: the same 64, CW columns each) -------------
    regs_grow<COMPUTE_REGS>();
    const int slice = SPLIT ? 0 : wg - 1;  // this warpgroup's 64 keys among the block's
    const u32 k_slice = smem_u32(sK) + slice * 64 * 128;
    const u32 v_slice = smem_u32(sV) + slice * 64 * 128;
    // Its first column of dK and dV, and that column's byte offset in a swizzled [BQ x DP] tile
    // (whole 64-column blocks of BQ * 128 bytes: CW is a multiple of 64).
    const int col0 = SPLIT ? (wg - 1) * CW : 0;
    const u32 col_bytes = (u32)(col0 / 64) * BQ * 128;
    static_assert(CW % 64 == 0, "a warpgroup's columns start on a swizzle block");
    // This thread's two keys (accumulator rows c0/c1 and c2/c3).
    const long long key0 = k0 + slice * 64 + ((threadIdx.x >> 5) & 3) * 16 + L.g;
    const float sl2 = s.scale * FERRO_LOG2E;
    const Dropout<BuildOptions::DROPOUT> drop(s);
    const float keep_scale = drop.keep_scale();

#if FERRO_FUSED_DQ
    u32 dq_stagings = 0;  // this warpgroup's dQ_parts staged so far (its buffer's uses)
#endif
    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int nd = 0; nd < DT; ++nd)
#pragma unroll
        for (int r = 0; r < 4; ++r) dk[nd][r] = dv[nd][r] = 0.f;

    if (steps > 0) mbar_wait(&kv_full, 0);
    for (int t = 0; t < steps; ++t) {
        const int st = t % STAGES;
        const long long i0 = step_row0(i_first, n_tiles, t, BQ);
        const u32 q_tile = smem_u32(sQ + st * Q_ELEMS), do_tile = smem_u32(sdO + st * Q_ELEMS);
        ring_wait_full(full, t);
        fence_proxy_async();  // the loaders' writes, now seen here, to the tensor cores' view

        float sT[NT][4], dpT[NT][4];  // [64 keys x BQ query rows]
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            wgmma_ss(sT, desc_k_major<BK>(k_slice, kk), desc_k_major<BQ>(q_tile, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            wgmma_ss(dpT, desc_k_major<BK>(v_slice, kk), desc_k_major<BQ>(do_tile, kk), kk > 0);
        wgmma_commit();

        // The query rows each of this thread's keys sees, counted from i0 (causal, window, the
        // ends of both sequences).
        const KeySpan span[2] = {row_span(s, key0, i0, BQ), row_span(s, key0 + 8, i0, BQ)};
        const float* st_rows = sSt + st * BQ * 2;
        const u32 h = hk * group + t / n_tiles, bh = b * s.heads + h;
        const float slope = BuildOptions::MODS ? alibi_slope(s, b, h) : 0.f;

        // Softcap / ALiBi without a mask: float operations only (capped_alibi), a - j of element r
        // of n-tile nt being d0 + 8 nt + (r & 1) - 8 (r >> 1).
        const bool fast = float_mods<BuildOptions>(s);
        const float d0 = (float)(i0 + s.offset - key0 + 2 * L.t);
        auto dist = [&](int nt, int r) {
            return fabsf(d0 + (float)(nt * 8 + (r & 1) - 8 * (r >> 1)));
        };
        wgmma_wait<1>();
        wgmma_pin(sT);
        u32 keeps = 0xFFFFFFFFu;  // dropout's bits: 4 per n-tile (element r: bit 4 nt + r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int c = nt * 8 + 2 * L.t;  // query column of r = 0, 2 (r = 1, 3: c + 1)
            const float4 st4 = *reinterpret_cast<const float4*>(st_rows + 2 * c);  // D, L, D, L
            const float lse2[2] = {st4.y * FERRO_LOG2E, st4.w * FERRO_LOG2E};
            if (BuildOptions::DROPOUT)
                keeps ^= (~drop.template keep_cols<false>(bh, i0 + c, key0) & 0xFu) << (4 * nt);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int ci = c + (r & 1);
                // A row with LSE -inf (one that sees no key, or a given lse saying so) has P = 0.
                const bool ok = ci >= span[r >> 1].lo && ci <= span[r >> 1].hi &&
                                lse2[r & 1] != neg_inf();
                float e, th;
                if (fast)
                    e = fmaf(capped_alibi(s, slope, sT[nt][r] * s.scale, dist(nt, r), th),
                             FERRO_LOG2E, -lse2[r & 1]);
                else if (per_element<BuildOptions>(s))  // softcap, ALiBi, mask: element by element
                    e = fmaf(modified_score<BuildOptions::MASK, BuildOptions::MODS>(
                                 s, mask, b, h, i0 + ci, key0 + 8 * (r >> 1), ok, slope,
                                 sT[nt][r] * s.scale),
                             FERRO_LOG2E, -lse2[r & 1]);
                else
                    e = fmaf(sT[nt][r], sl2, -lse2[r & 1]);
                sT[nt][r] = ok ? exp2f(e) : 0.f;
            }
        }
        u32 pa[NT / 2][4];  // P'^T rounded: the A operand of dV += P'^T dO
        if (BuildOptions::DROPOUT && drop.on) {
#pragma unroll
            for (int kk = 0; kk < NT / 2; ++kk) {
                float kept[2][4];
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        kept[n][r] = (keeps >> (4 * (2 * kk + n) + r)) & 1u
                                         ? sT[2 * kk + n][r] * keep_scale : 0.f;
                acc_to_a(kept[0], kept[1], pa[kk]);
            }
        } else {
            to_a_fragments<NT>(sT, pa);
        }
        wgmma_wait<0>();
        wgmma_pin(dpT);
        u32 da[NT / 2][4];  // dS^T rounded: the A operand of dK += dS^T Q
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int c = nt * 8 + 2 * L.t;
            const float2 delta = {st_rows[2 * c], st_rows[2 * c + 2]};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float dp = (keeps >> (4 * nt + r)) & 1u ? dpT[nt][r] * keep_scale : 0.f;
                float dS = sT[nt][r] * (dp - ((r & 1) ? delta.y : delta.x));
                // Softcap: dS times 1 - tanh^2, from the score lse + log P (P > 0: visible).
                // log2 by the MUFU (lg2.approx, ~2^-22 absolute): log2f's accurate form is ~30
                // instructions a score, and the derivative it feeds is rounded to the dtype.
                if (BuildOptions::MODS && s.softcap > 0.f && sT[nt][r] != 0.f) {
                    const float score =
                        fmaf(__log2f(sT[nt][r]), FERRO_LN2, st_rows[2 * c + 1 + 2 * (r & 1)]);
                    dS *= fast ? capped_grad(s, fmaf(slope, dist(nt, r), score))
                               : softcap_grad<BuildOptions::MASK, true>(
                                     s, mask, b, h, i0 + c + (r & 1), key0 + 8 * (r >> 1), slope,
                                     score);
                }
                dpT[nt][r] = dS;
            }
        }
        to_a_fragments<NT>(dpT, da);
#if FERRO_FUSED_DQ
        u16* const ds_step = sdS + (t & 1) * DS_ELEMS;  // this step's dS buffer
        store_ds_transposed<NT>(ds_step + (wg - 1) * 64 * BQ, da, L);
#endif

        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk)
            wgmma_rs(dv, pa[kk], desc_mn_major<BQ>(do_tile + col_bytes, kk), 1);
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk)
            wgmma_rs(dk, da[kk], desc_mn_major<BQ>(q_tile + col_bytes, kk), 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(dv);
        wgmma_pin(dk);
        ring_release(empty, t);  // done with this step's Q, dO and stats
#if FERRO_FUSED_DQ
        // Both warpgroups' dS of this step in place. The buffer of step t is written again at
        // step t + 2, after this barrier of step t + 1, which the warpgroup reading it at step t
        // reaches only once its product is done.
        fence_proxy_async();
        computing_sync<GROUPS>();
        if (i0 < s.seq_q && t % GROUPS == wg - 1) {  // (a tile past seq_q: ferro_dq_order.cuh)
            float dq[DT][4];  // dS K over the block's BK keys: [BQ query rows x DP]
            const u32 ds_tile = smem_u32(ds_step);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk)
                wgmma_ss_mn(dq, desc_k_major<BQ>(ds_tile, kk), desc_mn_major<BK>(smem_u32(sK), kk),
                            kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(dq);
            stage_dq<DT>(sDQ + (wg - 1) * DQ_FLOATS, &dq_full[wg - 1], &dq_empty[wg - 1],
                         dq_stagings++, dq);
        }
#endif
    }

    Rows gk = k_rows(s, lay.grad_k, b, hk), gv = k_rows(s, lay.grad_v, b, hk);
    gk.off += col0, gv.off += col0;  // this warpgroup's columns [col0, col0 + CW) of D
    store_acc_tile2<u16, DT>(grad_k, gk, dk, s.scale, grad_v, gv, dv, 1.f, key0, s.seq_k, L,
                             D - col0, true);
}
