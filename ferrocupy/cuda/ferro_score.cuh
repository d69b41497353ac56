// The score modifier: what turns a tile of q.k products into the probabilities a kernel multiplies,
// for every kernel family (mma.sync, wgmma, decode): which keys each row sees (causal + offset,
// window, kv_lens: ferro_visibility.cuh's rules, here as per-row spans and tile tests), softcap,
// ALiBi, the additive mask, and dropout. The mask, dropout and the model options (softcap, ALiBi
// and sinks: `MODS`) are compile-time options of a variant (`Options`): a `plain` variant
// (FERRO_PLAIN=1, configs.py's `plain`) has none of them, so its key loop holds no register for
// them. Which of them a call uses is known only at run time (AttnShape).
//
// Accumulator tiles are mma.sync's m16n8 C fragments (wgmma's are laid out the same per warp):
// element r of n-tile nt sits at row g + 8 * (r >> 1), column nt * 8 + 2t + (r & 1).
#pragma once
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_philox.cuh"

template <bool MASK_, bool DROPOUT_, bool MODS_>
struct Options {
    static constexpr bool MASK = MASK_, DROPOUT = DROPOUT_, MODS = MODS_;
};
#ifndef FERRO_PLAIN
#define FERRO_PLAIN 0
#endif
#ifndef FERRO_MODS
#define FERRO_MODS 0
#endif
// This build's options: configs.py's `plain` variants serve only calls with none of them; its
// `mods` ones (FERRO_MODS) alone serve calls with softcap, ALiBi or sinks.
#ifndef FERRO_UNMASKED  // a `mods` build without the additive mask and dropout (configs.py)
#define FERRO_UNMASKED 0
#endif
#define FERRO_MASKED (!FERRO_PLAIN && !FERRO_UNMASKED)  // the mask and dropout compiled in
typedef Options<FERRO_MASKED, FERRO_MASKED, FERRO_MODS && !FERRO_PLAIN> BuildOptions;

// ---- visibility as spans: a row's visible keys are one interval -----------------------------------

// The keys one row sees, as columns [lo, hi] counted from some first key (lo > hi: none).
struct KeySpan {
    int lo, hi;
    // The same span counted from `shift` columns further on.
    __device__ __forceinline__ KeySpan from(int shift) const { return {lo - shift, hi - shift}; }
    // Whether the row sees every one of columns [0, n).
    __device__ __forceinline__ bool covers(int n) const { return lo <= 0 && hi >= n - 1; }
};

// Row i's visible keys among [j0, j0 + n) (visible_cols: causal, window, the keys' end, rows past
// seq_q see none).
__device__ __forceinline__ KeySpan key_span(const AttnShape& s, long long i, long long j0, int n) {
    KeySpan k;
    visible_cols(s, i, j0, n, k.lo, k.hi);
    return k;
}

// The query rows key j sees among [i0, i0 + n), counted from i0: key_span's transpose, for the
// dK/dV kernels (a = i + offset sees j iff a - left <= j <= a + right; a key past the keys' end
// is seen by no row).
__device__ __forceinline__ KeySpan row_span(const AttnShape& s, long long j, long long i0, int n) {
    long long lo = 0, hi = (long long)s.seq_q - 1;
    if (j >= s.kv_len) hi = -1;
    if (j - s.right - s.offset > lo) lo = j - s.right - s.offset;
    if (j + s.left - s.offset < hi) hi = j + s.left - s.offset;
    lo -= i0;
    hi -= i0;
    return {lo < 0 ? 0 : (lo > n ? n : (int)lo), hi < -1 ? -1 : (hi >= n ? n - 1 : (int)hi)};
}

// -inf outside each row's span, scores left as they are inside: an accumulator tile of 16 rows
// (span[0]: c0/c1's row, span[1]: c2/c3's) x 8*NT keys, spans counted from the tile's first key.
template <int NT>
__device__ __forceinline__ void hide_outside(const KeySpan (&span)[2], Lane L, float (&sc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int c = nt * 8 + 2 * L.t + (r & 1);
            if (c < span[r >> 1].lo || c > span[r >> 1].hi) sc[nt][r] = neg_inf();
        }
}

