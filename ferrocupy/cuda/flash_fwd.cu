// Fused attention forward on mma.sync (sm_80+), FlashAttention-2's schedule, one body for every
// dtype: float32 through 3xTF32 products (ferro_mma_tf32.cuh, float32 accuracy), float16 /
// bfloat16 through m16n8k16 (ferro_mma_f16.cuh; FERRO_BF16 defined picks them). Accumulators and
// the softmax are float32 in both; the output is rounded once.
//
// One block = BM query rows of one (batch, head); each warp owns 16*MT rows. Q is staged in
// shared memory once (A fragments are read per k-step: holding them in registers as well as O and
// S spills at head_dim 128); K and V tiles of BN keys stream through it by cp.async (V_j loads
// during S = Q K_j^T, K_{j+1} during the softmax and O += P V_j); P stays in registers. Geometry
// (FERRO_*: padded head_dim, a multiple of 16; warps; MT; BN) comes from cuda/configs.py, the one
// table the backend and the compile tests read.
// A paged KV cache (FERRO_PAGED builds, configs.py's `paged`): each K/V tile's rows come through
// the block table (ferro_pages.cuh), translated once where one page holds the tile; the plain
// builds address K and V by their strides as they always have.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"
#include "ferro_pages.cuh"
#ifdef FERRO_BF16
#include "ferro_mma_f16.cuh"
typedef MmaF16 Mma;
#else
#include "ferro_mma_tf32.cuh"
typedef MmaTf32 Mma;
#endif

namespace {
typedef Mma::T T;
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, MT = FERRO_MT, BN = FERRO_BN;
constexpr int THREADS = 32 * WARPS, BM = 16 * MT * WARPS, PITCH = DP + Mma::PAD;
constexpr int NT = BN / 8;  // n-tiles of S = k-steps (x2) of P V
constexpr int DT = DP / 8;  // n-tiles of O
static_assert(DP % 16 == 0 && DP <= 256 && BN % 16 == 0, "tile geometry");
static_assert(sizeof(T) * (BM + 2 * BN) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");

template <class OPT>
__device__ __forceinline__ void forward(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v, T* __restrict__ out,
                                        const void* __restrict__ mask, float* __restrict__ lse,
                                        const int* __restrict__ kv_lens,
                                        const float* __restrict__ alibi,
                                        const float* __restrict__ sinks,
                                        const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                        const int* __restrict__ block_table, const u32 vec,
                                        const u32 mask_kind, const AttnLayout lay,
                                        const FlashV2Params p, const AttnExtras ex) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM][PITCH]
    T* sK = sQ + BM * PITCH;                 // [BN][PITCH]
    T* sV = sK + BN * PITCH;                 // [BN][PITCH]
    AttnShape s = attn_shape(p, ex, mask_kind);
    if (OPT::MODS) with_extras(s, ex, alibi, sinks);
    with_varlen(s, ex, cu_q, cu_k);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const QueryTile Tq = query_tile<BM, MT>(s, lay, L);  // (s: its batch entry's)
    if (Tq.empty()) return;  // a varlen tile past its sequence's rows (the whole block leaves)

    for_batch(s, kv_lens, Tq.b);  // before anything reads the keys' extent
    // Paged: the KV head's column of block 0, each row through the pages.
    const T* kb = k + (FERRO_PAGED ? rows_of(lay.k, 0, Tq.hk).off : Tq.k.off);
    const T* vb = v + (FERRO_PAGED ? rows_of(lay.v, 0, Tq.hk).off : Tq.v.off);
    // Key tile [j0, j0 + BN) of K or V (`t`: its strides; `rows`: (b, hk)'s rows) into `tile`.
    // The pages are found anew for each tile from the parameters: nothing more lives in
    // registers across the key loop (held there, they spilled at head_dim 128).
    auto load_keys = [&](T* tile, const T* base, const Strides& t, const Rows& rows, long long j0) {
        if constexpr (FERRO_PAGED) {
            const KeyPages pg = key_pages(block_table, ex.page_size, p.seq_k, Tq.b);
            const PagedRows rows_at(pg, t, j0, BN, s.kv_reach);
            load_tile_at<T, BN, DP, PITCH, THREADS>(tile, base, rows_at, j0, s.kv_reach, D, vec);
        } else {
            load_tile<T, BN, DP, PITCH, THREADS>(tile, base, rows.stride, j0, s.kv_reach, D, vec);
        }
    };
    const float slope = OPT::MODS ? alibi_slope(s, Tq.b, Tq.h) : 0.f;

    load_tile<T, BM, DP, PITCH, THREADS>(sQ, q + Tq.q.off, Tq.q.stride, Tq.m0, s.seq_q, D, vec);
    const T* sQw = sQ + warp * 16 * MT * PITCH;
    long long j_first;
    const int n_tiles = key_tiles<BN>(s, Tq, j_first);

