//! The MLP's gated activation `silu(gate) * up` as one op with its own backward, rounded where PyTorch's
//! bf16 ops round (silu computed in f32 and rounded, then the product):
//!   sig = 1 / (1 + exp(-g)),  s = T(g sig),  y = T(s u)
//!   ds = T(dy u),  dg = T(ds sig (1 + g (1 - sig))),  du = T(dy s)
//! It replaces candle's silu and product and their backward (about ten ops, each a pass over the
//! `[N, intermediate]` activations, the widest of a layer) with one kernel each way. CPU implementation
//! here; CUDA kernels in kernels/swiglu.cu.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, packed_grid, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// Elements per block of the CPU's parallel loops.
const BLOCK: usize = 1 << 14;

/// `(sig, s)` of gate value `x` in `T`'s rounding.
#[inline(always)]
fn silu<T: Elem>(x: f32) -> (f32, f32) {
    let sig = 1.0 / (1.0 + (-x).exp());
    (sig, T::of(x * sig).f32())
}

fn cpu_fwd<T: Elem>(g: &[T], u: &[T]) -> Vec<T> {
    let mut y = vec![T::of(0.0); g.len()];
    y.par_chunks_mut(BLOCK).zip(g.par_chunks(BLOCK).zip(u.par_chunks(BLOCK))).for_each(|(y, (g, u))| {
        for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
            *y = T::of(silu::<T>(g.f32()).1 * u.f32());
        }
    });
    y
}

/// `[dg; du]` (2n elements).
fn cpu_bwd<T: Elem>(g: &[T], u: &[T], dy: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = vec![T::of(0.0); 2 * n];
    let (dg, du) = out.split_at_mut(n);
    let ins = g.par_chunks(BLOCK).zip(u.par_chunks(BLOCK)).zip(dy.par_chunks(BLOCK));
    dg.par_chunks_mut(BLOCK).zip(du.par_chunks_mut(BLOCK)).zip(ins).for_each(|((dg, du), ((g, u), dy))| {
        for i in 0..g.len() {
            let (x, d) = (g[i].f32(), dy[i].f32());
            let (sig, s) = silu::<T>(x);
            let ds = T::of(d * u[i].f32()).f32();
            dg[i] = T::of(ds * (sig * (1.0 + x * (1.0 - sig))));
            du[i] = T::of(d * s);
        }
    });
    out
}

fn same_shape(what: &str, layouts: &[&Layout]) -> Result<usize> {
    let first = layouts[0].shape();
    if layouts.iter().any(|l| l.shape() != first) {
        let shapes: Vec<_> = layouts.iter().map(|l| l.shape().dims().to_vec()).collect();
        candle_core::bail!("{what}: the inputs' shapes differ: {shapes:?}");
    }
    let n = first.elem_count();
    if n > u32::MAX as usize {
        candle_core::bail!("{what}: {n} elements, at most 2^32 - 1");
    }
    Ok(n)
}

struct Swiglu;

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        same_shape("swiglu", &[l1, l2])?;
        let out = with_float!((s1, l1, "gate"), (s2, l2, "up") => |g, u| IntoStorage::storage(cpu_fwd(g, u)));
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
        let n = same_shape("swiglu", &[l1, l2])?;
        let y = super::cuda::run(&swiglu_plan(s1.dtype(), n, false)?, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = grad.to_dtype(g.dtype())?.contiguous()?;
        let both = g.apply_op3_no_bwd(u, &dy, &SwigluBwd)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

struct SwigluBwd;

impl CustomOp3 for SwigluBwd {
    fn name(&self) -> &'static str {
        "swiglu-bwd"
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
        same_shape("swiglu backward", &[l1, l2, l3])?;
        let out = with_float!((s1, l1, "gate"), (s2, l2, "up"), (s3, l3, "grad") => |g, u, d| {
            IntoStorage::storage(cpu_bwd(g, u, d))
        });
        Ok((out, both_shape(l1)))
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
        let n = same_shape("swiglu backward", &[l1, l2, l3])?;
        let plan = swiglu_plan(s1.dtype(), n, true)?;
        let out = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3)])?.remove(0);
        Ok((out, both_shape(l1)))
    }
}

/// `[2, ...]`: the gradients of gate and up stacked.
fn both_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.shape().dims());
    Shape::from(dims)
}

/// `silu(gate) * up` (same shape and dtype), with a backward to both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, Swiglu)
}

/// The same from candle's composite ops: the reference [`swiglu`] is tested against, and the decoder's
/// path with `fused_ops = false`.
pub fn swiglu_reference(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}

