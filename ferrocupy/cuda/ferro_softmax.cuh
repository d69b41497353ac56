// Row reductions over an mma accumulator tile and the online softmax (float32 for every dtype).
// A row's elements sit in the 4 lanes of a quad (lane = 4g + t), so a row reduction is two
// shuffles.
#pragma once
#include "ferro_params.cuh"

#define FERRO_LOG2E 1.4426950408889634f
#define FERRO_LN2 0.6931471805599453f

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Online softmax over one row of a score tile (rr = 0: c0, c1; rr = 1: c2, c3): updates the running
// max and sum, overwrites the scores with exp2((s - max) * sl2), returns the factor for the
// running output. A row whose scores are all -inf so far keeps max -inf and contributes zeros.
// With sl2 = scale * log2(e) the scores may stay raw (q.k, before the scale, so the common tile
// skips a multiply per element; max and m_run are then raw, and the row's LSE is
// m_run * scale + log(l)); scaled scores take `online_softmax`.
// MASKED (the kernel is built with the additive mask) and `has_mask` (the call has one): the scores
// may hold a mask, so a row's may all be finite and below -FLT_MAX / sl2 (float32's or bfloat16's
// lowest as the mask on every key it sees). Then the difference s - max is taken before the
// multiply, since the fused fma(s, sl2, -max * sl2) would overflow max * sl2 to -inf and make P
// NaN (inf - inf). Without a mask a score is q.k, softcapped or an ALiBi distance, far from that,
// and the fma (one instruction a score, not two) is exact enough: the hot loop. A call without a
// mask takes the fma in every variant, so the plain and the general builds give it the same bits
// (an unaligned view runs a general mma.sync build, its aligned twin a plain wgmma one).
template <int NT, bool MASKED>
__device__ __forceinline__ float online_softmax_raw(float (&sc)[NT][4], int rr, float& m_run,
                                                    float& l_run, float sl2, bool has_mask) {
    float mx = neg_inf();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][2 * rr], sc[nt][2 * rr + 1]));
    mx = quad_max(mx);
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;
    const float alpha = exp2f((m_run - m_use) * sl2);
    m_run = m_new;
    const float m_sl2 = m_use * sl2;
    float sum = 0.f;
    if (MASKED && has_mask) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float e = exp2f((sc[nt][2 * rr + c] - m_use) * sl2);
                sum += e;
                sc[nt][2 * rr + c] = e;
            }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float e = exp2f(fmaf(sc[nt][2 * rr + c], sl2, -m_sl2));
                sum += e;
                sc[nt][2 * rr + c] = e;
            }
    }
    l_run = l_run * alpha + sum;
    return alpha;
}

template <int NT>
__device__ __forceinline__ float online_softmax(float (&sc)[NT][4], int rr, float& m_run,
                                                float& l_run) {
    return online_softmax_raw<NT, true>(sc, rr, m_run, l_run, FERRO_LOG2E, true);
}

// O's two rows (alpha[0]: c0/c1's, alpha[1]: c2/c3's) times the softmax's rescale factors, only
// when some row of the warp had its max move (alpha != 1): after the first tiles it rarely does,
// and the multiply by exactly 1 is skipped, not approximated.
template <int DT>
__device__ __forceinline__ void rescale_rows(float (&o)[DT][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) {
            o[nd][0] *= alpha[0];
            o[nd][1] *= alpha[0];
            o[nd][2] *= alpha[1];
            o[nd][3] *= alpha[1];
        }
    }
}

// A finished row's log-sum-exp (natural log) from its running max and quad-summed sum;
// -inf for a row that saw no key.
__device__ __forceinline__ float row_lse(float m_run, float l) {
    return l == 0.f ? neg_inf() : m_run + logf(l);
}
