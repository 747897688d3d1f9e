// The tensor cores' warp-wide matrix multiply-accumulate, mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32
// for T = bf16 or f16 (compute capability 8.0+): D = A B + C, A 16x16, B 16x8, C and D 16x8 in f32.
// Each of the warp's 32 lanes holds a fragment; with g = lane / 4 and c = lane % 4 (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"):
//   a[0] = A[g][2c..2c+1]   a[1] = A[g+8][2c..2c+1]   a[2] = A[g][2c+8..2c+9]   a[3] = A[g+8][2c+8..2c+9]
//   b[0] = B[2c..2c+1][g]   b[1] = B[2c+8..2c+9][g]
//   d[0], d[1] = D[g][2c], D[g][2c+1]                 d[2], d[3] = D[g+8][2c], D[g+8][2c+1]
// A register holds two 16-bit values, the lower column of A (row of B) in its low half. Under the host
// emulator (GRPO_CUDA_EMU) the same layout is computed from every lane's registers, gathered at once.
#pragma once

#include "common.cuh"

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t bits_of(__half x) { return __half_as_ushort(x); }

// Two values as one register of a fragment: `lo` in the low half, each rounded to nearest (even) as
// from_f32 rounds. On the GPU one paired conversion (cvt.rn.bf16x2.f32 / f16x2: one F2FP), where two
// conversions and their packing took four instructions.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
#ifdef GRPO_CUDA_EMU
    return bits_of(from_f32<T>(lo)) | (bits_of(from_f32<T>(hi)) << 16);
#else
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t *>(&v);
    } else {
        const __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t *>(&v);
    }
#endif
}

// Two stored values as one register: `lo` in the low half.
template <typename T> __device__ __forceinline__ uint32_t pair(T lo, T hi) { return bits_of(lo) | (bits_of(hi) << 16); }

#ifdef GRPO_CUDA_EMU
template <typename T> inline float half_of(uint32_t r, int high) {
    T x;
    x.bits = (uint16_t)(high ? r >> 16 : r & 0xffffu);
    return to_f32(x);
}

// d += A B from the fragments of every lane (a[0..3], b[0..1] gathered as words 0..5).
template <typename T> inline void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    uint32_t all[32][emu::WARP_GATHER_WORDS];
    emu::warp_gather(0xffffffffu, mine, 6, all);
    const uint32_t lane = emu::tls.tid % 32, g = lane / 4, c = lane % 4;
    // A[r][k]: lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2.
    auto A = [&](uint32_t r, uint32_t k) {
        return half_of<T>(all[(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k % 2);
    };
    // B[k][n]: lane n * 4 + (k % 8) / 2, register 4 + (k >= 8), half k % 2.
    auto B = [&](uint32_t k, uint32_t n) { return half_of<T>(all[n * 4 + (k % 8) / 2][4 + (k >= 8)], k % 2); };
    for (uint32_t i = 0; i < 4; ++i) {
        const uint32_t r = g + 8 * (i / 2), n = 2 * c + i % 2;
        float acc = d[i];
        for (uint32_t k = 0; k < 16; ++k) acc = fmaf(A(r, k), B(k, n), acc);
        d[i] = acc;
    }
}
#else
template <typename T> __device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]);