// ---- scores: scale, softcap, ALiBi, additive mask, -inf where not visible ----------------------

// Head h's ALiBi slope in batch b (0 without ALiBi), read once per (batch, head) by the caller.
__device__ __forceinline__ float alibi_slope(const AttnShape& s, u32 b, u32 h) {
    return s.alibi ? s.alibi[(u64)b * s.alibi_b + h] : 0.f;
}

// Head h's sink logit; -inf (no sink: it adds exp(-inf) = 0) without sinks.
__device__ __forceinline__ float sink_logit(const AttnShape& s, u32 h) {
    return s.sinks ? s.sinks[h] : neg_inf();
}

// Whether the call changes scores element by element past the scale (softcap, ALiBi, a mask) as
// far as the variant has those options: a tile wholly visible then still needs per-element work.
template <class OPT>
__device__ __forceinline__ bool per_element(const AttnShape& s) {
    return (OPT::MASK && s.has_mask) || (OPT::MODS && (s.softcap > 0.f || s.alibi));
}

// The score of (b, h, i, j) from its scaled product x (SPEC): softcap(x) = softcap *
// tanh(x / softcap), then ALiBi's -slope * |a - j| (a = i + offset), then the additive mask, each
// where the variant (MASK, MODS) and the call have it; the mask only where `ok` (visible, inside
// both sequences: elsewhere it is never read).
// softcap * tanh(x / softcap). Float32 builds: tanhf and a true division (the float32 path is the
// accurate one). 16-bit builds: the reciprocal's product and sm_75's tanh.approx.f32 (one MUFU
// op, relative error below 2^-10.9, under a bfloat16 ulp and about float16's), where tanhf
// took ~20 instructions and the division ~8 a score, and the per-element loop of a softcap call
// ran at 0.29x the plain call's TFLOP/s (H100, 2026-12-07: 108 against 372, bf16 D128 S4096).
__device__ __forceinline__ float softcapped(const AttnShape& s, float x) {
#ifdef FERRO_BF16
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x * (1.f / s.softcap)));
    return s.softcap * t;
#else
    return s.softcap * tanhf(x / s.softcap);
#endif
}

template <bool MASK, bool MODS>
__device__ __forceinline__ float modified_score(const AttnShape& s, const void* mask, u32 b, u32 h,
                                                long long i, long long j, bool ok, float slope,
                                                float x) {
    if (MODS) {
        if (s.softcap > 0.f) x = softcapped(s, x);
        if (s.alibi) {
            const long long d = i + s.offset - j;
            x = fmaf(-slope, (float)(d < 0 ? -d : d), x);
        }
    }
    if (MASK && s.has_mask && ok) x += mask_at(s, mask, b, h, i, j);
    return x;
}

// A visible score without an additive mask, in float operations only (the common tile of a
// softcap or ALiBi call; modified_score's 64-bit distance and per-element tests cost as much as
// the products there: H100, bf16 D128, ALiBi's forward ran at 0.38x the plain call): x the scaled
// product, `dist` = |a - j| as a float (exact below 2^24 keys; beyond, rounded as the float32
// score is anyway), slope 0 without ALiBi. `t` gets tanh(x / softcap) (0 without softcap): the
// backward's softcap derivative is 1 - t^2.
__device__ __forceinline__ float capped_alibi(const AttnShape& s, float slope, float x, float dist,
                                              float& t) {
    t = 0.f;
    if (s.softcap > 0.f) {
        x = softcapped(s, x);
        t = x * (1.f / s.softcap);
    }
    return fmaf(-slope, dist, x);
}

// Whether a tile the caller knows wholly visible takes capped_alibi: the variant has the model
// options and the call softcap or ALiBi, and no additive mask.
template <class OPT>
__device__ __forceinline__ bool float_mods(const AttnShape& s) {
    return OPT::MODS && (s.softcap > 0.f || s.alibi) && !(OPT::MASK && s.has_mask);
}

