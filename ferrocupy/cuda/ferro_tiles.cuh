// Which tile of which (batch, head) a block computes and the key tiles it visits (ferro_score.cuh
// turns a tile's products into scores). Shared by every precision.
#pragma once
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"

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

// Block x's (batch, head) pair bh = b * heads + h (heads: the call's, or its KV heads) and tile
// rank, in the order above; where the call's mask is shared by its batch entries (stride 0 over
// batch: a bias [1, H, S, S]), with batch entries fastest, so the blocks that read one head's
// mask rows run side by side and share them in L2 instead of each entry's fetching them from
// memory again. (A permutation of the pairs alone: each pair's tiles keep their turn.)
__device__ __forceinline__ void block_coords(u32 x, u32 tiles, const AttnShape& s, u32 heads,
                                             u32& bh, u32& rank) {
    block_coords(x, tiles, s.batch * heads, bh, rank);
    if (s.has_mask && s.sb == 0u && s.batch > 1u) bh = (bh % s.batch) * heads + bh / s.batch;
}

// ---- one block's query tile (forward and dQ kernels) ---------------------------------------------
struct QueryTile {
    u32 bh, b, h, hk;
    long long m0, m_last;     // first row, last valid row (m_last < max(m0, 0): no row)
    long long row0;           // this thread's first row: its warp's first row + g
    Rows q, o, k, v;          // (b, h)'s rows of q and out, (b, hk)'s of k and v

    // No row of the tile exists (a varlen sequence shorter than the grid's rows; a dense call's
    // tiles all hold rows, so a build without FERRO_VARLEN folds the test away).
    __device__ __forceinline__ bool empty() const { return FERRO_VARLEN && m_last < max(m0, 0ll); }

    // Row of accumulator element (m-tile mt, half rr: c0/c1 or c2/c3).
    __device__ __forceinline__ long long row(int mt, int rr) const {
        return row0 + 16 * mt + 8 * rr;
    }
};

// A 1-D grid over (batch*heads) x query tiles of BM rows in block_coords order, the last tiles
// (under causal masking, those that see the most keys) first. Each warp owns 16*MT rows.
// Work item x of that order (a persistent kernel's block takes several). `from_end`: tiles end at
// seq_q, seq_q - BM, ..., so a short tile (m0 < 0: rows before 0 do not exist) holds the first
// rows, not the last; under causal masking those see the fewest keys, so the short tile is also
// the cheapest instead of a long one with most of its block idle.
// `s` becomes the tile's batch entry's (for_sequence): the grid covers the call's seq_q
// (max_seqlen_q in a varlen call), and a tile past its sequence's rows holds none (empty()).
template <int BM, int MT>
__device__ __forceinline__ QueryTile query_tile_at(u32 x, AttnShape& s, const AttnLayout& lay,
                                                   Lane L, bool from_end = false) {
    QueryTile t;
    const u32 q_tiles = (s.seq_q + BM - 1) / BM;
    u32 rank;
    block_coords(x, q_tiles, s, s.heads, t.bh, rank);
    t.b = t.bh / s.heads;
    t.h = t.bh % s.heads;
    t.hk = t.h / (s.heads / s.kv_heads);
    for_sequence(s, t.b);
    t.m0 = from_end ? (long long)s.seq_q - (long long)(rank + 1) * BM
                    : (long long)(q_tiles - 1 - rank) * BM;
    t.m_last = min((long long)s.seq_q, t.m0 + BM) - 1;
    t.row0 = t.m0 + (threadIdx.x >> 5) * 16 * MT + L.g;
    t.q = q_rows(s, lay.q, t.b, t.h);
    t.o = q_rows(s, lay.out, t.b, t.h);
    t.k = k_rows(s, lay.k, t.b, t.hk);
    t.v = k_rows(s, lay.v, t.b, t.hk);
    return t;
}
template <int BM, int MT>
__device__ __forceinline__ QueryTile query_tile(AttnShape& s, const AttnLayout& lay, Lane L) {
    return query_tile_at<BM, MT>(blockIdx.x, s, lay, L);
}

// The tiles of BN keys, from j_first on, that can hold a key visible to the tile's rows.
template <int BN>
__device__ __forceinline__ int key_tiles(const AttnShape& s, const QueryTile& t,
                                         long long& j_first) {
    long long lo, hi;
    visible_key_range(s, max(t.m0, 0ll) + s.offset, t.m_last + s.offset, lo, hi);
    j_first = lo / BN * BN;
    return hi > j_first && !t.empty() ? (int)((hi - j_first + BN - 1) / BN) : 0;
}

// Of a block's n_tiles key tiles (BN keys each from j_first), the ones [t_lo, t_hi) that rows
// [r0, r_last] can see (none when r0 > r_last): a warp-specialized kernel's warpgroup visits only
// these, as under a causal or window mask its rows see a different range than the block's.
template <int BN>
__device__ __forceinline__ void rows_key_tiles(const AttnShape& s, long long r0, long long r_last,
                                               long long j_first, int n_tiles, int& t_lo,
                                               int& t_hi) {
    t_lo = t_hi = 0;
    if (r0 > r_last) return;
    long long lo, hi;
    visible_key_range(s, r0 + s.offset, r_last + s.offset, lo, hi);
    if (hi > lo) {
        t_lo = (int)((lo - j_first) / BN);
        t_hi = min(n_tiles, (int)((hi - j_first + BN - 1) / BN));
    }
}

// True when every key of [j0, j0 + BN) is visible to every row of the tile (and exists), so the
// per-element visibility test can be skipped.
template <int BN>
__device__ __forceinline__ bool keys_wholly_visible(const AttnShape& s, const QueryTile& t,
                                                    long long j0) {
    return keys_visible_to_rows(s, t.m0, t.m_last, j0, j0 + BN - 1);  // (m_last < seq_q)
}
