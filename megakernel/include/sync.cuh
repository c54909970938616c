// Synchronisation primitives of the megakernel and the discrete finish kernel. Each names its memory order.
// Counters are monotonic uint32 in global memory, never reset between steps: a consumer waits until
// counter - target >= 0 (wrap-safe signed difference), the target being step * expected + offset.
#pragma once
#include <cuda/std/cstdint>

namespace qmk {

// Acquire load at GPU scope: later reads of this thread see every write released before the matching bump.
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed load at GPU scope: polling without ordering (followed by an acquire once the value is seen).
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release reduction at GPU scope: every write of this thread before it is visible to an acquirer that
// sees the new value. Integer adds aggregate; float atomics are never used as counters (article Part 9).
__device__ __forceinline__ void red_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Acquire load at system scope: reads a flag the host writes through mapped memory (one reader only).
__device__ __forceinline__ uint32_t ld_acquire_sys(const volatile uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release store at system scope: publishes a value (the token) to the host through mapped memory.
__device__ __forceinline__ void st_release_sys(volatile uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// Block-wide wait: thread 0 spins (relaxed polls, then one acquire), the block syncs after it.
// The acquire by thread 0 followed by __syncthreads (a CTA-scope fence) orders the block's later reads.
__device__ __forceinline__ void block_wait(const uint32_t* counter, uint32_t target) {
  if (threadIdx.x == 0) {
    while (!reached(ld_relaxed_gpu(counter), target)) { __nanosleep(32); }
    (void)ld_acquire_gpu(counter);
  }
  __syncthreads();
}

#ifndef QMK_MK_BUMP_FENCE
// 1: a __threadfence() (fence.sc.gpu) before the release reduction of block_bump. Not needed: the barrier orders
// the other threads' stores before thread 0's release (CTA scope), and release is cumulative, so the consumer's
// acquire sees them — the same argument the fence itself relied on (a fence by thread 0 orders only what thread 0
// observed). A/B: docs/megakernel.md "Sync protocol".
#define QMK_MK_BUMP_FENCE 0
#endif

// Block-wide bump: all threads' stores precede the barrier; thread 0 then releases at GPU scope through the
// reduction (cumulative: covers what the barrier ordered before it), so the consumer's acquire sees the whole
// block's output.
__device__ __forceinline__ void block_bump(uint32_t* counter, uint32_t v) {
  __syncthreads();
  if (threadIdx.x == 0) {
#if QMK_MK_BUMP_FENCE
    __threadfence();
#endif
    red_release_gpu(counter, v);
  }
}

}  // namespace qmk

namespace qmk {

// Release store at GPU scope: publishes a flag (the persistent loop's go mirror) after this thread's writes.
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Global nanosecond timer (per-instruction timing slots; same clock on every SM).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

}  // namespace qmk