// The softcap's derivative from a visible element's capped score (capped_alibi's before ALiBi,
// i.e. the score plus slope * dist): 1 - tanh^2, tanh = capped / softcap.
__device__ __forceinline__ float capped_grad(const AttnShape& s, float capped) {
    const float t = fminf(fmaxf(capped * (1.f / s.softcap), -1.f), 1.f);
    return 1.f - t * t;
}

// The softcap's derivative at a visible element whose score (modified_score's) is `score`:
// 1 - tanh^2, with tanh recovered as (score - ALiBi - mask) / softcap; 1 without softcap (SPEC:
// the backward multiplies dS by it). The backward kernels no longer hold the product itself when
// they form dS, so they pass the score (or lse + log P, which is the score where P > 0).
template <bool MASK, bool MODS>
__device__ __forceinline__ float softcap_grad(const AttnShape& s, const void* mask, u32 b, u32 h,
                                              long long i, long long j, float slope, float score) {
    if (!MODS || !(s.softcap > 0.f)) return 1.f;
    if (s.alibi) {
        const long long d = i + s.offset - j;
        score = fmaf(slope, (float)(d < 0 ? -d : d), score);
    }
    if (MASK && s.has_mask) score -= mask_at(s, mask, b, h, i, j);
    return capped_grad(s, score);
}

// Whether a tile the caller knows wholly visible takes add_mask_row: the call has an additive mask
// with unit key stride (its rows contiguous) and no softcap or ALiBi (their order around the mask
// is modified_score's).
template <class OPT>
__device__ __forceinline__ bool row_mask(const AttnShape& s) {
    return OPT::MASK && s.has_mask && s.sk == 1 && !(OPT::MODS && (s.softcap > 0.f || s.alibi));
}

// Scaled scores plus the additive mask, for row i's half (rr: c0/c1, or c2/c3) of an accumulator
// tile whose keys j0 + 8 nt + 2t, + 1 all exist and are visible to it (a wholly visible tile;
// row_mask's call). Where the row exists (0 <= i < seq_q: a tile's last rows may not, and stay
// as they are, never stored), its mask offset is formed once and each lane's two adjacent keys
// come in one 4-byte (16-bit mask) or 8-byte (float32) load where their address is aligned, else
// two; mask_at's per-element form (four 64-bit products, the type test) cost the masked wgmma
// forward most of its time (H100, bf16 D128 S4096: 0.35x SDPA with the same bias).
// x * scale + m, as modified_score forms it (the product, then the mask added).
__device__ __forceinline__ float mask_added(float x, float scale, float m) {
    x = x * scale;
    return x + m;
}

template <int NT>
__device__ __forceinline__ void add_mask_row(const AttnShape& s, const void* mask, u32 b, u32 h,
                                             long long i, long long j0, int rr, Lane L,
                                             float (&sc)[NT][4]) {
    const int e = 2 * rr;
    if (i < 0 || i >= (long long)s.seq_q) return;
    const u64 base = (u64)b * s.sb + (u64)h * s.sh + (u64)i * s.sq + (u64)(j0 + 2 * L.t);
    if (s.mask_kind == MASK_F32) {
        const float* m = static_cast<const float*>(mask) + base;
        if (!(reinterpret_cast<unsigned long long>(m) & 7ull)) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 w = *reinterpret_cast<const float2*>(m + nt * 8);
                sc[nt][e] = mask_added(sc[nt][e], s.scale, w.x);
                sc[nt][e + 1] = mask_added(sc[nt][e + 1], s.scale, w.y);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                sc[nt][e] = mask_added(sc[nt][e], s.scale, m[nt * 8]);
                sc[nt][e + 1] = mask_added(sc[nt][e + 1], s.scale, m[nt * 8 + 1]);
            }
        }
        return;
    }
    const u16* m = static_cast<const u16*>(mask) + base;
    const bool bf = s.mask_kind == MASK_BF16;
    if (!(reinterpret_cast<unsigned long long>(m) & 3ull)) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32 w = *reinterpret_cast<const u32*>(m + nt * 8);
            const float lo = bf ? __uint_as_float(w << 16) : f16_to_float((u16)(w & 0xffffu));
            const float hi = bf ? __uint_as_float(w & 0xffff0000u) : f16_to_float((u16)(w >> 16));
            sc[nt][e] = mask_added(sc[nt][e], s.scale, lo);
            sc[nt][e + 1] = mask_added(sc[nt][e + 1], s.scale, hi);
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u16 lo = m[nt * 8], hi = m[nt * 8 + 1];
            sc[nt][e] = mask_added(sc[nt][e], s.scale, bf ? bf16_to_float(lo) : f16_to_float(lo));
            sc[nt][e + 1] = mask_added(sc[nt][e + 1], s.scale, bf ? bf16_to_float(hi) : f16_to_float(hi));
        }
    }
}

