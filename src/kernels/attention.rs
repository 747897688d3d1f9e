//! The masked, scaled softmax of attention scores as one op with its own backward.
//!
//! For scores `x` (`[B, H, T, S]`) and, per query `(b, i)`, the range of keys `lo..=hi` it may attend to
//! (`ranges`: `[B, T, 2]` u32; causal within a packed segment, or only itself for padding):
//!   y_j = exp(scale x_j - m) / sum_{k in lo..=hi} exp(scale x_k - m)   for j in lo..=hi, else 0
//!   dx_j = scale y_j (g_j - sum_k g_k y_k)
//! in f32 whatever the dtype of `x`, with the output in that dtype. It replaces scale, a `[B, 1, T, S]`
//! additive f32 mask and candle's composite softmax: one pass instead of six, no mask tensor, and the
//! backward keeps only the probabilities. CPU reference here; CUDA kernels in kernels/attention.cu.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{u32s, with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// `(batch, heads, t, s)` of scores `[B, H, T, S]` with ranges `[B, T, 2]`.
fn dims(x: &Layout, ranges: &Layout) -> Result<(usize, usize, usize, usize)> {
    let (b, h, t, s) = x.shape().dims4()?;
    if ranges.shape().dims() != [b, t, 2] {
        candle_core::bail!("attention ranges have shape {:?}, expected [{b}, {t}, 2]", ranges.shape().dims());
    }
    if s == 0 || s > i32::MAX as usize {
        candle_core::bail!("attention over {s} keys: expected 1..=2^31-1");
    }
    if b * h * t > i32::MAX as usize {
        candle_core::bail!("{} attention rows: at most 2^31-1 (one GPU block each)", b * h * t);
    }
    Ok((b, h, t, s))
}

fn backward_shapes(y: &Layout, grad: &Layout) -> Result<()> {
    if y.shape() != grad.shape() {
        candle_core::bail!("masked-softmax backward: grad {:?} for output {:?}", grad.shape(), y.shape());
    }
    Ok(())
}

/// The key range of score row `row`, clipped to the row.
fn range(ranges: &[u32], row: usize, heads: usize, t: usize, s: usize) -> (usize, usize) {
    let (b, i) = (row / (heads * t), row % t);
    let lo = ranges[(b * t + i) * 2] as usize;
    let hi = (ranges[(b * t + i) * 2 + 1] as usize).min(s - 1);
    (lo, hi)
}

fn cpu_fwd<T: Elem>(x: &[T], ranges: &[u32], heads: usize, t: usize, s: usize, scale: f32) -> Vec<T> {
    let mut y = vec![T::of(0.0); x.len()];
    y.par_chunks_mut(s).zip(x.par_chunks(s)).enumerate().for_each(|(r, (yr, xr))| {
        let (lo, hi) = range(ranges, r, heads, t, s);
        if lo > hi {
            return;
        }
        let m = xr[lo..=hi].iter().fold(f32::NEG_INFINITY, |m, v| m.max(scale * v.f32()));
        let mut sum = 0f32;
        let mut e = Vec::with_capacity(hi + 1 - lo);
        for v in &xr[lo..=hi] {
            let p = (scale * v.f32() - m).exp();
            sum += p;
            e.push(p);
        }
        let inv = 1.0 / sum;
        for (o, p) in yr[lo..=hi].iter_mut().zip(e) {
            *o = T::of(p * inv);
        }
    });
    y
}

fn cpu_bwd<T: Elem>(y: &[T], g: &[T], ranges: &[u32], heads: usize, t: usize, s: usize, scale: f32) -> Vec<T> {
    let mut dx = vec![T::of(0.0); y.len()];
    dx.par_chunks_mut(s).zip(y.par_chunks(s).zip(g.par_chunks(s))).enumerate().for_each(|(r, (dr, (yr, gr)))| {
        let (lo, hi) = range(ranges, r, heads, t, s);
        if lo > hi {
            return;
        }
        let dot: f32 = yr[lo..=hi].iter().zip(&gr[lo..=hi]).map(|(y, g)| y.f32() * g.f32()).sum();
        for ((o, y), g) in dr[lo..=hi].iter_mut().zip(&yr[lo..=hi]).zip(&gr[lo..=hi]) {
            *o = T::of(scale * y.f32() * (g.f32() - dot));
        }
    });
    dx
}

struct MaskedSoftmax {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, h, t, s) = dims(l1, l2)?;
        let r = u32s(s2, l2, "attention ranges")?;
        let out = with_float!((s1, l1, "scores") => |x| IntoStorage::storage(cpu_fwd(x, r, h, t, s, self.scale)));
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
        let plan = softmax_plan(s1.dtype(), dims(l1, l2)?, self.scale, false)?;
        let y = super::cuda::run(&plan, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, ranges: &Tensor, y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(y.dtype())?.contiguous()?;
        let dx = y.contiguous()?.apply_op3_no_bwd(&g, ranges, &MaskedSoftmaxBwd { scale: self.scale })?;
        Ok((Some(dx), None))
    }
}

