// Rotary position embedding fused with the [B, T, H, D] -> [B, H, T, D] transpose (src/kernels/rope.rs
// has the CPU reference). With cos/sin [B, 1, T, D] (both halves equal) and x = (x1, x2) split at D/2:
//   rope_fwd_<T>: y = T(T(x * cos) + T(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1),
//                 rounding like transformers' bf16 ops; output [B, H, T, D].
//   rope_bwd_<T>: dx1 = g1 cos + g2 sin, dx2 = g2 cos - g1 sin (in f32); g [B, H, T, D], dx [B, T, H, D].
// One thread per V consecutive columns i of the first half (and the same of the second) of one (b, h, t),
// in [B, H, T, D/2V] order: V = 16 bytes of elements where every pointer is 16-byte aligned and D/2 a
// multiple of it (common.cuh), else 1. Grid-stride, 32-bit indices (the op checks B T H D < 2^32).

#include "common.cuh"

// Where run k lives: its first column i in the half, the start of its row in [B, T, H, D] and in
// [B, H, T, D], and the start of its cos/sin row in [B, 1, T, D].
struct RopeIndex {
    uint32_t i, bthd, bhtd, cs;
};

__device__ __forceinline__ RopeIndex rope_index(uint32_t k, uint32_t runs, uint32_t v, uint32_t t, uint32_t h,
                                                uint32_t d) {
    const uint32_t r = k / runs;  // (b h + hi) t + ti: the output row
    const uint32_t ti = r % t, hi = (r / t) % h, bi = r / (t * h);
    return RopeIndex{(k - r * runs) * v, ((bi * t + ti) * h + hi) * d, r * d, (bi * t + ti) * d};
}

template <typename T, int V>
__device__ void rope_fwd_runs(const T *__restrict__ x, const T *__restrict__ cs, const T *__restrict__ sn,
                              T *__restrict__ y, uint32_t b, uint32_t t, uint32_t h, uint32_t d) {
    const uint32_t half = d / 2, runs = half / V, total = b * h * t * runs;
    for (uint32_t k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += gridDim.x * blockDim.x) {
        const RopeIndex ix = rope_index(k, runs, V, t, h, d);
        const uint32_t xin = ix.bthd + ix.i, out = ix.bhtd + ix.i, c = ix.cs + ix.i;
        const Run<T, V> x1 = load_run<T, V>(x, xin), x2 = load_run<T, V>(x, xin + half);
        const Run<T, V> c1 = load_run<T, V>(cs, c), c2 = load_run<T, V>(cs, c + half);
        const Run<T, V> s1 = load_run<T, V>(sn, c), s2 = load_run<T, V>(sn, c + half);
        Run<T, V> y1, y2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float a = to_f32(x1.v[j]), bb = to_f32(x2.v[j]);
            const float a1 = to_f32(from_f32<T>(a * to_f32(c1.v[j]))), b1 = to_f32(from_f32<T>(-bb * to_f32(s1.v[j])));
            const float a2 = to_f32(from_f32<T>(bb * to_f32(c2.v[j]))), b2 = to_f32(from_f32<T>(a * to_f32(s2.v[j])));
            y1.v[j] = from_f32<T>(a1 + b1);
            y2.v[j] = from_f32<T>(a2 + b2);
        }
        store_run<T, V>(y, out, y1);
        store_run<T, V>(y, out + half, y2);
    }
}

template <typename T, int V>
__device__ void rope_bwd_runs(const T *__restrict__ g, const T *__restrict__ cs, const T *__restrict__ sn,
                              T *__restrict__ dx, uint32_t b, uint32_t t, uint32_t h, uint32_t d) {
    const uint32_t half = d / 2, runs = half / V, total = b * h * t * runs;
    for (uint32_t k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += gridDim.x * blockDim.x) {
        const RopeIndex ix = rope_index(k, runs, V, t, h, d);
        const uint32_t xin = ix.bthd + ix.i, gin = ix.bhtd + ix.i, c = ix.cs + ix.i;
        const Run<T, V> g1 = load_run<T, V>(g, gin), g2 = load_run<T, V>(g, gin + half);
        const Run<T, V> c1 = load_run<T, V>(cs, c), c2 = load_run<T, V>(cs, c + half);
        const Run<T, V> s1 = load_run<T, V>(sn, c), s2 = load_run<T, V>(sn, c + half);
        Run<T, V> d1, d2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float a = to_f32(g1.v[j]), bb = to_f32(g2.v[j]);
            d1.v[j] = from_f32<T>(a * to_f32(c1.v[j]) + bb * to_f32(s2.v[j]));
            d2.v[j] = from_f32<T>(bb * to_f32(c2.v[j]) - a * to_f32(s1.v[j]));
        }
        store_run<T, V>(dx, xin, d1);
        store_run<T, V>(dx, xin + half, d2);
    }
}

// Whether runs of Pack<T>::N columns apply: every pointer 16-byte aligned and the half a multiple of them.
template <typename T>
__device__ __forceinline__ bool rope_packs(const T *a, const T *cs, const T *sn, const T *out, uint32_t d) {
    return (d / 2) % Pack<T>::N == 0 && aligned16(a) && aligned16(cs) && aligned16(sn) && aligned16(out);
}

#define ROPE_KERNELS(NAME, T)                                                                              \
    extern "C" __global__ void rope_fwd_##NAME(const T *x, const T *cs, const T *sn, T *y, uint32_t b,     \
                                               uint32_t t, uint32_t h, uint32_t d) {                       \
        if (rope_packs(x, cs, sn, y, d))                                                                   \
            rope_fwd_runs<T, Pack<T>::N>(x, cs, sn, y, b, t, h, d);                                        \
        else                                                                                               \
            rope_fwd_runs<T, 1>(x, cs, sn, y, b, t, h, d);                                                 \
    }                                                                                                      \
    extern "C" __global__ void rope_bwd_##NAME(const T *g, const T *cs, const T *sn, T *dx, uint32_t b,    \
                                               uint32_t t, uint32_t h, uint32_t d) {                       \
        if (rope_packs(g, cs, sn, dx, d))                                                                  \
            rope_bwd_runs<T, Pack<T>::N>(g, cs, sn, dx, b, t, h, d);                                       \
        else                                                                                               \
            rope_bwd_runs<T, 1>(g, cs, sn, dx, b, t, h, d);                                                \
    }

ROPE_KERNELS(f32, float)
ROPE_KERNELS(bf16, __nv_bfloat16)
ROPE_KERNELS(f16, __half)