    const Dropout<OPT::DROPOUT> drop(s);
    // The softmax's scores: raw (q.k; m_run in raw units) where Mma::RAW_SCORES says and the call
    // allows (raw_units), else scaled.
    const bool raw = Mma::RAW_SCORES && raw_units<OPT>(s);
    const float sl2 = raw ? s.scale * FERRO_LOG2E : FERRO_LOG2E;

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.f;
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = neg_inf(), l_run[mt][0] = l_run[mt][1] = 0.f;

    if (n_tiles > 0) load_keys(sK, kb, lay.k, Tq.k, j_first);
    cp_async_commit();

    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        cp_async_wait<0>();
        __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
        load_keys(sV, vb, lay.v, Tq.v, j0);
        cp_async_commit();

        float sc[MT][NT][4];
        Mma::gemm_abt<MT, NT, DP, PITCH>(sQw, sK, sc);
        __syncthreads();  // every warp is done with K_j
        if (it + 1 < n_tiles) load_keys(sK, kb, lay.k, Tq.k, j0 + BN);
        cp_async_commit();

        const bool whole = keys_wholly_visible<BN>(s, Tq, j0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const long long i0 = Tq.row(mt, 0), i1 = Tq.row(mt, 1);
            if (Mma::RAW_SCORES) raw_scores<OPT, NT>(s, mask, Tq.b, Tq.h, slope, i0, i1, j0, whole, L, sc[mt]);
            else score_tile<OPT, NT>(s, mask, Tq.b, Tq.h, slope, i0, i1, j0, whole, L, sc[mt]);
            float alpha[2];
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
                alpha[rr] = online_softmax_raw<NT, OPT::MASK>(sc[mt], rr, m_run[mt][rr], l_run[mt][rr], sl2,
                                                              s.has_mask);
            rescale_rows<DT>(o[mt], alpha);
            const u32 bh[2] = {Tq.bh, Tq.bh}, rows[2] = {(u32)Tq.row(mt, 0), (u32)Tq.row(mt, 1)};
            drop.template drop<NT, true, false>(sc[mt], bh, rows, (u32)j0, L);
        }

        cp_async_wait<1>();
        __syncthreads();  // V_j landed (K_{j+1} may still be in flight)
        Mma::gemm_acc_ab<MT, NT, DP, PITCH>(sc, sV, o);
    }
    // Nothing in flight when the block ends: a tile whose rows see no key (n_tiles 0: a negative
    // offset, kv_lens 0, a window) loaded Q and never waited for it.
    cp_async_wait<0>();

    const float keep_scale = drop.keep_scale();
    const float sink = OPT::MODS ? sink_logit(s, Tq.h) : neg_inf();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        finish_forward<T, DT, OPT::MODS>(o[mt], m_run[mt], l_run[mt], raw ? s.scale : 1.f,
                                         keep_scale, sink, Tq.row(mt, 0), s.seq_q,
                                         row_index(s, Tq.b, Tq.h), out, Tq.o,
                                         lse, L, D, vec > 1);
}
}  // namespace

#ifdef FERRO_BF16
extern "C" __global__ void __launch_bounds__(THREADS)
flash_fwd_half(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ out, const void* __restrict__ mask, float* __restrict__ lse,
               const int* __restrict__ kv_lens, const float* __restrict__ alibi,
               const float* __restrict__ sinks, const int* __restrict__ cu_q,
               const int* __restrict__ cu_k, FERRO_BLOCK_TABLE_PARAM const u32 vec,
               const u32 mask_kind, const AttnLayout lay, const FlashV2Params p,
               const AttnExtras ex) {
    forward<BuildOptions>(q, k, v, out, mask, lse, kv_lens, alibi, sinks, cu_q, cu_k,
                          FERRO_BLOCK_TABLE_ARG, vec, mask_kind, lay, p, ex);
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2(const float* __restrict__ q, const float* __restrict__ k,
              const float* __restrict__ v, float* __restrict__ out,
              const void* __restrict__ mask, float* __restrict__ lse,
              const int* __restrict__ kv_lens, const float* __restrict__ alibi,
              const float* __restrict__ sinks, const int* __restrict__ cu_q,
              const int* __restrict__ cu_k, FERRO_BLOCK_TABLE_PARAM const u32 vec,
              const u32 mask_kind, const AttnLayout lay, const FlashV2Params p,
              const AttnExtras ex) {
    forward<BuildOptions>(q, k, v, out, mask, lse, kv_lens, alibi, sinks, cu_q, cu_k,
                          FERRO_BLOCK_TABLE_ARG, vec, mask_kind, lay, p, ex);
}
#endif
