//! Rotary position embedding fused with the `[B, T, H, D] -> [B, H, T, D]` transpose, as one op with its
//! own backward. With `cos`, `sin` `[B, 1, T, D]` (both halves equal) and `x = (x1, x2)` split at `D/2`:
//!   y = x cos + rotate_half(x) sin,  rotate_half(x) = (-x2, x1)
//! rounded after each product and the sum as transformers' bf16 ops are; the backward is the inverse
//! rotation, `dx1 = g1 cos + g2 sin`, `dx2 = g2 cos - g1 sin`. It replaces seven composite ops per
//! tensor. CPU reference here; CUDA kernels in kernels/rope.cu.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// `(b, t, h, d)` of `x` (or of the gradient `[B, H, T, D]` when `grad`), checking cos/sin `[B, 1, T, D]`.
fn dims(x: &Layout, c: &Layout, s: &Layout, grad: bool) -> Result<(usize, usize, usize, usize)> {
    let (b, t, h, d) = match x.shape().dims4()? {
        (b, h, t, d) if grad => (b, t, h, d),
        (b, t, h, d) => (b, t, h, d),
    };
    for (what, l) in [("cos", c), ("sin", s)] {
        if l.shape().dims() != [b, 1, t, d] {
            candle_core::bail!("rope {what} has shape {:?}, expected [{b}, 1, {t}, {d}]", l.shape().dims());
        }
    }
    if d == 0 || d % 2 != 0 {
        candle_core::bail!("rope over a head dimension of {d}: expected a positive even number");
    }
    if b * t * h * d > u32::MAX as usize {
        candle_core::bail!("rope over {b} x {t} x {h} x {d} elements: at most 2^32 - 1");
    }
    Ok((b, t, h, d))
}

/// Apply the rotation (`inverse`: its transpose) to `src`, reading `[B, T, H, D]` and writing
/// `[B, H, T, D]` (or, when `inverse`, reading `[B, H, T, D]` and writing `[B, T, H, D]`).
fn cpu_rope<T: Elem>(
    src: &[T],
    cs: &[T],
    sn: &[T],
    (_, t, h, d): (usize, usize, usize, usize),
    inverse: bool,
) -> Vec<T> {
    let half = d / 2;
    let mut out = vec![T::of(0.0); src.len()];
    // One output row of D values per (b, h, t) or (b, t, h).
    out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
        let (bi, hi, ti) = if inverse { (r / (t * h), r % h, (r / h) % t) } else { (r / (h * t), (r / t) % h, r % t) };
        let c = (bi * t + ti) * d;
        let s = if inverse { ((bi * h + hi) * t + ti) * d } else { ((bi * t + ti) * h + hi) * d };
        for i in 0..half {
            let (x1, x2) = (src[s + i].f32(), src[s + half + i].f32());
            let (c1, c2) = (cs[c + i].f32(), cs[c + half + i].f32());
            let (s1, s2) = (sn[c + i].f32(), sn[c + half + i].f32());
            if inverse {
                o[i] = T::of(x1 * c1 + x2 * s2);
                o[half + i] = T::of(x2 * c2 - x1 * s1);
            } else {
                let round = |v: f32| T::of(v).f32();
                o[i] = T::of(round(x1 * c1) + round(-x2 * s1));
                o[half + i] = T::of(round(x2 * c2) + round(x1 * s2));
            }
        }
    });
    out
}

struct Rope {
    inverse: bool,
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rope-bwd"
        } else {
            "rope"
        }
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
        let dims = dims(l1, l2, l3, self.inverse)?;
        let inv = self.inverse;
        let out = with_float!((s1, l1, "x"), (s2, l2, "cos"), (s3, l3, "sin") => |x, c, s| {
            IntoStorage::storage(cpu_rope(x, c, s, dims, inv))
        });
        Ok((out, out_shape(dims, inv)))
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
        let dims = dims(l1, l2, l3, self.inverse)?;
        let plan = rope_plan(s1.dtype(), dims, self.inverse)?;
        let y = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3)])?.remove(0);
        Ok((y, out_shape(dims, self.inverse)))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(cos.dtype())?.contiguous()?;
        let dx = g.apply_op3_no_bwd(cos, sin, &Rope { inverse: true })?;
        Ok((Some(dx), None, None))
    }
}

fn out_shape((b, t, h, d): (usize, usize, usize, usize), inverse: bool) -> Shape {
    if inverse {
        Shape::from((b, t, h, d))
    } else {
        Shape::from((b, h, t, d))
    }
}

/// Rotary embedding of `x` (`[B, T, H, D]`) with `cos`, `sin` (`[B, 1, T, D]`, same dtype), returned as
/// `[B, H, T, D]`, with a backward to `x`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { inverse: false })
}

