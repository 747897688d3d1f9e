// Attention block by block on the tensor cores (FlashAttention-2's algorithm with mma.sync, mma.cuh):
// the same inputs, outputs and arithmetic as flash_attention.cu's flash_fwd / flash_bwd_dq /
// flash_bwd_dkv (src/kernels/flash_attention.rs has the definitions and the CPU reference), for bf16 and
// f16 and a head dim D of 64 or 128 (one kernel per D: the fragments live in registers).
//
// q, dout, out: [B, H, T, D]; k, v: [B, KV, S, D] (query head h reads KV head h / (H / KV));
// ranges[(b * T + i) * 2 ..] = (lo, hi): the keys query (b, i) sees; lse, delta: [B, H, T] f32.
//   flash_mma_fwd_dD_<T>:    64 queries of one head per block (grid: B*H x query blocks), 16 per warp
//                            (their fragments in registers); keys in blocks of 32 through two stages of
//                            shared memory, the next block's K and V copied in (cp.async, cp_async.cuh)
//                            while this one's S = Q K^T and O += P V run on the tensor cores, P fed
//                            from S's accumulators (registers).
//   flash_mma_bwd_dq_dD_<T>: 64 queries per block, keys in blocks of 32 through two stages: S = Q K^T,
//                            dP = dO V^T, dS = P (dP - delta), dQ += dS K; also the span of keys each 16
//                            queries see (spans: [B, ceil(T / 16), 2] u32), for the dk/dv kernel.
//   flash_mma_bwd_dkv_dD_<T>: 64 keys of one KV head per block (grid: B*KV*split x key blocks), 16 per
//                            warp, over the queries of its part (of `split`) of its group's heads in
//                            blocks of 16 that see one of its keys (by spans): S^T = K Q^T, dP^T = V dO^T,
//                            dV += P^T dO, dK += dS^T Q; each part's f32 sums into parts ([split][dk
//                            (B*KV*S*D) | dv (B*KV*S*D)]). One stage (two would pass 48 KiB).
//   flash_mma_bwd_dkv_sum_<T>: dkv = [dk | dv], the parts summed in order (dk times scale), in T; the
//                            wgmma dk/dv kernels' too. The split keeps the GPU full when B*KV*key blocks
//                            is small (GQA at short lengths) and shortens the longest block.
// The backward without the dq kernel (FlashAttention-2's: S and dP computed once per score, dQ summed by
// f32 atomics, so not bitwise reproducible):
//   flash_mma_bwd_prep_dD_<T>: per 64 queries of one head, zeroes their rows of dq_acc ([B, H, T, D] f32)
//                            and (first head) writes their spans, as the dq kernel does.
//   flash_mma_bwd_dkvq_dD_<T>: the dk/dv kernel that also adds dQ = dS K of each 16 queries against its 64
//                            keys into dq_acc (dS through shared memory; each warp a quarter of D).
//   flash_mma_bwd_dq_out_dD_<T>: dq = scale dq_acc in T.
// 128 threads (4 warps) per block; f32 accumulators; tiles in shared memory as T with a row stride of
// D + 8 (16-byte rows, no bank conflicts between the 8 rows a fragment load reads). Shared memory per
// kernel: see the host (src/kernels/flash_mma.rs).

#include "common.cuh"
#include "cp_async.cuh"
#include "flash_rows.cuh"
#include "mma.cuh"

#define MMA_THREADS 128
#define FWD_BQ 64
#define FWD_BK 32
#define DQ_BQ 64
#define DQ_BK 32
#define DKV_BK 64
#define DKV_BQ 16

// Rows r0.. r0 + n of a [rows, D] matrix into a shared tile (row stride ld); rows >= limit are 0.
template <typename T>
__device__ void stage_rows(T *dst, const T *src, uint32_t r0, uint32_t n, uint32_t limit, uint32_t d, uint32_t ld) {
    for (uint32_t e = threadIdx.x; e < n * d; e += MMA_THREADS) {
        const uint32_t r = e / d, x = e % d;
        dst[r * ld + x] = (r0 + r < limit) ? src[(size_t)(r0 + r) * d + x] : from_f32<T>(0.f);
    }
}

