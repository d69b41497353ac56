// Decoding from a KV cache on sm_90 with the copy engine: few query rows (a KV group's heads x
// seq_q, at most ROWS) against many keys, each key read once per group.
//
// Why another decode kernel: the streams design (each warp copying its own tiles with 16-byte
// cp.async) read DRAM at 80-90% of peak while cudnn read at about 96%, and its split grid of
// one block per (batch, KV head, split) left SMs idle (B1: 128 blocks on 132 SMs) or ran in
// uneven waves (B64: 512 blocks). Here:
//   - A block takes HB consecutive KV heads at once (FERRO_WARPS; the layout keeps a key's heads
//     contiguous, so one key of the group is HB * head_dim elements in a row), and every key of
//     them is one `cp.async.bulk` (or, where the group's keys are contiguous too, the whole tile
//     is one copy): few, large requests, issued by one loader warp, completing on an mbarrier.
//   - The grid is persistent: one block per SM, the keys of every (batch, head group) pair laid
//     end to end as tiles of TK keys and cut into gridDim.x ranges that differ by at most one
//     tile. A block's range may cross pairs: the loader streams on regardless, and each
//     computing warp closes a pair's segment on its own (no block-wide barrier in the loop).
//   - Computing warp w owns KV head hg * HB + w of the tile: its rows' online softmax, Q and O
//     live in its registers (lane groups of TX lanes take one key at a time, as in the streams
//     kernel), so a segment closes with shuffles only.
// A pair wholly inside one block's range writes out (rounded once) and lse itself; a pair cut
// among blocks leaves each segment's unnormalised O and (max, sum) in the workspace slot
// `block - first block of the pair`, and flash_decode_merge merges them.
// Every forward option holds: causal + offset, window, mask, dropout (the same keep mask),
// kv_lens, dead rows -> 0; keys past every row's reach are never read (tiles outside a pair's
// visible keys copy nothing, and their stale shared memory is read as zeros).
// The backend takes this kernel only on sm_90 with head_dim a multiple of 16, 16-byte aligned
// rows, each key's KV heads contiguous (head stride head_dim) and kv_heads a multiple of HB, and
// only for calls without kv_lens: the even cut counts each pair's tiles up to the call's reach,
// so with short sequences in a long cache the blocks holding their empty tiles would idle while
// the others read everything (the split grid's many blocks refill the SMs instead). The kernel
// itself honours kv_lens (each batch's keys and rows), as every forward kernel does.
// Geometry (HB, ROWS, TX, TK, STAGES) from configs.py.
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_philox.cuh"
#include "ferro_softmax.cuh"
#include "ferro_mbarrier.cuh"
#include "ferro_decode.cuh"

namespace {
constexpr int DP = FERRO_HEAD_DIM, HB = FERRO_WARPS, THREADS = 32 * HB + 128;
constexpr int ROWS = FERRO_ROWS;                // query rows of a KV group, at most
constexpr int STAGES = FERRO_STAGES;            // tiles in the ring
constexpr int TX = FERRO_KEY_LANES;             // lanes per key
constexpr int TK = FERRO_BN;                    // keys per tile
constexpr int VEC = 16 / sizeof(T);             // elements per 16-byte chunk
constexpr int ROW_CHUNKS = DP / VEC;            // chunks per key row of one head
constexpr int CH = (ROW_CHUNKS + TX - 1) / TX;  // chunks per lane
constexpr int DL = CH * VEC;                    // dims per lane
constexpr int KW = 32 / TX;                     // keys a warp reads at once: one per lane group
constexpr int C = FERRO_SUB_KEYS / KW;          // keys per lane group per step
constexpr int SUB = KW * C;                     // keys per step; a tile is TK / SUB steps
constexpr int ROW_BYTES = DP * (int)sizeof(T);  // one head's row
constexpr int KEY_BYTES = HB * ROW_BYTES;       // one key of the head group (K or V)
constexpr int TILE_BYTES = 2 * TK * KEY_BYTES;  // K keys, then V keys
static_assert(HB % 4 == 0, "the computing warps are whole warpgroups");
static_assert(TX >= 1 && TX <= 32 && (TX & (TX - 1)) == 0, "lane groups of a power of two");
static_assert(DP % 16 == 0 && C >= 1 && TK % SUB == 0 && TK <= 64, "decode tile geometry");
static_assert(STAGES * TILE_BYTES + 16 * STAGES == FERRO_SMEM_BYTES, "shared memory = configs.py's");
}  // namespace

