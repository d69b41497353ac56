// Fused attention forward in float16 / bfloat16 on sm_90a's warpgroup tensor cores (wgmma),
// warp-specialized as FlashAttention-3 is: one warpgroup only loads (cp.async into rings of
// STAGES K buffers and STAGES V buffers, each announced on its `full` barrier), and WARPS / 4
// warpgroups only compute, each over 64 query rows of the block's BM, handing buffers back on
// their `empty` barriers: K(t) once S(t) has read it (before the softmax), V(t) once O += P V(t)
// has, so the next K load waits for no P V (FlashAttention-3's separate K and V pipelines). No
// block-wide barrier in the key loop, so the computing warpgroups drift apart and one's softmax
// overlaps the other's products; within a warpgroup, tile t's softmax overlaps O += P V of tile
// t - 1. (Strict turn-taking between the warpgroups, FlashAttention-3's ping-pong, measured 8%
// slower here: dev/tile_sweep.py, 2026-12-03.) S = Q K^T reads both operands from shared memory; P stays in registers. Softmax, masks
// and dropout are the mma.sync kernel's, element for element (the accumulator layout is the
// same). Built at head_dim 64, 128, 192 or 256 (a call's narrower head_dim zero-filled past its
// end), for 16-byte rows; geometry comes from cuda/configs.py.
// Persistent (one block per SM): the loaders fetch a tile's Q and keys while the computing
// warpgroups still finish the previous tile, whose start-up and output were otherwise exposed once
// per tile (at S 1024, 8 key tiles per query tile). Blocks take tiles from a global counter (the
// next free one, heaviest causal tiles first: no block is left with the long tail that a fixed
// turn gave causal calls), or in a fixed turn where the backend passes no counter.
// A paged KV cache (FERRO_PAGED builds, configs.py's `paged`): the loaders copy each K/V tile's
// rows through the block table (ferro_pages.cuh), translated once where one page holds the tile.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"
#include "ferro_mma_f16.cuh"
#include "ferro_wgmma.cuh"
#include "ferro_mbarrier.cuh"
#include "ferro_pages.cuh"

