// The packed parameter structs (the seed's uniforms, word for word: ferrocupy/params.py is the
// other half of this contract) and the options every attention kernel reads from them.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// A lane's place in an mma fragment: g = lane / 4 (accumulator row), t = lane % 4.
struct Lane { int g, t; };
__device__ __forceinline__ Lane lane_ids() { int l = threadIdx.x & 31; return Lane{l >> 2, l & 3}; }

struct RopeParams {
    u32 head_dim, seq_len, pos, heads;
    float theta;
    u32 rotary_dim;  // 0: all of head_dim (a seed call)
    u32 flags;       // the ROPE_* bits below (0 in a seed call)
    u32 pad0;
};
enum RopeFlags : u32 {
    ROPE_INTERLEAVED = 1,      // pairs (x[2i], x[2i+1]), not (x[i], x[i + rotary_dim/2])
    ROPE_INVERSE = 2,          // the negative angle
    ROPE_POSITIONS = 4,        // token (b, s) at positions[b * positions_b + s], not pos + s
    ROPE_POSITIONS_INT64 = 8,  // those positions are int64 (else int32)
};

// RoPE's second struct (params.py's ROPE_LAYOUT): element strides (batch, seq, head) of the input
// and the output viewed as [batch, seq_len, heads, head_dim], head_dim contiguous; the batch
// stride of the positions (0: one row shared by every batch entry).
struct RopeLayout { u64 x_b, x_s, x_h, out_b, out_s, out_h, positions_b, pad0; };

struct FlashV2Params {
    u32 batch, heads, seq_q, seq_k, head_dim, causal;
    float scale;
    u32 kv_heads;
    float dropout_prob;
    u32 seed, has_mask, causal_offset;
    u32 mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;
    u32 window, pad0, pad1, pad2;
};

struct FlashBwdParams {
    u32 batch, heads, seq_q, seq_k, head_dim, kv_heads;
    float scale, dropout_prob;
    u32 seed, causal, has_mask, causal_offset;
    u32 mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;
    u32 window, pad0, pad1, pad2;
};

// The second struct beside the seed's (params.py's ATTN_LAYOUT): element strides of every
// [batch, seq, heads, head_dim] tensor of a call, whose last dimension is contiguous (a
// transposed or sliced view is addressed as it is, never copied). Absent tensors: zeros.
struct Strides { u64 b, s, h; };
struct AttnLayout { Strides q, k, v, out, grad_out, grad_q, grad_k, grad_v; };

// Where one (batch, head)'s rows start in a tensor, and the elements from one row to the next.
struct Rows { u64 off, stride; };
__device__ __forceinline__ Rows rows_of(const Strides& t, u32 b, u32 h) {
    return Rows{(u64)b * t.b + (u64)h * t.h, t.s};
}

static_assert(sizeof(RopeParams) == 32, "RopeParams is 8 words");
static_assert(sizeof(RopeLayout) == 64, "RopeLayout is 8 u64 words");
static_assert(sizeof(AttnLayout) == 192, "AttnLayout is 24 u64 strides");
static_assert(sizeof(FlashV2Params) == 80, "FlashV2Params is 20 words");
static_assert(sizeof(FlashBwdParams) == 80, "FlashBwdParams is 20 words");

// The third struct (params.py's ATTN_EXTRAS): the options the seed's words have no room for.
// The window's sides (every kernel: attn_shape), softcap (0: none) and the flags' ALiBi and sinks
// bits are read here; page_size by the decode kernels (a paged cache: ferro_decode.cuh's
// DecodeBlock) and the append (append_kv.cu); new_keys by the append and by every forward's
// for_batch (the attention then sees kv_lens[b] + new_keys keys); rotary_dim by the append.
struct AttnExtras {
    int window_left, window_right;
    float softcap;
    u32 flags, page_size, new_keys, rotary_dim, pad0;
};
enum ExtrasFlags : u32 {
    EXTRAS_ALIBI = 1, EXTRAS_ALIBI_PER_BATCH = 2, EXTRAS_SINKS = 4, EXTRAS_VARLEN = 8,
    EXTRAS_PAGED = 16, EXTRAS_APPEND = 32, EXTRAS_ROTARY = 64, EXTRAS_ROTARY_INTERLEAVED = 128,
};
static_assert(sizeof(AttnExtras) == 32, "AttnExtras is 8 words");

// What a launch adds beside the struct (kernel arguments, not struct words, so the seed's structs
// stay as they are): the copy width every data row allows, and the mask's element type.
enum MaskKind : u32 { MASK_F32 = 0, MASK_F16 = 1, MASK_BF16 = 2 };

