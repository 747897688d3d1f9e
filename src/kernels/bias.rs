//! A projection's bias added to its rows, `y = x + b` over the last dimension, as one op with its own
//! backward: the input's gradient is the incoming one, the bias's its sum over rows in f32, in fixed row
//! blocks (so the same on every run) and rounded once. candle's `broadcast_add` reads the bias through
//! strided indexing per element, and its backward sums over rows in the gradient's own dtype (bf16 loses
//! the low bits of a sum over thousands of tokens) with a block per column reading rows apart. CPU
//! implementation here, over the same row blocks; CUDA kernels in kernels/bias.cu.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{row_blocks, with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, packed_grid, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// `(rows, cols)` of `x` against a bias of `cols`.
fn dims(x: &Layout, b: &Layout) -> Result<(usize, usize)> {
    let cols = x.shape().dims().last().copied().unwrap_or(0);
    if b.shape().dims() != [cols] || cols == 0 {
        candle_core::bail!("bias add: bias {:?} for rows of {cols} ({:?})", b.shape().dims(), x.shape().dims());
    }
    if x.shape().elem_count() > u32::MAX as usize {
        candle_core::bail!("bias add: {} elements, at most 2^32 - 1", x.shape().elem_count());
    }
    Ok((x.shape().elem_count() / cols, cols))
}

fn cpu_fwd<T: Elem>(x: &[T], b: &[T]) -> Vec<T> {
    let mut y = vec![T::of(0.0); x.len()];
    y.par_chunks_mut(b.len()).zip(x.par_chunks(b.len())).for_each(|(yr, xr)| {
        for ((o, v), c) in yr.iter_mut().zip(xr).zip(b) {
            *o = T::of(v.f32() + c.f32());
        }
    });
    y
}

fn cpu_bias_grad<T: Elem>(g: &[T], cols: usize) -> Vec<T> {
    let (_, per) = row_blocks(g.len() / cols);
    let partials: Vec<Vec<f32>> = g
        .par_chunks(per * cols)
        .map(|block| {
            let mut acc = vec![0f32; cols];
            for row in block.chunks(cols) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v.f32();
                }
            }
            acc
        })
        .collect();
    (0..cols).map(|c| T::of(partials.iter().map(|p| p[c]).sum())).collect()
}

struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        dims(l1, l2)?;
        let out = with_float!((s1, l1, "x"), (s2, l2, "bias") => |x, b| IntoStorage::storage(cpu_fwd(x, b)));
        Ok((out, l1.shape().clone()))
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
        let (rows, cols) = dims(l1, l2)?;
        let y = super::cuda::run(&add_plan(s1.dtype(), rows, cols)?, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, b: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let cols = b.elem_count();
        let g = grad.to_dtype(b.dtype())?.contiguous()?;
        let db = g.reshape((g.elem_count() / cols, cols))?.apply_op1_no_bwd(&BiasGrad)?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// The bias's gradient from the rows' (`[rows, cols]` to `[cols]`).
struct BiasGrad;

impl CustomOp1 for BiasGrad {
    fn name(&self) -> &'static str {
        "bias-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = l.shape().dims2()?;
        let out = with_float!((s, l, "gradient") => |g| IntoStorage::storage(cpu_bias_grad(g, cols)));
        Ok((out, Shape::from(cols)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (rows, cols) = l.shape().dims2()?;
        let db = super::cuda::run(&grad_plan(s.dtype(), rows, cols)?, &[(s, l)])?.remove(0);
        Ok((db, Shape::from(cols)))
    }
}

/// `x + b` over the last dimension of `x` (the bias `[cols]`, `x`'s dtype), with a backward to both.
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

/// The launch of `bias_add` over `rows x cols` elements of `dtype` ([`packed_grid`]).
#[cfg(any(test, feature = "cuda"))]
fn add_plan(dtype: DType, rows: usize, cols: usize) -> Result<Plan> {
    let mut p = Plan::default();
    let n = rows * cols;
    let args = vec![
        p.input("x", dtype, n),
        p.input("bias", dtype, cols),
        p.output("y", dtype, n),
        Arg::U32(rows as u32),
        Arg::U32(cols as u32),
    ];
    let (grid, block) = ((packed_grid(n, dtype), 1, 1), (256, 1, 1));
    p.launch(Launch {
        module: Module::Bias,
        kernel: kernel_name("bias_add", dtype)?,
        grid,
        block,
        shared_bytes: 0,
        args,
    })?;
    Ok(p)
}

/// The launches of the bias's gradient over a `rows x cols` gradient: `bias_partial` over [`row_blocks`]
/// (256 packs of columns a block), then `bias_sum` (a thread per column).
#[cfg(any(test, feature = "cuda"))]
fn grad_plan(dtype: DType, rows: usize, cols: usize) -> Result<Plan> {
    let mut p = Plan::default();
    let (blocks, per) = row_blocks(rows);
    let g = p.input("gradient", dtype, rows * cols);
    let db = p.output("bias gradient", dtype, cols);
    let partial = p.output("partial sums", DType::F32, blocks * cols);
    // A thread per 16-byte pack of columns where the row width allows (kernels/bias.cu), else per column.
    let pack = super::launch::pack_len(dtype);
    let units = if cols.is_multiple_of(pack) { cols / pack } else { cols };
    let col_blocks = units.div_ceil(256).clamp(1, 65535) as u32;
    let launch =
        |kernel, grid, args| Launch { module: Module::Bias, kernel, grid, block: (256, 1, 1), shared_bytes: 0, args };
    let dims = [rows, cols, per].map(|v| Arg::U32(v as u32));
    let args = [vec![g, partial], dims.to_vec()].concat();
    p.launch(launch(kernel_name("bias_partial", dtype)?, (blocks as u32, col_blocks, 1), args))?;
    let args = vec![partial, db, Arg::U32(cols as u32), Arg::U32(blocks as u32)];
    p.launch(launch(kernel_name("bias_sum", dtype)?, (cols.div_ceil(256) as u32, 1, 1), args))?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_rel_diff as max_diff, seeded};
    use super::*;
    use candle_core::{DType, Var};

    /// Forward and both gradients against candle's broadcast add, in f32 (exactly: one addition each, the
    /// bias's gradient summed in f32 either way) and in bf16 (the bias's gradient against an f64 sum: candle's
    /// own, summed in bf16, is the one off).
    #[test]
    fn matches_the_broadcast_add_and_an_exact_bias_gradient() {
        for dtype in [DType::F32, DType::BF16] {
            let x = Var::from_tensor(&seeded(&[3, 700, 24], 2.0, 1).to_dtype(dtype).unwrap()).unwrap();
            let b = Var::from_tensor(&seeded(&[24], 1.0, 2).to_dtype(dtype).unwrap()).unwrap();
            let up = seeded(&[3, 700, 24], 1.0, 3).to_dtype(dtype).unwrap();
            let fused = bias_add(x.as_tensor(), b.as_tensor()).unwrap();
            let composite = x.as_tensor().broadcast_add(b.as_tensor()).unwrap();
            assert_eq!(max_diff(&fused, &composite), 0.0, "{dtype:?} forward");
            let grads = (fused * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = grads.get(x.as_tensor()).unwrap();
            assert_eq!(max_diff(dx, &up), 0.0, "{dtype:?}: the input's gradient is the incoming one");
            let db = grads.get(b.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
            let exact = up.to_dtype(DType::F64).unwrap().sum(0).unwrap().sum(0).unwrap();
            let tol = if dtype == DType::F32 { 1e-6 } else { 4e-3 };
            assert!(max_diff(&db, &exact) < tol, "{dtype:?} bias gradient {}", max_diff(&db, &exact));
        }
    }

    /// kernels/bias.cu on the emulator against the CPU op: the sum in the same blocks and order (bit for
    /// bit), the add and the gradient in 16-byte packs and one at a time (a row width of no whole packs:
    /// 13, and 300 in 16-bit types), a bias gradient over more rows than blocks and over more columns (300)
    /// and more packs (2,304 / 8) than a block's threads.
    #[test]
    fn the_kernels_equal_the_cpu_op() {
        for (rows, cols) in [(5, 24), (3, 13), (1100, 300), (40, 2304)] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let x = seeded(&[rows, cols], 2.0, 4).to_dtype(dtype).unwrap();
                let b = seeded(&[cols], 1.0, 5).to_dtype(dtype).unwrap();
                let flat = |t: &Tensor| t.flatten_all().unwrap();
                let y = super::super::emu::run(&add_plan(dtype, rows, cols).unwrap(), &[&flat(&x), &b]).unwrap();
                let want = bias_add(&x, &b).unwrap();
                assert_eq!(max_diff(&y[0], &flat(&want)), 0.0, "add {rows}x{cols} {dtype:?}");
                let db = super::super::emu::run(&grad_plan(dtype, rows, cols).unwrap(), &[&flat(&x)]).unwrap();
                let want = x.apply_op1_no_bwd(&BiasGrad).unwrap();
                assert_eq!(max_diff(&db[0], &want), 0.0, "gradient {rows}x{cols} {dtype:?}");
            }
        }
    }
}
