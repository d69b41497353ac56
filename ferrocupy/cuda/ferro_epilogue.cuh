// The epilogue every attention kernel ends with: normalise (1 / sum, dropout's 1 / (1 - p)), the
// row's lse, an attention sink's share of the denominator, one rounding to the element type, the
// store. Rows are accumulator rows (mma.sync's
// m16n8 C fragments; wgmma's the same per warp): this thread holds, of m-tile mt, rows g + 16 mt
// (c0/c1, rr = 0) and g + 8 + 16 mt (c2/c3, rr = 1), columns 8 nd + 2t, + 1.
#pragma once
#include "ferro_params.cuh"
#include "ferro_convert.cuh"
#include "ferro_softmax.cuh"

// The factor that finishes a row of O: 1 / l times `keep_scale` (dropout's 1 / (1 - p), else 1);
// 0 for a row that saw no key (l = 0). NaN stays NaN.
__device__ __forceinline__ float row_normaliser(float l, float keep_scale) {
    return l == 0.f ? 0.f : keep_scale / l;
}

// A finished row's factor for O (keep_scale / its denominator; 0 for a row with nothing in it)
// and its lse, from its running max m (scaled units) and its sum l relative to m. SINKS (a variant
// built with sinks; the call's sink logit `sink`, -inf without one): the sink joins the
// denominator, exp(sink - m) + l (SPEC), computed relative to max(m, sink) so neither term
// overflows; a row that saw no key then has O = 0 and lse = sink. Without SINKS, row_normaliser and
// row_lse.
template <bool SINKS>
__device__ __forceinline__ void row_end(float m, float l, float keep_scale, float sink, float& inv,
                                        float& lse) {
    if (!SINKS) {
        inv = row_normaliser(l, keep_scale);
        lse = row_lse(m, l);
        return;
    }
    const float M = fmaxf(m, sink);
    if (M == neg_inf()) {  // no key and no sink
        inv = 0.f;
        lse = neg_inf();
        return;
    }
    const float e_m = m == neg_inf() ? 0.f : expf(m - M), e_s = expf(sink - M);
    const float denom = fmaf(l, e_m, e_s);
    inv = e_m == 0.f ? 0.f : keep_scale * e_m / denom;
    lse = M + logf(denom);
}

// Columns d, d + 1 of `row` (those < D), rounded once to T. `pairs`: both 16-bit columns at one
// store (every row 4-byte aligned and D even: the launch's copy width `vec` > 1). float32 goes a
// column at a time: pair stores pushed the float32 dQ kernel from 184 registers to 255 and spills
// (head_dim 64).
template <class T>
__device__ __forceinline__ void store_cols(T* row, int d, float x0, float x1, int D, bool pairs) {
    if constexpr (sizeof(T) == 2) {
        if (pairs) {
            if (d < D) Elem<T>::store2(row + d, x0, x1);
            return;
        }
    }
    if (d < D) row[d] = Elem<T>::from_f(x0);
    if (d + 1 < D) row[d + 1] = Elem<T>::from_f(x1);
}

// Half rr of an accumulator m-tile (DT n-tiles of 8 columns) times `mul` into `row`.
template <class T, int DT>
__device__ __forceinline__ void store_acc_row(T* row, const float (&acc)[DT][4], int rr, float mul,
                                              Lane L, int D, bool pairs) {
#pragma unroll
    for (int nd = 0; nd < DT; ++nd)
        store_cols(row, nd * 8 + 2 * L.t, acc[nd][2 * rr] * mul, acc[nd][2 * rr + 1] * mul, D, pairs);
}

// This thread's two rows of an accumulator m-tile (row0: c0/c1, row0 + 8: c2/c3), those inside
// [0, n_rows), times `mul` into the rows `at` of a tensor: dQ.
template <class T, int DT>
__device__ __forceinline__ void store_acc_tile(T* base, Rows at, long long row0, long long n_rows,
                                               const float (&acc)[DT][4], float mul, Lane L, int D,
                                               bool pairs) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long i = row0 + 8 * rr;
        if (i < 0 || i >= n_rows) continue;
        store_acc_row<T, DT>(base + at.off + (u64)i * at.stride, acc, rr, mul, L, D, pairs);
    }
}

// Two accumulator m-tiles of the same rows into two tensors (dK times the scale, and dV), a column
// pair of each in turn (stored row by row, the dK/dV kernels spilled more).
template <class T, int DT>
__device__ __forceinline__ void store_acc_tile2(T* base_a, Rows at_a, const float (&acc_a)[DT][4],
                                                float mul_a, T* base_b, Rows at_b,
                                                const float (&acc_b)[DT][4], float mul_b,
                                                long long row0, long long n_rows, Lane L, int D,
                                                bool pairs) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long i = row0 + 8 * rr;
        if (i < 0 || i >= n_rows) continue;
        T* ra = base_a + at_a.off + (u64)i * at_a.stride;
        T* rb = base_b + at_b.off + (u64)i * at_b.stride;
#pragma unroll
        for (int nd = 0; nd < DT; ++nd) {
            const int d = nd * 8 + 2 * L.t;
            const float a0 = acc_a[nd][2 * rr] * mul_a, a1 = acc_a[nd][2 * rr + 1] * mul_a;
            const float b0 = acc_b[nd][2 * rr] * mul_b, b1 = acc_b[nd][2 * rr + 1] * mul_b;
            if constexpr (sizeof(T) == 2) {
                if (pairs) {
                    if (d < D) Elem<T>::store2(ra + d, a0, a1), Elem<T>::store2(rb + d, b0, b1);
                    continue;
                }
            }
            if (d < D) ra[d] = Elem<T>::from_f(a0), rb[d] = Elem<T>::from_f(b0);
            if (d + 1 < D) ra[d + 1] = Elem<T>::from_f(a1), rb[d + 1] = Elem<T>::from_f(b1);
        }
    }
}

// The forwards' end for one m-tile: O normalised, rounded and stored, and each row's lse (when
// asked for) from its running max (times `m_scale`: the scale for raw-unit maxima, 1 for scaled
// ones), its sum, which each lane holds a quarter of (quad_sum), and (SINKS) the head's sink
// logit (row_end). This thread's rows: row0 (c0/c1) and row0 + 8 (c2/c3) of the (batch, head)
// whose rows of `out` are `o_rows` and whose row 0 is `lse_row0` of lse (row_index).
template <class T, int DT, bool SINKS>
__device__ __forceinline__ void finish_forward(const float (&o)[DT][4], const float (&m_run)[2],
                                               const float (&l_run)[2], float m_scale,
                                               float keep_scale, float sink, long long row0,
                                               u32 seq_q, u64 lse_row0, T* out, Rows o_rows, float* lse,
                                               Lane L, int D, bool pairs) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float l = quad_sum(l_run[rr]);  // every lane (shuffles), before the row test
        float inv, lse_i;
        row_end<SINKS>(m_run[rr] * m_scale, l, keep_scale, sink, inv, lse_i);
        const long long i = row0 + 8 * rr;
        if (i < 0 || i >= seq_q) continue;
        if (lse && L.t == 0) lse[lse_row0 + i] = lse_i;
        store_acc_row<T, DT>(out + o_rows.off + (u64)i * o_rows.stride, o, rr, inv, L, D, pairs);
    }
}
