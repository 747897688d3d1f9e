// Helpers shared by the kernels: f32 <-> storage type conversions and a block-wide reduction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }

// The sum over a warp's 32 lanes; every lane gets it.
__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Reduce over the block with op (max or sum); every thread gets the result.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float *shared) {
    for (int off = 16; off > 0; off >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = MAX ? fmaxf(v, o) : v + o;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();  // shared may still be read from a previous reduction
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : (MAX ? -INFINITY : 0.f);
    for (int off = 16; off > 0; off >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = MAX ? fmaxf(v, o) : v + o;
    }
    return v;
}

// Element-wise kernels move 16 bytes per thread and load or store (8 bf16/f16 or 4 f32 in one vector
// access) where their pointers allow: with one 2-byte element per access a multiprocessor keeps too few
// bytes in flight to stream HBM at more than about a third of its bandwidth.
// V consecutive elements of T moved by one access (aligned to their size).
template <typename T, int V>
struct alignas(sizeof(T) * V) Run {
    static constexpr int N = V;
    T v[V];
};

// 16 bytes of T: 8 bf16/f16 or 4 f32.
template <typename T>
using Pack = Run<T, 16 / sizeof(T)>;

// The run of V elements at element `at` of p (aligned to the run's size).
template <typename T, int V>
__device__ __forceinline__ Run<T, V> load_run(const T *p, uint32_t at) {
    return *reinterpret_cast<const Run<T, V> *>(p + at);
}

template <typename T, int V>
__device__ __forceinline__ void store_run(T *p, uint32_t at, const Run<T, V> &r) {
    *reinterpret_cast<Run<T, V> *>(p + at) = r;
}

__device__ __forceinline__ bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T *p, size_t pack) {
    return reinterpret_cast<const Pack<T> *>(p)[pack];
}

template <typename T>
__device__ __forceinline__ void store_pack(T *p, size_t pack, const Pack<T> &x) {
    reinterpret_cast<Pack<T> *>(p)[pack] = x;
}

// Calls f(i) for every i < n, grid-stride, Pack<T>::N consecutive i's per call of body(pack index) where
// `vectors` (every pointer 16-byte aligned), then each element of the tail (or of all, unaligned) with
// scalar(i).
template <typename T, typename Body, typename Scalar>
__device__ __forceinline__ void packed_loop(size_t n, bool vectors, Body body, Scalar scalar) {
    constexpr int N = Pack<T>::N;
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    const size_t packs = vectors ? n / N : 0;
    for (size_t p = first; p < packs; p += stride) body(p);
    for (size_t i = packs * N + first; i < n; i += stride) scalar(i);
}

// out[c] = T(sum over blocks b of partial[b, c], in block order) for c < cols, a thread per column: the
// second half of a deterministic sum over rows (a weight's or a bias's gradient).
template <typename T>
__device__ __forceinline__ void sum_partials(const float *__restrict__ partial, T *__restrict__ out, uint32_t cols,
                                             uint32_t blocks) {
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.f;
    for (uint32_t b = 0; b < blocks; ++b) s += partial[(size_t)b * cols + c];
    out[c] = from_f32<T>(s);
}