template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <> __device__ __forceinline__ void mma_16816<__half>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Four 8x8 matrices of 16-bit values from shared memory, one warp (ldmatrix.sync.aligned.m8n8.x4,
// optionally .trans): lane i gives the address of row i % 8 of matrix i / 8 (rows 16-byte aligned), and
// r[j] gets, of matrix j, row i / 4 at columns 2 (i % 4) and 2 (i % 4) + 1 (TRANS: column i / 4 at rows
// 2 (i % 4) and 2 (i % 4) + 1): an A or B fragment's registers, without a transposed copy of the tile.
#ifdef GRPO_CUDA_EMU
template <bool TRANS> inline void ldmatrix_x4(uint32_t r[4], const void *row) {
    const uint64_t p = (uint64_t)(uintptr_t)row;
    if (p & 15) emu::report("ldmatrix with a row address that is not 16-byte aligned");
    const uint32_t mine[2] = {(uint32_t)p, (uint32_t)(p >> 32)};
    uint32_t all[32][emu::WARP_GATHER_WORDS];
    emu::warp_gather(0xffffffffu, mine, 2, all);
    const auto at = [&](uint32_t lane) {
        return (const uint16_t *)(uintptr_t)(((uint64_t)all[lane][1] << 32) | all[lane][0]);
    };
    const uint32_t i = emu::tls.tid % 32;
    for (uint32_t j = 0; j < 4; ++j) {
        if (TRANS) {
            r[j] = (uint32_t)at(8 * j + 2 * (i % 4))[i / 4] | ((uint32_t)at(8 * j + 2 * (i % 4) + 1)[i / 4] << 16);
        } else {
            const uint16_t *q = at(8 * j + i / 4);
            r[j] = (uint32_t)q[2 * (i % 4)] | ((uint32_t)q[2 * (i % 4) + 1] << 16);
        }
    }
}
#else
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *row) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(row);
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s));
    }
}
#endif

// The A fragment of rows m0..m0+15, columns k0..k0+15 of a row-major shared tile X (row stride ld, rows
// 16-byte aligned, k0 a multiple of 8): matrices (m0, k0), (m0 + 8, k0), (m0, k0 + 8), (m0 + 8, k0 + 8).
template <typename T> __device__ __forceinline__ void frag_a(uint32_t a[4], const T *x, uint32_t ld, uint32_t m0,
                                                             uint32_t k0) {
    const uint32_t i = threadIdx.x % 32, j = i / 8;
    ldmatrix_x4<false>(a, x + (size_t)(m0 + i % 8 + 8 * (j % 2)) * ld + k0 + 8 * (j / 2));
}

// The B fragments of two n-tiles (n0..n0+7 in b[0], n0+8..n0+15 in b[1]), k0..k0+15, of B = Y^T for a
// row-major shared tile Y whose rows are B's columns: matrices (n0, k0), (n0, k0 + 8), (n0 + 8, k0),
// (n0 + 8, k0 + 8) of Y.
template <typename T> __device__ __forceinline__ void frag_bt2(uint32_t b[2][2], const T *y, uint32_t ld,
                                                               uint32_t n0, uint32_t k0) {
    const uint32_t i = threadIdx.x % 32, j = i / 8;
    uint32_t r[4];
    ldmatrix_x4<false>(r, y + (size_t)(n0 + i % 8 + 8 * (j / 2)) * ld + k0 + 8 * (j % 2));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}

// The same of B itself for a row-major shared tile Y whose rows are B's rows (Y[k][n]): transposed
// matrices (k0, n0), (k0 + 8, n0), (k0, n0 + 8), (k0 + 8, n0 + 8) of Y.
template <typename T> __device__ __forceinline__ void frag_b2(uint32_t b[2][2], const T *y, uint32_t ld,
                                                              uint32_t n0, uint32_t k0) {
    const uint32_t i = threadIdx.x % 32, j = i / 8;
    uint32_t r[4];
    ldmatrix_x4<true>(r, y + (size_t)(k0 + i % 8 + 8 * (j % 2)) * ld + n0 + 8 * (j / 2));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}

// The A fragment of a 16x16 block whose values are the accumulators of two 16x8 products (n-tiles
// `lo` for columns 0..7 and `hi` for 8..15): how a product's result feeds the next product.
template <typename T> __device__ __forceinline__ void frag_from_acc(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack2<T>(lo[0], lo[1]);
    a[1] = pack2<T>(lo[2], lo[3]);
    a[2] = pack2<T>(hi[0], hi[1]);
    a[3] = pack2<T>(hi[2], hi[3]);
}
