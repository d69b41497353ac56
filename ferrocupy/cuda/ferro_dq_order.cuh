// The fused backward's dQ (flash_bwd_fused_wgmma.cu): every computing warpgroup of the dK/dV
// kernel forms, per step, the float32 partial dQ_part = dS K over its 64 keys for one query tile
// (BQ rows) of one (batch, head), and adds it into a float32 accumulator in global memory,
// dq_accum [batch * heads][q_tiles * BQ][DP], which the pre-kernel zeroes and the post-kernel
// scales and rounds into grad_q.
//
// Order. ferrocupy promises bit-identical backward runs, so the adds into one query tile happen
// in one fixed order: key block n's warpgroup 0, its warpgroup 1, ..., then key block n + 1's.
// A counter per (batch, head, query tile), dq_sem (zeroed by the pre-kernel), counts the adds
// done; the add of rank GROUPS (n - first) + w waits until the counter reads its rank. `first` is
// the first key block that visits the tile (ferro_visibility.cuh's first_key_block, from the rule
// that decides which tiles a block visits): with causal, an offset or windows it is not block 0.
// A block also visits a tile past seq_q where its rows' range is empty and starts inside one
// (visible_row_range's clamp): it adds nothing there, and has no counter to wait on.
//
// No deadlock. (1) A warpgroup waits only for adds of the same (batch, KV head)'s blocks with a
// smaller key-block index, or of a lower warpgroup of its own block. (2) block_coords
// (ferro_tiles.cuh) numbers a (batch, KV head)'s key blocks in rank order within its group of
// heads, so each block waited for has a smaller blockIdx.x. (3) The GPU dispatches a 1-D grid's
// blocks in increasing blockIdx.x (FlashAttention-3's deterministic backward relies on the
// same), so when a block starts, every block with a smaller index holds an SM or has finished:
// no count of resident blocks matters, one block an SM is enough. (4) A waiting block holds only
// its own SM; the blocks it waits for wait only for still smaller indices, never for it. So the
// least-indexed waiting warpgroup waits for adds of running blocks that are not waiting, which
// make progress; by induction every wait ends. (5) Inside a block, a warpgroup hands its ring
// slot back (ring_release) before it waits, so the loader and the other warpgroups never wait
// for a waiting warpgroup's slot, and warpgroup 0 never waits for warpgroup 1.
#pragma once
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"

// A barrier of one computing warpgroup (ids 1, 2, ...; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int id) {
    asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// dS^T's rounded A fragments (to_a_fragments of this warpgroup's 64 keys x BQ query rows) stored
// as dS, BQ rows x 64 keys, in ferro_wgmma.cuh's 128-byte-swizzled K-major layout (one column
// block), the A operand of dQ_part = dS K.
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

// Adds warpgroup w's dQ_part (accumulator layout: 16 rows a warp, DT n-tiles) of query tile
// [i0, i0 + BQ) of (batch, head) bh into dq_accum, after every add that comes before it (see
// the top of this file), then counts it done. Every thread of the warpgroup calls it.
template <int BK, int BQ, int GROUPS, int DT>
__device__ __forceinline__ void add_dq_in_order(const AttnShape& s, float* dq_accum, u32* dq_sem,
                                                u32 bh, u32 key_block, int w, long long i0,
                                                const float (&dq)[DT][4], Lane L) {
    constexpr int DP = 8 * DT;
    const u64 q_tiles = (s.seq_q + BQ - 1) / BQ;
    u32* sem = dq_sem + (u64)bh * q_tiles + (u64)(i0 / BQ);
    const u32 rank = GROUPS * (key_block - first_key_block<BK>(s, i0, key_block)) + w;
    const int wt = threadIdx.x & 127;
    if (wt == 0)
        while (load_acquire(sem) != rank) __nanosleep(32);
    warpgroup_sync(w + 1);
    float* rows = dq_accum + ((u64)bh * q_tiles * BQ + i0 + (wt >> 5) * 16 + L.g) * DP + 2 * L.t;
#pragma unroll
    for (int nd = 0; nd < DT; ++nd)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)  // reductions in L2; their order per address is fixed
            atomicAdd(reinterpret_cast<float2*>(rows + 8 * rr * DP + 8 * nd),
                      make_float2(dq[nd][2 * rr], dq[nd][2 * rr + 1]));
    __threadfence();  // this thread's adds, before the count below
    warpgroup_sync(w + 1);
    if (wt == 0) {
        __threadfence();
        atomicAdd(sem, 1u);
    }
}