// The keys some row of a pair may see, [lo, hi) (s: its batch's shape): a tile copies only
// those of its own keys.
__device__ __forceinline__ void pair_keys(const AttnShape& s, long long& lo, long long& hi) {
    visible_key_range(s, s.offset, (long long)s.seq_q - 1 + s.offset, lo, hi);
    if (hi > s.kv_reach) hi = s.kv_reach;
    if (hi < lo) hi = lo;
}

// A block's walk over its tiles [t_begin, t_end): the pair (batch b, head group hg) and the
// tile's place u in it, stepped along without divisions (the loading and the computing warps
// walk alike).
struct TileWalk {
    u64 pair;
    u32 u, pair_tiles, groups;
    __device__ __forceinline__ TileWalk(u64 t, u32 pair_tiles_, u32 groups_)
        : pair(t / pair_tiles_), u((u32)(t % pair_tiles_)), pair_tiles(pair_tiles_), groups(groups_) {}
    __device__ __forceinline__ u32 b() const { return (u32)(pair / groups); }
    __device__ __forceinline__ u32 hg() const { return (u32)(pair % groups); }
    __device__ __forceinline__ bool last_of_pair() const { return u + 1 == pair_tiles; }
    __device__ __forceinline__ void next() {
        if (++u == pair_tiles) u = 0, ++pair;
    }
};

