// What the flash-attention kernels on the tensor cores (flash_mma.cu, flash_wgmma.cu) share: the key
// range of each query, the span of keys a block of queries sees, A fragments from device memory, the
// row reductions and the store of the accumulators' layout (mma.sync's C, also each warp's part of
// wgmma's D).
#pragma once

#include "common.cuh"
#include "mma.cuh"

// A block of BQ queries of one head (blockIdx.x: batch row x head, of h heads over kv KV heads of s keys;
// blockIdx.y: the query block, last first, so that the blocks of the last queries, which see the most keys
// under a causal mask, start first and the short ones fill the tail) as this thread sees it: the head bh,
// the batch row b, the block's first query i0, this thread's warp's first row m0 (16 per warp), and the K
// and V rows of the head's KV head.
template <typename T> struct QueryBlock {
    uint32_t bh, b, i0, m0;
    const T *kh, *vh;
};

// Accumulators (the layout of mma.sync's C and each warp's part of wgmma's D) set to zero.
template <int N> __device__ __forceinline__ void zero_acc(float (&a)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
        for (int i = 0; i < 4; ++i) a[n][i] = 0.f;
}

template <typename T, int D, int BQ>
__device__ __forceinline__ QueryBlock<T> query_block(const T *k, const T *v, uint32_t h, uint32_t kv, uint32_t s) {
    const uint32_t bh = blockIdx.x, b = bh / h, kvh = (bh % h) / (h / kv);
    const size_t rows = ((size_t)b * kv + kvh) * s * D;
    return QueryBlock<T>{bh, b, (gridDim.y - 1 - blockIdx.y) * BQ, 16 * (threadIdx.x / 32), k + rows, v + rows};
}

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

// The A fragments of this warp's 16 rows from m0 of the query block from i0 of head bh of x ([B, H, t, D]).
template <typename T, int D>
__device__ __forceinline__ void query_frags(uint32_t f[D / 16][4], const T *x, uint32_t bh, uint32_t i0, uint32_t m0,
                                            uint32_t t) {
    global_frags<T, D>(f, x + ((size_t)bh * t + i0) * D, m0, t - i0);
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


// This thread's two rows (g and g + 8 of its warp's 16 from m0; the accumulators' i / 2) of a block of
// queries from i0 of head bh: their key ranges (los, his: the block's, from mma_row_ranges) and, with
// the backward's lse and delta, their log-sum-exp and delta (0 past t).
struct QueryRows {
    uint32_t lo[2], hi[2];
    float lse[2], delta[2];
};

__device__ __forceinline__ QueryRows query_rows(const uint32_t *los, const uint32_t *his, const float *lse,
                                                const float *delta, uint32_t bh, uint32_t t, uint32_t i0,
                                                uint32_t m0) {
    const uint32_t g = (threadIdx.x % 32) / 4;
    QueryRows x;
    for (int r = 0; r < 2; ++r) {
        const uint32_t row = m0 + g + 8 * r, i = i0 + row;
        x.lo[r] = los[row], x.hi[r] = his[row];
        x.lse[r] = lse && i < t ? lse[(size_t)bh * t + i] : 0.f;
        x.delta[r] = delta && i < t ? delta[(size_t)bh * t + i] : 0.f;
    }
    return x;
}

// log2(e). The exponentials of the softmax are 2^x of scores times scale log2(e), less the row's
// maximum (or log-sum-exp) in the same units: one FFMA and one MUFU.EX2 per score, where expf(scale s -
// m) is a multiply, a subtraction and expf's range reduction around its MUFU.EX2 (about 9 instructions).
#define FLASH_LOG2E 1.4426950408889634f

// 2^x by the multifunction unit (ex2.approx.ftz: relative error below 2^-22, results under 2^-126
// flushed to 0; 2^-inf = 0).
__device__ __forceinline__ float flash_exp2(float x) {
#ifdef GRPO_CUDA_EMU
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// A query's statistics as the dk/dv kernels keep them in shared memory, one 16-byte load a query: its key
// range, its log-sum-exp times log2(e) (flash_exp2's unit) and its delta.
struct __align__(16) QueryStat {
    uint32_t lo, hi;
    float lse2, delta;
};

__device__ __forceinline__ QueryStat query_stat(uint32_t lo, uint32_t hi, float lse, float delta) {
    return QueryStat{lo, hi, lse * FLASH_LOG2E, delta};
}

// Whether every lane of the warp has keys j0.. j0 + KB - 1 in both its rows' ranges: the step needs no
// mask (one vote in place of two compares and a select per score). Warp-uniform.
template <int KB> __device__ __forceinline__ bool rows_see_all(const QueryRows &x, uint32_t j0) {
    const uint32_t j1 = j0 + KB - 1;
    return __all_sync(0xffffffffu, x.lo[0] <= j0 && j1 <= x.hi[0] && x.lo[1] <= j0 && j1 <= x.hi[1]);
}

// The scores s of keys j0 + 8 n + 2 c + i % 2 outside each row's range set to -inf (with MASK), and each
// row's maximum.
template <int KB, bool MASK>
__device__ __forceinline__ void masked_max(float (&s)[KB / 8][4], float (&mx)[2], const QueryRows &x, uint32_t j0) {
    const uint32_t c = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < KB / 8; ++n)
        for (int i = 0; i < 4; ++i) {
            const uint32_t j = j0 + 8 * n + 2 * c + i % 2, r = i / 2;
            if (MASK) s[n][i] = (j >= x.lo[r] && j <= x.hi[r]) ? s[n][i] : -INFINITY;
            mx[r] = fmaxf(mx[r], s[n][i]);
        }
}

// One key block's step of the online softmax over this thread's rows (scores s of keys j0 + 8 n + 2 c +
// i % 2, in the accumulators' layout, unscaled): s masked to each row's keys, the running max m (of the
// unscaled scores: scale > 0) and sum l updated, s turned into P = exp(scale (s - m)); alpha =
// exp(scale (m_old - m_new)), the factor the output accumulators take (rescale_rows) before P's product
// is added.
template <int KB>
__device__ __forceinline__ void softmax_step(float (&s)[KB / 8][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             const QueryRows &x, uint32_t j0, float scale) {
    const float c2 = scale * FLASH_LOG2E;
    float mx[2] = {-INFINITY, -INFINITY};
    if (rows_see_all<KB>(x, j0)) {
        masked_max<KB, false>(s, mx, x, j0);
    } else {
        masked_max<KB, true>(s, mx, x, j0);
    }
    float base[2], sum[2] = {0.f, 0.f};
    for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m[r], quad_max(mx[r]));
        base[r] = m_new == -INFINITY ? 0.f : m_new * c2;
        // exactly 1 where the maximum stays (rescale_rows then skips the warp's rows)
        alpha[r] = m[r] == m_new ? 1.f : flash_exp2(fmaf(m[r], c2, -base[r]));
        m[r] = m_new;
    }
#pragma unroll
    for (int n = 0; n < KB / 8; ++n)
        for (int i = 0; i < 4; ++i) {
            s[n][i] = flash_exp2(fmaf(s[n][i], c2, -base[i / 2]));
            sum[i / 2] += s[n][i];
        }
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + quad_sum(sum[r]);
}

