// The MLP's gated activation silu(gate) * up in one pass, and its backward in one (src/kernels/swiglu.rs
// has the CPU implementation), rounded where PyTorch's bf16 ops round (silu in f32, then each product):
//   swiglu_fwd_<T>: s = T(g sig), y = T(s * u), sig = 1 / (1 + exp(-g))
//   swiglu_bwd_<T>: ds = T(dy * u), dg = T(ds * sig (1 + g (1 - sig))), du = T(dy * s);
//                   dg in out[0, n), du in out[n, 2n).
// One thread per element, grid-stride.

#include "common.cuh"

template <typename T>
__device__ void swiglu_fwd(const T *__restrict__ g, const T *__restrict__ u, T *__restrict__ y, uint32_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float x = to_f32(g[i]);
        const float s = to_f32(from_f32<T>(x * (1.f / (1.f + expf(-x)))));
        y[i] = from_f32<T>(s * to_f32(u[i]));
    }
}

template <typename T>
__device__ void swiglu_bwd(const T *__restrict__ g, const T *__restrict__ u, const T *__restrict__ dy,
                           T *__restrict__ out, uint32_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float x = to_f32(g[i]), d = to_f32(dy[i]);
        const float sig = 1.f / (1.f + expf(-x));
        const float s = to_f32(from_f32<T>(x * sig));
        const float ds = to_f32(from_f32<T>(d * to_f32(u[i])));
        out[i] = from_f32<T>(ds * (sig * (1.f + x * (1.f - sig))));
        out[(size_t)n + i] = from_f32<T>(d * s);
    }
}

#define SWIGLU_KERNELS(NAME, T)                                                                            \
    extern "C" __global__ void swiglu_fwd_##NAME(const T *g, const T *u, T *y, uint32_t n) {               \
        swiglu_fwd<T>(g, u, y, n);                                                                         \
    }                                                                                                      \
    extern "C" __global__ void swiglu_bwd_##NAME(const T *g, const T *u, const T *dy, T *out, uint32_t n) { \
        swiglu_bwd<T>(g, u, dy, out, n);                                                                   \
    }

SWIGLU_KERNELS(f32, float)
SWIGLU_KERNELS(bf16, __nv_bfloat16)
SWIGLU_KERNELS(f16, __half)
