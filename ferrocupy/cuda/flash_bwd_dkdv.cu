// Attention backward, second kernel, on mma.sync (sm_80+), one body for every dtype (float32 by
// 3xTF32, float16 / bfloat16 by m16n8k16 with FERRO_BF16 defined; float32 accumulators). One
// block = BK keys of one (batch, KV head), each warp 16*MT of them, and (FERRO_DKDV_PARTS) one
// range of dK and dV's columns. Reads each query row's [Delta, LSE] from the stats the dQ kernel
// wrote, loops over the query heads of its GQA group and the query tiles (BQ rows) that can see
// its keys, and writes grad_k = scale * sum dS^T q and grad_v = sum P'^T grad_out, each rounded
// once. No atomics: deterministic. Geometry (FERRO_*; FERRO_BN is BQ here) comes from
// cuda/configs.py.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_tiles.cuh"
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"
#ifdef FERRO_BF16
#include "ferro_mma_f16.cuh"
typedef MmaF16 Mma;
#else
#include "ferro_mma_tf32.cuh"
typedef MmaTf32 Mma;
#endif

namespace {
typedef Mma::T T;
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, MT = FERRO_MT, BQ = FERRO_BN;
constexpr int THREADS = 32 * WARPS, BK = 16 * MT * WARPS, PITCH = DP + Mma::PAD;
constexpr int NT = BQ / 8;
// Each query row's [Delta, LSE]: float32 rows keep them in sdO's pad columns DP, DP + 1 (never
// read by the products; the block stays at 99 KB of shared memory, the per-block limit of
// sm_86/sm_89); 16-bit rows in a [BQ][2] array after sdO.
constexpr bool STATS_IN_PAD = sizeof(T) == 4;
static_assert(DP % 16 == 0 && DP <= 256 && BQ % 16 == 0, "tile geometry");
// dK and dV in PARTS column ranges of DC columns, each a block of its own (blockIdx.x % PARTS):
// one thread's two accumulators hold 16 * MT rows x DC columns, which at DP above 128 would
// spill whole. Every part computes S^T and dP^T over all DP columns. Range `part` starts at
// column part * (DP - DC), so the last ends at DP; where DP / 2 is an odd multiple of 8 the two
// overlap by 16 columns, which both blocks compute alike and store as the same values.
#ifndef FERRO_DKDV_PARTS
#define FERRO_DKDV_PARTS 1
#endif
constexpr int PARTS = FERRO_DKDV_PARTS, DC = (DP / PARTS + 15) / 16 * 16, DCT = DC / 8;
static_assert(PARTS == 1 || (PARTS == 2 && DC < DP), "one or two column ranges");
static_assert(sizeof(T) * (2 * BK + 2 * BQ) * PITCH + (STATS_IN_PAD ? 0 : 8 * BQ) == FERRO_SMEM_BYTES,
              "shared memory = configs.py's");

template <class OPT>
__device__ __forceinline__ void backward_dkdv(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v,
                                              const T* __restrict__ grad_out,
                                              T* __restrict__ grad_k, T* __restrict__ grad_v,
                                              const void* __restrict__ mask,
                                              const float* __restrict__ stats,
                                              const float* __restrict__ alibi,
                                              const int* __restrict__ cu_q,
                                              const int* __restrict__ cu_k, const u32 vec,
                                              const u32 mask_kind, const AttnLayout lay,
                                              const FlashBwdParams p, const AttnExtras ex) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);  // [BK][PITCH]
    T* sV = sK + BK * PITCH;                 // [BK][PITCH]
    T* sQ = sV + BK * PITCH;                 // [BQ][PITCH]
    T* sdO = sQ + BQ * PITCH;                // [BQ][PITCH]
    // Row c's [Delta, LSE] at sSt + c * ST_PITCH.
    float* sSt = STATS_IN_PAD ? reinterpret_cast<float*>(sdO + DP)
                              : reinterpret_cast<float*>(sdO + BQ * PITCH);
    constexpr int ST_PITCH = STATS_IN_PAD ? PITCH : 2;
    AttnShape s = attn_shape(p, ex, mask_kind);
    if (OPT::MODS) with_extras(s, ex, alibi, nullptr);
    with_varlen(s, ex, cu_q, cu_k);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const u32 k_tiles = (s.seq_k + BK - 1) / BK;
    u32 bhk, tile;  // the first key tiles are seen by the most queries
    block_coords(blockIdx.x / PARTS, k_tiles, s, s.kv_heads, bhk, tile);
    const int c0 = (int)(blockIdx.x % PARTS) * (DP - DC);  // this block's first dK/dV column
    const u32 b = bhk / s.kv_heads, hk = bhk % s.kv_heads, group = s.heads / s.kv_heads;
    const long long k0 = (long long)tile * BK;
    for_sequence(s, b);  // (k_tiles above: the grid's, over the frame)
    if (FERRO_VARLEN && k0 >= s.seq_k) return;  // a key tile past its sequence's (the block leaves)
    const long long key0 = k0 + warp * 16 * MT + L.g;  // + 16 mt + 8 rr

    const Rows rk = k_rows(s, lay.k, b, hk), rv = k_rows(s, lay.v, b, hk);
    const Rows gk = k_rows(s, lay.grad_k, b, hk), gv = k_rows(s, lay.grad_v, b, hk);
    load_tile<T, BK, DP, PITCH, THREADS>(sK, k + rk.off, rk.stride, k0, s.kv_reach, D, vec);
    load_tile<T, BK, DP, PITCH, THREADS>(sV, v + rv.off, rv.stride, k0, s.kv_reach, D, vec);
    const T* sKw = sK + warp * 16 * MT * PITCH;
    const T* sVw = sV + warp * 16 * MT * PITCH;

    const long long k_last = min((long long)s.seq_k, k0 + BK) - 1;
    long long q_lo, q_hi;
    visible_row_range(s, k0, k_last, q_lo, q_hi);
    const long long i_first = q_lo / BQ * BQ;
    const int n_tiles = q_hi > i_first ? (int)((q_hi - i_first + BQ - 1) / BQ) : 0;

    const Dropout<OPT::DROPOUT> drop(s);
    const float keep_scale = drop.keep_scale();

    float dk[MT][DCT][4], dv[MT][DCT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nd = 0; nd < DCT; ++nd)
