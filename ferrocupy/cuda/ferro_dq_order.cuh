// The fused backward's dQ (flash_bwd_fused_wgmma.cu): per step of the dK/dV kernel (one query
// tile of BQ rows of one (batch, head)), the computing warpgroups store their dS to shared memory,
// and one of them in turn (step t: warpgroup t % GROUPS) forms the float32 partial
// dQ_part = dS K over the block's BK keys and stages it in its own shared buffer (stage_dq). The
// loading warpgroup's last warp, the dQ writer (write_dq_in_order), adds each staged partial into
// a float32 accumulator in global memory with one bulk reduction (cp.reduce.async.bulk .add.f32:
// the L2 adds a contiguous BQ x DP tile, 32 KB at head_dim 128), so no computing warp waits for
// the adds or for their order. dq_accum is [batch * heads][q_tiles][BQ x DP] (q_tiles over the
// frame's seq_q: a varlen sequence's rows at its (batch, head)'s first ones), each tile in the
// accumulator's fragment order (dq_tile_offset), which the pre-kernel zeroes and the post-kernel
// scales and rounds into grad_q. One add per (key block, query tile).
//
// Order. ferrocupy promises bit-identical backward runs, so the adds into one query tile happen
// in one fixed order: key block n's, then key block n + 1's. A counter per (batch, head, query
// tile), dq_sem (zeroed by the pre-kernel), counts the adds done; key block n's writer issues its
// add once the counter reads n - first, and counts it only once the add has completed (the bulk
// group waited for, not only its reads). `first` is
// the first key block that visits the tile (ferro_visibility.cuh's first_key_block, from the rule
// that decides which tiles a block visits): with causal, an offset or windows it is not block 0.
// A block also visits a tile past seq_q where its rows' range is empty and starts inside one
// (visible_row_range's clamp): it adds nothing there, and has no counter to wait on.
//
// No deadlock. (1) A writer waits only for adds of the same (batch, KV head)'s blocks with a
// smaller key-block index. (2) block_coords
// (ferro_tiles.cuh) numbers a (batch, KV head)'s key blocks in rank order within its group of
// heads, so each block waited for has a smaller blockIdx.x. (3) The GPU dispatches a 1-D grid's
// blocks in increasing blockIdx.x (FlashAttention-3's deterministic backward relies on the
// same), so when a block starts, every block with a smaller index holds an SM or has finished:
// no count of resident blocks matters, one block an SM is enough. (4) A waiting block holds only
// its own SM; the blocks it waits for wait only for still smaller indices, never for it. So the
// least-indexed waiting writer waits for adds of running blocks that are not waiting, which
// make progress; by induction every wait ends. (5) Inside a block, the writer depends on nothing
// but the computing warpgroups' staging, which depends on the writer only through the buffer's
// previous use (dq_empty): the writer handles the steps in order, so the use it frees comes
// before the one it then waits for. lab/models/dq_model.py checks (1)-(5)
// over random schedules.
#pragma once
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"
#include "ferro_mbarrier.cuh"
#include "ferro_wgmma.cuh"

// A barrier of every computing warpgroup (id 1; 0 is __syncthreads).
template <int GROUPS>
__device__ __forceinline__ void computing_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(128 * GROUPS) : "memory");
}
// A barrier of computing warpgroup wg (ids 2, 3, ...).
__device__ __forceinline__ void warpgroup_sync(int wg) {
    asm volatile("bar.sync %0, 128;" ::"r"(wg + 1) : "memory");
}

// dS^T's rounded A fragments (to_a_fragments of this warpgroup's 64 keys x BQ query rows) stored
// as dS, BQ rows x 64 keys, in ferro_wgmma.cuh's 128-byte-swizzled K-major layout (one column
// block: the warpgroups' blocks side by side are the A operand of dQ_part = dS K).
template <int NT>
__device__ __forceinline__ void store_ds_transposed(u16* tile, const u32 (&a)[NT / 2][4], Lane L) {
    const int key = ((threadIdx.x >> 5) & 3) * 16 + L.g;  // this thread's keys: key, key + 8
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int c = nt * 8 + 2 * L.t + (r & 1), kj = key + 8 * (r >> 1);
            const u32 w = a[nt >> 1][(nt & 1) * 2 + (r >> 1)];
            tile[c * 64 + (((kj >> 3) ^ (c & 7)) << 3) + (kj & 7)] = (u16)(w >> (16 * (r & 1)));
        }
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The first row of step t's query tile in the fused kernel's walk: each query head's run of
// n_tiles steps takes the block's query tiles from the last to the first. Causal masking and
// windows give later key blocks later first and last tiles; walking down, key block n + 1
// reaches a tile no sooner than key block n, whose add it waits for, so no block waits on its
// predecessor step after step (walking up, each later block reached each tile two steps before
// its predecessor and was held to its pace: the lightest blocks of a head ran as long as the
// heaviest, 0.81-0.85x the two-kernel backward at S1024 causal). Without masking every block
// walks the same tiles in lockstep either way.
__device__ __forceinline__ long long step_row0(long long i_first, int n_tiles, int t, int rows) {
    return i_first + (long long)(n_tiles - 1 - t % n_tiles) * rows;
}

