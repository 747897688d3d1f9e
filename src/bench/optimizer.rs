//! `grpo bench optimizer`: the offloaded optimiser's host update, fused against the composite ops (on
//! the CPU) or the serial pageable copies (on a GPU) it replaced.

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::harness::{dtype_name, is_gpu, median, time_runs, Result, Timing};
use crate::device::device_name;
use crate::kernels::AdamW;
use crate::model::Grads;
use crate::train::optim::{OptimConfig, Optimizer};

/// The shape of [`optimizer`]'s benchmark: the state in host memory, as `optim.offload` keeps it, and the
/// parameters and their gradients on the bench's device.
#[derive(Debug, Clone, clap::Args)]
pub struct OptimizerSpec {
    /// Parameters in all.
    #[arg(long, default_value_t = 64_000_000)]
    pub params: usize,
    /// Tensors they are split into (a 7B model has ~340, a 0.5B one ~290).
    #[arg(long, default_value_t = 64)]
    pub tensors: usize,
}

/// Random `[1, n]` weights (of `dtype`) and `[n]` f32 gradients on `device` for tensors of `sizes`.
fn optimizer_problem(sizes: &[usize], dtype: DType, device: &Device) -> Result<(Vec<Var>, Grads)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let (mut vars, mut grads) = (Vec::new(), Vec::new());
    for &n in sizes {
        vars.push(Var::from_tensor(&Tensor::from_vec(random(n), (1, n), device)?.to_dtype(dtype)?)?);
        grads.push(Some(Tensor::from_vec(random(n), n, device)?));
    }
    Ok((vars, Grads { grads }))
}

/// The offloaded optimiser's update (AdamW, f32 state in host memory) of `spec.params` parameters in
/// `spec.tensors` tensors against a reference from the same state in the same run: the composite ops on
/// the CPU, pageable copies one tensor at a time from a GPU. Rates are in the model's units (32 B a
/// parameter, [`crate::cost::Gpu::host_update_bandwidth`]).
pub fn optimizer(spec: &OptimizerSpec, t: &Timing) -> Result<Value> {
    let tensors = spec.tensors.clamp(1, spec.params.max(1));
    let sizes: Vec<usize> =
        (0..tensors).map(|i| spec.params / tensors + usize::from(i < spec.params % tensors)).collect();
    let (vars, grads) = optimizer_problem(&sizes, t.dtype, &t.device)?;
    let names: Vec<String> = (0..tensors).map(|i| format!("w{i}")).collect();
    let cfg = OptimConfig { offload: true, weight_decay: 0.01, ..OptimConfig::default() };
    // The reference's state, from the same initial weights (copied: the fused run updates them).
    let mut state: Vec<Tensor> = vars
        .iter()
        .map(|v| v.as_tensor().to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.copy())
        .collect::<candle_core::Result<_>>()?;
    let mut opt = Optimizer::new(cfg.clone(), &names, &vars.iter().collect::<Vec<_>>())?;
    let (fused, _) = time_runs(t, || Ok(opt.step(&grads, cfg.lr, 1.0)?))?;
    let (reference, reference_runs) = match t.device.is_cpu() {
        true => ("composite candle ops", composite_update(t, &cfg, &mut state, &grads)?),
        false => ("pageable copies, one tensor at a time", serial_offload(t, &cfg, &mut state, &grads, &vars)?),
    };
    let bits = |t: &Tensor| t.to_vec1::<f32>().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).ok();
    let masters = opt.state_tensors()?.into_iter().filter(|(n, _)| n.starts_with("master."));
    let masters = masters.map(|(_, t)| t.flatten_all()).collect::<candle_core::Result<Vec<_>>>()?;
    let same_bits = masters.iter().zip(&state).all(|(a, b)| bits(a) == bits(b));
    let (fused_s, reference_s) = (median(&fused), median(&reference_runs));
    let gb = |s: f64| 32.0 * spec.params as f64 / s / 1e9;
    let device = device_name(&t.device);
    // The model's time for this offloaded update (src/cost/time.rs) on each GPU, beside the measured one.
    let predicted = (crate::cost::time::gpus().iter()).map(|gpu| {
        let seconds = crate::cost::time::offload_update_s(spec.params as f64, t.dtype.size_in_bytes() as f64, gpu);
        let measured_over_predicted = is_gpu(&device, gpu.name).then(|| fused_s / seconds);
        json!({"gpu": gpu.name, "seconds": seconds, "measured_over_predicted": measured_over_predicted})
    });
    Ok(json!({
        "bench": "optimizer",
        "device": device,
        "dtype": dtype_name(t.dtype),
        "params": spec.params,
        "tensors": tensors,
        "threads": rayon::current_num_threads(),
        "fused_s": fused_s,
        "fused_gb_per_s": gb(fused_s),
        "reference": reference,
        "reference_s": reference_s,
        "reference_gb_per_s": gb(reference_s),
        "speedup": reference_s / fused_s,
        // Bytes over PCIe per update on a GPU (f32 gradients down, weights up).
        "pcie_bytes": if t.device.is_cpu() { 0 } else { spec.params * (4 + t.dtype.size_in_bytes()) },
        "predicted": predicted.collect::<Vec<_>>(),
        "same_bits": same_bits, // the master weights after the timed runs
    }))
}

