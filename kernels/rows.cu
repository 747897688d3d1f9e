// Row kernels of the fused log-prob op (src/kernels/rows.rs has the CPU reference of each).
//
// lp_row_stats_<T>: for each row z of a [n, V] logits chunk and its target t, in one pass over the row with
//   an online log-sum-exp, writes [log p(t), entropy, lse] (f32) to out[row * 3 ..].
// lp_row_grad_<T>: dz[r, v] = g_r * (onehot(t_r)[v] - p) - e_r * p * (z[r, v] - lse_r + H_r), written in T,
//   p = exp(z[r, v] - lse_r), from coef[r] = (lse_r, g_r) (cols = 2: no entropy term) or
//   (lse_r, g_r, H_r, e_r) (cols = 4: the gradient of g_r log p(t_r) + e_r H_r).
//
// Each term is computed in f32 whatever T is; the sums are f64 (see Acc). A target outside [0, V) gives
// NaN log-probs (the trainer's non-finite guard then skips the step) rather than reading out of bounds.

#include "common.cuh"

// Running softmax statistics of a set of logits, relative to their maximum m:
//   s = sum exp(z - m),  u = sum exp(z - m) * (z - m).
// Then lse = m + log s and entropy = lse - E_p[z] = log s - u / s.
// The terms are f32, s and u f64: in f32 each thread's sum over its V / blockDim terms rounds every small
// term against the growing sum (terms under half an ulp are lost), a log-sum-exp error that grows with
// the vocabulary; in f64 the error is that of the f32 terms, whatever V (src/kernels/rows.rs, Acc).
struct Acc {
    float m;
    double s;
    double u;
};

__device__ __forceinline__ void push(Acc &a, float z) {
    if (z == -INFINITY) return;  // probability 0: contributes nothing
    if (z <= a.m) {
        const float d = z - a.m;
        const float e = expf(d);
        a.s += (double)e;
        a.u += (double)(e * d);
    } else {
        // New maximum: rescale what was accumulated against the old one.
        const double d = (double)a.m - (double)z;  // < 0, or -inf for the first element
        if (a.s != 0.0) {  // != keeps a NaN in s (a NaN logit makes the whole row NaN)
            const double sc = exp(d);
            a.u = (a.u + d * a.s) * sc;
            a.s = a.s * sc + 1.0;
        } else {
            a.u = 0.0;
            a.s = 1.0;
        }
        a.m = z;
    }
}

__device__ __forceinline__ Acc merge(Acc a, Acc b) {
    if (a.s == 0.0) return b;
    if (b.s == 0.0) return a;
    const float m = fmaxf(a.m, b.m);
    const double da = (double)a.m - (double)m, db = (double)b.m - (double)m;
    const double ea = exp(da), eb = exp(db);
    Acc r;
    r.m = m;
    r.s = a.s * ea + b.s * eb;
    r.u = (a.u + da * a.s) * ea + (b.u + db * b.s) * eb;
    return r;
}

__device__ __forceinline__ Acc warp_merge(Acc a) {
    for (int off = 16; off > 0; off >>= 1) {
        Acc o;
        o.m = __shfl_xor_sync(0xffffffffu, a.m, off);
        o.s = __shfl_xor_sync(0xffffffffu, a.s, off);
        o.u = __shfl_xor_sync(0xffffffffu, a.u, off);
        a = merge(a, o);
    }
    return a;
}

// One pack of a row: where none of its logits is NaN or above the running maximum (nearly every pack
// after a row's first), its terms are summed in f32 (at most 8, each <= 1: an error of a few f32 ulps of
// the pack's sum, the terms' own) and the pack's sums added in f64; otherwise each logit is pushed.
template <typename T>
__device__ __forceinline__ void push_pack(Acc &a, const Pack<T> &p) {
    float z[Pack<T>::N], top = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < Pack<T>::N; ++j) {
        z[j] = to_f32(p.v[j]);
        top = fmaxf(top, z[j]);
        nan |= z[j] != z[j];
    }
    if (nan || top > a.m) {
#pragma unroll
        for (int j = 0; j < Pack<T>::N; ++j) push(a, z[j]);
        return;
    }
    float s = 0.f, u = 0.f;