// Accumulators of this thread's two rows times the rows' factors; nothing where every row of the warp keeps
// its maximum (every factor exactly 1: the same values, a warp vote in place of D / 2 multiplies).
template <int D> __device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], const float (&alpha)[2]) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
        for (int i = 0; i < 4; ++i) o[n][i] *= alpha[i / 2];
}

// softmax_step, then the output accumulators o rescaled.
template <int KB, int D>
__device__ __forceinline__ void online_softmax(float (&s)[KB / 8][4], float (&o)[D / 8][4], float (&m)[2],
                                               float (&l)[2], const QueryRows &x, uint32_t j0, float scale) {
    float alpha[2];
    softmax_step<KB>(s, m, l, alpha, x, j0, scale);
    rescale_rows<D>(o, alpha);
}

// The forward's end for this thread's rows: o / l to rows i0 + m0 + g (+ 8) of out ([t, D] of one head)
// and their log-sum-exp scale m + log l (m: softmax_step's unscaled maximum; -inf when a row sees no key)
// to lse.
template <typename T, int D>
__device__ __forceinline__ void store_forward(T *out, float *lse, const float (&o)[D / 8][4], const float (&m)[2],
                                              const float (&l)[2], uint32_t row0, uint32_t t, float scale) {
    const uint32_t g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
    const float inv[2] = {l[0] > 0.f ? 1.f / l[0] : 0.f, l[1] > 0.f ? 1.f / l[1] : 0.f};
    store_acc<T, D>(out, o, inv, row0, t);
    for (int r = 0; r < 2; ++r) {
        const uint32_t i = row0 + g + 8 * r;
        if (i < t && c == 0) lse[i] = l[r] > 0.f ? scale * m[r] + logf(l[r]) : -INFINITY;
    }
}

// dS = P (dP - delta) in s, P = exp(scale S - L) on each row's keys (keys j0 + 8 n + 2 c + i % 2;
// MASK: some are outside a row's range).
template <int KB, bool MASK>
__device__ __forceinline__ void score_grads_of(float (&s)[KB / 8][4], const float (&dp)[KB / 8][4],
                                               const QueryRows &x, uint32_t j0, float scale) {
    const uint32_t c = threadIdx.x % 4;
    const float c2 = scale * FLASH_LOG2E, l2[2] = {x.lse[0] * FLASH_LOG2E, x.lse[1] * FLASH_LOG2E};
#pragma unroll
    for (int n = 0; n < KB / 8; ++n)
        for (int i = 0; i < 4; ++i) {
            const uint32_t j = j0 + 8 * n + 2 * c + i % 2, r = i / 2;
            float p = flash_exp2(fmaf(s[n][i], c2, -l2[r]));
            if (MASK) p = (j >= x.lo[r] && j <= x.hi[r]) ? p : 0.f;
            s[n][i] = p * (dp[n][i] - x.delta[r]);
        }
}

