//! What every benchmark shares: its error, where and how long to measure ([`Timing`]) and the timed
//! runs, the random model and inputs, and the JSON record it prints.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rand::Rng;
use serde_json::Value;

use crate::model::load::random_parameter;
use crate::model::{Decoder, ModelConfig};

/// Errors of a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Candle(#[from] candle_core::Error),
    #[error("{0}")]
    Model(#[from] crate::model::ModelError),
    #[error("model shape {path}: {source}")]
    Shape { path: PathBuf, source: crate::model::config::ConfigError },
    #[error("{0}")]
    Invalid(String),
}

pub(super) type Result<T> = std::result::Result<T, BenchError>;

/// Where and how long to measure.
#[derive(Debug, Clone)]
pub struct Timing {
    pub device: Device,
    pub dtype: DType,
    pub warmup: usize,
    pub repeats: usize,
}

pub(super) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        _ => "other",
    }
}

pub(super) fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Run `f` `warmup + repeats` times with the device synchronised around each; the timed durations.
pub(super) fn time_runs<T>(t: &Timing, mut f: impl FnMut() -> Result<T>) -> Result<(Vec<f64>, Vec<T>)> {
    let (mut times, mut outs) = (Vec::new(), Vec::new());
    for i in 0..t.warmup + t.repeats.max(1) {
        t.device.synchronize()?;
        let t0 = Instant::now();
        let out = f()?;
        t.device.synchronize()?;
        let dt = t0.elapsed().as_secs_f64();
        let kind = if i < t.warmup { "warm-up" } else { "timed" };
        tracing::info!("run {}/{} ({kind}): {dt:.3} s", i + 1, t.warmup + t.repeats.max(1));
        if i >= t.warmup {
            times.push(dt);
            outs.push(out);
        }
    }
    Ok((times, outs))
}

pub(super) fn shape_name(path: &std::path::Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

pub(super) fn load_shape(path: &std::path::Path) -> Result<ModelConfig> {
    ModelConfig::from_file(path).map_err(|source| BenchError::Shape { path: path.to_path_buf(), source })
}

/// A model of `cfg` with random weights drawn on the device itself (fast at billions of parameters; the
/// values do not matter for timing): normal(0, 0.02) matrices, unit norms, zero biases.
pub(super) fn random_model(cfg: ModelConfig, t: &Timing, trainable: bool) -> Result<Decoder> {
    let dev = &t.device;
    let get =
        |name: &str, shape: &[usize]| random_parameter(name, shape, dev, || Ok(Tensor::randn(0f32, 0.02, shape, dev)?));
    Ok(Decoder::from_tensors(cfg, get, t.dtype, &t.device, trainable)?)
}

pub(super) fn random_ids(rng: &mut impl Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// A bench's record as the JSON line it prints.
pub(super) fn to_record(record: impl serde::Serialize) -> Result<Value> {
    serde_json::to_value(record).map_err(|e| BenchError::Invalid(e.to_string()))
}

/// What the benchmarks' tests share: a tiny model shape and a short CPU timing.
#[cfg(test)]
pub(super) mod fixtures {
    use super::*;
    use serde_json::json;

    pub(crate) fn tiny_shape(dir: &std::path::Path) -> PathBuf {
        let raw = json!({"model_type": "qwen2", "vocab_size": 97, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true});
        let p = dir.join("tiny.json");
        std::fs::write(&p, raw.to_string()).unwrap();
        p
    }

    pub(crate) fn cpu() -> Timing {
        Timing { device: Device::Cpu, dtype: DType::F32, warmup: 1, repeats: 2 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_odd_even_and_no_runs() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn warm_up_runs_are_not_timed() {
        let mut calls = 0;
        let (times, outs) = time_runs(&fixtures::cpu(), || {
            calls += 1;
            Ok(calls)
        })
        .unwrap();
        assert_eq!((times.len(), outs, calls), (2, vec![2, 3], 3));
    }
}