struct MaskedSoftmaxBwd {
    scale: f32,
}

impl CustomOp3 for MaskedSoftmaxBwd {
    fn name(&self) -> &'static str {
        "masked-softmax-bwd"
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
        let (_, h, t, s) = dims(l1, l3)?;
        backward_shapes(l1, l2)?;
        let r = u32s(s3, l3, "attention ranges")?;
        let k = self.scale;
        let out =
            with_float!((s1, l1, "y"), (s2, l2, "grad") => |y, g| IntoStorage::storage(cpu_bwd(y, g, r, h, t, s, k)));
        Ok((out, l1.shape().clone()))
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
        backward_shapes(l1, l2)?;
        let plan = softmax_plan(s1.dtype(), dims(l1, l3)?, self.scale, true)?;
        let dx = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3)])?.remove(0);
        Ok((dx, l1.shape().clone()))
    }
}

/// `softmax(scale * scores)` over each query's key range `ranges[b, i] = (lo, hi)` (inclusive), 0 outside;
/// `scores` `[B, H, T, S]` f32/bf16/f16, the output in the same dtype, with a backward.
pub fn masked_softmax(scores: &Tensor, ranges: &Tensor, scale: f64) -> Result<Tensor> {
    scores.contiguous()?.apply_op2(&ranges.contiguous()?, MaskedSoftmax { scale: scale as f32 })
}

/// The same from candle's composite ops and an additive `[B, 1, T, S]` mask built from `ranges` on the
/// host (scale in the scores' dtype, then f32, mask, softmax, back to the dtype): the reference
/// [`masked_softmax`] is tested against, and the decoder's path with `fused_ops = false`. An empty range
/// gives a uniform row here (the fused op gives zeros); the decoder never makes one.
pub fn masked_softmax_reference(scores: &Tensor, ranges: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, _, t, s) = scores.dims4()?;
    let r: Vec<u32> = ranges.flatten_all()?.to_vec1()?;
    if r.len() != b * t * 2 {
        candle_core::bail!("attention ranges have {} values, expected {}", r.len(), b * t * 2);
    }
    let mut m = vec![-1e9f32; b * t * s];
    for (q, row) in m.chunks_mut(s).enumerate() {
        let (lo, hi) = (r[2 * q] as usize, (r[2 * q + 1] as usize).min(s - 1));
        for cell in row.iter_mut().take(hi + 1).skip(lo) {
            *cell = 0.0;
        }
    }
    let mask = Tensor::from_vec(m, (b, 1, t, s), scores.device())?;
    let x = (scores * scale)?.to_dtype(candle_core::DType::F32)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax(&x, candle_core::D::Minus1)?.to_dtype(scores.dtype())
}

