//! A weight's gradient added straight into its f32 accumulator: `acc += g^T x` for a projection's
//! incoming gradient `g` (`[rows, out]`) and input `x` (`[rows, in]`), one GEMM with an f32 output read
//! and written in place (cuBLAS `cublasGemmEx`: bf16/f16/f32 operands, f32 C and compute, beta 1). The
//! product is never rounded to the weight's dtype and never written as a tensor of its own: candle's
//! matmul backward writes `g^T x` in the weight's dtype, which [`super::accumulate`] then reads and adds
//! (2 + 10 bytes a weight element a micro-batch beyond the GEMM, and a weight-sized buffer alive until
//! the backward ends), where this op's GEMM reads and writes its f32 output (8 bytes, inside the GEMM).
//! Megatron-LM calls it gradient-accumulation fusion. CPU: the `gemm` crate with the same beta.

use candle_core::{CpuStorage, InplaceOp3, Layout, Result, Tensor};

use super::cpu::{with_float, Elem};

/// The product's sizes: `rows` summed over, `out x inp` accumulated.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    out: usize,
    inp: usize,
}

struct Wgrad(Dims);

/// Bytes of widened f32 operands a block of rows of a bf16/f16 product holds at once.
const WIDE_BLOCK_BYTES: usize = 8 << 20;

/// `acc[o, i] += sum_r g[r, o] x[r, i]` in f32 (`acc` row-major `out x inp`): f32 operands where they lie,
/// others widened to f32 a block of rows at a time (at most [`WIDE_BLOCK_BYTES`], at least one row).
fn cpu_wgrad<T: Elem>(acc: &mut [f32], g: &[T], x: &[T], d: Dims) {
    if let (Some(g), Some(x)) = (T::as_f32(g), T::as_f32(x)) {
        return gemm_rows(acc, g, x, d);
    }
    let per_row = (d.out + d.inp) * 4;
    let block = (WIDE_BLOCK_BYTES / per_row.max(1)).max(1);
    let (mut gw, mut xw) = (Vec::new(), Vec::new());
    for start in (0..d.rows).step_by(block) {
        let rows = block.min(d.rows - start);
        gw.clear();
        gw.extend(g[start * d.out..(start + rows) * d.out].iter().map(|e| e.f32()));
        xw.clear();
        xw.extend(x[start * d.inp..(start + rows) * d.inp].iter().map(|e| e.f32()));
        gemm_rows(acc, &gw, &xw, Dims { rows, ..d });
    }
}

/// `acc += g^T x` for f32 `g` (`rows x out`) and `x` (`rows x inp`).
fn gemm_rows(acc: &mut [f32], g: &[f32], x: &[f32], d: Dims) {
    // SAFETY: g^T is `out x rows` (column stride `out`, row stride 1), x `rows x inp` (row stride `inp`),
    // acc `out x inp` (row stride `inp`): every index the product touches lies in the slices, whose
    // lengths the op checked.
    unsafe {
        gemm::gemm(
            d.out,
            d.inp,
            d.rows,
            acc.as_mut_ptr(),
            1,
            d.inp as isize,
            true,
            g.as_ptr(),
            d.out as isize,
            1,
            x.as_ptr(),
            1,
            d.inp as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        )
    }
}

impl InplaceOp3 for Wgrad {
    fn name(&self) -> &'static str {
        "wgrad"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        x: &CpuStorage,
        xl: &Layout,
    ) -> Result<()> {
        let CpuStorage::F32(acc) = dst else { candle_core::bail!("wgrad: the accumulator must be f32") };
        let Some((a, b)) = dst_l.contiguous_offsets() else { candle_core::bail!("wgrad: accumulator not contiguous") };
        let acc = &mut acc[a..b];
        with_float!((g, gl, "wgrad gradient"), (x, xl, "wgrad input") => |g, x| cpu_wgrad(acc, g, x, self.0));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<()> {
        let Dims { rows, out, inp } = self.0;
        super::cuda::gemm_accumulate_f32((dst, dst_l), [(g, gl), (x, xl)], (out, inp, rows))
    }
}

