//! RMSNorm of the last dimension with its weight, as one op with its own backward, computed as Llama and
//! Qwen do it (transformers' `LlamaRMSNorm`): in f32, normalised and rounded to the input's dtype, then
//! times the weight in that dtype:
//!   r = 1 / sqrt(mean(x^2) + eps),  xhat = x r,  y = T(T(xhat) w)
//!   dyh = T(g w),  dx = r (dyh - xhat mean(dyh xhat)),  dw = sum over rows of g T(xhat)
//! It replaces the composite's eight ops and the product with the weight (and the backward of both: the
//! product's two gradients, the weight's as a sum over rows) with one kernel forward and two backward
//! (kernels/norm.cu: the rows, then the weight gradient's per-block partials summed in a fixed order), and
//! keeps only its input for the backward. CPU implementation here, over the same row blocks.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{row_blocks, with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// The widest row: the backward's per-warp partials (h f32 for each of at least one warp) fit 48 KiB of
/// shared memory.
const MAX_FEATURES: usize = 12 << 10;

fn rows_of(l: &Layout) -> Result<(usize, usize)> {
    let h = l.shape().dims().last().copied().unwrap_or(0);
    if h == 0 || h > MAX_FEATURES {
        candle_core::bail!("rms norm over {h} features: expected 1..={MAX_FEATURES}");
    }
    let rows = l.shape().elem_count() / h;
    if rows > i32::MAX as usize {
        candle_core::bail!("{rows} rows: at most 2^31-1 (one GPU block each)");
    }
    Ok((rows, h))
}

fn inv_rms<T: Elem>(x: &[T], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v.f32() * v.f32()).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

fn cpu_fwd<T: Elem>(x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let h = w.len();
    let mut y = vec![T::of(0.0); x.len()];
    y.par_chunks_mut(h).zip(x.par_chunks(h)).for_each(|(yr, xr)| {
        let r = inv_rms(xr, eps);
        for ((o, v), w) in yr.iter_mut().zip(xr).zip(w) {
            *o = T::of(T::of(v.f32() * r).f32() * w.f32());
        }
    });
    y
}

/// `[dx; dw]`: the input's gradient (rows x h) then the weight's (h).
fn cpu_bwd<T: Elem>(x: &[T], w: &[T], g: &[T], eps: f32) -> Vec<T> {
    let h = w.len();
    let rows = x.len() / h;
    let (_, per) = row_blocks(rows);
    let mut out = vec![T::of(0.0); x.len() + h];
    let (dx, dw) = out.split_at_mut(x.len());
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(per * h)
        .zip(x.par_chunks(per * h).zip(g.par_chunks(per * h)))
        .map(|(db, (xb, gb))| {
            let mut acc = vec![0f32; h];
            for ((dr, xr), gr) in db.chunks_mut(h).zip(xb.chunks(h)).zip(gb.chunks(h)) {
                let r = inv_rms(xr, eps);
                let dyh = |j: usize| T::of(gr[j].f32() * w[j].f32()).f32();
                let dot = (0..h).map(|j| dyh(j) * xr[j].f32() * r).sum::<f32>() / h as f32;
                for j in 0..h {
                    let xv = xr[j].f32();
                    dr[j] = T::of(r * (dyh(j) - xv * r * dot));
                    acc[j] += gr[j].f32() * T::of(xv * r).f32();
                }
            }
            acc
        })
        .collect();
    for (j, o) in dw.iter_mut().enumerate() {
        *o = T::of(partials.iter().map(|p| p[j]).sum());
    }
    out
}

fn check_weight(l: &Layout, w: &Layout, h: usize) -> Result<()> {
    if w.shape().dims() != [h] {
        candle_core::bail!("rms norm: weight {:?} for rows of {h} ({:?})", w.shape().dims(), l.shape().dims());
    }
    Ok(())
}

/// The backward's `(rows, h)` of input `x`, weight `w` and gradient `g`, checked against each other.
fn bwd_dims(x: &Layout, w: &Layout, g: &Layout) -> Result<(usize, usize)> {
    let (rows, h) = rows_of(x)?;
    check_weight(x, w, h)?;
    if x.shape() != g.shape() {
        candle_core::bail!("rms norm backward: grad {:?} for input {:?}", g.shape(), x.shape());
    }
    Ok((rows, h))
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, h) = rows_of(l1)?;
        check_weight(l1, l2, h)?;
        let out =
            with_float!((s1, l1, "x"), (s2, l2, "weight") => |x, w| IntoStorage::storage(cpu_fwd(x, w, self.eps)));
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
        let (rows, h) = rows_of(l1)?;
        check_weight(l1, l2, h)?;
        let y = super::cuda::run(&norm_plan(s1.dtype(), rows, h, self.eps, false)?, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(x.dtype())?.contiguous()?;
        let both = x.contiguous()?.apply_op3_no_bwd(&w.contiguous()?, &g, &RmsNormBwd { eps: self.eps })?;
        let h = w.elem_count();
        let rows = x.elem_count() / h;
        let dx = both.narrow(0, 0, rows * h)?.reshape(x.shape())?;
        Ok((Some(dx), Some(both.narrow(0, rows * h, h)?)))
    }
}

