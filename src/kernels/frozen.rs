//! Two products recorded in the graph with a backward of their own (`record_op`), their forward never run
//! by the op:
//!
//! - [`frozen_matmul`], `x W^T` with a frozen weight (LoRA's base projections without an adapter),
//!   computed without a graph, whose backward gives the gradient of `x` only, `g W`. candle 0.11's own
//!   matmul backward computes the gradient of both operands whether or not the weight is a variable, and
//!   keeps it until the whole backward ends: for a frozen 7B model, a weight-sized tensor per projection
//!   and a third of the backward's FLOPs spent on gradients nobody reads. (The patched candle-core,
//!   third_party/candle-core/PATCHED.md, skips an operand that leads to no variable too; this op does not
//!   depend on it.)
//! - [`unread_matmul`], `x W^T` whose values nobody reads, only its backward: a recomputed layer's MLP
//!   down projection (`checkpoint_layers`), whose output the backward never needs. Recorded on zeros
//!   (one element, broadcast), it saves the recomputation a GEMM a layer, a third of the MLP's.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

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

/// The op of [`unread_matmul`]: the backward of `x.matmul(&w.t())` as candle's matmul and transpose give
/// it, operand by operand (the same products on the same layouts, so the same values bit for bit).
struct UnreadMatmul {
    /// The weight gets no gradient (a frozen projection).
    frozen: bool,
}

impl CustomOp2 for UnreadMatmul {
    fn name(&self) -> &'static str {
        "unread-matmul"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        super::cpu::recorded(self.name())
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // candle's Matmul(x, w^T) backward: g (w^T)^T for x, x^T g for w^T, transposed back for w.
        let grad = grad.contiguous()?;
        let wt = w.t()?;
        let dx = match x.track_op() {
            true => Some(grad.matmul(&wt.t()?)?),
            false => None,
        };
        let dw = match !self.frozen && w.track_op() {
            true => Some(x.t()?.matmul(&grad)?.t()?),
            false => None,
        };
        Ok((dx, dw))
    }
}

/// `x W^T` for `x` `[rows, in]` and `weight` `[out, in]` as a node of the graph whose values are never
/// read: zeros (one element broadcast to `[rows, out]`, no device memory written), with the backward of
/// the product (`frozen`: the input's gradient only). For a product whose output only its backward needs:
/// seed the backward at it ([`Tensor::backward_from`]) and the gradients of `x` and the weight are
/// those of `x.matmul(&weight.t())`, without the forward's GEMM.
pub fn unread_matmul(x: &Tensor, weight: &Tensor, frozen: bool) -> Result<Tensor> {
    let (rows, out) = (x.dim(0)?, weight.dim(0)?);
    if x.rank() != 2 || weight.rank() != 2 || x.dim(1)? != weight.dim(1)? {
        candle_core::bail!("unread-matmul of {:?} by {:?}^T", x.dims(), weight.dims());
    }
    let zeros = Tensor::zeros((), x.dtype(), x.device())?.broadcast_as((rows, out))?;
    x.record_op2(weight, &zeros, UnreadMatmul { frozen })
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

    /// The backward seeded at the unread product gives the gradients candle's own product gives, bit for
    /// bit, trainable and frozen, in f32 and bf16.
    #[test]
    fn the_unread_product_has_the_gradients_of_the_product() {
        let dev = Device::Cpu;
        for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
            let values = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
            let x =
                Var::from_tensor(&Tensor::from_vec(values(15, 0.37), (5, 3), &dev).unwrap().to_dtype(dtype).unwrap())
                    .unwrap();
            let w =
                Var::from_tensor(&Tensor::from_vec(values(12, 0.71), (4, 3), &dev).unwrap().to_dtype(dtype).unwrap())
                    .unwrap();
            let g = Tensor::from_vec(values(20, 1.3), (5, 4), &dev).unwrap().to_dtype(dtype).unwrap();
            let want = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap().backward_from(&g).unwrap();
            let bits = |t: &Tensor| {
                t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            for frozen in [false, true] {
                let y = unread_matmul(x.as_tensor(), w.as_tensor(), frozen).unwrap();
                assert_eq!(y.dims(), [5, 4]);
                let store = y.backward_from(&g).unwrap();
                assert_eq!(bits(store.get(x.as_tensor()).unwrap()), bits(want.get(x.as_tensor()).unwrap()));
                match frozen {
                    true => assert!(store.get(w.as_tensor()).is_none()),
                    false => {
                        assert_eq!(bits(store.get(w.as_tensor()).unwrap()), bits(want.get(w.as_tensor()).unwrap()))
                    }
                }
            }
        }
    }
}
