// RoPE from x into out (out == x: in place), float32, float16 or bfloat16 (FERRO_ROPE_DTYPE 0, 1,
// 2), FERRO_ROPE_VEC elements per global access (16 bytes where every address and stride allows,
// else 4 bytes or one element: cuda/configs.py's rope_vector). One pass: each element is read
// once and written once.
//
// A thread takes one (token, group of heads, lane). Rotation lane l reads two vectors of each
// head, at i0 = l*VEC and at r/2 + i0 (r = rotary_dim): in a warp, consecutive lanes read
// consecutive 16 bytes. Rotate-half pairs them element by element (frequencies i0 + k);
// interleaved pairs neighbours within each vector (frequencies i0/2 + k and (r/2 + i0)/2 + k),
// except with one element per access, where lane l reads the pair x[2l], x[2l+1]. The lane forms
// its VEC angles once (float32 inverse frequencies from the host, computed by the NumPy reference
// itself; angle = f32(t) * inv in float32; sincosf in full precision) and rotates them in every
// head of its group, HU heads' loads in flight at a time. Out of place, further lanes copy the
// features past rotary_dim, two vectors each (c and c + copy lanes: each load instruction of a
// warp reads contiguous bytes), so a copying lane moves as many bytes as a rotating one and the
// (token, head group) items stay few. Rotations run in float32, rounded once to the element type.
#include "ferro_params.cuh"

#ifndef FERRO_ROPE_DTYPE
#error "FERRO_ROPE_DTYPE must be defined (0 float32, 1 float16, 2 bfloat16)"
#endif
#ifndef FERRO_ROPE_VEC
#error "FERRO_ROPE_VEC must be defined (elements per global access)"
#endif

#if FERRO_ROPE_DTYPE == 0
typedef float elem_t;
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float from_f32(float v) { return v; }
#else
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 v) {
#if FERRO_ROPE_DTYPE == 2
    return __uint_as_float((u32)v << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#endif
}
__device__ __forceinline__ u16 from_f32(float x) {
    u16 h;
#if FERRO_ROPE_DTYPE == 2
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
    return h;
}
#endif

constexpr int VEC = FERRO_ROPE_VEC;
constexpr int VEC_BYTES = VEC * (int)sizeof(elem_t);
constexpr u32 HU = 4;  // heads whose loads are issued before their stores

template <int BYTES> struct RawOf;
template <> struct RawOf<16> { typedef uint4 type; };
template <> struct RawOf<8> { typedef uint2 type; };
template <> struct RawOf<4> { typedef u32 type; };
template <> struct RawOf<2> { typedef u16 type; };
typedef typename RawOf<VEC_BYTES>::type raw_t;  // one access: VEC elements as one word
union Pack { raw_t raw; elem_t e[VEC]; };
static_assert(sizeof(Pack) == VEC_BYTES, "a Pack is one access");

__device__ __forceinline__ raw_t load_raw(const elem_t* p) {
    return *reinterpret_cast<const raw_t*>(p);
}
__device__ __forceinline__ void store_raw(elem_t* p, raw_t v) { *reinterpret_cast<raw_t*>(p) = v; }

__device__ __forceinline__ void unpack(raw_t raw, float (&f)[VEC]) {
    Pack u;
    u.raw = raw;
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = to_f32(u.e[k]);
}
__device__ __forceinline__ raw_t pack(const float (&f)[VEC]) {
    Pack u;
#pragma unroll
    for (int k = 0; k < VEC; ++k) u.e[k] = from_f32(f[k]);
    return u.raw;
}

// Rotates the VEC pairs held in (a, b) by the angles whose cos/sin are given: rotate-half pairs
// (a[k], b[k]); interleaved pairs neighbours (c[2k], c[2k+1]) of c = a ++ b (within a, then
// within b; with VEC = 1, the pair (a[0], b[0])).
template <bool INTERLEAVED>
__device__ __forceinline__ void turn(float (&a)[VEC], float (&b)[VEC], const float (&cs)[VEC],
                                     const float (&sn)[VEC]) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const int j = INTERLEAVED ? 2 * k : k;
        const int j2 = INTERLEAVED ? 2 * k + 1 : k + VEC;  // index of the pair's second in c
        float& u = j < VEC ? a[j] : b[j >= VEC ? j - VEC : 0];
        float& v = j2 < VEC ? a[j2] : b[j2 >= VEC ? j2 - VEC : 0];
        const float u0 = u, v0 = v;
        u = u0 * cs[k] - v0 * sn[k];
        v = v0 * cs[k] + u0 * sn[k];
    }
}

