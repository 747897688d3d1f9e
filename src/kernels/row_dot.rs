//! Each row's dot product of two tensors of one shape and dtype, in f32: the attention backward's `delta =
//! rowsum(dO O)` (one value per query and head). candle's `(g.to_dtype(F32)? * o.to_dtype(F32)?)?.sum(D::Minus1)`
//! writes two f32 casts and their product, each the inputs' size, and reads them back: 28 bytes moved per
//! element of a bf16 input, one element a thread and access. This op reads each input once, in 16-byte
//! runs, and writes a value per row: 4 bytes an element. No backward (delta is made in a backward). CPU
//! implementation here; CUDA kernels in kernels/row_dot.cu.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// `(rows, d)` of the inputs (`[.., d]`), both of one shape; the output's shape (the inputs' but the last).
fn dims(l1: &Layout, l2: &Layout) -> Result<((usize, usize), Shape)> {
    if l1.shape() != l2.shape() {
        candle_core::bail!("row_dot: {:?} against {:?}, one shape expected", l1.shape().dims(), l2.shape().dims());
    }
    let dims = l1.shape().dims();
    let Some((&d, rest)) = dims.split_last() else { candle_core::bail!("row_dot of a scalar") };
    if l1.shape().elem_count() > u32::MAX as usize {
        candle_core::bail!("row_dot of {dims:?}: at most 2^32 - 1 elements");
    }
    Ok(((rest.iter().product(), d), Shape::from(rest)))
}

fn cpu_row_dot<T: Elem>(a: &[T], b: &[T], d: usize) -> Vec<f32> {
    let rows = a.len().checked_div(d).unwrap_or(0);
    (0..rows)
        .into_par_iter()
        .map(|r| {
            let (x, y) = (&a[r * d..(r + 1) * d], &b[r * d..(r + 1) * d]);
            x.iter().zip(y).fold(0f32, |s, (x, y)| x.f32().mul_add(y.f32(), s))
        })
        .collect()
}

struct RowDot;

impl CustomOp2 for RowDot {
    fn name(&self) -> &'static str {
        "row-dot"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((_, d), shape) = dims(l1, l2)?;
        let out = with_float!((s1, l1, "row_dot a"), (s2, l2, "row_dot b") => |a, b| cpu_row_dot(a, b, d));
        Ok((CpuStorage::F32(out), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (dims, shape) = dims(l1, l2)?;
        let out = super::cuda::run(&row_dot_plan(s1.dtype(), dims, MAX_BLOCKS)?, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((out, shape))
    }
}

/// `sum(a * b, -1)` in f32 (`a`, `b` of one shape `[.., d]` and float dtype; the sum in f32 whatever
/// their dtype), without a backward.
pub fn row_dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &RowDot)
}

/// Blocks of the kernel at most (a grid-stride loop covers the rest).
#[cfg(any(test, feature = "cuda"))]
const MAX_BLOCKS: usize = 1024;

/// The launch of `row_dot` over `rows` rows of `d` of `dtype`: a group of lanes per row, as many as the
/// row's 16-byte runs up to 32 (a power of two), 256 threads a block, at most `max_blocks` blocks.
#[cfg(any(test, feature = "cuda"))]
fn row_dot_plan(dtype: DType, (rows, d): (usize, usize), max_blocks: usize) -> Result<Plan> {
    let runs = d.div_ceil(super::launch::pack_len(dtype)).max(1);
    let lanes = runs.next_power_of_two().min(32);
    let mut p = Plan::default();
    let a = p.input("a", dtype, rows * d);
    let b = p.input("b", dtype, rows * d);
    let out = p.output("row dot products", DType::F32, rows);
    let blocks = (rows * lanes).div_ceil(256).clamp(1, max_blocks) as u32;
    let args = vec![a, b, out, Arg::U32(rows as u32), Arg::U32(d as u32), Arg::U32(lanes as u32)];
    let kernel = kernel_name("row_dot", dtype)?;
    p.launch(Launch {
        module: Module::RowDot,
        kernel,
        grid: (blocks, 1, 1),
        block: (256, 1, 1),
        shared_bytes: 0,
        args,
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::seeded;
    use super::*;
    use candle_core::D;

    /// The composite reference: the inputs cast to f32, multiplied and summed over the last dimension.
    fn reference(a: &Tensor, b: &Tensor) -> Tensor {
        (a.to_dtype(DType::F32).unwrap() * b.to_dtype(DType::F32).unwrap()).unwrap().sum(D::Minus1).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// The CPU op against candle's composite, every dtype, and mismatched shapes as errors.
    #[test]
    fn equals_the_composite_sum_of_products() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (a, b) = (seeded(&[2, 3, 5, 64], 1.0, 1), seeded(&[2, 3, 5, 64], 1.0, 2));
            let (a, b) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
            let (got, want) = (row_dot(&a, &b).unwrap(), reference(&a, &b));
            assert_eq!(got.dims(), &[2, 3, 5]);
            for (g, w) in values(&got).iter().zip(values(&want)) {
                assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{dtype:?}: {g} vs {w}");
            }
        }
        let e = row_dot(&seeded(&[2, 4], 1.0, 3), &seeded(&[4, 2], 1.0, 4)).unwrap_err().to_string();
        assert!(e.contains("one shape expected"), "{e}");
    }

    /// kernels/row_dot.cu on the emulator against the CPU op: head dims 64 and 128 in 16-byte runs (8 and 16
    /// lanes a row; 128 f32 runs of 4: 32 lanes), a row of 6 (one element a lane), more rows than two
    /// blocks' groups (the grid-stride loop), no row.
    #[test]
    fn the_kernel_equals_the_cpu_op() {
        for (rows, d, blocks) in
            [(77, 64, MAX_BLOCKS), (33, 128, MAX_BLOCKS), (5, 6, MAX_BLOCKS), (301, 64, 2), (0, 64, 2)]
        {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let (a, b) = (seeded(&[rows, d], 1.0, 5), seeded(&[rows, d], 1.0, 6));
                let (a, b) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
                let plan = row_dot_plan(dtype, (rows, d), blocks).unwrap();
                let got = super::super::emu::run(&plan, &[&a.flatten_all().unwrap(), &b.flatten_all().unwrap()])
                    .unwrap()
                    .remove(0);
                let want = values(&row_dot(&a, &b).unwrap());
                for (i, (g, w)) in values(&got).iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{rows}x{d} {dtype:?} row {i}: {g} vs {w}");
                }
                assert_eq!(values(&got).len(), rows);
            }
        }
    }
}
