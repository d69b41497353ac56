// The attention sinks' gradient (SPEC "Beyond the seed, part 2"): grad_sinks[h] =
// -sum_{b,i} exp(sink_h - LSE_bhi) * Delta_bhi, from the [Delta, LSE] stats the dQ kernel wrote
// ([batch * heads * seq_q][2], or in a varlen call [heads * total_q][2] with total_q =
// cu_q[batch]: ferro_params.cuh's row_index; the LSE holds the sink). Written, never
// accumulated. One block per head: each thread sums a fixed stride of the rows in float64, then a fixed tree over the block,
// so every run gives the same bits (no atomics). A row whose LSE is -inf (no key and a sink of
// -inf) has no sink probability and adds nothing.
#include "ferro_params.cuh"

namespace {
constexpr int THREADS = 256;
}

extern "C" __global__ void __launch_bounds__(THREADS)
flash_bwd_sinks(const float* __restrict__ stats, const float* __restrict__ sinks,
                float* __restrict__ grad_sinks, const int* __restrict__ cu_q,
                const FlashBwdParams p, const AttnExtras ex) {
    __shared__ double part[THREADS];
    const u32 h = blockIdx.x, tid = threadIdx.x;
    const double sink = sinks[h];
    const bool varlen = ex.flags & EXTRAS_VARLEN;
    const u64 rows = varlen ? (u64)cu_q[p.batch] : (u64)p.batch * p.seq_q;  // of head h
    double acc = 0.0;
    for (u64 n = tid; n < rows; n += THREADS) {
        const u64 row = varlen ? (u64)h * rows + n
                               : ((n / p.seq_q) * p.heads + h) * p.seq_q + n % p.seq_q;
        const float* st = stats + row * 2;
        const float delta = st[0], lse = st[1];
        if (lse != neg_inf()) acc += exp(sink - (double)lse) * (double)delta;
    }
    part[tid] = acc;
    __syncthreads();
#pragma unroll
    for (u32 w = THREADS / 2; w; w >>= 1) {
        if (tid < w) part[tid] += part[tid + w];
        __syncthreads();
    }
    if (tid == 0) grad_sinks[h] = (float)(-part[0]);
}