// The block that holds tile t when `total` tiles are cut into `blocks` ranges
// [w * total / blocks, (w + 1) * total / blocks).
__device__ __forceinline__ u32 bulk_owner(u64 t, u64 total, u32 blocks) {
    return (u32)(((t + 1) * blocks - 1) / total);
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
        "r"((u32)__cvta_generic_to_shared(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_decode_bulk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  float* __restrict__ part_o, float* __restrict__ part_ml, T* __restrict__ out,
                  float* __restrict__ lse, const void* __restrict__ mask,
                  const int* __restrict__ kv_lens, const u32 pair_tiles, const u32 key0,
                  const u32 vec, const u32 mask_kind, const AttnLayout lay, const FlashV2Params p) {
    extern __shared__ __align__(128) unsigned char smem_b[];
    u64* full = reinterpret_cast<u64*>(smem_b + STAGES * TILE_BYTES);  // [STAGES]
    u64* empty = full + STAGES;                                        // [STAGES]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    const AttnShape s0 = attn_shape(p, mask_kind);
    const u32 groups = s0.kv_heads / HB;  // head groups per batch
    const u64 total = (u64)s0.batch * groups * pair_tiles;
    const u64 t_begin = (u64)blockIdx.x * total / gridDim.x;
    const u64 t_end = (u64)(blockIdx.x + 1) * total / gridDim.x;
    const u32 n_tiles = (u32)(t_end - t_begin);
    if (tid == 0) {
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(&full[i], 1);    // the loader's arrival (with the tile's bytes)
            mbar_init(&empty[i], HB);  // one arrival per computing warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= HB) {  // ---- the loading warpgroup: its first warp copies, the others leave ----
        regs_shrink<24>();  // its registers go to the computing warps (which take 240)
        if (warp > HB) return;
        TileWalk tw(t_begin, pair_tiles, groups);
        long long L = 0, H = 0;
        Rows rk{0, 0}, rv{0, 0};
        for (u32 n = 0; n < n_tiles; ++n, tw.next()) {
            const u32 stage = n % STAGES;
            if (n == 0 || tw.u == 0) {  // a new pair: its keys and rows
                AttnShape s = s0;
                for_batch(s, kv_lens, tw.b());
                pair_keys(s, L, H);
                rk = rows_of(lay.k, tw.b(), tw.hg() * HB), rv = rows_of(lay.v, tw.b(), tw.hg() * HB);
            }
            const long long j0 = (long long)key0 + (long long)tw.u * TK;
            const long long lo = max(L, j0), hi = min(H, j0 + TK);
            const u32 cnt = hi > lo ? (u32)(hi - lo) : 0u;
            if (n >= STAGES) mbar_wait(&empty[stage], ((n / STAGES) - 1) & 1);
            if (lane == 0) {
                if (cnt) mbar_arrive_expect(&full[stage], 2 * cnt * KEY_BYTES);
                else mbar_arrive(&full[stage]);  // nothing to copy: the tile is ready as it is
            }
            __syncwarp();  // the bytes are expected before any copy can complete
            if (cnt == 0) continue;
            unsigned char* kdst = smem_b + stage * TILE_BYTES + (lo - j0) * KEY_BYTES;
            unsigned char* vdst = kdst + TK * KEY_BYTES;
            const T* ks = k + rk.off + (u64)lo * rk.stride;
            const T* vs = v + rv.off + (u64)lo * rv.stride;
            if (rk.stride == (u64)HB * DP && rv.stride == (u64)HB * DP) {  // the keys are contiguous
                if (lane == 0) bulk_copy(kdst, ks, cnt * KEY_BYTES, &full[stage]);
                if (lane == 1) bulk_copy(vdst, vs, cnt * KEY_BYTES, &full[stage]);
            } else {  // a copy per key and tensor, a lane each
                for (u32 i = lane; i < 2 * cnt; i += 32) {
                    const bool is_v = i >= cnt;
                    const u32 key = is_v ? i - cnt : i;
                    bulk_copy((is_v ? vdst : kdst) + key * KEY_BYTES,
                              is_v ? vs + (u64)key * rv.stride : ks + (u64)key * rk.stride,
                              KEY_BYTES, &full[stage]);
                }
            }
        }
        return;  // its copies complete on the barriers the computing warps wait for
    }

    // ---- a computing warp: KV head hg * HB + warp of each tile ----
    regs_grow<240>();
    const int g = lane / TX, x = lane % TX;  // lane group (its key), lane within the group
    const bool dropout = s0.dropout_prob > 0.f;
    const u32 thr = dropout_threshold(s0.dropout_prob);
    const float keep_scale = dropout ? 1.f / (1.f - s0.dropout_prob) : 1.f;
    const u32 G = s0.heads / s0.kv_heads;
    const int R = (int)(G * s0.seq_q);
    const u64 rows_total = (u64)s0.batch * s0.heads * s0.seq_q;

    // Row r (head hk * G + r / seq_q, query r % seq_q) sees keys [see_lo[r], see_lo[r] + see_n[r]).
    u32 see_lo[ROWS], see_n[ROWS];
    float qf[ROWS][DL];  // this lane's dims of each row of Q, scaled; 0 past R
    float m[ROWS], l[ROWS], o[ROWS][DL];
    AttnShape s = s0;
    u32 b = 0, hk = 0;

    long long L = 0, H = 0;  // the pair's keys some row sees (those copied)
    TileWalk tw(t_begin, pair_tiles, groups);
    for (u32 n = 0; n < n_tiles; ++n, tw.next()) {
        const u32 stage = n % STAGES;
        if (n == 0 || tw.u == 0) {  // a segment of a new pair: its shape, rows and Q
            b = tw.b();
            hk = tw.hg() * HB + warp;
            s = s0;
            for_batch(s, kv_lens, b);
            pair_keys(s, L, H);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const u32 qi = r < R ? r % s.seq_q : 0, head = hk * G + (r < R ? r / s.seq_q : 0);
                long long r_lo, r_hi;
                visible_key_range(s, (long long)qi + s.offset, (long long)qi + s.offset, r_lo, r_hi);
                if (r_hi > s.kv_reach) r_hi = s.kv_reach;
                see_lo[r] = (u32)max(r_lo, 0ll);
                see_n[r] = r < R && r_hi > r_lo ? (u32)(r_hi - r_lo) : 0u;
                const T* qr = q + (u64)b * lay.q.b + (u64)qi * lay.q.s + (u64)head * lay.q.h;
#pragma unroll
                for (int cc = 0; cc < CH; ++cc) {
                    const int ch = x + TX * cc;
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        qf[r][cc * VEC + e] = (r < R && ch < ROW_CHUNKS) ? to_f(qr[ch * VEC + e]) * s.scale : 0.f;
                }
                m[r] = neg_inf(), l[r] = 0.f;
#pragma unroll
                for (int e = 0; e < DL; ++e) o[r][e] = 0.f;
            }
        }
        const long long j0 = (long long)key0 + (long long)tw.u * TK;
        const long long lo_k = max(L, j0), hi_k = max(lo_k, min(H, j0 + TK));
        mbar_wait(&full[stage], (n / STAGES) & 1);
        const unsigned char* kbuf = smem_b + stage * TILE_BYTES;
        const unsigned char* vbuf = kbuf + TK * KEY_BYTES;
        const u32 lo = (u32)lo_k, hi = (u32)hi_k;  // keys copied (others are stale: zeros)

        for (int sub = 0; sub < TK / SUB && j0 + sub * SUB < hi_k; ++sub) {
            if (j0 + (sub + 1) * SUB <= lo_k) continue;  // no copied key in this step
            const u32 rel0 = (u32)j0 + sub * SUB + g;     // key c of the group: rel0 + c * KW
            float sc[C][ROWS];  // scores, then P
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const u32 j = rel0 + c * KW;
                const bool copied = j - lo < hi - lo;
                const int kk = sub * SUB + c * KW + g;
                float kf[DL];
#pragma unroll
                for (int cc = 0; cc < CH; ++cc) {
                    const int ch = x + TX * cc;
                    float f[VEC];
                    if (copied && ch < ROW_CHUNKS) {
                        load16(reinterpret_cast<const T*>(kbuf + ((kk * HB + warp) * ROW_CHUNKS + ch) * 16), f);
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

            if (s.has_mask) {
#pragma unroll
                for (int c = 0; c < C; ++c)
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
                        if (rel0 + c * KW - see_lo[r] < see_n[r])
                            sc[c][r] += mask_at(s, mask, b, hk * G + r / s.seq_q, r % s.seq_q,
                                                rel0 + c * KW);
            }
            // Dropout's keep bits (bit c * ROWS + r), in a loop kept rolled (registers).
            u32 keep = ~0u;
            if (dropout) {
                keep = 0;
#pragma unroll 1
                for (int idx = 0; idx < C * ROWS; ++idx) {
                    const int c = idx / ROWS, r = idx % ROWS;
                    const u32 j = rel0 + c * KW;
                    const u32 bits = dropout_keep4(s.seed, thr, b * s.heads + hk * G + r / s.seq_q,
                                                   r % s.seq_q, j);
                    keep |= ((bits >> (j & 3)) & 1u) << idx;
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float mx = m[r];
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    if (!(rel0 + c * KW - see_lo[r] < see_n[r])) sc[c][r] = neg_inf();
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
            // O += P V over the group's keys (a key not copied reads as zeros).
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const bool copied = rel0 + c * KW - lo < hi - lo;
                const int kk = sub * SUB + c * KW + g;
#pragma unroll
                for (int cc = 0; cc < CH; ++cc) {
                    const int ch = x + TX * cc;
                    if (ch >= ROW_CHUNKS) continue;
                    float f[VEC];
                    if (copied) {
                        load16(reinterpret_cast<const T*>(vbuf + ((kk * HB + warp) * ROW_CHUNKS + ch) * 16), f);
                    } else {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) f[e] = 0.f;
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            o[r][cc * VEC + e] = fmaf(sc[c][r], f[e], o[r][cc * VEC + e]);
                }
            }
        }
        __syncwarp();  // every lane's reads of the tile are done
        if (lane == 0) mbar_arrive(&empty[stage]);

        if (n + 1 == n_tiles || tw.last_of_pair()) {  // the segment ends: merge the lane groups
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
            // The pair's blocks: its first tile's and its last tile's owners.
            const u32 first = bulk_owner(tw.pair * pair_tiles, total, gridDim.x);
            const u32 last = bulk_owner((tw.pair + 1) * pair_tiles - 1, total, gridDim.x);
            const u64 slot = blockIdx.x - first;
            if (g == 0) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r >= R) continue;
                    const u32 qi = r % s.seq_q, head = hk * G + r / s.seq_q;
                    const u64 row = ((u64)b * s.heads + head) * s.seq_q + qi;
                    if (first == last) {  // the whole pair is this block's: the answer
                        const float inv = l[r] == 0.f ? 0.f : keep_scale / l[r];  // sees nothing: 0
                        T* orow = out + (u64)b * lay.out.b + (u64)qi * lay.out.s + (u64)head * lay.out.h;
#pragma unroll
                        for (int cc = 0; cc < CH; ++cc) {
                            const int ch = x + TX * cc;
                            if (ch >= ROW_CHUNKS) continue;
#pragma unroll
                            for (int e = 0; e < VEC; ++e) orow[ch * VEC + e] = from_f(o[r][cc * VEC + e] * inv);
                        }
                        if (lse && x == 0) lse[row] = l[r] == 0.f ? neg_inf() : m[r] + logf(l[r]);
                    } else {
                        float* po = part_o + (slot * rows_total + row) * DP;
#pragma unroll
                        for (int cc = 0; cc < CH; ++cc) {
                            const int ch = x + TX * cc;
                            if (ch >= ROW_CHUNKS) continue;
#pragma unroll
                            for (int e = 0; e < VEC; e += 4)
                                *reinterpret_cast<float4*>(po + ch * VEC + e) =
                                    make_float4(o[r][cc * VEC + e], o[r][cc * VEC + e + 1],
                                                o[r][cc * VEC + e + 2], o[r][cc * VEC + e + 3]);
                        }
                        if (x == 0)
                            *reinterpret_cast<float2*>(part_ml + (slot * rows_total + row) * 2) =
                                make_float2(m[r], l[r]);
                    }
                }
            }
        }
    }
}

// One block per output row (b, h, i) of a pair cut among several blocks: each slot's weight
// exp(m_s - M) once (threads across slots, into shared memory), then groups of DP / 4 threads
// each sum a share of the slots' O (a float4 of dims a thread, independent loads), and the
// groups' sums add up in shared memory. Rows of pairs one block held are left alone (that block
// wrote them). `blocks` is the decode launch's grid.
constexpr int MERGE_THREADS = FERRO_COMBINE_THREADS;
constexpr int MERGE_SLOTS = FERRO_MAX_SPLITS;  // slots a pair may have: the decode grid, at most
constexpr int MERGE_LANES = DP / 4;            // threads of a group: a float4 of O each
constexpr int MERGE_GROUPS = MERGE_THREADS / MERGE_LANES;

__device__ __forceinline__ float merge_reduce(float x, bool is_max, float* scratch) {
#pragma unroll
    for (int w = 16; w; w >>= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, w);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();  // scratch is free (a previous reduction has been read)
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
    __syncthreads();
    x = scratch[0];
#pragma unroll
    for (int w = 1; w < MERGE_THREADS / 32; ++w) x = is_max ? fmaxf(x, scratch[w]) : x + scratch[w];
    return x;
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
flash_decode_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                   T* __restrict__ out, float* __restrict__ lse, const u32 pair_tiles,
                   const u32 blocks, const AttnLayout lay, const FlashV2Params p) {
    __shared__ float weight[MERGE_SLOTS];
    __shared__ float scratch[MERGE_THREADS / 32];
    __shared__ float4 sums[MERGE_GROUPS][MERGE_LANES];
    const u64 rows_total = (u64)p.batch * p.heads * p.seq_q, row = blockIdx.x;
    const u32 i = row % p.seq_q, bh = row / p.seq_q, h = bh % p.heads, b = bh / p.heads;
    const u32 groups = p.kv_heads / HB, G = p.heads / p.kv_heads;
    const u64 pair = (u64)b * groups + (h / G) / HB;
    const u64 total = (u64)p.batch * groups * pair_tiles;
    const u32 first = bulk_owner(pair * pair_tiles, total, blocks);
    const u32 n = bulk_owner((pair + 1) * pair_tiles - 1, total, blocks) - first + 1;
    if (n == 1) return;
    const int tid = threadIdx.x;
    float M = neg_inf();
    for (u32 sp = tid; sp < n; sp += MERGE_THREADS) M = fmaxf(M, part_ml[(sp * rows_total + row) * 2]);
    M = merge_reduce(M, true, scratch);
    const float m_use = M == neg_inf() ? 0.f : M;
    float L = 0.f;
    for (u32 sp = tid; sp < n; sp += MERGE_THREADS) {
        const float* ml = part_ml + (sp * rows_total + row) * 2;
        const float w = ml[1] != 0.f ? exp2f((ml[0] - m_use) * FERRO_LOG2E) : 0.f;  // empty: 0
        weight[sp] = w;
        L += ml[1] * w;
    }
    L = merge_reduce(L, false, scratch);  // its barriers also publish `weight`
    // (MERGE_THREADS need not be whole groups: at head_dim 48, 80, 96, 112 the last threads
    // take no slot and write no sum.)
    const int grp = tid / MERGE_LANES, c4 = tid % MERGE_LANES;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (u32 sp = grp; grp < MERGE_GROUPS && sp < n; sp += MERGE_GROUPS) {
        const float w = weight[sp];
        if (w == 0.f) continue;  // an empty slot's O is 0, but never multiply what was not summed
        const float4 x = *reinterpret_cast<const float4*>(part_o + (sp * rows_total + row) * DP + 4 * c4);
        acc.x = fmaf(w, x.x, acc.x), acc.y = fmaf(w, x.y, acc.y);
        acc.z = fmaf(w, x.z, acc.z), acc.w = fmaf(w, x.w, acc.w);
    }
    if (grp < MERGE_GROUPS) sums[grp][c4] = acc;
    __syncthreads();
    if (tid < MERGE_LANES) {
        float4 a = sums[0][tid];
#pragma unroll
        for (int gq = 1; gq < MERGE_GROUPS; ++gq) {
            const float4 y = sums[gq][tid];
            a.x += y.x, a.y += y.y, a.z += y.z, a.w += y.w;
        }
        const float keep_scale = p.dropout_prob > 0.f ? 1.f / (1.f - p.dropout_prob) : 1.f;
        const float inv = L == 0.f ? 0.f : keep_scale / L;  // a row that sees nothing: 0
        T* orow = out + (u64)b * lay.out.b + (u64)i * lay.out.s + (u64)h * lay.out.h + 4 * tid;
        orow[0] = from_f(a.x * inv), orow[1] = from_f(a.y * inv);
        orow[2] = from_f(a.z * inv), orow[3] = from_f(a.w * inv);
        if (lse && tid == 0) lse[row] = L == 0.f ? neg_inf() : M + logf(L);
    }
}
