// The MLP's gated activation silu(gate) * up in one pass, and its backward in one (src/kernels/swiglu.rs
// has the CPU implementation), rounded where PyTorch's bf16 ops round (silu in f32, then each product):
//   swiglu_fwd_<T>: s = T(g sig), y = T(s * u), sig = 1 / (1 + exp(-g))
//   swiglu_bwd_<T>: ds = T(dy * u), dg = T(ds * sig (1 + g (1 - sig))), du = T(dy * s);
//                   dg in out[0, n), du in out[n, 2n).
// Grid-stride, 16 bytes per thread and access where the pointers are 16-byte aligned (common.cuh).

#include "common.cuh"

template <typename T>
__device__ __forceinline__ T swiglu_one(T gv, T uv) {
    const float x = to_f32(gv);
    const float s = to_f32(from_f32<T>(x * (1.f / (1.f + expf(-x)))));
    return from_f32<T>(s * to_f32(uv));
}

// (dg, du) of one element.
template <typename T>
__device__ __forceinline__ void swiglu_grad_one(T gv, T uv, T dyv, T &dg, T &du) {
    const float x = to_f32(gv), d = to_f32(dyv);
    const float sig = 1.f / (1.f + expf(-x));
    const float s = to_f32(from_f32<T>(x * sig));
    const float ds = to_f32(from_f32<T>(d * to_f32(uv)));
    dg = from_f32<T>(ds * (sig * (1.f + x * (1.f - sig))));
    du = from_f32<T>(d * s);
}

template <typename T>
__device__ void swiglu_fwd(const T *__restrict__ g, const T *__restrict__ u, T *__restrict__ y, uint32_t n) {
    const bool vectors = aligned16(g) && aligned16(u) && aligned16(y);
    packed_loop<T>(
        n, vectors,
        [&](size_t p) {
            const Pack<T> gp = load_pack(g, p), up = load_pack(u, p);
            Pack<T> yp;
#pragma unroll
            for (int j = 0; j < Pack<T>::N; ++j) yp.v[j] = swiglu_one(gp.v[j], up.v[j]);
            store_pack(y, p, yp);
        },
        [&](size_t i) { y[i] = swiglu_one(g[i], u[i]); });
}

template <typename T>
__device__ void swiglu_bwd(const T *__restrict__ g, const T *__restrict__ u, const T *__restrict__ dy,
                           T *__restrict__ out, uint32_t n) {
    T *dg = out, *du = out + n;
    const bool vectors = aligned16(g) && aligned16(u) && aligned16(dy) && aligned16(dg) && aligned16(du);
    packed_loop<T>(
        n, vectors,
        [&](size_t p) {
            const Pack<T> gp = load_pack(g, p), up = load_pack(u, p), dp = load_pack(dy, p);
            Pack<T> a, b;
#pragma unroll
            for (int j = 0; j < Pack<T>::N; ++j) swiglu_grad_one(gp.v[j], up.v[j], dp.v[j], a.v[j], b.v[j]);
            store_pack(dg, p, a);
            store_pack(du, p, b);
        },
        [&](size_t i) { swiglu_grad_one(g[i], u[i], dy[i], dg[i], du[i]); });
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
