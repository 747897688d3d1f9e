// A host emulator of the CUDA subset kernels/*.cu use (docs/cuda-emulator.md).
//
// Force-included (g++ -include cuda_emu.h) before a kernels/*.cu file, which then compiles unchanged as
// C++17 for the host. Each CUDA thread of a block runs on its own host thread; blocks run one after
// another in a seeded random order (runtime.cpp). What it provides:
//   - threadIdx, blockIdx, blockDim, gridDim (per host thread);
//   - __shared__ (static: one copy per launch, blocks run one at a time) and extern __shared__ (dynamic:
//     exactly the launch's bytes, the rest of the region a poisoned canary);
//   - __syncthreads and __syncthreads_{or,and,count} as barriers across the block's live threads;
//   - warp shuffles (__shfl_sync, _up, _down, _xor), votes (__ballot_sync, __any_sync, __all_sync),
//     reductions (__reduce_max_sync, __reduce_min_sync on u32),
//     __activemask, __syncwarp, all over the 32 lanes of a warp with a full mask;
//   - cp.async (cp_async.cuh) as copies deferred to the wait that retires their group;
//   - the warp-wide matrix multiply-accumulate of mma.cuh (mma.sync m16n8k16, bf16 and f16 in, f32
//     accumulators) from the fragment layouts of the PTX ISA, every lane's registers gathered at once;
//   - the warpgroup-wide asynchronous one of wgmma.cuh (wgmma.mma_async m64nNk16 with shared-memory
//     matrix descriptors in the 128-byte swizzle), deferred to the wait that retires its group, and the
//     async-proxy fence its shared-memory operands need after cp.async writes them;
//   - atomics (atomicAdd, atomicSub, atomicMax, atomicMin, atomicExch, atomicCAS) on host atomics;
//   - __nv_bfloat16 and __half with round-to-nearest-even conversions;
//   - the math functions and intrinsics the kernels call (expf, __expf, rsqrtf, fmaxf, fmaf, ...).
#pragma once

// Kernels and headers test this to choose the emulator's spelling of what has no host equivalent
// (the inline PTX of mma.cuh).
#define GRPO_CUDA_EMU 1

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static const
#define __align__(n) alignas(n)

