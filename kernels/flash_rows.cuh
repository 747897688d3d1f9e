// What the flash-attention kernels on the tensor cores (flash_mma.cu, flash_wgmma.cu) share: the key
// range of each query, the span of keys a block of queries sees, A fragments from device memory, the
// row reductions and the store of the accumulators' layout (mma.sync's C, also each warp's part of
// wgmma's D).
#pragma once

#include "common.cuh"
#include "mma.cuh"

// The key range of query i of batch row b (clipped to the keys; empty: lo = 1, hi = 0, also past t).
__device__ __forceinline__ void mma_range(const uint32_t *ranges, uint32_t b, uint32_t i, uint32_t t, uint32_t s,
                                          uint32_t &lo, uint32_t &hi) {
    lo = 1, hi = 0;
    if (i >= t) return;
    lo = ranges[((size_t)b * t + i) * 2];
    hi = min(ranges[((size_t)b * t + i) * 2 + 1], s - 1);
    if (lo > hi) lo = 1, hi = 0;
}

// Ranges of rows i0.. i0 + n into shared memory and the span of keys any of them sees (kmin > kmax when
// none). Ends with a barrier.
template <int THREADS>
__device__ void mma_row_ranges(const uint32_t *ranges, uint32_t b, uint32_t i0, uint32_t n, uint32_t t, uint32_t s,
                               uint32_t *los, uint32_t *his, uint32_t &kmin, uint32_t &kmax) {
    for (uint32_t r = threadIdx.x; r < n; r += THREADS) mma_range(ranges, b, i0 + r, t, s, los[r], his[r]);
    __syncthreads();
    kmin = 0xffffffffu;
    kmax = 0;
    for (uint32_t r = 0; r < n; ++r) {
        if (los[r] <= his[r]) {
            kmin = min(kmin, los[r]);
            kmax = max(kmax, his[r]);
        }
    }
}

// The span of keys (least lo, greatest hi; empty: 0xffffffff, 0) of each 16 rows i0 + 16 u.. of the BQ whose
// ranges are in los, his, at spans[(b * ceil(t / 16) + i0 / 16 + u) * 2]: the dk/dv kernel's test of which
// query blocks to visit.
template <int BQ>
__device__ void write_spans(uint32_t *spans, const uint32_t *los, const uint32_t *his, uint32_t b, uint32_t i0,
                           uint32_t t) {
    const uint32_t u = threadIdx.x;
    if (u >= BQ / 16 || i0 + 16 * u >= t) return;
    uint32_t lo = 0xffffffffu, hi = 0;
    for (uint32_t r = 16 * u; r < 16 * u + 16; ++r) {
        if (los[r] <= his[r]) {
            lo = min(lo, los[r]);
            hi = max(hi, his[r]);
        }
    }
    uint32_t *out = spans + ((size_t)b * ((t + 15) / 16) + i0 / 16 + u) * 2;
    out[0] = lo;
    out[1] = hi;
}

// The A fragments of rows m0..m0+15 of a [rows, D] matrix in device memory (rows >= limit are 0).
template <typename T, int D>
__device__ void global_frags(uint32_t f[D / 16][4], const T *src, uint32_t m0, uint32_t limit) {
    const uint32_t lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t r = m0 + g + 8 * (i % 2), x = 16 * kk + 2 * c + 8 * (i / 2);
            f[kk][i] = r < limit ? pair(src[(size_t)r * D + x], src[(size_t)r * D + x + 1]) : 0u;
        }
    }
}

// Sum over the 4 lanes that hold one row of an accumulator.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Rows g and g + 8 of this warp's [16, D] accumulator tile, row r times scale[r], to rows row0 + g + 8 r
// of a [rows, D] matrix (rows >= limit skipped).
template <typename T, int D>
__device__ __forceinline__ void store_acc(T *dst, const float acc[D / 8][4], const float scale[2], uint32_t row0,
                                          uint32_t limit) {
    const uint32_t lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    for (int r = 0; r < 2; ++r) {
        const uint32_t i = row0 + g + 8 * r;
        if (i >= limit) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dst[(size_t)i * D + 8 * n + 2 * c] = from_f32<T>(acc[n][2 * r] * scale[r]);
            dst[(size_t)i * D + 8 * n + 2 * c + 1] = from_f32<T>(acc[n][2 * r + 1] * scale[r]);
        }
    }
}

