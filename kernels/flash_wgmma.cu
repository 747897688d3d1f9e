// Attention block by block on Hopper's warpgroup tensor cores (wgmma.mma_async, wgmma.cuh; compiled for
// sm_90a only): the same inputs, outputs and arithmetic as flash_mma.cu's kernels (src/kernels/
// flash_attention.rs has the definitions and the CPU reference), for bf16 and f16 and a head dim D of 64
// or 128, with each block product one warpgroup-wide m64 instruction on 64 x 64 (or 64 x D) tiles
// instead of mma.sync's 16 x 8. 256 threads (two warpgroups) per block; tiles in shared memory in the
// 128-byte swizzle, filled by cp.async; more than 48 KiB of shared memory (the host opts each kernel in).
// The forward, the dq kernel and the dk/dv kernels at D = 64 share one schedule (flash_wgmma_fwd): a ring
// of five slots that each warpgroup fills and publishes by halves (named barriers), the two warpgroups
// taking turns to issue their products, each pipelined; the dk/dv kernels at D = 128 run two stages.
//
// q, dout, out: [B, H, T, D]; k, v: [B, KV, S, D] (query head h reads KV head h / (H / KV));
// ranges[(b * T + i) * 2 ..] = (lo, hi): the keys query (b, i) sees; lse, delta: [B, H, T] f32.
//   flash_wgmma_fwd_dD_<T>:    128 queries of one head per block (64 per warpgroup, 16 per warp, their
//                              fragments in registers), keys in blocks of 64: S = Q K^T (A: Q's registers,
//                              B: the K tile, K-major), then O += P V (A: P from S's accumulators, B: the V
//                              tile, MN-major).
//   flash_wgmma_bwd_dq_dD_<T>: 128 queries per block, keys in blocks of 64: S = Q K^T, dP = dO V^T,
//                              dS = P (dP - delta), dQ += dS K (the previous block's, while this block's
//                              dS is computed); also the span of keys each 16 queries see
//                              (spans: [B, ceil(T / 16), 2] u32), for the dk/dv kernel.
//   flash_wgmma_bwd_dkv_dD_<T>: 128 keys of one KV head per block (64 per warpgroup; grid: B*KV*split x
//                              key blocks), over the queries of its part (of `split`) of its group's heads
//                              in blocks of 64 that see one of its keys (by spans, read once into a
//                              bitmask of query blocks in shared memory): S^T = K Q^T and dP^T =
//                              V dO^T (A and B from shared tiles), dV += P^T dO, dK += dS^T Q (A from
//                              registers); each part's f32 sums into parts ([split][dk (B*KV*S*D) | dv]),
//                              summed into dkv by flash_mma.cu's bwd_dkv_sum.
//   flash_wgmma_bwd_dkvq_dD_<T>: the dk/dv kernel that also adds dQ = dS K of each 64-query step against its
//                              128 keys into dq_acc ([B, H, T, D] f32, zeroed by flash_mma.cu's bwd_prep,
//                              scaled out by its bwd_dq_out): dS^T through a swizzled shared tile, then a
//                              warpgroup product per 64 of D's columns (or of the keys), f32 atomics.
// Shared memory per kernel: see the host (src/kernels/flash_wgmma.rs).

#include "barrier.cuh"
#include "common.cuh"
#include "cp_async.cuh"
#include "flash_rows.cuh"
#include "wgmma.cuh"

#define WG_THREADS 256
#define WG_BQ 128    // queries per block of the forward and the dq kernel
#define WG_BK 64     // keys per step of the forward and the dq kernel
#define WG_FWD_SLOTS 5  // K and V tiles the forward holds: being read (2), published, being filled, retiring
#define WG_DKV_BK 128  // keys per block of the dk/dv kernel
#define WG_DKV_BQ 64   // queries per step of the dk/dv kernel

// The first 1024-byte aligned address of the dynamic shared memory (the swizzle's alignment).
template <typename T> __device__ __forceinline__ T *wg_aligned(void *smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (T *)((unsigned char *)smem + ((1024u - (a & 1023u)) & 1023u));
}

// Rows first.. first + count of the swizzled tile dst (R rows), from rows r0 + first.. of a [rows, D]
// matrix (rows >= limit are 0), by threads tid of `threads`: asynchronous 16-byte copies when src is
// 16-byte aligned (the caller commits and waits), else at once.
template <typename T, int D, int R>
__device__ void stage_rows(T *dst, const T *src, uint32_t r0, uint32_t limit, uint32_t first, uint32_t count,
                           uint32_t tid, uint32_t threads) {
    constexpr uint32_t CHUNKS = D / 8;  // 16-byte copies per row
    const bool aligned = ((uintptr_t)src & 15) == 0;
    for (uint32_t e = tid; e < count * CHUNKS; e += threads) {
        const uint32_t r = first + e / CHUNKS, x = (e % CHUNKS) * 8;
        const bool in = r0 + r < limit;
        T *to = dst + wg_at<R>(r, x);
        if (aligned) {
            cp_async16(to, in ? src + (size_t)(r0 + r) * D + x : src, in ? 16u : 0u);
        } else {
            for (uint32_t i = 0; i < 8; ++i) to[i] = in ? src[(size_t)(r0 + r) * D + x + i] : from_f32<T>(0.f);
        }
    }
}

// Rows r0.. r0 + R of a [rows, D] matrix into the swizzled tile dst by the whole block.
template <typename T, int D, int R>
__device__ void stage_swizzled(T *dst, const T *src, uint32_t r0, uint32_t limit) {
    stage_rows<T, D, R>(dst, src, r0, limit, 0, R, threadIdx.x, WG_THREADS);
}

// After this thread's copies into a stage are waited for: makes every thread's writes visible to the
// tensor cores' reads (fence.proxy.async, then a barrier).
__device__ __forceinline__ void wg_publish() {
    wg_fence_proxy();
    __syncthreads();
}

// acc[64 rows, N] (+)= A Y^T for this warpgroup: A its [64, D] rows as fragments `af` (registers), Y a
// swizzled tile of N rows (K-major: the product's k is Y's columns), by its descriptor (LBO 16) or address.
template <typename T, int N, int D>
__device__ __forceinline__ void wg_rows_by_desc(float (&acc)[N / 8][4], const uint32_t (&af)[D / 16][4], uint64_t yd) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_rs<T, N, 0>(acc, af[kk], wg_desc_at(yd, (kk / 4) * N * 64 + (kk % 4) * 16), kk > 0);
}
template <typename T, int N, int D>
__device__ __forceinline__ void wg_rows_by_tile(float (&acc)[N / 8][4], const uint32_t (&af)[D / 16][4], const T *y) {
    wg_rows_by_desc<T, N, D>(acc, af, wg_desc(y, 16));
}

// The [64, KB] block of this warpgroup's accumulators `a` as A fragments of the next product (before
// its wg_begin: registers written after a wgmma.fence would need another).
template <typename T, int KB>
__device__ __forceinline__ void wg_frags(uint32_t (&af)[KB / 16][4], const float (&a)[KB / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < KB / 16; ++kk) frag_from_acc<T>(af[kk], a[2 * kk], a[2 * kk + 1]);
}

