// Decoding from a KV cache on tensor cores (float16 / bfloat16, sm_80+): a KV group's query rows
// (heads x seq_q, at most 16) are the 16 rows of one mma.sync m16n8k16 A operand, so each key is
// read once per group and costs a few tensor-core instructions instead of head_dim FMAs per row
// on the CUDA cores (the streams design spent 63% of the SM's issue slots on them at 80% of DRAM
// bandwidth: ncu, bf16 B1 Sk128k, H200, 2026-12-03).
//
// A block takes one (batch, KV head) and one split of its keys. Every warp holds all 16 rows of Q
// in registers (A fragments, loaded once) and streams its own tiles of TK keys (tiles warp,
// warp + WARPS, ...) through its own ring of STAGES shared-memory buffers with cp.async, so the
// key loop waits only on its own warp: `cp.async.wait_group` then `__syncwarp` (ldmatrix reads
// what the warp's other lanes copied). Per tile: S = Q K^T (float32 accumulators), scale, mask,
// -inf where a row does not see a key, the online softmax per row, dropout (the same keep mask),
// O += P V with P rounded to the dtype (as every half-precision forward here does). The warps'
// results merge through shared memory at the end (decode_finish); with several splits, the
// pair's last block to finish merges the splits (decode_finish's tickets). Every forward option holds: causal + offset, window,
// mask, dropout, kv_lens, a paged cache (TileKeys: a tile in one page translated once), dead
// rows -> 0; keys past the split's reach are never read.
// Rows of K and V take 16-byte copies (the backend checks). Geometry from configs.py.
#include "ferro_params.cuh"
#include "ferro_softmax.cuh"
#include "ferro_copy.cuh"
#include "ferro_score.cuh"
#include "ferro_mma_f16.cuh"
#include "ferro_decode.cuh"

#ifndef FERRO_BF16
#error "the tensor-core decode kernel is for float16 and bfloat16"
#endif

