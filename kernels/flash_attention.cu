// Attention block by block (the flash-attention algorithm), forward and backward
// (src/kernels/flash_attention.rs has the definitions and the CPU reference).
//
// q, dout, out: [B, H, T, D]; k, v: [B, KV, S, D] (query head h reads KV head h / (H / KV));
// ranges[(b * T + i) * 2 ..] = (lo, hi): the keys query (b, i) sees; lse, delta: [B, H, T] f32.
//   flash_fwd_<T>:     out = softmax(scale q k^T) v over each query's keys (online softmax), and lse
//                      (grid: query blocks x B*H)
//   flash_bwd_dq_<T>:  dq = scale sum_j p_ij (do_i . v_j - delta_i) k_j   (grid: query blocks x B*H)
//   flash_bwd_dkv_<T>: dk, dv of each key block over the queries of every head of its group
//                      (grid: key blocks x B*KV); dkv = [dk (B*KV*S*D) | dv (B*KV*S*D)]
// 128 threads per block; tiles of rows in shared memory as f32 with a row stride of D + 1 (no bank
// conflicts between rows); f32 accumulation; accumulators of a [rows, D] tile in registers, at most
// MAX_ACC per thread (the host keeps rows * D <= 128 * MAX_ACC). Shared memory sizes: see the host.

#include "common.cuh"

#define THREADS 128
#define WARPS (THREADS / 32)
#define MAX_ACC 16
#define FWD_KEYS 32

// The keys of query i of batch row b, clipped to the keys; false when none.
__device__ __forceinline__ bool key_range(const uint32_t *ranges, uint32_t b, uint32_t i, uint32_t t, uint32_t s,
                                          uint32_t &lo, uint32_t &hi) {
    lo = ranges[((size_t)b * t + i) * 2];
    hi = ranges[((size_t)b * t + i) * 2 + 1];
    if (hi >= s) hi = s - 1;
    return lo <= hi;
}

// Rows r0.. r0 + n of a [rows, d] matrix into shared memory (row stride ld) as f32; rows >= limit are 0.
template <typename T>
__device__ void load_rows(float *dst, const T *src, uint32_t r0, uint32_t n, uint32_t limit, uint32_t d,
                          uint32_t ld) {
    for (uint32_t e = threadIdx.x; e < n * d; e += THREADS) {
        const uint32_t r = e / d, x = e % d;
        dst[r * ld + x] = (r0 + r < limit) ? to_f32(src[(size_t)(r0 + r) * d + x]) : 0.f;
    }
}