#pragma unroll
    for (int j = 0; j < Pack<T>::N; ++j) {
        if (z[j] == -INFINITY) continue;  // probability 0 (and -inf * 0 would be NaN)
        const float d = z[j] - a.m, e = expf(d);
        s += e;
        u += e * d;
    }
    a.s += (double)s;
    a.u += (double)u;
}

// One block per row; blockDim.x a multiple of 32, at most 1024. Each thread reads 16-byte packs where the
// row is 16-byte aligned (common.cuh), else one logit at a time.
template <typename T>
__device__ void row_stats(const T *__restrict__ logits, const uint32_t *__restrict__ targets,
                          float *__restrict__ out, uint32_t vocab) {
    const size_t row = blockIdx.x;
    const T *z = logits + row * (size_t)vocab;
    Acc a = {-INFINITY, 0.0, 0.0};
    const uint32_t packs = aligned16(z) ? vocab / Pack<T>::N : 0;
    for (uint32_t p = threadIdx.x; p < packs; p += blockDim.x) push_pack(a, load_pack(z, p));
    for (uint32_t v = packs * Pack<T>::N + threadIdx.x; v < vocab; v += blockDim.x) push(a, to_f32(z[v]));
    a = warp_merge(a);
    __shared__ Acc partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = a;
    __syncthreads();
    if (warp != 0) return;
    const int warps = blockDim.x >> 5;
    Acc b = lane < warps ? partial[lane] : Acc{-INFINITY, 0.0, 0.0};
    b = warp_merge(b);
    if (lane == 0) {
        const double log_s = log(b.s);
        const double lse = (double)b.m + log_s;
        const uint32_t t = targets[row];
        const double zt = t < vocab ? (double)to_f32(z[t]) : __longlong_as_double(0x7ff8000000000000ll);
        out[row * 3 + 0] = (float)(zt - lse);
        out[row * 3 + 1] = (float)(log_s - b.u / b.s);
        out[row * 3 + 2] = (float)lse;
    }
}

// dz of logit z at column v.
template <typename T>
__device__ __forceinline__ T grad_one(T z, uint32_t v, uint32_t t, float lse, float g, float h, float e) {
    const float d = to_f32(z) - lse;
    const float p = expf(d);
    return from_f32<T>((v == t ? g : 0.f) - p * (g + e * (d + h)));
}

// grid.x = rows, grid.y * blockDim.x threads stride over the vocabulary, in 16-byte packs where the row and
// its gradient are 16-byte aligned.
template <typename T>
__device__ void row_grad(const T *__restrict__ logits, const uint32_t *__restrict__ targets,
                         const float *__restrict__ coef, T *__restrict__ out, uint32_t vocab, uint32_t cols) {
    const size_t row = blockIdx.x;
    const float *c = coef + row * (size_t)cols;
    const float lse = c[0], g = c[1];
    const float h = cols == 4 ? c[2] : 0.f, e = cols == 4 ? c[3] : 0.f;
    const uint32_t t = targets[row];
    const T *z = logits + row * (size_t)vocab;
    T *dz = out + row * (size_t)vocab;
    constexpr int N = Pack<T>::N;
    const uint32_t first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    const uint32_t packs = aligned16(z) && aligned16(dz) ? vocab / N : 0;
    for (uint32_t p = first; p < packs; p += stride) {
        const Pack<T> zp = load_pack(z, p);
        Pack<T> dp;
#pragma unroll
        for (int j = 0; j < N; ++j) dp.v[j] = grad_one(zp.v[j], p * N + j, t, lse, g, h, e);
        store_pack(dz, p, dp);
    }
    for (uint32_t v = packs * N + first; v < vocab; v += stride) dz[v] = grad_one(z[v], v, t, lse, g, h, e);
}

#define LP_KERNELS(NAME, T)                                                                                   \
    extern "C" __global__ void lp_row_stats_##NAME(const T *logits, const uint32_t *targets, float *out,      \
                                                   uint32_t vocab) {                                          \
        row_stats<T>(logits, targets, out, vocab);                                                            \
    }                                                                                                         \
    extern "C" __global__ void lp_row_grad_##NAME(const T *logits, const uint32_t *targets, const float *coef, \
                                                  T *out, uint32_t vocab, uint32_t cols) {                    \
        row_grad<T>(logits, targets, coef, out, vocab, cols);                                                 \
    }

LP_KERNELS(f32, float)
LP_KERNELS(bf16, __nv_bfloat16)
LP_KERNELS(f16, __half)