namespace {
constexpr int DP = FERRO_HEAD_DIM, WARPS = FERRO_WARPS, THREADS = 32 * WARPS;
constexpr int ROWS = FERRO_ROWS;           // the A operand's 16 rows
constexpr int STAGES = FERRO_STAGES;       // buffers per warp: STAGES - 1 tiles in flight
constexpr int TK = FERRO_BN / WARPS;       // keys per warp tile
constexpr int NT = TK / 8;                 // n-tiles of the scores
constexpr int DT = DP / 8;                 // n-tiles of O
constexpr int PITCH = DP + 8;              // elements per shared row of Q (ferro_mma_f16.cuh)
// K and V rows: swizzled where head_dim is whole 128-byte lines (swz_at: no padding, which
// slowed the copies), else padded like Q; configs.py's `kv_swizzled` decides.
constexpr bool SWZ = FERRO_KV_SWIZZLE;
constexpr int KPITCH = SWZ ? DP : PITCH;
constexpr int CHUNKS = DP / 8;             // 16-byte chunks per row
constexpr int TILE = 2 * TK * KPITCH;      // elements of one buffer: K rows, then V rows
constexpr int Q_BYTES = 2 * ROWS * PITCH;
constexpr int RING_BYTES = 2 * WARPS * STAGES * TILE;
constexpr int MERGE_BYTES = 4 * WARPS * ROWS * (DP + 2);  // each warp's O and (max, sum)
static_assert(ROWS == 16 && TK % 16 == 0 && TK * WARPS == FERRO_BN && TK * CHUNKS % 32 == 0,
              "decode tile geometry");
static_assert(Q_BYTES + (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) == FERRO_SMEM_BYTES,
              "shared memory = configs.py's");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
flash_decode_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 float* __restrict__ part_o, float* __restrict__ part_ml,
                 u32* __restrict__ tickets, T* __restrict__ out, float* __restrict__ lse,
                 const void* __restrict__ mask, const int* __restrict__ kv_lens,
                 const int* __restrict__ block_table, const float* __restrict__ alibi,
                 const float* __restrict__ sinks, const int* __restrict__ cu_q,
                 const int* __restrict__ cu_k, const u32 splits,
                 const u32 split_keys, const u32 vec, const u32 mask_kind, const AttnLayout lay,
                 const FlashV2Params p, const AttnExtras ex) {
    extern __shared__ __align__(16) unsigned char smem_d[];
    u16* sQ = reinterpret_cast<u16*>(smem_d);                        // [ROWS][PITCH]
    unsigned char* rings = smem_d + Q_BYTES;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const Lane L = lane_ids();
    u16* ring = reinterpret_cast<u16*>(rings) + warp * STAGES * TILE;

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
    const long long j_lo = blk.j_lo, j_hi = blk.j_hi;
    const int n_tiles = j_hi > j_lo ? (int)((j_hi - j_lo + TK - 1) / TK) : 0;
    const int n_mine = n_tiles > warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;

    // This lane's two rows (g, g + 8: the accumulators' c0/c1 and c2/c3) see the keys
    // j_lo + [see_lo, see_lo + see_n) of the split (none past R): one unsigned compare a score.
    // [all_lo, all_hi): the keys every row sees; a tile inside it skips the test.
    u32 see_lo[2], see_n[2], bh[2], qrow[2];
    float slope[2];  // ALiBi's, of each row's head
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = L.g + 8 * rr;
        const u32 qi = r < R ? r % s.seq_q : 0;
        long long r_lo, r_hi;
        visible_key_range(s, (long long)qi + s.offset, (long long)qi + s.offset, r_lo, r_hi);
        r_lo = max(r_lo, j_lo), r_hi = min(r_hi, j_hi);
        see_lo[rr] = (u32)(r_lo - j_lo);
        see_n[rr] = r < R && r_hi > r_lo ? (u32)(r_hi - r_lo) : 0u;
        bh[rr] = b * s.heads + hk * G + (r < R ? r / s.seq_q : 0);
        qrow[rr] = qi;
        slope[rr] = alibi_slope(s, b, bh[rr] - b * s.heads);
    }
    long long all_lo = j_lo, all_hi = j_hi;
    for (int r = 0; r < R; ++r) {
        long long r_lo, r_hi;
        const long long a = (long long)(r % s.seq_q) + s.offset;
        visible_key_range(s, a, a, r_lo, r_hi);
        all_lo = max(all_lo, r_lo), all_hi = min(all_hi, r_hi);
    }

    // Tile u of this warp: keys jt + [0, TK); lane-consecutive 16-byte chunks of each row (a
    // warp copies two rows of 256 bytes at a time at head_dim 128); past j_hi and past D,
    // zero-filled.
    auto load = [&](int u) {
        if (u < n_mine) {
            const long long jt = j_lo + (long long)(warp + WARPS * u) * TK;
            u16* sK = ring + (u % STAGES) * TILE;
            u16* sV = sK + TK * KPITCH;
            const TileKeys tk(blk, jt, TK);
#pragma unroll
            for (int i = 0; i < TK * CHUNKS / 32; ++i) {
                const int c = lane + 32 * i, key = c / CHUNKS, ch = c % CHUNKS;
                const long long j = jt + key;
                const bool ok = j < j_hi && ch * 8 < D;
                const u64 d0 = ok ? ch * 8 : 0;
                u64 ko = 0, vo = 0;
                if (ok) tk.at(blk, j, ko, vo);
                int at;
                if constexpr (SWZ) at = swz_at<DP>(key, ch);
                else at = key * PITCH + ch * 8;
                cp_async<16>(sK + at, kb + ko + d0, ok);
                cp_async<16>(sV + at, vb + vo + d0, ok);
            }
        }
        cp_async_commit();  // one group per tile, maybe empty: the wait below counts tiles
    };
    // The first tiles' copies go out before anything else waits on memory (Q's loads below
    // included), so the block's start-up hides behind them.
#pragma unroll
    for (int u = 0; u < STAGES - 1; ++u) load(u);

    // Q's rows (zero past R and past D) into shared memory, element by element (read once, so
    // its alignment is not asked for): every load of the thread issued before its first store,
    // one round trip rather than one per element.
    {
        constexpr int PER = ROWS * DP / THREADS;
        static_assert(ROWS * DP % THREADS == 0, "Q's elements spread evenly over the threads");
        T x[PER];
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int idx = tid + e * THREADS, r = idx / DP, d = idx % DP;
            x[e] = 0;
            if (r < R && d < D) {
                const u32 qi = r % s.seq_q, head = hk * G + r / s.seq_q;
                x[e] = q[blk.q_at(lay.q, head, qi) + d];
            }
        }
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int idx = tid + e * THREADS;
            sQ[(idx / DP) * PITCH + idx % DP] = x[e];
        }
    }
    __syncthreads();  // sQ written
    u32 qa[DP / 16][4];
    {
        const u32 a0 = lane_a<PITCH>(sQ);
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) ldmatrix_x4(qa[kk], a0 + 2 * (kk * 16));
    }

    const Dropout<true> drop(s);
    float o[1][DT][4];
