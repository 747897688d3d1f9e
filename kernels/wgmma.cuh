// Hopper's warpgroup-wide asynchronous matrix multiply-accumulate (wgmma.mma_async, PTX ISA 8.0, sm_90a
// only): D[64, N] (+)= A[64, 16] B[16, N], bf16 or f16 in, f32 accumulators, by the 128 threads of a
// warpgroup (four consecutive warps, the first a multiple of 4). A comes from registers (wgmma_rs: warp w
// of the warpgroup holds rows 16 w.. 16 w + 15 in the layout of mma.sync's A fragment, mma.cuh) or from
// shared memory (wgmma_ss; K-major or, with TA = 1, MN-major), B from shared memory, each described by a matrix descriptor. The accumulators
// of warp w, lane (g = lane / 4, c = lane % 4) (PTX ISA, "Register Fragments ... wgmma .m64nNk16"):
//   d[j][0], d[j][1] = D[16 w + g][8 j + 2 c], D[16 w + g][8 j + 2 c + 1]
//   d[j][2], d[j][3] = D[16 w + g + 8][8 j + 2 c], D[16 w + g + 8][8 j + 2 c + 1]
// the layout of mma.sync's accumulators, one n-tile of 8 per j.
//
// Shared tiles are in the 128-byte swizzle: a part of R rows x 64 16-bit values (128 bytes a row, from a
// 1024-byte aligned address) holds element (r, x) at byte 128 r + 16 ((x / 8) ^ (r % 8)) + 2 (x % 8): the
// hardware XORs address bits 4-6 with bits 7-9. A tile with wider rows is parts of 64 columns one after
// the other. A descriptor (64 bits): start address >> 4 in bits 0-13, leading-dimension byte offset (LBO)
// >> 4 in 16-29, stride-dimension byte offset (SBO) >> 4 in 32-45, base offset 0 in 49-51, layout 1
// (128-byte swizzle) in 62-63 (cute's GmmaDescriptor). An operand, its rows mn and its 16 k, is read
//   K-major (the k along a part's columns; trans 0): (mn, k) at start + SBO (mn / 8) + 128 (mn % 8) + 2 k,
//     SBO = 1024, LBO unused (16 by convention: "assumed to be 1"); start = the part + 128 mn0 + 32 (k0 % 64) / 16: a product's k0 picks the part and
//     moves the start within its first row (the XOR then finds the swizzled columns);
//   MN-major (the k along the rows, the mn along the columns; trans 1): (mn, k) at start +
//     LBO (mn / 64) + 2 (mn % 64) + 128 (k % 8) + SBO (k / 8), LBO = the bytes of a part, SBO = 1024;
//     start = the tile + 128 k0;
// then the swizzle (cute's canonical GMMA layouts, Swizzle<3,4,3> o ((8,m),(T,2)):((8T,SBO),(1,T)) K-major
// and ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) MN-major, T = 8 values).
//
// Order of a product (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   writes to the operand tiles by cp.async or st.shared, then fence.proxy.async (wg_fence_proxy) by the
//   writing threads, then a barrier;
//   wg_begin(accs...): wgmma.fence, after which no register of the accumulators or of an A fragment is
//   touched until wg_end<N>(accs...) (wgmma.commit_group, wgmma.wait_group N) has retired the products; wg_keep(frags)
//   after it keeps the compiler from reusing the A fragments' registers before. wg_commit() closes a group
//   and wg_wait<N>(accs...) waits until at most N groups are pending, so that a thread can compute on one
//   group's accumulators (named in the wait) while the next group's products run.
// Under the host emulator (GRPO_CUDA_EMU) each wgmma is recorded when issued (A's registers gathered from
// the warp) and performed, shared operands read through the descriptors, when a wait retires its group:
// accumulators read before the wait hold their old values, a tile refilled before it the new ones; a
// wgmma on accumulators no wgmma.fence since the last wait named (wg_begin), or written after it, or
// reading cp.async writes still in flight or with no fence.proxy.async after them, is reported; so are
// its accumulators or A registers written before the wait that retires it.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

