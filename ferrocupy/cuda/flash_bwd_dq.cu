// Attention backward, first kernel, on mma.sync (sm_80+), one body for every dtype (float32 by
// 3xTF32, float16 / bfloat16 by m16n8k16 with FERRO_BF16 defined; float32 accumulators). One
// block = BM query rows of one (batch, head), each warp 16*MT of them. Writes each row's
// [Delta, LSE] into the stats buffer for the dK/dV kernel (LSE is the forward's when given as
// `lse_in`, else a first pass over the visible keys computes it), then recomputes P and writes
// grad_q = scale * sum_j dS_ij k_j with dS = P (dP - Delta), rounded once. No atomics. Geometry
// (FERRO_*) comes from cuda/configs.py.
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
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, MT = FERRO_MT, BN = FERRO_BN;
constexpr int THREADS = 32 * WARPS, BM = 16 * MT * WARPS, PITCH = DP + Mma::PAD;
constexpr int NT = BN / 8, DT = DP / 8;
static_assert(DP % 16 == 0 && DP <= 256 && BN % 16 == 0, "tile geometry");
static_assert(sizeof(T) * (2 * BM + 2 * BN) * PITCH == FERRO_SMEM_BYTES, "shared memory = configs.py's");

template <class OPT>
__device__ __forceinline__ void backward_dq(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, const T* __restrict__ out,
                                            const T* __restrict__ grad_out, T* __restrict__ grad_q,
                                            const void* __restrict__ mask,
                                            float* __restrict__ stats,
                                            const float* __restrict__ lse_in,
                                            const float* __restrict__ alibi,
                                            const float* __restrict__ sinks,
                                            const int* __restrict__ cu_q,
                                            const int* __restrict__ cu_k, const u32 vec,
                                            const u32 mask_kind, const AttnLayout lay,
                                            const FlashBwdParams p, const AttnExtras ex) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM][PITCH]
    T* sdO = sQ + BM * PITCH;                // [BM][PITCH]
    T* sK = sdO + BM * PITCH;                // [BN][PITCH]
    T* sV = sK + BN * PITCH;                 // [BN][PITCH]
    AttnShape s = attn_shape(p, ex, mask_kind);
    if (OPT::MODS) with_extras(s, ex, alibi, sinks);
    with_varlen(s, ex, cu_q, cu_k);
    const Lane L = lane_ids();
    const int warp = threadIdx.x >> 5, D = s.head_dim;

    const QueryTile Tq = query_tile<BM, MT>(s, lay, L);  // (s: its batch entry's)
    if (Tq.empty()) return;  // a varlen tile past its sequence's rows (the whole block leaves)
    const Rows dO = q_rows(s, lay.grad_out, Tq.b, Tq.h), dQ = q_rows(s, lay.grad_q, Tq.b, Tq.h);
    const u64 row0 = row_index(s, Tq.b, Tq.h);  // of lse_in and the stats
    const T* kb = k + Tq.k.off;
    const T* vb = v + Tq.v.off;
    const float slope = OPT::MODS ? alibi_slope(s, Tq.b, Tq.h) : 0.f;

    load_tile<T, BM, DP, PITCH, THREADS>(sQ, q + Tq.q.off, Tq.q.stride, Tq.m0, s.seq_q, D, vec);
    load_tile<T, BM, DP, PITCH, THREADS>(sdO, grad_out + dO.off, dO.stride, Tq.m0, s.seq_q, D, vec);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const T* sQw = sQ + warp * 16 * MT * PITCH;
    const T* sdOw = sdO + warp * 16 * MT * PITCH;

    // Delta_i = grad_out_i . out_i, both as stored (rounded), summed in float32.
    float delta[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float acc = 0.f;
            const long long i = Tq.row(mt, rr);
            if (i < s.seq_q) {
                const T* orow = out + Tq.o.off + (u64)i * Tq.o.stride;
                const T* drow = sdOw + (16 * mt + 8 * rr + L.g) * PITCH;
                for (int d = L.t; d < D; d += 4)
                    acc += Elem<T>::to_f(drow[d]) * Elem<T>::to_f(orow[d]);
            }
            delta[mt][rr] = quad_sum(acc);
        }

    long long j_first;
    const int n_tiles = key_tiles<BN>(s, Tq, j_first);

    float lse[MT][2];
    if (lse_in) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const long long i = Tq.row(mt, rr);
                lse[mt][rr] = i < s.seq_q ? lse_in[row0 + i] : neg_inf();
            }
    } else {
        // Pass 1: LSE_i = m + log(sum exp(s - m)) over the visible keys (and the sink: row_end).
        // Only K is read, so sK and sV double-buffer it: tile j+1 loads while tile j is multiplied.
        float m_run[MT][2], l_run[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = neg_inf(), l_run[mt][0] = l_run[mt][1] = 0.f;
        if (n_tiles > 0) load_tile<T, BN, DP, PITCH, THREADS>(sK, kb, Tq.k.stride, j_first, s.kv_reach, D, vec);
        cp_async_commit();
        for (int it = 0; it < n_tiles; ++it) {
            const long long j0 = j_first + (long long)it * BN;
            cp_async_wait<0>();
            __syncthreads();  // tile j landed; every warp is done with tile j-1's buffer
            if (it + 1 < n_tiles)
                load_tile<T, BN, DP, PITCH, THREADS>((it & 1) ? sK : sV, kb, Tq.k.stride, j0 + BN,
                                                     s.kv_reach, D, vec);
            cp_async_commit();
            float sc[MT][NT][4];
            Mma::gemm_abt<MT, NT, DP, PITCH>(sQw, (it & 1) ? sV : sK, sc);
            const bool whole = keys_wholly_visible<BN>(s, Tq, j0);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                score_tile<OPT, NT>(s, mask, Tq.b, Tq.h, slope, Tq.row(mt, 0), Tq.row(mt, 1), j0,
                                    whole, L, sc[mt]);
                online_softmax<NT>(sc[mt], 0, m_run[mt][0], l_run[mt][0]);
                online_softmax<NT>(sc[mt], 1, m_run[mt][1], l_run[mt][1]);
            }
        }
        __syncthreads();  // both buffers are reloaded by pass 2
        const float sink = OPT::MODS ? sink_logit(s, Tq.h) : neg_inf();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                float inv;
                row_end<OPT::MODS>(m_run[mt][rr], quad_sum(l_run[mt][rr]), 1.f, sink, inv, lse[mt][rr]);
            }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const long long i = Tq.row(mt, rr);
            if (L.t == 0 && i < s.seq_q) {
                float* st = stats + (row0 + i) * 2;
                st[0] = delta[mt][rr];
                st[1] = lse[mt][rr];
            }
        }

    // Pass 2: dQ += dS K with dS = P (dP - Delta) (times softcap's 1 - tanh^2),
    // dP = (dO V^T) * keep / (1 - p).
    const Dropout<OPT::DROPOUT> drop(s);
    const float keep_scale = drop.keep_scale();
    float dq[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) dq[mt][nd][0] = dq[mt][nd][1] = dq[mt][nd][2] = dq[mt][nd][3] = 0.f;

    // V_{j+1} loads while S, dS and dQ use K_j; K_{j+1} loads while dP uses V_{j+1}.
    if (n_tiles > 0) load_tile<T, BN, DP, PITCH, THREADS>(sV, vb, Tq.v.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();
    if (n_tiles > 0) load_tile<T, BN, DP, PITCH, THREADS>(sK, kb, Tq.k.stride, j_first, s.kv_reach, D, vec);
    cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        const bool more = it + 1 < n_tiles;
        cp_async_wait<1>();
        __syncthreads();  // V_j landed
        float sc[MT][NT][4], dpr[MT][NT][4];
        Mma::gemm_abt<MT, NT, DP, PITCH>(sdOw, sV, dpr);
        __syncthreads();  // every warp is done with V_j
        if (more) load_tile<T, BN, DP, PITCH, THREADS>(sV, vb, Tq.v.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // K_j landed
        Mma::gemm_abt<MT, NT, DP, PITCH>(sQw, sK, sc);
        const bool whole = keys_wholly_visible<BN>(s, Tq, j0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            score_tile<OPT, NT>(s, mask, Tq.b, Tq.h, slope, Tq.row(mt, 0), Tq.row(mt, 1), j0, whole,
                                L, sc[mt]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                // Both columns 2t, 2t+1 share one Philox block.
                const u32 keep = drop.template keep_rows<false>(Tq.bh, (u32)Tq.row(mt, 0), (u32)Tq.row(mt, 1), j0, nt, L);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float l = lse[mt][r >> 1];
                    const float x = sc[mt][nt][r];
                    // 0 where not visible, and for a row that sees nothing (LSE = -inf).
                    const float P = x == neg_inf() || l == neg_inf()
                                        ? 0.f : exp2f((x - l) * FERRO_LOG2E);
                    const float dP = ((keep >> r) & 1) ? dpr[mt][nt][r] * keep_scale : 0.f;
                    float dS = P * (dP - delta[mt][r >> 1]);
                    if (OPT::MODS && x != neg_inf())  // softcap: dS times 1 - tanh^2
                        dS *= softcap_grad<OPT::MASK, true>(s, mask, Tq.b, Tq.h, Tq.row(mt, r >> 1),
                                                            j0 + nt * 8 + 2 * L.t + (r & 1), slope, x);
                    sc[mt][nt][r] = dS;
                }
            }
        }
        Mma::gemm_acc_ab<MT, NT, DP, PITCH>(sc, sK, dq);  // sc holds dS
        __syncthreads();  // every warp is done with K_j
        if (more) load_tile<T, BN, DP, PITCH, THREADS>(sK, kb, Tq.k.stride, j0 + BN, s.kv_reach, D, vec);
        cp_async_commit();
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        store_acc_tile<T, DT>(grad_q, dQ, Tq.row(mt, 0), s.seq_q, dq[mt], s.scale, L, D, vec > 1);
}
}  // namespace

