//! RMS normalisation of the last dimension as one op with its own backward, computed as Llama and Qwen
//! do it (transformers' `LlamaRMSNorm`): in f32, the result rounded to the input's dtype:
//!   r = 1 / sqrt(mean(x^2) + eps),  xhat = x r,  y = dtype(xhat)
//!   dx = r (g - xhat mean(g xhat))
//! The layer's weight multiplies the output as an ordinary candle op, which gives its gradient. It
//! replaces eight composite ops (and the f32 copies autograd kept of them). CPU reference here; CUDA
//! kernels in kernels/norm.cu.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

fn rows_of(l: &Layout) -> Result<(usize, usize)> {
    let h = l.shape().dims().last().copied().unwrap_or(0);
    if h == 0 || h > i32::MAX as usize {
        candle_core::bail!("rms norm over {h} features: expected 1..=2^31-1");
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

fn cpu_fwd<T: Elem>(x: &[T], h: usize, eps: f32) -> Vec<T> {
    let mut y = vec![T::of(0.0); x.len()];
    y.par_chunks_mut(h).zip(x.par_chunks(h)).for_each(|(yr, xr)| {
        let r = inv_rms(xr, eps);
        for (o, v) in yr.iter_mut().zip(xr) {
            *o = T::of(v.f32() * r);
        }
    });
    y
}

fn cpu_bwd<T: Elem>(x: &[T], g: &[T], h: usize, eps: f32) -> Vec<T> {
    let mut dx = vec![T::of(0.0); x.len()];
    dx.par_chunks_mut(h).zip(x.par_chunks(h).zip(g.par_chunks(h))).for_each(|(dr, (xr, gr))| {
        let r = inv_rms(xr, eps);
        let dot = xr.iter().zip(gr).map(|(x, g)| g.f32() * x.f32() * r).sum::<f32>() / h as f32;
        for ((o, x), g) in dr.iter_mut().zip(xr).zip(gr) {
            *o = T::of(r * (g.f32() - x.f32() * r * dot));
        }
    });
    dx
}

struct RmsNormalize {
    eps: f32,
}

impl CustomOp1 for RmsNormalize {
    fn name(&self) -> &'static str {
        "rms-normalize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, h) = rows_of(l)?;
        let out = with_float!((s, l, "x") => |x| IntoStorage::storage(cpu_fwd(x, h, self.eps)));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (rows, h) = rows_of(l)?;
        let y = super::cuda::run(&norm_plan(s.dtype(), rows, h, self.eps, false)?, &[(s, l)])?.remove(0);
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.to_dtype(x.dtype())?.contiguous()?;
        Ok(Some(x.contiguous()?.apply_op2_no_bwd(&g, &RmsNormalizeBwd { eps: self.eps })?))
    }
}

struct RmsNormalizeBwd {
    eps: f32,
}

impl CustomOp2 for RmsNormalizeBwd {
    fn name(&self) -> &'static str {
        "rms-normalize-bwd"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, h) = rows_of(l1)?;
        if l1.shape() != l2.shape() {
            candle_core::bail!("rms norm backward: grad {:?} for input {:?}", l2.shape(), l1.shape());
        }
        let out =
            with_float!((s1, l1, "x"), (s2, l2, "grad") => |x, g| IntoStorage::storage(cpu_bwd(x, g, h, self.eps)));
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
        if l1.shape() != l2.shape() {
            candle_core::bail!("rms norm backward: grad {:?} for input {:?}", l2.shape(), l1.shape());
        }
        let plan = norm_plan(s1.dtype(), rows, h, self.eps, true)?;
        let dx = super::cuda::run(&plan, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((dx, l1.shape().clone()))
    }
}

/// `x / sqrt(mean(x^2) + eps)` over the last dimension, computed in f32 and returned in `x`'s dtype,
/// with a backward. Multiply by the norm weight to get `RMSNorm(x)`.
pub fn rms_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(RmsNormalize { eps: eps as f32 })
}

