// Generation's attention over the paged KV cache (src/kernels/paged_attention.rs has the CPU
// implementation and the layout): each query token of a step against the first ctx[t] positions of its
// sequence, found through the sequence's block table in a pool of blocks.
//   q    [H, T, D]           the step's queries (head-major)
//   kv   [2 KV, slots, D]    keys in heads 0..KV, values in KV..2 KV
//   meta u32                 tables [seqs, max_blocks], then token_seq [T], then token_ctx [T]
//   out  [H, T, D]
// paged_attention_<T>: a block per (query token, KV head, split of the context of `chunk` positions). The
// query heads of the KV head's group are held in shared memory, so each key and value row of the split is
// read once for the whole group: a thread per position computes the group's scores from one read of its
// key row, then a thread per output column sums the weighted value rows (coalesced across the block).
// With one split the block writes the output; with several, each writes its partial (max, sum, weighted
// values) in f32 and paged_attention_reduce_<T> combines the splits of each (token, head) row.

#include "common.cuh"

#define PAGED_THREADS 128
// Query heads per KV head at most (their q rows and scores in shared memory).
#define PAGED_MAX_GROUP 8

struct PagedDims {
    uint32_t tokens, heads, kv_heads, slots, head_dim, block_size, max_blocks, seqs, chunk, splits;
};

__device__ __forceinline__ uint32_t paged_slot(const uint32_t *tables, const PagedDims &d, uint32_t s, uint32_t j) {
    return tables[s * d.max_blocks + j / d.block_size] * d.block_size + j % d.block_size;
}

template <typename T>
__device__ void paged_split(const T *__restrict__ q, const T *__restrict__ kv, const uint32_t *__restrict__ meta,
                            T *__restrict__ out, float *__restrict__ part_acc, float *__restrict__ part_ml,
                            PagedDims d, float scale) {
    extern __shared__ float paged_shared[];
    const uint32_t t = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
    const uint32_t group = d.heads / d.kv_heads, hd = d.head_dim;
    const uint32_t *tables = meta, *token_seq = meta + d.seqs * d.max_blocks, *token_ctx = token_seq + d.tokens;
    const uint32_t s = token_seq[t], ctx = token_ctx[t];
    const uint32_t begin = split * d.chunk, end = min(ctx, begin + d.chunk);
    const uint32_t n = end > begin ? end - begin : 0;
    float *qs = paged_shared;               // [group, D]
    float *scores = qs + group * hd;        // [group, chunk]
    float *reduce = scores + group * d.chunk;  // 32 floats for block_reduce
    for (uint32_t i = threadIdx.x; i < group * hd; i += blockDim.x) {
        const uint32_t h = g * group + i / hd;
        qs[i] = to_f32(q[((size_t)h * d.tokens + t) * hd + i % hd]);
    }
    __syncthreads();
    const T *keys = kv + (size_t)g * d.slots * hd;
    const T *values = kv + (size_t)(d.kv_heads + g) * d.slots * hd;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        const T *k = keys + (size_t)paged_slot(tables, d, s, begin + j) * hd;
        // Unrolled over the largest group, so that acc stays in registers.
        float acc[PAGED_MAX_GROUP];
#pragma unroll
        for (uint32_t h = 0; h < PAGED_MAX_GROUP; ++h) acc[h] = 0.f;
        for (uint32_t c = 0; c < hd; ++c) {
            const float kc = to_f32(k[c]);
#pragma unroll
            for (uint32_t h = 0; h < PAGED_MAX_GROUP; ++h)
                if (h < group) acc[h] = fmaf(kc, qs[h * hd + c], acc[h]);
        }
#pragma unroll
        for (uint32_t h = 0; h < PAGED_MAX_GROUP; ++h)
            if (h < group) scores[h * d.chunk + j] = acc[h] * scale;
    }
    __syncthreads();
    for (uint32_t h = 0; h < group; ++h) {
        float m = -INFINITY;
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[h * d.chunk + j]);
        m = block_reduce<true>(m, reduce);
        float sum = 0.f;
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float w = __expf(scores[h * d.chunk + j] - m);
            scores[h * d.chunk + j] = w;
            sum += w;
        }
        sum = block_reduce<false>(sum, reduce);
        const uint32_t row = (g * group + h) * d.tokens + t;
        if (threadIdx.x == 0 && d.splits > 1) {
            part_ml[((size_t)row * d.splits + split) * 2] = n > 0 ? m : -INFINITY;
            part_ml[((size_t)row * d.splits + split) * 2 + 1] = sum;
        }
        __syncthreads();
        for (uint32_t c = threadIdx.x; c < hd; c += blockDim.x) {
            float a = 0.f;
            for (uint32_t j = 0; j < n; ++j)
                a = fmaf(to_f32(values[(size_t)paged_slot(tables, d, s, begin + j) * hd + c]), scores[h * d.chunk + j], a);
            if (d.splits > 1)
                part_acc[((size_t)row * d.splits + split) * hd + c] = a;
            else
                out[(size_t)row * hd + c] = from_f32<T>(a / sum);
        }
    }
}

template <typename T>
__device__ void paged_reduce(const float *__restrict__ part_acc, const float *__restrict__ part_ml, T *__restrict__ out,
                             uint32_t rows, uint32_t splits, uint32_t hd) {
    const uint32_t row = blockIdx.x;
    if (row >= rows) return;
    float m = -INFINITY;
    for (uint32_t p = 0; p < splits; ++p) m = fmaxf(m, part_ml[((size_t)row * splits + p) * 2]);
    float total = 0.f;
    for (uint32_t p = 0; p < splits; ++p) {
        const float mp = part_ml[((size_t)row * splits + p) * 2];
        if (mp != -INFINITY) total += __expf(mp - m) * part_ml[((size_t)row * splits + p) * 2 + 1];
    }
    for (uint32_t c = threadIdx.x; c < hd; c += blockDim.x) {
        float a = 0.f;
        for (uint32_t p = 0; p < splits; ++p) {
            const float mp = part_ml[((size_t)row * splits + p) * 2];
            if (mp != -INFINITY) a += __expf(mp - m) * part_acc[((size_t)row * splits + p) * hd + c];
        }
        out[(size_t)row * hd + c] = from_f32<T>(a / total);
    }
}

#define PAGED_KERNELS(NAME, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(PAGED_THREADS) paged_attention_##NAME(                                                             \
        const T *q, const T *kv, const uint32_t *meta, T *out, float *part_acc, float *part_ml, uint32_t tokens,   \
        uint32_t heads, uint32_t kv_heads, uint32_t slots, uint32_t head_dim, uint32_t block_size,                \
        uint32_t max_blocks, uint32_t seqs, uint32_t chunk, uint32_t splits, float scale) {                       \
        PagedDims d{tokens, heads, kv_heads, slots, head_dim, block_size, max_blocks, seqs, chunk, splits};       \
        paged_split<T>(q, kv, meta, out, part_acc, part_ml, d, scale);                                             \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(PAGED_THREADS) paged_attention_reduce_##NAME(const float *part_acc, const float *part_ml, T *out,   \
                                                             uint32_t rows, uint32_t splits, uint32_t head_dim) {  \
        paged_reduce<T>(part_acc, part_ml, out, rows, splits, head_dim);                                           \
    }

PAGED_KERNELS(f32, float)
PAGED_KERNELS(bf16, __nv_bfloat16)
PAGED_KERNELS(f16, __half)