#ifdef FERRO_BF16
extern "C" __global__ void __launch_bounds__(THREADS)
flash_bwd_dq_half(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                  const u16* __restrict__ out, const u16* __restrict__ grad_out,
                  u16* __restrict__ grad_q, const void* __restrict__ mask,
                  float* __restrict__ stats, const float* __restrict__ lse_in,
                  const float* __restrict__ alibi, const float* __restrict__ sinks,
                  const int* __restrict__ cu_q, const int* __restrict__ cu_k, const u32 vec,
                  const u32 mask_kind, const AttnLayout lay, const FlashBwdParams p,
                  const AttnExtras ex) {
    backward_dq<BuildOptions>(q, k, v, out, grad_out, grad_q, mask, stats, lse_in, alibi, sinks, cu_q,
                              cu_k, vec, mask_kind, lay, p, ex);
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attn_v2_bw_dq(const float* __restrict__ q, const float* __restrict__ k,
                    const float* __restrict__ v, const float* __restrict__ out,
                    const float* __restrict__ grad_out, float* __restrict__ grad_q,
                    const void* __restrict__ mask, float* __restrict__ stats,
                    const float* __restrict__ lse_in, const float* __restrict__ alibi,
                    const float* __restrict__ sinks, const int* __restrict__ cu_q,
                    const int* __restrict__ cu_k, const u32 vec, const u32 mask_kind,
                    const AttnLayout lay, const FlashBwdParams p, const AttnExtras ex) {
    backward_dq<BuildOptions>(q, k, v, out, grad_out, grad_q, mask, stats, lse_in, alibi, sinks, cu_q,
                              cu_k, vec, mask_kind, lay, p, ex);
}
#endif
