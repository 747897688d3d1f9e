// The element-wise steps of a LoRA projection (src/kernels/lora.rs has the CPU implementation and the op
// around them; the products are cuBLAS GEMMs):
//   lora_input_<T>:   out = f32(x) * keep(i) * keep_scale            (f32; the adapters' input, dropout)
//   lora_combine_<T>: y = T(f32(base) + scale * delta * keep(i) * keep_scale)
// keep(i) is the dropout mask of element i: the high 32 bits of splitmix64(seed + (i + 1) * golden) at
// least `threshold` (round(p 2^32)); threshold 0 keeps every element. Forward: the input with the mask,
// then the base output plus the scaled adapter product (threshold 0). Backward: the gradient scaled
// (threshold 0, keep_scale = alpha / r), and the input's gradient from the base's plus the adapters'
// masked. Each product is rounded on its own (__fmul_rn, __fadd_rn: no contraction into fma), in the
// order of the composite ops. Grid-stride, 16 bytes of T a thread and access where every pointer is 16-byte
// aligned (common.cuh's packs: 8 bf16/f16 or 4 f32 elements, their f32 values moved as 16-byte runs of 4),
// one element at a time otherwise and for the tail.

#include "common.cuh"

__device__ __forceinline__ bool lora_keep(size_t i, uint32_t threshold, uint32_t seed_lo, uint32_t seed_hi) {
    if (threshold == 0) return true;
    uint64_t z = (((uint64_t)seed_hi << 32) | seed_lo) + ((uint64_t)i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32) >= threshold;
}

// The adapters' input of element i (x's value xv).
template <typename T>
__device__ __forceinline__ float lora_input_one(T xv, size_t i, uint32_t threshold, float keep_scale, uint32_t seed_lo,
                                                uint32_t seed_hi) {
    return lora_keep(i, threshold, seed_lo, seed_hi) ? __fmul_rn(to_f32(xv), keep_scale) : 0.f;
}

// The sum of element i (base's value bv, delta's dv).
template <typename T>
__device__ __forceinline__ T lora_combine_one(T bv, float dv, size_t i, float scale, uint32_t threshold, float keep_scale,
                                              uint32_t seed_lo, uint32_t seed_hi) {
    const float d = lora_keep(i, threshold, seed_lo, seed_hi) ? __fmul_rn(dv, keep_scale) : 0.f;
    return from_f32<T>(__fadd_rn(to_f32(bv), __fmul_rn(d, scale)));
}

// The f32 values of pack p of T's elements: Pack<T>::N floats as runs of 4 (16 bytes each).
template <typename T> using F32Runs = Run<float, 4>[Pack<T>::N / 4];

template <typename T>
__device__ void lora_input(const T *__restrict__ x, float *__restrict__ out, uint32_t n, uint32_t threshold,
                           float keep_scale, uint32_t seed_lo, uint32_t seed_hi) {
    constexpr int N = Pack<T>::N;
    packed_loop<T>(
        n, aligned16(x) && aligned16(out),
        [&](size_t p) {
            const Pack<T> xp = load_pack(x, p);
            F32Runs<T> o;
#pragma unroll
            for (int j = 0; j < N; ++j)
                o[j / 4].v[j % 4] = lora_input_one(xp.v[j], p * N + j, threshold, keep_scale, seed_lo, seed_hi);
#pragma unroll
            for (int r = 0; r < N / 4; ++r) reinterpret_cast<Run<float, 4> *>(out)[p * (N / 4) + r] = o[r];
        },
        [&](size_t i) { out[i] = lora_input_one(x[i], i, threshold, keep_scale, seed_lo, seed_hi); });
}

template <typename T>
__device__ void lora_combine(const T *__restrict__ base, const float *__restrict__ delta, T *__restrict__ y,
                             uint32_t n, float scale, uint32_t threshold, float keep_scale, uint32_t seed_lo,
                             uint32_t seed_hi) {
    constexpr int N = Pack<T>::N;
    packed_loop<T>(
        n, aligned16(base) && aligned16(delta) && aligned16(y),
        [&](size_t p) {
            const Pack<T> bp = load_pack(base, p);
            F32Runs<T> d;
#pragma unroll
            for (int r = 0; r < N / 4; ++r) d[r] = reinterpret_cast<const Run<float, 4> *>(delta)[p * (N / 4) + r];
            Pack<T> yp;
#pragma unroll
            for (int j = 0; j < N; ++j)
                yp.v[j] = lora_combine_one(bp.v[j], d[j / 4].v[j % 4], p * N + j, scale, threshold, keep_scale, seed_lo,
                                           seed_hi);
            store_pack(y, p, yp);
        },
        [&](size_t i) {
            y[i] = lora_combine_one(base[i], delta[i], i, scale, threshold, keep_scale, seed_lo, seed_hi);
        });
}

#define LORA_KERNELS(NAME, T)                                                                                  \
    extern "C" __global__ void lora_input_##NAME(const T *x, float *out, uint32_t n, uint32_t threshold,        \
                                                 float keep_scale, uint32_t seed_lo, uint32_t seed_hi) {        \
        lora_input<T>(x, out, n, threshold, keep_scale, seed_lo, seed_hi);                                     \
    }                                                                                                          \
    extern "C" __global__ void lora_combine_##NAME(const T *base, const float *delta, T *y, uint32_t n,         \
                                                   float scale, uint32_t threshold, float keep_scale,           \
                                                   uint32_t seed_lo, uint32_t seed_hi) {                        \
        lora_combine<T>(base, delta, y, n, scale, threshold, keep_scale, seed_lo, seed_hi);                    \
    }

LORA_KERNELS(f32, float)
LORA_KERNELS(bf16, __nv_bfloat16)
LORA_KERNELS(f16, __half)