// acc[64 rows, D] += A Y for this warpgroup: A [64, KB] as fragments `af` (wg_frags), Y a swizzled tile of
// KB rows (MN-major: the product's k is Y's rows), by its descriptor (LBO KB * 128) or address.
template <typename T, int KB, int D>
__device__ __forceinline__ void wg_acc_by_desc(float (&acc)[D / 8][4], const uint32_t (&af)[KB / 16][4], uint64_t yd) {
#pragma unroll
    for (int kk = 0; kk < KB / 16; ++kk) wgmma_rs<T, D, 1>(acc, af[kk], wg_desc_at(yd, kk * 16 * 64), 1);
}
template <typename T, int KB, int D>
__device__ __forceinline__ void wg_acc_by_tile(float (&acc)[D / 8][4], const uint32_t (&af)[KB / 16][4], const T *y) {
    wg_acc_by_desc<T, KB, D>(acc, af, wg_desc(y, KB * 128));
}

// The forward's named barriers (barrier.cuh) for warpgroup w (ids 1..12):
//   wg_full(w, st): w's half of the K and V tiles in slot st is in and fenced (w arrives; the other
//                   warpgroup syncs before its products on the slot);
//   wg_turn(w):     w may issue its products (the other arrives when it has issued its own).
__device__ __forceinline__ uint32_t wg_full(uint32_t w, uint32_t st) { return 1 + 2 * st + w; }
__device__ __forceinline__ uint32_t wg_turn(uint32_t w) { return 1 + 2 * WG_FWD_SLOTS + w; }

// The slots of steps j (at), j + 1 (next) and j + 2 (after) in a ring of N, and step j - 1's (last), moved
// on by a compare a step rather than computed by divisions.
template <uint32_t N> struct RingSlots {
    uint32_t last = N - 1, at = 0, next = 1, after = 2;
    __device__ __forceinline__ void advance() {
        last = at, at = next, next = after, after = after + 1 == N ? 0 : after + 1;
    }
};

// Whether rows of 16-bit values at a and b start 16-byte aligned (rows of D, a multiple of 8, values
// apart): the copies' fast path.
__device__ __forceinline__ bool rows_aligned16(const void *a, const void *b) {
    return (((uintptr_t)a | (uintptr_t)b) & 15) == 0;
}

// Warpgroup w's half (rows 32 w.. 32 w + 31) of rows j0.. j0 + 63 of two [s, D] matrices a and b into the
// swizzled tiles at and bt (64 rows each): the forward's K and V, the dk/dv kernel's Q and dO; one group of
// copies. Aligned, each thread copies the same 16-byte chunk x of rows r, r + STEP, ..: STEP, a multiple of
// 8, keeps the row's swizzle, so that one tile offset and one matrix offset serve every copy.
template <typename T, int D>
__device__ __forceinline__ void wg_stage_half(T *at, T *bt, const T *a, const T *b, uint32_t j0, uint32_t s, uint32_t w) {
    constexpr uint32_t HALF = WG_BK / 2, CHUNKS = D / 8, STEP = 128 / CHUNKS;
    static_assert(STEP % 8 == 0 && HALF % STEP == 0, "a thread's rows share their swizzle");
    if (rows_aligned16(a, b)) {
        const uint32_t tid = threadIdx.x % 128, r = HALF * w + tid / CHUNKS, x = (tid % CHUNKS) * 8;
        const uint32_t to = wg_at<WG_BK>(r, x), sa = (uint32_t)__cvta_generic_to_shared(at + to);
        const uint32_t sb = (uint32_t)__cvta_generic_to_shared(bt + to);
#pragma unroll
        for (uint32_t i = 0; i < HALF / STEP; ++i) {
            const uint32_t row = j0 + r + i * STEP;
            const bool in = row < s;
            const size_t from = in ? (size_t)row * D + x : 0;
            cp_async16_at(sa + i * STEP * 128, a + from, in ? 16u : 0u);
            cp_async16_at(sb + i * STEP * 128, b + from, in ? 16u : 0u);
        }
    } else {
        stage_rows<T, D, WG_BK>(at, a, j0, s, HALF * w, HALF, threadIdx.x % 128, 128);
        stage_rows<T, D, WG_BK>(bt, b, j0, s, HALF * w, HALF, threadIdx.x % 128, 128);
    }
    cp_async_commit();
}

// Warpgroup w's half of slot st published: this thread's copies into it waited for (`newer`: the group
// after it may stay pending), fenced for the tensor cores, and announced to the other warpgroup.
__device__ __forceinline__ void wg_publish_half(uint32_t w, uint32_t st, bool newer) {
    if (newer) {
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    wg_fence_proxy();
    bar_arrive(wg_full(w, st), WG_THREADS);
}

// The forward, FlashAttention-3's schedule without its producer warpgroup:
// - ping-pong between the two warpgroups: each issues its products only after the other has issued its
//   own (wg_turn), so that one warpgroup's softmax runs while the other's products do;
// - pipelined within a warpgroup: step j issues S_j = Q K_j^T, rescales O to block j - 1's running max
//   while it runs, issues O += P_{j-1} V_{j-1}, and computes block j's softmax while that product runs
//   (after waiting for S_j only); step 0 has no P V, and a last turn issues block n - 1's;
// - no block-wide barrier in the loop: each warpgroup copies half of every K and V tile into a ring of
//   five slots, block j + 2 at the start of step j, and publishes its half of block j + 1 right after
//   issuing step j's products (wg_full), so that neither warpgroup waits for the other's softmax. Syncing
//   on the other's half of block j also tells a warpgroup that the other has retired its products on block
//   j - 3, whose slot block j + 2 refills.
template <typename T, int D>
__device__ void flash_wgmma_fwd(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                const uint32_t *__restrict__ ranges, float *__restrict__ lse, T *__restrict__ out,
                                uint32_t h, uint32_t kv, uint32_t t, uint32_t s, float scale) {
    extern __shared__ uint32_t wg_smem[];
    T *tiles = wg_aligned<T>(wg_smem);                                    // [slots][keys, values][WG_BK x D]
    uint32_t *los = (uint32_t *)(tiles + 2 * WG_FWD_SLOTS * WG_BK * D);  // [WG_BQ]
    uint32_t *his = los + WG_BQ;                                          // [WG_BQ]
    const auto [bh, b, i0, m0, kh, vh] = query_block<T, D, WG_BQ>(k, v, h, kv, s);

    uint32_t qf[D / 16][4];
    query_frags<T, D>(qf, q, bh, i0, m0, t);
    uint32_t kmin, kmax;
    mma_row_ranges<WG_THREADS>(ranges, b, i0, WG_BQ, t, s, los, his, kmin, kmax);
    const QueryRows rows = query_rows(los, his, nullptr, nullptr, bh, t, i0, m0);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2] = {0.f, 0.f};
    float o[D / 8][4];
    zero_acc(o);

    const uint32_t w = wg_index(), n = kmin <= kmax ? (kmax - kmin) / WG_BK + 1 : 0;
    const auto slot = [&](uint32_t st) { return tiles + 2 * st * WG_BK * D; };
    const auto stage = [&, kh = kh, vh = vh](uint32_t j, uint32_t st) {
        wg_stage_half<T, D>(slot(st), slot(st) + WG_BK * D, kh, vh, kmin + j * WG_BK, s, w);
    };
    RingSlots<WG_FWD_SLOTS> ring;
    if (n > 0) {  // every product outside a branch within the loop: ptxas serialises wgmma in divergent paths
        float sc[WG_BK / 8][4];
        uint32_t pf[WG_BK / 16][4];
        stage(0, 0);
        if (n > 1) stage(1, 1);
        wg_publish_half(w, 0, n > 1);
        if (w == 1) bar_arrive(wg_turn(0), WG_THREADS);  // warpgroup 0 goes first
        bar_sync(wg_full(w ^ 1, 0), WG_THREADS);
        if (n > 2) stage(2, 2);
        bar_sync(wg_turn(w), WG_THREADS);
        wg_begin(sc);
        wg_rows_by_tile<T, WG_BK, D>(sc, qf, slot(0));
        wg_commit();
        bar_arrive(wg_turn(w ^ 1), WG_THREADS);
        if (n > 1) wg_publish_half(w, 1, n > 2);
        wg_wait<0>(sc);
        softmax_step<WG_BK>(sc, m, l, alpha, rows, kmin, scale);  // o is zero: nothing to rescale
        wg_frags<T, WG_BK>(pf, sc);
        for (uint32_t j = 1; j < n; ++j) {
            ring.advance();
            bar_sync(wg_full(w ^ 1, ring.at), WG_THREADS);
            if (j + 2 < n) stage(j + 2, ring.after);
            bar_sync(wg_turn(w), WG_THREADS);
            wg_begin(sc);
            wg_rows_by_tile<T, WG_BK, D>(sc, qf, slot(ring.at));
            wg_commit();
            rescale_rows<D>(o, alpha);
            wg_begin(o);
            wg_acc_by_tile<T, WG_BK, D>(o, pf, slot(ring.last) + WG_BK * D);
            wg_commit();
            bar_arrive(wg_turn(w ^ 1), WG_THREADS);
            if (j + 1 < n) wg_publish_half(w, ring.next, j + 2 < n);
            wg_wait<1>(sc);
            softmax_step<WG_BK>(sc, m, l, alpha, rows, kmin + j * WG_BK, scale);
            wg_wait<0>(o);
            wg_keep(pf);
            wg_frags<T, WG_BK>(pf, sc);
        }
        bar_sync(wg_turn(w), WG_THREADS);
        rescale_rows<D>(o, alpha);
        wg_begin(o);
        wg_acc_by_tile<T, WG_BK, D>(o, pf, slot(ring.at) + WG_BK * D);
        wg_commit();
        if (w == 0) bar_arrive(wg_turn(1), WG_THREADS);  // n + 1 turns each
        wg_wait<0>(o);
        wg_keep(pf);
    }
    store_forward<T, D>(out + (size_t)bh * t * D, lse + (size_t)bh * t, o, m, l, i0 + m0, t, scale);
}

