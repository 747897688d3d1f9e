//! A LoRA projection as one op with its own backward:
//!   y = T(f32(x W^T + b) + s (dropout(f32(x)) A^T) B^T),  s = alpha / r
//! with `W` (and `b`) frozen in the model's dtype T and `A` `[r, in]`, `B` `[out, r]` in f32 (PEFT's
//! `autocast_adapter_dtype`). The products are candle's GEMMs (cuBLAS on a GPU); the element-wise steps
//! around them are the two kernels of kernels/lora.cu (CPU implementation here):
//!   forward:  base = x W^T (+ b);  xd = dropout(f32(x));  xa = xd A^T;  y = combine(base, xa B^T, s)
//!   backward: gs = s f32(g);  gb = gs B;  dB = gs^T xa;  dA = gb^T dropout(f32(x));
//!             dx = combine(g W, gb A, 1) with the dropout mask on the adapters' part
//! Against candle's composite of the same (cast, two products, scale, cast, sum, cast, and the backward of
//! each, plus the frozen product's) it keeps only `xa` (`[N, r]` f32) for the backward instead of the
//! input in f32, rounds the input's gradient once, and runs 2 element-wise kernels each way instead of 5
//! forward and about 8 backward.
//!
//! Dropout (PEFT's `lora_dropout`, on the adapters' input in training) is a mask drawn from a counter-based
//! hash of `(seed, element)`, not from a stream: the layers' recomputation (`checkpoint_layers`) and the
//! backward draw the same mask from the same seed, on every device.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, packed_grid, Arg, Launch, Module, Plan};

/// Elements per block of the CPU's parallel loops.
const BLOCK: usize = 1 << 14;

/// Dropout on the adapters' input: each element zeroed with probability `p` (the others scaled by
/// 1 / (1 - p)), by a mask that is a function of `seed` and the element's index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub seed: u64,
}

/// The mask's parameters as the kernels take them: (threshold, keep scale, seed).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Mask {
    threshold: u32,
    keep_scale: f32,
    seed: u64,
}

impl Mask {
    /// Every element kept, times `scale`.
    const fn scaled(scale: f32) -> Self {
        Mask { threshold: 0, keep_scale: scale, seed: 0 }
    }

    fn of(dropout: Option<Dropout>) -> Self {
        match dropout {
            Some(d) if d.p > 0.0 => Mask {
                threshold: (d.p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32,
                keep_scale: (1.0 / (1.0 - d.p)) as f32,
                seed: d.seed,
            },
            _ => Mask::scaled(1.0),
        }
    }

    /// Element `i`'s factor: the keep scale, or 0 where dropped (kernels/lora.cu's `lora_keep`).
    #[inline(always)]
    fn factor(&self, i: usize) -> f32 {
        if self.threshold == 0 {
            return self.keep_scale;
        }
        // splitmix64(seed + i golden) = the kernel's mix of seed + (i + 1) golden.
        let z = crate::checksum::splitmix64(self.seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        if ((z >> 32) as u32) >= self.threshold {
            self.keep_scale
        } else {
            0.0
        }
    }
}

fn cpu_input<T: Elem>(x: &[T], mask: Mask) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(BLOCK).zip(x.par_chunks(BLOCK)).enumerate().for_each(|(c, (o, x))| {
        for (j, (o, x)) in o.iter_mut().zip(x).enumerate() {
            let f = mask.factor(c * BLOCK + j);
            *o = if f == 0.0 { 0.0 } else { x.f32() * f };
        }
    });
    out
}

fn cpu_combine<T: Elem>(base: &[T], delta: &[f32], scale: f32, mask: Mask) -> Vec<T> {
    let mut y = vec![T::of(0.0); base.len()];
    y.par_chunks_mut(BLOCK).zip(base.par_chunks(BLOCK).zip(delta.par_chunks(BLOCK))).enumerate().for_each(
        |(c, (y, (b, d)))| {
            for (j, ((y, b), d)) in y.iter_mut().zip(b).zip(d).enumerate() {
                let f = mask.factor(c * BLOCK + j);
                let d = if f == 0.0 { 0.0 } else { d * f };
                *y = T::of(b.f32() + d * scale);
            }
        },
    );
    y
}

fn elements(what: &str, l: &Layout) -> Result<usize> {
    let n = l.shape().elem_count();
    if n > u32::MAX as usize {
        candle_core::bail!("{what}: {n} elements, at most 2^32 - 1");
    }
    Ok(n)
}

/// The contiguous f32 elements of `s`; an error naming `what` otherwise.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    use candle_core::backend::BackendStorage;
    match s {
        CpuStorage::F32(v) => super::cpu::contiguous(v, l, what),
        _ => candle_core::bail!("{what} must be f32, got {:?}", s.dtype()),
    }
}

