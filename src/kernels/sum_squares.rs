//! The sum of squares of a tensor's elements (f32, bf16 or f16) as one f32 value: each gradient's part of
//! the global gradient norm. candle's `g.sqr()?.sum_all()` writes the squares out and then reduces them in
//! a single block (its reduction runs one block per output value): 0.77 s for the 7.6B parameters of the
//! seed's 7B model on an H100, where one read of the 30 GB of f32 gradients takes 15 ms. This op reads
//! each element once, over the whole GPU, and writes no tensor of the input's size. Each thread adds in
//! f64 and the blocks' sums are added in a fixed order, so the value is the same every run. CPU
//! implementation here; CUDA kernels in kernels/sum_squares.cu.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// Elements per block of the CPU's parallel loop.
const BLOCK: usize = 1 << 16;
/// Threads of a block of the partial sums' kernel, and its most blocks (about two blocks of 256 threads
/// for each of an H100's 2,048 resident threads per multiprocessor, 132 of them, rounded to 1,024): each
/// block's sum is one partial, and the total's single block adds them.
#[cfg(any(test, feature = "cuda"))]
const THREADS: u32 = 256;
#[cfg(any(test, feature = "cuda"))]
const MAX_PARTS: usize = 1024;

fn cpu_sum_squares<T: Elem>(x: &[T]) -> f32 {
    let parts: Vec<f64> =
        x.par_chunks(BLOCK).map(|c| c.iter().map(|v| f64::from(v.f32()) * f64::from(v.f32())).sum::<f64>()).collect();
    parts.iter().sum::<f64>() as f32
}

struct SumSquares;

impl CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let total = with_float!((s, l, "sum-squares input") => |x| cpu_sum_squares(x));
        Ok((CpuStorage::F32(vec![total]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let plan = sum_squares_plan(s.dtype(), l.shape().elem_count(), MAX_PARTS)?;
        // The plan's outputs: the partial sums, then the total.
        let total = super::cuda::run(&plan, &[(s, l)])?.pop().expect("the plan's total");
        Ok((total, Shape::from(())))
    }
}

/// The sum of the squares of `x`'s elements, an f32 scalar on `x`'s device (no backward).
pub fn sum_squares(x: &Tensor) -> Result<Tensor> {
    if x.elem_count() > u32::MAX as usize {
        candle_core::bail!("sum_squares: {} elements in one tensor, at most 2^32 - 1", x.elem_count());
    }
    x.contiguous()?.apply_op1_no_bwd(&SumSquares)
}

/// The launches of the sum of squares over `n` elements of `dtype`: `sum_squares_partial` on up to
/// `max_parts` blocks of 256 threads (striding over the rest), one partial each, then `sum_squares_total`
/// on one block of 256 threads striding over the partials.
#[cfg(any(test, feature = "cuda"))]
fn sum_squares_plan(dtype: DType, n: usize, max_parts: usize) -> Result<Plan> {
    let parts = n.div_ceil(THREADS as usize).clamp(1, max_parts);
    let mut p = Plan::default();
    let x = p.input("x", dtype, n);
    let partial = p.output("partial sums", DType::F32, parts);
    let total = p.output("sum of squares", DType::F32, 1);
    let (module, block) = (Module::SumSquares, (THREADS, 1, 1));
    let args = vec![x, partial, Arg::U32(n as u32)];
    let kernel = kernel_name("sum_squares_partial", dtype)?;
    p.launch(Launch { module, kernel, grid: (parts as u32, 1, 1), block, shared_bytes: 0, args })?;
    let args = vec![partial, total, Arg::U32(parts as u32)];
    let kernel = "sum_squares_total".to_string();
    p.launch(Launch { module, kernel, grid: (1, 1, 1), block, shared_bytes: 0, args })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::seeded;
    use super::*;
    use candle_core::{DType, Device};

    /// candle's composite: the squares written out, then summed (in f32).
    fn composite(x: &Tensor) -> f64 {
        x.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-30)
    }

    #[test]
    fn equals_the_composite_and_a_hand_computed_sum() {
        let x = Tensor::new(&[[3f32, -4.0], [0.5, 0.0]], &Device::Cpu).unwrap();
        assert_eq!(sum_squares(&x).unwrap().to_scalar::<f32>().unwrap(), 25.25);
        assert_eq!(sum_squares(&x).unwrap().dims(), &[] as &[usize]);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = seeded(&[300, 777], 2.0, 11).to_dtype(dtype).unwrap();
            let (s, c) = (sum_squares(&x).unwrap().to_scalar::<f32>().unwrap() as f64, composite(&x));
            assert!(close(s, c, 1e-5), "{dtype:?}: {s} vs {c}");
            // A strided view is read as its elements.
            let t = x.t().unwrap();
            assert_eq!(sum_squares(&t).unwrap().to_scalar::<f32>().unwrap() as f64, s, "{dtype:?} transposed");
        }
        let empty = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(sum_squares(&empty).unwrap().to_scalar::<f32>().unwrap(), 0.0);
        let inf = Tensor::new(&[1f32, f32::INFINITY], &Device::Cpu).unwrap();
        assert!(sum_squares(&inf).unwrap().to_scalar::<f32>().unwrap().is_infinite());
        let nan = Tensor::new(&[1f32, f32::NAN], &Device::Cpu).unwrap();
        assert!(sum_squares(&nan).unwrap().to_scalar::<f32>().unwrap().is_nan());
    }

    /// kernels/sum_squares.cu on the emulator against the CPU op, f32/bf16/f16: fewer elements than a
    /// block, a partial grid, more than the full grid's threads (the stride loop; a grid of 5 blocks
    /// stands for the 1,024 of a large tensor, which the emulator would run one block at a time), and
    /// more partials than the total's threads (its stride loop); the same value on every run whatever
    /// order the emulator runs the blocks in.
    #[test]
    fn the_kernels_equal_the_cpu_op() {
        let strided = 5 * THREADS as usize * 3 + 333;
        let cases = [(5, MAX_PARTS), (3 * 256 + 7, MAX_PARTS), (strided, 5), (257 * 256, MAX_PARTS)];
        for (n, max_parts) in cases {
            // The emulator runs 257 blocks slowly: that case in f32 only.
            let dtypes: &[DType] = if n > strided { &[DType::F32] } else { &[DType::F32, DType::BF16, DType::F16] };
            for &dtype in dtypes {
                let x = seeded(&[n], 3.0, n as u64).to_dtype(dtype).unwrap();
                let plan = sum_squares_plan(dtype, n, max_parts).unwrap();
                let outs = super::super::emu::run(&plan, &[&x]).unwrap();
                let got = outs[1].to_vec1::<f32>().unwrap()[0] as f64;
                let want = sum_squares(&x).unwrap().to_scalar::<f32>().unwrap() as f64;
                assert!(close(got, want, 1e-6), "{n} {dtype:?}: {got} vs {want}");
                let again = super::super::emu::run(&plan, &[&x]).unwrap()[1].to_vec1::<f32>().unwrap()[0];
                assert_eq!(again as f64, got, "{n} {dtype:?}: a second run differs");
            }
        }
    }
}