// The dq kernel's loop, the forward's schedule (see flash_wgmma_fwd) with its products: step j issues
// S_j = Q K_j^T and dP_j = dO V_j^T, then dQ += dS_{j-1} K_{j-1}, and computes dS_j while that product runs
// (after waiting for S_j and dP_j only); the two warpgroups take turns to issue (wg_turn); each copies half
// of every K and V tile into the forward's ring of WG_FWD_SLOTS and publishes it by halves (wg_full), no
// block-wide barrier in the loop.
template <typename T, int D>
__device__ __forceinline__ void wg_dq_ring(float (&acc)[D / 8][4], const uint32_t (&qf)[D / 16][4],
                                           const uint32_t (&gf)[D / 16][4], T *tiles, const T *kh, const T *vh,
                                           const QueryRows &rows, uint32_t kmin, uint32_t kmax, uint32_t s, float scale) {
    const uint32_t w = wg_index(), n = (kmax - kmin) / WG_BK + 1;
    const auto slot = [&](uint32_t st) { return tiles + 2 * st * WG_BK * D; };
    const auto stage = [&](uint32_t j, uint32_t st) {
        wg_stage_half<T, D>(slot(st), slot(st) + WG_BK * D, kh, vh, kmin + j * WG_BK, s, w);
    };
    const auto scores = [&](float(&sc)[WG_BK / 8][4], float(&dp)[WG_BK / 8][4], uint32_t st) {
        wg_begin(sc, dp);
        wg_rows_by_tile<T, WG_BK, D>(sc, qf, slot(st));
        wg_rows_by_tile<T, WG_BK, D>(dp, gf, slot(st) + WG_BK * D);
        wg_commit();
    };
    float sc[WG_BK / 8][4], dp[WG_BK / 8][4];
    uint32_t df[WG_BK / 16][4];
    RingSlots<WG_FWD_SLOTS> ring;
    stage(0, 0);
    if (n > 1) stage(1, 1);
    wg_publish_half(w, 0, n > 1);
    if (w == 1) bar_arrive(wg_turn(0), WG_THREADS);  // warpgroup 0 goes first
    bar_sync(wg_full(w ^ 1, 0), WG_THREADS);
    if (n > 2) stage(2, 2);
    bar_sync(wg_turn(w), WG_THREADS);
    scores(sc, dp, 0);
    bar_arrive(wg_turn(w ^ 1), WG_THREADS);
    if (n > 1) wg_publish_half(w, 1, n > 2);
    wg_wait<0>(sc, dp);
    score_grads<WG_BK>(sc, dp, rows, kmin, scale);  // sc becomes dS
    wg_frags<T, WG_BK>(df, sc);
    for (uint32_t j = 1; j < n; ++j) {
        ring.advance();
        bar_sync(wg_full(w ^ 1, ring.at), WG_THREADS);
        if (j + 2 < n) stage(j + 2, ring.after);
        bar_sync(wg_turn(w), WG_THREADS);
        scores(sc, dp, ring.at);
        wg_begin(acc);
        wg_acc_by_tile<T, WG_BK, D>(acc, df, slot(ring.last));
        wg_commit();
        bar_arrive(wg_turn(w ^ 1), WG_THREADS);
        if (j + 1 < n) wg_publish_half(w, ring.next, j + 2 < n);
        wg_wait<1>(sc, dp);
        score_grads<WG_BK>(sc, dp, rows, kmin + j * WG_BK, scale);
        wg_wait<0>(acc);
        wg_keep(df);
        wg_frags<T, WG_BK>(df, sc);
    }
    bar_sync(wg_turn(w), WG_THREADS);
    wg_begin(acc);
    wg_acc_by_tile<T, WG_BK, D>(acc, df, slot(ring.at));
    wg_commit();
    if (w == 0) bar_arrive(wg_turn(1), WG_THREADS);  // n + 1 turns each
    wg_wait<0>(acc);
    wg_keep(df);
}

template <typename T, int D>
__device__ void flash_wgmma_bwd_dq(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                   const T *__restrict__ dout, const uint32_t *__restrict__ ranges,
                                   const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dq,
                                   uint32_t *__restrict__ spans, uint32_t h, uint32_t kv, uint32_t t, uint32_t s,
                                   float scale) {
    extern __shared__ uint32_t wg_smem[];
    T *tiles = wg_aligned<T>(wg_smem);  // [slots][keys, values][WG_BK x D]
    uint32_t *los = (uint32_t *)(tiles + 2 * WG_FWD_SLOTS * WG_BK * D);  // [WG_BQ]
    uint32_t *his = los + WG_BQ;                                               // [WG_BQ]
    const auto [bh, b, i0, m0, kh, vh] = query_block<T, D, WG_BQ>(k, v, h, kv, s);

    uint32_t qf[D / 16][4], gf[D / 16][4];
    query_frags<T, D>(qf, q, bh, i0, m0, t);
    query_frags<T, D>(gf, dout, bh, i0, m0, t);
    uint32_t kmin, kmax;
    mma_row_ranges<WG_THREADS>(ranges, b, i0, WG_BQ, t, s, los, his, kmin, kmax);
    if (bh % h == 0) write_spans<WG_BQ>(spans, los, his, b, i0, t);
    const QueryRows rows = query_rows(los, his, lse, delta, bh, t, i0, m0);
    float acc[D / 8][4];
    zero_acc(acc);

    if (kmin <= kmax) wg_dq_ring<T, D>(acc, qf, gf, tiles, kh, vh, rows, kmin, kmax, s, scale);
    const float scales[2] = {scale, scale};
    store_acc<T, D>(dq + (size_t)bh * t * D, acc, scales, i0 + m0, t);
}

