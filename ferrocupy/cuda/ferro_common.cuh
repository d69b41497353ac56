// What every ferrocupy kernel shares, written once: the packed parameter structs (the seed's
// uniforms, word for word), the visibility rule, the mask gather, the Philox dropout generator,
// and the float32-exact tensor-core product (3xTF32) with its fragment helpers.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- packed parameter structs: field order = ferrocupy/params.py = the seed ----------------------
struct RopeParams {
    u32 head_dim, seq_len, pos, heads;
    float theta;
    u32 pad0, pad1, pad2;
};

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

static_assert(sizeof(RopeParams) == 32, "RopeParams is 8 words");
static_assert(sizeof(FlashV2Params) == 80, "FlashV2Params is 20 words");
static_assert(sizeof(FlashBwdParams) == 80, "FlashBwdParams is 20 words");

// The options every attention kernel reads, gathered from either struct (their orders differ).
struct AttnShape {
    u32 batch, heads, kv_heads, seq_q, seq_k, head_dim;
    u32 causal, window, has_mask, seed;
    long long offset;
    u32 sb, sh, sq, sk;
    float scale, dropout_prob;
};

template <class P>
__device__ __forceinline__ AttnShape attn_shape(const P& p) {
    AttnShape s;
    s.batch = p.batch; s.heads = p.heads; s.kv_heads = p.kv_heads;
    s.seq_q = p.seq_q; s.seq_k = p.seq_k; s.head_dim = p.head_dim;
    s.causal = p.causal; s.window = p.window; s.has_mask = p.has_mask; s.seed = p.seed;
    s.offset = (long long)p.causal_offset;
    s.sb = p.mask_stride_b; s.sh = p.mask_stride_h; s.sq = p.mask_stride_q; s.sk = p.mask_stride_k;
    s.scale = p.scale; s.dropout_prob = p.dropout_prob;
    return s;
}


// ---- block order: a 1-D grid of (row of heads) x tiles. Blocks go in groups of up to 16 heads,
// tile-major inside a group, so the heaviest causal tiles of every head in a group start first
// (no long block left for the tail) while a group's K/V (16 heads) still shares the L2. ---------
__device__ __forceinline__ void block_coords(u32 x, u32 tiles, u32 n_heads, u32& head,
                                             u32& rank) {
    const u32 G = n_heads < 16u ? n_heads : 16u;
    const u32 grp = x / (G * tiles), r = x % (G * tiles);
    const u32 in_grp = min(G, n_heads - grp * G);
    rank = r / in_grp;  // 0 = first dispatched
    head = grp * G + r % in_grp;
}

// ---- visibility: row i sits at a = i + causal_offset; key j is visible iff
//      (!causal || j <= a) && (window == 0 || |a - j| < window) ---------------------------------
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
    hi = s.seq_k;
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

__device__ __forceinline__ float mask_at(const AttnShape& s, const float* mask, u32 b, u32 h,
                                         long long i, long long j) {
    return mask[(u64)b * s.sb + (u64)h * s.sh + (u64)i * s.sq + (u64)j * s.sk];
}

// ---- dropout: Philox4x32-10 (Random123 / cuRAND), counter (j>>2, i, b*H+h, 0), key (seed, 0) ------
struct U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 philox4x32_10(U4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// Threshold: dropped iff word < uint32(double(p) * 2^32) (truncated).
__device__ __forceinline__ u32 dropout_threshold(float p) {
    return (u32)((double)p * 4294967296.0);
}

// keep bits for keys j0 = 4*(j>>2) .. j0+3 of row i (bit n = key j0+n kept).
__device__ __forceinline__ u32 dropout_keep4(u32 seed, u32 thr, u32 bh, u32 i, u32 j) {
    U4 r = philox4x32_10(U4{j >> 2, i, bh, 0u}, seed, 0u);
    return (r.x >= thr) | ((r.y >= thr) << 1) | ((r.z >= thr) << 2) | ((r.w >= thr) << 3);
}

// ---- float32-exact products on tensor cores: x = big + small, both TF32; a*b ~ ab + as + sb ----
__device__ __forceinline__ u32 tf32_big(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

struct Split { u32 big, small; };

__device__ __forceinline__ Split split_tf32(float x) {
    Split s;
    s.big = tf32_big(x);
    s.small = __float_as_uint(x - __uint_as_float(s.big));  // hardware truncates it to TF32
    return s;
}

// D += A(16x8) B(8x8), TF32 in, FP32 accumulate. Fragments (g = lane/4, t = lane%4):
// a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4); b0 (k=t, n=g) b1 (k=t+4, n=g);
// c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 3xTF32: float32-level accuracy (error ~2^-22 per product) at tensor-core speed.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const u32 (&ab)[4], const u32 (&as)[4],
                                           Split b0, Split b1) {
    mma_tf32(d, as, b0.big, b1.big);
    mma_tf32(d, ab, b0.small, b1.small);
    mma_tf32(d, ab, b0.big, b1.big);
}

__device__ __forceinline__ void split_frag(const float (&x)[4], u32 (&big)[4], u32 (&small)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        Split s = split_tf32(x[r]);
        big[r] = s.big;
        small[r] = s.small;
    }
}

