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
// with ib1 = 1 / (1 - b1^t), ib2 = 1 / (1 - b2^t); `flags`: 1 AdamW (else SGD), 2 decayed, 4 scaled. A
// thread per 16-byte pack of 4 elements of each row (one at a time where n or a pointer does not allow
// packs), grid-stride; each element's arithmetic the same either way.

#include "common.cuh"

__device__ __forceinline__ float affine(float x, float mul) { return __fadd_rn(__fmul_rn(x, mul), 0.f); }

// The update's constants (the kernel's arguments after n).
struct AdamwStep {
    uint32_t flags;
    float scale, lr, decay, b1, c1, b2, c2, ib1, ib2, eps;
};

// One element: its master weight p and (AdamW) moments m and v, updated in place, from its gradient g.
__device__ __forceinline__ void adamw_one(float &p, float &m, float &v, float g, const AdamwStep &a) {
    if (a.flags & 4) g = affine(g, a.scale);
    if (!(a.flags & 1)) {
        p = __fsub_rn(p, affine(g, a.lr));
        return;
    }
    if (a.flags & 2) p = affine(p, a.decay);
    m = __fadd_rn(affine(m, a.b1), affine(g, a.c1));
    v = __fadd_rn(affine(v, a.b2), affine(__fmul_rn(g, g), a.c2));
    const float den = __fadd_rn(__fsqrt_rn(affine(v, a.ib2)), a.eps);
    p = __fsub_rn(p, affine(__fdiv_rn(affine(m, a.ib1), den), a.lr));
}

extern "C" __global__ void adamw_f32(float *__restrict__ state, const float *__restrict__ g, uint32_t n,
                                     uint32_t flags, float scale, float lr, float decay, float b1, float c1,
                                     float b2, float c2, float ib1, float ib2, float eps) {
    const AdamwStep a{flags, scale, lr, decay, b1, c1, b2, c2, ib1, ib2, eps};
    const bool adam = flags & 1;
    // The moments' rows (AdamW only: SGD's state is the weights alone).
    float *m = adam ? state + n : nullptr, *v = adam ? state + 2 * (size_t)n : nullptr;
    const bool vectors = n % 4 == 0 && aligned16(state) && aligned16(g);
    packed_loop<float>(
        n, vectors,
        [&](size_t q) {
            Pack<float> pp = load_pack(state, q), mp = {}, vp = {};
            const Pack<float> gp = load_pack(g, q);
            if (adam) mp = load_pack(m, q), vp = load_pack(v, q);
#pragma unroll
            for (int j = 0; j < 4; ++j) adamw_one(pp.v[j], mp.v[j], vp.v[j], gp.v[j], a);
            store_pack(state, q, pp);
            if (adam) store_pack(m, q, mp), store_pack(v, q, vp);
        },
        [&](size_t i) {
            float p = state[i], mi = adam ? m[i] : 0.f, vi = adam ? v[i] : 0.f;
            adamw_one(p, mi, vi, g[i], a);
            state[i] = p;
            if (adam) m[i] = mi, v[i] = vi;
        });
}