// Stage st's statistics in `stats` ([2 stages][WG_DKV_BQ] QueryStat: each query's key range, log-sum-exp
// and delta).
__device__ __forceinline__ QueryStat *wg_query_stage(QueryStat *stats, uint32_t st) { return stats + st * WG_DKV_BQ; }

// The queries and output gradients of query block i0 of head bh into a stage's tiles (swizzled), as one
// group of copies.
template <typename T, int D>
__device__ void wg_stage_queries(T *qs, T *gs, const T *q, const T *dout, uint32_t bh, uint32_t i0, uint32_t t) {
    stage_swizzled<T, D, WG_DKV_BQ>(qs, q + (size_t)bh * t * D, i0, t);
    stage_swizzled<T, D, WG_DKV_BQ>(gs, dout + (size_t)bh * t * D, i0, t);
    cp_async_commit();
}

// Query r's statistics (r < WG_DKV_BQ; none for another r) of query block i0 of head bh: read from global
// memory a step ahead of their use, into registers, and written to the stage's shared array later
// (wg_store_stats), so that no step waits for their loads.
__device__ __forceinline__ QueryStat wg_load_stats(const uint32_t *ranges, const float *lse, const float *delta,
                                                  uint32_t b, uint32_t bh, uint32_t i0, uint32_t t, uint32_t s,
                                                  uint32_t r) {
    uint32_t lo = 1, hi = 0;
    if (r >= WG_DKV_BQ) return query_stat(lo, hi, 0.f, 0.f);
    mma_range(ranges, b, i0 + r, t, s, lo, hi);
    const bool in = i0 + r < t;
    return query_stat(lo, hi, in ? lse[(size_t)bh * t + i0 + r] : 0.f, in ? delta[(size_t)bh * t + i0 + r] : 0.f);
}

__device__ __forceinline__ void wg_store_stats(QueryStat *stage, const QueryStat &x, uint32_t r) {
    if (r < WG_DKV_BQ) stage[r] = x;
}

// Which query blocks of WG_DKV_BQ rows see one of keys j0..j_last, by the spans: bit qb of mask (words of
// 32 blocks, ceil(ceil(t / WG_DKV_BQ) / 32) of them; a block past the last is 0), one ballot per word, read
// from global memory once per block rather than at every step. The same for every head (spans are per
// row). Ends with a barrier.
__device__ void wg_query_mask(uint32_t *mask, const uint32_t *spans, uint32_t b, uint32_t t, uint32_t j0,
                              uint32_t j_last) {
    const uint32_t nqb = (t + WG_DKV_BQ - 1) / WG_DKV_BQ, words = (nqb + 31) / 32, lane = threadIdx.x % 32;
    for (uint32_t w = threadIdx.x / 32; w < words; w += WG_THREADS / 32) {
        const uint32_t qb = 32 * w + lane, i0 = qb * WG_DKV_BQ;
        const uint32_t *span = spans + ((size_t)b * ((t + 15) / 16) + i0 / 16) * 2;
        bool seen = false;
        for (uint32_t u = 0; qb < nqb && u < WG_DKV_BQ / 16 && i0 + 16 * u < t; ++u)
            seen |= span[2 * u] <= j_last && span[2 * u + 1] >= j0;
        const uint32_t bits = __ballot_sync(0xffffffffu, seen);
        if (lane == 0) mask[w] = bits;
    }
    __syncthreads();
}

// The first queries of the query blocks of mask (wg_query_mask), in order, into list (by the first warp);
// returns their count (every thread). Ends with a barrier. A step then finds its block by one shared
// load rather than a scan of the mask.
__device__ uint32_t wg_query_list(uint32_t *list, const uint32_t *mask, uint32_t t) {
    const uint32_t words = ((t + WG_DKV_BQ - 1) / WG_DKV_BQ + 31) / 32, lane = threadIdx.x % 32;
    uint32_t n = 0;
    for (uint32_t w = 0; w < words; ++w) {
        const uint32_t bits = mask[w];
        if (threadIdx.x < 32 && (bits >> lane & 1))
            list[n + __popc(bits & ((1u << lane) - 1))] = (32 * w + lane) * WG_DKV_BQ;
        n += __popc(bits);
    }
    __syncthreads();
    return n;
}

// p[0] += a and p[1] += b in device memory, atomically each (p 8-byte aligned): one vector reduction
// (red.global.add.v2.f32, sm_90), half the atomic instructions of two atomicAdds.
__device__ __forceinline__ void red_add2(float *p, float a, float b) {
#ifdef GRPO_CUDA_EMU
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#else
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#endif
}

// The atomic backward's dQ = dS K for one 64-query step against this block's 128 keys, in three parts:
// wg_store_ds puts dS^T in shared memory, wg_dq_product issues the products, wg_dq_red adds them to dq_acc.

// dS^T of this warpgroup's 64 keys against the step's 64 queries (accumulators ds) into the swizzled shared
// tile dss ([128 keys][64 queries]: the product's A, MN-major). Published by the caller (wg_publish).
template <typename T>
__device__ __forceinline__ void wg_store_ds(T *dss, const float (&ds)[WG_DKV_BQ / 8][4]) {
    const uint32_t warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < WG_DKV_BQ / 8; ++n)
        for (int r = 0; r < 2; ++r)
            *(uint32_t *)(dss + wg_at<WG_DKV_BK>(16 * warp + g + 8 * r, 8 * n + 2 * c)) =
                pack2<T>(ds[n][2 * r], ds[n][2 * r + 1]);
}

// wg_store_ds from dS^T's A fragments df (wg_frags: the same bf16 / f16 pairs), then this thread's writes
// fenced for the tensor cores (published to its warpgroup by a barrier of the caller's).
template <typename T>
__device__ __forceinline__ void wg_store_ds_frags(T *dss, const uint32_t (&df)[WG_DKV_BQ / 16][4]) {
    const uint32_t warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < WG_DKV_BQ / 16; ++kk)
        for (int i = 0; i < 4; ++i)  // frag_from_acc: register i holds accumulator column block 2 kk + i / 2, row half i % 2
            *(uint32_t *)(dss + wg_at<WG_DKV_BK>(16 * warp + g + 8 * (i % 2), 8 * (2 * kk + i / 2) + 2 * c)) = df[kk][i];
    wg_fence_proxy();
}

// acc = dS K for this warpgroup's share, from the published tile dss and the keys ks: 64 of D's columns over
// all 128 keys (D = 128) or all 64 columns over its own 64 keys (D = 64). Issued as one group, not waited for.
template <typename T, int D>
__device__ __forceinline__ void wg_dq_product(float (&acc)[8][4], const T *dss, const T *ks) {
    const uint32_t wg = threadIdx.x / 128;
    constexpr uint32_t KEYS = D == 128 ? WG_DKV_BK : 64;
    const uint32_t n0 = D == 128 ? 64 * wg : 0, k0 = D == 128 ? 0 : 64 * wg;
    const T *kcols = ks + (n0 / 64) * WG_DKV_BK * 64;
    const uint64_t ad = wg_desc(dss, WG_DKV_BK * 128), bd = wg_desc(kcols, WG_DKV_BK * 128);
    wg_begin(acc);
#pragma unroll
    for (uint32_t kk = 0; kk < KEYS / 16; ++kk) {
        const uint32_t key = k0 + 16 * kk;
        wgmma_ss<T, 64, 1, 1>(acc, wg_desc_at(ad, key * 64), wg_desc_at(bd, key * 64), kk > 0);
    }
    wg_commit();
}

