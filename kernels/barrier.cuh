// Named barriers (PTX bar.sync / bar.arrive with a barrier id and a thread count): barrier 0 is
// __syncthreads'; ids 1..15 let groups of warps wait for each other without the whole block.
//   bar_sync(id, n)    waits until n threads (whole warps, a multiple of 32) have arrived at barrier id,
//                      this one included;
//   bar_arrive(id, n)  counts this thread's arrival and goes on (a producer's signal to threads that
//                      bar_sync on the same id).
// A completed phase orders the memory accesses every participant made before it before the accesses the
// syncing threads make after it (PTX ISA, "Memory Consistency Model": bar.arrive synchronizes with bar.sync
// on the same barrier). A thread must not arrive again before the phase it arrived in has completed: the
// device would count it into that phase. Under the host emulator (GRPO_CUDA_EMU) that, a phase's count
// changing, and a phase left incomplete when the block ends are reported.
#pragma once

#include <stdint.h>

#ifdef GRPO_CUDA_EMU
inline void bar_sync(uint32_t id, uint32_t n) { emu::named_barrier(id, n, true); }
inline void bar_arrive(uint32_t id, uint32_t n) { emu::named_barrier(id, n, false); }
#else
__device__ __forceinline__ void bar_sync(uint32_t id, uint32_t n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t id, uint32_t n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
#endif