// Descriptor of an operand starting at `p` (shared memory), 128-byte swizzle, LBO `lbo` bytes (16 for a
// K-major operand), SBO 1024 bytes.
__device__ __forceinline__ uint64_t wg_desc(const void *p, uint32_t lbo) {
    const uint64_t start = ((uint32_t)__cvta_generic_to_shared(p) & 0x3ffffu) >> 4;
    return start | ((uint64_t)((lbo & 0x3ffffu) >> 4) << 16) | ((uint64_t)(1024u >> 4) << 32) | (1ull << 62);
}

// The descriptor d of an operand at p, moved to p + `elements` 16-bit values (a multiple of 8; both inside
// the 256 KiB shared window): its start address field is the address's bits 4-17, so the sum never carries
// out of it. One add where wg_desc is a conversion, a mask and a shift: a step's products take their
// descriptors from one per tile.
__device__ __forceinline__ uint64_t wg_desc_at(uint64_t d, uint32_t elements) { return d + elements / 8; }

// This thread's warpgroup (threadIdx.x / 128), broadcast from lane 0 so that the compiler knows it is the
// same in every lane of the warp (CUTLASS's canonical_warp_group_idx): what it derives (tile addresses,
// descriptors, barrier ids) stays in uniform registers, with no R2UR a product.
__device__ __forceinline__ uint32_t wg_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

// The element offset of (r, x) in a swizzled tile of 64-column parts of R rows each (16-bit values).
template <int R> __device__ __forceinline__ uint32_t wg_at(uint32_t r, uint32_t x) {
    return (x / 64) * R * 64 + r * 64 + (((x % 64) / 8) ^ (r % 8)) * 8 + x % 8;
}

#ifdef GRPO_CUDA_EMU
inline void wg_fence_proxy() { emu::fence_async_proxy(); }

template <typename... A> inline void wg_begin(A &...d) {
    (emu::tls.wg_fenced.emplace_back(&d[0][0], std::vector<float>(&d[0][0], &d[0][0] + sizeof(d) / sizeof(float))),
     ...);
}
template <int K> inline void wg_keep(uint32_t (&)[K][4]) {}

inline void wg_commit() {
    emu::tls.wg_groups.push_back(std::move(emu::tls.wg_open));
    emu::tls.wg_open.clear();
}
template <int P, typename... A> inline void wg_wait(A &...) { emu::retire_wgmma(P); }
template <int P, typename... A> inline void wg_end(A &...d) {
    wg_commit();
    wg_wait<P>(d...);
}

namespace emu {
inline void wg_issue(WgOp op) {
    if (tls.block_dim.x * tls.block_dim.y * tls.block_dim.z % 128 != 0) report("wgmma in a block of partial warpgroups");
    const auto fenced = std::find_if(tls.wg_fenced.begin(), tls.wg_fenced.end(), [&](const auto &f) { return f.first == op.d; });
    if (fenced == tls.wg_fenced.end()) {
        report("a wgmma on accumulators no wgmma.fence since the last wait named");
    } else if (std::memcmp(fenced->second.data(), op.d, op.n / 2 * sizeof(float)) != 0) {
        report("a wgmma on accumulators written after their wgmma.fence");
    }
    check_async_proxy(op);
    std::memcpy(op.d_issued, op.d, op.n / 2 * sizeof(float));
    if (op.a_regs) std::memcpy(op.a_issued, op.a_src, sizeof op.a_issued);
    tls.wg_open.push_back(op);
}
}  // namespace emu

template <typename T, int N, int TB>
inline void wgmma_rs(float (&d)[N / 8][4], const uint32_t a[4], uint64_t b, int scale_d) {
    uint32_t all[32][emu::WARP_GATHER_WORDS];
    emu::warp_gather(0xffffffffu, a, 4, all);
    const uint32_t g = (emu::tls.tid % 32) / 4;
    emu::WgOp op{&d[0][0], N, emu::ElemOf<T>::v, true, {}, 0, b, 0, TB, scale_d, {}, a, {}};
    // A[r][k]: lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2 (mma.cuh).
    for (uint32_t r = 0; r < 2; ++r)
        for (uint32_t k = 0; k < 16; ++k) op.a[r][k] = half_of<T>(all[g * 4 + (k % 8) / 2][r + 2 * (k >= 8)], k % 2);
    emu::wg_issue(op);
}