// dq_acc[rows i0.., this warpgroup's columns] += acc (wg_dq_product's, waited for) by f32 atomics, rows >= t
// skipped.
template <int D>
__device__ __forceinline__ void wg_dq_red(float *dq_acc, const float (&acc)[8][4], uint32_t i0, uint32_t t) {
    const uint32_t warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
    const uint32_t n0 = D == 128 ? 64 * (warp / 4) : 0;
    for (int r = 0; r < 2; ++r) {
        const uint32_t i = i0 + 16 * (warp % 4) + g + 8 * r;
        if (i >= t) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            red_add2(&dq_acc[(size_t)i * D + n0 + 8 * j + 2 * c], acc[j][2 * r], acc[j][2 * r + 1]);
    }
}

// dq_acc[rows i0.., 64 queries] += dS K at once (the two-stage loop): dS^T stored, published, multiplied by
// the keys and added.
template <typename T, int D>
__device__ __forceinline__ void wg_add_dq(float *dq_acc, T *dss, const float (&ds)[WG_DKV_BQ / 8][4], const T *ks,
                                          uint32_t i0, uint32_t t) {
    wg_store_ds<T>(dss, ds);
    wg_publish();
    float acc[8][4];
    wg_dq_product<T, D>(acc, dss, ks);
    wg_wait<0>(acc);
    wg_dq_red<D>(dq_acc, acc, i0, t);
}

// The dk/dv kernel's stages of Q and dO tiles: a ring filled and published by halves as the forward's
// (wg_dkv_ring), of five slots at head dim 64 and four at 128 (whose loop retires each block's products
// within its step, and whose five would not fit in shared memory); two for the atomic dq at 128
// (wg_dkv_two_stage: each warpgroup's dQ reads both warpgroups' dS^T).
template <int D, bool DQ> __host__ __device__ constexpr uint32_t wg_dkv_stages() {
    return D == 64 ? WG_FWD_SLOTS : DQ ? 2 : 4;
}

// The dk/dv kernels' tiles as a warpgroup's products read them: its 64 keys' and values' rows (K-major),
// and stage 0's queries and output gradients, K-major for the scores (q, g) and MN-major for dV and dK
// (qm, gm); stage st's are WG_DKV_BQ D elements on. Made once, so that a step's descriptors are adds.
struct DkvDescs {
    uint64_t k, v, q, g, qm, gm;
};
template <typename T, int D>
__device__ __forceinline__ DkvDescs dkv_descs(const T *ks, const T *vs, const T *qs, const T *gs, uint32_t wg) {
    return DkvDescs{wg_desc(ks + 64 * wg * 64, 16), wg_desc(vs + 64 * wg * 64, 16), wg_desc(qs, 16), wg_desc(gs, 16),
                    wg_desc(qs, WG_DKV_BQ * 128), wg_desc(gs, WG_DKV_BQ * 128)};
}

// S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys against the 64 queries of stage st: issued as
// one group, not waited for.
template <typename T, int D>
__device__ __forceinline__ void wg_dkv_scores(float (&sc)[WG_DKV_BQ / 8][4], float (&dp)[WG_DKV_BQ / 8][4],
                                              const DkvDescs &x, uint32_t st) {
    const uint64_t qd = wg_desc_at(x.q, st * WG_DKV_BQ * D), gd = wg_desc_at(x.g, st * WG_DKV_BQ * D);
    const uint64_t kd = x.k, vd = x.v;
    wg_begin(sc, dp);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t part = (kk / 4) * 64, col = (kk % 4) * 16;
        const uint64_t bq = wg_desc_at(qd, part * WG_DKV_BQ + col), bg = wg_desc_at(gd, part * WG_DKV_BQ + col);
        const uint32_t rows = part * WG_DKV_BK + col;
        wgmma_ss<T, WG_DKV_BQ>(sc, wg_desc_at(kd, rows), bq, kk > 0);
        wgmma_ss<T, WG_DKV_BQ>(dp, wg_desc_at(vd, rows), bg, kk > 0);
    }
    wg_commit();
}

// dV += P^T dO and dK += dS^T Q (A: the fragments pf, df; B: stage st's output gradients and queries):
// issued as one group.
template <typename T, int D>
__device__ __forceinline__ void wg_dkv_accumulate(float (&dv)[D / 8][4], float (&dk)[D / 8][4],
                                                  const uint32_t (&pf)[WG_DKV_BQ / 16][4],
                                                  const uint32_t (&df)[WG_DKV_BQ / 16][4], const DkvDescs &x,
                                                  uint32_t st) {
    wg_begin(dv, dk);
    wg_acc_by_desc<T, WG_DKV_BQ, D>(dv, pf, wg_desc_at(x.gm, st * WG_DKV_BQ * D));
    wg_acc_by_desc<T, WG_DKV_BQ, D>(dk, df, wg_desc_at(x.qm, st * WG_DKV_BQ * D));
    wg_commit();
}

// A query block the dk/dv kernel visits: its query head and first query.
struct QueryBlockId {
    uint32_t hq, i0;
};

// A stage's bounds on its queries' key ranges, a half (warpgroup) each: the largest first key and the
// smallest last key of its queries, read in one 16-byte load.
struct __align__(16) StageBounds {
    uint32_t lo[2], hi[2];
};

// The dk/dv kernel's place in its list of query blocks: a query head and an index into the list (the same
// blocks in every head).
struct QueryCursor {
    uint32_t hq, k;
};

