// RMS normalisation of rows (src/kernels/norm.rs has the CPU reference), as Llama/Qwen compute it:
//   xhat = x / sqrt(mean(x^2) + eps), in f32, then rounded to the storage type.
//   rms_norm_fwd_<T>: y = T(xhat)
//   rms_norm_bwd_<T>: dx = r * (g - xhat * mean(g * xhat)), r = 1 / sqrt(mean(x^2) + eps)
// One block per row; f32 accumulation; blockDim.x a multiple of 32, at most 1024.

#include "common.cuh"

template <typename T>
__device__ float row_rsqrt(const T *x, uint32_t h, float eps, float *shared) {
    float ss = 0.f;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
        const float v = to_f32(x[j]);
        ss += v * v;
    }
    ss = block_reduce<false>(ss, shared);
    return rsqrtf(ss / (float)h + eps);
}

template <typename T>
__device__ void norm_fwd(const T *__restrict__ x, T *__restrict__ y, uint32_t h, float eps) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * (size_t)h;
    T *yr = y + row * (size_t)h;
    const float r = row_rsqrt(xr, h, eps, shared);
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) yr[j] = from_f32<T>(to_f32(xr[j]) * r);
}

template <typename T>
__device__ void norm_bwd(const T *__restrict__ x, const T *__restrict__ g, T *__restrict__ dx, uint32_t h, float eps) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * (size_t)h;
    const T *gr = g + row * (size_t)h;
    T *dr = dx + row * (size_t)h;
    const float r = row_rsqrt(xr, h, eps, shared);
    float dot = 0.f;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) dot += to_f32(gr[j]) * to_f32(xr[j]) * r;
    dot = block_reduce<false>(dot, shared) / (float)h;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
        dr[j] = from_f32<T>(r * (to_f32(gr[j]) - to_f32(xr[j]) * r * dot));
    }
}

#define NORM_KERNELS(NAME, T)                                                                              \
    extern "C" __global__ void rms_norm_fwd_##NAME(const T *x, T *y, uint32_t h, float eps) {              \
        norm_fwd<T>(x, y, h, eps);                                                                         \
    }                                                                                                      \
    extern "C" __global__ void rms_norm_bwd_##NAME(const T *x, const T *g, T *dx, uint32_t h, float eps) { \
        norm_bwd<T>(x, g, dx, h, eps);                                                                     \
    }

NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)
NORM_KERNELS(f16, __half)