__device__ __forceinline__ float dot(const float *a, const float *b, uint32_t d) {
    float acc = 0.f;
    for (uint32_t x = 0; x < d; ++x) acc = fmaf(a[x], b[x], acc);
    return acc;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Ranges of the block's query rows i0.. i0 + bq into shared memory (empty: lo = 1, hi = 0, also for rows
// past t), and the span of keys any of them sees (kmin > kmax when none). Ends with a barrier.
__device__ void query_ranges(const uint32_t *ranges, uint32_t b, uint32_t i0, uint32_t bq, uint32_t t, uint32_t s,
                             uint32_t *los, uint32_t *his, uint32_t &kmin, uint32_t &kmax) {
    for (uint32_t r = threadIdx.x; r < bq; r += THREADS) {
        uint32_t lo = 1, hi = 0;
        if (i0 + r >= t || !key_range(ranges, b, i0 + r, t, s, lo, hi)) lo = 1, hi = 0;
        los[r] = lo;
        his[r] = hi;
    }
    __syncthreads();
    kmin = 0xffffffffu;
    kmax = 0;
    for (uint32_t r = 0; r < bq; ++r) {
        if (los[r] <= his[r]) {
            kmin = min(kmin, los[r]);
            kmax = max(kmax, his[r]);
        }
    }
}

template <typename T>
__device__ void flash_fwd(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                          const uint32_t *__restrict__ ranges, float *__restrict__ lse, T *__restrict__ out,
                          uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t d, uint32_t bq, float scale) {
    extern __shared__ float smem[];
    const uint32_t ld = d + 1, BK = FWD_KEYS;
    float *qs = smem;                        // [bq][ld] queries
    float *kvs = qs + bq * ld;               // [BK][ld] keys, then values
    float *ss = kvs + BK * ld;               // [bq][BK] scores, then probabilities
    float *ms = ss + bq * BK;                // [bq] running max
    float *ls = ms + bq;                     // [bq] running sum
    float *as = ls + bq;                     // [bq] rescale of the accumulator for this key block
    uint32_t *los = (uint32_t *)(as + bq);   // [bq]
    uint32_t *his = los + bq;                // [bq]
    const uint32_t bh = blockIdx.y, b = bh / h, kvh = (bh % h) / (h / kv), i0 = blockIdx.x * bq;
    const T *qh = q + (size_t)bh * t * d;
    const T *kh = k + ((size_t)b * kv + kvh) * s * d;
    const T *vh = v + ((size_t)b * kv + kvh) * s * d;
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    for (uint32_t r = tid; r < bq; r += THREADS) {
        ms[r] = -INFINITY;
        ls[r] = 0.f;
    }
    load_rows(qs, qh, i0, bq, t, d, ld);
    uint32_t kmin, kmax;
    query_ranges(ranges, b, i0, bq, t, s, los, his, kmin, kmax);
    float acc[MAX_ACC];
#pragma unroll
    for (int a = 0; a < MAX_ACC; ++a) acc[a] = 0.f;

    for (uint32_t j0 = kmin; kmin <= kmax && j0 <= kmax; j0 += BK) {
        load_rows(kvs, kh, j0, BK, s, d, ld);
        __syncthreads();
        for (uint32_t e = tid; e < bq * BK; e += THREADS) {
            const uint32_t r = e / BK, c = e % BK, j = j0 + c;
            ss[e] = (j >= los[r] && j <= his[r]) ? scale * dot(qs + r * ld, kvs + c * ld, d) : -INFINITY;
        }
        __syncthreads();
        // Online softmax: one warp per row, one lane per key.
        for (uint32_t r = warp; r < bq; r += WARPS) {
            const float x = ss[r * BK + lane];
            const float m_old = ms[r], m_new = fmaxf(m_old, warp_max(x));
            const float p = (x == -INFINITY) ? 0.f : expf(x - m_new);
            const float sum = warp_sum(p);
            ss[r * BK + lane] = p;
            if (lane == 0) {
                const float a = (m_old == -INFINITY) ? 0.f : expf(m_old - m_new);
                as[r] = a;
                ls[r] = ls[r] * a + sum;
                ms[r] = m_new;
            }
        }
        __syncthreads();
        load_rows(kvs, vh, j0, BK, s, d, ld);
        __syncthreads();
#pragma unroll
        for (int a = 0; a < MAX_ACC; ++a) {
            const uint32_t e = tid + a * THREADS;
            if (e < bq * d) {
                const uint32_t r = e / d, x = e % d;
                float sum = 0.f;
                for (uint32_t c = 0; c < BK; ++c) sum = fmaf(ss[r * BK + c], kvs[c * ld + x], sum);
                acc[a] = acc[a] * as[r] + sum;
            }
        }
        __syncthreads();
    }
    T *oh = out + (size_t)bh * t * d;
#pragma unroll
    for (int a = 0; a < MAX_ACC; ++a) {
        const uint32_t e = tid + a * THREADS;
        if (e < bq * d && i0 + e / d < t) {
            const float l = ls[e / d];
            oh[(size_t)i0 * d + e] = from_f32<T>(l > 0.f ? acc[a] / l : 0.f);
        }
    }
    for (uint32_t r = tid; r < bq; r += THREADS) {
        if (i0 + r < t) lse[(size_t)bh * t + i0 + r] = ls[r] > 0.f ? ms[r] + logf(ls[r]) : -INFINITY;
    }
}

template <typename T>
__device__ void flash_bwd_dq(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                             const T *__restrict__ dout, const uint32_t *__restrict__ ranges,
                             const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dq,
                             uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t d, uint32_t bq, uint32_t bk,
                             float scale) {
    extern __shared__ float smem[];
    const uint32_t ld = d + 1;
    float *qs = smem;                        // [bq][ld] queries
    float *gs = qs + bq * ld;                // [bq][ld] output gradients
    float *kvs = gs + bq * ld;               // [bk][ld] keys, values, keys
    float *ss = kvs + bk * ld;               // [bq][bk] p, then ds
    float *lses = ss + bq * bk;              // [bq]
    float *deltas = lses + bq;               // [bq]
    uint32_t *los = (uint32_t *)(deltas + bq);
    uint32_t *his = los + bq;
    const uint32_t bh = blockIdx.y, b = bh / h, kvh = (bh % h) / (h / kv), i0 = blockIdx.x * bq;
    const T *kh = k + ((size_t)b * kv + kvh) * s * d;
    const T *vh = v + ((size_t)b * kv + kvh) * s * d;
    const uint32_t tid = threadIdx.x;

    for (uint32_t r = tid; r < bq; r += THREADS) {
        const bool in = i0 + r < t;
        lses[r] = in ? lse[(size_t)bh * t + i0 + r] : 0.f;
        deltas[r] = in ? delta[(size_t)bh * t + i0 + r] : 0.f;
    }
    load_rows(qs, q + (size_t)bh * t * d, i0, bq, t, d, ld);
    load_rows(gs, dout + (size_t)bh * t * d, i0, bq, t, d, ld);
    uint32_t kmin, kmax;
    query_ranges(ranges, b, i0, bq, t, s, los, his, kmin, kmax);
    float acc[MAX_ACC];
#pragma unroll
    for (int a = 0; a < MAX_ACC; ++a) acc[a] = 0.f;

    for (uint32_t j0 = kmin; kmin <= kmax && j0 <= kmax; j0 += bk) {
        load_rows(kvs, kh, j0, bk, s, d, ld);
        __syncthreads();
        for (uint32_t e = tid; e < bq * bk; e += THREADS) {
            const uint32_t r = e / bk, c = e % bk, j = j0 + c;
            ss[e] = (j >= los[r] && j <= his[r]) ? expf(scale * dot(qs + r * ld, kvs + c * ld, d) - lses[r]) : 0.f;
        }
        __syncthreads();
        load_rows(kvs, vh, j0, bk, s, d, ld);
        __syncthreads();
        for (uint32_t e = tid; e < bq * bk; e += THREADS) {
            const uint32_t r = e / bk, c = e % bk;
            const float p = ss[e];
            if (p != 0.f) ss[e] = p * (dot(gs + r * ld, kvs + c * ld, d) - deltas[r]);
        }
        __syncthreads();
        load_rows(kvs, kh, j0, bk, s, d, ld);
        __syncthreads();
#pragma unroll
        for (int a = 0; a < MAX_ACC; ++a) {
            const uint32_t e = tid + a * THREADS;
            if (e < bq * d) {
                const uint32_t r = e / d, x = e % d;
                float sum = 0.f;
                for (uint32_t c = 0; c < bk; ++c) sum = fmaf(ss[r * bk + c], kvs[c * ld + x], sum);
                acc[a] += sum;
            }
        }
        __syncthreads();
    }
    T *dqh = dq + (size_t)bh * t * d;
#pragma unroll
    for (int a = 0; a < MAX_ACC; ++a) {
        const uint32_t e = tid + a * THREADS;
        if (e < bq * d && i0 + e / d < t) dqh[(size_t)i0 * d + e] = from_f32<T>(scale * acc[a]);
    }
}

template <typename T>
__device__ void flash_bwd_dkv(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                              const T *__restrict__ dout, const uint32_t *__restrict__ ranges,
                              const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dkv,
                              uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t d, uint32_t bq, uint32_t bk,
                              float scale) {
    extern __shared__ float smem[];
    const uint32_t ld = d + 1;
    float *ks = smem;                        // [bk][ld] keys
    float *vs = ks + bk * ld;                // [bk][ld] values
    float *qs = vs + bk * ld;                // [bq][ld] queries
    float *gs = qs + bq * ld;                // [bq][ld] output gradients
    float *ps = gs + bq * ld;                // [bq][bk] p
    float *dss = ps + bq * bk;               // [bq][bk] ds
    float *lses = dss + bq * bk;             // [bq]
    float *deltas = lses + bq;               // [bq]
    uint32_t *los = (uint32_t *)(deltas + bq);
    uint32_t *his = los + bq;
    const uint32_t bkv = blockIdx.y, b = bkv / kv, kvh = bkv % kv, j0 = blockIdx.x * bk, group = h / kv;
    const uint32_t j_last = min(j0 + bk, s) - 1;
    const uint32_t tid = threadIdx.x;
    load_rows(ks, k + (size_t)bkv * s * d, j0, bk, s, d, ld);
    load_rows(vs, v + (size_t)bkv * s * d, j0, bk, s, d, ld);
    float dk[MAX_ACC], dv[MAX_ACC];
#pragma unroll
    for (int a = 0; a < MAX_ACC; ++a) dk[a] = dv[a] = 0.f;

    for (uint32_t hq = kvh * group; hq < (kvh + 1) * group; ++hq) {
        const uint32_t bh = b * h + hq;
        for (uint32_t i0 = 0; i0 < t; i0 += bq) {
            // Only query blocks with a row that sees a key of this block.
            int any = 0;
            for (uint32_t r = tid; r < bq; r += THREADS) {
                uint32_t lo = 1, hi = 0;
                const bool in = i0 + r < t;
                if (!in || !key_range(ranges, b, i0 + r, t, s, lo, hi)) lo = 1, hi = 0;
                los[r] = lo;
                his[r] = hi;
                any |= lo <= hi && lo <= j_last && hi >= j0;
                lses[r] = in ? lse[(size_t)bh * t + i0 + r] : 0.f;
                deltas[r] = in ? delta[(size_t)bh * t + i0 + r] : 0.f;
            }
            if (!__syncthreads_or(any)) continue;
            load_rows(qs, q + (size_t)bh * t * d, i0, bq, t, d, ld);
            load_rows(gs, dout + (size_t)bh * t * d, i0, bq, t, d, ld);
            __syncthreads();
            for (uint32_t e = tid; e < bq * bk; e += THREADS) {
                const uint32_t r = e / bk, c = e % bk, j = j0 + c;
                float p = 0.f, ds = 0.f;
                if (j < s && j >= los[r] && j <= his[r]) {
                    p = expf(scale * dot(qs + r * ld, ks + c * ld, d) - lses[r]);
                    ds = p * (dot(gs + r * ld, vs + c * ld, d) - deltas[r]);
                }
                ps[e] = p;
                dss[e] = ds;
            }
            __syncthreads();
#pragma unroll
            for (int a = 0; a < MAX_ACC; ++a) {
                const uint32_t e = tid + a * THREADS;
                if (e < bk * d) {
                    const uint32_t c = e / d, x = e % d;
                    float sv = 0.f, sk = 0.f;
                    for (uint32_t r = 0; r < bq; ++r) {
                        sv = fmaf(ps[r * bk + c], gs[r * ld + x], sv);
                        sk = fmaf(dss[r * bk + c], qs[r * ld + x], sk);
                    }
                    dv[a] += sv;
                    dk[a] += sk;
                }
            }
            __syncthreads();
        }
    }
    const size_t nk = (size_t)gridDim.y * s * d;
    T *dkh = dkv + (size_t)bkv * s * d;
#pragma unroll
    for (int a = 0; a < MAX_ACC; ++a) {
        const uint32_t e = tid + a * THREADS;
        if (e < bk * d && j0 + e / d < s) {
            dkh[(size_t)j0 * d + e] = from_f32<T>(scale * dk[a]);
            dkh[nk + (size_t)j0 * d + e] = from_f32<T>(dv[a]);
        }
    }
}

#define FLASH_KERNELS(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                        \
        flash_fwd_##NAME(const T *q, const T *k, const T *v, const uint32_t *ranges, float *lse, T *out,         \
                         uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t d, uint32_t bq, float scale) { \
        flash_fwd<T>(q, k, v, ranges, lse, out, h, kv, t, s, d, bq, scale);                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                        \
        flash_bwd_dq_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,           \
                            const float *lse, const float *delta, T *dq, uint32_t h, uint32_t kv, uint32_t t,    \
                            uint32_t s, uint32_t d, uint32_t bq, uint32_t bk, float scale) {                     \
        flash_bwd_dq<T>(q, k, v, dout, ranges, lse, delta, dq, h, kv, t, s, d, bq, bk, scale);                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                        \
        flash_bwd_dkv_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,          \
                             const float *lse, const float *delta, T *dkv, uint32_t h, uint32_t kv, uint32_t t,  \
                             uint32_t s, uint32_t d, uint32_t bq, uint32_t bk, float scale) {                    \
        flash_bwd_dkv<T>(q, k, v, dout, ranges, lse, delta, dkv, h, kv, t, s, d, bq, bk, scale);                 \
    }

