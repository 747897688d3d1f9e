// Embedding lookup and its gradient summed in f32 (src/kernels/embedding.rs has the CPU reference).
// With weight W [V, H] and token ids [N]:
//   emb_fwd_<T>:   y[n, :] = W[ids[n], :]  (an id outside the vocabulary gives a NaN row, not a read);
//   emb_zero_f32:  dw = 0, the f32 accumulator of the backward;
//   emb_bwd_<T>:   dw[ids[n], :] += g[n, :] with f32 atomics (an id outside the vocabulary adds nothing):
//                  a token seen thousands of times is summed in f32, not rounded to T after each row.
// Grid-stride loops over elements; one thread per element.

#include "common.cuh"

template <typename T>
__device__ void emb_fwd(const T *__restrict__ w, const uint32_t *__restrict__ ids, T *__restrict__ y,
                        uint32_t n, uint32_t v, uint32_t h) {
    const size_t total = (size_t)n * h;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        const uint32_t id = ids[k / h];
        y[k] = id < v ? w[(size_t)id * h + k % h] : from_f32<T>(__int_as_float(0x7fc00000));
    }
}

template <typename T>
__device__ void emb_bwd(const uint32_t *__restrict__ ids, const T *__restrict__ g, float *__restrict__ dw,
                        uint32_t n, uint32_t v, uint32_t h) {
    const size_t total = (size_t)n * h;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        const uint32_t id = ids[k / h];
        if (id < v) atomicAdd(&dw[(size_t)id * h + k % h], to_f32(g[k]));
    }
}

extern "C" __global__ void emb_zero_f32(float *dw, uint32_t len_lo, uint32_t len_hi) {
    const size_t len = ((size_t)len_hi << 32) | len_lo;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < len; k += (size_t)gridDim.x * blockDim.x) {
        dw[k] = 0.f;
    }
}

#define EMB_KERNELS(NAME, T)                                                                                \
    extern "C" __global__ void emb_fwd_##NAME(const T *w, const uint32_t *ids, T *y, uint32_t n, uint32_t v, \
                                              uint32_t h) {                                                 \
        emb_fwd<T>(w, ids, y, n, v, h);                                                                     \
    }                                                                                                       \
    extern "C" __global__ void emb_bwd_##NAME(const uint32_t *ids, const T *g, float *dw, uint32_t n,       \
                                              uint32_t v, uint32_t h) {                                     \
        emb_bwd<T>(ids, g, dw, n, v, h);                                                                    \
    }

EMB_KERNELS(f32, float)
EMB_KERNELS(bf16, __nv_bfloat16)
EMB_KERNELS(f16, __half)