namespace {
// PLAIN: built for calls without an additive mask, dropout, softcap, ALiBi or sinks (configs.py
// picks it for them): their code, unused there, held registers across the key loop.
typedef BuildOptions OPT;
constexpr bool PLAIN = !OPT::MASK && !OPT::DROPOUT && !OPT::MODS;
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, BN = FERRO_BN, STAGES = FERRO_STAGES;
constexpr int LOADERS = 128, THREADS = LOADERS + 32 * WARPS, BM = 16 * WARPS;
constexpr int NT = BN / 8;  // n-tiles of S; 16-key k-steps of P V are NT / 2
constexpr int DT = DP / 8;  // n-tiles of O
constexpr int Q_ELEMS = BM * DP, KV_ELEMS = BN * DP;
// Two Q buffers (up to head_dim 128): the loaders fetch the next tile's Q while the computing
// warpgroups still work on this one's last keys, so a tile starts without waiting for its Q (and
// its warpgroups do not all wait for the slowest one's last product first).
// Registers per thread: the loaders need few (a paged build's translate pages: at 12 warps 32,
// what the computing warpgroups leave; 24 spilled), the computing warpgroups hold S, P and O.
constexpr int LOADER_REGS = WARPS == 8 ? 40 : (FERRO_PAGED ? 32 : 24);
constexpr int COMPUTE_REGS = WARPS == 8 ? 232 : 160;
static_assert(FERRO_MT == 1 && WARPS % 4 == 0, "whole warpgroups, 16 rows per warp");
static_assert((DP == 64 || DP == 128 || DP == 192 || DP == 256) && (BN == 64 || BN == 128),
              "wgmma tile geometry");
static_assert(LOADERS * LOADER_REGS + 32 * WARPS * COMPUTE_REGS <= 65536, "register file");
// Above head_dim 128 one Q buffer (configs.py's wgmma_q_buffers): two, with the K/V ring, would
// pass the shared memory a block has; the next tile's Q then loads once this one's products end.
constexpr int Q_BUFS = DP > 128 ? 1 : 2;
// Q x Q_BUFS, the K and V ring, and 1 KB to align the base for the 128-byte swizzle.
static_assert(2 * (Q_BUFS * Q_ELEMS + 2 * STAGES * KV_ELEMS) + 1024 == FERRO_SMEM_BYTES, "configs.py's shared memory");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_fwd_wgmma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                   u16* __restrict__ out, const void* __restrict__ mask, float* __restrict__ lse,
                   const int* __restrict__ kv_lens, const float* __restrict__ alibi,
                   const float* __restrict__ sinks, const int* __restrict__ cu_q,
                   const int* __restrict__ cu_k, FERRO_BLOCK_TABLE_PARAM
                   u32* __restrict__ tile_counter, const u32 vec,
                   const u32 mask_kind, const AttnLayout lay, const FlashV2Params p,
                   const AttnExtras ex) {
    extern __shared__ __align__(1024) u16 smem_w[];
    // K and V of key tile t sit in buffer t % STAGES of their own rings (the same index), each
    // ring with its own full / empty pair: K's buffer is handed back a softmax before V's.
    __shared__ u64 full_k[STAGES], empty_k[STAGES], full_v[STAGES], empty_v[STAGES];
    __shared__ u64 q_full[Q_BUFS], q_empty[Q_BUFS], tile_ready[Q_BUFS];
    __shared__ u32 tile_slot[Q_BUFS];  // the block's work items n, n + 1 (slot n % Q_BUFS), from loader thread 0
    const u32 raw = smem_u32(smem_w);
    u16* sQ = smem_w + (((1024u - (raw & 1023u)) & 1023u) >> 1);  // 1024-byte aligned
    u16* sK = sQ + Q_BUFS * Q_ELEMS;   // [STAGES][BN x DP], swizzled ([Q_BUFS][BM x DP] before)
    u16* sV = sK + STAGES * KV_ELEMS;  // [STAGES][BN x DP], swizzled
    AttnShape shape = attn_shape(p, ex, mask_kind);
    if (OPT::MODS) with_extras(shape, ex, alibi, sinks);
    with_varlen(shape, ex, cu_q, cu_k);
    const Lane L = lane_ids();
    // Warpgroup 0 loads. Broadcast from lane 0, as CUTLASS does, so the compiler knows the index
    // is warp-uniform: the per-warpgroup key range below then does not make it serialize wgmma.
    const int D = shape.head_dim, wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0);
    (void)vec;  // always 16-byte copies: the backend picks this kernel only then
    // Persistent: at most one block per SM; work items x are query tiles in block_coords order.
    const u32 n_work = (shape.seq_q + BM - 1) / BM * shape.batch * shape.heads;

    if (threadIdx.x == 0) {
        mbar_init_ring(full_k, empty_k, LOADERS, 32 * WARPS);
        mbar_init_ring(full_v, empty_v, LOADERS, 32 * WARPS);
        mbar_init_ring(q_full, q_empty, LOADERS, 32 * WARPS);  // item n's Q in buffer n % Q_BUFS
        for (int i = 0; i < Q_BUFS; ++i) mbar_init(&tile_ready[i], 1);
    }
    __syncthreads();
    // The block's n-th work item (n = 0, 1, ...; n_work or more: none left), the same for every
    // thread: loader thread 0 publishes it in slot n % Q_BUFS (publish_item) once item
    // n - Q_BUFS's Q buffer is handed back, so every thread has read item n - Q_BUFS from that
    // slot; the others wait for it.
    auto item = [&](u32 n) -> u32 {
        ring_wait_full(tile_ready, n);
        return tile_slot[n % Q_BUFS];
    };
    // (loader thread 0) Publish item x and claim the next: a block claims once per item it runs
    // (its first, blockIdx.x, is not claimed; the end item claims nothing), so a launch makes
    // n_work claims, returning 0 .. n_work - 1; the claim of n_work - 1 is the launch's last, and
    // its block sets the counter back to 0 for the next launch on the stream. Claimed one item ahead: the atomic's latency passes while this
    // item loads.
    auto publish_item = [&](u32 n, u32 x, u32& next) {
        if (tile_counter && x == n_work + gridDim.x - 1) atomicExch(tile_counter, 0u);
        tile_slot[n % Q_BUFS] = x;
        mbar_arrive(&tile_ready[n % Q_BUFS]);
        if (x < n_work) next = tile_counter ? atomicAdd(tile_counter, 1u) + gridDim.x : x + gridDim.x;
    };

    if (wg == 0) {  // ---- the loading warpgroup --------------------------------------------------
        regs_shrink<LOADER_REGS>();
        u32 ring = 0;  // key tiles loaded so far (their K and V: each ring's use `ring`)
        u32 next = blockIdx.x;  // (thread 0) the block's next item
        for (u32 n = 0;; ++n) {
            ring_wait_empty(q_empty, n);  // item n - Q_BUFS's Q (the same buffer) is read no more
            if (threadIdx.x == 0) publish_item(n, next, next);
            const u32 x = item(n);
            if (x >= n_work) break;
            AttnShape s = shape;
            const QueryTile T = query_tile_at<BM, 1>(x, s, lay, L, s.causal);
            for_batch(s, kv_lens, T.b);  // before anything reads the keys' extent
            long long j_first;
            const int n_tiles = key_tiles<BN>(s, T, j_first);
            load_tile_sw128<BM, DP, LOADERS>(sQ + (n % Q_BUFS) * Q_ELEMS, q + T.q.off, T.q.stride, T.m0, s.seq_q, D);
            mbar_arrive_cp_async(&q_full[n % Q_BUFS]);
            // Paged: the KV head's column of block 0, each row through the pages.
            const u16* kb = k + (FERRO_PAGED ? rows_of(lay.k, 0, T.hk).off : T.k.off);
            const u16* vb = v + (FERRO_PAGED ? rows_of(lay.v, 0, T.hk).off : T.v.off);
            // K(t), then V(t): each waits for its own ring's buffer (its use STAGES before handed
            // back) and is announced on its own `full`. So K(t + STAGES) waits for S(t) and, in
            // line behind V(t + STAGES - 1), for O += P V(t - 1): one tile sooner than when K and
            // V shared one buffer pair (after O += P V(t)); V(t + STAGES) for O += P V(t).
            for (int t = 0; t < n_tiles; ++t, ++ring) {
                const u32 st = ring % STAGES;
                const long long j = j_first + (long long)t * BN;
                ring_wait_empty(empty_k, ring);
                if constexpr (FERRO_PAGED) {
                    const KeyPages pg = key_pages(FERRO_BLOCK_TABLE_ARG, ex.page_size, p.seq_k,
                                                  T.b);
                    const PagedRows kr(pg, lay.k, j, BN, s.kv_reach);
                    load_tile_sw128_at<BN, DP, LOADERS>(sK + st * KV_ELEMS, kb, kr, j, s.kv_reach,
                                                        D);
                    mbar_arrive_cp_async(&full_k[st]);
                    ring_wait_empty(empty_v, ring);
                    load_tile_sw128_at<BN, DP, LOADERS>(sV + st * KV_ELEMS, vb,
                                                        kr.with_strides(lay.v), j, s.kv_reach, D);
                } else {
                    load_tile_sw128<BN, DP, LOADERS>(sK + st * KV_ELEMS, kb, T.k.stride, j,
                                                     s.kv_reach, D);
                    mbar_arrive_cp_async(&full_k[st]);
                    ring_wait_empty(empty_v, ring);
                    load_tile_sw128<BN, DP, LOADERS>(sV + st * KV_ELEMS, vb, T.v.stride, j,
                                                     s.kv_reach, D);
                }
                mbar_arrive_cp_async(&full_v[st]);  // (counts V's copies and K's before them)
            }
        }
        cp_async_wait<0>();  // nothing in flight when the block ends
        return;
    }

    // ---- the computing warpgroups ----------------------------------------------------------------
    regs_grow<COMPUTE_REGS>();
    u32 ring = 0;
    for (u32 n = 0;; ++n) {
        const u32 x = item(n);
        if (x >= n_work) break;
        const u32 q_tile = smem_u32(sQ + (n % Q_BUFS) * Q_ELEMS) + (wg - 1) * 64 * 128;  // its 64 rows
        AttnShape s = shape;
        QueryTile T = query_tile_at<BM, 1>(x, s, lay, L, s.causal);  // causal: short tile first rows
        for_batch(s, kv_lens, T.b);
        T.row0 = T.m0 + ((int)(threadIdx.x >> 5) - LOADERS / 32) * 16 + L.g;  // computing warps' rows
        long long j_first;
        const int n_tiles = key_tiles<BN>(s, T, j_first);
        const Dropout<OPT::DROPOUT> drop(s);
        const float slope = OPT::MODS ? alibi_slope(s, T.b, T.h) : 0.f;
        const bool raw = raw_units<OPT>(s);  // m_run in raw units (q.k), or scaled (a mask)
        const float sl2 = raw ? s.scale * FERRO_LOG2E : FERRO_LOG2E;
        // Key tile t of this query tile sits in buffer (ring + t) % STAGES of the K and V rings.
        auto k_tile = [&](int t) { return smem_u32(sK + ((ring + t) % STAGES) * KV_ELEMS); };
        auto v_tile = [&](int t) { return smem_u32(sV + ((ring + t) % STAGES) * KV_ELEMS); };
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

        // This warpgroup's own rows and the block's key tiles [t_lo, t_hi) they can see: under a
        // causal or window mask the block's 3 x 64 rows see different key ranges, and a warpgroup
        // whose rows are all past seq_q (the last tile of a short sequence) sees none.
        const long long wm0 = max(T.m0 + (wg - 1) * 64, 0ll);  // (rows before 0 do not exist)
        const long long wm_last = min(T.m_last, T.m0 + (wg - 1) * 64 + 63);
        int t_lo, t_hi;
        rows_key_tiles<BN>(s, wm0, wm_last, j_first, n_tiles, t_lo, t_hi);
        // The keys this thread's two rows see, as intervals counted from j_first: a few integers
        // live across the loop instead of the shape's 64-bit bounds.
        KeySpan span[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) span[rr] = key_span(s, T.row(0, rr), j_first, n_tiles * BN);

        // Softmax of tile t's scores into P (as A fragments); returns each row's rescale factor.
        auto softmax_to_p = [&](float (&sc)[NT][4], int t, float (&alpha)[2]) {
            const long long j0 = j_first + (long long)t * BN;
            const KeySpan tile[2] = {span[0].from(t * BN), span[1].from(t * BN)};
            // Every key of the tile visible to every row: per thread from the spans in the plain
            // kernel, per warpgroup in the general one (fewer registers across the loop).
            const bool whole = PLAIN ? tile[0].covers(BN) && tile[1].covers(BN)
                                     : keys_visible_to_rows(s, wm0, wm_last, j0, j0 + BN - 1);
            // Scores stay raw (q.k). The plain kernel only hides the keys a row cannot see on a
            // causal or window edge; the general one scales, masks and brings back to raw units any
            // tile that needs a per-element rule (hiding in place there cost it more spills).
            if (PLAIN) {
                if (!whole) hide_outside<NT>(tile, L, sc);
            } else {
                raw_scores<OPT, NT>(s, mask, T.b, T.h, slope, T.row(0, 0), T.row(0, 1), j0, whole, L, sc);
            }
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) alpha[rr] = online_softmax_raw<NT, OPT::MASK>(sc, rr, m_run[rr], l_run[rr], sl2, s.has_mask);
            const u32 bh[2] = {T.bh, T.bh}, rows[2] = {(u32)T.row(0, 0), (u32)T.row(0, 1)};
            drop.template drop<NT, true>(sc, bh, rows, (u32)j0, L);
        };
        auto issue_pv = [&](int t) {
#pragma unroll
            for (int kk = 0; kk < NT / 2; ++kk) wgmma_rs(o, pa[kk], desc_mn_major<BN>(v_tile(t), kk), 1);
        };

        // Tiles this warpgroup skips are still waited for and handed back, in order, on both
        // rings: every phase of empty_k and empty_v counts each computing thread once, and each
        // thread hands back K(t) and V(t) exactly once per tile (below: K(t) after S(t), V(t)
        // after O += P V(t), in the next iteration or the tail).
        auto pass_over = [&](int t) {
            ring_pass_over(full_k, empty_k, ring + t);
            ring_pass_over(full_v, empty_v, ring + t);
        };
        for (int t = 0; t < t_lo; ++t) pass_over(t);
        // Every computing thread waits for this tile's Q, even one with no key to visit, before it
        // hands Q back: so no arrival on q_empty can count toward an earlier tile's phase.
        ring_wait_full(q_full, n);
        for (int t = t_lo; t < t_hi; ++t) {
            ring_wait_full(full_k, ring + t);
            fence_proxy_async();  // the loaders' K(t), now seen here, to the tensor cores' view

            float sc[NT][4];
            wgmma_fence();
            issue_s(sc, t);
            wgmma_commit();
            if (t > t_lo) {
                // V(t - 1) (loaded before K(t): as good as landed), seen by the tensor cores too.
                ring_wait_full(full_v, ring + t - 1);
                fence_proxy_async();
                issue_pv(t - 1);
                // P V(t - 1) is a group of its own, so the softmax below waits for S(t) alone and
                // the product runs under it. (A commit after the branch, for both paths, made
                // ptxas close the t_lo path's empty group with a dummy wgmma placed where the
                // paths meet: on every tile a third group, and the wait for "all but one" then
                // took P V(t - 1) too: no overlap.)
                // (Builds with the additive mask or dropout wait for it here: their softmax under
                // the product spilled, ptxas: d64 84 -> 268 B, d128 8 -> 60.)
                wgmma_commit();
                wgmma_wait<OPT::MASK || OPT::DROPOUT ? 0 : 1>();
            } else {
                wgmma_wait<0>();
            }
            wgmma_pin(sc);
            ring_release(empty_k, ring + t);  // S(t) has read K(t): the loaders may refill it
            float alpha[2];
            softmax_to_p(sc, t, alpha);
            wgmma_wait<0>();
            wgmma_pin(o);
            if (t > t_lo) ring_release(empty_v, ring + t - 1);  // done with V(t - 1)
            rescale_rows<DT>(o, alpha);
            to_a_fragments<NT>(sc, pa);
        }
        if (t_hi > t_lo) {
            ring_wait_full(full_v, ring + t_hi - 1);
            fence_proxy_async();
            wgmma_fence();
            issue_pv(t_hi - 1);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(o);
            ring_release(empty_v, ring + t_hi - 1);  // (K(t_hi - 1) went back after its S)
        }
        ring_release(q_empty, n);  // every product that reads this Q has completed

        finish_forward<u16, DT, OPT::MODS>(o, m_run, l_run, raw ? s.scale : 1.f, drop.keep_scale(),
                                           OPT::MODS ? sink_logit(s, T.h) : neg_inf(), T.row(0, 0),
                                           s.seq_q, row_index(s, T.b, T.h), out, T.o, lse, L, D, true);
        for (int t = t_hi; t < n_tiles; ++t) pass_over(t);
        ring += n_tiles;
    }
}