// ---- asynchronous global->shared copies (zero-filled past the end) -------------------------------
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool valid) {
    u32 dst = (u32)__cvta_generic_to_shared(smem);
    int src_bytes = valid ? BYTES : 0;
    if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem),
                     "r"(src_bytes));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(gmem),
                     "n"(BYTES), "r"(src_bytes));
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Copy rows [row0, row0+ROWS) x [0, DP) of a [rows, row_stride]-strided float matrix (valid
// part: rows < n_rows, cols < D) into shared memory with row pitch PITCH, zero-filling the rest.
// VEC floats per copy (4: 16-byte copies, needs D % 4 == 0 and 16-byte aligned rows; else 1).
template <int ROWS, int DP, int PITCH, int VEC, int THREADS>
__device__ __forceinline__ void load_tile(float* smem, const float* base, u64 row_stride,
                                          long long row0, long long n_rows, int D) {
    constexpr int PER_ROW = DP / VEC;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < ROWS * PER_ROW; idx += THREADS) {
        int r = idx / PER_ROW, c = (idx % PER_ROW) * VEC;
        long long row = row0 + r;
        bool ok = row < n_rows && c < D;
        const float* src = ok ? base + (u64)row * row_stride + c : base;
        cp_async<VEC * 4>(smem + r * PITCH + c, src, ok);
    }
}


// ---- fragment access in shared memory (row pitch PITCH floats, PITCH % 32 in {4, 12, 20, 28}:
//      conflict-free for the patterns below). g = lane/4, t = lane%4. ---------------------------
struct Lane { int g, t; };
__device__ __forceinline__ Lane lane_ids() { int l = threadIdx.x & 31; return Lane{l >> 2, l & 3}; }

// A operand (16 rows x 8 cols) at x[0][0], row-major.
template <int PITCH>
__device__ __forceinline__ void frag_a(const float* x, Lane L, float (&a)[4]) {
    a[0] = x[L.g * PITCH + L.t];
    a[1] = x[(L.g + 8) * PITCH + L.t];
    a[2] = x[L.g * PITCH + L.t + 4];
    a[3] = x[(L.g + 8) * PITCH + L.t + 4];
}

// B operand (k 8 x n 8) stored n-major (x[n][k]), as K is for S = Q K^T.
template <int PITCH>
__device__ __forceinline__ void frag_b_nk(const float* x, Lane L, Split& b0, Split& b1) {
    b0 = split_tf32(x[L.g * PITCH + L.t]);
    b1 = split_tf32(x[L.g * PITCH + L.t + 4]);
}

// B operand stored k-major (x[k][n]) with the k order permuted (mma k = t <-> row 2t, k = t+4 <->
// row 2t+1), which lets an accumulator fragment be reused as the A operand without shuffles.
template <int PITCH>
__device__ __forceinline__ void frag_b_kn_perm(const float* x, Lane L, Split& b0, Split& b1) {
    b0 = split_tf32(x[(2 * L.t) * PITCH + L.g]);
    b1 = split_tf32(x[(2 * L.t + 1) * PITCH + L.g]);
}

// An accumulator fragment c (16 x 8) as the A operand of the next product, k order permuted.
__device__ __forceinline__ void acc_as_a(const float (&c)[4], u32 (&big)[4], u32 (&small)[4]) {
    const float a[4] = {c[0], c[2], c[1], c[3]};
    split_frag(a, big, small);
}


// acc (16 x 8*NT) = A B^T: A is 16 rows x 8*KS at sA, B is 8*NT rows x 8*KS at sB, both
// row-major in shared memory (S = Q K^T, dP = dO V^T, and their transposes in the dK/dV kernel).
template <int NT, int KS, int PITCH>
__device__ __forceinline__ void gemm_abt(const float* sA, const float* sB, Lane L,
                                         float (&acc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        float a[4];
        u32 ab[4], as[4];
        frag_a<PITCH>(sA + ks * 8, L, a);
        split_frag(a, ab, as);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            Split b0, b1;
            frag_b_nk<PITCH>(sB + nt * 8 * PITCH + ks * 8, L, b0, b1);
            mma_3xtf32(acc[nt], ab, as, b0, b1);
        }
    }
}

// acc (16 x 8*KS) += A B: A (16 x 8*NT) in accumulator layout (e.g. P), B (8*NT x 8*KS) row-major
// in shared memory. Each 8-column chunk is summed over the tile in a fresh accumulator and then
// added to acc in ordinary float32: the tensor cores accumulate with truncation, and over
// thousands of accumulations into one register that bias reached 1.6e-5 relative error
// (S = 2048); per tile it stays near 1e-7.
template <int NT, int KS, int PITCH>
__device__ __forceinline__ void gemm_acc_ab(const float (&a)[NT][4], const float* sB, Lane L,
                                            float (&acc)[KS][4]) {
    u32 ab[NT][4], as[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc_as_a(a[nt], ab[nt], as[nt]);
#pragma unroll
    for (int nd = 0; nd < KS; ++nd) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            Split b0, b1;
            frag_b_kn_perm<PITCH>(sB + nt * 8 * PITCH + nd * 8, L, b0, b1);
            mma_3xtf32(t, ab[nt], as[nt], b0, b1);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nd][r] += t[r];
    }
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