FLASH_KERNELS(f32, float)
FLASH_KERNELS(bf16, __nv_bfloat16)
FLASH_KERNELS(f16, __half)

// ---------------------------------------------------------------------------------------------------------
// Element-wise steps of the chunked attention (src/kernels/flash_attention/driver.rs): its matrix products
// are batched GEMMs (cuBLAS), these kernels do the rest. A step works on query rows i0.. i0 + n of every
// head, stacked per KV head: batch entry e = b KV + kv (blockIdx.y), stacked row = g n + r (blockIdx.x) is
// query head kv G + g, query i0 + r. One block per stacked row; scores blocks are [N, M, nk] f32 (M = G n),
// stats are m [N, M] then l [N, M] (l = 0: no key seen yet).

struct Row {
    uint32_t e, row, bht, b, i;
};

__device__ __forceinline__ Row stacked_row(uint32_t h, uint32_t kv, uint32_t t, uint32_t i0, uint32_t n) {
    Row x;
    x.e = blockIdx.y;
    x.row = blockIdx.x;
    const uint32_t group = h / kv, g = x.row / n, r = x.row % n;
    x.b = x.e / kv;
    x.i = i0 + r;
    x.bht = (x.b * h + (x.e % kv) * group + g) * t + x.i;
    return x;
}