// stage_rows by asynchronous 16-byte copies when `src` is 16-byte aligned (the caller commits and waits;
// rows >= limit are zero-filled), else at once. The tile's rows (stride ld) are 16-byte aligned.
template <typename T, int D>
__device__ void stage_rows_async(T *dst, const T *src, uint32_t r0, uint32_t n, uint32_t limit, uint32_t ld) {
    constexpr uint32_t V = 16 / sizeof(T), CHUNKS = D / V;  // elements per copy, copies per row
    if (((uintptr_t)src & 15) != 0) {
        stage_rows(dst, src, r0, n, limit, D, ld);
        return;
    }
    for (uint32_t e = threadIdx.x; e < n * CHUNKS; e += MMA_THREADS) {
        const uint32_t r = e / CHUNKS, x = (e % CHUNKS) * V;
        const bool in = r0 + r < limit;
        cp_async16(dst + r * ld + x, in ? src + (size_t)(r0 + r) * D + x : src, in ? 16u : 0u);
    }
}

// Block j0's keys and values (BK rows each) into stage st of `tiles` ([2 stages][K, V][BK][ld]), as one
// group of asynchronous copies.
template <typename T, int D, int BK>
__device__ __forceinline__ void stage_kv(T *tiles, const T *kh, const T *vh, uint32_t j0, uint32_t st, uint32_t s,
                                         uint32_t ld) {
    stage_rows_async<T, D>(tiles + 2 * st * BK * ld, kh, j0, BK, s, ld);
    stage_rows_async<T, D>(tiles + (2 * st + 1) * BK * ld, vh, j0, BK, s, ld);
    cp_async_commit();
}

// Before computing on key block j0 (in stage st, its copies issued): issue block j0 + BK's into the other
// stage when there is one (<= kmax), wait for block j0's, and make every thread's copies visible. Returns
// the stage's K tile; its V tile follows at + BK * ld.
template <typename T, int D, int BK>
__device__ __forceinline__ const T *next_kv(T *tiles, const T *kh, const T *vh, uint32_t j0, uint32_t kmax,
                                            uint32_t st, uint32_t s, uint32_t ld) {
    if (kmax - j0 >= BK) {
        stage_kv<T, D, BK>(tiles, kh, vh, j0 + BK, st ^ 1, s, ld);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
    return tiles + 2 * st * BK * ld;
}

// s[16, KB] = A Y^T: A this warp's [16, D] fragments `af` (registers), Y a row-major shared tile of KB rows
// (row stride ld): the scores of 16 queries against KB keys (or dO against V).
template <typename T, int KB, int D>
__device__ __forceinline__ void scores(float s[KB / 8][4], const uint32_t af[D / 16][4], const T *y, uint32_t ld) {
#pragma unroll
    for (int n = 0; n < KB / 8; ++n)
        for (int i = 0; i < 4; ++i) s[n][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int n = 0; n < KB / 8; n += 2) {
            uint32_t bf[2][2];
            frag_bt2(bf, y, ld, 8 * n, 16 * kk);
            mma_16816<T>(s[n], af[kk], bf[0]);
            mma_16816<T>(s[n + 1], af[kk], bf[1]);
        }
    }
}