// The dk/dv kernel's shared memory (flash_wgmma_bwd_dkv lays it out), the inputs its query steps read and
// the block's place: its keys j0.. and the query heads up to hq_end of batch row b. Stages are named by
// their slot (0.. STAGES - 1).
template <typename T, int D, bool DQ> struct DkvBlock {
    static constexpr uint32_t STAGES = wg_dkv_stages<D, DQ>();
    T *ks, *vs;        // [WG_DKV_BK x D] keys, values
    T *qs, *gs;        // [STAGES][WG_DKV_BQ x D] queries, output gradients
    QueryStat *stats;  // [STAGES][WG_DKV_BQ]
    StageBounds *bounds;  // [STAGES] (the ring's)
    T *dss;            // with DQ: [WG_DKV_BK x WG_DKV_BQ] dS^T, swizzled
    QueryBlockId *ids;  // in the ring: [2 warpgroups][STAGES] each stage's (query head, first query)
    uint32_t *mask;    // the query blocks that see one of the keys (wg_query_mask)
    uint32_t *list;    // their first queries (wg_query_list)
    uint32_t blocks;   // and their count
    const T *q, *dout;
    const uint32_t *ranges;
    const float *lse, *delta;
    uint32_t b, h, t, s, j0, hq_end;

    __device__ T *qt(uint32_t st) const { return qs + st * WG_DKV_BQ * D; }
    __device__ T *gt(uint32_t st) const { return gs + st * WG_DKV_BQ * D; }
    __device__ QueryStat *stat(uint32_t st) const { return stats + st * WG_DKV_BQ; }
    // The cursor moved to the next block (past the list's last, the next head's first); whether one is left.
    __device__ bool next(QueryCursor &c) const {
        if (++c.k == blocks) c.k = 0, ++c.hq;
        return c.hq < hq_end;
    }
    __device__ uint32_t first(const QueryCursor &c) const { return list[c.k]; }
    // Query block (hq, i0)'s tiles into stage st by the whole block (one group of copies, not waited for);
    // returns the statistics of query threadIdx.x, for wg_store_stats into stat(st).
    __device__ QueryStat stage(uint32_t st, uint32_t hq, uint32_t i0) const {
        wg_stage_queries<T, D>(qt(st), gt(st), q, dout, b * h + hq, i0, t);
        return wg_load_stats(ranges, lse, delta, b, b * h + hq, i0, t, s, threadIdx.x);
    }
    // Warpgroup w's half (rows 32 w.. 32 w + 31) of query block (hq, i0)'s tiles into stage st, one group of
    // copies; the block's place into the warpgroup's ids (visible to the warpgroup after its next barrier).
    __device__ void stage_half(uint32_t st, uint32_t hq, uint32_t i0, uint32_t w) const {
        const size_t head = (size_t)(b * h + hq) * t * D;
        wg_stage_half<T, D>(qt(st), gt(st), q + head, dout + head, i0, t, w);
        if (threadIdx.x % 128 == 0) ids[w * STAGES + st] = QueryBlockId{hq, i0};
    }
    __device__ QueryBlockId id(uint32_t st, uint32_t w) const { return ids[w * STAGES + st]; }
    // The statistics of query half_row() (warpgroup w's half, one a thread of its first warp) of query block
    // (hq, i0).
    __device__ QueryStat half_stats(uint32_t hq, uint32_t i0) const {
        return wg_load_stats(ranges, lse, delta, b, b * h + hq, i0, t, s, half_row());
    }
    __device__ static uint32_t half_row() {
        const uint32_t r = threadIdx.x % 128;
        return r < WG_DKV_BQ / 2 ? (threadIdx.x / 128) * (WG_DKV_BQ / 2) + r : WG_DKV_BQ;
    }
    // Warpgroup w's half of stage st's statistics (x, half_stats' of this thread) into stat(st), and by its
    // first warp the half's bounds: the largest first key and the smallest last key of its queries.
    __device__ void store_half_stats(uint32_t st, uint32_t w, const QueryStat &x) const {
        wg_store_stats(stat(st), x, half_row());
        if (threadIdx.x % 128 < 32) {
            const uint32_t lo = __reduce_max_sync(0xffffffffu, x.lo), hi = __reduce_min_sync(0xffffffffu, x.hi);
            if (threadIdx.x % 32 == 0) bounds[st].lo[w] = lo, bounds[st].hi[w] = hi;
        }
    }
    // Whether each of this thread's keys key0 and key0 + 8 is in the range of every query of stage st (a
    // query that sees no key has lo > hi: never).
    __device__ bool sees_all(uint32_t st, uint32_t key0) const {
        const StageBounds x = bounds[st];
        return max(x.lo[0], x.lo[1]) <= key0 && key0 + 8 <= min(x.hi[0], x.hi[1]);
    }
    // dq_acc's rows of query head hq.
    __device__ float *dq_rows(float *dq_acc, uint32_t hq) const { return dq_acc + (size_t)(b * h + hq) * t * D; }
};

// The query blocks the kernel visits: its list's in each of its heads hq.. hq_end.
__device__ __forceinline__ uint32_t wg_query_blocks(uint32_t blocks, uint32_t hq, uint32_t hq_end) {
    return blocks * (hq_end - hq);
}

// The ring's dQ of block u (the atomic backward at head dim 64): warpgroup w's dS^T (fragments df) into its
// 64 keys' rows of the tile dss, published to its own warps (wg_self), then dQ = dS K over those keys and
// the f32 atomics. Its product runs while the other warpgroup computes; only its registers and the
// fragments' are live, not the scores'.
__device__ __forceinline__ uint32_t wg_self(uint32_t w) { return 1 + 2 * WG_FWD_SLOTS + 2 + w; }

template <typename T, int D, bool DQ>
__device__ __forceinline__ void wg_ring_dq(const DkvBlock<T, D, DQ> &blk, float *dq_acc,
                                           const uint32_t (&df)[WG_DKV_BQ / 16][4], uint32_t st, uint32_t w) {
    wg_store_ds_frags<T>(blk.dss, df);
    bar_sync(wg_self(w), 128);
    float dq[8][4];
    wg_dq_product<T, D>(dq, blk.dss, blk.ks);
    wg_wait<0>(dq);
    const QueryBlockId id = blk.id(st, w);
    wg_dq_red<D>(blk.dq_rows(dq_acc, id.hq), dq, id.i0, blk.t);
}

// The dk/dv loop over the n query blocks from cursor c, the forward's schedule (see flash_wgmma_fwd) with
// the roles of keys and queries swapped:
// - ping-pong between the two warpgroups (wg_turn), so that one's P^T and dS^T run while the other's
//   products do;
// - at head dim 64 pipelined within a warpgroup: step u issues S^T_u = K Q_u^T and dP^T_u = V dO_u^T, then
//   dV += P^T dO and dK += dS^T Q of block u - 1, and computes block u's P^T and dS^T while those run. At
//   128 the previous block's fragments do not fit beside the accumulators: a step issues its S^T and dP^T,
//   computes P^T and dS^T, then issues its own dV and dK in a second turn;
// - no block-wide barrier in the loop: each warpgroup copies half of every Q and dO tile (and reads half of
//   its queries' statistics) into a ring of slots, block u + 2 at the start of step u, and publishes
//   its half of block u + 1 right after issuing step u's first products (wg_full);
// - with DQ (head dim 64), each step ends with its block's dQ (wg_ring_dq), which reads only the warpgroup's
//   own rows.
template <typename T, int D, bool DQ>
__device__ __forceinline__ void wg_dkv_ring(float (&dk)[D / 8][4], float (&dv)[D / 8][4], const DkvBlock<T, D, DQ> &blk,
                                            float *dq_acc, QueryCursor c, uint32_t n, float scale) {
    using Blk = DkvBlock<T, D, DQ>;
    constexpr bool PIPE = D == 64;
    static_assert(Blk::STAGES == (PIPE ? WG_FWD_SLOTS : 4) && (PIPE || !DQ), "the slots the schedule needs; wg_full's ids");
    const uint32_t w = wg_index(), m0 = 16 * (threadIdx.x / 32), key0 = blk.j0 + m0 + (threadIdx.x % 32) / 4;
    const DkvDescs xd = dkv_descs<T, D>(blk.ks, blk.vs, blk.qs, blk.gs, w);
    float sc[WG_DKV_BQ / 8][4], dp[WG_DKV_BQ / 8][4];
    uint32_t pf[WG_DKV_BQ / 16][4], df[WG_DKV_BQ / 16][4];
    // Without PIPE, dV and dK of block u in a turn of their own (warpgroup 1 leaves its last turn's arrival
    // out: 2 n turns each).
    const auto accumulate = [&](uint32_t u, uint32_t st) {
        bar_sync(wg_turn(w), WG_THREADS);
        wg_dkv_accumulate<T, D>(dv, dk, pf, df, xd, st);
        if (w == 0 || u + 1 < n) bar_arrive(wg_turn(w ^ 1), WG_THREADS);
        wg_wait<0>(dv, dk);
        wg_keep(pf);
        wg_keep(df);
    };
    const auto grads = [&](uint32_t st) {  // P^T and dS^T of stage st, and their fragments
        probs_t_if<WG_DKV_BQ>(sc, dp, blk.stat(st), blk.j0 + m0, scale, blk.sees_all(st, key0));
    };
    QueryCursor staged = c;  // the last block staged
    const auto stage = [&](uint32_t st) {  // the block after the last staged, into slot st
        blk.next(staged);
        blk.stage_half(st, staged.hq, blk.first(staged), w);
    };
    // Step u's loads before its turn: block u + 1's statistics (by the place stage noted), block u + 2's
    // tiles; and after its first products, block u + 1's statistics stored and its half announced.
    QueryStat coming = query_stat(1, 0, 0.f, 0.f);
    RingSlots<Blk::STAGES> ring;
    const auto begin = [&](uint32_t u) {
        if (u + 1 < n) {
            const QueryBlockId id = blk.id(ring.next, w);
            coming = blk.half_stats(id.hq, id.i0);
        }
        if (u + 2 < n) stage(ring.after);
    };
    const auto announce = [&](uint32_t u) {
        if (u + 1 < n) {
            blk.store_half_stats(ring.next, w, coming);
            wg_publish_half(w, ring.next, u + 2 < n);
        }
    };
    const uint32_t i0 = blk.first(c);
    blk.stage_half(0, c.hq, i0, w);
    blk.store_half_stats(0, w, blk.half_stats(c.hq, i0));
    if (n > 1) stage(1);
    wg_publish_half(w, 0, n > 1);
    if (w == 1) bar_arrive(wg_turn(0), WG_THREADS);  // warpgroup 0 goes first
    bar_sync(wg_full(w ^ 1, 0), WG_THREADS);  // also publishes block 1's place to this warpgroup
    begin(0);
    bar_sync(wg_turn(w), WG_THREADS);
    wg_dkv_scores<T, D>(sc, dp, xd, 0);
    bar_arrive(wg_turn(w ^ 1), WG_THREADS);
    announce(0);
    wg_wait<0>(sc, dp);
    grads(0);
    wg_frags<T, WG_DKV_BQ>(pf, sc);
    wg_frags<T, WG_DKV_BQ>(df, dp);
    if constexpr (!PIPE) accumulate(0, 0);
    if constexpr (DQ) wg_ring_dq<T, D, DQ>(blk, dq_acc, df, 0, w);
    for (uint32_t u = 1; u < n; ++u) {
        ring.advance();
        bar_sync(wg_full(w ^ 1, ring.at), WG_THREADS);
        begin(u);
        bar_sync(wg_turn(w), WG_THREADS);
        wg_dkv_scores<T, D>(sc, dp, xd, ring.at);
        if constexpr (PIPE) wg_dkv_accumulate<T, D>(dv, dk, pf, df, xd, ring.last);
        bar_arrive(wg_turn(w ^ 1), WG_THREADS);
        announce(u);
        wg_wait<PIPE ? 1 : 0>(sc, dp);
        grads(ring.at);
        if constexpr (PIPE) {
            wg_wait<0>(dv, dk);
            wg_keep(pf);
            wg_keep(df);
        }
        wg_frags<T, WG_DKV_BQ>(pf, sc);
        wg_frags<T, WG_DKV_BQ>(df, dp);
        if constexpr (!PIPE) accumulate(u, ring.at);
        if constexpr (DQ) wg_ring_dq<T, D, DQ>(blk, dq_acc, df, ring.at, w);
    }
    if constexpr (PIPE) {
        bar_sync(wg_turn(w), WG_THREADS);
        wg_dkv_accumulate<T, D>(dv, dk, pf, df, xd, ring.at);
        if (w == 0) bar_arrive(wg_turn(1), WG_THREADS);  // n + 1 turns each
        wg_wait<0>(dv, dk);
        wg_keep(pf);
        wg_keep(df);
    }
}

