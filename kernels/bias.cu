// A projection's bias added to its rows, and the bias's gradient (src/kernels/bias.rs has the CPU
// implementation):
//   bias_add_<T>:      y[r, c] = T(x[r, c] + b[c]) over rows x cols, in 16-byte packs where the pointers
//                      and the row width allow (common.cuh), one element at a time otherwise; grid-stride.
//   bias_partial_<T>:  per block of `rows_per_block` consecutive rows, partial[block, c] = sum of g[r, c] in
//                      f32 over the rows in order, a thread per 16-byte pack of columns (consecutive threads,
//                      consecutive packs; a thread per column where the row width or the pointer does not
//                      allow packs).
//   bias_sum_<T>:      db[c] = T(sum over the blocks' partials in block order): the same sum on every run.

#include "common.cuh"

template <typename T>
__device__ void bias_add(const T *__restrict__ x, const T *__restrict__ b, T *__restrict__ y, uint32_t rows,
                         uint32_t cols) {
    constexpr int N = Pack<T>::N;
    const size_t n = (size_t)rows * cols;
    const bool vectors = cols % N == 0 && aligned16(x) && aligned16(b) && aligned16(y);
    packed_loop<T>(
        n, vectors,
        [&](size_t p) {
            const Pack<T> xp = load_pack(x, p), bp = load_pack(b, (uint32_t)(p % (cols / N)));
            Pack<T> yp;
#pragma unroll
            for (int j = 0; j < N; ++j) yp.v[j] = from_f32<T>(to_f32(xp.v[j]) + to_f32(bp.v[j]));
            store_pack(y, p, yp);
        },
        [&](size_t i) { y[i] = from_f32<T>(to_f32(x[i]) + to_f32(b[(uint32_t)(i % cols)])); });
}

template <typename T>
__device__ void bias_partial(const T *__restrict__ g, float *__restrict__ partial, uint32_t rows, uint32_t cols,
                             uint32_t rows_per_block) {
    constexpr int N = Pack<T>::N;
    const size_t first = (size_t)blockIdx.x * rows_per_block;
    const size_t last = min((size_t)rows, first + rows_per_block);
    float *out = partial + (size_t)blockIdx.x * cols;
    if (cols % N == 0 && aligned16(g)) {
        // A thread per pack of N columns: each column's rows in the same order as one at a time.
        const uint32_t packs = cols / N;
        for (uint32_t u = blockIdx.y * blockDim.x + threadIdx.x; u < packs; u += gridDim.y * blockDim.x) {
            float s[N] = {};
            for (size_t r = first; r < last; ++r) {
                const Pack<T> p = load_pack(g, r * packs + u);
#pragma unroll
                for (int j = 0; j < N; ++j) s[j] += to_f32(p.v[j]);
            }
#pragma unroll
            for (int j = 0; j < N; ++j) out[u * N + j] = s[j];
        }
        return;
    }
    for (uint32_t c = blockIdx.y * blockDim.x + threadIdx.x; c < cols; c += gridDim.y * blockDim.x) {
        float s = 0.f;
        for (size_t r = first; r < last; ++r) s += to_f32(g[r * cols + c]);
        out[c] = s;
    }
}

#define BIAS_KERNELS(NAME, T)                                                                               \
    extern "C" __global__ void bias_add_##NAME(const T *x, const T *b, T *y, uint32_t rows, uint32_t cols) { \
        bias_add<T>(x, b, y, rows, cols);                                                                   \
    }                                                                                                       \
    extern "C" __global__ void bias_partial_##NAME(const T *g, float *partial, uint32_t rows, uint32_t cols, \
                                                   uint32_t rows_per_block) {                               \
        bias_partial<T>(g, partial, rows, cols, rows_per_block);                                            \
    }                                                                                                       \
    extern "C" __global__ void bias_sum_##NAME(const float *partial, T *db, uint32_t cols, uint32_t blocks) { \
        sum_partials<T>(partial, db, cols, blocks);                                                         \
    }

BIAS_KERNELS(f32, float)
BIAS_KERNELS(bf16, __nv_bfloat16)
BIAS_KERNELS(f16, __half)