/// The launch of `swiglu_fwd` (`backward`: `swiglu_bwd`) over `n` elements of `dtype` ([`packed_grid`]).
#[cfg(any(test, feature = "cuda"))]
pub(super) fn swiglu_plan(dtype: DType, n: usize, backward: bool) -> Result<Plan> {
    let mut p = Plan::default();
    let mut args = vec![p.input("gate", dtype, n), p.input("up", dtype, n)];
    if backward {
        args.push(p.input("grad", dtype, n));
        args.push(p.output("gate and up gradients", dtype, 2 * n));
    } else {
        args.push(p.output("y", dtype, n));
    }
    args.push(Arg::U32(n as u32));
    let blocks = packed_grid(n, dtype);
    let base = if backward { "swiglu_bwd" } else { "swiglu_fwd" };
    let (grid, block) = ((blocks, 1, 1), (256, 1, 1));
    p.launch(Launch { module: Module::Swiglu, kernel: kernel_name(base, dtype)?, grid, block, shared_bytes: 0, args })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_rel_diff as max_diff, seeded};
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Forward and both gradients against candle's composite ops, in f32 (to rounding) and in bf16 (to
    /// the dtype's rounding: the composite rounds at every op).
    #[test]
    fn matches_the_composite_forward_and_backward() {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 0.02)] {
            let n = 7 * 3000;
            let g = Var::from_tensor(&seeded(&[n / 7, 7], 6.0, 1).to_dtype(dtype).unwrap()).unwrap();
            let u = Var::from_tensor(&seeded(&[n / 7, 7], 2.0, 2).to_dtype(dtype).unwrap()).unwrap();
            let up = seeded(&[n / 7, 7], 1.0, 3).to_dtype(dtype).unwrap();
            let fused = swiglu(g.as_tensor(), u.as_tensor()).unwrap();
            let reference = swiglu_reference(g.as_tensor(), u.as_tensor()).unwrap();
            assert!(max_diff(&fused, &reference) < tol, "{dtype:?} forward {}", max_diff(&fused, &reference));
            let g1 = (fused * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&g, &u] {
                let d = max_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
                assert!(d < tol, "{dtype:?}: gradient differs by {d}");
            }
        }
    }

    #[test]
    fn finite_differences_agree() {
        let g = Var::from_tensor(&seeded(&[14 / 7, 7], 3.0, 4)).unwrap();
        let u = Var::from_tensor(&seeded(&[14 / 7, 7], 2.0, 5)).unwrap();
        let up = seeded(&[14 / 7, 7], 1.0, 6);
        let f = |g: &Tensor, u: &Tensor| -> f64 {
            (swiglu(g, u).unwrap() * &up).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
        };
        let grads =
            (swiglu(g.as_tensor(), u.as_tensor()).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (which, var) in [(0, &g), (1, &u)] {
            let analytic: Vec<f32> = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let x0: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            for idx in [0usize, 5, 13] {
                let at = |d: f32| {
                    let mut v = x0.clone();
                    v[idx] += d;
                    let t = Tensor::from_vec(v, (2, 7), &Device::Cpu).unwrap();
                    if which == 0 {
                        f(&t, u.as_tensor())
                    } else {
                        f(g.as_tensor(), &t)
                    }
                };
                let fd = (at(1e-3) - at(-1e-3)) / 2e-3;
                assert!((fd - analytic[idx] as f64).abs() < 2e-3, "input {which}[{idx}]: fd {fd} vs {}", analytic[idx]);
            }
        }
    }

    #[test]
    fn inputs_of_different_shapes_are_an_error() {
        let e = swiglu(&seeded(&[14 / 7, 7], 1.0, 1), &seeded(&[21 / 7, 7], 1.0, 2)).unwrap_err().to_string();
        assert!(e.contains("shapes differ"), "{e}");
    }

    /// kernels/swiglu.cu on the emulator against the CPU op, forward and backward, f32/bf16/f16: 16-byte
    /// packs with a scalar tail (35 elements), more packs than the grid's threads (the stride loop), and
    /// every buffer one element off 16-byte alignment (the scalar path).
    #[test]
    fn the_kernels_equal_the_cpu_op() {
        for (n, misaligned) in [(7 * 5, false), (7 * 160_000, false), (7 * 301, true)] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let (g, u, dy) =
                    (seeded(&[n / 7, 7], 6.0, 7), seeded(&[n / 7, 7], 2.0, 8), seeded(&[n / 7, 7], 1.0, 9));
                let [g, u, dy] = [g, u, dy].map(|t| t.to_dtype(dtype).unwrap());
                // expf on the host and on a GPU may differ in the last bit of f32; after rounding to the
                // dtype, at most one unit of it.
                let tol = if dtype == DType::F32 { 1e-6 } else { 0.01 };
                let y = emulate(&swiglu_plan(dtype, n, false).unwrap(), &[&g, &u], misaligned);
                let want = swiglu(&g, &u).unwrap().flatten_all().unwrap();
                assert!(max_diff(&y, &want) < tol, "forward {n} {dtype:?} misaligned {misaligned}");
                let both = emulate(&swiglu_plan(dtype, n, true).unwrap(), &[&g, &u, &dy], misaligned);
                let want = g.apply_op3_no_bwd(&u, &dy, &SwigluBwd).unwrap().flatten_all().unwrap();
                assert!(max_diff(&both, &want) < tol, "backward {n} {dtype:?} misaligned {misaligned}");
            }
        }
    }

    /// `plan` (over `n` elements) on the emulator; `misaligned`: no pointer 16-byte aligned
    /// ([`emu::run_shifted`](super::super::emu::run_shifted)). The output's `n` elements (or `[dg; du]`, 2n).
    fn emulate(plan: &Plan, inputs: &[&Tensor], misaligned: bool) -> Tensor {
        let flat: Vec<Tensor> = inputs.iter().map(|t| t.flatten_all().unwrap()).collect();
        let refs: Vec<&Tensor> = flat.iter().collect();
        let run = if misaligned { super::super::emu::run_shifted } else { super::super::emu::run };
        run(plan, &refs).unwrap().remove(0)
    }
}
