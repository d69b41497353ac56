// Shared-memory barriers (mbarrier, sm_80+; try_wait needs sm_90) between the warps that load
// tiles and the warps that use them, so neither waits for the whole block. A barrier completes a
// phase when its expected number of arrivals has come; waiters name the phase by its parity.
#pragma once
#include "ferro_params.cuh"

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((u32)__cvta_generic_to_shared(bar)),
                 "r"(count) : "memory");
}
// One arrival by this thread.
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(
                     (u32)__cvta_generic_to_shared(bar)) : "memory");
}
// One arrival once every cp.async this thread has issued so far has landed (counted in the
// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                     (u32)__cvta_generic_to_shared(bar)) : "memory");
}
// A ring of STAGES buffers: `full[i]` completes when its `producers` have filled buffer i,
// `empty[i]` when its `consumers` are done with it.
template <int STAGES>
__device__ __forceinline__ void mbar_init_ring(u64 (&full)[STAGES], u64 (&empty)[STAGES],
                                               u32 producers, u32 consumers) {
    for (int i = 0; i < STAGES; ++i) {
        mbar_init(&full[i], producers);
        mbar_init(&empty[i], consumers);
    }
}
// Wait until the phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}" ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
}
// The ring's use n (0, 1, ...; any non-negative integer type) is buffer n % STAGES, filled in phase n / STAGES of its `full`
// and handed back in the same phase of its `empty`.
// Producer: before fill n, wait until use n - STAGES of the buffer has been handed back.
template <int STAGES, class I>
__device__ __forceinline__ void ring_wait_empty(u64 (&empty)[STAGES], I n) {
    if (n >= STAGES) mbar_wait(&empty[n % STAGES], ((n / STAGES) - 1) & 1);
}
// Consumer: wait until fill n has landed; hand use n back.
template <int STAGES, class I>
__device__ __forceinline__ void ring_wait_full(u64 (&full)[STAGES], I n) {
    mbar_wait(&full[n % STAGES], (n / STAGES) & 1);
}
template <int STAGES, class I>
__device__ __forceinline__ void ring_release(u64 (&empty)[STAGES], I n) {
    mbar_arrive(&empty[n % STAGES]);
}
// A consumer that skips use n still waits for it and hands it back, in order, so that every
// phase of `empty` counts each consumer once (and no arrival lands in a later phase).
template <int STAGES, class I>
__device__ __forceinline__ void ring_pass_over(u64 (&full)[STAGES], u64 (&empty)[STAGES], I n) {
    ring_wait_full(full, n);
    ring_release(empty, n);
}
// Warpgroup register budgets (sm_90a): the loading warpgroup gives registers back, the computing
// ones take them. Every warp of a warpgroup executes it.
template <int N>
__device__ __forceinline__ void regs_shrink() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_grow() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