#define FERRO_LOG2E 1.4426950408889634f
#define FERRO_LN2 0.6931471805599453f

// ---- one block's query tile (forward and dQ kernels) ---------------------------------------------
struct QueryTile {
    u32 bh, b, h, hk;
    long long m0, m_last;     // first row, last valid row
    long long rows[2];        // this thread's rows: g and g + 8 of its warp's 16
    u64 q_stride, kv_stride;  // floats between consecutive rows of q/out and of k/v
    u64 q_off, kv_off;        // where (b, h, row 0) starts in q/out, (b, hk, row 0) in k/v
};

// A 1-D grid over (batch*heads) x query tiles of BM rows in block_coords order, the last tiles
// (under causal masking, those that see the most keys) first.
template <int BM>
__device__ __forceinline__ QueryTile query_tile(const AttnShape& s, Lane L) {
    QueryTile t;
    const u32 q_tiles = (s.seq_q + BM - 1) / BM;
    u32 rank;
    block_coords(blockIdx.x, q_tiles, s.batch * s.heads, t.bh, rank);
    t.b = t.bh / s.heads;
    t.h = t.bh % s.heads;
    t.hk = t.h / (s.heads / s.kv_heads);
    t.m0 = (long long)(q_tiles - 1 - rank) * BM;
    t.m_last = min((long long)s.seq_q, t.m0 + BM) - 1;
    t.rows[0] = t.m0 + (threadIdx.x >> 5) * 16 + L.g;
    t.rows[1] = t.rows[0] + 8;
    t.q_stride = (u64)s.heads * s.head_dim;
    t.kv_stride = (u64)s.kv_heads * s.head_dim;
    t.q_off = ((u64)t.b * s.seq_q * s.heads + t.h) * s.head_dim;
    t.kv_off = ((u64)t.b * s.seq_k * s.kv_heads + t.hk) * s.head_dim;
    return t;
}

// The tiles of BN keys, from j_first on, that can hold a key visible to the tile's rows.
template <int BN>
__device__ __forceinline__ int key_tiles(const AttnShape& s, const QueryTile& t,
                                         long long& j_first) {
    long long lo, hi;
    visible_key_range(s, t.m0 + s.offset, t.m_last + s.offset, lo, hi);
    j_first = lo / BN * BN;
    return hi > j_first ? (int)((hi - j_first + BN - 1) / BN) : 0;
}

// True when every key of [j0, j0 + BN) is visible to every row of the tile (and exists), so the
// per-element visibility test can be skipped.
template <int BN>
__device__ __forceinline__ bool keys_wholly_visible(const AttnShape& s, const QueryTile& t,
                                                    long long j0) {
    const long long a_lo = t.m0 + s.offset, a_hi = t.m_last + s.offset;
    return j0 + BN <= s.seq_k && (!s.causal || j0 + BN - 1 <= a_lo) &&
           (!s.window || (a_hi - j0 < s.window && j0 + BN - 1 - a_lo < s.window));
}

// Scores of a tile: scale, additive mask, -inf where a key is not visible (or a row or key is
// past the end). `whole`: every key is known visible (keys_wholly_visible).
template <int NT>
__device__ __forceinline__ void score_tile(const AttnShape& s, const float* mask,
                                           const QueryTile& t, long long j0, bool whole, Lane L,
                                           float (&sc)[NT][4]) {
    if (whole && !s.has_mask) {  // the common case: nothing to test per element
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) sc[nt][r] *= s.scale;
        return;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const long long i = t.rows[r >> 1], j = j0 + nt * 8 + 2 * L.t + (r & 1);
            const bool ok = i < s.seq_q && j < s.seq_k && (whole || visible(s, i + s.offset, j));
            float x = sc[nt][r] * s.scale;
            if (s.has_mask && ok) x += mask_at(s, mask, t.b, t.h, i, j);
            sc[nt][r] = ok ? x : neg_inf();
        }
}

// Online softmax over one row of a score tile (rr = 0: c0, c1; rr = 1: c2, c3): updates the running
// max and sum, overwrites the scores with exp(s - max), returns the factor for the running output.
// A row whose scores are all -inf so far keeps max -inf and contributes zeros.
template <int NT>
__device__ __forceinline__ float online_softmax(float (&sc)[NT][4], int rr, float& m_run,
                                                float& l_run) {
    float mx = neg_inf();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][2 * rr], sc[nt][2 * rr + 1]));
    mx = quad_max(mx);
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;
    const float alpha = exp2f((m_run - m_use) * FERRO_LOG2E);
    m_run = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float e = exp2f(sc[nt][2 * rr + c] * FERRO_LOG2E - m_use * FERRO_LOG2E);
            sum += e;
            sc[nt][2 * rr + c] = e;
        }
    l_run = l_run * alpha + sum;
    return alpha;
}

