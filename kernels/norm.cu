// RMSNorm of rows with its weight (src/kernels/norm.rs has the CPU implementation), as Llama/Qwen compute it
// (transformers' LlamaRMSNorm): xhat = x r in f32, r = 1 / sqrt(mean(x^2) + eps), rounded to the storage
// type, then times the weight in the storage type:
//   rms_norm_fwd_<T>: y = T(T(xhat) w)
//   rms_norm_bwd_<T>: per row, dyh = T(g w) (the product's gradient, rounded as the composite rounds it),
//                     dx = T(r (dyh - xhat mean(dyh xhat))); and each block's partial of the weight's
//                     gradient, sum over its rows of g T(xhat), in f32 into partial[block, :]
//   rms_norm_dw_<T>:  dw = T(sum of the partials, in block order): the same sum on every run
// fwd: one block per row. bwd: a block per `rows_per_block` consecutive rows, the partial sums of the
// block in dynamic shared memory (after the reductions' 32 floats: 32 + h floats), each column's owned by one thread (j = threadIdx.x + k
// blockDim.x), so no two threads touch one. dw: a thread per column. f32 accumulation; blockDim.x a
// multiple of 32, at most 1024.

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
__device__ void norm_fwd(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y, uint32_t h, float eps) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * (size_t)h;
    T *yr = y + row * (size_t)h;
    const float r = row_rsqrt(xr, h, eps, shared);
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
        yr[j] = from_f32<T>(to_f32(from_f32<T>(to_f32(xr[j]) * r)) * to_f32(w[j]));
    }
}

template <typename T>
__device__ void norm_bwd(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ g,
                         T *__restrict__ dx, float *__restrict__ partial, uint32_t rows, uint32_t h,
                         uint32_t rows_per_block, float eps) {
    extern __shared__ float smem[];  // the block reductions' 32 floats, then h partials
    float *shared = smem, *acc = smem + 32;
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) acc[j] = 0.f;
    const size_t first = (size_t)blockIdx.x * rows_per_block;
    const size_t last = min((size_t)rows, first + rows_per_block);
    for (size_t row = first; row < last; ++row) {
        const T *xr = x + row * (size_t)h;
        const T *gr = g + row * (size_t)h;
        T *dr = dx + row * (size_t)h;
        const float r = row_rsqrt(xr, h, eps, shared);
        float dot = 0.f;
        for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float dyh = to_f32(from_f32<T>(to_f32(gr[j]) * to_f32(w[j])));
            dot += dyh * to_f32(xr[j]) * r;
        }
        dot = block_reduce<false>(dot, shared) / (float)h;
        for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float xv = to_f32(xr[j]);
            const float dyh = to_f32(from_f32<T>(to_f32(gr[j]) * to_f32(w[j])));
            dr[j] = from_f32<T>(r * (dyh - xv * r * dot));
            acc[j] += to_f32(gr[j]) * to_f32(from_f32<T>(xv * r));
        }
    }
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) partial[(size_t)blockIdx.x * h + j] = acc[j];
}

template <typename T>
__device__ void norm_dw(const float *__restrict__ partial, T *__restrict__ dw, uint32_t h, uint32_t blocks) {
    const uint32_t j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= h) return;
    float s = 0.f;
    for (uint32_t b = 0; b < blocks; ++b) s += partial[(size_t)b * h + j];
    dw[j] = from_f32<T>(s);
}

#define NORM_KERNELS(NAME, T)                                                                                  \
    extern "C" __global__ void rms_norm_fwd_##NAME(const T *x, const T *w, T *y, uint32_t h, float eps) {      \
        norm_fwd<T>(x, w, y, h, eps);                                                                          \
    }                                                                                                          \
    extern "C" __global__ void rms_norm_bwd_##NAME(const T *x, const T *w, const T *g, T *dx, float *partial,  \
                                                   uint32_t rows, uint32_t h, uint32_t rows_per_block,         \
                                                   float eps) {                                                \
        norm_bwd<T>(x, w, g, dx, partial, rows, h, rows_per_block, eps);                                       \
    }                                                                                                          \
    extern "C" __global__ void rms_norm_dw_##NAME(const float *partial, T *dw, uint32_t h, uint32_t blocks) {  \
        norm_dw<T>(partial, dw, h, blocks);                                                                    \
    }

NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)
NORM_KERNELS(f16, __half)