// Scores of 16 rows (i0: c0/c1's row, i1 = c2/c3's) x 8*NT keys from j0 of head h (ALiBi `slope`):
// scale, softcap, ALiBi, additive mask, -inf where a key is not visible (or a row or key is past
// the end). `whole`: every key is known visible (keys_wholly_visible).
template <class OPT, int NT>
__device__ __forceinline__ void score_tile(const AttnShape& s, const void* mask, u32 b, u32 h,
                                           float slope, long long i0, long long i1, long long j0,
                                           bool whole, Lane L, float (&sc)[NT][4]) {
    if (whole && !per_element<OPT>(s)) {  // the common case: nothing to test per element
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) sc[nt][r] *= s.scale;
        return;
    }
    if (whole && row_mask<OPT>(s)) {  // the mask alone, every key visible
        add_mask_row<NT>(s, mask, b, h, i0, j0, 0, L, sc);
        add_mask_row<NT>(s, mask, b, h, i1, j0, 1, L, sc);
        return;
    }
    if (whole && float_mods<OPT>(s)) {  // softcap and ALiBi alone, every key visible
        // a - j of element r of n-tile nt, a = i + offset: d[r >> 1] - (8 nt + (r & 1))
        const float d[2] = {(float)(i0 + s.offset - j0 - 2 * L.t),
                            (float)(i1 + s.offset - j0 - 2 * L.t)};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                float t;
                sc[nt][r] = capped_alibi(s, slope, sc[nt][r] * s.scale,
                                         fabsf(d[r >> 1] - (float)(nt * 8 + (r & 1))), t);
            }
        return;
    }
    // (hide_outside's interval test is cheaper per element, but here it cost the general
    // kernels registers: the wgmma forward spilled 784 bytes with it, 80 without.)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const long long i = r < 2 ? i0 : i1, j = j0 + nt * 8 + 2 * L.t + (r & 1);
            const bool ok = i >= 0 && i < s.seq_q && j < s.kv_len &&
                            (whole || visible(s, i + s.offset, j));
            const float x = modified_score<OPT::MASK, OPT::MODS>(s, mask, b, h, i, j, ok, slope,
                                                                sc[nt][r] * s.scale);
            sc[nt][r] = ok ? x : neg_inf();
        }
}

// Whether the forwards' scores stay raw (q.k: the softmax folds the scale into its exponent, so the
// common tile skips a multiply per element): unless the call has an additive mask, whose finite
// values below -FLT_MAX * scale have no raw form (they overflowed to -inf, and a row whose every
// score was one came out dead). The softmax's sl2 and the lse's m_scale follow it.
template <class OPT>
__device__ __forceinline__ bool raw_units(const AttnShape& s) {
    return !(OPT::MASK && s.has_mask);
}

// A forward's scores in raw_units' units: left as they are on a tile with nothing to do per
// element (which a masked call never has); else scored by score_tile and, raw, brought back.
template <class OPT, int NT>
__device__ __forceinline__ void raw_scores(const AttnShape& s, const void* mask, u32 b, u32 h,
                                           float slope, long long i0, long long i1, long long j0,
                                           bool whole, Lane L, float (&sc)[NT][4]) {
    if (whole && !per_element<OPT>(s)) return;
    score_tile<OPT, NT>(s, mask, b, h, slope, i0, i1, j0, whole, L, sc);
    const float to_units = raw_units<OPT>(s) ? 1.f / s.scale : 1.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[nt][r] *= to_units;
}