#pragma unroll
    for (int nd = 0; nd < DT; ++nd) o[0][nd][0] = o[0][nd][1] = o[0][nd][2] = o[0][nd][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};

    for (int u = 0; u < n_mine; ++u) {
        __syncwarp();  // every lane is done reading the buffer refilled here (tile u - 1's)
        load(u + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // this lane's copies of tile u have landed
        __syncwarp();                 // and every other lane's
        const u16* sK = ring + (u % STAGES) * TILE;
        const u16* sV = sK + TK * KPITCH;
        const long long jt = j_lo + (long long)(warp + WARPS * u) * TK;

        float sc[1][NT][4];
        if constexpr (SWZ) {
            gemm_abt_swz<NT, DP>(qa, sK, sc[0]);
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) sc[0][nt][0] = sc[0][nt][1] = sc[0][nt][2] = sc[0][nt][3] = 0.f;
            const u32 b0 = lane_b_nk<PITCH>(sK);
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk)
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    u32 bf[4];
                    ldmatrix_x4(bf, b0 + 2 * (np * 16 * PITCH + kk * 16));
                    mma16816(sc[0][2 * np], qa[kk], bf[0], bf[1]);
                    mma16816(sc[0][2 * np + 1], qa[kk], bf[2], bf[3]);
                }
        }

        // Scale, softcap, ALiBi, mask, -inf where the row does not see the key.
        const bool whole = jt >= all_lo && jt + TK <= all_hi;
        const u32 rel0 = (u32)(jt - j_lo);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = nt * 8 + 2 * L.t + c;
                    float x = sc[0][nt][2 * rr + c] * s.scale;
                    const bool seen = rel0 + key - see_lo[rr] < see_n[rr];
                    if (!whole && !seen) x = neg_inf();
                    else x = modified_score<true, BuildOptions::MODS>(
                        s, mask, b, bh[rr] - b * s.heads, qrow[rr], jt + key, see_n[rr] != 0,
                        slope[rr], x);
                    sc[0][nt][2 * rr + c] = x;
                }

        float alpha[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) alpha[rr] = online_softmax<NT>(sc[0], rr, m_run[rr], l_run[rr]);
        rescale_rows<DT>(o[0], alpha);
        // Dropout (1 / (1 - p) once at the end; l keeps P's sum). A split may start anywhere, so
        // a pair of keys may straddle two Philox blocks (EVEN false).
        drop.drop<NT, false>(sc[0], bh, qrow, (u32)jt, L);
        if constexpr (SWZ) gemm_acc_ab_swz<NT, DP>(sc[0], sV, o[0]);
        else gemm_acc_ab<1, NT, DP, PITCH>(sc, sV, o);
    }
    cp_async_wait<0>();

    // The warps' results through shared memory (the rings are done with once every warp is).
    __syncthreads();
    float* sO = reinterpret_cast<float*>(rings);  // [WARPS][ROWS][DP]
    float* sML = sO + WARPS * ROWS * DP;          // [WARPS][ROWS][2]
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = L.g + 8 * rr;
        const float l = quad_sum(l_run[rr]);  // every lane (shuffles), before the row test
        if (r >= R) continue;  // decode_finish reads rows < R only (4 of the 16 at GQA 4, Sq 1)
#pragma unroll
        for (int nd = 0; nd < DT; ++nd)
            *reinterpret_cast<float2*>(sO + (warp * ROWS + r) * DP + nd * 8 + 2 * L.t) =
                make_float2(o[0][nd][2 * rr], o[0][nd][2 * rr + 1]);
        if (L.t == 0) sML[(warp * ROWS + r) * 2] = m_run[rr], sML[(warp * ROWS + r) * 2 + 1] = l;
    }
    __syncthreads();

    decode_finish<WARPS, ROWS, THREADS>(sO, sML, s, lay, blk, split, splits, out, lse, part_o, part_ml,
                                        tickets);
}