// acc[16, D] += A B: A the [16, KB] block of this warp's accumulators `a` (as the next product's
// fragments), B [KB, D] a row-major shared tile (row stride ld).
template <typename T, int KB, int D>
__device__ __forceinline__ void mma_acc_by_tile(float acc[D / 8][4], const float a[KB / 8][4], const T *b,
                                                uint32_t ld) {
#pragma unroll
    for (int kk = 0; kk < KB / 16; ++kk) {
        uint32_t af[4];
        frag_from_acc<T>(af, a[2 * kk], a[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t bf[2][2];
            frag_b2(bf, b, ld, 8 * n, 16 * kk);
            mma_16816<T>(acc[n], af, bf[0]);
            mma_16816<T>(acc[n + 1], af, bf[1]);
        }
    }
}

template <typename T, int D>
__device__ void flash_mma_fwd(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                              const uint32_t *__restrict__ ranges, float *__restrict__ lse, T *__restrict__ out,
                              uint32_t h, uint32_t kv, uint32_t t, uint32_t s, float scale) {
    extern __shared__ uint32_t mma_smem[];
    const uint32_t ld = D + 8;
    T *tiles = (T *)mma_smem;                       // [2 stages][keys, values][FWD_BK][ld]
    uint32_t *los = (uint32_t *)(tiles + 4 * FWD_BK * ld);  // [FWD_BQ]
    uint32_t *his = los + FWD_BQ;                   // [FWD_BQ]
    const auto [bh, b, i0, m0, kh, vh] = query_block<T, D, FWD_BQ>(k, v, h, kv, s);

    uint32_t qf[D / 16][4];
    query_frags<T, D>(qf, q, bh, i0, m0, t);
    uint32_t kmin, kmax;
    mma_row_ranges<MMA_THREADS>(ranges, b, i0, FWD_BQ, t, s, los, his, kmin, kmax);
    const QueryRows rows = query_rows(los, his, nullptr, nullptr, bh, t, i0, m0);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
    zero_acc(o);

    // Key blocks through two stages: block j + 1 is copied in while block j is computed on.
    if (kmin <= kmax) stage_kv<T, D, FWD_BK>(tiles, kh, vh, kmin, 0, s, ld);
    for (uint32_t j0 = kmin, st = 0; kmin <= kmax && j0 <= kmax; j0 += FWD_BK, st ^= 1) {
        const T *ks = next_kv<T, D, FWD_BK>(tiles, kh, vh, j0, kmax, st, s, ld), *vs = ks + FWD_BK * ld;
        float sc[FWD_BK / 8][4];
        scores<T, FWD_BK, D>(sc, qf, ks, ld);
        online_softmax<FWD_BK, D>(sc, o, m, l, rows, j0, scale);
        mma_acc_by_tile<T, FWD_BK, D>(o, sc, vs, ld);
        __syncthreads();  // every warp is done with this stage before it is filled again
    }
    store_forward<T, D>(out + (size_t)bh * t * D, lse + (size_t)bh * t, o, m, l, i0 + m0, t, scale);
}

template <typename T, int D>
__device__ void flash_mma_bwd_dq(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                 const T *__restrict__ dout, const uint32_t *__restrict__ ranges,
                                 const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dq,
                                 uint32_t *__restrict__ spans, uint32_t h, uint32_t kv, uint32_t t, uint32_t s,
                                 float scale) {
    extern __shared__ uint32_t mma_smem[];
    const uint32_t ld = D + 8;
    T *tiles = (T *)mma_smem;                       // [2 stages][keys, values][DQ_BK][ld]
    uint32_t *los = (uint32_t *)(tiles + 4 * DQ_BK * ld);  // [DQ_BQ]
    uint32_t *his = los + DQ_BQ;                    // [DQ_BQ]
    const auto [bh, b, i0, m0, kh, vh] = query_block<T, D, DQ_BQ>(k, v, h, kv, s);

    uint32_t qf[D / 16][4], gf[D / 16][4];
    query_frags<T, D>(qf, q, bh, i0, m0, t);
    query_frags<T, D>(gf, dout, bh, i0, m0, t);
    uint32_t kmin, kmax;
    mma_row_ranges<MMA_THREADS>(ranges, b, i0, DQ_BQ, t, s, los, his, kmin, kmax);
    if (bh % h == 0) write_spans<DQ_BQ>(spans, los, his, b, i0, t);
    const QueryRows rows = query_rows(los, his, lse, delta, bh, t, i0, m0);
    float acc[D / 8][4];
    zero_acc(acc);

    // Key blocks through two stages, as in the forward.
    if (kmin <= kmax) stage_kv<T, D, DQ_BK>(tiles, kh, vh, kmin, 0, s, ld);
    for (uint32_t j0 = kmin, st = 0; kmin <= kmax && j0 <= kmax; j0 += DQ_BK, st ^= 1) {
        const T *ks = next_kv<T, D, DQ_BK>(tiles, kh, vh, j0, kmax, st, s, ld), *vs = ks + DQ_BK * ld;
        float sc[DQ_BK / 8][4], dp[DQ_BK / 8][4];
        scores<T, DQ_BK, D>(sc, qf, ks, ld);
        scores<T, DQ_BK, D>(dp, gf, vs, ld);
        score_grads<DQ_BK>(sc, dp, rows, j0, scale);  // sc becomes dS
        mma_acc_by_tile<T, DQ_BK, D>(acc, sc, ks, ld);
        __syncthreads();  // every warp is done with this stage before it is filled again
    }
    const float scales[2] = {scale, scale};
    store_acc<T, D>(dq + (size_t)bh * t * D, acc, scales, i0 + m0, t);
}

// dq_acc[rows i0.., 16 queries] += dS K for this block's 64 keys: dS^T (this warp's 16 keys against the 16
// queries, accumulators `ds`) through the shared tile dss ([DKV_BQ][DKV_BK + 8]), then each warp the
// product for a quarter of D's columns, added by f32 atomics (rows >= t skipped).
template <typename T, int D>
__device__ __forceinline__ void add_dq(float *dq_acc, T *dss, const float ds[DKV_BQ / 8][4], const T *ks,
                                       uint32_t ld, uint32_t i0, uint32_t t) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const uint32_t lds = DKV_BK + 8, m0 = 16 * warp, n0 = warp * (D / 4);
#pragma unroll
    for (int n = 0; n < DKV_BQ / 8; ++n)
        for (int i = 0; i < 4; ++i) dss[(8 * n + 2 * c + i % 2) * lds + m0 + g + 8 * (i / 2)] = from_f32<T>(ds[n][i]);
    __syncthreads();
    float acc[D / 32][4];
#pragma unroll
    for (int n = 0; n < D / 32; ++n)
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DKV_BK / 16; ++kk) {
        uint32_t af[4];
        frag_a(af, dss, lds, 0, 16 * kk);
#pragma unroll
        for (int n = 0; n < D / 32; n += 2) {
            uint32_t bf[2][2];
            frag_b2(bf, ks, ld, n0 + 8 * n, 16 * kk);
            mma_16816<T>(acc[n], af, bf[0]);
            mma_16816<T>(acc[n + 1], af, bf[1]);
        }
    }
    for (int r = 0; r < 2; ++r) {
        const uint32_t i = i0 + g + 8 * r;
        if (i >= t) continue;
#pragma unroll
        for (int n = 0; n < D / 32; ++n)
            for (int x = 0; x < 2; ++x) atomicAdd(&dq_acc[(size_t)i * D + n0 + 8 * n + 2 * c + x], acc[n][2 * r + x]);
    }
}

