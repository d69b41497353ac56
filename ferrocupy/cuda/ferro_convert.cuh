// Element conversions, in one place. Kernels hold float16 / bfloat16 elements as raw 16-bit words
// (u16: no CUDA half header is needed under NVRTC) and compute in float32; FERRO_BF16 (0:
// float16, 1: bfloat16) names a half-precision build's type, and a float32 build leaves it out.
// `Elem<T>` gives the kernels written once for both (float, or the build's u16) the same calls.
#pragma once
#include "ferro_params.cuh"

// Either half type as float32, in any build: an additive mask may come in either.
__device__ __forceinline__ float bf16_to_float(u16 x) { return __uint_as_float((u32)x << 16); }
__device__ __forceinline__ float f16_to_float(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

#ifdef FERRO_BF16
// Two floats rounded (to nearest even) into one register of two 16-bit elements, lo first.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if FERRO_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ u16 round1(float x) { return (u16)(pack2(x, 0.f) & 0xffffu); }

__device__ __forceinline__ float widen(u16 x) {
#if FERRO_BF16
    return bf16_to_float(x);
#else
    return f16_to_float(x);
#endif
}
#endif

template <class T> struct Elem;

template <> struct Elem<float> {
    static constexpr int VEC = 4;  // elements in 16 bytes
    static __device__ __forceinline__ float to_f(float x) { return x; }
    static __device__ __forceinline__ float from_f(float x) { return x; }
    // 16 bytes (of shared memory) as floats, in registers.
    static __device__ __forceinline__ void load16(const float* src, float (&f)[VEC]) {
        const float4 r = *reinterpret_cast<const float4*>(src);
        f[0] = r.x, f[1] = r.y, f[2] = r.z, f[3] = r.w;
    }
};

#ifdef FERRO_BF16
template <> struct Elem<u16> {
    static constexpr int VEC = 8;
    static __device__ __forceinline__ float to_f(u16 x) { return widen(x); }
    static __device__ __forceinline__ u16 from_f(float x) { return round1(x); }
    // Both elements of a 32-bit word, low first.
    static __device__ __forceinline__ void widen2(u32 w, float& lo, float& hi) {
        lo = widen((u16)(w & 0xffffu));
        hi = widen((u16)(w >> 16));
    }
    static __device__ __forceinline__ void store2(u16* at, float x0, float x1) {
        *reinterpret_cast<u32*>(at) = pack2(x0, x1);
    }
    static __device__ __forceinline__ void load16(const u16* src, float (&f)[VEC]) {
        const uint4 r = *reinterpret_cast<const uint4*>(src);
        const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) widen2(w[c], f[2 * c], f[2 * c + 1]);
    }
};
#endif