// The dk/dv loop on two stages (the atomic dq at head dim 128), from cursor c, whose tiles are coming and
// whose statistics are in stat(0): each step's products wait for its own P^T and dS^T; the next block's
// tiles come in meanwhile.
template <typename T, int D, bool DQ>
__device__ __forceinline__ void wg_dkv_two_stage(float (&dk)[D / 8][4], float (&dv)[D / 8][4], const DkvBlock<T, D, DQ> &blk,
                                                 float *dq_acc, QueryCursor c, float scale) {
    const uint32_t m0 = 16 * (threadIdx.x / 32);
    const DkvDescs xd = dkv_descs<T, D>(blk.ks, blk.vs, blk.qs, blk.gs, wg_index());
    float sc[WG_DKV_BQ / 8][4], dp[WG_DKV_BQ / 8][4];
    uint32_t pf[WG_DKV_BQ / 16][4], df[WG_DKV_BQ / 16][4];
    uint32_t i0 = blk.first(c);
    wg_store_stats(blk.stat(0), blk.stage(0, c.hq, i0), threadIdx.x);
    QueryCursor cn = c;
    bool next = blk.next(cn);
    for (uint32_t st = 0;; st ^= 1) {
        QueryStat coming = query_stat(1, 0, 0.f, 0.f);
        if (next) {
            coming = blk.stage(st ^ 1, cn.hq, blk.first(cn));
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        wg_publish();
        // Rows: this warpgroup's 64 keys; columns: the stage's 64 queries.
        wg_dkv_scores<T, D>(sc, dp, xd, st);
        wg_wait<0>(sc, dp);
        probs_t<WG_DKV_BQ>(sc, dp, blk.stat(st), blk.j0 + m0, scale);  // P^T and dS^T
        wg_frags<T, WG_DKV_BQ>(pf, sc);
        wg_frags<T, WG_DKV_BQ>(df, dp);
        wg_dkv_accumulate<T, D>(dv, dk, pf, df, xd, st);
        wg_wait<0>(dv, dk);
        wg_keep(pf);
        wg_keep(df);
        if constexpr (DQ) wg_add_dq<T, D>(blk.dq_rows(dq_acc, c.hq), blk.dss, dp, blk.ks, i0, blk.t);
        // The next stage's statistics, read since the step began; the barrier publishes them.
        if (next) wg_store_stats(blk.stat(st ^ 1), coming, threadIdx.x);
        __syncthreads();  // every warp is done with this stage before it is filled again
        if (!next) break;
        c = cn, i0 = blk.first(c);
        next = blk.next(cn);
    }
}

// The dk/dv kernel; with DQ, also dQ into dq_acc ([B, H, T, D] f32, zeroed) by f32 atomics. Grid: x = (KV
// head bkv, part) as bkv * split + part, y = key block (so that the blocks of the first keys, which the most
// queries see, start first); each block's dk and dv over its part of the group's query heads, unscaled,
// into its share of `parts` ([split][dk | dv] f32). Each query block that sees one of the block's keys
// (mask) is one step: it computes on one stage while the next block's tiles come into another (cp.async)
// and its statistics into registers, so that no step waits for a global load but its own tiles'.
template <typename T, int D, bool DQ>
__device__ void flash_wgmma_bwd_dkv(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                    const T *__restrict__ dout, const uint32_t *__restrict__ ranges,
                                    const float *__restrict__ lse, const float *__restrict__ delta,
                                    float *__restrict__ parts, const uint32_t *__restrict__ spans, float *dq_acc,
                                    uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t split, float scale) {
    constexpr uint32_t STAGES = wg_dkv_stages<D, DQ>();
    extern __shared__ uint32_t wg_smem[];
    DkvBlock<T, D, DQ> blk;
    blk.ks = wg_aligned<T>(wg_smem);
    blk.vs = blk.ks + WG_DKV_BK * D;
    blk.qs = blk.vs + WG_DKV_BK * D;
    blk.gs = blk.qs + STAGES * WG_DKV_BQ * D;
    blk.stats = (QueryStat *)(blk.gs + STAGES * WG_DKV_BQ * D);
    blk.dss = (T *)(blk.stats + STAGES * WG_DKV_BQ);
    blk.bounds = (StageBounds *)(blk.dss + (DQ ? WG_DKV_BK * WG_DKV_BQ : 0));
    blk.ids = (QueryBlockId *)(blk.bounds + STAGES);
    blk.mask = (uint32_t *)(blk.ids + (STAGES > 2 ? 2 * STAGES : 0));
    blk.list = blk.mask + ((t + WG_DKV_BQ - 1) / WG_DKV_BQ + 31) / 32;
    blk.q = q, blk.dout = dout, blk.ranges = ranges, blk.lse = lse, blk.delta = delta;
    const uint32_t bkv = blockIdx.x / split, part = blockIdx.x % split, kvh = bkv % kv;
    blk.b = bkv / kv, blk.h = h, blk.t = t, blk.s = s, blk.j0 = blockIdx.y * WG_DKV_BK;
    QueryCursor c{0, 0};
    dkv_heads(kvh, h / kv, part, split, c.hq, blk.hq_end);
    stage_swizzled<T, D, WG_DKV_BK>(blk.ks, k + (size_t)bkv * s * D, blk.j0, s);
    stage_swizzled<T, D, WG_DKV_BK>(blk.vs, v + (size_t)bkv * s * D, blk.j0, s);
    cp_async_commit();
    wg_query_mask(blk.mask, spans, blk.b, t, blk.j0, min(blk.j0 + WG_DKV_BK, s) - 1);
    blk.blocks = wg_query_list(blk.list, blk.mask, t);
    float dk[D / 8][4], dv[D / 8][4];
    zero_acc(dk);
    zero_acc(dv);
    if (blk.blocks > 0 && c.hq < blk.hq_end) {
        if constexpr (STAGES > 2) {
            wg_dkv_ring<T, D, DQ>(dk, dv, blk, dq_acc, c, wg_query_blocks(blk.blocks, c.hq, blk.hq_end), scale);
        } else {
            wg_dkv_two_stage<T, D, DQ>(dk, dv, blk, dq_acc, c, scale);
        }
    }
    cp_async_wait<0>();  // the key and value tiles, when no query block saw them
    const size_t nk = (size_t)(gridDim.x / split) * s * D;
    store_dkv_part<D>(parts + 2 * nk * part, dk, dv, bkv, blk.j0 + 16 * (threadIdx.x / 32), s, nk);
}

// The four operand layouts the attention kernels use, one product each, for `grpo selftest` to check on
// a GPU first: D = A B for A [64, 16] (a) and B [16, 64] (b), both row-major, as
//   out[0]: A from registers, B K-major (a tile of B^T's rows);  out[1]: A from registers, B MN-major;
//   out[2]: A and B K-major from shared tiles;  out[3]: A and B MN-major from shared tiles;
// out: [4][64][64] f32. One warpgroup (128 threads); 21 KiB of shared memory (src/kernels/flash_wgmma.rs).
template <typename T> __device__ void wgmma_layouts(const T *__restrict__ a, const T *__restrict__ b, float *out) {
    extern __shared__ uint32_t wg_smem[];
    T *ak = wg_aligned<T>(wg_smem);  // A K-major: 64 rows (m) x 64 columns (k; 16 used), swizzled
    T *bk = ak + 64 * 64;            // B K-major: 64 rows (n) x 64 columns (k; 16 used)
    T *am = bk + 64 * 64;            // A MN-major: 16 rows (k) x 64 columns (m)
    T *bm = am + 16 * 64;            // B MN-major: 16 rows (k) x 64 columns (n)
    for (uint32_t e = threadIdx.x; e < 64 * 64; e += blockDim.x) {
        const uint32_t r = e / 64, x = e % 64;
        ak[wg_at<64>(r, x)] = x < 16 ? a[r * 16 + x] : from_f32<T>(0.f);
        bk[wg_at<64>(r, x)] = x < 16 ? b[x * 64 + r] : from_f32<T>(0.f);
    }
    for (uint32_t e = threadIdx.x; e < 16 * 64; e += blockDim.x) {
        const uint32_t r = e / 64, x = e % 64;
        am[wg_at<16>(r, x)] = a[x * 16 + r];
        bm[wg_at<16>(r, x)] = b[r * 64 + x];
    }
    wg_publish();
    uint32_t af[1][4];
    global_frags<T, 16>(af, a, 16 * (threadIdx.x / 32), 64);
    float d[4][8][4];
    wg_begin(d[0], d[1], d[2], d[3]);
    wgmma_rs<T, 64, 0>(d[0], af[0], wg_desc(bk, 16), 0);
    wgmma_rs<T, 64, 1>(d[1], af[0], wg_desc(bm, 16 * 128), 0);
    wgmma_ss<T, 64, 0, 0>(d[2], wg_desc(ak, 16), wg_desc(bk, 16), 0);
    wgmma_ss<T, 64, 1, 1>(d[3], wg_desc(am, 16 * 128), wg_desc(bm, 16 * 128), 0);
    wg_end<0>(d[0], d[1], d[2], d[3]);
    wg_keep(af);
    const uint32_t g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4, row = 16 * (threadIdx.x / 32) + g;
    for (int v = 0; v < 4; ++v)
        for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i) out[v * 64 * 64 + (row + 8 * (i / 2)) * 64 + 8 * j + 2 * c + i % 2] = d[v][j][i];
}