struct RmsNormBwd {
    eps: f32,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, h) = bwd_dims(l1, l2, l3)?;
        let out = with_float!((s1, l1, "x"), (s2, l2, "weight"), (s3, l3, "grad") => |x, w, g| {
            IntoStorage::storage(cpu_bwd(x, w, g, self.eps))
        });
        Ok((out, Shape::from(rows * h + h)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (rows, h) = bwd_dims(l1, l2, l3)?;
        let plan = norm_plan(s1.dtype(), rows, h, self.eps, true)?;
        let both = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3)])?.remove(0);
        Ok((both, Shape::from(rows * h + h)))
    }
}

/// `RMSNorm(x) = T(T(x / sqrt(mean(x^2) + eps)) w)` over the last dimension (normalised in f32), with a
/// backward to `x` and to the weight `w` (`[h]`, `x`'s dtype).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// The same from candle's composite ops (transformers' formula): the reference [`rms_norm`] is tested
/// against, and the decoder's path with `fused_ops = false`.
pub fn rms_norm_reference(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(candle_core::DType::F32)?;
    let rms = (xf.sqr()?.mean_keepdim(candle_core::D::Minus1)? + eps)?.sqrt()?;
    xf.broadcast_div(&rms)?.to_dtype(x.dtype())?.broadcast_mul(w)
}

