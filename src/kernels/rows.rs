//! The two row kernels under the fused log-prob op, as forward-only candle custom ops:
//!
//! - [`row_stats`]: for each row `z` of a `[n, V]` logits chunk and its target `t`, one pass with an online
//!   log-sum-exp gives `[log p(t), entropy, lse]` (f32);
//! - [`row_grad`]: `dz[r, v] = g_r (onehot(t_r)[v] - p[r, v]) - e_r p[r, v] (z[r, v] - lse_r + H_r)` in the
//!   logits' dtype, `p = exp(z - lse)`: the gradient of `g_r log p(t_r) + e_r H_r` (the entropy term only
//!   when its coefficients are given).
//!
//! The CPU implementations here (rayon over rows; f32 terms, f64 sums, see [`Acc`]) are the reference;
//! with the `cuda` feature the same functions run as kernels/rows.cu on the GPU. A target outside `[0, V)` is an
//! error on the CPU and gives NaN on the GPU (no device sync to check it).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{contiguous, u32s, with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};

/// Running softmax statistics relative to the running maximum `m`: `s = sum e^(z-m)`,
/// `u = sum e^(z-m) (z-m)`; then `lse = m + ln s` and `entropy = ln s - u / s`.
///
/// Each term is computed in f32 (as PyTorch does), but `s` and `u` are accumulated in f64. In f32 each of
/// the V terms of a row is rounded against the growing sum, and a term below half an ulp of the sum is
/// lost outright: over a whole vocabulary the lost mass makes the log-sum-exp systematically low, by an
/// amount that grows with V (log-probs of SmolLM2-135M, V = 49,152, were 2.3e-4 too high against a
/// float64 forward). With f64 sums the error is that of the f32 terms (about 1e-7 relative, whatever V).
#[derive(Clone, Copy)]
struct Acc {
    m: f32,
    s: f64,
    u: f64,
}

impl Acc {
    const EMPTY: Acc = Acc { m: f32::NEG_INFINITY, s: 0.0, u: 0.0 };

    fn push(&mut self, z: f32) {
        if z == f32::NEG_INFINITY {
            return;
        }
        if z <= self.m {
            let d = z - self.m;
            let e = d.exp();
            self.s += e as f64;
            self.u += (e * d) as f64;
        } else {
            let d = self.m as f64 - z as f64;
            // `!=` keeps a NaN in `s`: a NaN logit makes the whole row NaN, never a finite wrong value.
            if self.s != 0.0 {
                let sc = d.exp();
                self.u = (self.u + d * self.s) * sc;
                self.s = self.s * sc + 1.0;
            } else {
                self.u = 0.0;
                self.s = 1.0;
            }
            self.m = z;
        }
    }
}

fn dims(logits: &Layout, targets: &Layout) -> Result<(usize, usize)> {
    let (n, v) = logits.shape().dims2()?;
    if targets.shape().dims() != [n] {
        candle_core::bail!("targets have shape {:?}, expected [{n}]", targets.shape().dims());
    }
    if v == 0 || v > i32::MAX as usize {
        candle_core::bail!("vocabulary of {v}: expected 1..=2^31-1");
    }
    if n > i32::MAX as usize {
        candle_core::bail!("{n} rows: at most 2^31-1 (one GPU block each)");
    }
    Ok((n, v))
}

fn cpu_stats<T: Elem>(z: &[T], t: &[u32], v: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; t.len() * 3];
    out.par_chunks_mut(3).zip(z.par_chunks(v.max(1))).zip(t.par_iter()).try_for_each(|((o, row), &t)| {
        if t as usize >= v {
            candle_core::bail!("target {t} is outside the vocabulary of {v}");
        }
        let mut a = Acc::EMPTY;
        for &x in row {
            a.push(x.f32());
        }
        let ln_s = a.s.ln();
        let lse = a.m as f64 + ln_s;
        o[0] = (row[t as usize].f32() as f64 - lse) as f32;
        o[1] = (ln_s - a.u / a.s) as f32;
        o[2] = lse as f32;
        Ok(())
    })?;
    Ok(out)
}