/// `acc += g^T x` in f32, in place: `acc` an f32 contiguous `[out, in]` accumulator, `g` `[rows, out]`
/// and `x` `[rows, in]` of one float dtype (copied first where not contiguous).
pub fn wgrad_accumulate(acc: &Tensor, g: &Tensor, x: &Tensor) -> Result<()> {
    let ((rows, out), (x_rows, inp)) = (g.dims2()?, x.dims2()?);
    if acc.dtype() != candle_core::DType::F32 || !acc.is_contiguous() || acc.dims() != [out, inp] || rows != x_rows {
        candle_core::bail!(
            "wgrad: an f32 contiguous [{out}, {inp}] accumulator and {rows} rows in both operands, got {:?} {:?} and {x_rows} rows",
            acc.dtype(),
            acc.dims()
        );
    }
    if g.dtype() != x.dtype() {
        candle_core::bail!("wgrad: the gradient is {:?}, the input {:?}", g.dtype(), x.dtype());
    }
    if rows == 0 || out == 0 || inp == 0 {
        return Ok(());
    }
    let (g, x) = (g.contiguous()?, x.contiguous()?);
    acc.inplace_op3(&g, &x, &Wgrad(Dims { rows, out, inp }))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_rel_diff, seeded};
    use super::*;
    use candle_core::DType;

    /// Against the composite `acc + (g^T x)` in f32, every dtype, a transposed (non-contiguous) gradient
    /// among them, twice into the same accumulator (in place: the accumulator's own storage); a product
    /// wide enough that bf16 and f16 operands are widened in three blocks of rows.
    #[test]
    fn equals_the_f32_product_added() {
        let cases = [(37, 19, 23, [DType::F32, DType::BF16, DType::F16]), (1100, 4096, 8, [DType::BF16; 3])];
        for (rows, out, inp, dtypes) in cases {
            equals_the_f32_product_added_at(rows, out, inp, &dtypes);
        }
    }

    fn equals_the_f32_product_added_at(rows: usize, out: usize, inp: usize, dtypes: &[DType]) {
        for &dtype in dtypes {
            let x = seeded(&[rows, inp], 1.0, 1).to_dtype(dtype).unwrap();
            for g in [seeded(&[rows, out], 1.0, 2), seeded(&[out, rows], 1.0, 3).t().unwrap()] {
                let g = g.to_dtype(dtype).unwrap();
                let acc = seeded(&[out, inp], 1.0, 4);
                let product =
                    g.to_dtype(DType::F32).unwrap().t().unwrap().matmul(&x.to_dtype(DType::F32).unwrap()).unwrap();
                let want = ((&acc + &product).unwrap() + &product).unwrap();
                let alias = acc.clone();
                wgrad_accumulate(&acc, &g, &x).unwrap();
                wgrad_accumulate(&alias, &g, &x).unwrap();
                let err = max_rel_diff(&acc, &want);
                assert!(err < 1e-6, "{dtype:?} {:?}: {err}", g.layout());
            }
        }
    }

    #[test]
    fn mismatched_operands_are_refused() {
        let acc = Tensor::zeros((3, 4), DType::F32, &candle_core::Device::Cpu).unwrap();
        let (g, x) = (seeded(&[5, 3], 1.0, 1), seeded(&[5, 4], 1.0, 2));
        assert!(wgrad_accumulate(&acc.to_dtype(DType::BF16).unwrap(), &g, &x).is_err());
        assert!(wgrad_accumulate(&acc, &x, &g).unwrap_err().to_string().contains("[4, 3] accumulator"));
        assert!(wgrad_accumulate(&acc, &g, &x.to_dtype(DType::BF16).unwrap()).is_err());
        assert!(wgrad_accumulate(&acc, &g.narrow(0, 0, 4).unwrap(), &x).is_err());
    }
}