// The dk/dv kernel; with DQ, also dQ into dq_acc ([B, H, T, D] f32, zeroed) by add_dq. Grid: x = (KV head
// bkv, part) as bkv * split + part, y = key block (the first keys' blocks, which the most queries see,
// start first); each block's dk and dv over its part of the group's query heads, unscaled, into its share
// of `parts` ([split][dk | dv] f32), summed by bwd_dkv_sum.
template <typename T, int D, bool DQ>
__device__ void flash_mma_bwd_dkv(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                  const T *__restrict__ dout, const uint32_t *__restrict__ ranges,
                                  const float *__restrict__ lse, const float *__restrict__ delta,
                                  float *__restrict__ parts, const uint32_t *__restrict__ spans, float *dq_acc,
                                  uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t split, float scale) {
    extern __shared__ uint32_t mma_smem[];
    const uint32_t ld = D + 8;
    T *ks = (T *)mma_smem;                          // [DKV_BK][ld] keys
    T *vs = ks + DKV_BK * ld;                       // [DKV_BK][ld] values
    T *qs = vs + DKV_BK * ld;                       // [DKV_BQ][ld] queries
    T *gs = qs + DKV_BQ * ld;                       // [DKV_BQ][ld] output gradients
    QueryStat *stats = (QueryStat *)(gs + DKV_BQ * ld);  // [DKV_BQ] key ranges, log-sum-exp, delta
    T *dss = (T *)(stats + DKV_BQ);                       // with DQ: [DKV_BQ][DKV_BK + 8] dS
    const uint32_t bkv = blockIdx.x / split, b = bkv / kv;
    const uint32_t j0 = blockIdx.y * DKV_BK, j_last = min(j0 + DKV_BK, s) - 1;
    uint32_t hq_first, hq_end;
    dkv_heads(bkv % kv, h / kv, blockIdx.x % split, split, hq_first, hq_end);
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t m0 = 16 * warp;
    stage_rows_async<T, D>(ks, k + (size_t)bkv * s * D, j0, DKV_BK, s, ld);
    stage_rows_async<T, D>(vs, v + (size_t)bkv * s * D, j0, DKV_BK, s, ld);
    cp_async_commit();
    float dk[D / 8][4], dv[D / 8][4];
    zero_acc(dk);
    zero_acc(dv);

    for (uint32_t hq = hq_first; hq < hq_end; ++hq) {
        const uint32_t bh = b * h + hq;
        for (uint32_t i0 = 0; i0 < t; i0 += DKV_BQ) {
            // Only query blocks whose keys' span meets this block's (the same test in every thread).
            const uint32_t *span = spans + ((size_t)b * ((t + 15) / 16) + i0 / 16) * 2;
            if (span[0] > j_last || span[1] < j0) continue;
            __syncthreads();
            for (uint32_t r = threadIdx.x; r < DKV_BQ; r += MMA_THREADS) {
                uint32_t rlo, rhi;
                mma_range(ranges, b, i0 + r, t, s, rlo, rhi);
                const bool in = i0 + r < t;
                stats[r] = query_stat(rlo, rhi, in ? lse[(size_t)bh * t + i0 + r] : 0.f,
                                      in ? delta[(size_t)bh * t + i0 + r] : 0.f);
            }
            stage_rows_async<T, D>(qs, q + (size_t)bh * t * D, i0, DKV_BQ, t, ld);
            stage_rows_async<T, D>(gs, dout + (size_t)bh * t * D, i0, DKV_BQ, t, ld);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            // Rows: this warp's 16 keys; columns: the block's 16 queries (two n-tiles).
            float sc[DKV_BQ / 8][4], dp[DKV_BQ / 8][4];
#pragma unroll
            for (int n = 0; n < DKV_BQ / 8; ++n)
                for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t af[4], bf[2][2];
                frag_a(af, ks, ld, m0, 16 * kk);
                frag_bt2(bf, qs, ld, 0, 16 * kk);
                mma_16816<T>(sc[0], af, bf[0]);
                mma_16816<T>(sc[1], af, bf[1]);
                frag_a(af, vs, ld, m0, 16 * kk);
                frag_bt2(bf, gs, ld, 0, 16 * kk);
                mma_16816<T>(dp[0], af, bf[0]);
                mma_16816<T>(dp[1], af, bf[1]);
            }
            probs_t<DKV_BQ>(sc, dp, stats, j0 + m0, scale);  // P^T and dS^T
            uint32_t pf[4], df[4];
            frag_from_acc<T>(pf, sc[0], sc[1]);
            frag_from_acc<T>(df, dp[0], dp[1]);
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t bf[2][2];
                frag_b2(bf, gs, ld, 8 * n, 0);
                mma_16816<T>(dv[n], pf, bf[0]);
                mma_16816<T>(dv[n + 1], pf, bf[1]);
                frag_b2(bf, qs, ld, 8 * n, 0);
                mma_16816<T>(dk[n], df, bf[0]);
                mma_16816<T>(dk[n + 1], df, bf[1]);
            }
            if (DQ) add_dq<T, D>(dq_acc + (size_t)bh * t * D, dss, dp, ks, ld, i0, t);
        }
    }
    cp_async_wait<0>();  // the key and value tiles, when no query block saw them
    // The block's part and KV head read again from its index (not held in registers through the loop).
    const size_t nk = (size_t)(gridDim.x / split) * s * D;
    store_dkv_part<D>(parts + 2 * nk * (blockIdx.x % split), dk, dv, blockIdx.x / split, j0 + m0, s, nk);
}