namespace emu {

struct dim3 {
    uint32_t x = 1, y = 1, z = 1;
};

// One asynchronous copy (cp_async.cuh): 16 bytes to dst, the first n of them from src, the rest zero.
struct AsyncCopy {
    unsigned char *dst;
    const unsigned char *src;
    uint32_t n;
};

// One wgmma.mma_async of a thread (wgmma.cuh): its accumulators d (n / 8 x 4), performed when a wait
// retires its group. A is the thread's two rows (16 w + g, + 8) gathered from its warp's registers at the
// issue (a_regs), or read through a_desc at the retirement, as B is through b_desc. The thread's
// accumulators and A registers as they were at the issue (d_issued, a_src / a_issued): the wait that
// retires the product reports them written in between (undefined on the device).
struct WgOp {
    float *d;
    uint32_t n, elem;  // elem: E_BF16 or E_F16
    bool a_regs;
    float a[2][16];
    uint64_t a_desc, b_desc;
    int trans_a, trans_b, scale_d;  // trans_a: A (from a_desc) MN-major
    float d_issued[64];
    const uint32_t *a_src;
    uint32_t a_issued[4];
};

// The launch state of the calling host thread (set by runtime.cpp).
struct ThreadState {
    dim3 thread_idx, block_idx, block_dim, grid_dim;
    uint32_t tid = 0;   // linear thread index in the block
    uint32_t warp_ops = 0;  // warp-collective operations done in this block (double-buffer parity)
    std::vector<AsyncCopy> async_open;  // copies issued since the last commit
    std::vector<std::vector<AsyncCopy>> async_groups;  // committed groups, oldest first, not yet waited for
    std::vector<uint32_t> unfenced;  // 16-byte chunks of dynamic shared memory its retired copies wrote, not fenced since
    // The accumulators each wgmma.fence since the last wgmma wait named, with their values at the fence.
    std::vector<std::pair<float *, std::vector<float>>> wg_fenced;
    std::vector<WgOp> wg_open;    // wgmma issued since the last commit
    std::vector<std::vector<WgOp>> wg_groups;  // committed wgmma groups, oldest first
};
extern thread_local ThreadState tls;

// Performs this thread's oldest committed groups of copies until at most `pending` remain.
void retire_async_copies(int pending);
// A cp.async into dst issued (its chunk in flight until its group retires).
void async_copy_issued(const void *dst);
// fence.proxy.async: this thread's retired copies become visible to the async proxy (wgmma's operands).
void fence_async_proxy();
// Reports a wgmma whose shared operands hold bytes a thread's copies are still writing, or wrote with no
// fence.proxy.async by that thread since.
void check_async_proxy(const WgOp &op);
// Performs this thread's oldest committed groups of wgmma until at most `pending` remain.
void retire_wgmma(int pending);
// The offset of p in the launch's dynamic shared memory (__cvta_generic_to_shared; reported if outside).
uint32_t shared_offset(const void *p);

// Barriers and warp collectives (runtime.cpp).
int sync_block(int kind, int pred);  // kind: 0 plain, 1 or, 2 and, 3 count
// Named barriers 1..15 (barrier.cuh): bar.sync (wait) or bar.arrive for `count` threads.
constexpr uint32_t NAMED_BARRIERS = 16;
void named_barrier(uint32_t id, uint32_t count, bool wait);
void sync_warp(uint32_t mask);
uint64_t warp_exchange(uint32_t mask, uint64_t value, int src_lane, int mode, int width);
uint32_t warp_vote(uint32_t mask, int pred);
// Every lane's first n (<= WARP_GATHER_WORDS) registers of `mine`, as all[lane][i], for the warp-wide
// matrix instructions (mma.h): one barrier of the warp.
constexpr uint32_t WARP_GATHER_WORDS = 8;
void warp_gather(uint32_t mask, const uint32_t *mine, uint32_t n, uint32_t (*all)[WARP_GATHER_WORDS]);
void report(const char *what);
// The launch's dynamic shared memory (exactly its bytes; build.rs spells `extern __shared__ T name[];`
// as `T *name = (T *)emu::dynamic_shared();`, since C++ has no block-scope extern static).
void *dynamic_shared();

}  // namespace emu

#define threadIdx (emu::tls.thread_idx)
#define blockIdx (emu::tls.block_idx)
#define blockDim (emu::tls.block_dim)
#define gridDim (emu::tls.grid_dim)
#define warpSize 32
using emu::dim3;