// The keys of block j0.. j0 + nk the row sees, as a.. z within the block; false when none.
__device__ __forceinline__ bool visible(const uint32_t *ranges, const Row &x, uint32_t t, uint32_t s, uint32_t j0,
                                        uint32_t nk, uint32_t &a, uint32_t &z) {
    uint32_t lo, hi;
    if (!key_range(ranges, x.b, x.i, t, s, lo, hi)) return false;
    a = lo > j0 ? lo - j0 : 0;
    z = hi + 1 < j0 + nk ? hi + 1 - j0 : nk;
    return hi >= j0 && a < z;
}

template <typename T>
__device__ void fa_gather(const T *src, T *dst, uint32_t h, uint32_t kv, uint32_t t, uint32_t d, uint32_t i0,
                          uint32_t n) {
    const Row x = stacked_row(h, kv, t, i0, n);
    const size_t to = ((size_t)x.e * gridDim.x + x.row) * d, from = (size_t)x.bht * d;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) dst[to + c] = src[from + c];
}

template <typename T>
__device__ void fa_scatter(const float *acc, T *dst, uint32_t h, uint32_t kv, uint32_t t, uint32_t d, uint32_t i0,
                           uint32_t n) {
    const Row x = stacked_row(h, kv, t, i0, n);
    const size_t from = ((size_t)x.e * gridDim.x + x.row) * d, to = (size_t)x.bht * d;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) dst[to + c] = from_f32<T>(acc[from + c]);
}