#pragma unroll
            for (int r = 0; r < 4; ++r) dk[mt][nd][r] = dv[mt][nd][r] = 0.f;

    // Steps t = (query head of the group, query tile). Q_{t+1} loads while dV uses dO_t;
    // dO_{t+1} and its stats load while S^T uses Q_{t+1}.
    const int steps = (int)group * n_tiles;
    auto load_q = [&](int t) {
        const u32 h = hk * group + t / n_tiles;
        const long long i0 = i_first + (long long)(t % n_tiles) * BQ;
        const Rows rq = q_rows(s, lay.q, b, h);
        load_tile<T, BQ, DP, PITCH, THREADS>(sQ, q + rq.off, rq.stride, i0, s.seq_q, D, vec);
    };
    auto load_do = [&](int t) {
        const u32 h = hk * group + t / n_tiles;
        const long long i0 = i_first + (long long)(t % n_tiles) * BQ;
        const Rows rdo = q_rows(s, lay.grad_out, b, h);
        load_tile<T, BQ, DP, PITCH, THREADS>(sdO, grad_out + rdo.off, rdo.stride, i0, s.seq_q, D, vec);
        const float* st = stats + row_index(s, b, h) * 2;
        for (int idx = threadIdx.x; idx < 2 * BQ; idx += THREADS) {
            const bool ok = i0 + idx / 2 < s.seq_q;  // rows past the end: never visible
            cp_async<4>(sSt + (STATS_IN_PAD ? (idx / 2) * PITCH + (idx & 1) : idx),
                        ok ? st + (i0 * 2 + idx) : st, ok);
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
        float sT[MT][NT][4], dpT[MT][NT][4];  // [16 keys x BQ queries]: S^T and (dO V^T)^T
        Mma::gemm_abt<MT, NT, DP, PITCH>(sKw, sQ, sT);
        cp_async_wait<0>();
        __syncthreads();  // dO_t and its stats landed
        Mma::gemm_abt<MT, NT, DP, PITCH>(sVw, sdO, dpT);
        const bool whole = !per_element<OPT>(s) && wholly_visible(s, i0, i0 + BQ - 1, k0, k0 + BK - 1);
        const float slope = OPT::MODS ? alibi_slope(s, b, h) : 0.f;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int c = nt * 8 + 2 * L.t;  // query column of r = 0, 2 (r = 1, 3: c + 1)
                // Bits r of keep: (key row r>>1, query column c + (r&1)).
                const u32 keep = drop.template keep_cols<false>(bh, i0 + c, key0 + 16 * mt);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const long long j = key0 + 16 * mt + 8 * (r >> 1), i = i0 + c + (r & 1);
                    const int ci = c + (r & 1);
                    const bool ok = whole || (i < s.seq_q && j < s.seq_k && visible(s, i + s.offset, j));
                    const float x = modified_score<OPT::MASK, OPT::MODS>(s, mask, b, h, i, j, ok, slope,
                                                                        sT[mt][nt][r] * s.scale);
                    const float lse = sSt[ci * ST_PITCH + 1];
                    // 0 where not visible, and for a row that sees nothing (LSE = -inf).
                    const float P = ok && lse != neg_inf() ? exp2f((x - lse) * FERRO_LOG2E) : 0.f;
                    const bool kept = (keep >> r) & 1u;
                    const float dP = kept ? dpT[mt][nt][r] * keep_scale : 0.f;
                    sT[mt][nt][r] = kept ? P * keep_scale : 0.f;           // P'
                    float dS = P * (dP - sSt[ci * ST_PITCH]);
                    if (OPT::MODS && P != 0.f)  // softcap: dS times 1 - tanh^2
                        dS *= softcap_grad<OPT::MASK, true>(s, mask, b, h, i, j, slope, x);
                    dpT[mt][nt][r] = dS;
                }
            }
        }
        Mma::gemm_acc_ab<MT, NT, DC, PITCH>(dpT, sQ + c0, dk);  // dpT holds dS^T
        __syncthreads();  // every warp is done with Q_t
        if (more) load_q(t + 1);
        cp_async_commit();
        Mma::gemm_acc_ab<MT, NT, DC, PITCH>(sT, sdO + c0, dv);  // sT holds P'^T
        __syncthreads();  // every warp is done with dO_t and its stats
        if (more) load_do(t + 1);
        cp_async_commit();
    }

    cp_async_wait<0>();  // (with no query step, the K/V copies are still in flight)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        store_acc_tile2<T, DCT>(grad_k + c0, gk, dk[mt], s.scale, grad_v + c0, gv, dv[mt], 1.f,
                                key0 + 16 * mt, s.seq_k, L, D - c0, vec > 1);
}
}  // namespace

