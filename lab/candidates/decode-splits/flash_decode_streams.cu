// Decoding from a KV cache, bound by memory: few query rows (a KV group's heads x seq_q, at most
// ROWS) against many keys, each key read once per group.
//
// A block takes one (batch, KV head) and one split of its keys. Inside it nothing waits for
// anything but its own copies: every warp streams its own tiles (tiles warp, warp + WARPS, ...)
// through its own ring of STAGES shared-memory buffers, and inside a warp each group of TX lanes
// takes one key at a time, a lane holding DL of the head's dims (16-byte chunks x, x + TX, ...:
// a group's 16-byte reads are contiguous in global and in shared memory). A lane copies its chunks
// with cp.async and later reads back only those same bytes, so `cp.async.wait_group` is the only
// synchronisation the key loop needs; with STAGES - 1 tiles in flight per warp the copies run
// back to back. Each lane group keeps its own online softmax (max, sum, O over its dims) for
// every row; the groups of a warp merge by shuffles, the warps through shared memory at the end.
//
// With one split the block writes out (rounded once) and lse itself; with more, its unnormalised
// O and (max, sum) go to the workspace and the pair's last block to finish merges them
// (decode_finish's tickets). Every forward option
// holds: causal + offset, window, mask, dropout (the same keep mask), kv_lens, a paged cache
// (TileKeys), dead rows -> 0.
// Rows of K and V must take 16-byte copies (head_dim * element size a multiple of 16, aligned);
// other calls take flash_decode.cu. Geometry (ROWS, TX, the tile, STAGES) from configs.py.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_score.cuh"
#include "ferro_decode.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, THREADS = 32 * WARPS;
constexpr int ROWS = FERRO_ROWS;                // query rows per block, at most
constexpr int STAGES = FERRO_STAGES;            // buffers per warp: STAGES - 1 tiles in flight
constexpr int TX = FERRO_KEY_LANES;             // lanes per key
constexpr int VEC = 16 / sizeof(T);             // elements per 16-byte chunk
constexpr int ROW_CHUNKS = DP / VEC;            // chunks per key row
constexpr int CH = (ROW_CHUNKS + TX - 1) / TX;  // chunks per lane
constexpr int DL = CH * VEC;                    // dims per lane
constexpr int KW = 32 / TX;                     // keys a warp reads at once: one per lane group
constexpr int TK = FERRO_BN / WARPS;            // keys per warp tile
constexpr int C = TK / KW;                      // keys per lane group per tile
constexpr int ROW_BYTES = DP * (int)sizeof(T);
constexpr int TILE_BYTES = 2 * TK * ROW_BYTES;  // K rows, then V rows
constexpr int MERGE_BYTES = 4 * WARPS * ROWS * (DP + 2);  // each warp's O and (max, sum)
static_assert(TX >= 1 && TX <= 32 && (TX & (TX - 1)) == 0, "lane groups of a power of two");
static_assert(DP % 16 == 0 && C >= 1 && C * KW * WARPS == FERRO_BN, "decode tile geometry");
static_assert((WARPS * STAGES * TILE_BYTES > MERGE_BYTES ? WARPS * STAGES * TILE_BYTES
                                                          : MERGE_BYTES) == FERRO_SMEM_BYTES,
              "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
flash_decode_streams(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     float* __restrict__ part_o, float* __restrict__ part_ml,
                     u32* __restrict__ tickets, T* __restrict__ out, float* __restrict__ lse,
                     const void* __restrict__ mask, const int* __restrict__ kv_lens,
                     const int* __restrict__ block_table, const float* __restrict__ alibi,
                     const float* __restrict__ sinks, const int* __restrict__ cu_q,
                     const int* __restrict__ cu_k, const u32 splits, const u32 split_keys,
                     const u32 vec, const u32 mask_kind,
                     const AttnLayout lay, const FlashV2Params p, const AttnExtras ex) {
    extern __shared__ __align__(16) unsigned char smem_d[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane / TX, x = lane % TX;  // lane group (its key), lane within the group
    unsigned char* ring = smem_d + warp * STAGES * TILE_BYTES;

    AttnShape s = attn_shape(p, ex, mask_kind);
    if (BuildOptions::MODS) with_extras(s, ex, alibi, sinks);
    with_varlen(s, ex, cu_q, cu_k);
    // (split_keys, planned on the capacity, is unused: each block divides its entry's own keys)
    (void)split_keys;
    const DecodeBlock blk = decode_block(s, kv_lens, block_table, ex, lay, splits, FERRO_BN);
    if (FERRO_VARLEN && blk.R == 0) return;  // a sequence with no query row (the block leaves)
    const u32 split = blockIdx.x % splits, b = blk.b, hk = blk.hk, G = blk.G;
    const int R = blk.R, D = s.head_dim;
    const T* kb = k + blk.rk.off;
    const T* vb = v + blk.rv.off;
    // This split's keys; the warp's share of its tiles.
    const long long j_lo = blk.j_lo, j_hi = blk.j_hi;
    const int n_tiles = j_hi > j_lo ? (int)((j_hi - j_lo + TK - 1) / TK) : 0;
    const int n_mine = n_tiles > warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;

    // Tile u of this warp: keys jt + c * KW + g for c < C. A lane copies chunks x + TX * cc of
    // its group's keys; past j_hi (the split's end, or the reach) and past D, zero-filled.
    auto load = [&](int u) {
        if (u < n_mine) {
            const long long jt = j_lo + (long long)(warp + WARPS * u) * TK;
            unsigned char* buf = ring + (u % STAGES) * TILE_BYTES;
            const TileKeys tk(blk, jt, TK);
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const long long j = jt + c * KW + g;
                const bool key_ok = j < j_hi;
                u64 ko = 0, vo = 0;
                if (key_ok) tk.at(blk, j, ko, vo);
#pragma unroll
                for (int cc = 0; cc < CH; ++cc) {
                    const int ch = x + TX * cc;
                    if (ch < ROW_CHUNKS) {
                        const int off = ((c * KW + g) * ROW_CHUNKS + ch) * 16;
                        const bool ok = key_ok && ch * VEC < D;
                        const u64 d0 = ok ? ch * VEC : 0;
                        cp_async<16>(buf + off, kb + (ok ? ko + d0 : 0), ok);
                        cp_async<16>(buf + TK * ROW_BYTES + off, vb + (ok ? vo + d0 : 0), ok);
                    }
                }
            }
        }
        cp_async_commit();  // one group per tile, maybe empty: the wait below counts tiles
    };

    const Dropout<true> drop(s);
    float m[ROWS], l[ROWS], o[ROWS][DL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = neg_inf(), l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < DL; ++e) o[r][e] = 0.f;
    }

    // The first tiles' copies go out before anything waits on memory (Q's loads below).
#pragma unroll
    for (int u = 0; u < STAGES - 1; ++u) load(u);

    // Row r sees the keys j_lo + [see_lo[r], see_lo[r] + see_n[r]) of this split (none past R):
    // one unsigned compare per (row, key) in the loop.
    u32 see_lo[ROWS], see_n[ROWS];
    float qf[ROWS][DL];  // this lane's dims of each row of Q, scaled; 0 past D and past R
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const u32 qi = r < R ? r % s.seq_q : 0, head = hk * G + (r < R ? r / s.seq_q : 0);
        long long r_lo, r_hi;
        visible_key_range(s, (long long)qi + s.offset, (long long)qi + s.offset, r_lo, r_hi);
        r_lo = max(r_lo, j_lo), r_hi = min(r_hi, j_hi);
        see_lo[r] = (u32)(r_lo - j_lo);
        see_n[r] = r < R && r_hi > r_lo ? (u32)(r_hi - r_lo) : 0u;
        const T* qr = q + blk.q_at(lay.q, head, qi);
#pragma unroll
        for (int cc = 0; cc < CH; ++cc) {
            const int ch = x + TX * cc;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const int d = ch * VEC + e;
                qf[r][cc * VEC + e] = (r < R && ch < ROW_CHUNKS && d < D) ? E::to_f(qr[d]) * s.scale : 0.f;
            }
        }
    }

    for (int u = 0; u < n_mine; ++u) {
        // The buffer refilled here was read (by this lane alone) in iteration u - 1.
        __syncwarp();
        load(u + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // this lane's copies of tile u have landed
        const unsigned char* buf = ring + (u % STAGES) * TILE_BYTES;
        const long long jt = j_lo + (long long)(warp + WARPS * u) * TK;

        float sc[C][ROWS];  // scores, then P
#pragma unroll
        for (int c = 0; c < C; ++c) {
            float kf[DL];
#pragma unroll
            for (int cc = 0; cc < CH; ++cc) {
                const int ch = x + TX * cc;
                float f[VEC];
                if (ch < ROW_CHUNKS) {
                    E::load16(reinterpret_cast<const T*>(buf + ((c * KW + g) * ROW_CHUNKS + ch) * 16), f);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) f[e] = 0.f;
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) kf[cc * VEC + e] = f[e];
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float a0 = 0.f, a1 = 0.f;  // two chains: the FMAs overlap
#pragma unroll
                for (int e = 0; e < DL; e += 2) {
                    a0 = fmaf(qf[r][e], kf[e], a0);
                    a1 = fmaf(qf[r][e + 1], kf[e + 1], a1);
                }
                sc[c][r] = a0 + a1;
            }
        }
        // The group's lanes hold parts of each dot product: sum them (xor within the group).
#pragma unroll
        for (int w = TX / 2; w; w >>= 1)
#pragma unroll
            for (int c = 0; c < C; ++c)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) sc[c][r] += __shfl_xor_sync(0xffffffffu, sc[c][r], w);

        // Which (row, key) pairs count, softcap, ALiBi and the mask; then the online softmax per
        // row.
        const u32 rel = (u32)(jt - j_lo) + g;  // key c is rel + c * KW
        if (per_element<BuildOptions>(s)) {
#pragma unroll
            for (int c = 0; c < C; ++c)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const u32 h = hk * G + r / s.seq_q;
                    // (rows past R have no head: hidden scores, no slope read)
                    const float slope = r < R ? alibi_slope(s, b, h) : 0.f;
                    sc[c][r] = modified_score<true, BuildOptions::MODS>(
                        s, mask, b, h, r % s.seq_q, jt + c * KW + g,
                        rel + c * KW - see_lo[r] < see_n[r], slope, sc[c][r]);
                }
        }
        // Dropout's keep bits (bit c * ROWS + r), in a loop kept rolled: Philox unrolled C x ROWS
        // times would cost registers the key loop needs.
        u32 keep = ~0u;
        if (drop.on) {
            keep = 0;
#pragma unroll 1
            for (int idx = 0; idx < C * ROWS; ++idx) {
                const int c = idx / ROWS, r = idx % ROWS;
                const u32 j = (u32)(jt + c * KW + g);
                keep |= (drop.bits(b * s.heads + hk * G + r / s.seq_q, r % s.seq_q, j) & 1u) << idx;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float mx = m[r];
#pragma unroll
            for (int c = 0; c < C; ++c) {
                if (!(rel + c * KW - see_lo[r] < see_n[r])) sc[c][r] = neg_inf();
                mx = fmaxf(mx, sc[c][r]);
            }
            const float m_use = mx == neg_inf() ? 0.f : mx;
            const float alpha = exp2f((m[r] - m_use) * FERRO_LOG2E);
            m[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                float pe = exp2f((sc[c][r] - m_use) * FERRO_LOG2E);
                sum += pe;  // the normaliser counts dropped keys (SPEC: dropout after softmax)
                sc[c][r] = (keep >> (c * ROWS + r)) & 1u ? pe : 0.f;
            }
            l[r] = l[r] * alpha + sum;
            if (__any_sync(0xffffffffu, alpha != 1.f)) {  // once the max settles, alpha is 1
#pragma unroll
                for (int e = 0; e < DL; ++e) o[r][e] *= alpha;
            }
        }
        // O += P V over the group's keys.
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
            for (int cc = 0; cc < CH; ++cc) {
                const int ch = x + TX * cc;
                if (ch >= ROW_CHUNKS) continue;
                float f[VEC];
                E::load16(reinterpret_cast<const T*>(buf + TK * ROW_BYTES +
                                                  ((c * KW + g) * ROW_CHUNKS + ch) * 16), f);
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        o[r][cc * VEC + e] = fmaf(sc[c][r], f[e], o[r][cc * VEC + e]);
            }
        }
    }
    cp_async_wait<0>();

    // Merge the lane groups of the warp (each streamed its own keys): (max, sum, O) pairwise.
