// RMSNorm of rows with its weight (src/kernels/norm.rs has the CPU implementation), as Llama/Qwen compute it
// (transformers' LlamaRMSNorm): xhat = x r in f32, r = 1 / sqrt(mean(x^2) + eps), rounded to the storage
// type, then times the weight in the storage type:
//   rms_norm_fwd_<T>: y = T(T(xhat) w)
//   rms_norm_bwd_<T>: per row, dyh = T(g w) (the product's gradient, rounded as the composite rounds it),
//                     dx = T(r (dyh - xhat mean(dyh xhat))); and each block's partial of the weight's
//                     gradient, sum over its rows of g T(xhat), in f32 into partial[block, :]
//   rms_norm_dw_<T>:  dw = T(sum of the partials, in block order): the same sum on every run
// fwd: one warp per row (blockDim.x / 32 rows a block). bwd: a block per `rows_per_block` consecutive rows,
// a warp per row, each warp's terms of the weight's gradient in its own row of dynamic shared memory
// (warps x h floats), the block's partial their sum in warp order. dw: a thread per column. Rows move in
// 16-byte packs where they and the weight are 16-byte aligned (common.cuh), an element at a time
// otherwise; f32 accumulation.

#include "common.cuh"

// y = T(T(x r) w) of one element.
template <typename T>
__device__ __forceinline__ T norm_one(T x, T w, float r) {
    return from_f32<T>(to_f32(from_f32<T>(to_f32(x) * r)) * to_f32(w));
}

template <typename T>
__device__ void norm_fwd(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y, uint32_t rows,
                         uint32_t h, float eps) {
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const uint32_t lane = threadIdx.x & 31;
    const T *xr = x + row * (size_t)h;
    T *yr = y + row * (size_t)h;
    constexpr int N = Pack<T>::N;
    const uint32_t packs = aligned16(xr) && aligned16(yr) && aligned16(w) ? h / N : 0;
    float ss = 0.f;
    for (uint32_t p = lane; p < packs; p += 32) {
        const Pack<T> xp = load_pack(xr, p);
#pragma unroll
        for (int j = 0; j < N; ++j) ss += to_f32(xp.v[j]) * to_f32(xp.v[j]);
    }
    for (uint32_t j = packs * N + lane; j < h; j += 32) ss += to_f32(xr[j]) * to_f32(xr[j]);
    const float r = rsqrtf(warp_sum(ss) / (float)h + eps);
    for (uint32_t p = lane; p < packs; p += 32) {
        const Pack<T> xp = load_pack(xr, p), wp = load_pack(w, p);
        Pack<T> yp;
#pragma unroll
        for (int j = 0; j < N; ++j) yp.v[j] = norm_one(xp.v[j], wp.v[j], r);
        store_pack(yr, p, yp);
    }
    for (uint32_t j = packs * N + lane; j < h; j += 32) yr[j] = norm_one(xr[j], w[j], r);
}

// The backward of one element: dx = T(r (dyh - x r dot)), and its term g T(x r) of the weight's gradient
// added into *acc.
template <typename T>
__device__ __forceinline__ T norm_grad_one(T xv, T wv, T gv, float r, float dot, float *acc) {
    const float x = to_f32(xv), dyh = to_f32(from_f32<T>(to_f32(gv) * to_f32(wv)));
    *acc += to_f32(gv) * to_f32(from_f32<T>(x * r));
    return from_f32<T>(r * (dyh - x * r * dot));
}

// One warp per row: the rows of the block's row block in turn over its warps (row first + w, then + warps,
// ...), each warp adding its rows' terms of the weight's gradient into its own row of shared memory (the
// columns a lane touches are its own), then the block's partial the sum of its warps' in warp order.
template <typename T>
__device__ void norm_bwd(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ g,
                         T *__restrict__ dx, float *__restrict__ partial, uint32_t rows, uint32_t h,
                         uint32_t rows_per_block, float eps) {
    extern __shared__ float smem[];  // [warps][h]
    const uint32_t warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *acc = smem + (size_t)warp * h;
    for (uint32_t j = lane; j < h; j += 32) acc[j] = 0.f;
    const size_t first = (size_t)blockIdx.x * rows_per_block;
    const size_t last = min((size_t)rows, first + rows_per_block);
    constexpr int N = Pack<T>::N;
    for (size_t row = first + warp; row < last; row += warps) {
        const T *xr = x + row * (size_t)h, *gr = g + row * (size_t)h;
        T *dr = dx + row * (size_t)h;
        const uint32_t packs = aligned16(xr) && aligned16(gr) && aligned16(dr) && aligned16(w) ? h / N : 0;
        float ss = 0.f, xd = 0.f;  // sum x^2, sum dyh x
        for (uint32_t p = lane; p < packs; p += 32) {
            const Pack<T> xp = load_pack(xr, p), wp = load_pack(w, p), gp = load_pack(gr, p);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float xv = to_f32(xp.v[j]);
                ss += xv * xv;
                xd += to_f32(from_f32<T>(to_f32(gp.v[j]) * to_f32(wp.v[j]))) * xv;
            }
        }
        for (uint32_t j = packs * N + lane; j < h; j += 32) {
            const float xv = to_f32(xr[j]);
            ss += xv * xv;
            xd += to_f32(from_f32<T>(to_f32(gr[j]) * to_f32(w[j]))) * xv;
        }
        const float r = rsqrtf(warp_sum(ss) / (float)h + eps);
        const float dot = warp_sum(xd) * r / (float)h;
        for (uint32_t p = lane; p < packs; p += 32) {
            const Pack<T> xp = load_pack(xr, p), wp = load_pack(w, p), gp = load_pack(gr, p);
            Pack<T> dp;
#pragma unroll
            for (int j = 0; j < N; ++j) dp.v[j] = norm_grad_one(xp.v[j], wp.v[j], gp.v[j], r, dot, &acc[p * N + j]);
            store_pack(dr, p, dp);
        }
        for (uint32_t j = packs * N + lane; j < h; j += 32) dr[j] = norm_grad_one(xr[j], w[j], gr[j], r, dot, &acc[j]);
    }
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) {
        float s = 0.f;
        for (uint32_t k = 0; k < warps; ++k) s += smem[(size_t)k * h + j];
        partial[(size_t)blockIdx.x * h + j] = s;
    }
}

#define NORM_KERNELS(NAME, T)                                                                                  \
    extern "C" __global__ void rms_norm_fwd_##NAME(const T *x, const T *w, T *y, uint32_t rows, uint32_t h,    \
                                                   float eps) {                                                \
        norm_fwd<T>(x, w, y, rows, h, eps);                                                                    \
    }                                                                                                          \
    extern "C" __global__ void rms_norm_bwd_##NAME(const T *x, const T *w, const T *g, T *dx, float *partial,  \
                                                   uint32_t rows, uint32_t h, uint32_t rows_per_block,         \
                                                   float eps) {                                                \
        norm_bwd<T>(x, w, g, dx, partial, rows, h, rows_per_block, eps);                                       \
    }                                                                                                          \
    extern "C" __global__ void rms_norm_dw_##NAME(const float *partial, T *dw, uint32_t h, uint32_t blocks) {  \
        sum_partials<T>(partial, dw, h, blocks);                                                               \
    }

NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)
NORM_KERNELS(f16, __half)