#define WGMMA_LAYOUTS(NAME, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) wgmma_layouts_##NAME(const T *a, const T *b, float *out) { \
        wgmma_layouts<T>(a, b, out);                                                                            \
    }

WGMMA_LAYOUTS(bf16, __nv_bfloat16)
WGMMA_LAYOUTS(f16, __half)

// The forward at head dim 64 held to 128 registers, two blocks a multiprocessor (its 84 KiB of shared memory
// twice fits too); the other kernels use up to 255 registers, one block each.
#define FLASH_WGMMA_KERNELS(NAME, T, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, D == 64 ? 2 : 1)                                    \
        flash_wgmma_fwd_##NAME(const T *q, const T *k, const T *v, const uint32_t *ranges, float *lse, T *out,   \
                               uint32_t h, uint32_t kv, uint32_t t, uint32_t s, float scale) {                   \
        flash_wgmma_fwd<T, D>(q, k, v, ranges, lse, out, h, kv, t, s, scale);                                    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                                  \
        flash_wgmma_bwd_dq_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,     \
                                  const float *lse, const float *delta, T *dq, uint32_t *spans, uint32_t h,      \
                                  uint32_t kv, uint32_t t, uint32_t s, float scale) {                            \
        flash_wgmma_bwd_dq<T, D>(q, k, v, dout, ranges, lse, delta, dq, spans, h, kv, t, s, scale);              \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                                  \
        flash_wgmma_bwd_dkv_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,    \
                                   const float *lse, const float *delta, float *parts, const uint32_t *spans,    \
                                   uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t split, float scale) { \
        flash_wgmma_bwd_dkv<T, D, false>(q, k, v, dout, ranges, lse, delta, parts, spans, nullptr, h, kv, t, s,  \
                                         split, scale);                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                                  \
        flash_wgmma_bwd_dkvq_##NAME(const T *q, const T *k, const T *v, const T *dout, const uint32_t *ranges,   \
                                    const float *lse, const float *delta, float *parts, const uint32_t *spans,   \
                                    float *dq_acc, uint32_t h, uint32_t kv, uint32_t t, uint32_t s, uint32_t split, \
                                    float scale) {                                                               \
        flash_wgmma_bwd_dkv<T, D, true>(q, k, v, dout, ranges, lse, delta, parts, spans, dq_acc, h, kv, t, s,    \
                                        split, scale);                                                           \
    }

FLASH_WGMMA_KERNELS(d64_bf16, __nv_bfloat16, 64)
FLASH_WGMMA_KERNELS(d128_bf16, __nv_bfloat16, 128)
FLASH_WGMMA_KERNELS(d64_f16, __half, 64)
FLASH_WGMMA_KERNELS(d128_f16, __half, 128)