// ---------------------------------------------------------------- barriers, warps, votes
inline void __syncthreads() { emu::sync_block(0, 0); }
inline int __syncthreads_or(int p) { return emu::sync_block(1, p); }
inline int __syncthreads_and(int p) { return emu::sync_block(2, p); }
inline int __syncthreads_count(int p) { return emu::sync_block(3, p); }
inline void __syncwarp(uint32_t mask = 0xffffffffu) { emu::sync_warp(mask); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline size_t __cvta_generic_to_shared(const void *p) { return emu::shared_offset(p); }

namespace emu {
template <typename T>
inline T shuffle(uint32_t mask, T v, int src, int mode, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type over 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = warp_exchange(mask, bits, src, mode, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace emu

template <typename T> inline T __shfl_sync(uint32_t m, T v, int src, int w = 32) { return emu::shuffle(m, v, src, 0, w); }
template <typename T> inline T __shfl_up_sync(uint32_t m, T v, unsigned d, int w = 32) { return emu::shuffle(m, v, (int)d, 1, w); }
template <typename T> inline T __shfl_down_sync(uint32_t m, T v, unsigned d, int w = 32) { return emu::shuffle(m, v, (int)d, 2, w); }
template <typename T> inline T __shfl_xor_sync(uint32_t m, T v, int lm, int w = 32) { return emu::shuffle(m, v, lm, 3, w); }
inline uint32_t __ballot_sync(uint32_t m, int p) { return emu::warp_vote(m, p); }
namespace emu {
// The max or min of v over the warp's 32 lanes (the full mask only), every lane gets it.
inline uint32_t warp_reduce(uint32_t m, uint32_t v, bool max) {
    if (m != 0xffffffffu) report("a warp reduction over part of the warp");
    uint32_t all[32][WARP_GATHER_WORDS];
    warp_gather(m, &v, 1, all);
    uint32_t r = all[0][0];
    for (int i = 1; i < 32; ++i) r = max ? std::max(r, all[i][0]) : std::min(r, all[i][0]);
    return r;
}
}  // namespace emu
inline uint32_t __reduce_max_sync(uint32_t m, uint32_t v) { return emu::warp_reduce(m, v, true); }
inline uint32_t __reduce_min_sync(uint32_t m, uint32_t v) { return emu::warp_reduce(m, v, false); }
inline int __any_sync(uint32_t m, int p) { return emu::warp_vote(m, p) != 0; }
inline int __all_sync(uint32_t m, int p) { return emu::warp_vote(m, p) == m; }
inline uint32_t __activemask() { return 0xffffffffu; }

// ---------------------------------------------------------------- atomics
namespace emu {
template <typename T, typename F>
inline T atomic_update(T *p, F f) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4- or 8-byte values");
    using U = typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type;
    U *up = reinterpret_cast<U *>(p);
    U old = __atomic_load_n(up, __ATOMIC_RELAXED);
    for (;;) {
        T o, n;
        std::memcpy(&o, &old, sizeof(T));
        n = f(o);
        U nb;
        std::memcpy(&nb, &n, sizeof(T));
        if (__atomic_compare_exchange_n(up, &old, nb, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return o;
    }
}
}  // namespace emu
template <typename T> inline T atomicAdd(T *p, T v) { return emu::atomic_update(p, [v](T o) { return o + v; }); }
template <typename T> inline T atomicSub(T *p, T v) { return emu::atomic_update(p, [v](T o) { return o - v; }); }
template <typename T> inline T atomicMax(T *p, T v) { return emu::atomic_update(p, [v](T o) { return o < v ? v : o; }); }
template <typename T> inline T atomicMin(T *p, T v) { return emu::atomic_update(p, [v](T o) { return v < o ? v : o; }); }
template <typename T> inline T atomicExch(T *p, T v) { return emu::atomic_update(p, [v](T) { return v; }); }
template <typename T> inline T atomicCAS(T *p, T cmp, T v) {
    return emu::atomic_update(p, [cmp, v](T o) { return o == cmp ? v : o; });
}

// ---------------------------------------------------------------- bf16 and f16
struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    uint16_t bits;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __half half;

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t u = (uint32_t)h.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {  // round to nearest even; NaN stays a quiet NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline float __half2float(__half h) {
    _Float16 x;
    std::memcpy(&x, &h.bits, 2);
    return (float)x;
}
inline __half __float2half(float f) {  // the compiler's conversion rounds to nearest even
    const _Float16 x = (_Float16)f;
    __half h;
    std::memcpy(&h.bits, &x, 2);
    return h;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline __half __float2half_rn(float f) { return __float2half(f); }

// ---------------------------------------------------------------- math
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Correctly rounded single operations (nvcc never contracts them into an fma; the host compiler does not
// contract without -ffp-contract=fast and an FMA target).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline double __longlong_as_double(long long x) {
    double d;
    std::memcpy(&d, &x, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long x;
    std::memcpy(&x, &d, 8);
    return x;
}
inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline int __float_as_int(float f) {
    int x;
    std::memcpy(&x, &f, 4);
    return x;
}
inline uint32_t __float_as_uint(float f) { return (uint32_t)__float_as_int(f); }
inline float __uint_as_float(uint32_t x) { return __int_as_float((int)x); }
template <typename A, typename B>
inline typename std::common_type<A, B>::type min(A a, B b) {
    return b < a ? b : a;
}
template <typename A, typename B>
inline typename std::common_type<A, B>::type max(A a, B b) {
    return a < b ? b : a;
}

// ---------------------------------------------------------------- kernel registry
namespace emu {

// Argument kinds and element types, as src/kernels/emu.rs passes them.
enum Kind : uint32_t { PTR = 0, U32 = 1, I32 = 2, F32 = 3, U64 = 4 };
enum Elem : uint32_t { E_NONE = 0, E_F32 = 1, E_BF16 = 2, E_F16 = 3, E_U32 = 4 };

struct Arg {
    uint32_t kind;
    uint32_t elem;  // element type of a pointer
    uint64_t size;  // bytes of the argument as passed
    const void *value;  // the argument's bytes (for a pointer: where the pointer is)
};

template <typename T> struct ElemOf { static constexpr uint32_t v = E_NONE; };
template <> struct ElemOf<float> { static constexpr uint32_t v = E_F32; };
template <> struct ElemOf<__nv_bfloat16> { static constexpr uint32_t v = E_BF16; };
template <> struct ElemOf<__half> { static constexpr uint32_t v = E_F16; };
template <> struct ElemOf<uint32_t> { static constexpr uint32_t v = E_U32; };

template <typename P> struct ParamOf;
template <typename T> struct ParamOf<T *> {
    static constexpr uint32_t kind = PTR, elem = ElemOf<typename std::remove_cv<T>::type>::v;
};
template <> struct ParamOf<uint32_t> { static constexpr uint32_t kind = U32, elem = E_NONE; };
template <> struct ParamOf<int32_t> { static constexpr uint32_t kind = I32, elem = E_NONE; };
template <> struct ParamOf<float> { static constexpr uint32_t kind = F32, elem = E_NONE; };
template <> struct ParamOf<uint64_t> { static constexpr uint32_t kind = U64, elem = E_NONE; };

// Checks argument `i` against parameter type P; writes the mismatch to err (false) otherwise.
bool check_arg(const char *kernel, size_t i, const Arg &a, uint32_t kind, uint32_t elem, size_t size, char *err,
               size_t errlen);

// Runs body() once per CUDA thread of each block of the grid (runtime.cpp).
typedef void (*Body)(const void *ctx);
// `max_shared`: the dynamic shared memory the kernel may have (48 KiB unless it opts in to more).
bool run_grid(const char *kernel, dim3 grid, dim3 block, uint32_t shared, uint32_t max_shared, uint64_t seed, Body body,
              const void *ctx, char *err, size_t errlen);

// One kernel of a .cu file: its name and its launcher.
typedef bool (*Launcher)(const char *name, dim3 grid, dim3 block, uint32_t shared, uint32_t max_shared,
                         const Arg *args, size_t n, uint64_t seed, char *err, size_t errlen);
struct Entry {
    const char *name;
    Launcher launch;
};

// The launcher of kernel F: checks each argument against F's parameter types, then runs the grid.
template <typename Sig, Sig F> struct Bound;
template <typename... P, void (*F)(P...)> struct Bound<void (*)(P...), F> {
    template <size_t... I> static void call(const Arg *a, std::index_sequence<I...>) {
        F(*static_cast<const P *>(a[I].value)...);
    }
    static bool launch(const char *name, dim3 grid, dim3 block, uint32_t shared, uint32_t max_shared, const Arg *args,
                       size_t n, uint64_t seed, char *err, size_t errlen) {
        if (n != sizeof...(P)) {
            snprintf(err, errlen, "%s takes %zu arguments, the launch passes %zu", name, sizeof...(P), n);
            return false;
        }
        size_t i = 0;
        bool ok = true;
        ((ok = ok && check_arg(name, i, args[i], ParamOf<P>::kind, ParamOf<P>::elem, sizeof(P), err, errlen), ++i),
         ...);
        if (!ok) return false;
        auto body = [](const void *c) { call(static_cast<const Arg *>(c), std::index_sequence_for<P...>{}); };
        return run_grid(name, grid, block, shared, max_shared, seed, body, args, err, errlen);
    }
};

}  // namespace emu

#define EMU_KERNEL(name) emu::Entry{#name, &emu::Bound<decltype(&name), &name>::launch}
