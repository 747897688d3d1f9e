//! `grpo bench gemm`: one layer's projection GEMMs at a model shape (forward, input and weight
//! gradients), each timed, beside the rate the performance model assumes for them.

use std::path::PathBuf;

use serde_json::{json, Value};

use super::harness::{dtype_name, load_shape, randn, shape_name, time_median, Result, Timing};
use crate::device::device_name;

/// The projections' GEMMs of one layer of a model shape (`grpo bench gemm`).
#[derive(Debug, Clone, clap::Args)]
pub struct GemmSpec {
    /// HF config.json of the model shape (e.g. configs/models/qwen2.5-7b-instruct.config.json).
    #[arg(long)]
    pub shape: PathBuf,
    /// Tokens of a micro-batch: the products' rows.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
}

/// Each projection's forward (`x W^T`), input gradient (`g W`) and weight gradient (`g^T x`) of one layer
/// of `--shape` over `--tokens` rows, as the decoder runs them, timed one by one: their TFLOP/s each and
/// in all (what the performance model's single GEMM efficiency stands for), beside the model's rate.
pub fn gemm(spec: &GemmSpec, t: &Timing) -> Result<Value> {
    let cfg = load_shape(&spec.shape)?;
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let n = spec.tokens;
    // Each GEMM's name, [m, k] x [k, n] and median seconds.
    let mut gemms: Vec<(String, (usize, usize, usize), f64)> = Vec::new();
    for (name, fan_in, fan_out) in
        [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, i), ("up", h, i), ("down", i, h)]
    {
        let (x, w, g) =
            (randn(t, (n, fan_in), 0.02)?, randn(t, (fan_out, fan_in), 0.02)?, randn(t, (n, fan_out), 0.02)?);
        let cases = [
            ("forward", (n, fan_in, fan_out), (x.clone(), w.t()?)),
            ("input gradient", (n, fan_out, fan_in), (g.clone(), w.clone())),
            ("weight gradient", (fan_out, n, fan_in), (g.t()?, x.clone())),
        ];
        for (what, mkn, (lhs, rhs)) in cases {
            gemms.push((format!("{name} {what}"), mkn, time_median(t, || Ok(lhs.matmul(&rhs)?))?));
        }
    }
    let flops = |(m, k, n): (usize, usize, usize)| 2.0 * (m * k * n) as f64;
    let seconds = gemms.iter().map(|g| g.2).sum::<f64>();
    let total_flops = gemms.iter().map(|g| flops(g.1)).sum::<f64>();
    // The model's time for each GEMM, at the rate of its product's shape.
    let assumed = crate::cost::time::gpus().iter().map(|gpu| {
        let rate = |(m, _, n): (usize, usize, usize)| crate::cost::time::gemm_flops_per_s(m as f64, n as f64, gpu);
        let model_s = gemms.iter().map(|g| flops(g.1) / rate(g.1)).sum::<f64>();
        json!({"gpu": gpu.name, "tflops": total_flops / model_s / 1e12})
    });
    let assumed: Vec<Value> = assumed.collect();
    let gemms = gemms.iter().map(|(name, (m, k, n), seconds)| {
        json!({"name": name, "m": m, "k": k, "n": n, "seconds": seconds, "tflops": flops((*m, *k, *n)) / seconds / 1e12})
    });
    Ok(json!({
        "bench": "gemm",
        "device": device_name(&t.device),
        "dtype": dtype_name(t.dtype),
        "shape": shape_name(&spec.shape),
        "tokens": n,
        "gemms": gemms.collect::<Vec<_>>(),
        "seconds": seconds,
        "tflops": total_flops / seconds / 1e12,
        "assumed": assumed,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::{cpu, tiny_shape};

    #[test]
    fn every_projection_has_its_three_products() {
        let dir = tempfile::tempdir().unwrap();
        let r = gemm(&GemmSpec { shape: tiny_shape(dir.path()), tokens: 8 }, &cpu()).unwrap();
        let gemms = r["gemms"].as_array().unwrap();
        assert_eq!(gemms.len(), 7 * 3);
        // q's weight gradient: [q out, tokens] x [tokens, hidden].
        let q_wgrad = &gemms[2];
        assert_eq!(q_wgrad["name"], "q weight gradient");
        assert_eq!(
            (q_wgrad["m"].as_u64(), q_wgrad["k"].as_u64(), q_wgrad["n"].as_u64()),
            (Some(16), Some(8), Some(16))
        );
        let sum: f64 = gemms.iter().map(|g| g["seconds"].as_f64().unwrap()).sum();
        assert!((r["seconds"].as_f64().unwrap() - sum).abs() < 1e-12, "{r}");
        assert_eq!(r["assumed"].as_array().unwrap().len(), crate::cost::time::gpus().len());
    }
}
