// Which keys a query row sees (causal with a KV-cache offset, sliding window) and the additive
// mask gather: the rules of SPEC "Attention forward", shared by every attention kernel.
#pragma once
#include "ferro_params.cuh"
#include "ferro_convert.cuh"

// Row i sits at a = i + causal_offset; key j is visible iff
// (!causal || j <= a) && (window == 0 || |a - j| < window).
__device__ __forceinline__ bool visible(const AttnShape& s, long long a, long long j) {
    if (s.causal && j > a) return false;
    if (s.window) {
        long long d = a - j;
        if (d < 0) d = -d;
        if (d >= (long long)s.window) return false;
    }
    return true;
}

// Keys [lo, hi) that any row with absolute position in [a_lo, a_hi] may see; everything outside
// is skipped tile by tile (causal, window).
__device__ __forceinline__ void visible_key_range(const AttnShape& s, long long a_lo,
                                                  long long a_hi, long long& lo, long long& hi) {
    lo = 0;
    hi = s.kv_len;
    if (s.causal && a_hi + 1 < hi) hi = a_hi + 1;
    if (s.window) {
        long long w = s.window;
        if (a_lo - w + 1 > lo) lo = a_lo - w + 1;
        if (a_hi + w < hi) hi = a_hi + w;
    }
    if (hi < lo) hi = lo;
}

// Rows [lo, hi) that may see any key in [j_lo, j_hi] (the transpose, for the dK/dV kernel).
__device__ __forceinline__ void visible_row_range(const AttnShape& s, long long j_lo,
                                                  long long j_hi, long long& lo, long long& hi) {
    lo = 0;
    hi = s.seq_q;
    if (s.causal && j_lo - s.offset > lo) lo = j_lo - s.offset;   // need a = i + off >= j
    if (s.window) {
        long long w = s.window;
        if (j_lo - w + 1 - s.offset > lo) lo = j_lo - w + 1 - s.offset;  // a > j - w
        if (j_hi + w - s.offset < hi) hi = j_hi + w - s.offset;          // a < j + w
    }
    if (hi < lo) hi = lo;
}

// The keys row i sees among [j0, j0 + n), as columns [lo, hi] counted from j0 (lo > hi: none).
// Causal, window and the keys' end each bound one side, so a row's visible keys are one interval
// and a tile without an additive mask needs two integer compares per element, not `visible`'s
// 64-bit tests. A row past seq_q (or before 0) sees nothing.
__device__ __forceinline__ void visible_cols(const AttnShape& s, long long i, long long j0, int n,
                                             int& lo, int& hi) {
    const long long a = i + s.offset;
    long long l = 0, h = s.kv_len - 1;
    if (s.causal && a < h) h = a;
    if (s.window) {
        const long long w = s.window;
        if (a - w + 1 > l) l = a - w + 1;
        if (a + w - 1 < h) h = a + w - 1;
    }
    l -= j0;
    h -= j0;
    lo = l < 0 ? 0 : (l > n ? n : (int)l);
    hi = h < -1 ? -1 : (h >= n ? n - 1 : (int)h);
    if (i < 0 || i >= s.seq_q) hi = -1;
}

// True when every row i in [i_lo, i_hi] sees every key j in [j_lo, j_hi] and all of them exist,
// so a tile can skip the per-element test.
__device__ __forceinline__ bool wholly_visible(const AttnShape& s, long long i_lo, long long i_hi,
                                               long long j_lo, long long j_hi) {
    const long long a_lo = i_lo + s.offset, a_hi = i_hi + s.offset;
    return i_hi < (long long)s.seq_q && j_hi < s.kv_len && (!s.causal || j_hi <= a_lo) &&
           (!s.window || (a_hi - j_lo < s.window && j_hi - a_lo < s.window));
}

// The additive mask at (b, h, i, j) through its broadcast strides, as float32 whatever its type
// (float32, or the call's half dtype).
__device__ __forceinline__ float mask_at(const AttnShape& s, const void* mask, u32 b, u32 h,
                                         long long i, long long j) {
    const u64 idx = (u64)b * s.sb + (u64)h * s.sh + (u64)i * s.sq + (u64)j * s.sk;
    if (s.mask_kind == MASK_F32) return static_cast<const float*>(mask)[idx];
    const u16 x = static_cast<const u16*>(mask)[idx];
    return s.mask_kind == MASK_BF16 ? bf16_to_float(x) : f16_to_float(x);
}