// The options every attention kernel reads, gathered from either struct (their orders differ).
struct AttnShape {
    u32 batch, heads, kv_heads, seq_q, seq_k, head_dim;
    u32 causal, has_mask, seed;
    // Position a = i + offset sees key j iff a - left <= j <= a + right: SPEC's window_left and
    // window_right, an unbounded side as UNBOUNDED_SIDE (no test then needs a special case),
    // causal folded in (right is 0 under it). set_windows writes them. Unsigned: both are >= 0,
    // and a zero-extended side costs the 64-bit position arithmetic no high word.
    u32 left, right;
    long long offset;
    u32 sb, sh, sq, sk;
    float scale, dropout_prob;
    u32 mask_kind;
    long long kv_len;    // keys that exist: seq_k, or this batch's kv_lens entry
    long long kv_reach;  // keys [kv_reach, seq_k) are visible to no row: never loaded (zero-filled)
    u32 new_keys;        // an append's keys per sequence, written before the attention (else 0)
    // The score modifiers and the sink (AttnExtras; with_extras): read only by a variant built
    // with them (Options::MODS), so a plain variant's registers never hold them.
    float softcap;       // > 0: scores become softcap * tanh(score / softcap)
    const float* alibi;  // ALiBi slopes (null: none), slope of (b, h) at b * alibi_b + h
    u32 alibi_b;
    const float* sinks;  // sink logits per head (null: none)
    // Where the batch entry lies in the call's tensors (SPEC varlen; with_varlen, for_sequence):
    // `cu_q`, `cu_k` the call's cu_seqlens (null: a dense call); the entry's first row of q (out,
    // grad_out, grad_q: q_rows) and first key of k (v, grad_k, grad_v: k_rows), 0 in a dense
    // call. A per-row array (lse, the backward's stats) holds row i of (b, h) at
    // b * row_b + h * row_h + q_start + i: [batch, heads, seq_q], or varlen [heads, total_q].
    const int* cu_q;
    const int* cu_k;
    long long q_start, k_start;
    u64 row_b, row_h;
    // The call's seq_q, which for_sequence leaves as it is (varlen: max_seqlen_q): what sizes a
    // workspace laid out per row of the grid's frame (the fused backward's dQ, decode's splits).
    u32 frame_q;
};

// Keys [kv_reach, ...) are visible to no row. The last row sits at a = seq_q - 1 + offset and
// sees no key past a + right (causal: a). Those keys may hold anything (a preallocated KV cache).
__device__ __forceinline__ long long key_reach(const AttnShape& s) {
    long long reach = s.kv_len;
    const long long a_last = (long long)s.seq_q - 1 + s.offset;
    if (a_last + s.right + 1 < reach) reach = a_last + s.right + 1;
    return reach < 0 ? 0 : reach;
}

// An unbounded side of the window: at least any row's distance from any key. Offsets are int32
// and sequences shorter than 2^30, so |a - j| < 2^32 even at int32's extremes (kv_lens shifting
// a further down by at most seq_k); the sums below are 64-bit, so it overflows none of them.
constexpr u32 UNBOUNDED_SIDE = 0xFFFFFFFFu;

// The window's sides (SPEC: window_left, window_right; -1 unbounded), causal folded into the
// right one.
__device__ __forceinline__ void set_windows(AttnShape& s, int left, int right) {
    s.left = left < 0 ? UNBOUNDED_SIDE : (u32)left;
    s.right = s.causal ? 0u : (right < 0 ? UNBOUNDED_SIDE : (u32)right);
    s.kv_reach = key_reach(s);
}

// Every kernel's shape: the seed struct's words, the window's sides from `ex` (which restates a
// seed call's symmetric window: params.py's seed_extras), so every kernel reads visibility one way.
template <class P>
__device__ __forceinline__ AttnShape attn_shape(const P& p, const AttnExtras& ex, u32 mask_kind) {
    AttnShape s;
    s.batch = p.batch; s.heads = p.heads; s.kv_heads = p.kv_heads;
    s.seq_q = p.seq_q; s.seq_k = p.seq_k; s.head_dim = p.head_dim;
    s.causal = p.causal; s.has_mask = p.has_mask; s.seed = p.seed;
    s.offset = (long long)(int)p.causal_offset;  // the word holds a signed 32-bit offset
    s.sb = p.mask_stride_b; s.sh = p.mask_stride_h; s.sq = p.mask_stride_q; s.sk = p.mask_stride_k;
    s.scale = p.scale; s.dropout_prob = p.dropout_prob;
    s.mask_kind = mask_kind;
    s.kv_len = s.seq_k;
    s.new_keys = (ex.flags & EXTRAS_APPEND) ? ex.new_keys : 0u;
    set_windows(s, ex.window_left, ex.window_right);
    s.softcap = 0.f;
    s.alibi = nullptr;
    s.alibi_b = 0;
    s.sinks = nullptr;
    s.cu_q = s.cu_k = nullptr;
    s.q_start = s.k_start = 0;
    s.row_h = s.seq_q;
    s.row_b = (u64)s.heads * s.seq_q;
    s.frame_q = s.seq_q;
    return s;
}