// ---- dropout (SPEC "Dropout"): P' = P * keep / (1 - p), keep bits from Philox ---------------------

// ENABLED false (a plain variant): every call below folds away.
template <bool ENABLED>
struct Dropout {
    const AttnShape& s;  // (the seed and p read from it where used, as the kernel's own code would)
    u32 thr;
    bool on;
    __device__ __forceinline__ explicit Dropout(const AttnShape& shape)
        : s(shape), thr(dropout_threshold(shape.dropout_prob)),
          on(ENABLED && shape.dropout_prob > 0.f) {}

    // What multiplies a kept element, once (on O's normaliser, dP or P'); 1 without dropout.
    __device__ __forceinline__ float keep_scale() const {
        return on ? 1.f / (1.f - s.dropout_prob) : 1.f;
    }

    // Keep bits of row i from key j on (bit 0: j, up to the end of j's Philox block of four).
    __device__ __forceinline__ u32 bits(u32 bh, u32 i, u32 j) const {
        return dropout_keep4(s.seed, thr, bh, i, j) >> (j & 3);
    }

    // Sharing a draw. One Philox4x32-10 (~90 instructions) gives the keep bits of four keys of
    // one row, and the lanes of a warp read them in twos or ones: in an accumulator tile lanes
    // t and t ^ 1 of a quad read one block (keys 8 nt + 4 (t >> 1) .. + 3) of both their rows;
    // in dK/dV (keys as rows) the four lanes g, g ^ 1, g ^ 2, g ^ 3 of one t read one block of
    // both their query columns. Where the tile starts on a block (key offset % 4 == 0, the same
    // in the whole warp), each lane draws one of the blocks its group reads and the group swaps
    // them by shuffles: a draw per lane where there were two (rows) or four (columns). Every
    // lane of the warp must call these together (the kernels' loops are whole-warp). SHARED
    // (default) chooses it; the mma.sync kernels and the wgmma dK/dV pass false: there the
    // shuffles' registers cost more than the draws they save (ptxas spill stores, nvcc 13.0:
    // mma.sync bf16 d64 forward 0 -> 88 B, float32 d128 0 -> 8; wgmma dK/dV bf16 d128 96 -> 180,
    // fused 92 -> 460).
    //
    // Rows: the words of rows row[0] and row[1] (heads bh[0], bh[1]) at key j's block, lane
    // t & 1 drawing row[t & 1]'s.
    __device__ __forceinline__ void shared_rows(const u32 (&bh)[2], const u32 (&row)[2], u32 j,
                                                Lane L, u32 (&w)[2]) const {
        const int mine = L.t & 1;
        const u32 drawn = dropout_keep4(s.seed, thr, bh[mine], row[mine], j);
        const u32 theirs = __shfl_xor_sync(0xffffffffu, drawn, 1);
        w[mine] = drawn;
        w[mine ^ 1] = theirs;
    }

