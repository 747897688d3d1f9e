// The optimiser's update in one pass over each parameter's f32 state (src/kernels/adamw.rs has the CPU
// implementation and the composite reference it equals bit for bit). `state` is [rows, n]: the master
// weights, then (AdamW) the first and second moments; `g` is the gradient [n] in f32. Every product and
// sum is rounded on its own (__fmul_rn, __fadd_rn: no contraction into fma), in the order of the composite
// candle ops, so that the GPU, the host (`optim.offload`) and the reference give the same bits:
//   g  = g * scale + 0                                     (when scale != 1)
//   SGD:   p = p - (g * lr + 0)
//   AdamW: p = p * decay + 0                               (decayed parameters)
//          m = (m * b1 + 0) + (g * (1 - b1) + 0)
//          v = (v * b2 + 0) + ((g * g) * (1 - b2) + 0)
//          p = p - ((m * ib1 + 0) / (sqrt(v * ib2 + 0) + eps) * lr + 0)
// with ib1 = 1 / (1 - b1^t), ib2 = 1 / (1 - b2^t); `flags`: 1 AdamW (else SGD), 2 decayed, 4 scaled. One
// thread per element, grid-stride.

#include "common.cuh"

__device__ __forceinline__ float affine(float x, float mul) { return __fadd_rn(__fmul_rn(x, mul), 0.f); }

extern "C" __global__ void adamw_f32(float *__restrict__ state, const float *__restrict__ g, uint32_t n,
                                     uint32_t flags, float scale, float lr, float decay, float b1, float c1,
                                     float b2, float c2, float ib1, float ib2, float eps) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i];
        if (flags & 4) gi = affine(gi, scale);
        float p = state[i];
        if (!(flags & 1)) {
            state[i] = __fsub_rn(p, affine(gi, lr));
            continue;
        }
        if (flags & 2) p = affine(p, decay);
        const float m = __fadd_rn(affine(state[n + i], b1), affine(gi, c1));
        const float v = __fadd_rn(affine(state[2 * (size_t)n + i], b2), affine(__fmul_rn(gi, gi), c2));
        const float den = __fadd_rn(__fsqrt_rn(affine(v, ib2)), eps);
        state[i] = __fsub_rn(p, affine(__fdiv_rn(affine(m, ib1), den), lr));
        state[n + i] = m;
        state[2 * (size_t)n + i] = v;
    }
}
