// The fused attention backward, float16 / bfloat16 on sm_90a (five products where the two-kernel
// backward, flash_bwd_dq_wgmma.cu + flash_bwd_dkdv_wgmma.cu, forms seven), for calls that pass
// the forward's LSE. Three launches, in order on one stream:
//   flash_bwd_fused_pre: each row's [Delta = grad_out . out, LSE] into the stats (what the dQ
//       kernel's statistics pass writes), dq_accum and the order counters zeroed;
//   flash_bwd_fused_wgmma: the dK/dV kernel built with FERRO_FUSED_DQ: dK and dV as there, and
//       dQ_part = dS K per (key block, query tile), staged in shared memory and added into
//       dq_accum by a writer warp, in a fixed order (ferro_dq_order.cuh: the accumulator's
//       fragment-ordered tiles, bit-identical runs, and why the order cannot deadlock);
//   flash_bwd_fused_post: grad_q = scale dq_accum, rounded once to the dtype.
// dS is rounded to the dtype before dS K, as the dQ kernel rounds it. Geometry from configs.py
// (BACKWARD_FUSED); the pre- and post-kernels take one block of FUSED_THREADS per (batch, head,
// query tile of FERRO_BN rows) of the frame (varlen: max_seqlen_q rows a sequence, its own
// first; rows past its length hold nothing).
#define FERRO_FUSED_DQ 1
#include "flash_bwd_dkdv_wgmma.cu"

namespace {
constexpr int ROW_LANES = 8;  // lanes per row in the pre- and post-kernels (16 bytes each)
constexpr int FUSED_THREADS = 128;  // configs.FUSED_THREADS: the launch bound (loops use blockDim)
static_assert(DP % 8 == 0, "rows of 16-byte chunks");

// The block's tile of the frame; `s` becomes its batch entry's (for_sequence).
struct FusedTile { u32 bh, b, h; long long m0; u64 q_tiles; };
__device__ __forceinline__ FusedTile fused_tile(AttnShape& s) {
    FusedTile f;
    f.q_tiles = (s.frame_q + BQ - 1) / BQ;
    f.bh = (u32)(blockIdx.x / f.q_tiles);
    f.b = f.bh / s.heads;
    f.h = f.bh % s.heads;
    f.m0 = (long long)(blockIdx.x % f.q_tiles) * BQ;
    for_sequence(s, f.b);
    return f;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(FUSED_THREADS)
flash_bwd_fused_pre(const u16* __restrict__ out, const u16* __restrict__ grad_out,
                    const float* __restrict__ lse_in, float* __restrict__ stats,
                    float* __restrict__ dq_accum, u32* __restrict__ dq_sem,
                    const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                    const AttnLayout lay, const FlashBwdParams p, const AttnExtras ex) {
    AttnShape s = attn_shape(p, ex, 0);
    with_varlen(s, ex, cu_q, cu_k);
    const FusedTile f = fused_tile(s);
    float4* acc = reinterpret_cast<float4*>(dq_accum + ((u64)f.bh * f.q_tiles * BQ + f.m0) * DP);
    for (int i = threadIdx.x; i < BQ * DP / 4; i += blockDim.x)
        acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (threadIdx.x == 0) dq_sem[(u64)f.bh * f.q_tiles + f.m0 / BQ] = 0u;

    // Delta_i = grad_out_i . out_i (both as stored, summed in float32); the forward's LSE.
    const Rows ro = q_rows(s, lay.out, f.b, f.h), rdo = q_rows(s, lay.grad_out, f.b, f.h);
    const u64 row0 = row_index(s, f.b, f.h);  // of lse_in and the stats
    const int lane = threadIdx.x % ROW_LANES, D = s.head_dim;
    for (int r = threadIdx.x / ROW_LANES; r < BQ; r += blockDim.x / ROW_LANES) {
        const long long i = f.m0 + r;
        float sum = 0.f;
        if (i < s.seq_q)
            for (int d = 8 * lane; d < D; d += 8 * ROW_LANES) {  // D: a multiple of 8
                float o[8], g[8];
                Elem<u16>::load16(out + ro.off + (u64)i * ro.stride + d, o);
                Elem<u16>::load16(grad_out + rdo.off + (u64)i * rdo.stride + d, g);
#pragma unroll
                for (int e = 0; e < 8; ++e) sum += g[e] * o[e];
            }
#pragma unroll
        for (int m = ROW_LANES / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
        if (lane == 0 && i < s.seq_q) {
            float* st = stats + (row0 + i) * 2;
            st[0] = sum;
            st[1] = lse_in[row0 + i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(FUSED_THREADS)
flash_bwd_fused_post(const float* __restrict__ dq_accum, u16* __restrict__ grad_q,
                     const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                     const AttnLayout lay, const FlashBwdParams p, const AttnExtras ex) {
    AttnShape s = attn_shape(p, ex, 0);
    with_varlen(s, ex, cu_q, cu_k);
    const FusedTile f = fused_tile(s);
    const Rows rq = q_rows(s, lay.grad_q, f.b, f.h);
    const int lane = threadIdx.x % ROW_LANES, D = s.head_dim;
    for (int r = threadIdx.x / ROW_LANES; r < BQ; r += blockDim.x / ROW_LANES) {
        const long long i = f.m0 + r;
        if (i >= s.seq_q) break;
        const float* tile = dq_accum + ((u64)f.bh * f.q_tiles * BQ + f.m0) * DP;  // fragment order
        for (int d = 8 * lane; d < D; d += 8 * ROW_LANES) {
            const float* cols = tile + dq_tile_offset(r, d);  // row i's columns d .. d + 7
            const float4 x = *reinterpret_cast<const float4*>(cols);
            const float4 y = *reinterpret_cast<const float4*>(cols + 4);
            const float sc = s.scale;
            uint4 w;
            w.x = pack2(sc * x.x, sc * x.y);
            w.y = pack2(sc * x.z, sc * x.w);
            w.z = pack2(sc * y.x, sc * y.y);
            w.w = pack2(sc * y.z, sc * y.w);
            *reinterpret_cast<uint4*>(grad_q + rq.off + (u64)i * rq.stride + d) = w;
        }
    }
}