template <int KB>
__device__ __forceinline__ void score_grads(float (&s)[KB / 8][4], const float (&dp)[KB / 8][4], const QueryRows &x,
                                            uint32_t j0, float scale) {
    if (rows_see_all<KB>(x, j0)) {
        score_grads_of<KB, false>(s, dp, x, j0, scale);
    } else {
        score_grads_of<KB, true>(s, dp, x, j0, scale);
    }
}

// dk and dv of this thread's keys j0 + g (+ 8) (its warp's 16 from j0) into `part`, one block's share of
// the f32 partial sums (dk of KV head bkv: [s, D] at bkv s D, dv nk elements after); the dk/dv kernels'
// split sums them (flash_mma.cu's bwd_dkv_sum).
template <int D>
__device__ __forceinline__ void store_dkv_part(float *part, const float (&dk)[D / 8][4], const float (&dv)[D / 8][4],
                                               uint32_t bkv, uint32_t j0, uint32_t s, size_t nk) {
    const uint32_t g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
    float *dkh = part + (size_t)bkv * s * D;
    for (int r = 0; r < 2; ++r) {
        const uint32_t j = j0 + g + 8 * r;
        if (j >= s) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            for (int x = 0; x < 2; ++x) {
                const size_t e = (size_t)j * D + 8 * n + 2 * c + x;
                dkh[e] = dk[n][2 * r + x];
                dkh[nk + e] = dv[n][2 * r + x];
            }
    }
}

// The query heads of KV head kvh's group that block `part` of `split` takes: [first, end).
__device__ __forceinline__ void dkv_heads(uint32_t kvh, uint32_t group, uint32_t part, uint32_t split,
                                          uint32_t &first, uint32_t &end) {
    // (first and a count, not two clamps: with min() on both ends nvcc's dk/dv kernels took 32 more registers)
    const uint32_t per = (group + split - 1) / split, p0 = part * per;
    first = kvh * group + p0;
    end = first + (p0 >= group ? 0 : min(per, group - p0));
}

// P^T and dS^T of a dk/dv kernel (rows: this thread's keys j + g (+ 8); columns: queries 8 n + 2 c + i % 2
// of a step whose statistics are st) from S^T in s and dP^T in dp (MASK: some keys are outside a query's
// range).
template <int BQ, bool MASK>
__device__ __forceinline__ void probs_t_of(float (&s)[BQ / 8][4], float (&dp)[BQ / 8][4], const QueryStat *st,
                                           uint32_t j, float scale) {
    const uint32_t g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
    const float c2 = scale * FLASH_LOG2E;
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
        for (int i = 0; i < 4; ++i) {
            const uint32_t key = j + g + 8 * (i / 2);
            const QueryStat &x = st[8 * n + 2 * c + i % 2];
            float p = flash_exp2(fmaf(s[n][i], c2, -x.lse2));
            if (MASK) p = (key >= x.lo && key <= x.hi) ? p : 0.f;
            s[n][i] = p;
            dp[n][i] = p * (dp[n][i] - x.delta);
        }
}

// probs_t_of, without the mask where `inside` holds in every lane of the warp (its test, the caller's:
// that each of the thread's two keys is in the range of every query of the step).
template <int BQ>
__device__ __forceinline__ void probs_t_if(float (&s)[BQ / 8][4], float (&dp)[BQ / 8][4], const QueryStat *st,
                                           uint32_t j, float scale, bool inside) {
    if (__all_sync(0xffffffffu, inside)) {
        probs_t_of<BQ, false>(s, dp, st, j, scale);
    } else {
        probs_t_of<BQ, true>(s, dp, st, j, scale);
    }
}

// probs_t_if with the test from the step's statistics: one check per query column rather than two per
// score. A query that sees no key (lo > hi) is never inside.
template <int BQ>
__device__ __forceinline__ void probs_t(float (&s)[BQ / 8][4], float (&dp)[BQ / 8][4], const QueryStat *st, uint32_t j,
                                        float scale) {
    const uint32_t g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4, key0 = j + g, key1 = key0 + 8;
    bool inside = true;
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
        for (int q = 0; q < 2; ++q) {
            const QueryStat &x = st[8 * n + 2 * c + q];
            inside &= (x.lo <= key0) & (key1 <= x.hi);
        }
    probs_t_if<BQ>(s, dp, st, j, scale, inside);
}