// The call's score modifiers and sinks (SPEC "Beyond the seed, part 2"): `alibi` float32 [heads]
// or [batch, heads] and `sinks` float32 [heads] as the flags say (each null when absent).
__device__ __forceinline__ void with_extras(AttnShape& s, const AttnExtras& ex, const float* alibi,
                                            const float* sinks) {
    s.softcap = ex.softcap;
    s.alibi = (ex.flags & EXTRAS_ALIBI) ? alibi : nullptr;
    s.alibi_b = (ex.flags & EXTRAS_ALIBI_PER_BATCH) ? s.heads : 0u;
    s.sinks = (ex.flags & EXTRAS_SINKS) ? sinks : nullptr;
}

// A varlen call's packed sequences (SPEC "Beyond the seed, part 2"; the flags' EXTRAS_VARLEN):
// `cu_q`, `cu_k` int32 [batch + 1], the seed struct's batch the number of sequences and its
// seq_q / seq_k the max_seqlen_q / max_seqlen_k, which size the grid (for_sequence then narrows
// each block to its sequence). Per-row arrays become [heads, total_q], total_q = cu_q[batch].
// A dense call (the flag clear) is left as attn_shape made it, whatever the pointers, and so is
// every call in a build without FERRO_VARLEN (configs.py's `varlen` variants): there cu_q stays
// null, for_sequence is compiled out and the sequence lengths stay the kernel parameters
// (registers across the key loops). The backend runs a varlen call on varlen builds only.
#ifndef FERRO_VARLEN
#define FERRO_VARLEN 0
#endif
__device__ __forceinline__ void with_varlen(AttnShape& s, const AttnExtras& ex, const int* cu_q,
                                            const int* cu_k) {
    if (!FERRO_VARLEN || !(ex.flags & EXTRAS_VARLEN)) return;
    s.cu_q = cu_q;
    s.cu_k = cu_k;
    s.row_b = 0;
    s.row_h = (u64)cu_q[s.batch];
}

// Sequence b's view in a varlen call (no change in a dense one): rows cu_q[b] ..< cu_q[b+1]
// of q and keys cu_k[b] ..< cu_k[b+1] of k, every rule applied with its own Sq_b, Sk_b, and
// right-aligned in the [max_seqlen_q, max_seqlen_k] frame as the reference's _Frame is: row i
// sits at i + causal_offset + (Sk_b - max_seqlen_k) - (Sq_b - max_seqlen_q). Called once per
// block (per work item) with s as attn_shape made it; rows and keys are then counted inside the
// sequence (dropout's counter, ALiBi, visibility), tiles past Sq_b / Sk_b hold nothing.
__device__ __forceinline__ void for_sequence(AttnShape& s, u32 b) {
    if (!s.cu_q) return;
    s.q_start = s.cu_q[b];
    s.k_start = s.cu_k[b];
    const long long sq = (long long)s.cu_q[b + 1] - s.q_start;
    const long long sk = (long long)s.cu_k[b + 1] - s.k_start;
    s.offset += (sk - (long long)s.seq_k) - (sq - (long long)s.seq_q);
    s.seq_q = (u32)sq;
    s.seq_k = (u32)sk;
    s.kv_len = sk;
    s.kv_reach = key_reach(s);
}

// (b, h)'s rows of a q-shaped tensor and (b, hk)'s of a k-shaped one, from the batch entry's
// first row (for_sequence).
__device__ __forceinline__ Rows q_rows(const AttnShape& s, const Strides& t, u32 b, u32 h) {
    Rows r = rows_of(t, b, h);
    r.off += (u64)s.q_start * t.s;
    return r;
}
__device__ __forceinline__ Rows k_rows(const AttnShape& s, const Strides& t, u32 b, u32 hk) {
    Rows r = rows_of(t, b, hk);
    r.off += (u64)s.k_start * t.s;
    return r;
}

// Index of (b, h)'s row 0 in a per-row array (lse; the backward's stats, two floats a row).
__device__ __forceinline__ u64 row_index(const AttnShape& s, u32 b, u32 h) {
    return (u64)b * s.row_b + (u64)h * s.row_h + (u64)s.q_start;
}

// Batch b's view when the call has kv_lens (SPEC "Beyond the seed"): its keys j >= kv_lens[b]
// + new_keys (an append's, written before the attention) do not exist, and its rows sit
// kv_lens[b] + new_keys - seq_k positions later. Storage (seq_k) is unchanged.
__device__ __forceinline__ void for_batch(AttnShape& s, const int* kv_lens, u32 b) {
    if (!kv_lens) return;
    s.kv_len = (long long)kv_lens[b] + s.new_keys;
    s.offset += s.kv_len - (long long)s.seq_k;
    s.kv_reach = key_reach(s);
}