template <typename T> __device__ void fa_cast(const float *src, T *dst, uint32_t len) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f32<T>(src[i]);
}

template <typename T>
__device__ void fa_fwd_scores(const float *sc, T *p, float *stats, float *acc, const uint32_t *ranges, uint32_t h,
                              uint32_t kv, uint32_t t, uint32_t s, uint32_t d, uint32_t i0, uint32_t n, uint32_t j0,
                              uint32_t nk, float scale) {
    __shared__ float red[32];
    const Row x = stacked_row(h, kv, t, i0, n);
    const size_t row = (size_t)x.e * gridDim.x + x.row, rows = (size_t)gridDim.x * gridDim.y;
    const float *srow = sc + row * nk;
    T *prow = p + row * nk;
    uint32_t a, z;
    if (!visible(ranges, x, t, s, j0, nk, a, z)) {
        for (uint32_t j = threadIdx.x; j < nk; j += blockDim.x) prow[j] = from_f32<T>(0.f);
        return;
    }
    float mx = -INFINITY;
    for (uint32_t j = a + threadIdx.x; j < z; j += blockDim.x) mx = fmaxf(mx, scale * srow[j]);
    mx = block_reduce<true>(mx, red);
    const float l_old = stats[rows + row];
    const float m_old = l_old > 0.f ? stats[row] : -INFINITY;
    const float m_new = fmaxf(m_old, mx);
    float sum = 0.f;
    for (uint32_t j = threadIdx.x; j < nk; j += blockDim.x) {
        const T v = from_f32<T>(j >= a && j < z ? __expf(scale * srow[j] - m_new) : 0.f);
        prow[j] = v;
        sum += to_f32(v);  // the sum of the probabilities the GEMM multiplies
    }
    sum = block_reduce<false>(sum, red);
    const float alpha = l_old > 0.f ? __expf(m_old - m_new) : 0.f;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) acc[row * d + c] *= alpha;
    if (threadIdx.x == 0) {
        stats[row] = m_new;
        stats[rows + row] = l_old * alpha + sum;
    }
}