/// The update of `grads` into the master weights `state` by candle's composite ops (the moments kept
/// beside them), the tensors in parallel, their new weights in the model's dtype: the host update before
/// the fused op. Returns the timed runs.
fn composite_update(t: &Timing, cfg: &OptimConfig, state: &mut [Tensor], grads: &Grads) -> Result<Vec<f64>> {
    use rayon::prelude::*;
    let mut moments: Vec<Option<(Tensor, Tensor)>> = vec![None; state.len()];
    let mut step = 0;
    let (runs, _) = time_runs(t, || {
        step += 1;
        let op = adam_op(cfg, step);
        let out = (state.par_iter().zip(&moments).zip(&grads.grads))
            .map(|((master, moments), g)| {
                let g = g.as_ref().expect("every tensor has a gradient");
                let moments = moments.as_ref().map(|(m, v)| (m, v));
                let (master, moments) = crate::kernels::adamw_reference(master, moments, g, &op)?;
                master.to_dtype(t.dtype)?;
                Ok((master, moments))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (k, (master, m)) in out.into_iter().enumerate() {
            (state[k], moments[k]) = (master, m);
        }
        Ok(())
    })?;
    Ok(runs)
}

/// The offloaded update as it ran before the staging: per tensor, the gradient copied to the host
/// (pageable memory, waited for), the fused update on the host, the new weights copied to the device
/// and set into a copy of the parameter. Returns the timed runs; `state` ends as the master weights.
fn serial_offload(
    t: &Timing,
    cfg: &OptimConfig,
    state: &mut [Tensor],
    grads: &Grads,
    vars: &[Var],
) -> Result<Vec<f64>> {
    let rows: Vec<Tensor> = state
        .iter()
        .map(|m| Tensor::cat(&[m.unsqueeze(0)?, m.zeros_like()?.unsqueeze(0)?, m.zeros_like()?.unsqueeze(0)?], 0))
        .collect::<candle_core::Result<_>>()?;
    let copies: Vec<Var> =
        vars.iter().map(|v| Var::from_tensor(&v.as_tensor().copy()?)).collect::<candle_core::Result<_>>()?;
    let mut step = 0;
    let (runs, _) = time_runs(t, || {
        step += 1;
        let op = adam_op(cfg, step);
        for ((s, g), var) in rows.iter().zip(&grads.grads).zip(&copies) {
            let g = g.as_ref().expect("every tensor has a gradient").to_device(&Device::Cpu)?;
            crate::kernels::adamw(s, &g, &op)?;
            let w = s.get(0)?.to_dtype(t.dtype)?.reshape(var.shape())?.to_device(var.device())?;
            var.set(&w)?;
        }
        Ok(())
    })?;
    for (k, s) in rows.iter().enumerate() {
        state[k] = s.get(0)?;
    }
    Ok(runs)
}

/// The AdamW op of the bench's update number `step`.
fn adam_op(cfg: &OptimConfig, step: i32) -> AdamW {
    let (lr, weight_decay, betas, eps) = (cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps);
    AdamW { adam: true, scale: 1.0, lr, weight_decay, betas, eps, t: step }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::cpu;

    #[test]
    fn the_fused_update_matches_the_composite_one_bit_for_bit() {
        let r = optimizer(&OptimizerSpec { params: 1000, tensors: 3 }, &cpu()).unwrap();
        assert_eq!((r["tensors"].as_u64(), r["pcie_bytes"].as_u64()), (Some(3), Some(0)));
        assert_eq!(r["reference"], "composite candle ops");
        assert_eq!(r["same_bits"], true, "{r}");
        assert!(r["speedup"].as_f64().unwrap() > 0.0, "{r}");
        // More tensors than parameters: one parameter each.
        let r = optimizer(&OptimizerSpec { params: 2, tensors: 5 }, &cpu()).unwrap();
        assert_eq!(r["tensors"], 2);
    }
}
