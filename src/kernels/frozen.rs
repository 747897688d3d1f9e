//! [`frozen_matmul`], `x W^T` with a frozen weight (LoRA's base projections without an adapter), recorded
//! in the graph with a backward of its own (`record_op1`), its forward computed without a graph: the
//! backward gives the gradient of `x` only, `g W`. candle 0.11's own matmul backward computes the gradient
//! of both operands whether or not the weight is a variable, and keeps it until the whole backward ends:
//! for a frozen 7B model, a weight-sized tensor per projection and a third of the backward's FLOPs spent on
//! gradients nobody reads. (The patched candle-core, third_party/candle-core/PATCHED.md, skips an operand
//! that leads to no variable too; this op does not depend on it.)

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// The op in the graph: recorded with its values (`record_op1`), its backward `g W`.
struct FrozenMatmul {
    /// The frozen weight `[out, in]`.
    weight: Tensor,
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        super::cpu::recorded(self.name())
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.to_dtype(self.weight.dtype())?.matmul(&self.weight)?))
    }
}

/// `x W^T` for `x` `[rows, in]` and a frozen `weight` `[out, in]`: differentiable in `x` only (the weight
/// never gets a gradient, whatever it is).
pub fn frozen_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let weight = weight.detach();
    let values = x.detach().matmul(&weight.t()?)?;
    if !x.track_op() {
        return Ok(values);
    }
    x.record_op1(&values, FrozenMatmul { weight })
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
}