#pragma unroll
    for (int w = TX; w < 32; w <<= 1) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float m_o = __shfl_xor_sync(0xffffffffu, m[r], w);
            const float l_o = __shfl_xor_sync(0xffffffffu, l[r], w);
            const float mx = fmaxf(m[r], m_o);
            const float m_use = mx == neg_inf() ? 0.f : mx;
            const float a = exp2f((m[r] - m_use) * FERRO_LOG2E);
            const float a_o = exp2f((m_o - m_use) * FERRO_LOG2E);
            l[r] = l[r] * a + l_o * a_o;
#pragma unroll
            for (int e = 0; e < DL; ++e)
                o[r][e] = o[r][e] * a + __shfl_xor_sync(0xffffffffu, o[r][e], w) * a_o;
            m[r] = mx;
        }
    }
    // Then the warps, through shared memory (the rings are done with: every warp's copies landed).
    __syncthreads();
    float* sO = reinterpret_cast<float*>(smem_d);  // [WARPS][ROWS][DP]
    float* sML = sO + WARPS * ROWS * DP;             // [WARPS][ROWS][2]
    if (g == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int cc = 0; cc < CH; ++cc) {
                const int ch = x + TX * cc;
                if (ch >= ROW_CHUNKS) continue;
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    sO[(warp * ROWS + r) * DP + ch * VEC + e] = o[r][cc * VEC + e];
            }
            if (x == 0) sML[(warp * ROWS + r) * 2] = m[r], sML[(warp * ROWS + r) * 2 + 1] = l[r];
        }
    }
    __syncthreads();

    decode_finish<WARPS, ROWS, THREADS>(sO, sML, s, lay, blk, split, splits, out, lse, part_o, part_ml,
                                        tickets);
}
