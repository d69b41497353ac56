// Rotate-half RoPE in place, float32, float16 or bfloat16 (FERRO_ROPE_DTYPE 0, 1, 2, from
// cuda/configs.py). One thread per (token, pair index i): the angle depends only on the position
// and i, so it is computed once (to the bit of the NumPy reference: float32 inverse frequency and
// angle, accurate sincosf) and applied to every head of the token. The rotation is computed in
// float32 and rounded once to the element type.
#include "ferro_params.cuh"

#if FERRO_ROPE_DTYPE == 0
typedef float elem_t;
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }
#else
typedef u16 elem_t;
__device__ __forceinline__ float load1(const u16* p) {
#if FERRO_ROPE_DTYPE == 2
    return __uint_as_float((u32)*p << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
#endif
}
__device__ __forceinline__ void store1(u16* p, float x) {
    u16 h;
#if FERRO_ROPE_DTYPE == 2
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
    *p = h;
}
#endif

extern "C" __global__ void __launch_bounds__(256)
rope(elem_t* __restrict__ x, const u64 tokens, const RopeParams p) {
    const u32 half = p.head_dim / 2;
    const u64 items = tokens * half;
    const u64 token_stride = (u64)p.heads * p.head_dim;
    for (u64 item = (u64)blockIdx.x * blockDim.x + threadIdx.x; item < items;
         item += (u64)gridDim.x * blockDim.x) {
        const u64 token = item / half;
        const u32 i = (u32)(item % half);
        const u32 t = p.pos + (u32)(token % p.seq_len);
        // inv_i = 1 / theta^(2i/D) and angle = t * inv_i, each rounded to float32 as Hugging Face
        // computes them (pow in double, then rounded, so host and device agree to the bit).
        const float e = (float)(2 * i) / (float)p.head_dim;
        const float inv = 1.0f / (float)pow((double)p.theta, (double)e);
        const float angle = (float)t * inv;
        float sn, cs;
        sincosf(angle, &sn, &cs);
        elem_t* row = x + token * token_stride + i;
        u32 h = 0;
        for (; h + 4 <= p.heads; h += 4) {  // four heads' loads in flight before the stores
            float a[4], b[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                a[u] = load1(row + (u64)(h + u) * p.head_dim);
                b[u] = load1(row + (u64)(h + u) * p.head_dim + half);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                store1(row + (u64)(h + u) * p.head_dim, a[u] * cs - b[u] * sn);
                store1(row + (u64)(h + u) * p.head_dim + half, b[u] * cs + a[u] * sn);
            }
        }
        for (; h < p.heads; ++h) {
            const float a = load1(row + (u64)h * p.head_dim), b = load1(row + (u64)h * p.head_dim + half);
            store1(row + (u64)h * p.head_dim, a * cs - b * sn);
            store1(row + (u64)h * p.head_dim + half, b * cs + a * sn);
        }
    }
}
