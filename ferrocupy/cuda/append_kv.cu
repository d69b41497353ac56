// The KV-cache append (SPEC "Appending to a KV cache"), launched before the attention of the
// same plan: k_new and v_new [batch, new_keys, kv_heads, head_dim] (C-contiguous) are written
// into the cache (k, v through the layout's strides; paged: row pos % page of block
// block_table[b, pos / page]) at positions pos = kv_lens[b] + t, k_new rotated first when the
// call has RoPE tables; and q is rotated into q_rot (C-contiguous [batch, seq_q, heads,
// head_dim], the attention's q then) at kv_lens[b] + i when the call is causal or windowed, else
// at kv_lens[b] (flash-attn's rule). A rotation pairs (x[i], x[i + rotary_dim/2]) (rotate-half)
// or (x[2i], x[2i+1]) (interleaved) and makes (a cos - b sin, b cos + a sin) with cos, sin from
// the tables [seqlen_ro, rotary_dim/2] (float32 or the element type) at the position, in float32,
// rounded once to the element type; features past rotary_dim pass unchanged. One thread per
// output element (a grid-stride loop): an append writes a few rows. The plan's checks hold
// before the launch: every position lies inside the cache and the tables, every block id the
// append reaches is a block of the cache.
// ferro-variants: FERRO_APPEND_DTYPE=0,1,2
#include "ferro_params.cuh"

#if FERRO_APPEND_DTYPE == 1
#define FERRO_BF16 0
#elif FERRO_APPEND_DTYPE == 2
#define FERRO_BF16 1
#endif
#include "ferro_elem.cuh"

namespace {
struct Rotary {
    const void* cos;
    const void* sin;
    u32 tables_f32, dim, half;  // dim 0: no rotation
    bool interleaved;

    __device__ __forceinline__ float table(const void* t, u64 at) const {
        return tables_f32 ? static_cast<const float*>(t)[at] : E::to_f(static_cast<const T*>(t)[at]);
    }
    // Feature d of `row` (head_dim elements) rotated to position `pos`.
    __device__ __forceinline__ float at(const T* row, int d, long long pos) const {
        if ((u32)d >= dim) return E::to_f(row[d]);
        int i, ia, ib;
        bool first;
        if (interleaved) {
            i = d >> 1, ia = 2 * i, ib = ia + 1, first = !(d & 1);
        } else {
            first = (u32)d < half;
            i = first ? d : d - (int)half, ia = i, ib = i + (int)half;
        }
        const float a = E::to_f(row[ia]), b = E::to_f(row[ib]);
        const u64 k = (u64)pos * half + i;
        const float c = table(cos, k), s = table(sin, k);
        return first ? a * c - b * s : b * c + a * s;
    }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
append_kv(const T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
          const T* __restrict__ k_new, const T* __restrict__ v_new, T* __restrict__ q_rot,
          const int* __restrict__ kv_lens, const int* __restrict__ block_table,
          const void* __restrict__ rotary_cos, const void* __restrict__ rotary_sin,
          const u32 tables_f32, const AttnLayout lay, const FlashV2Params p, const AttnExtras ex) {
    const u32 D = p.head_dim, n_new = ex.new_keys, page = ex.page_size;
    Rotary rot;
    rot.cos = rotary_cos, rot.sin = rotary_sin, rot.tables_f32 = tables_f32;
    rot.dim = (ex.flags & EXTRAS_ROTARY) ? ex.rotary_dim : 0u;
    rot.half = rot.dim / 2;
    rot.interleaved = (ex.flags & EXTRAS_ROTARY_INTERLEAVED) != 0;
    const bool paged = (ex.flags & EXTRAS_PAGED) && block_table;
    const u64 kv_items = (u64)p.batch * n_new * p.kv_heads * D;
    const u64 q_items = rot.dim ? (u64)p.batch * p.seq_q * p.heads * D : 0;
    // q row i at kv_lens[b] + i under causal or a window, else every row at kv_lens[b]
    const bool q_per_row = p.causal || ex.window_left >= 0 || ex.window_right >= 0;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < kv_items + q_items;
         idx += (u64)gridDim.x * blockDim.x) {
        if (idx < kv_items) {
            const int d = (int)(idx % D);
            const u64 r = idx / D;  // ((b * n_new + t) * kv_heads + hk)
            const u32 hk = (u32)(r % p.kv_heads), t = (u32)(r / p.kv_heads % n_new);
            const u32 b = (u32)(r / p.kv_heads / n_new);
            const long long pos = (long long)kv_lens[b] + t;
            u64 kb = (u64)b, kr = (u64)pos;
            if (paged) {
                kb = (u64)(u32)block_table[(u64)b * (p.seq_k / page) + (u64)pos / page];
                kr = (u64)pos % page;
            }
            const T* src = k_new + r * D;
            k[kb * lay.k.b + kr * lay.k.s + (u64)hk * lay.k.h + d] = E::from_f(rot.at(src, d, pos));
            v[kb * lay.v.b + kr * lay.v.s + (u64)hk * lay.v.h + d] = v_new[r * D + d];
        } else {
            const u64 e = idx - kv_items;
            const int d = (int)(e % D);
            const u64 r = e / D;  // ((b * seq_q + i) * heads + h)
            const u32 h = (u32)(r % p.heads), i = (u32)(r / p.heads % p.seq_q);
            const u32 b = (u32)(r / p.heads / p.seq_q);
            const long long pos = (long long)kv_lens[b] + (q_per_row ? i : 0u);
            const T* row = q + (u64)b * lay.q.b + (u64)i * lay.q.s + (u64)h * lay.q.h;
            q_rot[r * D + d] = E::from_f(rot.at(row, d, pos));
        }
    }
}
