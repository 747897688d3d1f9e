// Each row's dot product of two matrices of the same shape, in f32 (src/kernels/row_dot.rs has the CPU
// implementation): the attention backward's delta = rowsum(dO O), which candle's composite casts, product
// and sum computed through three f32 tensors of the inputs' size.
//   row_dot_<T>: out[r] = sum over c < d of f32(a[r d + c]) f32(b[r d + c]), r < rows
// A group of G lanes per row (G a power of two up to 32, at least d's runs / 32): each lane adds the
// products of its runs of V elements (16 bytes where both pointers are 16-byte aligned and d a multiple
// of them, else one element), in order, then the group's lanes add theirs by shuffles. Grid-stride over
// row groups; rows past the last add nothing but take part in the shuffles.

#include "common.cuh"

template <typename T, int V>
__device__ void row_dot_runs(const T *__restrict__ a, const T *__restrict__ b, float *__restrict__ out, uint32_t rows,
                             uint32_t d, uint32_t g) {
    const uint32_t runs = d / V, lane = threadIdx.x % g;
    const uint32_t groups = (gridDim.x * blockDim.x) / g;
    // every lane of a warp runs the same number of iterations (blockDim.x a multiple of 32, g of 32's
    // divisors), so that the shuffles see the whole warp
    const uint32_t rounds = (rows + groups - 1) / groups;
    for (uint32_t k = 0, r = (blockIdx.x * blockDim.x + threadIdx.x) / g; k < rounds; ++k, r += groups) {
        float s = 0.f;
        if (r < rows) {
            for (uint32_t i = lane; i < runs; i += g) {
                const uint32_t at = r * d + i * V;
                const Run<T, V> x = load_run<T, V>(a, at), y = load_run<T, V>(b, at);
#pragma unroll
                for (int j = 0; j < V; ++j) s = fmaf(to_f32(x.v[j]), to_f32(y.v[j]), s);
            }
        }
        for (uint32_t off = g / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (r < rows && lane == 0) out[r] = s;
    }
}

#define ROW_DOT_KERNELS(NAME, T)                                                                           \
    extern "C" __global__ void row_dot_##NAME(const T *a, const T *b, float *out, uint32_t rows, uint32_t d, \
                                              uint32_t g) {                                                \
        if (d % Pack<T>::N == 0 && aligned16(a) && aligned16(b))                                           \
            row_dot_runs<T, Pack<T>::N>(a, b, out, rows, d, g);                                            \
        else                                                                                               \
            row_dot_runs<T, 1>(a, b, out, rows, d, g);                                                     \
    }

ROW_DOT_KERNELS(f32, float)
ROW_DOT_KERNELS(bf16, __nv_bfloat16)
ROW_DOT_KERNELS(f16, __half)