/// `cols` coefficients per row: `(lse, g)`, or `(lse, g, H, e)` with the entropy term.
fn cpu_grad<T: Elem>(z: &[T], t: &[u32], coef: &[f32], v: usize, cols: usize) -> Result<Vec<T>> {
    let mut out = vec![T::of(0.0); z.len()];
    out.par_chunks_mut(v.max(1)).zip(z.par_chunks(v.max(1))).enumerate().try_for_each(|(r, (o, row))| {
        let c = &coef[cols * r..cols * (r + 1)];
        let (lse, g, t) = (c[0], c[1], t[r] as usize);
        let (h, e) = if cols == 4 { (c[2], c[3]) } else { (0.0, 0.0) };
        if t >= v {
            candle_core::bail!("target {t} is outside the vocabulary of {v}");
        }
        for (o, &x) in o.iter_mut().zip(row) {
            let d = x.f32() - lse;
            *o = T::of(-d.exp() * (g + e * (d + h)));
        }
        let d = row[t].f32() - lse;
        o[t] = T::of(g - d.exp() * (g + e * (d + h)));
        Ok(())
    })?;
    Ok(out)
}

/// The coefficients per row of a `[n, cols]` coefficient layout: 2 or 4.
fn coef_cols(n: usize, l: &Layout) -> Result<usize> {
    match l.shape().dims() {
        [m, c @ (2 | 4)] if *m == n => Ok(*c),
        d => candle_core::bail!("coefficients must be f32 [{n}, 2] or [{n}, 4], not {d:?}"),
    }
}

struct RowStats;

impl CustomOp2 for RowStats {
    fn name(&self) -> &'static str {
        "lp-row-stats"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = dims(l1, l2)?;
        let t = u32s(s2, l2, "targets")?;
        let out = with_float!((s1, l1, "logits") => |z| cpu_stats(z, t, v)?);
        Ok((CpuStorage::F32(out), Shape::from((n, 3))))
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
        let (n, v) = dims(l1, l2)?;
        let plan = stats_plan(s1.dtype(), n, v)?;
        let out = super::cuda::run(&plan, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((out, Shape::from((n, 3))))
    }
}

struct RowGrad;

impl CustomOp3 for RowGrad {
    fn name(&self) -> &'static str {
        "lp-row-grad"
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
        let (n, v) = dims(l1, l2)?;
        let t = u32s(s2, l2, "targets")?;
        let cols = coef_cols(n, l3)?;
        let coef = match s3 {
            CpuStorage::F32(c) => contiguous(c, l3, "coefficients")?,
            _ => candle_core::bail!("coefficients must be f32"),
        };
        let out = with_float!((s1, l1, "logits") => |z| IntoStorage::storage(cpu_grad(z, t, coef, v, cols)?));
        Ok((out, Shape::from((n, v))))
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
        let (n, v) = dims(l1, l2)?;
        let cols = coef_cols(n, l3)?;
        let plan = grad_plan(s1.dtype(), n, v, cols)?;
        let out = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3)])?.remove(0);
        Ok((out, Shape::from((n, v))))
    }
}

/// `[n, 3]` f32: `log p(target)`, entropy and log-sum-exp of each row of `logits` (`[n, V]`, f32/bf16/f16;
/// `targets` `[n]` u32). No gradient.
pub fn row_stats(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.detach().contiguous()?.apply_op2_no_bwd(&targets.detach().contiguous()?, &RowStats)
}

/// `dz = g (onehot(t) - p) - e p (log p + H)` (`[n, V]`, dtype of `logits`, `p = softmax(z)` from the
/// row's log-sum-exp): `coef` is `[n, 2]` f32 of `(lse, g)` (no entropy term), or `[n, 4]` of
/// `(lse, g, H, e)` with the row's entropy H and its upstream gradient e. No gradient.
pub fn row_grad(logits: &Tensor, targets: &Tensor, coef: &Tensor) -> Result<Tensor> {
    let coef = coef.detach().to_dtype(DType::F32)?.contiguous()?;
    logits.detach().contiguous()?.apply_op3_no_bwd(&targets.detach().contiguous()?, &coef, &RowGrad)
}