/// The launch of `attn_softmax_fwd` (`backward`: `attn_softmax_bwd`) over scores `[B, H, T, S]` of
/// `dtype`: one block of 256 threads per row of S.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn softmax_plan(
    dtype: DType,
    (b, h, t, s): (usize, usize, usize, usize),
    scale: f32,
    backward: bool,
) -> Result<Plan> {
    let (rows, mut p) = (b * h * t, Plan::default());
    let mut args = match backward {
        false => vec![p.input("scores", dtype, rows * s)],
        true => vec![p.input("y", dtype, rows * s), p.input("grad", dtype, rows * s)],
    };
    args.push(p.input("attention ranges", DType::U32, b * t * 2));
    args.push(p.output("probabilities", dtype, rows * s));
    args.extend([Arg::U32(h as u32), Arg::U32(t as u32), Arg::U32(s as u32), Arg::F32(scale)]);
    let base = if backward { "attn_softmax_bwd" } else { "attn_softmax_fwd" };
    let (grid, block) = ((rows as u32, 1, 1), (256, 1, 1));
    p.launch(Launch {
        module: Module::Attention,
        kernel: kernel_name(base, dtype)?,
        grid,
        block,
        shared_bytes: 0,
        args,
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var, D};

    /// Scores `[2, 3, 5, 7]` (keys = 2 past + 5 new), ranges with a causal row, a packed second segment
    /// and a padding query.
    fn setup() -> (Var, Tensor, Tensor) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (b, h, t, s) = (2, 3, 5, 7);
        let data: Vec<f32> = (0..b * h * t * s).map(|_| rng.gen_range(-4.0..4.0)).collect();
        let x = Var::from_vec(data, (b, h, t, s), &Device::Cpu).unwrap();
        // Row 0: causal with 2 cached keys (query i sees 0..=i+2). Row 1: segment A = queries 0..2,
        // segment B = queries 2..4 (keys from 4), query 4 is padding (itself only, key 6).
        let r: Vec<u32> = [[0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [2, 2], [2, 3], [4, 4], [4, 5], [6, 6]]
            .iter()
            .flatten()
            .copied()
            .collect();
        let ranges = Tensor::from_vec(r.clone(), (b, t, 2), &Device::Cpu).unwrap();
        // The same as an additive mask.
        let mut m = vec![-1e30f32; b * t * s];
        for bi in 0..b {
            for i in 0..t {
                let (lo, hi) = (r[(bi * t + i) * 2] as usize, r[(bi * t + i) * 2 + 1] as usize);
                for cell in &mut m[(bi * t + i) * s + lo..=(bi * t + i) * s + hi] {
                    *cell = 0.0;
                }
            }
        }
        let mask = Tensor::from_vec(m, (b, 1, t, s), &Device::Cpu).unwrap();
        (x, ranges, mask)
    }

    /// Seeded upstream gradient (candle's rand is not seeded).
    fn upstream(shape: &Shape) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let data: Vec<f32> = (0..shape.elem_count()).map(|_| rng.gen_range(-1.0..1.0)).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn composite(x: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
        candle_nn::ops::softmax(&(x * scale).unwrap().broadcast_add(mask).unwrap(), D::Minus1).unwrap()
    }

    use super::super::testing::max_abs_diff as max_diff;

    #[test]
    fn matches_scale_mask_softmax_forward_and_backward() {
        let (x, ranges, mask) = setup();
        let up = upstream(x.shape());
        let fused = masked_softmax(x.as_tensor(), &ranges, 0.35).unwrap();
        let reference = composite(x.as_tensor(), &mask, 0.35);
        assert!(max_diff(&fused, &reference) < 1e-6);
        let g1 = (fused * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap());
        assert!(max_diff(a, b) < 1e-6, "gradient differs by {}", max_diff(a, b));
    }

    #[test]
    fn masked_entries_are_exactly_zero_and_rows_sum_to_one() {
        let (x, ranges, _) = setup();
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let y = masked_softmax(&x.as_tensor().to_dtype(dt).unwrap(), &ranges, 1.0).unwrap();
            assert_eq!(y.dtype(), dt);
            let y = y.to_dtype(DType::F32).unwrap();
            let sums: Vec<f32> = y.sum(D::Minus1).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-2), "{sums:?}");
            let row: Vec<f32> = y.get(1).unwrap().get(0).unwrap().get(4).unwrap().to_vec1().unwrap();
            assert_eq!(row, vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], "padding query sees only itself");
        }
    }

    #[test]
    fn finite_differences_agree() {
        let (x, ranges, _) = setup();
        let up = upstream(x.shape());
        let f = |x: &Tensor| -> f64 {
            let y = masked_softmax(x, &ranges, 0.7).unwrap();
            (y * &up).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
        };
        let y = masked_softmax(x.as_tensor(), &ranges, 0.7).unwrap();
        let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let x0: Vec<f32> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let eps = 1e-3f32;
        for idx in [0usize, 9, 40, 77, 150, 209] {
            let at = |d: f32| {
                let mut v = x0.clone();
                v[idx] += d;
                f(&Tensor::from_vec(v, x.shape(), &Device::Cpu).unwrap())
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            assert!((fd - g[idx] as f64).abs() < 2e-3, "d/dx[{idx}]: fd {fd} vs {}", g[idx]);
        }
    }

    #[test]
    fn ranges_past_the_keys_are_clipped_and_empty_ranges_give_zeros() {
        let x =
            Tensor::from_vec((0..8).map(|i| i as f32 * 0.1).collect::<Vec<_>>(), (1, 1, 2, 4), &Device::Cpu).unwrap();
        let r = Tensor::new(&[[[2u32, 99], [3, 1]]], &Device::Cpu).unwrap();
        let y: Vec<Vec<f32>> =
            masked_softmax(&x, &r, 1.0).unwrap().squeeze(0).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
        assert_eq!(&y[0][..2], &[0.0, 0.0]);
        assert!((y[0][2] + y[0][3] - 1.0).abs() < 1e-6 && y[0][3] > y[0][2]);
        assert_eq!(y[1], vec![0.0; 4]);
    }

    #[test]
    fn bad_ranges_are_errors() {
        let x = Tensor::zeros((1, 2, 3, 3), DType::F32, &Device::Cpu).unwrap();
        let r = Tensor::zeros((1, 2, 2), DType::U32, &Device::Cpu).unwrap();
        assert!(masked_softmax(&x, &r, 1.0).unwrap_err().to_string().contains("ranges have shape"));
        let r = Tensor::zeros((1, 3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(masked_softmax(&x, &r, 1.0).unwrap_err().to_string().contains("u32"));
    }
}