// Rows i0.. i0 + 64 of head bh of dq_acc zeroed; the first head's block also writes their spans.
template <int D>
__device__ void flash_mma_bwd_prep(const uint32_t *__restrict__ ranges, uint32_t *__restrict__ spans,
                                   float *__restrict__ dq_acc, uint32_t h, uint32_t t, uint32_t s) {
    __shared__ uint32_t los[DQ_BQ], his[DQ_BQ];
    const uint32_t bh = blockIdx.y, b = bh / h, i0 = blockIdx.x * DQ_BQ, rows = min(DQ_BQ, t - i0);
    float *acc = dq_acc + ((size_t)bh * t + i0) * D;
    for (uint32_t e = threadIdx.x; e < rows * D; e += MMA_THREADS) acc[e] = 0.f;
    if (bh % h != 0) return;  // the same test in every thread of the block
    uint32_t kmin, kmax;
    mma_row_ranges<MMA_THREADS>(ranges, b, i0, DQ_BQ, t, s, los, his, kmin, kmax);
    write_spans<DQ_BQ>(spans, los, his, b, i0, t);
}

// dkv = the sum of the dk/dv kernel's `split` partial sums ([split][2 nk] f32), dk (the first nk) times
// scale; 1-D grid, any size.
template <typename T>
__device__ void flash_mma_bwd_dkv_sum(const float *__restrict__ parts, T *__restrict__ dkv, uint32_t nk, uint32_t split,
                                      float scale) {
    const size_t n = 2 * (size_t)nk;
    for (size_t e = (size_t)blockIdx.x * MMA_THREADS + threadIdx.x; e < n; e += (size_t)gridDim.x * MMA_THREADS) {
        float sum = 0.f;
        for (uint32_t p = 0; p < split; ++p) sum += parts[p * n + e];
        dkv[e] = from_f32<T>(e < nk ? scale * sum : sum);
    }
}