/// The same from candle's composite ops (transformers' formula): the reference [`rms_normalize`] is
/// tested against, and the decoder's path with `fused_ops = false`.
pub fn rms_normalize_reference(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(candle_core::DType::F32)?;
    let rms = (xf.sqr()?.mean_keepdim(candle_core::D::Minus1)? + eps)?.sqrt()?;
    xf.broadcast_div(&rms)?.to_dtype(x.dtype())
}

/// The launch of `rms_norm_fwd` (`backward`: `rms_norm_bwd`) over `rows` rows of `h` of `dtype`: one block
/// per row, at most 256 threads, fewer for short rows (q/k norms over a head of 64-128).
#[cfg(any(test, feature = "cuda"))]
pub(super) fn norm_plan(dtype: DType, rows: usize, h: usize, eps: f32, backward: bool) -> Result<Plan> {
    let mut p = Plan::default();
    let mut args = vec![p.input("x", dtype, rows * h)];
    if backward {
        args.push(p.input("grad", dtype, rows * h));
    }
    args.extend([p.output("normalized", dtype, rows * h), Arg::U32(h as u32), Arg::F32(eps)]);
    let threads = (h.div_ceil(32) * 32).min(256) as u32;
    let base = if backward { "rms_norm_bwd" } else { "rms_norm_fwd" };
    let (grid, block) = ((rows as u32, 1, 1), (threads, 1, 1));
    p.launch(Launch { module: Module::Norm, kernel: kernel_name(base, dtype)?, grid, block, shared_bytes: 0, args })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn seeded(shape: (usize, usize, usize), scale: f32, seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = shape.0 * shape.1 * shape.2;
        Tensor::from_vec((0..n).map(|_| rng.gen_range(-scale..scale)).collect::<Vec<f32>>(), shape, &Device::Cpu)
            .unwrap()
    }

    fn composite(x: &Tensor, eps: f64) -> Tensor {
        rms_normalize_reference(x, eps).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
        d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    }

    #[test]
    fn matches_the_composite_forward_and_backward() {
        let x = Var::from_tensor(&seeded((2, 3, 37), 3.0, 1)).unwrap();
        let up = seeded((2, 3, 37), 1.0, 2);
        let fused = rms_normalize(x.as_tensor(), 1e-6).unwrap();
        let reference = composite(x.as_tensor(), 1e-6);
        assert!(max_diff(&fused, &reference) < 1e-6);
        let g1 = (fused * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap());
        assert!(d < 1e-5, "gradient differs by {d}");
    }

    #[test]
    fn rounds_like_transformers_in_bf16_and_f16() {
        for dt in [DType::BF16, DType::F16] {
            let x = seeded((1, 4, 64), 5.0, 3).to_dtype(dt).unwrap();
            let fused = rms_normalize(&x, 1e-5).unwrap();
            assert_eq!(fused.dtype(), dt);
            // Same f32 value rounded once: identical bits.
            assert_eq!(max_diff(&fused, &composite(&x, 1e-5)), 0.0, "{dt:?}");
        }
    }

    #[test]
    fn finite_differences_agree() {
        let x = Var::from_tensor(&seeded((1, 2, 9), 2.0, 4)).unwrap();
        let up = seeded((1, 2, 9), 1.0, 5);
        let f = |x: &Tensor| -> f64 {
            (rms_normalize(x, 1e-6).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
        };
        let g = (rms_normalize(x.as_tensor(), 1e-6).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let x0: Vec<f32> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for idx in [0usize, 4, 9, 17] {
            let at = |d: f32| {
                let mut v = x0.clone();
                v[idx] += d;
                f(&Tensor::from_vec(v, (1, 2, 9), &Device::Cpu).unwrap())
            };
            let fd = (at(1e-3) - at(-1e-3)) / 2e-3;
            assert!((fd - g[idx] as f64).abs() < 2e-3, "d/dx[{idx}]: fd {fd} vs {}", g[idx]);
        }
    }
}