// Heads [h, h1) of one token: the pairs at offsets off1 and off2 of each head, rotated.
template <bool INTERLEAVED>
__device__ __forceinline__ void rotate_heads(const elem_t* xs, elem_t* os, u64 xh, u64 oh, u32 h,
                                             u32 h1, u32 off1, u32 off2, const float (&cs)[VEC],
                                             const float (&sn)[VEC]) {
    for (; h + HU <= h1; h += HU) {
        raw_t ra[HU], rb[HU];
#pragma unroll
        for (u32 u = 0; u < HU; ++u) {
            ra[u] = load_raw(xs + (h + u) * xh + off1);
            rb[u] = load_raw(xs + (h + u) * xh + off2);
        }
#pragma unroll
        for (u32 u = 0; u < HU; ++u) {
            float a[VEC], b[VEC];
            unpack(ra[u], a);
            unpack(rb[u], b);
            turn<INTERLEAVED>(a, b, cs, sn);
            store_raw(os + (h + u) * oh + off1, pack(a));
            store_raw(os + (h + u) * oh + off2, pack(b));
        }
    }
    for (; h < h1; ++h) {
        float a[VEC], b[VEC];
        unpack(load_raw(xs + h * xh + off1), a);
        unpack(load_raw(xs + h * xh + off2), b);
        turn<INTERLEAVED>(a, b, cs, sn);
        store_raw(os + h * oh + off1, pack(a));
        store_raw(os + h * oh + off2, pack(b));
    }
}

// Heads [h, h1) of one token: the VEC features at offset j1 of each head, and at j2 when `two`,
// copied as they are.
__device__ __forceinline__ void copy_heads(const elem_t* xs, elem_t* os, u64 xh, u64 oh, u32 h,
                                           u32 h1, u32 j1, u32 j2, bool two) {
    if (!two) j2 = j1;  // (the same vector twice: one load, stored twice, harmless)
    for (; h + HU <= h1; h += HU) {
        raw_t r1[HU], r2[HU];
#pragma unroll
        for (u32 u = 0; u < HU; ++u) {
            r1[u] = load_raw(xs + (h + u) * xh + j1);
            r2[u] = load_raw(xs + (h + u) * xh + j2);
        }
#pragma unroll
        for (u32 u = 0; u < HU; ++u) {
            store_raw(os + (h + u) * oh + j1, r1[u]);
            store_raw(os + (h + u) * oh + j2, r2[u]);
        }
    }
    for (; h < h1; ++h) {
        const raw_t r1 = load_raw(xs + h * xh + j1), r2 = load_raw(xs + h * xh + j2);
        store_raw(os + h * oh + j1, r1);
        store_raw(os + h * oh + j2, r2);
    }
}

// Lanes of one (token, head group): rd / 2 / VEC rotating, then (out of place) the copying ones,
// each passing two of the (head_dim - rd) / VEC vectors past rotary_dim through (backend.py's
// rope planning counts them the same way).
__device__ __forceinline__ u32 copy_vectors(const RopeParams& p, u32 rd, bool in_place) {
    return in_place ? 0 : (p.head_dim - rd) / VEC;
}

