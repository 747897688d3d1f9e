// Heads to the front and back (src/kernels/heads.rs has the CPU implementation): the transposes around the
// attention, as copies.
//   heads_<T>: dst [B, H, T, D] = src [B, T, H, D] (`back` 0: v into the attention's layout), or
//              dst [B, T, H, D] = src [B, H, T, D] (`back` 1: the attention's output back).
// One thread per V consecutive elements of a row of D, in [B, H, T, D/V] order: V = 16 bytes of elements
// where both pointers are 16-byte aligned and D a multiple of them (common.cuh), else 1. Grid-stride,
// 32-bit indices (the op checks B T H D < 2^32).

#include "common.cuh"

template <typename T, int V>
__device__ void heads_runs(const T *__restrict__ src, T *__restrict__ dst, uint32_t b, uint32_t t, uint32_t h,
                           uint32_t d, bool back) {
    const uint32_t runs = d / V, total = b * h * t * runs;
    for (uint32_t k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += gridDim.x * blockDim.x) {
        const uint32_t r = k / runs;  // (b h + hi) t + ti: the row in [B, H, T, D]
        const uint32_t ti = r % t, hi = (r / t) % h, bi = r / (t * h);
        const uint32_t i = (k - r * runs) * V;
        const uint32_t bhtd = r * d + i, bthd = ((bi * t + ti) * h + hi) * d + i;
        const uint32_t from = back ? bhtd : bthd, to = back ? bthd : bhtd;
        store_run<T, V>(dst, to, load_run<T, V>(src, from));
    }
}

#define HEADS_KERNELS(NAME, T)                                                                             \
    extern "C" __global__ void heads_##NAME(const T *src, T *dst, uint32_t b, uint32_t t, uint32_t h,      \
                                            uint32_t d, uint32_t back) {                                   \
        if (d % Pack<T>::N == 0 && aligned16(src) && aligned16(dst))                                       \
            heads_runs<T, Pack<T>::N>(src, dst, b, t, h, d, back != 0);                                    \
        else                                                                                               \
            heads_runs<T, 1>(src, dst, b, t, h, d, back != 0);                                             \
    }

HEADS_KERNELS(f32, float)
HEADS_KERNELS(bf16, __nv_bfloat16)
HEADS_KERNELS(f16, __half)
