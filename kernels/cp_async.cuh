// Asynchronous copies from device memory into shared memory (cp.async, compute capability 8.0+), for the
// tiles a kernel loads while it computes on the previous ones:
//   cp_async16(dst, src, n)  copies the first n (0 or 16) of 16 bytes, zero-filling the rest (dst in
//                            shared memory, both 16-byte aligned);
//   cp_async16_at(dst, ..)   the same to the shared-memory address dst (__cvta_generic_to_shared's);
//   cp_async_commit()        closes this thread's group of copies issued since the last commit;
//   cp_async_wait<N>()       waits until at most the N newest of this thread's groups are pending.
// A thread sees its own completed copies; other threads' after a __syncthreads that follows their wait.
// Under the host emulator (GRPO_CUDA_EMU) the destination turns to NaN bytes when the copy is issued and
// gets its data when a wait retires the copy's group: a tile read before its wait, or refilled while
// another warp still reads it, holds NaNs there (where the device would read stale or torn data).
#pragma once

#include <stdint.h>

#ifdef GRPO_CUDA_EMU
inline void cp_async16(void *dst, const void *src, uint32_t n) {
    std::memset(dst, 0xff, 16);  // in flight: undefined (NaN in bf16, f16 and f32) until its wait
    emu::async_copy_issued(dst);
    emu::tls.async_open.push_back(emu::AsyncCopy{(unsigned char *)dst, (const unsigned char *)src, n});
}
inline void cp_async16_at(uint32_t dst, const void *src, uint32_t n) {
    cp_async16((unsigned char *)emu::dynamic_shared() + dst, src, n);
}
inline void cp_async_commit() {
    emu::tls.async_groups.push_back(std::move(emu::tls.async_open));
    emu::tls.async_open.clear();
}
template <int N> inline void cp_async_wait() { emu::retire_async_copies(N); }
#else
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void *src, uint32_t n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src, uint32_t n) {
    cp_async16_at((uint32_t)__cvta_generic_to_shared(dst), src, n);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif
