// The fused backward's dQ (flash_bwd_fused_wgmma.cu): per step of the dK/dV kernel (one query
// tile of BQ rows of one (batch, head)), the computing warpgroups store their dS to shared memory,
// and one of them in turn (step t: warpgroup t % GROUPS) forms the float32 partial
// dQ_part = dS K over the block's BK keys and adds it into a float32 accumulator in global
// memory, dq_accum [batch * heads][q_tiles * BQ][DP] (q_tiles over the frame's seq_q: a varlen
// sequence's rows at its (batch, head)'s first ones), which the pre-kernel zeroes and the
// post-kernel scales and rounds into grad_q. One add per (key block, query tile).
//
// Order. ferrocupy promises bit-identical backward runs, so the adds into one query tile happen
// in one fixed order: key block n's, then key block n + 1's. A counter per (batch, head, query
// tile), dq_sem (zeroed by the pre-kernel), counts the adds done; key block n's add waits until
// the counter reads n - first. `first` is
// the first key block that visits the tile (ferro_visibility.cuh's first_key_block, from the rule
// that decides which tiles a block visits): with causal, an offset or windows it is not block 0.
// A block also visits a tile past seq_q where its rows' range is empty and starts inside one
// (visible_row_range's clamp): it adds nothing there, and has no counter to wait on.
//
// No deadlock. (1) A warpgroup waits only for adds of the same (batch, KV head)'s blocks with a
// smaller key-block index. (2) block_coords
// (ferro_tiles.cuh) numbers a (batch, KV head)'s key blocks in rank order within its group of
// heads, so each block waited for has a smaller blockIdx.x. (3) The GPU dispatches a 1-D grid's
// blocks in increasing blockIdx.x (FlashAttention-3's deterministic backward relies on the
// same), so when a block starts, every block with a smaller index holds an SM or has finished:
// no count of resident blocks matters, one block an SM is enough. (4) A waiting block holds only
// its own SM; the blocks it waits for wait only for still smaller indices, never for it. So the
// least-indexed waiting warpgroup waits for adds of running blocks that are not waiting, which
// make progress; by induction every wait ends. (5) Inside a block, a warpgroup hands its ring
// slot back (ring_release) before it waits, and the other warpgroups wait for it only at the
// next step's dS barrier: nothing of the block it waits for depends on them.
#pragma once
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"

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

// Adds computing warpgroup wg's dQ_part (accumulator layout: 16 rows a warp, DT n-tiles) of
// query tile [i0, i0 + BQ) of (batch, head) bh into dq_accum, after every add that comes before
// it (see the top of this file), then counts it done. Every thread of the warpgroup calls it.
template <int BK, int BQ, int DT>
__device__ __forceinline__ void add_dq_in_order(const AttnShape& s, float* dq_accum, u32* dq_sem,
                                                u32 bh, u32 key_block, int wg, long long i0,
                                                const float (&dq)[DT][4], Lane L) {
    constexpr int DP = 8 * DT;
    const u64 q_tiles = (s.frame_q + BQ - 1) / BQ;
    u32* sem = dq_sem + (u64)bh * q_tiles + (u64)(i0 / BQ);
    const u32 rank = key_block - first_key_block<BK>(s, i0, key_block);
    const int wt = threadIdx.x & 127;
    if (wt == 0)
        while (load_acquire(sem) != rank) __nanosleep(32);
    warpgroup_sync(wg);
    float* rows = dq_accum + ((u64)bh * q_tiles * BQ + i0 + (wt >> 5) * 16 + L.g) * DP + 2 * L.t;
#pragma unroll
    for (int nd = 0; nd < DT; ++nd)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)  // reductions in L2; their order per address is fixed
            atomicAdd(reinterpret_cast<float2*>(rows + 8 * rr * DP + 8 * nd),
                      make_float2(dq[nd][2 * rr], dq[nd][2 * rr + 1]));
    __threadfence();  // this thread's adds, before the count below
    warpgroup_sync(wg);
    if (wt == 0) {
        __threadfence();
        atomicAdd(sem, 1u);
    }
}