// dq = scale dq_acc, rows i0.. i0 + 64 of head bh.
template <typename T, int D>
__device__ void flash_mma_bwd_dq_out(const float *__restrict__ dq_acc, T *__restrict__ dq, uint32_t t, float scale) {
    const uint32_t bh = blockIdx.y, i0 = blockIdx.x * DQ_BQ, rows = min(DQ_BQ, t - i0);
    const size_t base = ((size_t)bh * t + i0) * D;
    for (uint32_t e = threadIdx.x; e < rows * D; e += MMA_THREADS) dq[base + e] = from_f32<T>(scale * dq_acc[base + e]);
}

#define FLASH_MMA_KERNELS(NAME, T, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_fwd_##NAME(const T *q, const T *k, const T *v, const uint32_t *ranges, float *lse, T *out,     \
                             uint32_t h, uint32_t kv, uint32_t t, uint32_t s, float scale) {                     \
        flash_mma_fwd<T, D>(q, k, v, ranges, lse, out, h, kv, t, s, scale);                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_bwd_dq_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,       \
                                const float *lse, const float *delta, T *dq, uint32_t *spans, uint32_t h,        \
                                uint32_t kv, uint32_t t, uint32_t s, float scale) {                              \
        flash_mma_bwd_dq<T, D>(q, k, v, dout, ranges, lse, delta, dq, spans, h, kv, t, s, scale);                \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_bwd_dkv_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,      \
                                 const float *lse, const float *delta, float *parts, const uint32_t *spans,     \
                                 uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t split, float scale) { \
        flash_mma_bwd_dkv<T, D, false>(q, k, v, dout, ranges, lse, delta, parts, spans, nullptr, h, kv, t, s, split, \
                                       scale);                                                                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_bwd_prep_##NAME(const uint32_t *ranges, uint32_t *spans, float *dq_acc, uint32_t h, uint32_t t, \
                                  uint32_t s) {                                                                  \
        flash_mma_bwd_prep<D>(ranges, spans, dq_acc, h, t, s);                                                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_bwd_dkvq_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,     \
                                  const float *lse, const float *delta, float *parts, const uint32_t *spans,     \
                                  float *dq_acc, uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t split, \
                                  float scale) {                                                                 \
        flash_mma_bwd_dkv<T, D, true>(q, k, v, dout, ranges, lse, delta, parts, spans, dq_acc, h, kv, t, s, split, \
                                      scale);                                                                    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_bwd_dq_out_##NAME(const float *dq_acc, T *dq, uint32_t t, float scale) {                       \
        flash_mma_bwd_dq_out<T, D>(dq_acc, dq, t, scale);                                                        \
    }

FLASH_MMA_KERNELS(d64_bf16, __nv_bfloat16, 64)
FLASH_MMA_KERNELS(d128_bf16, __nv_bfloat16, 128)
FLASH_MMA_KERNELS(d64_f16, __half, 64)
FLASH_MMA_KERNELS(d128_f16, __half, 128)

#define FLASH_MMA_SUM(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                    \
        flash_mma_bwd_dkv_sum_##NAME(const float *parts, T *dkv, uint32_t nk, uint32_t split, float scale) {     \
        flash_mma_bwd_dkv_sum<T>(parts, dkv, nk, split, scale);                                                  \
    }

FLASH_MMA_SUM(bf16, __nv_bfloat16)
FLASH_MMA_SUM(f16, __half)