#ifdef FERRO_BF16
extern "C" __global__ void __launch_bounds__(THREADS)
flash_bwd_dkdv_half(const u16* __restrict__ q, const u16* __restrict__ k,
                    const u16* __restrict__ v, const u16* __restrict__ grad_out,
                    u16* __restrict__ grad_k, u16* __restrict__ grad_v,
                    const void* __restrict__ mask, const float* __restrict__ stats,
                    const float* __restrict__ alibi, const int* __restrict__ cu_q,
                    const int* __restrict__ cu_k, const u32 vec, const u32 mask_kind,
                    const AttnLayout lay, const FlashBwdParams p, const AttnExtras ex) {
    backward_dkdv<BuildOptions>(q, k, v, grad_out, grad_k, grad_v, mask, stats, alibi, cu_q, cu_k, vec,
                                mask_kind, lay, p, ex);
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2_bw_dkdv(const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ grad_out,
                      float* __restrict__ grad_k, float* __restrict__ grad_v,
                      const void* __restrict__ mask, const float* __restrict__ stats,
                      const float* __restrict__ alibi, const int* __restrict__ cu_q,
                      const int* __restrict__ cu_k, const u32 vec, const u32 mask_kind,
                      const AttnLayout lay, const FlashBwdParams p, const AttnExtras ex) {
    backward_dkdv<BuildOptions>(q, k, v, grad_out, grad_k, grad_v, mask, stats, alibi, cu_q, cu_k, vec,
                                mask_kind, lay, p, ex);
}
#endif