    // The forwards: zero the dropped P of an accumulator tile (row[0]: c0/c1's row of head bh[0],
    // row[1]: c2/c3's) whose n-tile nt holds keys j0 + 8 nt + 2t, + 1; l keeps P's sum. EVEN: j0
    // is even, so both keys of a pair share a Philox block (else a pair may open the next).
    template <int NT, bool EVEN, bool SHARED = true>
    __device__ __forceinline__ void drop(float (&sc)[NT][4], const u32 (&bh)[2], const u32 (&row)[2],
                                         u32 j0, Lane L) const {
        if (!on) return;
        if (SHARED && EVEN && !(j0 & 3u)) {  // tiles on a block: lanes t, t ^ 1 share draws
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const u32 j = j0 + nt * 8 + 2 * L.t;
                u32 w[2];
                shared_rows(bh, row, j, L, w);
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const u32 k = w[rr] >> (j & 3u);
                    if (!(k & 1u)) sc[nt][2 * rr] = 0.f;
                    if (!(k & 2u)) sc[nt][2 * rr + 1] = 0.f;
                }
            }
            return;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const u32 j = j0 + nt * 8 + 2 * L.t;
                if constexpr (EVEN) {
                    const u32 k = bits(bh[rr], row[rr], j);
                    if (!(k & 1u)) sc[nt][2 * rr] = 0.f;
                    if (!(k & 2u)) sc[nt][2 * rr + 1] = 0.f;
                } else {
                    const u32 w = dropout_keep4(s.seed, thr, bh[rr], row[rr], j);
                    const u32 w1 = ((j + 1) & 3) ? w : dropout_keep4(s.seed, thr, bh[rr], row[rr], j + 1);
                    if (!((w >> (j & 3)) & 1u)) sc[nt][2 * rr] = 0.f;
                    if (!((w1 >> ((j + 1) & 3)) & 1u)) sc[nt][2 * rr + 1] = 0.f;
                }
            }
    }

    // dQ: bit r = element r of n-tile nt of an accumulator tile (rows i0: r = 0, 1; i1: r = 2, 3;
    // keys j0 + 8 nt + 2t, + 1, sharing a Philox block: j0 even); all kept without dropout.
    template <bool SHARED = true>
    __device__ __forceinline__ u32 keep_rows(u32 bh, u32 i0, u32 i1, long long j0, int nt,
                                             Lane L) const {
        u32 keep = 0xFu;
        if (on) {
            const u32 j = (u32)(j0 + nt * 8 + 2 * L.t);
            if (SHARED && !(j0 & 3)) {  // on a block: lanes t, t ^ 1 share the draws
                const u32 b2[2] = {bh, bh}, rows[2] = {i0, i1};
                u32 w[2];
                shared_rows(b2, rows, j, L, w);
                keep = ((w[0] >> (j & 3u)) & 3u) | (((w[1] >> (j & 3u)) & 3u) << 2);
            } else {
                keep = bits(bh, i0, j) & 3u;
                keep |= (bits(bh, i1, j) & 3u) << 2;
            }
        }
        return keep;
    }

    // dK/dV, keys as rows: bit r = (key j + 8 (r >> 1), query i + (r & 1)).
    template <bool SHARED = true>
    __device__ __forceinline__ u32 keep_cols(u32 bh, long long i, long long j) const {
        u32 keep = 0xFu;
        const Lane L = lane_ids();
        // Key rows j (this lane's: a block's first plus g & 3) and j + 8; on a block, the lanes
        // g & ~3 .. + 3 of this t each draw one of (column i or i + 1) x (key row j or j + 8)
        // and gather the other three.
        if (SHARED && on && !((j - (L.g & 3)) & 3)) {
            const int q = L.g & 3, group = (L.g & ~3) * 4 + L.t;  // lane of q = 0: 4 (g & ~3) + t
            const u32 drawn = dropout_keep4(s.seed, thr, bh, (u32)i + (q & 1),
                                            (u32)(j + 8 * (q >> 1)));
            u32 w[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) w[p] = __shfl_sync(0xffffffffu, drawn, group + 4 * p);
            const int sh = q;  // (j + 8 rr) & 3 for both key rows
            keep = 0u;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
                keep |= (((w[2 * rr] >> sh) & 1u) | (((w[2 * rr + 1] >> sh) & 1u) << 1)) << (2 * rr);
            return keep;
        }
        if (on) {
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const u32 jr = (u32)(j + 8 * rr);
                const u32 k0b = bits(bh, (u32)i, jr), k1b = bits(bh, (u32)i + 1, jr);
                keep &= ~(3u << (2 * rr));
                keep |= ((k0b & 1u) | ((k1b & 1u) << 1)) << (2 * rr);
            }
        }
        return keep;
    }

    // One element: kept?
    __device__ __forceinline__ bool kept(u32 bh, u32 i, u32 j) const {
        return !on || (bits(bh, i, j) & 1u);
    }
};