template <typename T>
__device__ void fa_fwd_finish(const float *stats, const float *acc, T *out, float *lse, uint32_t h, uint32_t kv,
                              uint32_t t, uint32_t d, uint32_t i0, uint32_t n) {
    const Row x = stacked_row(h, kv, t, i0, n);
    const size_t row = (size_t)x.e * gridDim.x + x.row, rows = (size_t)gridDim.x * gridDim.y;
    const float m = stats[row], l = stats[rows + row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) out[(size_t)x.bht * d + c] = from_f32<T>(acc[row * d + c] * inv);
    if (threadIdx.x == 0) lse[x.bht] = l > 0.f ? m + logf(l) : -INFINITY;
}

template <typename T>
__device__ void fa_bwd_scores(const float *sc, const float *dp, const float *lse_delta, const uint32_t *ranges, T *p,
                              T *ds, uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t i0, uint32_t n,
                              uint32_t j0, uint32_t nk, float scale, uint32_t rows_total) {
    const Row x = stacked_row(h, kv, t, i0, n);
    const size_t row = (size_t)x.e * gridDim.x + x.row;
    uint32_t a = 0, z = 0;
    const bool any = visible(ranges, x, t, s, j0, nk, a, z);
    const float lse = lse_delta[x.bht], delta = lse_delta[rows_total + x.bht];
    for (uint32_t j = threadIdx.x; j < nk; j += blockDim.x) {
        const size_t at = row * nk + j;
        const float pj = any && j >= a && j < z ? __expf(scale * sc[at] - lse) : 0.f;
        p[at] = from_f32<T>(pj);
        ds[at] = from_f32<T>(pj * (dp[at] - delta));
    }
}

#define CHUNKED_KERNELS(NAME, T)                                                                                  \
    extern "C" __global__ void fa_gather_##NAME(const T *src, T *dst, uint32_t h, uint32_t kv, uint32_t t,        \
                                                uint32_t d, uint32_t i0, uint32_t n) {                            \
        fa_gather<T>(src, dst, h, kv, t, d, i0, n);                                                               \
    }                                                                                                             \
    extern "C" __global__ void fa_scatter_##NAME(const float *acc, T *dst, uint32_t h, uint32_t kv, uint32_t t,   \
                                                 uint32_t d, uint32_t i0, uint32_t n) {                           \
        fa_scatter<T>(acc, dst, h, kv, t, d, i0, n);                                                              \
    }                                                                                                             \
    extern "C" __global__ void fa_cast_##NAME(const float *src, T *dst, uint32_t len) { fa_cast<T>(src, dst, len); } \
    extern "C" __global__ void fa_fwd_scores_##NAME(const float *sc, T *p, float *stats, float *acc,              \
                                                    const uint32_t *ranges, uint32_t h, uint32_t kv, uint32_t t,  \
                                                    uint32_t s, uint32_t d, uint32_t i0, uint32_t n, uint32_t j0, \
                                                    uint32_t nk, float scale) {                                   \
        fa_fwd_scores<T>(sc, p, stats, acc, ranges, h, kv, t, s, d, i0, n, j0, nk, scale);                        \
    }                                                                                                             \
    extern "C" __global__ void fa_fwd_finish_##NAME(const float *stats, const float *acc, T *out, float *lse,     \
                                                    uint32_t h, uint32_t kv, uint32_t t, uint32_t d, uint32_t i0, \
                                                    uint32_t n) {                                                 \
        fa_fwd_finish<T>(stats, acc, out, lse, h, kv, t, d, i0, n);                                               \
    }                                                                                                             \
    extern "C" __global__ void fa_bwd_scores_##NAME(const float *sc, const float *dp, const float *lse_delta,     \
                                                    const uint32_t *ranges, T *p, T *ds, uint32_t h, uint32_t kv, \
                                                    uint32_t t, uint32_t s, uint32_t i0, uint32_t n, uint32_t j0, \
                                                    uint32_t nk, float scale, uint32_t rows_total) {              \
        fa_bwd_scores<T>(sc, dp, lse_delta, ranges, p, ds, h, kv, t, s, i0, n, j0, nk, scale, rows_total);        \
    }

CHUNKED_KERNELS(f32, float)
CHUNKED_KERNELS(bf16, __nv_bfloat16)
CHUNKED_KERNELS(f16, __half)