/// The launch of `lp_row_stats` over logits `[n, V]` of `dtype`: one block of 512 threads per row.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn stats_plan(dtype: DType, n: usize, v: usize) -> Result<Plan> {
    let mut p = Plan::default();
    let z = p.input("logits", dtype, n * v);
    let t = p.input("targets", DType::U32, n);
    let out = p.output("stats", DType::F32, n * 3);
    p.launch(Launch {
        module: Module::Rows,
        kernel: kernel_name("lp_row_stats", dtype)?,
        grid: (n as u32, 1, 1),
        block: (512, 1, 1),
        shared_bytes: 0,
        args: vec![z, t, out, Arg::U32(v as u32)],
    })?;
    Ok(p)
}

/// The launch of `lp_row_grad` over logits `[n, V]` of `dtype` with `cols` (2 or 4) coefficients per
/// row: per row, blocks of 256 threads striding over the vocabulary, about two 16-byte packs per thread.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn grad_plan(dtype: DType, n: usize, v: usize, cols: usize) -> Result<Plan> {
    let threads = 256u32;
    let pack = super::launch::pack_len(dtype) as u32;
    let per_row = (v as u32).div_ceil(threads * 2 * pack).clamp(1, 65535);
    let mut p = Plan::default();
    let z = p.input("logits", dtype, n * v);
    let t = p.input("targets", DType::U32, n);
    let coef = p.input("coefficients", DType::F32, n * cols);
    let out = p.output("grad", dtype, n * v);
    p.launch(Launch {
        module: Module::Rows,
        kernel: kernel_name("lp_row_grad", dtype)?,
        grid: (n as u32, per_row, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
        args: vec![z, t, coef, out, Arg::U32(v as u32), Arg::U32(cols as u32)],
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    fn logits(n: usize, v: usize, scale: f32) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((n * 1009 + v) as u64);
        let data: Vec<f32> = (0..n * v).map(|_| rng.gen_range(-scale..scale)).collect();
        Tensor::from_vec(data, (n, v), &Device::Cpu).unwrap()
    }

    fn naive(z: &Tensor, t: &Tensor) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let z = z.to_dtype(DType::F32).unwrap();
        let lse = z.log_sum_exp(D::Minus1).unwrap();
        let logp_all = candle_nn::ops::log_softmax(&z, D::Minus1).unwrap();
        let logp = logp_all.gather(&t.unsqueeze(1).unwrap(), 1).unwrap().squeeze(1).unwrap();
        let ent = (logp_all.exp().unwrap() * &logp_all).unwrap().sum(D::Minus1).unwrap().neg().unwrap();
        (logp.to_vec1().unwrap(), ent.to_vec1().unwrap(), lse.to_vec1().unwrap())
    }

    fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
    }

    #[test]
    fn stats_match_the_composite_ops_in_every_dtype() {
        let (n, v) = (9, 1000);
        let t = Tensor::from_vec((0..n as u32).map(|i| (i * 97 + 5) % v as u32).collect(), n, &Device::Cpu).unwrap();
        // Wide logits (|z| up to 30) exercise the running-max rescaling.
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let z = logits(n, v, 30.0).to_dtype(dt).unwrap();
            let s = row_stats(&z, &t).unwrap();
            assert_eq!(s.dims(), [n, 3]);
            let (lp, ent, lse) = naive(&z, &t);
            let col = |i| s.narrow(1, i, 1).unwrap().squeeze(1).unwrap().to_vec1::<f32>().unwrap();
            assert!(close(&col(0), &lp, 1e-5), "{dt:?} logp {:?} vs {lp:?}", col(0));
            assert!(close(&col(1), &ent, 1e-5), "{dt:?} entropy {:?} vs {ent:?}", col(1));
            assert!(close(&col(2), &lse, 1e-5), "{dt:?} lse");
        }
    }

    /// Logits shaped like a language model's: a few tokens far above a broad mass of unlikely ones.
    fn lm_logits(n: usize, v: usize) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(v as u64);
        (0..n * v).map(|i| if i % v < 3 { 12.0 + i as f32 % 5.0 } else { rng.gen_range(-9.0f32..3.0) }).collect()
    }

    #[test]
    fn stats_are_as_precise_as_float64_whatever_the_vocabulary() {
        // With f32 sums the log-sum-exp of the 151,936-token row came out low by about 1e-4 (the small terms
        // are rounded away against the growing sum); the error must stay at f32 rounding of the result.
        for v in [1_000usize, 49_152, 151_936] {
            let n = 3;
            let z = lm_logits(n, v);
            let t: Vec<u32> = (0..n as u32).map(|i| i * 17 + 1).collect();
            let s = row_stats(
                &Tensor::from_vec(z.clone(), (n, v), &Device::Cpu).unwrap(),
                &Tensor::from_vec(t.clone(), n, &Device::Cpu).unwrap(),
            )
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
            for (r, row) in z.chunks(v).enumerate() {
                let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                let sum: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
                let lse = m + sum.ln();
                let mean_z: f64 = row.iter().map(|&x| (x as f64 - lse).exp() * x as f64).sum();
                let want = [row[t[r] as usize] as f64 - lse, lse - mean_z, lse];
                for (i, w) in want.iter().enumerate() {
                    let err = (s[r][i] as f64 - w).abs();
                    assert!(err < 4e-6, "V = {v}, row {r}, column {i}: {} vs float64 {w} (error {err:.2e})", s[r][i]);
                }
            }
        }
    }

    #[test]
    fn grad_is_g_times_onehot_minus_softmax() {
        let (n, v) = (4, 37);
        let z = logits(n, v, 5.0);
        let t = Tensor::new(&[0u32, 36, 5, 5], &Device::Cpu).unwrap();
        let s = row_stats(&z, &t).unwrap();
        let g = Tensor::new(&[1.5f32, -0.5, 0.0, 2.0], &Device::Cpu).unwrap();
        let coef = Tensor::stack(&[s.narrow(1, 2, 1).unwrap().squeeze(1).unwrap(), g.clone()], 1).unwrap();
        let dz = row_grad(&z, &t, &coef).unwrap();
        let p = candle_nn::ops::softmax(&z, D::Minus1).unwrap();
        let onehot = Tensor::zeros((n, v), DType::F32, &Device::Cpu)
            .unwrap()
            .scatter_add(&t.unsqueeze(1).unwrap(), &Tensor::ones((n, 1), DType::F32, &Device::Cpu).unwrap(), 1)
            .unwrap();
        let want = (onehot - p).unwrap().broadcast_mul(&g.unsqueeze(1).unwrap()).unwrap();
        let diff = (dz - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "max |dz - want| = {diff}");
    }

    #[test]
    fn a_nan_logit_makes_the_row_nan() {
        for pos in [0usize, 3, 9] {
            let mut row = vec![1.0f32, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, 2.5, -2.0, 0.25];
            row[pos] = f32::NAN;
            let z = Tensor::from_vec(row, (1, 10), &Device::Cpu).unwrap();
            let s: Vec<f32> = row_stats(&z, &Tensor::new(&[1u32], &Device::Cpu).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(s.iter().all(|x| x.is_nan()), "NaN at {pos}: {s:?}");
        }
    }

    #[test]
    fn bad_targets_and_shapes_are_errors() {
        let z = logits(2, 5, 1.0);
        let e = row_stats(&z, &Tensor::new(&[1u32, 5], &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
        let e = row_stats(&z, &Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(e.contains("targets have shape"), "{e}");
        let e = row_stats(&z, &Tensor::new(&[1i64, 2], &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(e.contains("u32"), "{e}");
    }
}
