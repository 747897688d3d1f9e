// The element-wise steps of a LoRA projection (src/kernels/lora.rs has the CPU implementation and the op
// around them; the products are cuBLAS GEMMs):
//   lora_input_<T>:   out = f32(x) * keep(i) * keep_scale            (f32; the adapters' input, dropout)
//   lora_combine_<T>: y = T(f32(base) + scale * delta * keep(i) * keep_scale)
// keep(i) is the dropout mask of element i: the high 32 bits of splitmix64(seed + (i + 1) * golden) at
// least `threshold` (round(p 2^32)); threshold 0 keeps every element. Forward: the input with the mask,
// then the base output plus the scaled adapter product (threshold 0). Backward: the gradient scaled
// (threshold 0, keep_scale = alpha / r), and the input's gradient from the base's plus the adapters'
// masked. Each product is rounded on its own (__fmul_rn, __fadd_rn: no contraction into fma), in the
// order of the composite ops. One thread per element, grid-stride.

#include "common.cuh"

__device__ __forceinline__ bool lora_keep(size_t i, uint32_t threshold, uint32_t seed_lo, uint32_t seed_hi) {
    if (threshold == 0) return true;
    uint64_t z = (((uint64_t)seed_hi << 32) | seed_lo) + ((uint64_t)i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32) >= threshold;
}

template <typename T>
__device__ void lora_input(const T *__restrict__ x, float *__restrict__ out, uint32_t n, uint32_t threshold,
                           float keep_scale, uint32_t seed_lo, uint32_t seed_hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = lora_keep(i, threshold, seed_lo, seed_hi) ? __fmul_rn(to_f32(x[i]), keep_scale) : 0.f;
    }
}

template <typename T>
__device__ void lora_combine(const T *__restrict__ base, const float *__restrict__ delta, T *__restrict__ y,
                             uint32_t n, float scale, uint32_t threshold, float keep_scale, uint32_t seed_lo,
                             uint32_t seed_hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float d = lora_keep(i, threshold, seed_lo, seed_hi) ? __fmul_rn(delta[i], keep_scale) : 0.f;
        y[i] = from_f32<T>(__fadd_rn(to_f32(base[i]), __fmul_rn(d, scale)));
    }
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
