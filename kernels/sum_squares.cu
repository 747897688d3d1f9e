// The sum of squares of a tensor's elements, in two launches (src/kernels/sum_squares.rs has the CPU
// implementation): the gradient norm's part of each gradient, which candle's `sqr().sum_all()` computed in
// one block (its reduction runs a block per output value) after writing the squares out.
//   sum_squares_partial_<T>: partial[b] = sum of f32(x[i])^2 over block b's grid-stride elements
//   sum_squares_total:       out[0] = sum of partial[0 .. parts), in one block
// Each thread adds in f64, the block's threads in f32 (block_reduce, a fixed order): the result depends
// on the element count only, not on timing, so it is the same every run.

#include "common.cuh"

template <typename T, bool SQUARE>
__device__ void block_sum(const T *__restrict__ x, float *__restrict__ out, uint32_t n) {
    __shared__ float shared[32];
    double acc = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const double v = to_f32(x[i]);
        acc += SQUARE ? v * v : v;
    }
    const float s = block_reduce<false>((float)acc, shared);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

extern "C" __global__ void sum_squares_total(const float *partial, float *out, uint32_t parts) {
    block_sum<float, false>(partial, out, parts);
}

#define SUM_SQUARES_KERNELS(NAME, T)                                                                       \
    extern "C" __global__ void sum_squares_partial_##NAME(const T *x, float *partial, uint32_t n) {        \
        block_sum<T, true>(x, partial, n);                                                                 \
    }

SUM_SQUARES_KERNELS(f32, float)
SUM_SQUARES_KERNELS(bf16, __nv_bfloat16)
SUM_SQUARES_KERNELS(f16, __half)