/// `f32(x)` times the mask (kernels/lora.cu's `lora_input`).
struct LoraInput(Mask);

impl CustomOp1 for LoraInput {
    fn name(&self) -> &'static str {
        "lora-input"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        elements("lora input", l)?;
        let out = with_float!((s, l, "x") => |x| CpuStorage::F32(cpu_input(x, self.0)));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let n = elements("lora input", l)?;
        let out = super::cuda::run(&input_plan(s.dtype(), n, self.0)?, &[(s, l)])?.remove(0);
        Ok((out, l.shape().clone()))
    }
}

/// `T(f32(base) + scale * delta * mask)` (kernels/lora.cu's `lora_combine`).
struct LoraCombine {
    scale: f32,
    mask: Mask,
}

impl CustomOp2 for LoraCombine {
    fn name(&self) -> &'static str {
        "lora-combine"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        same_shape(l1, l2)?;
        let delta = f32s(s2, l2, "delta")?;
        let out =
            with_float!((s1, l1, "base") => |b| IntoStorage::storage(cpu_combine(b, delta, self.scale, self.mask)));
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
        let n = same_shape(l1, l2)?;
        if s2.dtype() != DType::F32 {
            candle_core::bail!("lora combine: delta must be f32, got {:?}", s2.dtype());
        }
        let plan = combine_plan(s1.dtype(), n, self.scale, self.mask)?;
        let out = super::cuda::run(&plan, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((out, l1.shape().clone()))
    }
}

fn same_shape(l1: &Layout, l2: &Layout) -> Result<usize> {
    if l1.shape() != l2.shape() {
        candle_core::bail!("lora combine: base {:?} and delta {:?} differ", l1.shape().dims(), l2.shape().dims());
    }
    elements("lora combine", l1)
}

fn input(x: &Tensor, mask: Mask) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&LoraInput(mask))
}

fn combine(base: &Tensor, delta: &Tensor, scale: f32, mask: Mask) -> Result<Tensor> {
    base.contiguous()?.apply_op2_no_bwd(&delta.contiguous()?, &LoraCombine { scale, mask })
}

/// The op in the graph: recorded with its values (`record_op3`, as [`super::frozen_matmul`]), its backward
/// the three gradients.
struct LoraLinear {
    weight: Tensor,
    /// `xa`, the `[N, r]` f32 product of the (dropped-out) input with A: B's gradient reads it.
    xa: Tensor,
    scale: f32,
    mask: Mask,
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "lora-linear"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        super::cpu::recorded(self.name())
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(self.weight.dtype())?.contiguous()?;
        let gs = input(&g, Mask::scaled(self.scale))?;
        let gb = gs.matmul(b)?;
        let db = b.track_op().then(|| gs.t()?.matmul(&self.xa)).transpose()?;
        let da = match a.track_op() {
            true => Some(gb.t()?.matmul(&input(x, self.mask)?)?),
            false => None,
        };
        let dx = match x.track_op() {
            true => Some(combine(&g.matmul(&self.weight)?, &gb.matmul(a)?, 1.0, self.mask)?),
            false => None,
        };
        Ok((dx, da, db))
    }
}

