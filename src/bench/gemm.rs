//! `grpo bench gemm`: one layer's projection GEMMs at a model shape (forward, input and weight
//! gradients), each timed, beside the rate the performance model assumes for them.

use std::path::PathBuf;

use candle_core::Tensor;
use serde_json::Value;

use super::harness::{dtype_name, load_shape, median, shape_name, time_runs, to_record, Result, Timing};
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

/// One GEMM of `grpo bench gemm`: `[m, k] x [k, n]`, median seconds and TFLOP/s.
#[derive(Debug, serde::Serialize)]
struct GemmTiming {
    name: String,
    m: usize,
    k: usize,
    n: usize,
    seconds: f64,
    tflops: f64,
}

/// The rate the performance model assumes for the layer's projection GEMMs on a GPU (each at its peak times
/// [`crate::cost::time::Gpu::gemm_efficiency`] times its tiles' utilisation), over their sum.
#[derive(Debug, serde::Serialize)]
struct AssumedGemm {
    gpu: &'static str,
    tflops: f64,
}

/// What `grpo bench gemm` prints.
#[derive(Debug, serde::Serialize)]
struct GemmRecord {
    bench: &'static str,
    device: String,
    dtype: &'static str,
    shape: String,
    tokens: usize,
    /// Each projection's forward (`x W^T`), input gradient (`g W`) and weight gradient (`g^T x`), as the
    /// decoder runs them (candle's matmul on the transposed weight, cuBLAS on a GPU).
    gemms: Vec<GemmTiming>,
    /// Their sum, and all their FLOPs over it: the layer's GEMM rate the performance model's single GEMM
    /// efficiency stands for.
    seconds: f64,
    tflops: f64,
    assumed: Vec<AssumedGemm>,
}

/// Each projection's three GEMMs of one layer of `--shape` over `--tokens` rows, timed one by one on the
/// device in the bench's dtype: what the performance model's GEMM efficiency (measured at 2048^3) should be
/// at the shapes a step runs.
pub fn gemm(spec: &GemmSpec, t: &Timing) -> Result<Value> {
    let cfg = load_shape(&spec.shape)?;
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let n = spec.tokens;
    let rand = |shape: (usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 0.02, shape, &t.device)?.to_dtype(t.dtype)?)
    };
    let mut gemms = Vec::new();
    for (name, fan_in, fan_out) in
        [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, i), ("up", h, i), ("down", i, h)]
    {
        let (x, w, g) = (rand((n, fan_in))?, rand((fan_out, fan_in))?, rand((n, fan_out))?);
        // (lhs, rhs) of each product: x W^T, g W, g^T x.
        let cases = [
            ("forward", (n, fan_in, fan_out), (x.clone(), w.t()?)),
            ("input gradient", (n, fan_out, fan_in), (g.clone(), w.clone())),
            ("weight gradient", (fan_out, n, fan_in), (g.t()?, x.clone())),
        ];
        for (what, (m, k, cols), (lhs, rhs)) in cases {
            let (times, _) = time_runs(t, || Ok(lhs.matmul(&rhs)?))?;
            let seconds = median(&times);
            let tflops = 2.0 * (m * k * cols) as f64 / seconds / 1e12;
            gemms.push(GemmTiming { name: format!("{name} {what}"), m, k, n: cols, seconds, tflops });
        }
    }
    let seconds = gemms.iter().map(|g| g.seconds).sum::<f64>();
    let flops = gemms.iter().map(|g| 2.0 * (g.m * g.k * g.n) as f64).sum::<f64>();
    // The model's time for each GEMM, at the rate of its product's shape.
    let assumed = crate::cost::time::gpus()
        .iter()
        .map(|gpu| {
            let rate = |g: &GemmTiming| crate::cost::time::gemm_flops_per_s(g.m as f64, g.n as f64, gpu);
            let model_s = gemms.iter().map(|g| 2.0 * (g.m * g.k * g.n) as f64 / rate(g)).sum::<f64>();
            AssumedGemm { gpu: gpu.name, tflops: flops / model_s / 1e12 }
        })
        .collect();
    let record = GemmRecord {
        bench: "gemm",
        device: device_name(&t.device),
        dtype: dtype_name(t.dtype),
        shape: shape_name(&spec.shape),
        tokens: n,
        gemms,
        seconds,
        tflops: flops / seconds / 1e12,
        assumed,
    };
    to_record(record)
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