/// The launches over `rows` rows of `h` of `dtype`. Forward: `rms_norm_fwd`, a warp per row, 8 rows a block
/// of 256 threads. Backward:
/// `rms_norm_bwd` over [`row_blocks`] (the input's gradient and each block's f32 partial of the weight's),
/// then `rms_norm_dw` (the partials summed, after the input's gradient in the first output), a warp per row,
/// as many warps a block as their partials fit 48 KiB of shared memory (at most 8).
#[cfg(any(test, feature = "cuda"))]
pub(super) fn norm_plan(dtype: DType, rows: usize, h: usize, eps: f32, backward: bool) -> Result<Plan> {
    let mut p = Plan::default();
    let (x, w) = (p.input("x", dtype, rows * h), p.input("weight", dtype, h));
    let block = (256, 1, 1);
    let launch = |kernel, grid, args| Launch { module: Module::Norm, kernel, grid, block, shared_bytes: 0, args };
    if !backward {
        let y = p.output("y", dtype, rows * h);
        let args = vec![x, w, y, Arg::U32(rows as u32), Arg::U32(h as u32), Arg::F32(eps)];
        p.launch(launch(kernel_name("rms_norm_fwd", dtype)?, (rows.div_ceil(8) as u32, 1, 1), args))?;
        return Ok(p);
    }
    let (blocks, per) = row_blocks(rows);
    let g = p.input("grad", dtype, rows * h);
    let out = p.output("input and weight gradients", dtype, rows * h + h);
    let partial = p.output("weight gradient partials", DType::F32, blocks * h);
    let dims = [rows, h, per].map(|v| Arg::U32(v as u32));
    let args = [vec![x, w, g, out, partial], dims.to_vec(), vec![Arg::F32(eps)]].concat();
    let mut l = launch(kernel_name("rms_norm_bwd", dtype)?, (blocks as u32, 1, 1), args);
    // As many warps (rows at a time) as their partials fit 48 KiB, at most 8.
    let warps = (super::launch::MAX_SHARED_BYTES / (4 * h)).clamp(1, 8);
    l.block = (32 * warps as u32, 1, 1);
    l.shared_bytes = (4 * warps * h) as u32;
    p.launch(l)?;
    let Arg::Buffer { index, .. } = out else { unreachable!("an output is a buffer") };
    let dw = Arg::Buffer { index, offset: rows * h };
    let args = vec![partial, dw, Arg::U32(h as u32), Arg::U32(blocks as u32)];
    p.launch(launch(kernel_name("rms_norm_dw", dtype)?, (h.div_ceil(256) as u32, 1, 1), args))?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_rel_diff as max_diff, seeded};
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Forward and both gradients against the composite ops in f32 on the same (rounded) inputs, on more
    /// rows than the backward has blocks (several rows a block): in f32 to rounding, in bf16 to its rounding
    /// (the weight's gradient summed in f32 over 1,100 rows, where candle's bf16 sum loses 3% of it).
    #[test]
    fn matches_the_composite_forward_and_backward() {
        for (dtype, rows, tol) in [(DType::F32, 7, 1e-5), (DType::F32, 1100, 1e-5), (DType::BF16, 1100, 0.02)] {
            let round = |t: Tensor| t.to_dtype(dtype).unwrap();
            let (x, w) = (round(seeded(&[rows, 37], 3.0, 1)), round((seeded(&[37], 0.5, 2) + 1.0).unwrap()));
            let up = round(seeded(&[rows, 37], 1.0, 3)).to_dtype(DType::F32).unwrap();
            let run = |x: &Tensor, w: &Tensor, fused: bool| {
                let (x, w) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap());
                let op = if fused { rms_norm } else { rms_norm_reference };
                let y = op(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
                let g = (y.to_dtype(DType::F32).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let grads = [&x, &w].map(|v| g.get(v.as_tensor()).unwrap().clone());
                assert!(grads.iter().all(|g| g.dtype() == x.dtype()));
                (y, grads)
            };
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (y, g) = run(&x, &w, true);
            let (y_ref, g_ref) = run(&f32(&x), &f32(&w), false);
            assert!(max_diff(&y, &y_ref) < tol, "{dtype:?} forward {}", max_diff(&y, &y_ref));
            for (a, b) in g.iter().zip(&g_ref) {
                assert_eq!(a.dims(), b.dims());
                let d = max_diff(a, b);
                assert!(d < tol, "{dtype:?} {rows} rows: gradient differs by {d}");
            }
        }
    }

    /// Transformers' roundings: the normalised row rounded to the dtype, then the product with the weight.
    #[test]
    fn rounds_like_transformers_in_bf16_and_f16() {
        for dt in [DType::BF16, DType::F16] {
            let x = seeded(&[4, 64], 5.0, 3).to_dtype(dt).unwrap();
            let w = seeded(&[64], 2.0, 4).to_dtype(dt).unwrap();
            let fused = rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(fused.dtype(), dt);
            let xf = x.to_dtype(DType::F32).unwrap();
            let r =
                xf.sqr().unwrap().mean_keepdim(1).unwrap().affine(1.0, 1e-5).unwrap().sqrt().unwrap().recip().unwrap();
            let xhat = xf.broadcast_mul(&r).unwrap().to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
            let want = xhat.broadcast_mul(&w.to_dtype(DType::F32).unwrap()).unwrap().to_dtype(dt).unwrap();
            assert_eq!(max_diff(&fused, &want), 0.0, "{dt:?}");
        }
    }

    #[test]
    fn finite_differences_agree() {
        let x = Var::from_tensor(&seeded(&[2, 9], 2.0, 4)).unwrap();
        let w = Var::from_tensor(&(seeded(&[9], 0.5, 6) + 1.0).unwrap()).unwrap();
        let up = seeded(&[2, 9], 1.0, 5);
        let f = |x: &Tensor, w: &Tensor| -> f64 {
            (rms_norm(x, w, 1e-6).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
        };
        let g = (rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap() * &up).unwrap().sum_all().unwrap();
        let g = g.backward().unwrap();
        for (which, var, idx) in [(0, &x, [0usize, 4, 9, 17]), (1, &w, [0, 3, 5, 8])] {
            let grad: Vec<f32> = g.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let x0: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            for idx in idx {
                let at = |d: f32| {
                    let mut v = x0.clone();
                    v[idx] += d;
                    let t = Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap();
                    if which == 0 {
                        f(&t, w.as_tensor())
                    } else {
                        f(x.as_tensor(), &t)
                    }
                };
                let fd = (at(1e-3) - at(-1e-3)) / 2e-3;
                assert!((fd - grad[idx] as f64).abs() < 2e-3, "input {which}[{idx}]: fd {fd} vs {}", grad[idx]);
            }
        }
    }

    #[test]
    fn a_weight_of_another_width_is_an_error() {
        let e = rms_norm(&seeded(&[2, 9], 1.0, 1), &seeded(&[8], 1.0, 2), 1e-6).unwrap_err().to_string();
        assert!(e.contains("weight [8] for rows of 9"), "{e}");
    }
}