/// `x W^T + b + (dropout(x) A^T) B^T scale` for `x` `[N, in]` in the model's dtype, a frozen `w`
/// `[out, in]` (and `bias` `[out]`) of that dtype, and f32 adapters `a` `[r, in]`, `b` `[out, r]`; the
/// sum rounded to the model's dtype. Differentiable in `x`, `a` and `b` (never in `w` or `bias`).
pub fn lora_linear(
    x: &Tensor,
    (w, bias): (&Tensor, Option<&Tensor>),
    (a, b): (&Tensor, &Tensor),
    scale: f64,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let mask = Mask::of(dropout);
    let (x_, w) = (x.detach(), w.detach());
    let base = x_.matmul(&w.t()?)?;
    let base = match bias {
        Some(bias) => base.broadcast_add(&bias.detach())?,
        None => base,
    };
    let xa = input(&x_, mask)?.matmul(&a.detach().t()?)?;
    let values = combine(&base, &xa.matmul(&b.detach().t()?)?, scale as f32, Mask::scaled(1.0))?;
    if !(x.track_op() || a.track_op() || b.track_op()) {
        return Ok(values);
    }
    x.record_op3(a, b, &values, LoraLinear { weight: w, xa, scale: scale as f32, mask })
}

/// The same from candle's composite ops (the base product through [`super::frozen_matmul`], the dropout
/// as a product with the mask): the reference [`lora_linear`] is tested against, and the decoder's path
/// with `fused_ops = false`.
pub fn lora_linear_reference(
    x: &Tensor,
    (w, bias): (&Tensor, Option<&Tensor>),
    (a, b): (&Tensor, &Tensor),
    scale: f64,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let base = if x.track_op() { super::frozen_matmul(x, w)? } else { x.matmul(&w.t()?)? };
    let base = match bias {
        Some(bias) => base.broadcast_add(bias)?,
        None => base,
    };
    let mut x32 = x.to_dtype(DType::F32)?;
    let mask = Mask::of(dropout);
    if mask.threshold > 0 {
        let factors: Vec<f32> = (0..x.elem_count()).map(|i| mask.factor(i)).collect();
        x32 = (x32 * Tensor::from_vec(factors, x.shape(), x.device())?)?;
    }
    let delta = x32.matmul(&a.t()?)?.matmul(&b.t()?)?.affine(scale, 0.0)?;
    (base.to_dtype(DType::F32)? + delta)?.to_dtype(x.dtype())
}

/// The launch of `lora_input` over `n` elements of `dtype` ([`packed_grid`]).
#[cfg(any(test, feature = "cuda"))]
fn input_plan(dtype: DType, n: usize, mask: Mask) -> Result<Plan> {
    let mut p = Plan::default();
    let mut args = vec![p.input("x", dtype, n), p.output("f32 x, masked", DType::F32, n)];
    args.push(Arg::U32(n as u32));
    args.extend(mask_args(mask));
    p.launch(elementwise(kernel_name("lora_input", dtype)?, dtype, n, args))?;
    Ok(p)
}

/// The launch of `lora_combine` over `n` elements (base and output of `dtype`, delta f32).
#[cfg(any(test, feature = "cuda"))]
fn combine_plan(dtype: DType, n: usize, scale: f32, mask: Mask) -> Result<Plan> {
    let mut p = Plan::default();
    let mut args = vec![p.input("base", dtype, n), p.input("delta", DType::F32, n), p.output("y", dtype, n)];
    args.extend([Arg::U32(n as u32), Arg::F32(scale)]);
    args.extend(mask_args(mask));
    p.launch(elementwise(kernel_name("lora_combine", dtype)?, dtype, n, args))?;
    Ok(p)
}

#[cfg(any(test, feature = "cuda"))]
fn mask_args(m: Mask) -> [Arg; 4] {
    [Arg::U32(m.threshold), Arg::F32(m.keep_scale), Arg::U32(m.seed as u32), Arg::U32((m.seed >> 32) as u32)]
}

