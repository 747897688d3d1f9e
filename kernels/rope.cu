// Rotary position embedding fused with the [B, T, H, D] -> [B, H, T, D] transpose (src/kernels/rope.rs
// has the CPU reference). With cos/sin [B, 1, T, D] (both halves equal) and x = (x1, x2) split at D/2:
//   rope_fwd_<T>: y = T(T(x * cos) + T(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1),
//                 rounding like transformers' bf16 ops; output [B, H, T, D].
//   rope_bwd_<T>: dx1 = g1 cos + g2 sin, dx2 = g2 cos - g1 sin (in f32); g [B, H, T, D], dx [B, T, H, D].
// One thread per (b, h, t, i < D/2).

#include "common.cuh"

// Where pair k (k < B*H*T*D/2, in [B, H, T, D/2] order) lives: its index i in the half, the start of its
// row in [B, T, H, D] and in [B, H, T, D], and the start of its cos/sin row in [B, 1, T, D].
struct RopeIndex {
    uint32_t i;
    size_t bthd, bhtd, cs;
};

__device__ __forceinline__ RopeIndex rope_index(size_t k, uint32_t t, uint32_t h, uint32_t d) {
    const uint32_t half = d / 2;
    const size_t r = k / half;
    const uint32_t ti = r % t, hi = (r / t) % h;
    const size_t bi = r / ((size_t)t * h);
    return RopeIndex{(uint32_t)(k % half), ((bi * t + ti) * h + hi) * d, r * d, (bi * t + ti) * d};
}

template <typename T>
__device__ void rope_fwd(const T *__restrict__ x, const T *__restrict__ cs, const T *__restrict__ sn,
                         T *__restrict__ y, uint32_t b, uint32_t t, uint32_t h, uint32_t d) {
    const uint32_t half = d / 2;
    const size_t total = (size_t)b * h * t * half;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        const RopeIndex ix = rope_index(k, t, h, d);
        const uint32_t i = ix.i;
        const size_t xin = ix.bthd, out = ix.bhtd, c = ix.cs;
        const float x1 = to_f32(x[xin + i]), x2 = to_f32(x[xin + half + i]);
        const float c1 = to_f32(cs[c + i]), c2 = to_f32(cs[c + half + i]);
        const float s1 = to_f32(sn[c + i]), s2 = to_f32(sn[c + half + i]);
        const float a1 = to_f32(from_f32<T>(x1 * c1)), b1 = to_f32(from_f32<T>(-x2 * s1));
        const float a2 = to_f32(from_f32<T>(x2 * c2)), b2 = to_f32(from_f32<T>(x1 * s2));
        y[out + i] = from_f32<T>(a1 + b1);
        y[out + half + i] = from_f32<T>(a2 + b2);
    }
}

template <typename T>
__device__ void rope_bwd(const T *__restrict__ g, const T *__restrict__ cs, const T *__restrict__ sn,
                         T *__restrict__ dx, uint32_t b, uint32_t t, uint32_t h, uint32_t d) {
    const uint32_t half = d / 2;
    const size_t total = (size_t)b * h * t * half;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        const RopeIndex ix = rope_index(k, t, h, d);
        const uint32_t i = ix.i;
        const size_t xin = ix.bthd, gin = ix.bhtd, c = ix.cs;
        const float g1 = to_f32(g[gin + i]), g2 = to_f32(g[gin + half + i]);
        const float c1 = to_f32(cs[c + i]), c2 = to_f32(cs[c + half + i]);
        const float s1 = to_f32(sn[c + i]), s2 = to_f32(sn[c + half + i]);
        dx[xin + i] = from_f32<T>(g1 * c1 + g2 * s2);
        dx[xin + half + i] = from_f32<T>(g2 * c2 - g1 * s1);
    }
}

#define ROPE_KERNELS(NAME, T)                                                                              \
    extern "C" __global__ void rope_fwd_##NAME(const T *x, const T *cs, const T *sn, T *y, uint32_t b,     \
                                               uint32_t t, uint32_t h, uint32_t d) {                       \
        rope_fwd<T>(x, cs, sn, y, b, t, h, d);                                                             \
    }                                                                                                      \
    extern "C" __global__ void rope_bwd_##NAME(const T *g, const T *cs, const T *sn, T *dx, uint32_t b,    \
                                               uint32_t t, uint32_t h, uint32_t d) {                       \
        rope_bwd<T>(g, cs, sn, dx, b, t, h, d);                                                            \
    }

ROPE_KERNELS(f32, float)
ROPE_KERNELS(bf16, __nv_bfloat16)
ROPE_KERNELS(f16, __half)
