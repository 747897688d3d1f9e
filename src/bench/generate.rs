//! `grpo bench generate`: greedy generation with the KV cache on random weights, never stopping early.

use std::path::PathBuf;

use rand::SeedableRng;
use serde_json::Value;

use super::harness::{
    dtype_name, load_shape, median, random_ids, random_model, shape_name, time_runs, to_record, BenchError, Result,
    Timing,
};
use crate::device::device_name;

/// Generation settings (`grpo bench generate`).
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateSpec {
    /// HF config.json of the model shape; weights are random.
    #[arg(long)]
    pub shape: PathBuf,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// The fused RMSNorm/rope/softmax kernels; --composite-ops uses candle's composite ops instead.
    #[arg(long = "composite-ops", action = clap::ArgAction::SetFalse)]
    pub fused_ops: bool,
}

/// Greedy generation of exactly `new_tokens` per row (no stop token) from random prompts.
pub fn generate(spec: &GenerateSpec, t: &Timing) -> Result<Value> {
    use crate::eval::{generate as run_generate, SamplingParams};
    let cfg = load_shape(&spec.shape)?;
    let vocab = cfg.vocab_size;
    let mut model = random_model(cfg, t, false)?;
    model.options.fused_ops = spec.fused_ops;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let prompts: Vec<Vec<u32>> = (0..spec.batch).map(|_| random_ids(&mut rng, spec.prompt_len, vocab)).collect();
    let ids: Vec<u64> = (0..spec.batch as u64).collect();
    let params = SamplingParams { max_new_tokens: spec.new_tokens, ..SamplingParams::default() };
    let (times, outs) = time_runs(t, || {
        let g = run_generate(&model, &prompts, &ids, &params, &[], 0, |_| {})?;
        Ok(g.iter().map(|g| g.tokens.len()).sum::<usize>())
    })?;
    let produced = outs.first().copied().unwrap_or(0);
    if produced != spec.batch * spec.new_tokens {
        return Err(BenchError::Invalid(format!(
            "generated {produced} tokens, expected {} x {}",
            spec.batch, spec.new_tokens
        )));
    }
    let time = median(&times);
    to_record(GenerateRecord {
        bench: "generate",
        implementation: "grpo",
        shape: shape_name(&spec.shape),
        batch: spec.batch,
        prompt_len: spec.prompt_len,
        new_tokens: spec.new_tokens,
        fused_ops: spec.fused_ops,
        dtype: dtype_name(t.dtype),
        device: device_name(&t.device),
        time_s: time,
        tokens_per_s: produced as f64 / time,
    })
}

/// `grpo bench generate`'s record: the median time of the batch's generation and its new tokens a second.
#[derive(Debug, serde::Serialize)]
struct GenerateRecord {
    bench: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    shape: String,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    fused_ops: bool,
    dtype: &'static str,
    device: String,
    time_s: f64,
    tokens_per_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::{cpu, tiny_shape};

    #[test]
    fn generation_produces_every_token() {
        let dir = tempfile::tempdir().unwrap();
        let spec =
            GenerateSpec { shape: tiny_shape(dir.path()), batch: 3, prompt_len: 5, new_tokens: 4, fused_ops: false };
        let r = generate(&spec, &cpu()).unwrap();
        assert_eq!(r["batch"], 3);
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
}