#[cfg(any(test, feature = "cuda"))]
fn elementwise(kernel: String, dtype: DType, n: usize, args: Vec<Arg>) -> Launch {
    let grid = (packed_grid(n, dtype), 1, 1);
    Launch { module: Module::Lora, kernel, grid, block: (256, 1, 1), shared_bytes: 0, args }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_rel_diff as max_diff, seeded};
    use super::*;
    use candle_core::{Device, Var};

    struct Case {
        x: Var,
        w: Tensor,
        bias: Tensor,
        a: Var,
        b: Var,
        up: Tensor,
    }

    fn case(dtype: DType, (n, i, o, r): (usize, usize, usize, usize)) -> Case {
        let t = |(r, c): (usize, usize), scale, seed| seeded(&[r, c], scale, seed).to_dtype(dtype).unwrap();
        Case {
            x: Var::from_tensor(&t((n, i), 1.0, 1)).unwrap(),
            w: t((o, i), 0.5, 2),
            bias: seeded(&[1, o], 0.3, 3).to_dtype(dtype).unwrap().squeeze(0).unwrap(),
            a: Var::from_tensor(&seeded(&[r, i], 0.5, 4)).unwrap(),
            b: Var::from_tensor(&seeded(&[o, r], 0.5, 5)).unwrap(),
            up: t((n, o), 1.0, 6),
        }
    }

    type Op = fn(&Tensor, (&Tensor, Option<&Tensor>), (&Tensor, &Tensor), f64, Option<Dropout>) -> Result<Tensor>;

    /// The output and the gradients of x, A and B of `sum(op(...) * up)`.
    fn run(c: &Case, op: Op, dropout: Option<Dropout>) -> (Tensor, Vec<Tensor>) {
        let y = op(c.x.as_tensor(), (&c.w, Some(&c.bias)), (c.a.as_tensor(), c.b.as_tensor()), 1.5, dropout).unwrap();
        let store = (y.to_dtype(DType::F32).unwrap() * c.up.to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grads = [&c.x, &c.a, &c.b].map(|v| store.get(v.as_tensor()).unwrap().clone()).to_vec();
        (y, grads)
    }

    /// Forward and the three gradients against the composite ops, with and without dropout, in f32 (to
    /// rounding) and bf16 (the composite rounds at each op, the fused op once).
    #[test]
    fn matches_the_composite_forward_and_backward() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 0.02)] {
            for dropout in [None, Some(Dropout { p: 0.3, seed: 11 })] {
                let c = case(dtype, (37, 24, 20, 4));
                let (y, g) = run(&c, lora_linear, dropout);
                let (y_ref, g_ref) = run(&c, lora_linear_reference, dropout);
                assert!(max_diff(&y, &y_ref) < tol, "{dtype:?} {dropout:?} forward {}", max_diff(&y, &y_ref));
                for (k, (g, r)) in g.iter().zip(&g_ref).enumerate() {
                    assert_eq!(g.dtype(), r.dtype(), "gradient {k}");
                    let d = max_diff(g, r);
                    assert!(d < tol, "{dtype:?} {dropout:?}: gradient {k} differs by {d}");
                }
            }
        }
    }

    /// Central differences of `sum(y * up)` in f32 against the op's gradients of x, A and B, with dropout.
    #[test]
    fn finite_differences_agree() {
        let c = case(DType::F32, (5, 6, 4, 2));
        let dropout = Some(Dropout { p: 0.25, seed: 3 });
        let (_, grads) = run(&c, lora_linear, dropout);
        let f = |x: &Tensor, a: &Tensor, b: &Tensor| -> f64 {
            let y = lora_linear(x, (&c.w, Some(&c.bias)), (a, b), 1.5, dropout).unwrap();
            (y * &c.up).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
        };
        let vars = [&c.x, &c.a, &c.b];
        for (which, var) in vars.iter().enumerate() {
            let analytic: Vec<f32> = grads[which].flatten_all().unwrap().to_vec1().unwrap();
            let x0: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            for idx in [0, x0.len() / 2, x0.len() - 1] {
                let at = |d: f32| {
                    let mut v = x0.clone();
                    v[idx] += d;
                    let t = Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap();
                    let mut args = vars.map(|v| v.as_tensor().detach());
                    args[which] = t;
                    f(&args[0], &args[1], &args[2])
                };
                let fd = (at(1e-2) - at(-1e-2)) / 2e-2;
                let a = analytic[idx] as f64;
                assert!((fd - a).abs() < 2e-3 * (1.0 + a.abs()), "input {which}[{idx}]: fd {fd} vs {a}");
            }
        }
    }

    /// The mask drops about p of the elements, the same ones for the same seed, others for another; the
    /// kept ones are scaled by 1 / (1 - p); without dropout the op is the plain projection.
    #[test]
    fn the_dropout_mask_is_a_function_of_the_seed() {
        let keep = |seed| (0..20_000).map(|i| Mask::of(Some(Dropout { p: 0.1, seed })).factor(i)).collect::<Vec<_>>();
        let (m1, m2) = (keep(5), keep(6));
        let dropped = m1.iter().filter(|&&f| f == 0.0).count() as f64 / m1.len() as f64;
        assert!((dropped - 0.1).abs() < 0.01, "{dropped}");
        assert!(m1.iter().all(|&f| f == 0.0 || (f - 1.0 / 0.9).abs() < 1e-6));
        assert_eq!(m1, keep(5));
        assert_ne!(m1, m2);
        assert!(Mask::of(None).threshold == 0 && Mask::of(Some(Dropout { p: 0.0, seed: 1 })).threshold == 0);
        let c = case(DType::F32, (3, 4, 5, 2));
        let x = c.x.as_tensor().detach();
        let y = lora_linear(&x, (&c.w, None), (c.a.as_tensor(), c.b.as_tensor()), 2.0, None).unwrap();
        let plain = x.matmul(&c.w.t().unwrap()).unwrap();
        let delta = x.matmul(&c.a.as_tensor().t().unwrap()).unwrap().matmul(&c.b.as_tensor().t().unwrap()).unwrap();
        assert!(max_diff(&y, &(plain + (delta * 2.0).unwrap()).unwrap()) < 1e-6);
    }

    /// kernels/lora.cu on the emulator against the CPU ops, bit for bit, with and without the mask,
    /// f32/bf16/f16: on 16-byte packs with a tail (35 elements: 4 packs of 8, or 8 of 4, and the rest one
    /// at a time), on no aligned pointer (every element one at a time), and (once) on more packs than the
    /// grid has threads (its stride loop).
    #[test]
    fn the_kernels_equal_the_cpu_ops() {
        let dropout = Mask::of(Some(Dropout { p: 0.2, seed: 1 << 40 }));
        // f32 packs of 4: 1,100,000 elements are more than 1,024 blocks x 256 threads x 4 (slow on the emulator).
        let mut cases = vec![(1_100_000, DType::F32, dropout, false)];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for misaligned in [false, true] {
                cases.extend([Mask::scaled(1.0), Mask::scaled(0.75), dropout].map(|m| (35, dtype, m, misaligned)));
            }
        }
        for (n, dtype, mask, misaligned) in cases {
            let run = if misaligned { super::super::emu::run_shifted } else { super::super::emu::run };
            let x = seeded(&[n / 5, 5], 2.0, 7).to_dtype(dtype).unwrap().flatten_all().unwrap();
            let delta = seeded(&[n / 5, 5], 1.0, 8).flatten_all().unwrap();
            let got = run(&input_plan(dtype, n, mask).unwrap(), &[&x]).unwrap();
            let want = input(&x, mask).unwrap();
            assert_eq!(max_diff(&got[0], &want), 0.0, "input {n} {dtype:?} {mask:?} misaligned {misaligned}");
            let plan = combine_plan(dtype, n, 1.5, mask).unwrap();
            let got = run(&plan, &[&x, &delta]).unwrap();
            let want = combine(&x, &delta, 1.5, mask).unwrap();
            assert_eq!(max_diff(&got[0], &want), 0.0, "combine {n} {dtype:?} {mask:?} misaligned {misaligned}");
        }
    }
}
