// Dropout's generator: Philox4x32-10 (Random123 / cuRAND), counter (j>>2, i, b*H+h, 0), key
// (seed, 0); element (i, j) is dropped iff word j&3 < uint32(double(p) * 2^32). SPEC "Dropout";
// ferrocupy/reference.py draws the same bits.
#pragma once
#include "ferro_params.cuh"

struct U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 philox4x32_10(U4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// Threshold: dropped iff word < uint32(double(p) * 2^32) (truncated).
__device__ __forceinline__ u32 dropout_threshold(float p) {
    return (u32)((double)p * 4294967296.0);
}

// keep bits for keys j0 = 4*(j>>2) .. j0+3 of row i (bit n = key j0+n kept).
__device__ __forceinline__ u32 dropout_keep4(u32 seed, u32 thr, u32 bh, u32 i, u32 j) {
    U4 r = philox4x32_10(U4{j >> 2, i, bh, 0u}, seed, 0u);
    return (r.x >= thr) | ((r.y >= thr) << 1) | ((r.z >= thr) << 2) | ((r.w >= thr) << 3);
}