// The grid-stride loop over (token, head group, lane) items, with index arithmetic in I (32
// bits whenever the item count allows: 64-bit division costs several times more).
template <typename I>
__device__ __forceinline__ void rope_items(const elem_t* x, elem_t* out, const void* positions,
                                           const float* __restrict__ inv_freq, I items,
                                           u32 lanes, u32 rot_lanes, u32 copy_vecs,
                                           u32 head_groups, const RopeParams& p,
                                           const RopeLayout& l) {
    const u32 rd = p.rotary_dim ? p.rotary_dim : p.head_dim;
    const u32 half = rd / 2;
    const u32 per_group = (p.heads + head_groups - 1) / head_groups;
    const bool interleaved = p.flags & ROPE_INTERLEAVED;
    for (I item = (I)blockIdx.x * blockDim.x + threadIdx.x; item < items;
         item += (I)gridDim.x * blockDim.x) {
        const u32 lane = (u32)(item % lanes);
        const I rest = item / lanes;
        const u32 group = (u32)(rest % head_groups);
        const I token = rest / head_groups;
        const I b = token / p.seq_len;
        const u32 s = (u32)(token % p.seq_len);
        const elem_t* xs = x + (u64)b * l.x_b + (u64)s * l.x_s;
        elem_t* os = out + (u64)b * l.out_b + (u64)s * l.out_s;
        const u32 h0 = group * per_group;
        const u32 h1 = min(h0 + per_group, p.heads);
        if (lane >= rot_lanes) {  // out of place: features past rotary_dim pass through
            const u32 c = lane - rot_lanes, c2 = c + (lanes - rot_lanes);
            copy_heads(xs, os, l.x_h, l.out_h, h0, h1, rd + c * VEC, rd + c2 * VEC, c2 < copy_vecs);
            continue;
        }
        // The token's position, read once for all its heads.
        float t;
        if (p.flags & ROPE_POSITIONS) {
            const u64 at = (u64)b * l.positions_b + s;
            t = (p.flags & ROPE_POSITIONS_INT64) ? (float)((const long long*)positions)[at]
                                                 : (float)((const int*)positions)[at];
        } else {
            t = (float)(p.pos + s);  // the engine checked that pos + seq_len fits in 32 bits
        }
        const u32 i0 = lane * VEC;
        float cs[VEC], sn[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            // pair k of the lane's two vectors (c = a ++ b): its frequency
            const u32 f = !interleaved ? i0 + k
                        : VEC == 1     ? lane
                        : k < VEC / 2  ? i0 / 2 + k
                                       : (half + i0) / 2 + (k - VEC / 2);
            const float angle = t * inv_freq[f];  // float32, as the reference forms it
            sincosf(angle, &sn[k], &cs[k]);
            if (p.flags & ROPE_INVERSE) sn[k] = -sn[k];  // sin(-a) = -sin(a): the same bits
        }
        if (!interleaved)
            rotate_heads<false>(xs, os, l.x_h, l.out_h, h0, h1, i0, half + i0, cs, sn);
        else if (VEC == 1)  // one element per access: the pair's two elements
            rotate_heads<true>(xs, os, l.x_h, l.out_h, h0, h1, 2 * lane, 2 * lane + 1, cs, sn);
        else
            rotate_heads<true>(xs, os, l.x_h, l.out_h, h0, h1, i0, half + i0, cs, sn);
    }
}

// `x` and `out` may be one buffer (in place: each thread reads its elements before it writes
// them, and no two threads touch one element); otherwise they do not overlap.
extern "C" __global__ void __launch_bounds__(256)
rope(const elem_t* x, elem_t* out, const void* positions, const float* __restrict__ inv_freq,
     const u64 tokens, const u32 head_groups, const RopeParams p, const RopeLayout l) {
    const u32 rd = p.rotary_dim ? p.rotary_dim : p.head_dim;
    const u32 rot_lanes = rd / 2 / VEC, copy_vecs = copy_vectors(p, rd, out == x);
    const u32 lanes = rot_lanes + (copy_vecs + 1) / 2;
    const u64 items = tokens * head_groups * lanes;
    if (items + (u64)gridDim.x * blockDim.x < 0xFFFFFFFFull)
        rope_items<u32>(x, out, positions, inv_freq, (u32)items, lanes, rot_lanes, copy_vecs,
                        head_groups, p, l);
    else
        rope_items<u64>(x, out, positions, inv_freq, items, lanes, rot_lanes, copy_vecs,
                        head_groups, p, l);
}