/// The same from candle's composite ops (transpose, products, `rotate_half`): the reference [`rope`] is
/// tested against, and the decoder's path with `fused_ops = false`.
pub fn rope_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    use candle_core::D;
    let x = x.transpose(1, 2)?.contiguous()?;
    let d = x.dim(D::Minus1)?;
    let rot = Tensor::cat(&[&x.narrow(D::Minus1, d / 2, d / 2)?.neg()?, &x.narrow(D::Minus1, 0, d / 2)?], D::Minus1)?;
    x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?
}

/// The launch of `rope_fwd` (`inverse`: `rope_bwd`) over `[b, t, h, d]` of `dtype`: a thread per 16-byte
/// run of a half-row, 256 per block, at most 1,024 blocks (a grid-stride loop covers the rest).
#[cfg(any(test, feature = "cuda"))]
pub(super) fn rope_plan(dtype: DType, (b, t, h, d): (usize, usize, usize, usize), inverse: bool) -> Result<Plan> {
    let len = b * t * h * d;
    let mut p = Plan::default();
    let x = p.input(if inverse { "grad" } else { "x" }, dtype, len);
    let (c, s) = (p.input("cos", dtype, b * t * d), p.input("sin", dtype, b * t * d));
    let y = p.output("rotated", dtype, len);
    let dims = [b, t, h, d].map(|n| Arg::U32(n as u32));
    // A thread per 16-byte run of a half-row (at most; runs of one element where the kernel cannot pack).
    let threads = 256u32;
    let blocks = (len / 2).div_ceil(threads as usize * super::launch::pack_len(dtype)).min(1024) as u32;
    p.launch(Launch {
        module: Module::Rope,
        kernel: kernel_name(if inverse { "rope_bwd" } else { "rope_fwd" }, dtype)?,
        grid: (blocks, 1, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
        args: [x, c, s, y].into_iter().chain(dims).collect(),
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn seeded(shape: &[usize], scale: f32, seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        Tensor::from_vec((0..n).map(|_| rng.gen_range(-scale..scale)).collect::<Vec<f32>>(), shape, &Device::Cpu)
            .unwrap()
    }

    /// cos/sin of real angles, both halves equal.
    fn tables(b: usize, t: usize, d: usize) -> (Tensor, Tensor) {
        let half = d / 2;
        let mut c = Vec::new();
        let mut s = Vec::new();
        for bi in 0..b {
            for p in 0..t {
                let row: Vec<f32> =
                    (0..half).map(|i| (p + bi) as f32 * 10000f32.powf(-((2 * i) as f32) / d as f32)).collect();
                for _ in 0..2 {
                    c.extend(row.iter().map(|a| a.cos()));
                    s.extend(row.iter().map(|a| a.sin()));
                }
            }
        }
        let shape = (b, 1, t, d);
        (Tensor::from_vec(c, shape, &Device::Cpu).unwrap(), Tensor::from_vec(s, shape, &Device::Cpu).unwrap())
    }

    fn composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        rope_reference(x, cos, sin).unwrap()
    }

    use super::super::testing::max_abs_diff as max_diff;

    #[test]
    fn matches_the_composite_forward_and_backward() {
        let (b, t, h, d) = (2, 5, 3, 8);
        let x = Var::from_tensor(&seeded(&[b, t, h, d], 2.0, 1)).unwrap();
        let (cos, sin) = tables(b, t, d);
        let up = seeded(&[b, h, t, d], 1.0, 2);
        let fused = rope(x.as_tensor(), &cos, &sin).unwrap();
        let reference = composite(x.as_tensor(), &cos, &sin);
        assert_eq!(fused.dims(), [b, h, t, d]);
        assert!(max_diff(&fused, &reference) < 1e-6);
        let g1 = (fused * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let diff = max_diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap());
        assert!(diff < 1e-6, "gradient differs by {diff}");
    }

    #[test]
    fn rounds_like_the_composite_in_bf16_and_f16() {
        let (b, t, h, d) = (1, 7, 2, 16);
        let (cos, sin) = tables(b, t, d);
        for dt in [DType::BF16, DType::F16] {
            let x = seeded(&[b, t, h, d], 3.0, 3).to_dtype(dt).unwrap();
            let (c, s) = (cos.to_dtype(dt).unwrap(), sin.to_dtype(dt).unwrap());
            assert_eq!(max_diff(&rope(&x, &c, &s).unwrap(), &composite(&x, &c, &s)), 0.0, "{dt:?}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let x = Tensor::zeros((1, 2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        let (c, s) = tables(1, 3, 4);
        assert!(rope(&x, &c, &s).unwrap_err().to_string().contains("cos has shape"));
    }
}