// The float2 index of fragment pair (n-tile nd, half hr: rows g or g + 8) of computing thread wt
// (0-127) in a staged or accumulated dQ tile: [DT x 2 pairs][128 threads] float2, so a warp's 32
// lanes store 256 contiguous bytes (no bank conflict) and the tile is one contiguous bulk add.
// Row 16 (wt / 32) + (wt % 32) / 4 + 8 hr, columns 8 nd + 2 (wt % 4) + {0, 1}.
__device__ __forceinline__ int dq_pair_index(int nd, int hr, int wt) { return (2 * nd + hr) * 128 + wt; }
// The float offset in a tile of row r (0 .. BQ - 1), columns [d, d + 8) (d a multiple of 8):
// 8 contiguous floats, the pairs of the row's four lanes wt .. wt + 3.
__device__ __forceinline__ int dq_tile_offset(int r, int d) {
    return 2 * dq_pair_index(d >> 3, (r >> 3) & 1, 32 * (r >> 4) + 4 * (r & 7));
}

// (computing warpgroup wg, its turn) Stage its dQ_part (accumulator layout: 16 rows a warp, DT
// n-tiles) in its buffer `staged` once the writer has read the buffer's previous use (`use`:
// this warpgroup's stagings so far), and announce it on `full`. Every thread of the warpgroup
// calls it.
template <int DT>
__device__ __forceinline__ void stage_dq(float* staged, u64* full, u64* empty, u32 use,
                                         const float (&dq)[DT][4]) {
    if (use > 0) mbar_wait(empty, (use - 1) & 1);
    const int wt = threadIdx.x & 127;
    float2* out = reinterpret_cast<float2*>(staged);
#pragma unroll
    for (int nd = 0; nd < DT; ++nd)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
            out[dq_pair_index(nd, hr, wt)] = make_float2(dq[nd][2 * hr], dq[nd][2 * hr + 1]);
    fence_proxy_async();  // these stores, to the bulk copy's (async proxy) view
    mbar_arrive(full);
}

// (the dQ writer warp) Every step's staged dQ_part, in step order: wait for its staging, for its
// turn in the tile's order, add it into dq_accum with one bulk reduction, hand the buffer back
// once read, count the add once complete. Lane 0 issues; the warp waits together.
template <int BK, int BQ, int DP, int GROUPS>
__device__ __forceinline__ void write_dq_in_order(const AttnShape& s, float* dq_accum, u32* dq_sem,
                                                  const float* staged, u64* full, u64* empty,
                                                  u32 b, u32 hk, u32 group, u32 key_block,
                                                  long long i_first, int n_tiles, int steps) {
    constexpr u32 TILE_BYTES = BQ * DP * 4;
    const u64 q_tiles = (s.frame_q + BQ - 1) / BQ;
    const bool lead = (threadIdx.x & 31) == 0;
    u32 uses[GROUPS] = {};
    for (int t = 0; t < steps; ++t) {
        const long long i0 = step_row0(i_first, n_tiles, t, BQ);
        if (i0 >= s.seq_q) continue;  // (the computing warpgroups stage nothing there either)
        const int buf = t % GROUPS;
        u32 use = 0;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) use = g == buf ? uses[g]++ : use;
        mbar_wait(&full[buf], use & 1);
        if (lead) {
            const u32 bh = b * s.heads + hk * group + (u32)(t / n_tiles);
            const u64 tile = (u64)bh * q_tiles + (u64)(i0 / BQ);
            const u32 rank = key_block - first_key_block<BK>(s, i0, key_block);
            while (load_acquire(dq_sem + tile) != rank) __nanosleep(32);
            asm volatile("fence.proxy.async.global;" ::: "memory");  // the earlier adds, seen by ours
            asm volatile(
                "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                "cp.async.bulk.commit_group;\n"
                "cp.async.bulk.wait_group.read 0;" ::"l"(dq_accum + tile * (BQ * DP)),
                "r"(smem_u32(staged + buf * (BQ * DP))), "r"(TILE_BYTES)
                : "memory");
            mbar_arrive(&empty[buf]);  // read: the warpgroup may stage its next partial
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds performed
            asm volatile("fence.proxy.async.global;" ::: "memory");
            __threadfence();
            atomicAdd(dq_sem + tile, 1u);
        }
        __syncwarp();
    }
}
