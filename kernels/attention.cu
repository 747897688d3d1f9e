// Masked, scaled softmax of attention scores (src/kernels/attention.rs has the CPU reference).
//
// Scores are [B, H, T, S] rows of length S; the query at (b, i) may attend to keys lo..=hi, given by
// ranges[(b * T + i) * 2 ..] = (lo, hi). Outside the range the probability is exactly 0.
//   attn_softmax_fwd_<T>: y = softmax_{lo..hi}(scale * x)
//   attn_softmax_bwd_<T>: dx = scale * y * (g - sum_j g_j y_j)  (0 outside the range)
// One block per row; f32 accumulation; blockDim.x a multiple of 32, at most 1024.

#include "common.cuh"

__device__ __forceinline__ void row_range(const uint32_t *ranges, size_t row, uint32_t heads, uint32_t t, uint32_t s,
                                          uint32_t &lo, uint32_t &hi) {
    const size_t b = row / ((size_t)heads * t);
    const size_t i = row % t;
    lo = ranges[(b * t + i) * 2];
    hi = ranges[(b * t + i) * 2 + 1];
    if (hi >= s) hi = s - 1;
}

template <typename T>
__device__ void softmax_fwd(const T *__restrict__ x, const uint32_t *__restrict__ ranges, T *__restrict__ y,
                            uint32_t heads, uint32_t t, uint32_t s, float scale) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    uint32_t lo, hi;
    row_range(ranges, row, heads, t, s, lo, hi);
    const T *xr = x + row * (size_t)s;
    T *yr = y + row * (size_t)s;
    float m = -INFINITY;
    for (uint32_t j = lo + threadIdx.x; j <= hi; j += blockDim.x) m = fmaxf(m, scale * to_f32(xr[j]));
    m = block_reduce<true>(m, shared);
    float sum = 0.f;
    for (uint32_t j = lo + threadIdx.x; j <= hi; j += blockDim.x) sum += expf(scale * to_f32(xr[j]) - m);
    sum = block_reduce<false>(sum, shared);
    const float inv = 1.f / sum;
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x) {
        const float p = (j >= lo && j <= hi) ? expf(scale * to_f32(xr[j]) - m) * inv : 0.f;
        yr[j] = from_f32<T>(p);
    }
}

template <typename T>
__device__ void softmax_bwd(const T *__restrict__ y, const T *__restrict__ g, const uint32_t *__restrict__ ranges,
                            T *__restrict__ dx, uint32_t heads, uint32_t t, uint32_t s, float scale) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    uint32_t lo, hi;
    row_range(ranges, row, heads, t, s, lo, hi);
    const T *yr = y + row * (size_t)s;
    const T *gr = g + row * (size_t)s;
    T *dr = dx + row * (size_t)s;
    float dot = 0.f;
    for (uint32_t j = lo + threadIdx.x; j <= hi; j += blockDim.x) dot += to_f32(gr[j]) * to_f32(yr[j]);
    dot = block_reduce<false>(dot, shared);
    for (uint32_t j = threadIdx.x; j < s; j += blockDim.x) {
        const float d = (j >= lo && j <= hi) ? scale * to_f32(yr[j]) * (to_f32(gr[j]) - dot) : 0.f;
        dr[j] = from_f32<T>(d);
    }
}

#define ATTN_KERNELS(NAME, T)                                                                                  \
    extern "C" __global__ void attn_softmax_fwd_##NAME(const T *x, const uint32_t *ranges, T *y, uint32_t heads, \
                                                       uint32_t t, uint32_t s, float scale) {                  \
        softmax_fwd<T>(x, ranges, y, heads, t, s, scale);                                                      \
    }                                                                                                          \
    extern "C" __global__ void attn_softmax_bwd_##NAME(const T *y, const T *g, const uint32_t *ranges, T *dx,   \
                                                       uint32_t heads, uint32_t t, uint32_t s, float scale) {  \
        softmax_bwd<T>(y, g, ranges, dx, heads, t, s, scale);                                                  \
    }

ATTN_KERNELS(f32, float)
ATTN_KERNELS(bf16, __nv_bfloat16)
ATTN_KERNELS(f16, __half)
