//! What every benchmark shares: its error, where and how long to measure ([`Timing`]) and the timed
//! runs, the random model and inputs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};
use rand::Rng;

use crate::model::load::{random_parameter, sample_normal};
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
    let runs = t.warmup + t.repeats.max(1);
    for i in 0..runs {
        t.device.synchronize()?;
        let t0 = Instant::now();
        let out = f()?;
        t.device.synchronize()?;
        let dt = t0.elapsed().as_secs_f64();
        let kind = if i < t.warmup { "warm-up" } else { "timed" };
        tracing::info!("run {}/{runs} ({kind}): {dt:.3} s", i + 1);
        if i >= t.warmup {
            times.push(dt);
            outs.push(out);
        }
    }
    Ok((times, outs))
}

/// The median time of [`time_runs`].
pub(super) fn time_median<T>(t: &Timing, f: impl FnMut() -> Result<T>) -> Result<f64> {
    Ok(median(&time_runs(t, f)?.0))
}

pub(super) fn shape_name(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

pub(super) fn load_shape(path: &Path) -> Result<ModelConfig> {
    ModelConfig::from_file(path).map_err(|source| BenchError::Shape { path: path.to_path_buf(), source })
}

/// Whether the device named `device` is the modelled GPU `gpu` (by the first word of its name).
pub(super) fn is_gpu(device: &str, gpu: &str) -> bool {
    device.contains(gpu.split(' ').next().unwrap_or(gpu))
}

/// A model of `cfg` with random weights drawn on the device (the values do not matter for timing):
/// normal(0, 0.02) matrices, unit norms, zero biases.
pub(super) fn random_model(cfg: ModelConfig, t: &Timing, trainable: bool) -> Result<Decoder> {
    let dev = &t.device;
    let get =
        |name: &str, shape: &[usize]| random_parameter(name, shape, dev, || Ok(Tensor::randn(0f32, 0.02, shape, dev)?));
    Ok(Decoder::from_tensors(cfg, get, t.dtype, &t.device, trainable)?)
}

/// Normal(0, `std`) values of `shape` on the bench's device, in its dtype.
pub(super) fn randn(t: &Timing, shape: impl Into<Shape>, std: f32) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, std, shape, &t.device)?.to_dtype(t.dtype)?)
}

pub(super) fn random_ids(rng: &mut impl Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// One problem of a long-tailed mix: its prompt tokens (log-normal around `prompt_median`, sigma 0.6, at
/// least 1) and `answers` lengths (at least 1), log-normal with sigma `answer_sigma` around the problem's
/// median, itself log-normal with sigma `problem_sigma` around `median`.
pub(super) fn long_tailed(
    rng: &mut impl Rng,
    prompt_median: f64,
    (median, problem_sigma, answer_sigma): (f64, f64, f64),
    answers: usize,
) -> (usize, Vec<usize>) {
    let prompt = (prompt_median * (0.6 * sample_normal(rng) as f64).exp()).round().max(1.0);
    let centre = median.ln() + problem_sigma * sample_normal(rng) as f64;
    let lengths =
        (0..answers).map(|_| (centre + answer_sigma * sample_normal(rng) as f64).exp().round().max(1.0) as usize);
    (prompt as usize, lengths.collect())
}

/// What the benchmarks' tests share: a tiny model shape, a short CPU timing, a spec from its options.
#[cfg(test)]
pub(super) mod fixtures {
    use super::*;
    use serde_json::json;

    pub(crate) fn tiny_shape(dir: &Path) -> PathBuf {
        let raw = json!({"model_type": "qwen2", "vocab_size": 97, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true});
        let p = dir.join("tiny.json");
        std::fs::write(&p, raw.to_string()).unwrap();
        p
    }

    pub(crate) fn cpu() -> Timing {
        Timing { device: Device::Cpu, dtype: DType::F32, warmup: 1, repeats: 2 }
    }

    /// A bench's spec from its command-line options (the others at their defaults).
    pub(crate) fn parse<T: clap::Args + clap::FromArgMatches>(args: &[&str]) -> T {
        let matches = T::augment_args(clap::Command::new("bench")).get_matches_from([&["bench"], args].concat());
        T::from_arg_matches(&matches).unwrap()
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
