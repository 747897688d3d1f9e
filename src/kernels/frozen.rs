//! `x W^T` with the weight outside candle's graph, recorded with a backward of its own (`record_op1`), its
//! forward computed without a graph: the backward gives the gradient of `x`, `g W`, and the weight's
//! gradient either not at all ([`frozen_matmul`]: LoRA's base projections without an adapter) or added
//! straight into the weight's f32 accumulator ([`matmul_accumulating`]: `acc += g^T x`, one GEMM with an
//! f32 output, [`super::wgrad_accumulate`]). candle 0.11's own matmul backward computes the gradient of
//! both operands whether or not the weight is a variable, in the weight's dtype, and keeps it until the
//! whole backward ends: for a frozen 7B model, a weight-sized tensor per projection and a third of the
//! backward's FLOPs spent on gradients nobody reads; for a trained one, a rounding to bf16 and a pass of
//! its own to add it into the accumulator. (The patched candle-core, third_party/candle-core/PATCHED.md,
//! skips an operand that leads to no variable too; this op does not depend on it.)

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// The op in the graph: recorded with its values (`record_op1`), its backward `g W` (and `acc += g^T x`).
struct OutsideMatmul {
    /// The weight `[out, in]`, detached.
    weight: Tensor,
    /// The weight's f32 accumulator `[out, in]`; `None`: a frozen weight.
    accumulator: Option<Tensor>,
}

impl CustomOp1 for OutsideMatmul {
    fn name(&self) -> &'static str {
        "outside-matmul"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        super::cpu::recorded(self.name())
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.to_dtype(self.weight.dtype())?;
        if let Some(acc) = &self.accumulator {
            super::wgrad_accumulate(acc, &grad, &x.to_dtype(self.weight.dtype())?)?;
        }
        Ok(Some(grad.matmul(&self.weight)?))
    }
}

fn outside_matmul(x: &Tensor, weight: &Tensor, accumulator: Option<&Tensor>) -> Result<Tensor> {
    let weight = weight.detach();
    let values = x.detach().matmul(&weight.t()?)?;
    if !x.track_op() {
        return Ok(values);
    }
    x.record_op1(&values, OutsideMatmul { weight, accumulator: accumulator.cloned() })
}

/// `x W^T` for `x` `[rows, in]` and a frozen `weight` `[out, in]`: differentiable in `x` only (the weight
/// never gets a gradient, whatever it is).
pub fn frozen_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    outside_matmul(x, weight, None)
}

/// `x W^T` for `x` `[rows, in]` and `weight` `[out, in]` whose gradient the backward adds into `acc` (f32,
/// `[out, in]`, in place) instead of handing it to candle's gradient store; differentiable in `x`. Where
/// `x` leads to no variable nothing is recorded and the weight gets no gradient: callers use candle's
/// matmul there.
pub fn matmul_accumulating(x: &Tensor, weight: &Tensor, acc: &Tensor) -> Result<Tensor> {
    outside_matmul(x, weight, Some(acc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn the_input_gets_the_gradient_of_matmul_and_the_weight_none() {
        let dev = Device::Cpu;
        let x = Var::from_vec((0..12).map(|i| (i as f32 * 0.37).sin()).collect(), (4, 3), &dev).unwrap();
        let w = Tensor::from_vec((0..6).map(|i| (i as f32 * 0.71).cos()).collect(), (2, 3), &dev).unwrap();
        let g = Tensor::from_vec((0..8).map(|i| i as f32 - 3.5).collect(), (4, 2), &dev).unwrap();
        let y = frozen_matmul(x.as_tensor(), &w).unwrap();
        let wt = w.t().unwrap();
        let want = x.as_tensor().matmul(&wt).unwrap();
        assert_eq!(y.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
        let store = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let store_ref = (want * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (dx, dx_ref) = (store.get(x.as_tensor()).unwrap(), store_ref.get(x.as_tensor()).unwrap());
        assert_eq!(dx.to_vec2::<f32>().unwrap(), dx_ref.to_vec2::<f32>().unwrap());
        // Neither gives the frozen weight a gradient (the patched candle skips an operand that leads to no
        // variable).
        assert!(store.get(&w).is_none() && store_ref.get(&wt).is_none() && store_ref.get(&w).is_none());
    }

    /// The weight's gradient lands in the accumulator (added to what it held, at each backward) and not in
    /// the store; the input's is candle's.
    #[test]
    fn the_weight_gradient_is_added_into_the_accumulator() {
        use super::super::testing::{max_rel_diff, seeded};
        let x = Var::from_tensor(&seeded(&[5, 3], 1.0, 1)).unwrap();
        let w = Var::from_tensor(&seeded(&[4, 3], 1.0, 2)).unwrap();
        let g = seeded(&[5, 4], 1.0, 3);
        let start = seeded(&[4, 3], 1.0, 4);
        let acc = start.copy().unwrap();
        let want = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let store_ref = (&want * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = store_ref.get(w.as_tensor()).unwrap();
        for times in 1..=2 {
            let y = matmul_accumulating(x.as_tensor(), w.as_tensor(), &acc).unwrap();
            assert_eq!(y.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
            let store = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(store.get(w.as_tensor()).is_none());
            let dx = store.get(x.as_tensor()).unwrap();
            assert!(max_rel_diff(dx, store_ref.get(x.as_tensor()).unwrap()) < 1e-6);
            let expected = (&start + dw.affine(times as f64, 0.0).unwrap()).unwrap();
            assert!(max_rel_diff(&acc, &expected) < 1e-6, "after {times} backward(s)");
        }
        // An input that leads to no variable records nothing: no backward, the accumulator untouched.
        let before = acc.to_vec2::<f32>().unwrap();
        let y = matmul_accumulating(&x.as_tensor().detach(), w.as_tensor(), &acc).unwrap();
        assert!(!y.track_op());
        assert_eq!(acc.to_vec2::<f32>().unwrap(), before);
    }
}
