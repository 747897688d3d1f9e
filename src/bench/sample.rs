//! `grpo bench sample`: picking the next token (temperature, top-k, top-p) on the device against the
//! full-sort reference on the host.

use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::harness::{median, time_runs, Result, Timing};
use crate::device::device_name;
use crate::eval::{sample_rows, sample_token_reference, SamplingParams};

/// Sampling settings of [`sample`] (`grpo bench sample`).
#[derive(Debug, Clone, clap::Args)]
pub struct SampleSpec {
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Rows per timed run (one per sequence of a generation batch).
    #[arg(long, default_value_t = 32)]
    pub rows: usize,
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
}

/// Time to pick one token per row of `[rows, vocab]` logits (normal, std 3) on the device, copying back
/// only the ids ([`crate::eval::sample_rows`]), against the full-sort reference on the host after copying
/// the logits there. Both draw with the same uniforms, so they pick the same tokens but for a uniform
/// within float rounding of a boundary (`picks_differing`).
pub fn sample(spec: &SampleSpec, t: &Timing) -> Result<Value> {
    use rayon::prelude::*;
    let params = SamplingParams {
        temperature: spec.temperature,
        top_p: spec.top_p,
        top_k: spec.top_k,
        ..SamplingParams::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    let flat: Vec<f32> =
        (0..spec.rows * spec.vocab).map(|_| 3.0 * crate::model::load::sample_normal(&mut rng)).collect();
    let logits = Tensor::from_vec(flat, (spec.rows, spec.vocab), &t.device)?;
    let uniforms: Vec<f64> = (0..spec.rows).map(|_| rng.gen::<f64>()).collect();
    let as_f32: Vec<f32> = uniforms.iter().map(|&u| u as f32).collect();
    let (ours, picks) = time_runs(t, || Ok(crate::device::to_host::<u32>(&sample_rows(&logits, &params, &as_f32)?)?))?;
    let (reference, ref_picks) = time_runs(t, || {
        let rows = logits.to_vec2::<f32>()?;
        Ok(rows
            .par_iter()
            .zip(&uniforms)
            .map(|(row, &u)| sample_token_reference(row, &params, u))
            .collect::<Vec<u32>>())
    })?;
    let differ = picks.last().zip(ref_picks.last()).map_or(0, |(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count());
    let per_row = |times: &[f64]| median(times) / spec.rows.max(1) as f64;
    Ok(json!({
        "bench": "sample",
        "impl": "grpo",
        "device": device_name(&t.device),
        "vocab": spec.vocab,
        "rows": spec.rows,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "us_per_row": per_row(&ours) * 1e6,
        "reference_us_per_row": per_row(&reference) * 1e6,
        "speedup": per_row(&reference) / per_row(&ours),
        "picks_differing": differ,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::cpu;

    #[test]
    fn sampling_agrees_with_the_reference() {
        let spec = SampleSpec { vocab: 3000, rows: 4, temperature: 0.6, top_p: 0.95, top_k: 0 };
        let r = sample(&spec, &cpu()).unwrap();
        assert!(r["speedup"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["picks_differing"], 0, "{r}");
    }
}
