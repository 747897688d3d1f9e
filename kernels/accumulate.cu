// Gradient accumulation in place (src/kernels/accumulate.rs has the CPU implementation): a micro-batch's
// gradient, in any float dtype, added into its parameter's f32 accumulator, acc[i] += f32(g[...]), i = r
// cols + c:
//   accumulate_<T>:   g contiguous; 4 elements a thread and access (acc 16 bytes, g 4 elements) where both
//                     pointers allow, one otherwise; grid-stride.
//   accumulate_t_<T>: g a transposed 2-D view of a contiguous [cols, rows] buffer (a weight's gradient as
//                     candle's product backward leaves it): element (r, c) at g[c rows + r]. Each block
//                     moves a 32 x 32 tile through shared memory, reading g along its rows and
//                     updating acc along its own, both coalesced; block (32, 8), grid (row tiles, column
//                     tiles).

#include "common.cuh"

template <typename T>
__device__ void accumulate(float *__restrict__ acc, const T *__restrict__ g, uint32_t n) {
    const bool vectors = aligned16(acc) && ((uintptr_t)g & (4 * sizeof(T) - 1)) == 0;
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    const size_t fours = vectors ? n / 4 : 0;
    for (size_t p = first; p < fours; p += stride) {
        const Run<T, 4> gp = reinterpret_cast<const Run<T, 4> *>(g)[p];
        Run<float, 4> a = reinterpret_cast<const Run<float, 4> *>(acc)[p];
#pragma unroll
        for (int j = 0; j < 4; ++j) a.v[j] += to_f32(gp.v[j]);
        reinterpret_cast<Run<float, 4> *>(acc)[p] = a;
    }
    for (size_t i = fours * 4 + first; i < n; i += stride) acc[i] += to_f32(g[i]);
}

template <typename T>
__device__ void accumulate_t(float *__restrict__ acc, const T *__restrict__ g, uint32_t rows, uint32_t cols) {
    __shared__ float tile[32][33];  // [c][r], padded against bank conflicts
    const uint32_t r0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    // Read g[c, r0 + tx] for the tile's columns c: consecutive threads, consecutive addresses.
    for (uint32_t k = ty; k < 32; k += 8) {
        const uint32_t r = r0 + tx, c = c0 + k;
        if (r < rows && c < cols) tile[k][tx] = to_f32(g[(size_t)c * rows + r]);
    }
    __syncthreads();
    // Add into acc[r, c0 + tx] for the tile's rows r.
    for (uint32_t k = ty; k < 32; k += 8) {
        const uint32_t r = r0 + k, c = c0 + tx;
        if (r < rows && c < cols) acc[(size_t)r * cols + c] += tile[tx][k];
    }
}

#define ACCUMULATE_KERNELS(NAME, T)                                                                          \
    extern "C" __global__ void accumulate_##NAME(float *acc, const T *g, uint32_t n) {                       \
        accumulate<T>(acc, g, n);                                                                            \
    }                                                                                                        \
    extern "C" __global__ void accumulate_t_##NAME(float *acc, const T *g, uint32_t rows, uint32_t cols) {   \
        accumulate_t<T>(acc, g, rows, cols);                                                                 \
    }

ACCUMULATE_KERNELS(f32, float)
ACCUMULATE_KERNELS(bf16, __nv_bfloat16)
ACCUMULATE_KERNELS(f16, __half)
