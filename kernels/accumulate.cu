// Gradient accumulation in place (src/kernels/accumulate.rs has the CPU implementation): a micro-batch's
// gradient, in any float dtype, added into its parameter's f32 accumulator,
//   accumulate_<T>: acc[i] += f32(g[r s0 + c s1]),  i = r cols + c
// where g is contiguous (one row: rows 1, s0 = cols, s1 1) or a transposed 2-D view of a contiguous buffer
// (a weight's gradient as candle's product backward leaves it: s0 1, s1 = rows), read where it lies. One
// thread per element, grid-stride.

#include "common.cuh"

template <typename T>
__device__ void accumulate(float *__restrict__ acc, const T *__restrict__ g, uint32_t rows, uint32_t cols,
                           uint32_t s0, uint32_t s1) {
    const size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i - r * cols;
        acc[i] += to_f32(g[r * s0 + c * s1]);
    }
}

#define ACCUMULATE_KERNELS(NAME, T)                                                                          \
    extern "C" __global__ void accumulate_##NAME(float *acc, const T *g, uint32_t rows, uint32_t cols,       \
                                                 uint32_t s0, uint32_t s1) {                                 \
        accumulate<T>(acc, g, rows, cols, s0, s1);                                                           \
    }

ACCUMULATE_KERNELS(f32, float)
ACCUMULATE_KERNELS(bf16, __nv_bfloat16)
ACCUMULATE_KERNELS(f16, __half)
