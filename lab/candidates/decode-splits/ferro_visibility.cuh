// Which keys a query row sees (causal with a KV-cache offset, the window's two sides) and the additive
// mask gather: the rules of SPEC "Attention forward", shared by every attention kernel.
#pragma once
#include "ferro_params.cuh"
#include "ferro_convert.cuh"

// Row i sits at a = i + causal_offset; key j is visible iff a - left <= j <= a + right (SPEC's
// window_left / window_right; causal makes right 0): see set_windows.
__device__ __forceinline__ bool visible(const AttnShape& s, long long a, long long j) {
    return j - a <= s.right && a - j <= s.left;
}

// Keys [lo, hi) that any row with absolute position in [a_lo, a_hi] may see (and that exist);
// everything outside is skipped tile by tile.
__device__ __forceinline__ void visible_key_range(const AttnShape& s, long long a_lo,
                                                  long long a_hi, long long& lo, long long& hi) {
    lo = 0;
    hi = s.kv_len;
    if (a_hi + s.right + 1 < hi) hi = a_hi + s.right + 1;
    if (a_lo - s.left > lo) lo = a_lo - s.left;
    if (hi < lo) hi = lo;
}

// A decode split's keys [j_lo, j_hi): the keys some row of this batch entry can see, [lo, hi)
// (its own kv_lens entry and window, clipped to the reach: past it nothing is read), cut into
// `splits` runs of whole tiles of `step` keys from lo. Each entry divides its own keys: a cache far longer
// than its sequences (kv_lens) or a sliding window leaves no split idle while others take all
// (the host plans the split count on the capacity, the most any entry can have). Splits past
// the keys are empty (j_lo == j_hi).
__device__ __forceinline__ void split_keys_range(const AttnShape& s, u32 split, u32 splits,
                                                 u32 step, long long& j_lo, long long& j_hi) {
    long long lo, hi;
    visible_key_range(s, s.offset, (long long)s.seq_q - 1 + s.offset, lo, hi);
    if (hi > s.kv_reach) hi = s.kv_reach;
    if (hi < lo) hi = lo;
    const long long tiles = (hi - lo + step - 1) / step;
    const long long per = (tiles + splits - 1) / splits * step;
    j_lo = min(hi, lo + (long long)split * per);
    j_hi = min(hi, j_lo + per);
}

// Rows [lo, hi) that may see any key in [j_lo, j_hi] (the transpose, for the dK/dV kernel).
__device__ __forceinline__ void visible_row_range(const AttnShape& s, long long j_lo,
                                                  long long j_hi, long long& lo, long long& hi) {
    lo = 0;
    hi = s.seq_q;
    if (j_lo - s.right - s.offset > lo) lo = j_lo - s.right - s.offset;
    if (j_hi + s.left + 1 - s.offset < hi) hi = j_hi + s.left + 1 - s.offset;
    if (hi < lo) hi = lo;
}

// The first of the key blocks (BK keys each, from 0) whose dK/dV block visits the query tile
// starting at row m0, given that block n visits it. Block n visits the query tiles
// [lo_n / BQ, ceil(hi_n / BQ)) of its rows [lo_n, hi_n) (visible_row_range; hi_n >= lo_n after
// its clamp); both ends are nondecreasing in n, so a tile's visitors are consecutive blocks and
// the first is the least n with hi_n > m0: a binary search over [0, n].
template <int BK>
__device__ __forceinline__ unsigned first_key_block(const AttnShape& s, long long m0, unsigned n) {
    unsigned lo = 0, hi = n;
    while (lo < hi) {
        const unsigned mid = (lo + hi) >> 1;
        const long long k0 = (long long)mid * BK;
        long long r_lo, r_hi;
        visible_row_range(s, k0, min((long long)s.seq_k, k0 + BK) - 1, r_lo, r_hi);
        if (r_hi > m0) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// The keys row i sees among [j0, j0 + n), as columns [lo, hi] counted from j0 (lo > hi: none).
// The window's sides and the keys' end each bound one side, so a row's visible keys are one
// interval and a tile without an additive mask needs two integer compares per element, not
// `visible`'s 64-bit tests. A row past seq_q (or before 0) sees nothing.
__device__ __forceinline__ void visible_cols(const AttnShape& s, long long i, long long j0, int n,
                                             int& lo, int& hi) {
    const long long a = i + s.offset;
    long long l = 0, h = s.kv_len - 1;
    if (a + s.right < h) h = a + s.right;
    if (a - s.left > l) l = a - s.left;
    l -= j0;
    h -= j0;
    lo = l < 0 ? 0 : (l > n ? n : (int)l);
    hi = h < -1 ? -1 : (h >= n ? n - 1 : (int)h);
    if (i < 0 || i >= s.seq_q) hi = -1;
}

// True when every row i in [i_lo, i_hi], rows the caller knows exist (i_hi < seq_q), sees every
// key j in [j_lo, j_hi] and all of them exist. A query tile's rows end at its m_last, below
// seq_q by construction: its test needs no compare with seq_q, which for a varlen sequence is a
// per-block value, not the kernel parameter (the compare alone cost the mma.sync forward some 50
// registers across its key loop).
__device__ __forceinline__ bool keys_visible_to_rows(const AttnShape& s, long long i_lo,
                                                     long long i_hi, long long j_lo,
                                                     long long j_hi) {
    const long long a_lo = i_lo + s.offset, a_hi = i_hi + s.offset;
    return j_hi < s.kv_len && j_hi <= a_lo + s.right && j_lo >= a_hi - s.left;
}

// True when every row i in [i_lo, i_hi] sees every key j in [j_lo, j_hi] and all of them exist,
// so a tile can skip the per-element test.
__device__ __forceinline__ bool wholly_visible(const AttnShape& s, long long i_lo, long long i_hi,
                                               long long j_lo, long long j_hi) {
    return i_hi < (long long)s.seq_q && keys_visible_to_rows(s, i_lo, i_hi, j_lo, j_hi);
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