template <typename T, int N, int TA = 0, int TB = 0>
inline void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int scale_d) {
    emu::wg_issue(emu::WgOp{&d[0][0], N, emu::ElemOf<T>::v, false, {}, a, b, TA, TB, scale_d, {}, nullptr, {}});
}
#else
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of the accumulators across the asynchronous product.
template <int N> __device__ __forceinline__ void wg_fence_acc(float (&d)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

template <typename... A> __device__ __forceinline__ void wg_begin(A &...d) {
    (wg_fence_acc(d), ...);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int P, typename... A> __device__ __forceinline__ void wg_wait(A &...d) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(P) : "memory");
    (wg_fence_acc(d), ...);
}

template <int P, typename... A> __device__ __forceinline__ void wg_end(A &...d) {
    wg_commit();
    wg_wait<P>(d...);
}

// Keeps A fragments' registers alive (unchanged) until here: after the wg_end that retires their products.
template <int K> __device__ __forceinline__ void wg_keep(uint32_t (&a)[K][4]) {
#pragma unroll
    for (int j = 0; j < K; ++j)
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[j][i])::"memory");
}

#define WG_ACC8(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WG_ACC64 WG_ACC8(0), WG_ACC8(1), WG_ACC8(2), WG_ACC8(3), WG_ACC8(4), WG_ACC8(5), WG_ACC8(6), WG_ACC8(7)
#define WG_ACC128 WG_ACC64, WG_ACC8(8), WG_ACC8(9), WG_ACC8(10), WG_ACC8(11), WG_ACC8(12), WG_ACC8(13), WG_ACC8(14), WG_ACC8(15)
#define WG_D32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_D64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// One wgmma with A in registers: shape m64n<N>k16, type <TY>, accumulator registers <DREGS> (operands 0..),
// then A's 4 registers <AREGS>, B's descriptor <B>, scale-d <S> and the trans-b immediate TB <TBOP>.
#define WG_RS(N, TY, DREGS, AREGS, B, S, TBOP, ACC)                                                        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N         \
                 "k16.f32." TY "." TY " " DREGS ", " AREGS ", %" B ", p, 1, 1, %" TBOP ";\n}\n"              \
                 : ACC                                                                                       \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB));

template <typename T, int N, int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t a[4], uint64_t b, int scale_d) {
    static_assert(N == 64 || N == 128, "wgmma_rs: m64n64k16 or m64n128k16");
    constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
    if constexpr (N == 64 && BF16) {
        WG_RS(64, "bf16", WG_D32, "{%32, %33, %34, %35}", "36", "37", "38", WG_ACC64)
    } else if constexpr (N == 64) {
        WG_RS(64, "f16", WG_D32, "{%32, %33, %34, %35}", "36", "37", "38", WG_ACC64)
    } else if constexpr (BF16) {
        WG_RS(128, "bf16", WG_D64, "{%64, %65, %66, %67}", "68", "69", "70", WG_ACC128)
    } else {
        WG_RS(128, "f16", WG_D64, "{%64, %65, %66, %67}", "68", "69", "70", WG_ACC128)
    }
}

// One wgmma with A and B from descriptors: m64n64k16, trans-a TA and trans-b TB immediates (1: MN-major).
#define WG_SS64(TY)                                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TY \
                 "." TY " " WG_D32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"                                 \
                 : WG_ACC64                                                                               \
                 : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));

template <typename T, int N, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int scale_d) {
    static_assert(N == 64, "wgmma_ss: m64n64k16 only");
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        WG_SS64("bf16")
    } else {
        WG_SS64("f16")
    }
}
#endif
